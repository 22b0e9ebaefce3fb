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
    round_operands: bool = False,
    out: torch.Tensor | None = None,
    precision: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in float64, written out as FlashAttention's backward computes them:
    dS = P * (dP - D) with D = rowsum(dO * O). With ``round_out`` O is first rounded to q's dtype,
    because the backward reads the O the forward stored. In a row that sees few keys dP - D cancels,
    and the rounding of O alone then moves a gradient element by several units in its last place,
    which autograd through ``attention_reference`` (it never rounds O) does not show.
    ``round_operands``: P and dS also rounded to q's dtype before the products that take them
    (dV = P^T dO, dK = dS^T Q, dQ = dS K), as every FlashAttention kernel feeds its tensor cores;
    in those few-key rows that rounding of dS alone can move dq and dk by a few units too.
    ``out``: the O to compute D from (a kernel's forward output, which the backward reads), in
    place of the reference's own (rounded per ``round_out``). ``precision``: the arithmetic
    (float32: the kernels' accumulators, whose summation order alone leaves dP - D a little off
    zero where it cancels exactly, as in a row with one key)."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads // heads_kv
    qd, dod = q.to(precision), dout.to(precision)
    kd, vd = (t.to(precision).repeat_interleave(group, dim=2) for t in (k, v))
    scores, tanh = _scores(qd, kd, scale, seqlen_q, seqlen_k, causal, tuple(window_size), softcap, alibi_slopes)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0)).nan_to_num(0.0)
    if out is not None:
        out = out.to(precision)
    else:
        out = torch.einsum("bhqk,bkhd->bqhd", probs, vd)
        if round_out:
            out = out.to(q.dtype).to(precision)
    return _flash_gradients(probs, out, qd, kd, vd, dod, scale, heads_kv, tanh,
                            operand_dtype=q.dtype if round_operands else None)


def _flash_gradients(probs, out, qd, kd, vd, dod, scale, heads_kv, tanh=None, operand_dtype=None):
    """FlashAttention's backward from P (batch, heads, seqlen_q, seqlen_k) and O, all float64 (or all
    of one precision), K/V
    already repeated per query head: D = rowsum(dO * O), dS = P * (dP - D) (through the softcap's
    tanh when given); dK and dV summed over each K/V head's group of query heads. ``operand_dtype``:
    P and dS rounded to it before the products that take them."""
    batch, seqlen_k, heads, head_dim = kd.shape
    delta = (dod * out).sum(-1).transpose(1, 2)  # (batch, heads, seqlen_q)
    dscores = probs * (torch.einsum("bqhd,bkhd->bhqk", dod, vd) - delta[..., None])
    if tanh is not None:  # through softcap * tanh(s / softcap)
        dscores = dscores * (1 - tanh * tanh)
    if operand_dtype is not None:
        probs, dscores = (t.to(operand_dtype).to(probs.dtype) for t in (probs, dscores))
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
    (alibi_slopes of shape (batch, heads) give sequence b its row), and ``seqused_k`` (batch,):
    sequence b attends to its first seqused_k[b] keys only (FlashAttention-3)."""
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
    slopes = options.pop("alibi_slopes", None)
    seqused_k = options.pop("seqused_k", None)
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if seqused_k is not None:
            k1 = k0 + int(seqused_k[b])
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
    window_size: tuple[int, int] = (-1, -1),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernels' contract: (dq, dk, dv) from given out and lse, which may come from a
    larger attention (all keys of a ring, say): P = exp(S * scale - lse), D = rowsum(dO * out),
    dS = P * (dP - D) (with ``softcap``: the capped scores, dS through the tanh; pairs outside
    ``window_size`` masked). For the out and lse of these q, k, v alone it is the plain backward;
    for a slice of the keys it gives that slice's exact share. In q's dtype, computed in float64."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads // heads_kv
    qd, dod, od = q.double(), dout.double(), out.double()
    kd, vd = (t.double().repeat_interleave(group, dim=2) for t in (k, v))
    scores, tanh = _scores(qd, kd, scale, seqlen_q, seqlen_k, causal, tuple(window_size), softcap, None)
    lse_d = lse.double().masked_fill(torch.isinf(lse), math.inf)[..., None]  # +inf rows: P = 0
    probs = torch.exp(scores - lse_d).nan_to_num(0.0)
    dq, dk, dv = _flash_gradients(probs, od, qd, kd, vd, dod, scale, heads_kv, tanh)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def apply_rotary_reference(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """Rotary embedding as FlashAttention's kernels apply it: x (batch, seqlen, heads, d), cos/sin
    (seqlen_ro, rotary_dim / 2), ``positions`` (batch, seqlen) integers: token (b, i) is rotated by
    the angle of row positions[b, i]. ``interleaved``: the pairs (0, 1), (2, 3), ...; otherwise
    (GPT-NeoX) the pairs (j, j + rotary_dim / 2). Columns >= rotary_dim are left as they are.
    Computed in float32 (cos/sin, x read in float32) and rounded to x's dtype once, at the end, as
    the kernels do before the rotated q or k enter the cache or the matmul."""
    half = cos.shape[-1]
    rotary_dim = 2 * half
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} > head dim {x.shape[-1]}")
    idx = positions.to(device=cos.device, dtype=torch.long)
    c = cos.float()[idx][:, :, None, :].to(x.device)  # (batch, seqlen, 1, rotary_dim / 2)
    s = sin.float()[idx][:, :, None, :].to(x.device)
    xf = x.float()
    rot = xf[..., :rotary_dim]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    y1 = x1 * c - x2 * s
    y2 = x1 * s + x2 * c
    rotated = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
    return torch.cat((rotated, xf[..., rotary_dim:]), dim=-1).to(x.dtype)


def attention_kvcache_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | int | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention-2's ``flash_attn_with_kvcache``, one sequence at a time. Returns (out, lse,
    k_cache_after, v_cache_after): out (batch, seqlen_q, heads, d) in ``compute_dtype`` (float32
    by default), lse (batch, heads, seqlen_q) float32 (natural log, +inf and out 0 for a query that
    sees no key), and copies of the caches with k/v appended; the inputs are not modified.

    - caches (batch_cache, seqlen_cache, heads_kv, d), or with ``block_table`` (batch, max_pages)
      paged: (num_pages, page_size, heads_kv, d), position p of sequence b at page
      block_table[b, p // page_size], row p % page_size.
    - cache_seqlens None (the whole cache: seqlen_cache, or max_pages * page_size), an int, or
      (batch,) integers. Row b of a contiguous cache is cache_batch_idx[b] (default b).
    - k/v (batch, seqlen_new, heads_kv, d): written at positions cache_seqlens[b] + i (k rotated
      first), then attended to. Sequence b's keys are positions [cache_leftpad[b],
      cache_seqlens[b] + seqlen_new); causal, window and ALiBi distances count from cache_leftpad
      (bottom-right aligned over those keys).
    - rotary (needs k): new key i rotated at position cache_seqlens[b] + i; query i at
      cache_seqlens[b] + i when causal or a local window, else every query at cache_seqlens[b].
      FlashAttention-2 drops a window side >= the cache capacity before deciding "local"
      (flash_api.cpp, mha_fwd_kvcache), which only changes the rotary positions here: the mask of a
      side that long hides nothing.
    - rotated q and k rounded to their dtype (the kernels rotate in float32 and store the dtype).
    ``compute_dtype`` other than float32 gives the "same-dtype PyTorch" baseline of the tests."""
    batch, seqlen_q, heads, head_dim = q.shape
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None and k is None:
        raise ValueError("rotary_cos/rotary_sin need the new k and v to append")
    if k is not None and cache_seqlens is None:
        raise ValueError("appending k/v needs cache_seqlens")
    paged = block_table is not None
    if paged and (cache_batch_idx is not None or cache_leftpad is not None):
        raise ValueError("block_table cannot be combined with cache_batch_idx or cache_leftpad")
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if paged else k_cache.shape[1]
    seqlen_new = 0 if k is None else k.shape[1]
    if cache_seqlens is None:
        lengths = [capacity] * batch
    elif isinstance(cache_seqlens, int):
        lengths = [cache_seqlens] * batch
    else:
        lengths = [int(n) for n in cache_seqlens.tolist()]
    leftpad = [int(n) for n in cache_leftpad.tolist()] if cache_leftpad is not None else [0] * batch
    rows = [int(n) for n in cache_batch_idx.tolist()] if cache_batch_idx is not None else list(range(batch))
    table = block_table.long().cpu() if paged else None
    for b in range(batch):
        if not 0 <= leftpad[b] <= lengths[b] + seqlen_new <= capacity:
            raise ValueError(f"sequence {b}: keys [{leftpad[b]}, {lengths[b] + seqlen_new}) outside the cache "
                             f"(capacity {capacity})")

    if rotary_cos is not None:
        left, right = window_size
        local = (0 <= left < capacity) or (0 <= right < capacity)
        starts = torch.tensor(lengths, dtype=torch.long)[:, None]
        q_steps = torch.arange(seqlen_q)[None, :] if causal or local else torch.zeros(1, seqlen_q, dtype=torch.long)
        q = apply_rotary_reference(q, rotary_cos, rotary_sin, starts + q_steps, rotary_interleaved)
        k = apply_rotary_reference(k, rotary_cos, rotary_sin, starts + torch.arange(seqlen_new)[None, :],
                                   rotary_interleaved)

    def index(b, start, stop):
        """Cache indices (first two dims) of positions [start, stop) of sequence b."""
        pos = torch.arange(start, stop)
        if paged:
            at = table[b, pos // page_size], pos % page_size
        else:
            at = torch.full_like(pos, rows[b]), pos
        return tuple(i.to(k_cache.device) for i in at)

    k_after, v_after = k_cache.clone(), v_cache.clone()
    if k is not None:
        for b in range(batch):
            at = index(b, lengths[b], lengths[b] + seqlen_new)
            k_after[at] = k[b].to(k_after.dtype)
            v_after[at] = v[b].to(v_after.dtype)

    out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    lse = torch.full((batch, heads, seqlen_q), float("inf"), dtype=torch.float32, device=q.device)
    for b in range(batch):
        at = index(b, leftpad[b], lengths[b] + seqlen_new)
        keys, values = k_after[at][None], v_after[at][None]
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        o, l = attention_reference(q[b:b + 1].to(compute_dtype), keys.to(compute_dtype), values.to(compute_dtype),
                                   causal, softmax_scale, compute_dtype, window_size=tuple(window_size),
                                   softcap=softcap, alibi_slopes=slopes)
        out[b], lse[b] = o[0], l[0].float()
    return out, lse, k_after, v_after
