"""Split-KV combine: merge the fp32 partial outputs and LSEs of the split forward (any GPU, SM80+).

The split forward (kernels/sm80/forward.py, feature ``split``) writes, for every row (b, i, h) and
split s, a partial output O_s normalised over the split's own keys and its natural-log LSE_s
(+inf: the split saw no key, and its O_s must get weight 0). Per row:

    lse = log(sum_s exp(LSE_s)),   out = sum_s exp(LSE_s - lse) * O_s    (in the output dtype)

and a row whose splits are all empty gets out = 0, lse = +inf. Nothing ever evaluates exp(inf - inf):
an empty (or out-of-range) split's argument is replaced by -inf before the exp2, so its weight is 0.

Layout of the work (memory-bound; each partial is read once, in 128-bit loads):
- A row's columns are spread over ``threads_per_row`` consecutive lanes (a power of two <= 32),
  each owning ``chunks_per_thread`` 4-float chunks; a warp holds ``rows_per_warp`` = 32 /
  threads_per_row consecutive rows (consecutive h: one contiguous span of OAccum per split).
- ``group`` warps share a row's splits (warp g of the group reads splits g, g + group, ..., four per
  loop trip, all loads issued before the FMAs), so that a few rows with many splits still have many
  loads in flight; warps 1.. of a group leave their sums in shared memory for warp 0, which converts
  and stores the row. ``group`` is chosen at launch (a power of two up to num_warps, at most the
  number of splits): 1 once the grid has enough warps without it (many rows, e.g. seqlen_q > 1).
- The row's LSE comes first, in every warp of the group (the LSEs are a few hundred bytes, read
  from L1): lane c reads splits c, c + threads_per_row, ..., max then sum of exp2, each reduced
  with shuffles over the row's lanes. No loop keeps per-split state: any number of splits works.
- The partials of a warp's first trip of splits are loaded before the row's LSE is known, so that
  their L2 round trip overlaps the LSEs'.
The split forward merges a decode step's tiles itself with the same ``merge_row`` (kernels/sm80/
forward.py, ``_merge_splits``: 8 lanes per row there, so that a tile's 16 rows take one pass).
num_splits, batch, seqlen_q, heads and the actual head dim are run-time values; the padded head dim
(columns past the actual one are neither read nor written when ``check_hdim``) and the dtype are
compile-time. An empty split's partial output must be finite (the forward writes 0): its weight is
0, applied without a branch. The caller launches only with batch * seqlen_q * heads > 0 and
num_splits >= 1.
"""

import math
from typing import Type

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

LN2 = math.log(2.0)
LOG2E = math.log2(math.e)
VEC = 4  # fp32 per 128-bit load
# Warps of a CTA share a row's splits only while the grid would otherwise have fewer warps than
# this (about what an H100 holds at once, 132 SMs x 64): with many rows one warp per row is faster
# (measured on H100: 4 splits x 65536 rows of d128, 228 us with 8 warps per row, 55 us with 1).
GROUP_WARPS_TARGET = 8192


def row_lanes(head_dim_padded: int) -> tuple[int, int]:
    """(threads per row, chunks per thread) of a row of ``head_dim_padded`` columns spread over at
    most a warp's lanes in 4-column chunks (a 128-bit fp32 load each); also the ring merge's."""
    chunks = head_dim_padded // VEC
    tpr = 32
    while chunks % tpr:
        tpr //= 2
    return tpr, chunks // tpr


def row_copy(dtype: Type[cutlass.Numeric], threads_per_row: int) -> cute.TiledCopy:
    """The copy of one row's 4-column chunks between memory and the ``row_lanes`` threads that own
    them (one vector access of 4 elements each)."""
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=VEC * dtype.width),
        cute.make_layout((1, threads_per_row)),
        cute.make_layout((1, VEC)),
    )


def clamped_row(row, num_rows, seqlen, heads):
    """(row_ok, b, i, h) of output row ``row`` of ``num_rows`` = batch * seqlen * heads rows (h
    fastest). A row past the last is clamped to the last (row_ok False): its lanes redo that row
    and store nothing, so that every lane of a warp reaches the warp's shuffles and barriers. Also
    the ring merge's."""
    row_ok = row < num_rows
    row = cutlass.min(row, num_rows - 1)
    h = row % heads
    bi = row // heads
    i = bi % seqlen
    return row_ok, bi // seqlen, i, h


class SplitCombine:
    """Compile-time configuration of the combine kernel; ``__call__`` is the host-side launch."""

    def __init__(self, dtype: Type[cutlass.Numeric], head_dim_padded: int, check_hdim: bool, num_warps: int = 8,
                 unroll: int = 4, threads_per_row: int | None = None):
        assert head_dim_padded % 16 == 0 and 16 <= head_dim_padded <= 256, head_dim_padded
        assert num_warps & (num_warps - 1) == 0, num_warps
        self.dtype = dtype
        self.head_dim = head_dim_padded
        self.check_hdim = check_hdim
        self.num_warps = num_warps
        self.num_threads = 32 * num_warps
        self.unroll = unroll  # splits (per warp) or LSEs (per lane) loaded per loop trip
        self.threads_per_row, self.chunks_per_thread = row_lanes(head_dim_padded)
        if threads_per_row is not None:  # fewer lanes per row, more rows per warp (merge_in_cta)
            assert threads_per_row <= self.threads_per_row and self.threads_per_row % threads_per_row == 0
            self.chunks_per_thread *= self.threads_per_row // threads_per_row
            self.threads_per_row = threads_per_row
        self.rows_per_warp = 32 // self.threads_per_row

    @cute.jit
    def __call__(
        self,
        mOAccum: cute.Tensor,  # (num_splits, batch, seqlen_q, heads, head_dim) fp32
        mLSEAccum: cute.Tensor,  # (num_splits, batch, heads, seqlen_q) fp32, natural log, +inf: empty split
        mO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim) dtype
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q) fp32
        stream: cuda.CUstream,
    ):
        copy_acc = row_copy(Float32, self.threads_per_row)
        copy_out = row_copy(self.dtype, self.threads_per_row)
        # every warp's partial sums: (warp, row of the warp, column)
        sacc_layout = cute.make_ordered_layout((self.num_warps, self.rows_per_warp, self.head_dim), order=(2, 1, 0))

        @cute.struct
        class SharedStorage:
            sAcc: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sacc_layout)], 16]

        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        num_splits = mOAccum.shape[0]
        # Warps per row (a power of two): as many as there are splits, up to num_warps, while the
        # grid is short of GROUP_WARPS_TARGET warps. Both conditions only get harder as it doubles.
        row_warps = cute.ceil_div(rows, self.rows_per_warp)  # warps with one warp per row
        group = Int32(1)
        for k in cutlass.range_constexpr(self.num_warps.bit_length() - 1):
            if (num_splits >= 2 ** (k + 1)) & (row_warps < GROUP_WARPS_TARGET >> k):
                group = Int32(2 ** (k + 1))
        rows_per_cta = self.rows_per_warp * (self.num_warps // group)
        self.kernel(mOAccum, mLSEAccum, mO, mLSE, group, copy_acc, copy_out, sacc_layout, SharedStorage).launch(
            grid=(cute.ceil_div(rows, rows_per_cta), 1, 1),
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mOAccum, mLSEAccum, mO, mLSE, group: Int32, copy_acc: cute.TiledCopy, copy_out: cute.TiledCopy,
               sacc_layout: cute.Layout, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        batch, seqlen_q, heads, head_dim = mO.shape
        num_rows = batch * seqlen_q * heads
        row = (cta * (self.num_warps // group) + warp // group) * self.rows_per_warp + lane // self.threads_per_row
        # (a warp can hold several rows when threads_per_row < 32: all reach _row_lse's shuffles)
        row_ok, b, i, h = clamped_row(row, num_rows, seqlen_q, heads)
        sAcc = cutlass.memory.SmemAllocator().allocate(SharedStorage).sAcc.get_tensor(sacc_layout)
        self.merge_row(mOAccum[None, b, i, None, None], mLSEAccum[None, b, h, i], mO[b, i, None, None], h,
                       mLSE[b, None, None], (h, i), row_ok, group, sAcc, copy_acc, copy_out)

    @cute.jit
    def merge_row(self, o_splits: cute.Tensor, lse_splits: cute.Tensor, out_rows: cute.Tensor, h: Int32,
                  lse_out: cute.Tensor, lse_coord, row_ok, group: Int32, sAcc: cute.Tensor,
                  copy_acc: cute.TiledCopy, copy_out: cute.TiledCopy):
        """Merge one row, (b, i, h) say, with the CTA's other rows: ``o_splits`` (num_splits, heads,
        d) and ``lse_splits`` (num_splits,) its splits' partials, ``out_rows`` (heads, d) the output
        rows of head ``h``'s (b, i), ``lse_out[lse_coord]`` its LSE. Warp ``w`` of the CTA holds
        rows w // group (rows_per_warp of them, lane // threads_per_row) and splits w % group, ...;
        ``group`` > 1 sums the warps' shares through ``sAcc`` ((num_warps, rows_per_warp, d) fp32)
        behind a CTA barrier, so every thread of the CTA calls this the same number of times.
        ``row_ok`` false: the lanes compute and store nothing (their row is a clamped copy)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = tidx // 32
        lane = tidx % 32
        g = warp % group  # this warp's share of the splits: g, g + group, ...
        r = lane // self.threads_per_row  # row of the warp
        c = lane % self.threads_per_row  # column group of the row
        head_dim = out_rows.shape[1]

        tile = (1, self.head_dim)
        thr = copy_acc.get_slice(c)
        coords = thr.partition_S(cute.make_identity_tensor(tile))
        acc = cute.make_rmem_tensor(coords.shape, Float32)
        acc.fill(0.0)
        # the 4-column chunks inside the actual head dim
        col_ok = [coords[0, 0, k][1] < head_dim for k in range(self.chunks_per_thread)]
        # acc += exp(lse_s - lse) * O_s over this warp's splits (g, g + group, ...), ``unroll`` per
        # trip; the first trip's loads go out before the row's LSE is known, so that their L2 round
        # trip overlaps _row_lse's (a decode step's splits all fit one trip)
        num_splits = cute.size(lse_splits)
        trip = group * self.unroll
        lses, parts = self._load_trip(lse_splits, o_splits, h, thr, col_ok, g, group)
        lse = self._row_lse(lse_splits, c)
        self._add_trip(acc, lse, num_splits, col_ok, g, group, lses, parts)
        for base in cutlass.range(g + trip, num_splits, trip, unroll=1):
            more_lses, more_parts = self._load_trip(lse_splits, o_splits, h, thr, col_ok, base, group)
            self._add_trip(acc, lse, num_splits, col_ok, base, group, more_lses, more_parts)

        if group > 1:  # the same in the whole CTA
            if g > 0:
                cute.autovec_copy(acc, thr.partition_D(cute.local_tile(sAcc[warp, None, None], tile, (r, 0))))
            cute.arch.barrier()
            if g == 0:
                for w in cutlass.range(1, group, unroll=1):
                    part = cute.make_rmem_tensor(coords.shape, Float32)
                    cute.autovec_copy(thr.partition_S(cute.local_tile(sAcc[warp + w, None, None], tile, (r, 0))), part)
                    acc.store(acc.load() + part.load())
        if (g == 0) & row_ok:
            thr_out = copy_out.get_slice(c)
            tOg = thr_out.partition_D(cute.local_tile(out_rows, tile, (h, 0)))
            rO = cute.make_fragment_like(tOg)
            rO.store(acc.load().to(self.dtype))
            for k in cutlass.range_constexpr(self.chunks_per_thread):
                if const_expr(self.check_hdim):
                    if col_ok[k]:
                        cute.copy(copy_out, rO[None, None, k], tOg[None, None, k])
                else:
                    cute.copy(copy_out, rO[None, None, k], tOg[None, None, k])
            if c == 0:
                lse_out[lse_coord] = lse

    @cute.jit
    def _row_lse(self, lse_row: cute.Tensor, c: Int32) -> Float32:
        """log(sum_s exp(lse_row[s])) over the non-empty splits (+inf if none), the same in every lane
        of the row: lane c reads splits c, c + threads_per_row, ..."""
        tpr = self.threads_per_row
        num_splits = cute.size(lse_row)
        step = tpr * self.unroll
        row_max = -Float32.inf
        for base in cutlass.range(c, num_splits, step, unroll=1):
            for u in cutlass.range_constexpr(self.unroll):
                s = base + u * tpr
                x = lse_row[cutlass.min(s, num_splits - 1)]  # in bounds; masked below
                valid = (s < num_splits) & (x < Float32.inf) & (x > -Float32.inf)
                row_max = cute.arch.fmax(row_max, x if valid else -Float32.inf)
        row_max = cute.arch.warp_reduction_max(row_max, threads_in_group=tpr)
        total = Float32(0.0)
        for base in cutlass.range(c, num_splits, step, unroll=1):
            for u in cutlass.range_constexpr(self.unroll):
                s = base + u * tpr
                x = lse_row[cutlass.min(s, num_splits - 1)]
                valid = (s < num_splits) & (x < Float32.inf) & (x > -Float32.inf)
                # valid implies a finite row_max >= x; otherwise exp2(-inf) = 0
                total += cute.math.exp2((x - row_max) * LOG2E if valid else -Float32.inf, fastmath=True)
        total = cute.arch.warp_reduction_sum(total, threads_in_group=tpr)
        return Float32.inf if row_max == -Float32.inf else row_max + cute.math.log2(total, fastmath=True) * LN2

    @cute.jit
    def _load_trip(self, lse_row: cute.Tensor, rows: cute.Tensor, h: Int32, thr, col_ok: list, base: Int32,
                   group: Int32):
        """The loads of one trip of ``_add_trip``: the LSEs and this thread's columns of the partial
        outputs of splits base, base + group, ... (``unroll`` of them, clamped into range: no
        branch before the loads). ``rows``: (num_splits, heads, head_dim) of this (b, i)."""
        num_splits = cute.size(lse_row)
        tile = (1, self.head_dim)
        lses = []
        parts = []
        for u in cutlass.range_constexpr(self.unroll):
            s = cutlass.min(base + u * group, num_splits - 1)
            lses.append(lse_row[s])
            src = thr.partition_S(cute.local_tile(rows[s, None, None], tile, (h, 0)))
            part = cute.make_rmem_tensor(src.shape, Float32)
            for k in cutlass.range_constexpr(self.chunks_per_thread):
                if const_expr(self.check_hdim):
                    if col_ok[k]:
                        cute.autovec_copy(src[None, None, k], part[None, None, k])
                else:
                    cute.autovec_copy(src[None, None, k], part[None, None, k])
            parts.append(part)
        return lses, parts

    @cute.jit
    def _add_trip(self, acc: cute.Tensor, lse: Float32, num_splits: Int32, col_ok: list, base: Int32, group: Int32,
                  lses: list, parts: list):
        """acc += exp(lse_s - lse) * O_s over one trip's splits (``_load_trip``)."""
        for u in cutlass.range_constexpr(self.unroll):
            x = lses[u]
            valid = (base + u * group < num_splits) & (x < Float32.inf) & (x > -Float32.inf)
            # valid implies a finite lse >= x (up to rounding); otherwise the weight is exp2(-inf) = 0.
            # No branch: a branch would let the compiler sink this split's loads behind it.
            w = cute.math.exp2((x - lse) * LOG2E if valid else -Float32.inf, fastmath=True)
            for k in cutlass.range_constexpr(self.chunks_per_thread):
                if const_expr(self.check_hdim):
                    if col_ok[k]:
                        acc[None, None, k].store(acc[None, None, k].load() + w * parts[u][None, None, k].load())
                else:
                    acc[None, None, k].store(acc[None, None, k].load() + w * parts[u][None, None, k].load())
