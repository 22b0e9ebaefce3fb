"""SM80 building blocks shared by the forward and backward kernels.

- ``smem_layout_atom``: the swizzled shared-memory tile every Q/K/V/O/dO buffer is built from.
- ``gmem_tiled_copy``: 128-bit ``cp.async`` (or plain 128-bit) copies, threads laid out along rows.
- ``tiled_mma``: warps stacked along M, each issuing ``mma.sync.m16n8k16`` with fp32 accumulators.
- ``gemm`` / ``gemm_rs``: one tile GEMM whose ``ldmatrix`` loads of k-slice k+1 are issued before
  the MMAs of k-slice k, so shared-memory latency hides behind tensor-core work.
- ``copy_rows``: a predicated tile copy for the sequence and head-dim boundaries (zero-fill).
"""

from typing import Type

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

COPY_BITS = 128


def atom_columns(head_dim: int) -> int:
    """Columns of a shared-memory atom row (``smem_layout_atom``): 64, or 32 where the head dim is
    not a multiple of 64."""
    return 64 if head_dim % 64 == 0 else 32


def copy_rows_per_pass(dtype: Type[cutlass.Numeric], head_dim: int, num_threads: int) -> int:
    """Rows one pass of ``gmem_tiled_copy`` covers: a tile must hold whole passes, or the threads
    past its last row would write shared memory beyond it (the SM80 forward asserts it)."""
    return num_threads // (atom_columns(head_dim) // (COPY_BITS // dtype.width))


def smem_layout_atom(dtype: Type[cutlass.Numeric], head_dim: int) -> cute.ComposedLayout:
    """8 rows x 64 (or 32) columns, XOR-swizzled so that both the row-wise ``cp.async`` writes and
    the column-wise ``ldmatrix`` reads of 8 rows hit 8 different 16-byte bank groups."""
    cols = atom_columns(head_dim)
    swizzle_bits = 3 if cols == 64 else 2
    # Swizzle<B, 3, 3>: permute 16-byte chunks (3 low bits = 8 fp16) within 2^B chunks of a row.
    return cute.make_composed_layout(
        cute.make_swizzle(swizzle_bits, 3, 3),
        0,
        cute.make_ordered_layout((8, cols), order=(1, 0)),
    )


def gmem_tiled_copy(dtype, head_dim: int, num_threads: int, asynchronous: bool, cols: int | None = None) -> cute.TiledCopy:
    """Threads cover one swizzle atom's row with 128-bit vectors (or ``cols`` columns); the rest go
    down the rows."""
    elems = COPY_BITS // dtype.width
    if cols is None:
        cols = atom_columns(head_dim)
    threads_per_row = cols // elems
    op = (
        cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
        if asynchronous
        else cute.nvgpu.CopyUniversalOp()
    )
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=COPY_BITS)
    thr_layout = cute.make_ordered_layout((num_threads // threads_per_row, threads_per_row), order=(1, 0))
    return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, elems)))


def tiled_mma(dtype, num_warps: int, warps_n: int = 1) -> cute.TiledMma:
    """``num_warps`` warps of m16n8k16; with warps_n == 1 each warp owns whole rows of the result.

    The N permutation of 16 lets one ``ldmatrix.x4`` feed two n8 MMAs of the B operand."""
    warps_m = num_warps // warps_n
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)),
        (warps_m, warps_n, 1),
        permutation_mnk=(warps_m * 16, warps_n * 16, 16),
    )


def ldmatrix_atom(dtype, transpose: bool = False) -> cute.CopyAtom:
    return cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=transpose, num_matrices=4), dtype)


@cute.jit
def gemm(
    mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    tCsA: cute.Tensor,
    tCsB: cute.Tensor,
    copy_A: cute.TiledCopy,
    copy_B: cute.TiledCopy,
    A_in_regs: cutlass.Constexpr[bool] = False,
):
    """acc += A @ B^T with A, B in shared memory (A may already sit in registers)."""
    tCrA_view = copy_A.retile(tCrA)
    tCrB_view = copy_B.retile(tCrB)
    num_k = cute.size(tCsB.shape[2])
    if const_expr(not A_in_regs):
        cute.copy(copy_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
    cute.copy(copy_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
    for k in cutlass.range_constexpr(num_k):
        if const_expr(k + 1 < num_k):
            if const_expr(not A_in_regs):
                cute.copy(copy_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
            cute.copy(copy_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
        cute.gemm(mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def gemm_rs(
    mma: cute.TiledMma,
    acc: cute.Tensor,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    tCsB: cute.Tensor,
    copy_B: cute.TiledCopy,
    n_chunks: cutlass.Constexpr[int] = 1,
):
    """acc += A @ B^T with A already in registers (P) and B in shared memory (V^T).

    ``n_chunks`` > 1 runs the k loop once per slice of N: only one slice of B's registers is
    live at a time (for d128, O = P V would otherwise hold two k-slices of all 128 columns of V)."""
    num_k = cute.size(tCrA.shape[2])
    n_copy = cute.size(tCsB.shape[1]) // n_chunks  # copy-tile columns per chunk
    n_mma = cute.size(tCrB.shape[1]) // n_chunks  # MMA-tile columns per chunk
    # split the N modes into (columns per chunk, chunk)
    acc_c = cute.logical_divide(acc, (None, None, n_mma))
    tCrB_c = cute.logical_divide(tCrB, (None, n_mma, None))
    tCrB_view_c = cute.logical_divide(copy_B.retile(tCrB), (None, n_copy, None))
    tCsB_c = cute.logical_divide(tCsB, (None, n_copy, None))
    for c in cutlass.range_constexpr(n_chunks):
        B_view = tCrB_view_c[None, (None, c), None]
        B_smem = tCsB_c[None, (None, c), None]
        cute.copy(copy_B, B_smem[None, None, 0], B_view[None, None, 0])
        for k in cutlass.range_constexpr(num_k):
            if const_expr(k + 1 < num_k):
                cute.copy(copy_B, B_smem[None, None, k + 1], B_view[None, None, k + 1])
            A = tCrA[None, None, k]
            cute.gemm(mma, acc_c[None, None, (None, c)], A, tCrB_c[None, (None, c), k], acc_c[None, None, (None, c)])


@cute.jit
def vector_predicate(
    dst: cute.Tensor,
    coords: cute.Tensor,
    m: cutlass.Constexpr[int],
    rows_left: Int32,
    cols_valid: Int32,
    check_rows: cutlass.Constexpr[bool],
    check_cols: cutlass.Constexpr[bool],
) -> cute.Tensor:
    """One bool per 128-bit vector of row ``m`` of a (CPY, CPY_ROWS, CPY_COLS) partition."""
    pred = cute.make_rmem_tensor(
        cute.make_layout((cute.size(dst.shape[0][1]), cute.size(dst.shape[2])), stride=(cute.size(dst.shape[2]), 1)),
        Boolean,
    )
    for v in cutlass.range_constexpr(cute.size(pred.shape[0])):
        for k in cutlass.range_constexpr(cute.size(pred.shape[1])):
            ok = Boolean(True)
            if const_expr(check_rows):
                ok = coords[(0, v), m, k][0] < rows_left
            if const_expr(check_cols):
                ok = ok & (coords[(0, v), m, k][1] < cols_valid)
            pred[v, k] = ok
    return pred


@cute.jit
def copy_rows(
    tiled_copy: cute.TiledCopy,
    src: cute.Tensor,
    dst: cute.Tensor,
    coords: cute.Tensor,
    rows_left: Int32,
    cols_valid: Int32,
    check_rows: cutlass.Constexpr[bool],
    check_cols: cutlass.Constexpr[bool],
):
    """Copy a (CPY, CPY_ROWS, CPY_COLS) partition, predicating rows >= ``rows_left`` and columns >=
    ``cols_valid``. Predicated-off ``cp.async`` vectors are zero-filled, which is what padded head-dim
    columns and rows past the sequence end must hold (0 * garbage could be NaN in P @ V)."""
    if const_expr(not check_rows and not check_cols):
        cute.copy(tiled_copy, src, dst)
    else:
        for m in cutlass.range_constexpr(cute.size(dst.shape[1])):
            pred = vector_predicate(dst, coords, m, rows_left, cols_valid, check_rows, check_cols)
            cute.copy(tiled_copy, src[None, m, None], dst[None, m, None], pred=pred)


@cute.jit
def store_rows(
    tiled_copy: cute.TiledCopy,
    src: cute.Tensor,
    dst: cute.Tensor,
    coords: cute.Tensor,
    rows_left: Int32,
    cols_valid: Int32,
    check_cols: cutlass.Constexpr[bool],
):
    """Register -> global store of a tile, skipping rows >= ``rows_left`` and columns >= ``cols_valid``."""
    for m in cutlass.range_constexpr(cute.size(dst.shape[1])):
        if coords[0, m, 0][0] < rows_left:
            if const_expr(check_cols):
                pred = vector_predicate(dst, coords, m, rows_left, cols_valid, False, True)
                cute.copy(tiled_copy, src[None, m, None], dst[None, m, None], pred=pred)
            else:
                cute.copy(tiled_copy, src[None, m, None], dst[None, m, None])


@cute.jit
def store_acc_tile(
    rX: cute.Tensor,
    sX: cute.Tensor,
    mma: cute.TiledMma,
    copy_store: cute.TiledCopy,
    gX: cute.Tensor,
    tidx: Int32,
    rows_left: Int32,
    cols_valid: Int32,
    check_cols: cutlass.Constexpr[bool],
    transposed: cutlass.Constexpr[bool] = False,
):
    """Write a converted accumulator tile (MMA C layout in registers) to global memory through
    shared memory ``sX``, so that the global stores are 128-bit and row-contiguous. The caller makes
    sure nobody still reads ``sX``'s memory (a barrier) before calling. ``transposed``: the
    accumulator holds the tile's transpose (columns x rows)."""
    thr_store, tXrX, coords = acc_tile_to_rows(rX, sX, mma, copy_store, tidx, transposed)
    store_rows(copy_store, tXrX, thr_store.partition_D(gX), coords, rows_left, cols_valid, check_cols)


@cute.jit
def acc_tile_to_rows(rX: cute.Tensor, sX: cute.Tensor, mma: cute.TiledMma, copy_store: cute.TiledCopy, tidx: Int32,
                     transposed: cutlass.Constexpr[bool] = False):
    """``store_acc_tile``'s first half: the accumulator tile through ``sX`` into each thread's
    row-contiguous vectors of ``copy_store``. Returns (the thread's copy slice, its vectors, their
    (row, col) coordinates). ``transposed``: rX holds sX's transpose, written element by element
    into a transposed view (an accumulator's neighbours are then a row apart)."""
    pair = 1 if const_expr(transposed) else 2
    r2s = cute.make_tiled_copy_C(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), rX.element_type, num_bits_per_copy=pair * rX.element_type.width),
        mma,
    ).get_slice(tidx)
    sX_acc = sX
    if const_expr(transposed):
        sX_acc = cute.make_tensor(sX.iterator, cute.select(sX.layout, mode=[1, 0]))
    cute.copy(r2s, r2s.retile(rX), r2s.partition_D(sX_acc))
    cute.arch.barrier()
    thr_store = copy_store.get_slice(tidx)
    tXsX = thr_store.partition_S(sX)
    tXrX = cute.make_fragment_like(tXsX, rX.element_type)
    cute.autovec_copy(tXsX, tXrX)
    coords = thr_store.partition_S(cute.make_identity_tensor((cute.size(sX.shape[0]), cute.size(sX.shape[1]))))
    return thr_store, tXrX, coords
