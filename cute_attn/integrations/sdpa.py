"""``F.scaled_dot_product_attention``'s flash backend on cute_attn's kernels.

    import cute_attn, torch.nn.attention as attention
    attention.activate_flash_attention_impl("cute_attn")   # SDPA's flash backend now runs cute_attn
    attention.restore_flash_attention_impl()                # back to torch's own

``import cute_attn`` registers the name with torch's flash-implementation registry
(``torch.nn.attention.register_flash_attention_impl``; torch 2.13 checked on the CPU; on older
torch, ``register()`` returns False and nothing changes). Activation overrides the CUDA kernels of
``aten::_scaled_dot_product_flash_attention`` and ``aten::_flash_attention_forward`` and their
backwards, which SDPA's flash backend and ``torch.nn.attention.varlen`` call. A call cute_attn
cannot serve (dropout, a debug mask, variable-length ``cu_seq`` batches, sliding windows, ALiBi,
paged or split KV, causal with seqlen_q != seqlen_k (SDPA aligns that mask top-left, cute_attn
bottom-right), inputs cute_attn's checks reject, an unsupported GPU) runs torch's own kernel,
looked up with ``torch.library.get_kernel`` before the override: no error, same results as before.
The backward is deterministic when ``torch.use_deterministic_algorithms(True)`` is on.
"""

from __future__ import annotations

import torch

NAME = "cute_attn"
_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_flash_attention_forward",
    "_flash_attention_backward",
)


def register() -> bool:
    """Register ``"cute_attn"`` with torch's flash-implementation registry (not activated)."""
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl"):
        return False
    attention.register_flash_attention_impl(NAME, register_fn=activate)
    return True


class _Handle:
    """What the registry keeps while cute_attn is active; ``remove`` restores torch's kernels."""

    def __init__(self, library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def activate() -> _Handle:
    """Override the flash ops' CUDA kernels (the registry calls this; use
    ``torch.nn.attention.activate_flash_attention_impl("cute_attn")``)."""
    originals = {name: _original_kernel(name) for name in _OPS}
    library = torch.library.Library("aten", "IMPL", "CUDA")
    impls = {
        "_scaled_dot_product_flash_attention": _sdpa_forward,
        "_scaled_dot_product_flash_attention_backward": _sdpa_backward,
        "_flash_attention_forward": _flash_forward,
        "_flash_attention_backward": _flash_backward,
    }
    for name, impl in impls.items():
        library.impl(name, _with_fallback(impl, originals[name], name), "CUDA", with_keyset=True)
    return _Handle(library)


def _original_kernel(name: str):
    try:
        return torch.library.get_kernel(f"aten::{name}", "CUDA")
    except (AttributeError, RuntimeError):  # older torch, or a build without CUDA kernels
        return None


class _Unsupported(Exception):
    """A call cute_attn does not serve; the message says why."""


def _with_fallback(impl, original, name: str):
    def kernel(keyset, *args, **kwargs):
        try:
            return impl(*args, **kwargs)
        except _Unsupported as why:
            if original is None:
                raise RuntimeError(f"cute_attn cannot run aten::{name} here ({why}) and torch's own "
                                   f"kernel could not be found") from None
            return original.call_boxed(keyset, *args, **kwargs)

    return kernel


# option values that ask for nothing cute_attn lacks (None always qualifies)
_NEUTRAL = {"return_debug_mask": (False,), "window_size_left": (-1,), "window_size_right": (-1,),
            "num_splits": (0, 1)}


def unsupported_reason(q, k, v, causal: bool, dropout_p: float = 0.0, top_left_causal: bool = False,
                       scale: float | None = None, **options) -> str | None:
    """Why cute_attn cannot run attention on (batch, seqlen, heads, head_dim) views q, k, v with
    these SDPA/flash options (None: it can). Every other option must be None or neutral: a tensor
    (cu_seq, seqused_k, alibi_slopes, block_table) or a real window asks for what cute_attn lacks."""
    from cute_attn import dispatch, interface

    if dropout_p:
        return "dropout"
    for name, value in options.items():
        if value is not None and (isinstance(value, torch.Tensor) or value not in _NEUTRAL.get(name, ())):
            return f"{name} given"
    if causal and top_left_causal and q.shape[1] != k.shape[1]:
        return "causal with seqlen_q != seqlen_k (SDPA aligns that mask top-left, cute_attn bottom-right)"
    try:
        interface._check_qkv(q, k, v)
        interface._softmax_scale(scale, q.shape[3])
        interface._check_cuda("q", q)
        dispatch.plan_for_device(q.device)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def _bshd(*tensors):
    return tuple(t.transpose(1, 2) for t in tensors)


def _require(reason):
    if reason is not None:
        raise _Unsupported(reason)


def _forward(q, k, v, causal, scale, out=None):
    from cute_attn import interface

    return interface.forward(q, k, v, causal=causal, softmax_scale=scale, out=out, return_lse=True)


def _backward(grad_out, q, k, v, out, lse, causal, scale):
    from cute_attn import interface

    try:
        interface._check_lse(lse, q)
    except (TypeError, ValueError) as e:  # an LSE from another kernel's forward
        raise _Unsupported(str(e)) from None
    return interface.backward(interface._grad_ready(grad_out), q, k, v, out, lse, causal=causal,
                              softmax_scale=scale, deterministic=torch.are_deterministic_algorithms_enabled())


def _rng_placeholders(device):
    # no dropout: the RNG state outputs only have to exist
    return torch.zeros((2,), dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device)


# ---------------------------------------------------------------- SDPA: (batch, heads, seqlen, head_dim)
def _sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    q, k, v = _bshd(query, key, value)
    _require(unsupported_reason(q, k, v, is_causal, dropout_p, True, scale, return_debug_mask=return_debug_mask))
    # torch's flash kernel returns the output as a (batch, heads, seqlen, d) view of (b, s, h, d) memory
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    out, lse = _forward(q, k, v, is_causal, scale, out)
    rng_state, unused = _rng_placeholders(q.device)
    debug = torch.empty(0, dtype=q.dtype, device=q.device)
    return out.transpose(1, 2), lse, None, None, q.shape[1], k.shape[1], rng_state, unused, debug


def _sdpa_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                   dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    q, k, v, o, go = _bshd(query, key, value, out, grad_out)
    _require(unsupported_reason(q, k, v, is_causal, dropout_p, True, scale, cum_seq_q=cum_seq_q, cum_seq_k=cum_seq_k))
    dq, dk, dv = _backward(go, q, k, v, o, logsumexp, is_causal, scale)
    return _bshd(dq, dk, dv)


# ---------------------------------------------------------------- flash API: (batch, seqlen, heads, head_dim)
def _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                   return_debug_mask, **options):
    scale = options.pop("scale", None)
    _require(unsupported_reason(query, key, value, is_causal, dropout_p, False, scale, cum_seq_q=cum_seq_q,
                                cum_seq_k=cum_seq_k, return_debug_mask=return_debug_mask, **options))
    out, lse = _forward(query, key, value, is_causal, scale)
    rng_state, unused = _rng_placeholders(query.device)
    return out, lse, rng_state, unused, torch.empty(0, dtype=query.dtype, device=query.device)


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                    dropout_p, is_causal, rng_state, unused, **options):
    scale = options.pop("scale", None)
    _require(unsupported_reason(query, key, value, is_causal, dropout_p, False, scale, cum_seq_q=cum_seq_q,
                                cum_seq_k=cum_seq_k, **options))
    return _backward(grad_out, query, key, value, out, logsumexp, is_causal, scale)
