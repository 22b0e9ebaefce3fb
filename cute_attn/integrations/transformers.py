"""Hugging Face transformers: ``attn_implementation="cute_attn"``.

    import cute_attn.integrations.transformers  # registers "cute_attn"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cute_attn", dtype=torch.bfloat16)

Importing this module registers ``attention_forward`` with transformers' ``AttentionInterface`` and
SDPA's mask function with its ``AttentionMaskInterface`` under the name ``"cute_attn"``: the model
builds the same masks as with ``"sdpa"``, which are None whenever plain causal (or full)
attention is exact, and then cute_attn's kernels run (GQA without repeating K/V, training through
``flash_attn_func``; logit softcapping, as Gemma 2 asks, included). Whatever cute_attn cannot serve (an
explicit mask: padding, packing or a sliding window's; dropout; position biases; paged caches; fp32
models; CPU tensors) goes to
transformers' own SDPA attention, so every model works and only the speed differs.
transformers is an optional dependency: ``pip install cute-attn[transformers]``.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import cute_attn

NAME = "cute_attn"
_DTYPES = (torch.float16, torch.bfloat16)


def declined(module, query, key, attention_mask, dropout: float, kwargs) -> str | None:
    """Why this call goes to SDPA instead (None: cute_attn runs it)."""
    if attention_mask is not None:
        return "an explicit attention mask"
    if dropout:
        return "attention dropout"
    for name in ("sliding_window", "position_bias", "cache"):
        if kwargs.get(name) is not None:
            return name
    if kwargs.get("output_attentions"):
        return "output_attentions"
    if query.dtype not in _DTYPES or not query.is_cuda:
        return "not a CUDA fp16/bf16 tensor"
    head_dim, heads, heads_kv = query.shape[3], query.shape[1], key.shape[1]
    if head_dim % 8 or head_dim > 256 or key.shape[3] != head_dim or heads % heads_kv:
        return "head dims or head counts cute_attn does not run"
    return None


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query (batch, heads, q_len, d), key/value (batch,
    heads_kv, kv_len, d); returns ((batch, q_len, heads, d), None)."""
    if declined(module, query, key, attention_mask, dropout, kwargs) is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and q_len > 1  # one query token (decoding) sees every key
    if causal and kv_len > q_len:
        # as with SDPA: a mask-free causal call with more keys than queries is a prefill into an
        # empty static cache, whose keys past q_len are unwritten slots
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = cute_attn.flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                    causal=causal, softmax_scale=scaling, softcap=float(kwargs.get("softcap") or 0.0))
    return out, None


def register() -> None:
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
