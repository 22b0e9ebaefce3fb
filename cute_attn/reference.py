"""Plain-torch attention with cute_attn's conventions, for tests and checks.

- q (batch, seqlen_q, heads, d), k/v (batch, seqlen_k, heads_kv, d); heads % heads_kv == 0 and
  query head h reads K/V head h // (heads // heads_kv).
- causal is bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
- returns out (like q) and lse (batch, heads, seqlen_q), float32, natural log.
- a query that sees no key gets out = 0 and lse = +inf (FlashAttention's convention).

``compute_dtype=torch.float32`` (default) is the accurate reference; passing the inputs' own dtype
gives a "same-dtype PyTorch attention" whose error against the fp32 reference sets the tolerance.
"""

from __future__ import annotations

import math

import torch


def causal_visible(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: True where query i may see key j (bottom-right aligned)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads // heads_kv
    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    kc = kc.repeat_interleave(group, dim=2)
    vc = vc.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qc, kc).float() * scale
    if causal:
        scores = scores.masked_fill(~causal_visible(seqlen_q, seqlen_k, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0)[..., None])
    probs = probs.masked_fill(empty[..., None], 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs.to(compute_dtype), vc)
    return out.to(q.dtype), lse.masked_fill(empty, float("inf"))
