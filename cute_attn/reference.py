"""Plain-torch attention with cute_attn's conventions, for tests and checks.

- q (batch, seqlen_q, heads, d), k/v (batch, seqlen_k, heads_kv, d); heads % heads_kv == 0 and
  query head h reads K/V head h // (heads // heads_kv).
- causal is bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
- returns out (like q) and lse (batch, heads, seqlen_q), float32, natural log.
- a query that sees no key gets out = 0 and lse = +inf (FlashAttention's convention).

``compute_dtype=torch.float32`` (default) is the accurate reference; passing the inputs' own dtype
gives a "same-dtype PyTorch attention" whose error against the fp32 reference sets the tolerance.
``attention_backward_reference`` gives the gradients as FlashAttention's backward defines them,
from the output rounded to the input dtype (the backward tests allow its error too).
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


def attention_backward_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    round_out: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in float64, written out as FlashAttention's backward computes them:
    dS = P * (dP - D) with D = rowsum(dO * O). With ``round_out`` O is first rounded to q's dtype,
    because the backward reads the O the forward stored. In a row that sees few keys dP - D cancels,
    and the rounding of O alone then moves a gradient element by several units in its last place,
    which autograd through ``attention_reference`` (it never rounds O) does not show."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads // heads_kv
    qd, dod = q.double(), dout.double()
    kd, vd = (t.double().repeat_interleave(group, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if causal:
        scores = scores.masked_fill(~causal_visible(seqlen_q, seqlen_k, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0)).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vd)
    if round_out:
        out = out.to(q.dtype).double()
    delta = (dod * out).sum(-1).transpose(1, 2)  # (batch, heads, seqlen_q)
    dscores = probs * (torch.einsum("bqhd,bkhd->bhqk", dod, vd) - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", dscores, kd) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", dscores, qd) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", probs, dod)
    # K/V heads shared by a group of query heads collect the group's gradients
    dk, dv = (t.view(batch, seqlen_k, heads_kv, group, head_dim).sum(3) for t in (dk, dv))
    return dq, dk, dv
