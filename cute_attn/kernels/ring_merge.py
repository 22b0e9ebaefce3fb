"""Ring attention's merge: fold one step's partial result into the running fp32 output and LSE.

A step of the ring (cute_attn/distributed.py) attends this rank's queries to the K/V slice in hand
and returns, per row (b, i, h), an output O_p normalised over that slice's keys (in the inputs'
dtype) and its natural-log LSE_p (+inf: the row saw no key there). The running accumulators
(O_a fp32, LSE_a fp32, -inf before the first step) become, in place:

    lse = log(exp(LSE_a) + exp(LSE_p)),   O_a = exp(LSE_a - lse) * O_a + exp(LSE_p - lse) * O_p

One kernel per step instead of a chain of torch operations (logaddexp, two exps, two broadcasts,
a multiply-add and two copies): each accumulator element is read and written once, the step's
output read once. A row that has seen no key in any step keeps O_a = 0 and LSE_a = -inf (weights 0).

Layout of the work (memory-bound): a row's columns are spread over ``threads_per_row`` consecutive
lanes (a power of two <= 32), each owning ``chunks_per_thread`` 4-column chunks (128-bit fp32
loads). ``indexed``: step row i folds into accumulator row ``mRowIndex[i]`` (a varlen step on the
first or second half of every sequence); otherwise into row i of accumulator views that start at
the step's first row. batch, rows, heads and the actual head dim are run-time values.
"""

from typing import Type

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from cute_attn.kernels.combine import LN2, LOG2E, clamped_row, row_copy, row_lanes


class RingMerge:
    """Compile-time configuration of the merge; ``__call__`` is the host-side launch."""

    def __init__(self, dtype: Type[cutlass.Numeric], head_dim_padded: int, check_hdim: bool, indexed: bool,
                 num_warps: int = 4):
        assert head_dim_padded % 16 == 0 and 16 <= head_dim_padded <= 256, head_dim_padded
        self.dtype = dtype
        self.head_dim = head_dim_padded
        self.check_hdim = check_hdim
        self.indexed = indexed
        self.num_warps = num_warps
        self.threads_per_row, self.chunks_per_thread = row_lanes(head_dim_padded)
        self.rows_per_cta = 32 * num_warps // self.threads_per_row

    @cute.jit
    def __call__(
        self,
        mAcc: cute.Tensor,  # (batch, acc rows, heads, head_dim) fp32, updated in place
        mAccLSE: cute.Tensor,  # (batch, heads, acc rows) fp32, natural log, -inf: no key yet
        mPart: cute.Tensor,  # (batch, rows, heads, head_dim) dtype: the step's output
        mPartLSE: cute.Tensor,  # (batch, heads, rows) fp32, +inf: the row saw no key in this step
        mRowIndex: cute.Tensor | None,  # (rows,) int32 accumulator row of each step row (indexed)
        stream: cuda.CUstream,
    ):
        copy_acc, copy_part = row_copy(Float32, self.threads_per_row), row_copy(self.dtype, self.threads_per_row)
        rows = mPart.shape[0] * mPart.shape[1] * mPart.shape[2]
        self.kernel(mAcc, mAccLSE, mPart, mPartLSE, mRowIndex, copy_acc, copy_part).launch(
            grid=(cute.ceil_div(rows, self.rows_per_cta), 1, 1), block=[32 * self.num_warps, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mAcc, mAccLSE, mPart, mPartLSE, mRowIndex, copy_acc: cute.TiledCopy, copy_part: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        tpr = self.threads_per_row
        c = tidx % tpr  # column group of the row
        batch, seqlen, heads, head_dim = mPart.shape
        num_rows = batch * seqlen * heads
        row = cta * self.rows_per_cta + tidx // tpr
        # (every lane of a warp reaches the warp barrier before the LSE store)
        row_ok, b, i, h = clamped_row(row, num_rows, seqlen, heads)
        acc_row = i
        if const_expr(self.indexed):
            acc_row = mRowIndex[i]

        lse_acc = mAccLSE[b, h, acc_row]
        lse_part = mPartLSE[b, h, i]
        lse_part = -Float32.inf if lse_part == Float32.inf else lse_part
        top = cute.arch.fmax(lse_acc, lse_part)
        # no key on either side: both weights 0 (never exp2(-inf - -inf))
        top_or_0 = Float32(0.0) if top == -Float32.inf else top
        e_acc = cute.math.exp2((lse_acc - top_or_0) * LOG2E, fastmath=True)
        e_part = cute.math.exp2((lse_part - top_or_0) * LOG2E, fastmath=True)
        total = e_acc + e_part
        inv = Float32(0.0) if top == -Float32.inf else cute.arch.rcp_approx(total)
        w_acc, w_part = e_acc * inv, e_part * inv
        lse = -Float32.inf if top == -Float32.inf else top + cute.math.log2(total, fastmath=True) * LN2

        tile = (1, self.head_dim)
        thr_acc, thr_part = copy_acc.get_slice(c), copy_part.get_slice(c)
        tAg = thr_acc.partition_D(cute.local_tile(mAcc[b, acc_row, None, None], tile, (h, 0)))
        tPg = thr_part.partition_S(cute.local_tile(mPart[b, i, None, None], tile, (h, 0)))
        coords = thr_acc.partition_S(cute.make_identity_tensor(tile))
        rA = cute.make_fragment_like(tAg)
        rP = cute.make_fragment_like(tPg)
        for k in cutlass.range_constexpr(self.chunks_per_thread):
            if const_expr(self.check_hdim):
                if coords[0, 0, k][1] < head_dim:
                    cute.copy(copy_acc, tAg[None, None, k], rA[None, None, k])
                    cute.copy(copy_part, tPg[None, None, k], rP[None, None, k])
            else:
                cute.copy(copy_acc, tAg[None, None, k], rA[None, None, k])
                cute.copy(copy_part, tPg[None, None, k], rP[None, None, k])
        rA.store(rA.load() * w_acc + rP.load().to(Float32) * w_part)
        if row_ok:
            for k in cutlass.range_constexpr(self.chunks_per_thread):
                if const_expr(self.check_hdim):
                    if coords[0, 0, k][1] < head_dim:
                        cute.copy(copy_acc, rA[None, None, k], tAg[None, None, k])
                else:
                    cute.copy(copy_acc, rA[None, None, k], tAg[None, None, k])
        # every lane of the row has read the old LSE before one of them overwrites it
        cute.arch.sync_warp()
        if row_ok & (c == 0):
            mAccLSE[b, h, acc_row] = lse
