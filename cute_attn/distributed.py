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
def _local_forward(q, k, v, causal: bool, scale: float, softcap: float):
    """(out, lse) of one step: cute_attn's forward kernel (the CPU tests put the reference here)."""
    from cute_attn import interface

    return interface.forward(q, k, v, causal=causal, softmax_scale=scale, softcap=softcap, return_lse=True)


def _local_backward(dout, q, k, v, out, lse, causal: bool, scale: float, deterministic: bool, softcap: float):
    """(dq, dk, dv) shares of one step, from the merged out and lse: cute_attn's backward kernel
    (it recomputes each score, capped, and its probability from the merged lse)."""
    from cute_attn import interface

    return interface.backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, softcap=softcap,
                              deterministic=deterministic)


def _steps_plan(step: int, rank: int, world: int, causal: bool, layout: str):
    """What this rank computes at ``step`` of the ring (holding the slice of rank (rank - step) %
    world): (causal, query part, K/V part), each part "all", "first" or "second" half, or None to
    skip the step."""
    if not causal:
        return False, "all", "all"
    if step == 0:
        return True, "all", "all"
    source = (rank - step) % world
    if layout == "contiguous":
        return (False, "all", "all") if source < rank else None
    # zigzag: see the module docstring
    return (False, "all", "first") if source < rank else (False, "second", "all")


def _part(t: torch.Tensor, which: str, dim: int = 1) -> torch.Tensor:
    if which == "all":
        return t
    half = t.shape[dim] // 2
    return t.narrow(dim, 0 if which == "first" else half, half)


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


def _ring_forward(q, k, v, group, causal, scale, layout, softcap):
    world, rank = _world(group)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf, dtype=acc_dtype, device=q.device)
    ring = _Ring(group)
    kv = (k, v)
    for step in range(world):
        pending = ring.start(kv) if step + 1 < world else None
        plan = _steps_plan(step, rank, world, causal, layout)
        if plan is not None:
            step_causal, rows, keys = plan
            part_out, part_lse = _local_forward(_part(q, rows), _part(kv[0], keys), _part(kv[1], keys),
                                                step_causal, scale, softcap)
            _merge(out, lse, part_out, part_lse.to(acc_dtype), rows)
        if pending is not None:
            kv = tuple(_Ring.finish(pending))
    lse = lse.masked_fill(torch.isneginf(lse), math.inf)  # back to cute_attn's convention
    return out.to(q.dtype), lse.to(acc_dtype)  # fp32 (fp64 only for the CPU tests' fp64 inputs)


def _ring_backward(dout, q, k, v, out, lse, group, causal, scale, layout, deterministic, softcap):
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
        plan = _steps_plan(step, rank, world, causal, layout)
        part = None
        if plan is not None:
            step_causal, rows, keys = plan
            part = _local_backward(_part(dout, rows), _part(q, rows), _part(k_here, keys), _part(v_here, keys),
                                   _part(out, rows), _part(lse, rows, dim=2), step_causal, scale, deterministic,
                                   softcap)
            _part(dq, rows).add_(part[0])
        if dkv_pending is not None:  # the accumulators of the slice in hand
            dk_acc, dv_acc = _Ring.finish(dkv_pending)
        if part is not None:
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
    def forward(ctx, q, k, v, group, causal, scale, layout, deterministic, softcap):
        out, lse = _ring_forward(q, k, v, group, causal, scale, layout, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, scale, layout, deterministic, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, layout, deterministic, softcap = ctx.args
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, group, causal, scale, layout,
                                    deterministic, softcap)
        return dq, dk, dv, None, None, None, None, None, None


def ring_flash_attn_func(q, k, v, *, group=None, causal: bool = False, softmax_scale: float | None = None,
                         window_size=(-1, -1), softcap: float = 0.0, deterministic: bool = False,
                         layout: str = "zigzag", return_lse: bool = False):
    """Exact attention over a sequence split across the ranks of ``group`` (default: the world).

    q (batch, seqlen / world, heads, d) and k, v (batch, seqlen / world, heads_kv, d) are this rank's
    slices in ``layout`` (``shard_sequence``); returns this rank's slice of the output (and, with
    ``return_lse``, of the LSE (batch, heads, seqlen / world)), with autograd. Every rank calls it
    with the same arguments. ``causal`` is over the whole sequence; ``softcap`` as in
    ``flash_attn_func`` (exact: each step caps its own scores, the merge goes through their LSE).
    window_size is not supported by the ring yet (each step would need its keys' offset)."""
    _check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise TypeError(f"{name} must be a 4-dim torch.Tensor (batch, seqlen / world, heads, head_dim)")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("ring_flash_attn_func: window_size is not supported by the ring yet")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < math.inf:
        raise ValueError(f"softcap must be a finite number >= 0 (0.0: off), got {softcap!r}")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"q and k must hold slices of one sequence (equal lengths), got {q.shape[1]} and {k.shape[1]}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"layout 'zigzag' needs an even slice length (two pieces), got {q.shape[1]}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    out, lse = _RingFlashAttn.apply(q, k, v, group, causal, scale, layout, deterministic, float(softcap))
    return (out, lse) if return_lse else out
