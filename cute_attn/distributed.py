"""Context parallelism: ring attention over the ranks of a ``torch.distributed`` process group.

    import cute_attn.distributed as cp
    q, k, v = (cp.shard_sequence(t, group) for t in (q_full, k_full, v_full))   # this rank's slices
    out = cp.ring_flash_attn_func(q, k, v, group=group, causal=True)           # this rank's out slice
    out_full = cp.gather_sequence(out, group)

Each rank holds a slice of every sequence (dim 1). K/V slices travel around the ring of ranks
(``batch_isend_irecv``: NCCL on GPUs, gloo in the CPU tests) while each rank runs cute_attn's
forward kernel on its queries and the slice in hand; the partial outputs merge exactly through
their log-sum-exps. The backward runs the same ring with cute_attn's backward kernel, given the
merged output and LSE, so every step's dQ, dK, dV are exact shares; dK/dV travel with their K/V
slice and arrive home summed. The next slice's transfer is posted before the current step's
kernels run, so communication overlaps compute.

Layouts: ``"contiguous"`` gives rank r the r-th of world equal pieces; ``"zigzag"`` splits the
sequence into 2 * world pieces and gives rank r pieces r and 2 * world - 1 - r, so that under a
causal mask every rank does the same work at every step (the diagonal step: causal attention on its
own slice; then either all its queries against the first half of the visiting slice, or the second
half of its queries against the whole visiting slice).

Sliding windows (``window_size``, over the whole sequence): each step attends, for every pair of a
query piece and a piece of the visiting slice, only the rows and keys in the window's band, as one
local call with that sub-block's own window (``_band``: bottom-right aligned and never negative,
so the kernels see ordinary FlashAttention windows). K/V still travel the whole ring; steps whose
pieces the window does not reach compute nothing.

Packed variable-length batches (``ring_flash_attn_varlen_func``, ``shard_varlen``): every sequence
is split over the ranks as one dense sequence is, so the steps are the same (``_halves_work``), run
by the varlen kernels on all rows or on the first / second half of every sequence (row indices
built on the device, ``_VarlenParts``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag")


# ---------------------------------------------------------------------------- layouts
def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _pieces(length: int, world: int, layout: str, name: str) -> int:
    parts = world * (2 if layout == "zigzag" else 1)
    if length % parts:
        raise ValueError(f"{name}: the sequence length {length} must be a multiple of {parts} "
                         f"({'2 x ' if layout == 'zigzag' else ''}{world} ranks) for layout {layout!r}")
    return length // parts


def shard_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """This rank's slice of a full (every rank holds the same) tensor along ``dim``."""
    _check_layout(layout)
    world, rank = _world(group)
    piece = _pieces(x.shape[dim], world, layout, "shard_sequence")
    if layout == "contiguous":
        return x.narrow(dim, rank * piece, piece).contiguous()
    first, second = x.narrow(dim, rank * piece, piece), x.narrow(dim, (2 * world - 1 - rank) * piece, piece)
    return torch.cat([first, second], dim=dim)


def gather_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's slice (the inverse of ``shard_sequence``; all ranks get it)."""
    _check_layout(layout)
    return _unshard(_all_slices(x, group), layout, dim)


def _all_slices(x: torch.Tensor, group) -> list:
    world, _ = _world(group)
    slices = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(slices, x.contiguous(), group=group)
    return slices


def _unshard(slices: list, layout: str, dim: int) -> torch.Tensor:
    """One sequence from every rank's slice of it, in rank order."""
    if layout == "contiguous":
        return torch.cat(slices, dim=dim)
    halves = [s.chunk(2, dim=dim) for s in slices]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, group=None, layout: str = "zigzag"):
    """This rank's part of a packed variable-length tensor x (total, ...) whose sequences are rows
    cu_seqlens[b]:cu_seqlens[b + 1]: each sequence split as ``shard_sequence`` splits one (its
    length a multiple of world, 2 x world for zigzag). Returns (x's shard, the local cu_seqlens =
    cu_seqlens / world, int32 on cu_seqlens' device). Reads cu_seqlens on the host (a sync)."""
    _check_layout(layout)
    world, _ = _world(group)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds, bounds[1:]):
        _pieces(end - start, world, layout, "shard_varlen")
    parts = [shard_sequence(x[start:end], group, layout, dim=0) for start, end in zip(bounds, bounds[1:])]
    shard = torch.cat(parts, dim=0) if parts else x[:0]
    return shard, (cu_seqlens // world).to(torch.int32)


def gather_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, group=None, layout: str = "zigzag",
                  dim: int = 0) -> torch.Tensor:
    """The inverse of ``shard_varlen`` for a shard x (total / world along ``dim``), given the
    global cu_seqlens; all ranks get the packed whole. Reads cu_seqlens on the host."""
    _check_layout(layout)
    world, _ = _world(group)
    slices = _all_slices(x, group)
    bounds = (cu_seqlens // world).tolist()
    sequences = [_unshard([s.narrow(dim, start, end - start) for s in slices], layout, dim)
                 for start, end in zip(bounds, bounds[1:])]
    return torch.cat(sequences, dim=dim) if sequences else x.narrow(dim, 0, 0)


# ---------------------------------------------------------------------------- local attention
def _local_forward(q, k, v, causal: bool, scale: float, softcap: float, window_size=(-1, -1)):
    """(out, lse) of one step: cute_attn's forward kernel (the CPU tests put the reference here)."""
    from cute_attn import interface

    return interface.forward(q, k, v, causal=causal, softmax_scale=scale, softcap=softcap, window_size=window_size,
                             return_lse=True)


def _local_backward(dout, q, k, v, out, lse, causal: bool, scale: float, deterministic: bool, softcap: float,
                    window_size=(-1, -1)):
    """(dq, dk, dv) shares of one step, from the merged out and lse: cute_attn's backward kernel
    (it recomputes each score, capped, and its probability from the merged lse)."""
    from cute_attn import interface

    return interface.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, softcap=softcap,
                              window_size=window_size, deterministic=deterministic)


# ---------------------------------------------------------------------------- what each step computes
# A step's work is a list of local attention calls, each (query rows, K/V rows, causal, window):
# rows as (start, length) in this rank's slice and in the visiting slice, the window in
# FlashAttention's sense for that sub-block (bottom-right aligned, -1 unbounded).
_WHOLE = None  # every row of a slice


def _step_work(step: int, rank: int, world: int, length: int, causal: bool, layout: str, window) -> list:
    """What this rank computes at ``step`` of the ring, holding the slice of rank (rank - step) %
    world. Without a window: at most one call (see the module docstring). With one: a call per
    pair of pieces (query piece, key piece) whose band of visible pairs is not empty
    (``_band``)."""
    if window is not None:
        left, right = window
        work = []
        for q_local, q_global, q_len in _slice_pieces(rank, world, length, layout):
            for k_local, k_global, k_len in _slice_pieces((rank - step) % world, world, length, layout):
                band = _band(q_global, q_len, k_global, k_len, left, right)
                if band is not None:
                    (row, rows), (key, keys), band_window = band
                    work.append(((q_local + row, rows), (k_local + key, keys), False, band_window))
        return work
    half = {"all": _WHOLE, "first": (0, length // 2), "second": (length // 2, length // 2)}
    return [(half[rows], half[keys], step_causal, (-1, -1))
            for rows, keys, step_causal in _halves_work(step, rank, world, causal, layout)]


def _halves_work(step: int, rank: int, world: int, causal: bool, layout: str) -> list:
    """The ring's work without a window: at most one call of (query part, K/V part, causal), each
    part "all", or the "first" / "second" half of every sequence of the slice (the zigzag pieces;
    see the module docstring). The same for dense and varlen slices."""
    source = (rank - step) % world
    if not causal:
        return [("all", "all", False)]
    if step == 0:
        return [("all", "all", True)]
    if layout == "contiguous":
        return [("all", "all", False)] if source < rank else []
    # zigzag: all queries on the first key piece, or the second query piece on all keys
    return [("all", "first", False)] if source < rank else [("second", "all", False)]


def _slice_pieces(rank: int, world: int, length: int, layout: str) -> list:
    """(start in the slice, start in the whole sequence, length) of each piece of rank's slice."""
    if layout == "contiguous":
        return [(0, rank * length, length)]
    half = length // 2
    return [(0, rank * half, half), (half, (2 * world - 1 - rank) * half, half)]


def _band(q_start: int, q_len: int, k_start: int, k_len: int, left, right):
    """The visible pairs between queries [q_start, q_start + q_len) and keys [k_start, k_start +
    k_len) of one sequence (query i sees key j iff i - left <= j <= i + right; None: unbounded) as
    one local attention call: ((first row, rows), (first key, keys), window) relative to the two
    pieces, or None when no pair is visible. Only rows that see a key and keys that a row sees
    are kept, and the sub-block's window, bottom-right aligned, is then never negative: its left
    edge is left + (last key - last row) >= 0 and its right edge right - (last key - last row) >= 0."""
    huge = 1 << 60
    lo, hi = huge if left is None else left, huge if right is None else right
    row_first, row_end = max(q_start, k_start - hi), min(q_start + q_len, k_start + k_len + lo)
    if row_first >= row_end:
        return None
    key_first, key_end = max(k_start, row_first - lo), min(k_start + k_len, row_end + hi)
    rows, keys = row_end - row_first, key_end - key_first
    offset = (key_end - 1) - (row_end - 1)  # last key - last row
    edge = lambda w, bound: -1 if bound is None or w >= rows + keys else w  # noqa: E731  (-1: never binds)
    window = (edge(lo + offset, left), edge(hi - offset, right))
    return (row_first - q_start, rows), (key_first - k_start, keys), window


def _part(t: torch.Tensor, rows, dim: int = 1) -> torch.Tensor:
    """The (start, length) rows of ``t`` along ``dim`` (``_WHOLE``: all of them)."""
    return t if rows is _WHOLE else t.narrow(dim, rows[0], rows[1])


# ---------------------------------------------------------------------------- the ring
class _Ring:
    """Sends this rank's buffers to the next rank and receives the previous rank's, posted ahead."""

    def __init__(self, group):
        self.group = group
        world, rank = _world(group)
        # P2P ops address global ranks
        global_rank = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next, self.prev = global_rank((rank + 1) % world), global_rank((rank - 1) % world)

    def start(self, tensors):
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def finish(pending):
        requests, received = pending
        for request in requests:
            request.wait()
        return received


def _merge(out, lse, part_out, part_lse, rows):
    """out/lse (fp32 accumulators) <- the exact combination with a step's result on ``rows``."""
    acc_out, acc_lse = _part(out, rows), _part(lse, rows, dim=2)
    if _fused_merge(acc_out, acc_lse, part_out, part_lse):
        return
    new_out, new_lse = _combined(acc_out, acc_lse, part_out, part_lse, lse_to_out=lambda t: t.transpose(1, 2))
    acc_out.copy_(new_out)
    acc_lse.copy_(new_lse)


def _fused_merge(acc_out, acc_lse, part_out, part_lse, row_index=None) -> bool:
    """The merge as one kernel (kernels/ring_merge.py) on the GPU: acc_out (batch, rows, heads, d)
    and acc_lse (batch, heads, rows) fp32 updated in place (through ``row_index``: step row i into
    accumulator row row_index[i]). False (nothing done) off the GPU, e.g. the CPU tests' reference
    steps, whose merge is ``_combined``."""
    if not (acc_out.is_cuda and acc_out.dtype == torch.float32 and part_out.dtype in (torch.float16, torch.bfloat16)):
        return False
    if part_out.numel():
        from cute_attn import compile as compile_mod
        from cute_attn import dispatch

        key = compile_mod.ring_merge_key(dispatch.plan_for_device(acc_out.device).target,
                                         "bf16" if part_out.dtype == torch.bfloat16 else "fp16", part_out.shape[-1],
                                         row_index is not None)
        merge = compile_mod.ring_merge_cache.get(key)
        with torch.cuda.device(acc_out.device):
            merge(acc_out, acc_lse, part_out, part_lse, row_index)
    return True


def _combined(acc_out, acc_lse, part_out, part_lse, lse_to_out):
    """(out, lse) of two partial results through their LSEs; ``lse_to_out`` views an LSE like out's
    leading modes. cute_attn's LSE is +inf for a row that saw no key; such a row contributes nothing."""
    part_lse = part_lse.masked_fill(torch.isinf(part_lse) & (part_lse > 0), -math.inf)
    new_lse = torch.logaddexp(acc_lse, part_lse)
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    old_weight = lse_to_out(torch.exp(acc_lse - safe)).unsqueeze(-1)
    new_weight = lse_to_out(torch.exp(part_lse - safe)).unsqueeze(-1)
    return acc_out * old_weight + part_out.to(acc_out.dtype) * new_weight, new_lse


def _ring_forward(q, k, v, group, causal, scale, layout, softcap, window):
    world, rank = _world(group)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf, dtype=acc_dtype, device=q.device)
    ring = _Ring(group)
    kv = (k, v)
    for step in range(world):
        pending = ring.start(kv) if step + 1 < world else None
        for rows, keys, step_causal, step_window in _step_work(step, rank, world, q.shape[1], causal, layout, window):
            part_out, part_lse = _local_forward(_part(q, rows), _part(kv[0], keys), _part(kv[1], keys),
                                                step_causal, scale, softcap, step_window)
            _merge(out, lse, part_out, part_lse.to(acc_dtype), rows)
        if pending is not None:
            kv = tuple(_Ring.finish(pending))
    lse = lse.masked_fill(torch.isneginf(lse), math.inf)  # back to cute_attn's convention
    return out.to(q.dtype), lse.to(acc_dtype)  # fp32 (fp64 only for the CPU tests' fp64 inputs)


def _ring_backward(dout, q, k, v, out, lse, group, causal, scale, layout, deterministic, softcap, window):
    world, rank = _world(group)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)

    def step_shares(step, k_here, v_here):
        shares = []
        for rows, keys, step_causal, step_window in _step_work(step, rank, world, q.shape[1], causal, layout, window):
            part = _local_backward(_part(dout, rows), _part(q, rows), _part(k_here, keys), _part(v_here, keys),
                                   _part(out, rows), _part(lse, rows, dim=2), step_causal, scale, deterministic,
                                   softcap, step_window)
            _part(dq, rows).add_(part[0])
            shares.append((keys, part))

        def add(dk_acc, dv_acc):
            for keys, part in shares:
                _part(dk_acc, keys).add_(part[1])
                _part(dv_acc, keys).add_(part[2])
        return add

    dk, dv = _gradient_ring(k, v, group, acc_dtype, step_shares)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _gradient_ring(k, v, group, acc_dtype, step_shares):
    """The backward's ring, dense or varlen: K/V travel around it and the dK/dV accumulated for
    them follow one hop behind (posted once a step's shares are in); after the last step one more
    hop brings them home. ``step_shares(step, k_here, v_here)`` runs a step's local backward calls
    (adding their dQ itself) and returns a function that adds their dK/dV shares into the
    accumulators of the slice in hand. Returns the home slice's (dk, dv) in ``acc_dtype``."""
    world, _ = _world(group)
    ring = _Ring(group)
    k_here, v_here = k, v
    dk_acc = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
    dv_acc = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
    dkv_pending = None
    for step in range(world):
        kv_pending = ring.start((k_here, v_here)) if step + 1 < world else None
        add_shares = step_shares(step, k_here, v_here)
        if dkv_pending is not None:  # the accumulators of the slice in hand
            dk_acc, dv_acc = _Ring.finish(dkv_pending)
        add_shares(dk_acc, dv_acc)
        if world > 1:
            dkv_pending = ring.start((dk_acc, dv_acc))
        if kv_pending is not None:
            k_here, v_here = _Ring.finish(kv_pending)
    if dkv_pending is not None:
        dk_acc, dv_acc = _Ring.finish(dkv_pending)
    return dk_acc, dv_acc


class _RingFlashAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, layout, deterministic, softcap, window):
        out, lse = _ring_forward(q, k, v, group, causal, scale, layout, softcap, window)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, scale, layout, deterministic, softcap, window)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, layout, deterministic, softcap, window = ctx.args
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, group, causal, scale, layout,
                                    deterministic, softcap, window)
        return dq, dk, dv, None, None, None, None, None, None, None


def ring_flash_attn_func(q, k, v, *, group=None, causal: bool = False, softmax_scale: float | None = None,
                         window_size=(-1, -1), softcap: float = 0.0, deterministic: bool = False,
                         layout: str = "zigzag", return_lse: bool = False):
    """Exact attention over a sequence split across the ranks of ``group`` (default: the world).

    q (batch, seqlen / world, heads, d) and k, v (batch, seqlen / world, heads_kv, d) are this rank's
    slices in ``layout`` (``shard_sequence``); returns this rank's slice of the output (and, with
    ``return_lse``, of the LSE (batch, heads, seqlen / world)), with autograd. Every rank calls it
    with the same arguments. ``causal`` and ``window_size`` (left, right; -1 unbounded; causal
    sets right = 0) are over the whole sequence, as in ``flash_attn_func``: each step attends only
    the pieces of the visiting slice that the window reaches, each piece pair as a local call with
    its own window (``_band``); ``softcap`` as in ``flash_attn_func`` (exact: each step caps its
    own scores, the merge goes through their LSE)."""
    _check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise TypeError(f"{name} must be a 4-dim torch.Tensor (batch, seqlen / world, heads, head_dim)")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    from cute_attn.interface import _window

    left, right = _window(window_size)
    if causal:
        right = 0
    # None: no window (the plain ring); else each side's reach, None where unbounded
    window = None if (left, right) == (-1, -1) or (causal and left < 0) else (
        None if left < 0 else left, None if right < 0 else right)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < math.inf:
        raise ValueError(f"softcap must be a finite number >= 0 (0.0: off), got {softcap!r}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must hold slices of one sequence (equal lengths), got {q.shape[1]} and {k.shape[1]}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout 'zigzag' needs an even slice length (two pieces), got {q.shape[1]}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    out, lse = _RingFlashAttn.apply(q, k, v, group, causal, scale, layout, deterministic, float(softcap), window)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------- varlen
def _local_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                          scale: float, softcap: float):
    """(out, lse) of one varlen step: cute_attn's varlen forward (the CPU tests put the reference here)."""
    from cute_attn import interface

    return interface.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                    softmax_scale=scale, softcap=softcap, return_lse=True)


def _local_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                           causal: bool, scale: float, deterministic: bool, softcap: float):
    """(dq, dk, dv) shares of one varlen step from the merged out and lse: cute_attn's varlen backward."""
    from cute_attn import interface

    return interface.varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     causal=causal, softmax_scale=scale, softcap=softcap, deterministic=deterministic)


class _VarlenParts:
    """The rows of a packed slice that a step's part names: "all", or the "first" / "second" half
    of every sequence (row indices built on the device: no host sync), with that part's cu_seqlens
    and longest sequence."""

    def __init__(self, cu_seqlens: torch.Tensor, total: int, max_seqlen: int):
        self.cu, self.total, self.max = cu_seqlens, total, max_seqlen
        half_cu = cu_seqlens.to(torch.int64) // 2
        t = torch.arange(total // 2, device=cu_seqlens.device)
        sequence = torch.searchsorted(half_cu[1:], t, right=True)  # the sequence of each half-row
        first = cu_seqlens.to(torch.int64)[sequence] + (t - half_cu[sequence])
        self.index = {"first": first, "second": first + (half_cu[1:] - half_cu[:-1])[sequence]}
        self.index32 = {part: index.to(torch.int32) for part, index in self.index.items()}  # the merge kernel's
        self.half_cu = half_cu.to(torch.int32)

    def rows(self, t: torch.Tensor, part: str, dim: int = 0) -> torch.Tensor:
        return t if part == "all" else t.index_select(dim, self.index[part])

    def lengths(self, part: str):
        """(cu_seqlens, max_seqlen) of the part."""
        return (self.cu, self.max) if part == "all" else (self.half_cu, self.max // 2)

    def add(self, acc: torch.Tensor, part: str, value: torch.Tensor) -> None:
        if part == "all":
            acc.add_(value)
        else:
            acc.index_add_(0, self.index[part], value.to(acc.dtype))


def _ring_varlen_forward(q, k, v, cu_seqlens, max_seqlen, group, causal, scale, layout, softcap):
    world, rank = _world(group)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=acc_dtype, device=q.device)
    parts = _VarlenParts(cu_seqlens, q.shape[0], max_seqlen)
    ring = _Ring(group)
    kv = (k, v)
    for step in range(world):
        pending = ring.start(kv) if step + 1 < world else None
        for rows, keys, step_causal in _halves_work(step, rank, world, causal, layout):
            part_out, part_lse = _local_varlen_forward(
                parts.rows(q, rows), parts.rows(kv[0], keys), parts.rows(kv[1], keys), parts.lengths(rows)[0],
                parts.lengths(keys)[0], parts.lengths(rows)[1], parts.lengths(keys)[1], step_causal, scale, softcap)
            if _fused_merge(out.unsqueeze(0), lse.unsqueeze(0), part_out.unsqueeze(0), part_lse.unsqueeze(0),
                            parts.index32.get(rows)):
                continue
            acc_out, acc_lse = parts.rows(out, rows), parts.rows(lse, rows, dim=1)
            new_out, new_lse = _combined(acc_out, acc_lse, part_out, part_lse.to(acc_dtype),
                                         lse_to_out=lambda t: t.transpose(0, 1))
            if rows == "all":
                out, lse = new_out, new_lse
            else:
                out.index_copy_(0, parts.index[rows], new_out)
                lse.index_copy_(1, parts.index[rows], new_lse)
        if pending is not None:
            kv = tuple(_Ring.finish(pending))
    lse = lse.masked_fill(torch.isneginf(lse), math.inf)
    return out.to(q.dtype), lse.to(acc_dtype)


def _ring_varlen_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, group, causal, scale, layout,
                          deterministic, softcap):
    world, rank = _world(group)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    parts = _VarlenParts(cu_seqlens, q.shape[0], max_seqlen)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)

    def step_shares(step, k_here, v_here):
        shares = []
        for rows, keys, step_causal in _halves_work(step, rank, world, causal, layout):
            (cu_q, max_q), (cu_k, max_k) = parts.lengths(rows), parts.lengths(keys)
            dq_i, dk_i, dv_i = _local_varlen_backward(
                parts.rows(dout, rows), parts.rows(q, rows), parts.rows(k_here, keys), parts.rows(v_here, keys),
                parts.rows(out, rows), parts.rows(lse, rows, dim=1).contiguous(), cu_q, cu_k, max_q, max_k,
                step_causal, scale, deterministic, softcap)
            parts.add(dq, rows, dq_i)
            shares.append((keys, dk_i, dv_i))

        def add(dk_acc, dv_acc):
            for keys, dk_i, dv_i in shares:
                parts.add(dk_acc, keys, dk_i)
                parts.add(dv_acc, keys, dv_i)
        return add

    dk, dv = _gradient_ring(k, v, group, acc_dtype, step_shares)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingFlashAttnVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, group, causal, scale, layout, deterministic, softcap):
        out, lse = _ring_varlen_forward(q, k, v, cu_seqlens, max_seqlen, group, causal, scale, layout, softcap)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.args = (max_seqlen, group, causal, scale, layout, deterministic, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        max_seqlen, group, causal, scale, layout, deterministic, softcap = ctx.args
        dq, dk, dv = _ring_varlen_backward(dout.contiguous(), q, k, v, out, lse, cu_seqlens, max_seqlen, group, causal,
                                           scale, layout, deterministic, softcap)
        return (dq, dk, dv) + (None,) * 8


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen: int, *, group=None, causal: bool = False,
                                softmax_scale: float | None = None, softcap: float = 0.0, deterministic: bool = False,
                                layout: str = "zigzag", return_lse: bool = False):
    """``ring_flash_attn_func`` for packed variable-length batches: q (total / world, heads, d) and
    k, v (total / world, heads_kv, d) hold this rank's part of every sequence (``shard_varlen``),
    cu_seqlens (batch + 1,) int32 the local offsets (the global ones / world, the same on every
    rank) and max_seqlen the longest local sequence. Every sequence's length must be a multiple of
    world (2 x world for zigzag). Returns this rank's out (and, with ``return_lse``, lse (heads,
    total / world)), with autograd. ``causal`` and ``softcap`` as in ``flash_attn_varlen_func``, per
    sequence; no sliding window here yet (its band differs per sequence)."""
    _check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise TypeError(f"{name} must be a 3-dim torch.Tensor (total / world, heads, head_dim)")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise TypeError("cu_seqlens must be a 1-dim int32 torch.Tensor (batch + 1,)")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise TypeError(f"max_seqlen must be an int >= 0, got {max_seqlen!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < math.inf:
        raise ValueError(f"softcap must be a finite number >= 0 (0.0: off), got {softcap!r}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must hold parts of the same sequences (equal totals), got {q.shape[0]} and "
                         f"{k.shape[0]}")
    if layout == "zigzag" and (q.shape[0] % 2 or max_seqlen % 2):
        raise ValueError("layout 'zigzag' needs every local sequence of even length (two pieces)")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    out, lse = _RingFlashAttnVarlen.apply(q, k, v, cu_seqlens, max_seqlen, group, causal, scale, layout,
                                          deterministic, float(softcap))
    return (out, lse) if return_lse else out
