"""cute_attn: exact FlashAttention for PyTorch, written in the CUTLASS Python DSL (CuTe DSL).

    import cute_attn
    out = cute_attn.forward(q, k, v, causal=True)            # (batch, seqlen, heads, head_dim)
    out, lse = cute_attn.forward(q, k, v, return_lse=True)
    out = cute_attn.flash_attn_func(q, k, v, causal=True); out.sum().backward()
    out = cute_attn.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = cute_attn.flash_attn_qkvpacked_func(qkv, causal=True)  # qkv (batch, seqlen, 3, heads, head_dim)
    out = cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens)  # decode
"""

from cute_attn.integrations import custom_ops  # noqa: F401  registers torch.ops.cute_attn.fwd / bwd
from cute_attn.dispatch import force_arch
from cute_attn.integrations import sdpa as _sdpa
from cute_attn.interface import (
    backward,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    forward,
    varlen_backward,
    varlen_forward,
)
from cute_attn.reference import attention_reference

_sdpa.register()  # torch.nn.attention.activate_flash_attention_impl("cute_attn"); not activated here

__version__ = "0.1.0"
__all__ = [
    "forward", "backward", "varlen_forward", "varlen_backward", "flash_attn_func", "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache", "force_arch", "attention_reference", "__version__",
]
