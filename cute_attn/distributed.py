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
    world, _ = _world(group)
    slices = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(slices, x.contiguous(), group=group)
    if layout == "contiguous":
        return torch.cat(slices, dim=dim)
    halves = [s.chunk(2, dim=dim) for s in slices]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


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
    source = (rank - step) % world
    if window is not None:
        left, right = window
        work = []
        for q_local, q_global, q_len in _slice_pieces(rank, world, length, layout):
            for k_local, k_global, k_len in _slice_pieces(source, world, length, layout):
                band = _band(q_global, q_len, k_global, k_len, left, right)
                if band is not None:
                    (row, rows), (key, keys), band_window = band
                    work.append(((q_local + row, rows), (k_local + key, keys), False, band_window))
        return work
    if not causal:
        return [(_WHOLE, _WHOLE, False, (-1, -1))]
    if step == 0:
        return [(_WHOLE, _WHOLE, True, (-1, -1))]
    if layout == "contiguous":
        return [(_WHOLE, _WHOLE, False, (-1, -1))] if source < rank else []
    half = length // 2  # zigzag: all queries on the first key piece, or the second query piece on all keys
    return [(_WHOLE, (0, half), False, (-1, -1))] if source < rank else [((half, half), _WHOLE, False, (-1, -1))]


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
    """out/lse (fp32 accumulators) <- the exact combination with a step's result on ``rows``.
    cute_attn's LSE is +inf for a row that saw no key; such a row contributes nothing."""
    part_lse = part_lse.masked_fill(torch.isinf(part_lse) & (part_lse > 0), -math.inf)
    acc_out, acc_lse = _part(out, rows), _part(lse, rows, dim=2)
    new_lse = torch.logaddexp(acc_lse, part_lse)
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    old_weight = torch.exp(acc_lse - safe).transpose(1, 2).unsqueeze(-1)
    new_weight = torch.exp(part_lse - safe).transpose(1, 2).unsqueeze(-1)
    acc_out.copy_(acc_out * old_weight + part_out.to(acc_out.dtype) * new_weight)
    acc_lse.copy_(new_lse)


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
    ring = _Ring(group)
    # K/V and the dK/dV accumulated for them travel together (the accumulators one hop behind,
    # posted once this step's shares are in); after the last step one more hop brings them home
    k_here, v_here = k, v
    dk_acc = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
    dv_acc = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
    dkv_pending = None
    for step in range(world):
        kv_pending = ring.start((k_here, v_here)) if step + 1 < world else None
        shares = []
        for rows, keys, step_causal, step_window in _step_work(step, rank, world, q.shape[1], causal, layout, window):
            part = _local_backward(_part(dout, rows), _part(q, rows), _part(k_here, keys), _part(v_here, keys),
                                   _part(out, rows), _part(lse, rows, dim=2), step_causal, scale, deterministic,
                                   softcap, step_window)
            _part(dq, rows).add_(part[0])
            shares.append((keys, part))
        if dkv_pending is not None:  # the accumulators of the slice in hand
            dk_acc, dv_acc = _Ring.finish(dkv_pending)
        for keys, part in shares:
            _part(dk_acc, keys).add_(part[1])
            _part(dv_acc, keys).add_(part[2])
        if world > 1:
            dkv_pending = ring.start((dk_acc, dv_acc))
        if kv_pending is not None:
            k_here, v_here = _Ring.finish(kv_pending)
    if dkv_pending is not None:
        dk_acc, dv_acc = _Ring.finish(dkv_pending)
    return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


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
