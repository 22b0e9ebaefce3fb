"""Hopper building blocks shared by the SM90 kernels: swizzled shared-memory layouts that both TMA
and wgmma understand, warpgroup MMAs, TMA copies, and the named barriers.
"""

import enum

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

WARPGROUP_THREADS = 128


class NamedBarrier(enum.IntEnum):
    """Hardware named barriers (0 is __syncthreads)."""

    EPILOGUE = 1  # all consumer threads: O (a whole tile, in Q's buffer) in shared memory
    SCHEDULER_WG1 = 2  # ping-pong: consumer warpgroup i waits on SCHEDULER_WG1 + i - 1
    EPILOGUE_WG1 = 5  # consumer warpgroup i's threads: its rows of O in shared memory (5, 6, 7)
    V_TAIL_WG1 = 8  # consumer warpgroup i's threads: V's rows past the keys zeroed (8, 9, 10)


def smem_layout(dtype, rows: int, cols: int, stages: int | None = None, slice_cols: int | None = None):
    """(rows, cols[, stages]) row-major tile with the widest swizzle a row of ``cols`` allows: the
    layout TMA writes and wgmma reads (K-major for Q, K; MN-major for V seen transposed). A tile
    that warpgroups read MN-major in column slices of ``slice_cols`` takes the widest swizzle that
    fits one slice (a wgmma operand must start on a swizzle atom)."""
    width = cols if slice_cols is None else slice_cols
    atom = warpgroup.make_smem_layout_atom(hopper.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, width), dtype)
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    return cute.tile_to_shape(atom, shape, (0, 1) if stages is None else (0, 1, 2))


def tiled_mma(dtype, num_warpgroups: int, n: int, b_major_mn: bool, a_in_registers: bool,
              warpgroups_along_n: bool = False, a_major_mn: bool = False) -> cute.TiledMma:
    """wgmma with warpgroups stacked along M (64 rows each) and the whole N in one instruction; or,
    with ``warpgroups_along_n``, side by side along N (each takes ``n`` columns of every row).
    ``a_major_mn``: A read MN-major from shared memory (a transposed view, e.g. dO^T)."""
    return hopper.make_trivial_tiled_mma(
        dtype, dtype,
        OperandMajorMode.MN if a_major_mn else OperandMajorMode.K,
        OperandMajorMode.MN if b_major_mn else OperandMajorMode.K,
        Float32,
        atom_layout_mnk=(1, num_warpgroups, 1) if warpgroups_along_n else (num_warpgroups, 1, 1),
        tiler_mn=(64, n),
        a_source=warpgroup.OperandSource.RMEM if a_in_registers else warpgroup.OperandSource.SMEM,
    )


@cute.jit
def wgmma(
    mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
    wait: cutlass.Constexpr[int],
):
    """acc (+)= A B as one wgmma group over the K blocks; ``wait`` >= 0 waits until at most that
    many groups are still in flight, -1 returns with this one in flight."""
    warpgroup.fence()
    atom = cute.make_mma_atom(mma.op)  # a fresh atom: its accumulate flag is changed below
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wait >= 0):
        warpgroup.wait_group(wait)


def tma_tiles(atom: cute.CopyAtom, gmem: cute.Tensor, smem: cute.Tensor, cta_rank=0, cluster_size: int = 1):
    """Partition a (rows, cols, ...) global tile view and a (rows, cols, ...) shared buffer for
    ``atom``: returns (shared, global) with the tile as mode 0 and the rest (block, stage) after.
    A multicast atom of ``cluster_size`` CTAs: the slice that CTA ``cta_rank`` loads."""
    s, g = cpasync.tma_partition(
        atom, cta_rank, cute.make_layout(cluster_size), cute.group_modes(smem, 0, 2), cute.group_modes(gmem, 0, 2)
    )
    return s, g


def release_stage(pipe, state):
    """``pipe.consumer_release(state)`` by every consumer thread, for pipelines whose consumer
    group counts one arrive per thread. The DSL's release arrives from lane 0 of each warp, and
    under register pressure ptxas recomputes that predicate from the thread index (S2R) at every
    release: a short-scoreboard stall ncu showed in the SM90 backward."""
    pipe.sync_object_empty.arrive(state.index, pipe.consumer_mask)


@cute.jit
def zero_rows_from(sX: cute.Tensor, first_row, tid, num_threads: cutlass.Constexpr[int]):
    """Rows ``first_row`` on of the (rows, cols) shared-memory tile ``sX`` set to zero by
    ``num_threads`` threads (``tid`` 0..num_threads - 1), 8 columns at a time. A K/V block read
    whole by TMA holds, past its sequence's keys, rows the call never wrote (a cache's rows past
    cache_seqlens, a page's slots past its sequence's keys): masked scores give them probability 0,
    but 0 times NaN is NaN, so they must read as zeros, as FlashAttention-2's zero-filling loads
    make them. The caller then fences (``fence_view_async_shared``) and synchronises its readers."""
    rows, cols = cute.size(sX, mode=[0]), cute.size(sX, mode=[1])
    per_row = cols // 8
    count = (rows - first_row) * per_row
    for i in cutlass.range(tid, count, num_threads, unroll=1):
        r = i // per_row
        c = (i - r * per_row) * 8
        for j in cutlass.range_constexpr(8):
            sX[first_row + r, c + j] = sX.element_type(0.0)
