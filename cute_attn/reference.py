"""Plain-torch attention with cute_attn's conventions, for tests and checks.

- q (batch, seqlen_q, heads, d), k/v (batch, seqlen_k, heads_kv, d); heads % heads_kv == 0 and
  query head h reads K/V head h // (heads // heads_kv).
- causal is bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
- FlashAttention's options, with its semantics: ``window_size=(left, right)`` (-1: unbounded)
  keeps the keys j with i' - left <= j <= i' + right, i' = i + seqlen_k - seqlen_q (causal sets
  right = 0); ``softcap > 0`` maps each scaled score s to softcap * tanh(s / softcap);
  ``alibi_slopes`` (heads,) or (batch, heads) adds -slope * |i' - j| after that.
- ``attention_varlen_reference``: sequences packed along one dim, delimited by cu_seqlens.
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


def visible_keys(seqlen_q: int, seqlen_k: int, causal: bool = False, window_size=(-1, -1),
                 device=None) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: True where query i may see key j (bottom-right aligned window)."""
    left, right = window_size
    if causal:
        right = 0
    diagonal = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=device)[None, :]
    seen = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        seen &= j >= diagonal - left
    if right >= 0:
        seen &= j <= diagonal + right
    return seen


def _scores(qc, kc, scale, seqlen_q, seqlen_k, causal, window_size, softcap, alibi_slopes):
    """Scaled, capped, biased and masked scores (batch, heads, seqlen_q, seqlen_k), and the capped
    scores' tanh (for the backward; None without softcap)."""
    scores = torch.einsum("bqhd,bkhd->bhqk", qc, kc).to(torch.float64 if qc.dtype == torch.float64 else torch.float32)
    scores = scores * scale
    tanh = None
    if softcap > 0:
        tanh = torch.tanh(scores / softcap)
        scores = softcap * tanh
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype)
        slopes = slopes.view(1, -1, 1, 1) if slopes.dim() == 1 else slopes.view(slopes.shape[0], -1, 1, 1)
        i = torch.arange(seqlen_q, device=qc.device)[:, None] + (seqlen_k - seqlen_q)
        j = torch.arange(seqlen_k, device=qc.device)[None, :]
        scores = scores - slopes * (i - j).abs().to(scores.dtype)
    if causal or window_size != (-1, -1):
        seen = visible_keys(seqlen_q, seqlen_k, causal, window_size, qc.device)
        scores = scores.masked_fill(~seen, float("-inf"))
    return scores, tanh


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads // heads_kv
    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    kc = kc.repeat_interleave(group, dim=2)
    vc = vc.repeat_interleave(group, dim=2)
    scores, _ = _scores(qc, kc, scale, seqlen_q, seqlen_k, causal, tuple(window_size), softcap, alibi_slopes)
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
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
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
    scores, tanh = _scores(qd, kd, scale, seqlen_q, seqlen_k, causal, tuple(window_size), softcap, alibi_slopes)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0)).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vd)
    if round_out:
        out = out.to(q.dtype).double()
    return _flash_gradients(probs, out, qd, kd, vd, dod, scale, heads_kv, tanh)


def _flash_gradients(probs, out, qd, kd, vd, dod, scale, heads_kv, tanh=None):
    """FlashAttention's backward from P (batch, heads, seqlen_q, seqlen_k) and O, all float64, K/V
    already repeated per query head: D = rowsum(dO * O), dS = P * (dP - D) (through the softcap's
    tanh when given); dK and dV summed over each K/V head's group of query heads."""
    batch, seqlen_k, heads, head_dim = kd.shape
    delta = (dod * out).sum(-1).transpose(1, 2)  # (batch, heads, seqlen_q)
    dscores = probs * (torch.einsum("bqhd,bkhd->bhqk", dod, vd) - delta[..., None])
    if tanh is not None:  # through softcap * tanh(s / softcap)
        dscores = dscores * (1 - tanh * tanh)
    dq = torch.einsum("bhqk,bkhd->bqhd", dscores, kd) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", dscores, qd) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", probs, dod)
    group = heads // heads_kv
    dk, dv = (t.view(batch, seqlen_k, heads_kv, group, head_dim).sum(3) for t in (dk, dv))
    return dq, dk, dv


def attention_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length batches, FlashAttention's varlen layout: q (total_q, heads, d), k/v
    (total_k, heads_kv, d); sequence b holds rows cu_seqlens[b]:cu_seqlens[b + 1] (int32, batch + 1
    entries). Returns out like q and lse (heads, total_q). ``options``: as ``attention_reference``
    (alibi_slopes of shape (batch, heads) give sequence b its row)."""
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
    slopes = options.pop("alibi_slopes", None)
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if q1 == q0:
            continue
        sequence_slopes = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
        o, l = attention_reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, softmax_scale,
                                   compute_dtype, alibi_slopes=sequence_slopes, **options)
        out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def attention_block_backward_reference(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernels' contract: (dq, dk, dv) from given out and lse, which may come from a
    larger attention (all keys of a ring, say): P = exp(S * scale - lse), D = rowsum(dO * out),
    dS = P * (dP - D) (with ``softcap``: the capped scores, dS through the tanh). For the out and lse of these q, k, v alone it is the plain backward; for a
    slice of the keys it gives that slice's exact share. In q's dtype, computed in float64."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads // heads_kv
    qd, dod, od = q.double(), dout.double(), out.double()
    kd, vd = (t.double().repeat_interleave(group, dim=2) for t in (k, v))
    scores, tanh = _scores(qd, kd, scale, seqlen_q, seqlen_k, causal, (-1, -1), softcap, None)
    lse_d = lse.double().masked_fill(torch.isinf(lse), math.inf)[..., None]  # +inf rows: P = 0
    probs = torch.exp(scores - lse_d).nan_to_num(0.0)
    dq, dk, dv = _flash_gradients(probs, od, qd, kd, vd, dod, scale, heads_kv, tanh)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
