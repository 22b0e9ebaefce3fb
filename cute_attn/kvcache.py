"""KV-cache decode, host side: argument checks, the rotary embedding and the in-place cache append.

No kernel code here. ``check_kvcache_args`` validates a ``flash_attn_with_kvcache`` call the way
FlashAttention-2's ``mha_fwd_kvcache`` does (every check before anything is launched; a ValueError
or TypeError naming the argument, what was given and what is expected; the CUDA-device check last,
so every other error can be tested on CPU) and returns a ``KVCachePlan``. ``append_kv`` and
``rotate_q`` are plain torch on the device: no host synchronisation and no data-dependent shapes,
so a decode step can be captured in a CUDA graph and replayed with new cache_seqlens values.

Left to the caller, as FlashAttention-2 does (checking them would synchronise with the GPU):
cache_seqlens[b] + seqlen_new <= cache_len and cache_leftpad[b] <= cache_seqlens[b] for each
sequence; cache_batch_idx entries in [0, batch_cache) and distinct when k/v are appended;
block_table page ids in [0, num_pages), and the pages a call writes not shared by two sequences;
with rotary, q's positions (up to cache_seqlens[b] + seqlen_q - 1 when causal or local) below
seqlen_ro. Out of range, a gather or a cache write is a device-side assert on CUDA, not an error here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from cute_attn import compile as compile_mod
from cute_attn import dispatch
from cute_attn.interface import _check_cuda, _check_int32, _check_kind, _check_layout
from cute_attn.traits import MAX_HEAD_DIM


@dataclass(frozen=True, eq=False)
class KVCachePlan:
    """A validated ``flash_attn_with_kvcache`` call: sizes, and the int32 tensors as the kernels read them."""

    batch: int
    seqlen_q: int
    heads: int
    heads_kv: int
    head_dim: int
    seqlen_new: int  # rows of k/v appended (0 without k)
    paged: bool
    page_size: int  # keys per page (0 unless paged)
    cache_len: int  # rows one sequence can hold: seqlen_cache, or max_pages * page_size when paged
    rotary_dim: int  # columns rotated (0 without rotary)
    rotary_interleaved: bool
    num_splits: int  # as given: 0 = heuristic, 1 = no split, n > 1 = n
    max_seqlen_k: int  # host-side bound on the keys one sequence attends (cache_len, or int cache_seqlens + seqlen_new)
    cache_seqlens: torch.Tensor  # (batch,) int32 on q's device; from an int or None a shared cached tensor: read only
    cache_batch_idx: torch.Tensor | None  # (batch,) int32, or None
    cache_leftpad: torch.Tensor | None  # (batch,) int32, or None
    block_table: torch.Tensor | None  # (batch, max_pages) int32, last dim contiguous (paged), or None


# ---------------------------------------------------------------------------- device constants
# small read-only int tensors of the per-call path (cache_seqlens from an int, aranges), built once
_CONSTANTS: dict = {}
_MAX_CONSTANTS = 1024


def _constant(key: tuple, device: torch.device, make):
    """``make()`` cached under (key, device). Nothing is cached or reused while the current CUDA
    stream is being captured: a tensor filled during a capture holds its values only once the graph
    is replayed, and a cached tensor a graph reads must never be evicted, so a capture builds its
    own (one small recorded kernel)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return make()
    full_key = key + (device,)
    t = _CONSTANTS.get(full_key)
    if t is None:
        if len(_CONSTANTS) >= _MAX_CONSTANTS:
            _CONSTANTS.clear()
        t = _CONSTANTS[full_key] = make()
    return t


def _filled(value: int, batch: int, device: torch.device) -> torch.Tensor:
    return _constant(("full", value, batch), device,
                     lambda: torch.full((batch,), value, dtype=torch.int32, device=device))


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """int64 0..n-1 (int64: gather's index type; int32 + int64 gives int64)."""
    return _constant(("arange", n), device, lambda: torch.arange(n, dtype=torch.int64, device=device))


# ---------------------------------------------------------------------------- validation
def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_same(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    if t.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")


def check_kvcache_args(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                       cache_batch_idx=None, cache_leftpad=None, block_table=None, rotary_interleaved=True,
                       num_splits=0) -> KVCachePlan:
    """Validate a ``flash_attn_with_kvcache`` call (FlashAttention-2's rules) and return its plan.

    q (batch, seqlen_q, heads, d) fp16/bf16; k_cache/v_cache (batch_cache, seqlen_cache, heads_kv, d),
    or with block_table (num_pages, page_size, heads_kv, d) and block_table (batch, max_pages) int32;
    k/v (batch, seqlen_new, heads_kv, d) or None; rotary_cos/sin (seqlen_ro, rotary_dim / 2) or None;
    cache_seqlens None (the full cache), an int or (batch,) int32; cache_batch_idx/cache_leftpad
    (batch,) int32 or None. No value is read from the device (see the module's docstring).
    """
    # q and the caches
    _check_kind("q", q)
    batch, seqlen_q, heads, head_dim = q.shape
    if head_dim > MAX_HEAD_DIM or head_dim % 8 or head_dim == 0:
        raise ValueError(f"q's head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {head_dim}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_kind(name, t)
        _check_same(name, t, q)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    rows, slots, heads_kv, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"k_cache/v_cache head_dim {cache_dim} does not match q's head_dim {head_dim}")
    if heads_kv == 0 or heads % heads_kv:
        raise ValueError(f"q heads ({heads}) must be a multiple of k_cache/v_cache heads ({heads_kv})")

    # dense or paged
    paged = block_table is not None
    if paged:
        if isinstance(block_table, torch.Tensor) and block_table.dim() != 2:
            raise ValueError(f"block_table must have 2 dims (batch, max_pages), got shape {tuple(block_table.shape)}")
        max_pages = block_table.shape[1] if isinstance(block_table, torch.Tensor) else 0
        _check_int32("block_table", block_table, (batch, max_pages), q.device, " or None")
        if slots == 0:  # any other page size works (kernels/sm80/forward.py: paged_rows)
            raise ValueError("a paged cache's page size (k_cache.shape[1]) must be positive, got 0")
        for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if t is not None:
                raise ValueError(f"{name} is not supported with a paged cache (block_table given), as in "
                                 f"FlashAttention-2: pass {name}=None")
        page_size, cache_len = slots, max_pages * slots
    else:
        if cache_batch_idx is None and rows < batch:
            raise ValueError(f"k_cache/v_cache batch ({rows}) must be at least q's batch ({batch}) without "
                             f"cache_batch_idx")
        page_size, cache_len = 0, slots

    # new keys and values
    if (k is None) != (v is None):
        raise ValueError(f"k and v must both be given or both be None, got k {'None' if k is None else 'given'} "
                         f"and v {'None' if v is None else 'given'}")
    seqlen_new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            _check_kind(name, t)
            _check_same(name, t, q)
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        seqlen_new = k.shape[1]
        expected = (batch, seqlen_new, heads_kv, head_dim)
        if tuple(k.shape) != expected:
            raise ValueError(f"k/v must have shape (batch, seqlen_new, heads_kv, head_dim) = {expected}, "
                             f"got {tuple(k.shape)}")
        if seqlen_new > cache_len:
            raise ValueError(f"k/v's seqlen_new ({seqlen_new}) must be at most the cache length ({cache_len})")
        if cache_seqlens is None:
            raise ValueError("k/v given requires cache_seqlens (the rows to append at), as in FlashAttention-2, "
                             "got cache_seqlens=None")

    # rotary
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved must be a bool, got {type(rotary_interleaved).__name__}")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must both be given or both be None, got only "
                         f"{'rotary_cos' if rotary_sin is None else 'rotary_sin'}")
    rotary_dim = 0
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos/rotary_sin require new k and v to append (FlashAttention-2's rule), "
                             "got k=None")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
            _check_same(name, t, q)
            if t.dim() != 2:
                raise ValueError(f"{name} must have 2 dims (seqlen_ro, rotary_dim / 2), got shape {tuple(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
        if rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"rotary_cos and rotary_sin must have the same shape, got {tuple(rotary_cos.shape)} "
                             f"and {tuple(rotary_sin.shape)}")
        seqlen_ro, rotary_dim = rotary_cos.shape[0], 2 * rotary_cos.shape[1]
        if rotary_dim % 16 or rotary_dim > head_dim:
            raise ValueError(f"rotary_cos's rotary_dim (2 * shape[1] = {rotary_dim}) must be a multiple of 16 and "
                             f"at most head_dim ({head_dim})")
        if seqlen_ro < cache_len:
            raise ValueError(f"rotary_cos/rotary_sin must have at least the cache length ({cache_len}) rows, "
                             f"got {seqlen_ro}")

    # the int32 tensors
    if cache_seqlens is None:
        max_seqlen_k = cache_len
    elif _is_int(cache_seqlens):
        if cache_seqlens < 0 or cache_seqlens + seqlen_new > cache_len:
            extra = f" - seqlen_new ({seqlen_new})" if seqlen_new else ""
            raise ValueError(f"cache_seqlens must be in [0, cache length ({cache_len}){extra}], got {cache_seqlens}")
        max_seqlen_k = cache_seqlens + seqlen_new
    elif isinstance(cache_seqlens, torch.Tensor):
        _check_int32("cache_seqlens", cache_seqlens, (batch,), q.device, ", an int or None")
        max_seqlen_k = cache_len
    else:
        raise TypeError(f"cache_seqlens must be a torch.Tensor, an int or None, got {type(cache_seqlens).__name__}")
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            _check_int32(name, t, (batch,), q.device, " or None")
    if not _is_int(num_splits):
        raise TypeError(f"num_splits must be an int (0: heuristic), got {type(num_splits).__name__}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0: heuristic), got {num_splits}")

    # layouts, then the device
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if t is not None:
            _check_layout(name, t)
    _check_cuda("q", q)

    if not isinstance(cache_seqlens, torch.Tensor):
        value = cache_len if cache_seqlens is None else int(cache_seqlens)
        cache_seqlens = _filled(value, batch, q.device)
    return KVCachePlan(
        batch=batch, seqlen_q=seqlen_q, heads=heads, heads_kv=heads_kv, head_dim=head_dim, seqlen_new=seqlen_new,
        paged=paged, page_size=page_size, cache_len=cache_len, rotary_dim=rotary_dim,
        rotary_interleaved=rotary_interleaved, num_splits=num_splits, max_seqlen_k=max_seqlen_k,
        cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        block_table=block_table,
    )


# ---------------------------------------------------------------------------- rotary and append
# Host cost: each torch op here costs about 5-20 us of Python and dispatcher time, more than its
# kernel on a decode step, so the functions below are written for few ops (counted in the tests).
def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
             interleaved: bool) -> torch.Tensor:
    """The first rotary_dim columns of x (batch, seqlen, heads, d) rotated, fp32, contiguous
    (batch, seqlen, heads, rotary_dim). 6 ops: 2 gathers, a cast, a mul, 2 addcmul_."""
    half = cos.shape[1]
    rd = 2 * half
    c = cos[positions].unsqueeze(2)  # (batch, seqlen or 1, 1, half), in cos's dtype
    s = sin[positions].unsqueeze(2)
    xr = x[..., :rd].float()  # a new fp32 tensor (x is not read after this)
    if interleaved:  # pairs (2j, 2j + 1)
        pairs, c2 = xr.unflatten(-1, (half, 2)), c.unsqueeze(-1)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        out = pairs * c2
        o1, o2 = out[..., 0], out[..., 1]
    else:  # GPT-NeoX: pairs (j, j + half)
        pairs, c2 = xr.unflatten(-1, (2, half)), c.unsqueeze(-2)
        x1, x2 = pairs[..., 0, :], pairs[..., 1, :]
        out = pairs * c2
        o1, o2 = out[..., 0, :], out[..., 1, :]
    o1.addcmul_(x2, s, value=-1)  # x1 cos - x2 sin (fp32: the bf16/fp16 factors promote)
    o2.addcmul_(x1, s)  # x2 cos + x1 sin
    return out.flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """x (batch, seqlen, heads, d) rotated: token (b, i) by the angles of row positions[b, i] of
    cos/sin (seqlen_ro, rotary_dim / 2). positions: int tensor on x's device, (batch, seqlen) or
    (batch, 1) (every token at one position). interleaved: pairs (0, 1), (2, 3)...; else GPT-NeoX
    pairs (j, j + rotary_dim / 2). Columns >= rotary_dim are copied unchanged. fp32 math, result in
    x's dtype, a new tensor. No host sync (an out-of-range position is a device-side error)."""
    rd = 2 * cos.shape[1]
    out = _rotated(x, cos, sin, positions, interleaved)
    if rd == x.shape[-1]:
        return out.to(x.dtype)
    result = x.clone()
    result[..., :rd].copy_(out)
    return result


def _positions(cache_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """(batch, n) int64: cache_seqlens[b] + i."""
    return cache_seqlens.unsqueeze(1) + _arange(n, cache_seqlens.device)


def _flat_rows(plan: KVCachePlan, seqlens: torch.Tensor, pos: torch.Tensor | None, batch_idx, table) -> torch.Tensor:
    """(batch, seqlen_new) int64: the rows that token i of sequence b goes to in the cache seen as
    (rows * slots, heads_kv, d). pos: the positions cache_seqlens[b] + i if already built."""
    n, device = plan.seqlen_new, seqlens.device
    if plan.paged:  # page block_table[b, pos // page_size], row pos % page_size
        ps = plan.page_size
        pos = _positions(seqlens, n) if pos is None else pos
        page_of = torch.div(pos, ps, rounding_mode="floor")
        page = table.gather(1, page_of)
        return torch.add(pos, page - page_of, alpha=ps)  # page * ps + pos - page_of * ps
    slots = plan.cache_len
    if batch_idx is not None:
        pos = _positions(seqlens, n) if pos is None else pos
        return torch.add(pos, batch_idx.unsqueeze(1), alpha=slots)
    if pos is not None:
        return torch.add(pos, _row_starts(plan.batch, slots, device).unsqueeze(1))
    offsets = _constant(("rows", plan.batch, n, slots), device,
                        lambda: _row_starts(plan.batch, slots, device).unsqueeze(1) + _arange(n, device))
    return seqlens.unsqueeze(1) + offsets


def _row_starts(batch: int, slots: int, device: torch.device) -> torch.Tensor:
    return _constant(("row_starts", batch, slots), device,
                     lambda: torch.arange(0, batch * slots, slots, dtype=torch.int64, device=device))


def _write(cache: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> None:
    """cache (R, slots, heads_kv, d) in place: cache row r // slots, slot r % slots = new's token
    for each r of rows (batch, n); new (batch, n, heads_kv, d)."""
    r, slots = cache.shape[0], cache.shape[1]
    if r <= 1 or cache.stride(0) == slots * cache.stride(1):  # (R * slots) rows: a view
        cache.flatten(0, 1).index_copy_(0, rows.flatten(), new.flatten(0, 1))
    else:  # a cache whose rows are not evenly spaced (a slice of a larger one, say)
        cache.index_put_((torch.div(rows, slots, rounding_mode="floor"), rows % slots), new)


def append_kv(plan: KVCachePlan, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              rotary_cos=None, rotary_sin=None, cache_seqlens: torch.Tensor | None = None, cache_batch_idx=None,
              block_table=None, rotary_interleaved: bool = True, q: torch.Tensor | None = None,
              causal_or_local: bool = False):
    """Write k (rotated at positions cache_seqlens[b] + i when plan.rotary_dim) and v into the caches
    in place at rows cache_seqlens[b] + i: dense, batch row cache_batch_idx[b] (b without it); paged,
    page block_table[b, pos // page_size], row pos % page_size. Arguments as ``check_kvcache_args``
    accepted them; cache_seqlens/cache_batch_idx/block_table default to the plan's. Device ops only
    (no host sync, fixed shapes): CUDA-graph capturable.

    With ``q``, returns q rotated as ``rotate_q(plan, q, ..., causal_or_local)`` would (q itself
    without rotary), the two rotations done in one pass (7 ops fewer than two calls); else None."""
    if plan.seqlen_new == 0:
        return None if q is None else rotate_q(plan, q, rotary_cos, rotary_sin, cache_seqlens, causal_or_local,
                                                rotary_interleaved)
    seqlens = plan.cache_seqlens if cache_seqlens is None else cache_seqlens
    batch_idx = plan.cache_batch_idx if cache_batch_idx is None else cache_batch_idx
    table = plan.block_table if block_table is None else block_table
    pos = None
    if plan.rotary_dim and q is not None:
        q, k = _rotate_q_and_k(plan, q, k, rotary_cos, rotary_sin, seqlens, causal_or_local, rotary_interleaved)
    elif plan.rotary_dim:
        pos = _positions(seqlens, plan.seqlen_new)
        k = apply_rotary(k, rotary_cos, rotary_sin, pos, rotary_interleaved)
    rows = _flat_rows(plan, seqlens, pos, batch_idx, table)
    _write(k_cache, rows, k)
    _write(v_cache, rows, v)
    return q


def _rotate_q_and_k(plan: KVCachePlan, q, k, cos, sin, seqlens, causal_or_local: bool, interleaved: bool):
    """(q rotated, k rotated) from one buffer: per sequence, q's tokens x heads then k's, rotated in
    place at cache_seqlens[b] + the token's offset (q: i when causal_or_local, else 0; k: i)."""
    batch, nq, heads, d = q.shape
    nk, heads_kv = k.shape[1], k.shape[2]
    mq = nq * heads
    buf = torch.cat((q.reshape(batch, mq, d), k.reshape(batch, nk * heads_kv, d)), dim=1)
    device = buf.device

    def offsets():
        q_off = torch.arange(nq, dtype=torch.int64, device=device) if causal_or_local else \
            torch.zeros(nq, dtype=torch.int64, device=device)
        k_off = torch.arange(nk, dtype=torch.int64, device=device)
        return torch.cat((q_off.repeat_interleave(heads), k_off.repeat_interleave(heads_kv)))

    positions = seqlens.unsqueeze(1) + _constant(("qk", nq, heads, nk, heads_kv, causal_or_local), device, offsets)
    x = buf.unsqueeze(2)  # (batch, mq + nk * heads_kv, 1, d): one token per row
    x[..., :2 * cos.shape[1]].copy_(_rotated(x, cos, sin, positions, interleaved))
    return buf[:, :mq].view(batch, nq, heads, d), buf[:, mq:].view(batch, nk, heads_kv, d)


def rotate_q(plan: KVCachePlan, q: torch.Tensor, rotary_cos, rotary_sin, cache_seqlens: torch.Tensor | None = None,
             causal_or_local: bool = False, interleaved: bool = True) -> torch.Tensor:
    """q rotated as FlashAttention-2 does in a call that appends with rotary: token i of sequence b
    at position cache_seqlens[b] + i when causal or local (a window), else every token at
    cache_seqlens[b]. q itself when plan.rotary_dim is 0. (``append_kv(..., q=q)`` does both.)"""
    if not plan.rotary_dim:
        return q
    seqlens = plan.cache_seqlens if cache_seqlens is None else cache_seqlens
    positions = _positions(seqlens, q.shape[1]) if causal_or_local else seqlens.unsqueeze(1)
    return apply_rotary(q, rotary_cos, rotary_sin, positions, interleaved)


def sm90_paged_varlen(q: torch.Tensor, heads_kv: int, opts, max_seqlen_q: int, page_size: int, batch: int):
    """The features with which a paged varlen call of ``batch`` sequences over the packed queries
    ``q`` (total_q, heads, d) runs the SM90 forward, or None where it runs the decode kernel. The
    SM90 forward takes it on Hopper (not forced to sm80), with pages of a multiple of
    SM90_PAGE_ROWS keys and a head dim the SM90 table has, when the sequences hold at least
    SM90_PAGED_MIN_QUERIES tile rows (queries, times g when packed) on average: known without
    reading cu_seqlens. Fewer (decode rows) keep the decode kernel, which also splits long caches.
    The g query heads of a K/V head are packed into its tiles where g divides every tier's
    tile_m / 16 (no ALiBi: traits.sm90_packs_gqa) and the batch has short sequences: fewer
    queries than a tile's rows on average, or fewer than half the longest (measured: packed
    1.4-1.5x faster on a long chunk among 30-31 decode rows, 1.7x on 64-query chunks; 3% and 13%
    slower on uniform chunks of 128 and 1024 queries). Packed, fewer rows on average still run
    the SM90 forward when one sequence fills a tile (a chunk of prefill beside decode rows, as
    vLLM's chunked prefill batches them) and the batch has a tile per SM at least (measured
    against the decode kernel: 1.01-1.29x faster on the 13 such batches tried, docs/performance.md)."""
    from cute_attn.traits import SM90_PAGED_MIN_QUERIES, sm90_packs_gqa

    group = q.shape[1] // heads_kv
    short = q.shape[0] < SM90_PAGED_MIN_QUERIES * batch or 2 * q.shape[0] < max_seqlen_q * batch
    pack = short and not opts.features.alibi and sm90_packs_gqa(q.shape[-1], opts.causal, group)
    rows = group if pack else 1  # tile rows per query
    if max_seqlen_q * rows < SM90_PAGED_MIN_QUERIES:
        return None
    plan = dispatch.plan_for_device(q.device)
    if q.shape[0] * rows < SM90_PAGED_MIN_QUERIES * batch:
        # a chunk beside short sequences (decode rows): packed, when the batch's tiles (a tile or more
        # per sequence, the chunk's rows over SM90_PAGED_MIN_QUERIES) fill the GPU (fewer: the decode
        # kernel splits the long caches)
        tiles = heads_kv * (batch - 1 + -(-max_seqlen_q * rows // SM90_PAGED_MIN_QUERIES))
        if not pack or tiles < plan.num_sms:
            return None
    features = dataclasses.replace(opts.features, varlen=True, seqused=True, paged=True, pack_gqa=pack)
    # which family runs depends on the features, head dim and GPU, not on the dtype
    key = compile_mod.forward_key(plan.target, "bf16", q.shape[-1], opts.causal, plan.smem_capacity,
                                  kernel=plan.kernel, seqlen=max_seqlen_q, features=features, page_size=page_size)
    return features if key.kernel == "sm90" else None


def sm90_kvcache_launcher(q: torch.Tensor, opts, plan: KVCachePlan):
    """``flash_attn_with_kvcache`` on the SM90 forward for chunks of queries (chunked prefill): a
    launch taking interface._decode_launcher's arguments, or None where the decode kernel runs
    (``sm90_paged_varlen``'s rule on seqlen_q queries per sequence; a num_splits asked for;
    cache_leftpad; a q whose batch and sequence modes do not merge into rows). The queries run as
    a packed varlen batch of seqlen_q rows per sequence. A paged cache keeps its block table; a
    contiguous one is read as pages of seqlen_cache keys, page b the cache row cache_batch_idx[b]
    (a (batch, 1) block table). The LSE comes out per query head and is transposed into
    (batch, heads, seqlen_q)."""
    from cute_attn.interface import _forward_launcher

    batch, seqlen_q, heads, head_dim = q.shape
    page_size = plan.page_size if plan.paged else plan.cache_len
    packed = q.stride(0) == seqlen_q * q.stride(1) or batch == 1
    if plan.num_splits or plan.cache_leftpad is not None or not packed:
        return None
    rows = _as_rows(q)
    features = sm90_paged_varlen(rows[0], plan.heads_kv, opts, seqlen_q, page_size, batch)
    if features is None:
        return None
    device = q.device
    run = _forward_launcher(rows, None, dataclasses.replace(opts, features=features), max_seqlen_q=seqlen_q,
                            max_seqlen_k=plan.max_seqlen_k, page_size=page_size)
    # sequence b's queries are rows b * seqlen_q: of the packed view; the kernel reads the keys
    # from seqused_k (cache_seqlens) and the block table, so cu_seqlens_k is not read for them
    cu_seqlens = _constant(("chunks", batch, seqlen_q), device,
                           lambda: torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=device))

    def launch(q, k_cache, v_cache, out, lse, alibi_slopes, cache):
        seqused, _, batch_idx, table = cache
        if table is None:
            table = batch_idx.unsqueeze(1)
        lse_rows = torch.empty((heads, batch, seqlen_q), dtype=torch.float32, device=device)
        run(_as_rows(q), k_cache, v_cache, _as_rows(out), lse_rows.view(1, heads, batch * seqlen_q), cu_seqlens,
            cu_seqlens, alibi_slopes, seqused, table)
        lse.copy_(lse_rows.transpose(0, 1))

    return launch


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """(batch, seqlen, heads, d) whose batch and sequence modes merge, as the varlen kernels' packed
    (1, batch * seqlen, heads, d) view (a view: no copy)."""
    batch, seqlen, heads, d = t.shape
    rows = batch * seqlen
    return t.as_strided((1, rows, heads, d), (rows * t.stride(1), t.stride(1), t.stride(2), t.stride(3)))


def varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, block_table,
                 seqused_k=None, softmax_scale=None, causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                 alibi_slopes=None, *, call_layout=None):
    """``flash_attn_varlen_func`` over a paged cache (FlashAttention-2's ``block_table``): returns
    out (total_q, heads, d) and lse (heads, total_q). The KV-cache kernel with packed queries
    (the varlen feature: sequence b's queries are rows cu_seqlens_q[b]: of q) over the first
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] (or seqused_k[b]) keys of its pages, split-KV and packed
    GQA as ``flash_attn_with_kvcache`` picks them. On Hopper, batches of chunks over pages of a
    multiple of traits.SM90_PAGE_ROWS keys run the SM90 forward instead (wgmma, a TMA load per
    page piece, packed GQA; ``sm90_paged_varlen``). No host
    synchronisation. Inference only: q, k or v that require grad raise NotImplementedError.

    Host time: a serving loop changes the batch, the totals and max_seqlen every step, so the
    checks run once per layout (``interface._varlen_layout``: the call without those; its
    lengths' own checks per call, ``_PAGED_VARLEN_LAYOUTS``), and the kernel choice once per
    layout and lengths (``_PAGED_VARLEN_RUNS``). ``call_layout``: the caller's layout of this call
    (flash_attn_varlen_func's, which holds all of this one's), or None to compute it."""
    from cute_attn.interface import _remember, _varlen_layout

    layout = call_layout
    if layout is None:
        layout = _varlen_layout(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                block_table, alibi_slopes, (softmax_scale, causal, window_size, softcap))
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        layout = None  # the checks raise
    lengths = None if layout is None else (layout, q.shape[0], cu_seqlens_q.shape[0], max_seqlen_q, max_seqlen_k,
                                           block_table.shape[1])
    run = _PAGED_VARLEN_RUNS.get(lengths)
    if run is None:
        opts = _PAGED_VARLEN_LAYOUTS.get(layout)
        if opts is None:
            opts = _check_paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_table,
                                       seqused_k, softmax_scale, causal, window_size, softcap, alibi_slopes)
            _remember(_PAGED_VARLEN_LAYOUTS, layout, opts)
        run = _varlen_paged_run(q, k_cache, cu_seqlens_q, max_seqlen_q, max_seqlen_k, block_table, opts)
        _remember(_PAGED_VARLEN_RUNS, lengths, run)
    return run(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, alibi_slopes)


# checked paged varlen layouts: layout -> the score options (interface._FORWARD_LAUNCHES' rules)
_PAGED_VARLEN_LAYOUTS: dict = {}
# their kernel choices: (layout, total_q, batch + 1, max_seqlen_q, max_seqlen_k, max_pages) -> run
_PAGED_VARLEN_RUNS: dict = {}


def _check_paged_varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, block_table, seqused_k,
                        softmax_scale, causal: bool, window_size, softcap: float, alibi_slopes):
    """``varlen_paged``'s checks (beside flash_attn_varlen_func's): the score options."""
    from cute_attn.interface import _alibi_slopes, _score_options

    _, heads, head_dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    # the KV-cache call's own checks on a stand-in of its shapes (batch, max_seqlen_q queries; a
    # broadcast view, no memory), cu_seqlens_k[1:] for the key counts (a view), then the packed
    # q's own layout
    q_like = q.new_empty((1, 1, 1, head_dim)).expand(batch, max_seqlen_q, heads, head_dim)
    check_kvcache_args(q_like, k_cache, v_cache, block_table=block_table,
                       cache_seqlens=seqused_k if seqused_k is not None else cu_seqlens_k[1:])
    _check_layout("q", q)
    _check_cuda("q", q)
    opts = _score_options(causal, softmax_scale, head_dim, window_size, softcap, alibi_slopes is not None)
    _alibi_slopes(alibi_slopes, batch, heads, q.device)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise NotImplementedError("flash_attn_varlen_func with a block_table has no backward (inference, as "
                                  "FlashAttention-2's paged path): call it under torch.no_grad() or with tensors "
                                  "that do not require grad")
    return opts


def _varlen_paged_run(q, k_cache, cu_seqlens_q, max_seqlen_q: int, max_seqlen_k: int, block_table, opts):
    """``varlen_paged``'s kernel choice for checked arguments: a function of (q, k_cache, v_cache,
    cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, alibi_slopes) -> (out, lse) that runs any
    call of the same layout and lengths (total_q, batch, max_seqlen_q/k, max_pages)."""
    from cute_attn.interface import _alibi_slopes, _decode_launcher, _forward_launcher

    total_q, heads, _ = q.shape
    batch = cu_seqlens_q.numel() - 1
    device = q.device
    _, page_size, heads_kv, _ = k_cache.shape
    launch = None
    if total_q:
        sm90 = sm90_paged_varlen(q, heads_kv, opts, max_seqlen_q, page_size, batch)
        max_keys = min(max_seqlen_k, block_table.shape[1] * page_size)
        if sm90 is not None:
            launch = _forward_launcher(q.unsqueeze(0), k_cache, dataclasses.replace(opts, features=sm90),
                                       max_seqlen_q=max_seqlen_q, max_seqlen_k=max_keys, page_size=page_size)
        else:
            decode = _decode_launcher(q.unsqueeze(0), k_cache, opts, max_keys, 0, kvcache=False,
                                      page_size=page_size, varlen=(batch, max_seqlen_q))

            def launch(q, k_cache, v_cache, out, lse, cu_seqlens_q, cu_seqlens_k, slopes, keys, block_table):
                decode(q, k_cache, v_cache, out, lse, slopes, (keys, None, None, block_table),
                       cu_seqlens=(cu_seqlens_q, cu_seqlens_k))

    def run(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, alibi_slopes):
        q_packed = q.unsqueeze(0)  # (1, total_q, heads, d): the varlen kernels' view
        out = torch.empty(q_packed.shape, dtype=q.dtype, device=device)
        lse = torch.empty((1, heads, total_q), dtype=torch.float32, device=device)
        if launch is not None:
            keys = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
            launch(q_packed, k_cache, v_cache, out, lse, cu_seqlens_q, cu_seqlens_k,
                   _alibi_slopes(alibi_slopes, batch, heads, device), keys, block_table)
        return out[0], lse[0]

    return run
