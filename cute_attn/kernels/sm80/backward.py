"""FlashAttention-2 backward for SM80+ (mma.sync, cp.async, ldmatrix), written with the CuTe DSL.

Three kernels, launched in this order:

1. ``BackwardPreprocessSm80``: D = rowsum(dO * O) in fp32 per (batch, head, query); the LSE scaled
   to log2 (LSE * log2 e, +inf on padded rows); zero the fp32 dQ accumulator.
2. ``FlashAttentionBackwardSm80``: grid over (K/V block, K/V head, batch). Each CTA keeps its K and
   V tiles in shared memory and its dK, dV accumulators in registers, and walks every Q block of
   every query head that reads this K/V head (GQA/MQA: dK and dV are summed in registers, so they
   need no atomics and no expanded copies). Per Q block, recomputing attention from the saved LSE:
       S = Q K^T,  P = exp2(S * scale_log2 - LSE_log2)       (masked on the diagonal / seqlen_k end)
       dP = dO V^T,  dS = P * (dP - D)
       dV += P^T dO,  dK += dS^T Q,  dQ += dS K  (fp32; atomics, or in K/V-block order when
       deterministic)
   P and dS go through shared memory because the dV/dK GEMMs read them transposed.
3. ``BackwardPostprocessSm80``: dQ = dQ_accum * softmax_scale, converted to the input dtype.
dK is scaled by softmax_scale in the main kernel's epilogue.

Features (kernels/features.py, compile-time): a sliding window changes which Q blocks a K/V block
visits and which of them are masked (block_info.backward_walk); a softcap recomputes S as
tanh(S * softcap_scale) and multiplies dS by its derivative 1 - tanh^2; ALiBi adds its bias to S
before the exp2 (it has no derivative of its own). Varlen: every kernel finds its sequence's rows
through SeqlenInfo; the row buffers (LSE_log2, D, dQ accumulator) hold sequence b from its padded
offset (a multiple of VARLEN_ROW_PAD), so whole Q blocks of one sequence never touch another's.
"""

from functools import partial
from typing import Type

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from cute_attn.kernels import block_info
from cute_attn.kernels.features import NO_FEATURES, Features
from cute_attn.kernels.layout import acc_to_rows_cols, convert, transpose_smem
from cute_attn.kernels.mask import alibi_slope_units, apply_mask, apply_softcap
from cute_attn.kernels.seqlen_info import VARLEN_ROW_PAD, SeqlenInfo
from cute_attn.kernels.sm80 import common
from cute_attn.traits import BACKWARD_ROW_PAD as ROW_PAD  # rows of the padded per-row buffers: a multiple of this


def _elem_ptr(t: cute.Tensor, i):
    return t.iterator + cute.crd2idx(i, t.layout)


def dq_accum_thread_view(mdQ_accum: cute.Tensor, seq: SeqlenInfo, head, m_block, tile_m: int, head_dim: int,
                         num_threads: int, num_values: int, tidx) -> cute.Tensor:
    """This thread's ``num_values`` slots of one Q block's fp32 dQ accumulator (Q block ``m_block``
    of sequence ``seq``: in varlen counted from the sequence's padded offset).

    A Q block's tile_m x head_dim floats are contiguous; the dQ MMA's thread ``tidx`` owns slots
    tidx, tidx + num_threads, tidx + 2 num_threads, ... in the order of its accumulator fragment.
    Consecutive threads thus add to consecutive floats (one 128-byte line per warp instruction,
    instead of 8 half-used sectors in row-major order); the postprocess reads the slots back with
    the same MMA partition to put each value at its (row, column)."""
    rows = seq.padded_q_rows(mdQ_accum[seq.tensor_batch, head, None, None])
    block = cute.local_tile(rows, (tile_m, head_dim), (m_block, 0))
    return cute.make_tensor(block.iterator + tidx, cute.make_layout(num_values, stride=num_threads))


class BackwardPreprocessSm80:
    """D = rowsum(dO * O), LSE_log2 = LSE * log2(e), dQ_accum = 0, one (Q block, head, batch) per CTA.
    ``zero_dq_accum`` False: the accumulator is left alone (the SM90 backward's first share of a
    Q block is stored, not added: kernels/sm90/backward.py, ``dq_first_share``).

    varlen: O, dO and the LSE are packed (cu_seqlens_q); the row buffers are written from each
    sequence's padded offset, in whole VARLEN_ROW_PAD-row blocks, so that every Q block the main
    kernels may read (any tile_m dividing VARLEN_ROW_PAD) has D, LSE_log2 = +inf past seqlen_q and
    a zeroed dQ accumulator."""

    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int, check_hdim: bool, tile_m: int = 64,
                 num_threads: int = 128, varlen: bool = False, zero_dq_accum: bool = True):
        self.zero_dq_accum = zero_dq_accum
        self.dtype = dtype
        self.head_dim = head_dim
        self.check_hdim = check_hdim
        self.tile_m = tile_m
        self.num_threads = num_threads
        self.varlen = varlen
        assert VARLEN_ROW_PAD % tile_m == 0

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q) fp32, natural log
        mLSE_log2: cute.Tensor,  # (batch, heads, seqlen_q_padded) fp32
        mD: cute.Tensor,  # (batch, heads, seqlen_q_padded) fp32
        mdQ_accum: cute.Tensor,  # (batch, heads, seqlen_q_padded, head_dim_padded) fp32
        mCuSeqlensQ: cute.Tensor | None,  # varlen: (batch + 1,) int32; the tensors then have batch 1
        max_seqlen_q: Int32,  # varlen: the longest sequence (the grid)
        stream: cuda.CUstream,
    ):
        copy_load = common.gmem_tiled_copy(self.dtype, self.head_dim, self.num_threads, asynchronous=False)
        copy_zero = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
            cute.make_ordered_layout((self.num_threads // 8, 8), order=(1, 0)),
            cute.make_layout((1, 4)),
        )
        if const_expr(self.varlen):
            # the longest sequence's padded row blocks (the kernel skips those past its own sequence's)
            num_m_blocks = cute.ceil_div(max_seqlen_q, VARLEN_ROW_PAD) * (VARLEN_ROW_PAD // self.tile_m)
            batch = mCuSeqlensQ.shape[0] - 1
        else:
            num_m_blocks = cute.ceil_div(mLSE_log2.shape[2], self.tile_m)
            batch = mO.shape[0]
        self.kernel(mO, mdO, mLSE, mLSE_log2, mD, mdQ_accum, mCuSeqlensQ, copy_load, copy_zero).launch(
            grid=(num_m_blocks, cute.size(mO.shape[2]), cute.size(batch)),
            block=[self.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mO, mdO, mLSE, mLSE_log2, mD, mdQ_accum, mCuSeqlensQ: cute.Tensor | None,
               copy_load: cute.TiledCopy, copy_zero: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        # (the row kernels have no keys: the K side mirrors Q and goes unused)
        seq = SeqlenInfo(batch, mO.shape[1], mO.shape[1], mCuSeqlensQ, mCuSeqlensQ)
        if const_expr(self.varlen):
            # this sequence's whole padded row blocks: ceil(seqlen_q / PAD) * PAD rows
            if m_block * self.tile_m < cute.ceil_div(seq.seqlen_q, VARLEN_ROW_PAD) * VARLEN_ROW_PAD:
                self._block(mO, mdO, mLSE, mLSE_log2, mD, mdQ_accum, copy_load, copy_zero, seq, m_block, head, tidx)
        else:
            self._block(mO, mdO, mLSE, mLSE_log2, mD, mdQ_accum, copy_load, copy_zero, seq, m_block, head, tidx)

    @cute.jit
    def _block(self, mO, mdO, mLSE, mLSE_log2, mD, mdQ_accum, copy_load: cute.TiledCopy, copy_zero: cute.TiledCopy,
               seq: SeqlenInfo, m_block: Int32, head: Int32, tidx: Int32):
        head_dim = mO.shape[3]
        tile = (self.tile_m, self.head_dim)
        rows_left = seq.seqlen_q - m_block * self.tile_m
        b = seq.tensor_batch

        thr = copy_load.get_slice(tidx)
        coords = thr.partition_S(cute.make_identity_tensor(tile))
        tOgO = thr.partition_S(cute.local_tile(seq.q_rows(mO[b, None, head, None]), tile, (m_block, 0)))
        tdOgdO = thr.partition_S(cute.local_tile(seq.q_rows(mdO[b, None, head, None]), tile, (m_block, 0)))
        rO = cute.make_fragment_like(tOgO)
        rdO = cute.make_fragment_like(tdOgdO)
        rO.fill(0.0)
        rdO.fill(0.0)
        # (CPY, CPY_ROWS, CPY_COLS): each thread holds 8-element vectors of a few rows
        for m in cutlass.range_constexpr(cute.size(rO.shape[1])):
            if coords[0, m, 0][0] < rows_left:
                for k in cutlass.range_constexpr(cute.size(rO.shape[2])):
                    if coords[0, m, k][1] < head_dim:
                        cute.autovec_copy(tOgO[None, m, k], rO[None, m, k])
                        cute.autovec_copy(tdOgdO[None, m, k], rdO[None, m, k])
        gLSE = cute.local_tile(seq.q_rows(mLSE[b, head, None]), (self.tile_m,), (m_block,))
        gLSE_log2 = cute.local_tile(seq.padded_q_rows(mLSE_log2[b, head, None]), (self.tile_m,), (m_block,))
        gD = cute.local_tile(seq.padded_q_rows(mD[b, head, None]), (self.tile_m,), (m_block,))
        # threads of one row are consecutive lanes: thread t covers row t // tpr, chunk t % tpr
        tpr = (64 if self.head_dim % 64 == 0 else 32) // 8
        for m in cutlass.range_constexpr(cute.size(rO.shape[1])):
            prod = rO[None, m, None].load().to(Float32) * rdO[None, m, None].load().to(Float32)
            d = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            d = cute.arch.warp_reduction_sum(d, threads_in_group=tpr)
            row = coords[0, m, 0][0]
            if coords[0, m, 0][1] == 0:
                gD[row] = d
                lse_log2 = Float32.inf
                if row < rows_left:
                    lse_log2 = gLSE[row] * 1.4426950408889634
                gLSE_log2[row] = lse_log2

        if const_expr(self.zero_dq_accum):  # zero this block's rows of the dQ accumulator
            gdQ = cute.local_tile(seq.padded_q_rows(mdQ_accum[b, head, None, None]),
                                  (self.tile_m, mdQ_accum.shape[3]), (m_block, 0))
            thr_zero = copy_zero.get_slice(tidx)
            tZg = thr_zero.partition_D(gdQ)
            zeros = cute.make_fragment_like(tZg)
            zeros.fill(0.0)
            cute.copy(copy_zero, zeros, tZg)


class FlashAttentionBackwardSm80:
    """Compile-time configuration of one main backward variant; ``__call__`` launches it.

    features: local window, softcap, ALiBi, varlen (kernels/features.py)."""

    def __init__(
        self,
        dtype: Type[cutlass.Numeric],
        head_dim: int,
        tile_m: int,
        tile_n: int,
        num_warps: int,
        sdp_warps_m: int,
        dkv_warps_n: int,
        dq_warps_m: int,
        causal: bool,
        check_hdim: bool,
        deterministic: bool,
        features: Features = NO_FEATURES,
    ):
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_warps = num_warps
        self.num_threads = num_warps * 32
        self.sdp_warps_m = sdp_warps_m
        self.dkv_warps_n = dkv_warps_n
        self.dq_warps_m = dq_warps_m
        self.causal = causal
        self.check_hdim = check_hdim
        self.deterministic = deterministic
        self.features = features
        # dP = dO V^T before S = Q K^T: needed with a softcap (the derivative of tanh goes straight
        # into dP - D, no third S-sized fragment); with ALiBi plus causal or varlen only because
        # those compiled without local memory that way at d128 (S first spilled 8-24 bytes, dP first
        # none; for ALiBi alone it is the other way round). The default kernel keeps S first.
        self.dp_first = features.softcap or (features.alibi and (causal or features.varlen))
        assert ROW_PAD % tile_m == 0 and VARLEN_ROW_PAD % tile_m == 0

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim)
        mV: cute.Tensor,
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mLSE_log2: cute.Tensor,  # (batch, heads, seqlen_q_padded)
        mD: cute.Tensor,  # (batch, heads, seqlen_q_padded)
        mdQ_accum: cute.Tensor,  # (batch, heads, seqlen_q_padded, head_dim_padded) fp32
        mdK: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim)
        mdV: cute.Tensor,
        mSemaphore: cute.Tensor,  # (batch, heads, seqlen_q_padded / tile_m) int32, deterministic only
        softmax_scale: Float32,
        softmax_scale_log2: Float32,  # softcap: softcap * log2(e)
        mCuSeqlensQ: cute.Tensor | None,  # varlen: (batch + 1,) int32; the tensors then have batch 1
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,  # seqused: (batch,) int32, the keys each sequence attends to
        mAlibiSlopes: cute.Tensor | None,  # ALiBi: (batch, heads) fp32
        max_seqlen_k: Int32,  # varlen: the longest sequence of keys (the grid)
        window_left: Int32,  # local: the window's edges (an unbounded side is huge)
        window_right: Int32,
        softcap_scale: Float32,  # softcap: softmax_scale / softcap
        stream: cuda.CUstream,
    ):
        d, tm, tn = self.head_dim, self.tile_m, self.tile_n
        atom_d = common.smem_layout_atom(self.dtype, d)
        sQ_layout = cute.tile_to_shape(atom_d, (tm, d, 2), (0, 1, 2))
        sKV_layout = cute.tile_to_shape(atom_d, (tn, d), (0, 1))
        sPdS_layout = cute.tile_to_shape(common.smem_layout_atom(self.dtype, tn), (tm, tn), (0, 1))
        sRow_layout = cute.make_layout((tm, 2))

        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 128]

        copy_load = common.gmem_tiled_copy(self.dtype, d, self.num_threads, asynchronous=True)
        copy_store = common.gmem_tiled_copy(self.dtype, d, self.num_threads, asynchronous=False)
        # per-row fp32 vectors (LSE_log2, D): 4 floats per thread, tile_m / 4 threads
        copy_row = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=128),
            cute.make_layout(tm // 4),
            cute.make_layout(4),
        )
        mma_sdp = common.tiled_mma(self.dtype, self.num_warps, warps_n=self.num_warps // self.sdp_warps_m)
        mma_dkv = common.tiled_mma(self.dtype, self.num_warps, warps_n=self.num_warps // self.dkv_warps_n)
        mma_dq = common.tiled_mma(self.dtype, self.num_warps, warps_n=self.num_warps // self.dq_warps_m)
        varlen = const_expr(mCuSeqlensQ is not None)
        num_n_blocks = cute.ceil_div(max_seqlen_k if varlen else mK.shape[1], tn)
        batch = mCuSeqlensQ.shape[0] - 1 if varlen else mK.shape[0]
        self.kernel(
            mQ, mK, mV, mdO, mLSE_log2, mD, mdQ_accum, mdK, mdV, mSemaphore, softmax_scale, softmax_scale_log2,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mAlibiSlopes, window_left, window_right, softcap_scale,
            sQ_layout, sKV_layout, sPdS_layout, sRow_layout, copy_load, copy_store, copy_row,
            mma_sdp, mma_dkv, mma_dq, SharedStorage,
        ).launch(
            grid=(num_n_blocks, cute.size(mK.shape[2]), cute.size(batch)),
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE_log2: cute.Tensor,
        mD: cute.Tensor,
        mdQ_accum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mSemaphore: cute.Tensor,
        softmax_scale: Float32,
        softmax_scale_log2: Float32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mAlibiSlopes: cute.Tensor | None,
        window_left: Int32,
        window_right: Int32,
        softcap_scale: Float32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sPdS_layout: cute.ComposedLayout,
        sRow_layout: cute.Layout,
        copy_load: cute.TiledCopy,
        copy_store: cute.TiledCopy,
        copy_row: cute.TiledCopy,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head_kv, batch = cute.arch.block_idx()
        seq = SeqlenInfo(batch, mQ.shape[1], mK.shape[1], mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        tile = partial(
            self._tile, mQ, mK, mV, mdO, mLSE_log2, mD, mdQ_accum, mdK, mdV, mSemaphore, softmax_scale,
            softmax_scale_log2, mAlibiSlopes, window_left, window_right, softcap_scale,
            sQ_layout, sKV_layout, sPdS_layout, sRow_layout, copy_load, copy_store, copy_row,
            mma_sdp, mma_dkv, mma_dq, SharedStorage, seq, n_block, head_kv, tidx,
        )
        if const_expr(self.features.varlen):
            if n_block * self.tile_n < seq.seqlen_k:  # the grid is sized for the longest sequence
                tile()
        else:
            tile()

    @cute.jit
    def _tile(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE_log2: cute.Tensor,
        mD: cute.Tensor,
        mdQ_accum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mSemaphore: cute.Tensor,
        softmax_scale: Float32,
        softmax_scale_log2: Float32,
        mAlibiSlopes: cute.Tensor | None,
        window_left: Int32,
        window_right: Int32,
        softcap_scale: Float32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sPdS_layout: cute.ComposedLayout,
        sRow_layout: cute.Layout,
        copy_load: cute.TiledCopy,
        copy_store: cute.TiledCopy,
        copy_row: cute.TiledCopy,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        seq: SeqlenInfo,
        n_block: Int32,
        head_kv: Int32,
        tidx: Int32,
    ):
        """One (K/V block, K/V head, sequence) tile: the whole CTA's work."""
        d, tm, tn = self.head_dim, self.tile_m, self.tile_n
        seqlen_q, seqlen_k, head_dim = seq.seqlen_q, seq.seqlen_k, mQ.shape[3]
        group = mQ.shape[2] // mK.shape[2]  # query heads per K/V head
        window_left = window_left if const_expr(self.features.local) else None
        window_right = window_right if const_expr(self.features.local) else None

        # Q blocks [m_min, m_max) see this K/V block; those below m_mask_right_end cross the right
        # edge (causal diagonal / window), those from m_mask_left_start on the window's left edge;
        # on the last, partial K/V block every Q block needs the seqlen_k mask
        m_min, m_max, m_mask_right_end, m_mask_left_start = block_info.backward_walk(
            n_block, tm, tn, seqlen_q, seqlen_k, self.causal, window_left, window_right
        )
        num_m = cutlass.max(m_max - m_min, 0)
        partial_n = (n_block + 1) * tn > seqlen_k

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sdO = storage.sdO.get_tensor(sQ_layout)
        sP = storage.sP.get_tensor(sPdS_layout)
        sdS = storage.sdS.get_tensor(sPdS_layout)
        sLSE = storage.sLSE.get_tensor(sRow_layout)
        sD = storage.sD.get_tensor(sRow_layout)
        # transposed views: the dV/dK GEMMs read P, dS, dO, Q as (cols, rows); the dQ GEMM reads K^T
        sPt, sdSt, sQt, sdOt, sKt = (transpose_smem(t) for t in (sP, sdS, sQ, sdO, sK))

        # ---- K and V: once per CTA, zero-filled past seqlen_k and past head_dim
        b = seq.tensor_batch
        thr_load = copy_load.get_slice(tidx)
        cKV = thr_load.partition_S(cute.make_identity_tensor((tn, d)))
        cQ = thr_load.partition_S(cute.make_identity_tensor((tm, d)))
        kv_rows_left = seqlen_k - n_block * tn
        gK = cute.local_tile(seq.k_rows(mK[b, None, head_kv, None]), (tn, d), (n_block, 0))
        gV = cute.local_tile(seq.k_rows(mV[b, None, head_kv, None]), (tn, d), (n_block, 0))
        common.copy_rows(copy_load, thr_load.partition_S(gK), thr_load.partition_D(sK), cKV,
                         kv_rows_left, head_dim, True, self.check_hdim)
        common.copy_rows(copy_load, thr_load.partition_S(gV), thr_load.partition_D(sV), cKV,
                         kv_rows_left, head_dim, True, self.check_hdim)
        tQsQ = thr_load.partition_D(sQ)
        tdOsdO = thr_load.partition_D(sdO)

        # ---- MMA partitions
        thr_sdp = mma_sdp.get_slice(tidx)
        thr_dkv = mma_dkv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)
        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((tn, d)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C((tn, d)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        ldsm = common.ldmatrix_atom(self.dtype)
        ldsm_t = common.ldmatrix_atom(self.dtype, transpose=True)
        # S = Q K^T and dP = dO V^T
        tSrQ = thr_sdp.make_fragment_A(thr_sdp.partition_A(sQ[None, None, 0]))
        tSrK = thr_sdp.make_fragment_B(thr_sdp.partition_B(sK))
        tdPrdO = thr_sdp.make_fragment_A(thr_sdp.partition_A(sdO[None, None, 0]))
        tdPrV = thr_sdp.make_fragment_B(thr_sdp.partition_B(sV))
        ldsm_sdp_A = cute.make_tiled_copy_A(ldsm, mma_sdp).get_slice(tidx)
        ldsm_sdp_B = cute.make_tiled_copy_B(ldsm, mma_sdp).get_slice(tidx)
        tSsQ, tdPsdO = ldsm_sdp_A.partition_S(sQ), ldsm_sdp_A.partition_S(sdO)
        tSsK, tdPsV = ldsm_sdp_B.partition_S(sK), ldsm_sdp_B.partition_S(sV)
        # dV += P^T dO and dK += dS^T Q
        tdVrPt = thr_dkv.make_fragment_A(thr_dkv.partition_A(sPt))
        tdVrdOt = thr_dkv.make_fragment_B(thr_dkv.partition_B(sdOt[None, None, 0]))
        tdKrdSt = thr_dkv.make_fragment_A(thr_dkv.partition_A(sdSt))
        tdKrQt = thr_dkv.make_fragment_B(thr_dkv.partition_B(sQt[None, None, 0]))
        ldsm_dkv_A = cute.make_tiled_copy_A(ldsm_t, mma_dkv).get_slice(tidx)
        ldsm_dkv_B = cute.make_tiled_copy_B(ldsm_t, mma_dkv).get_slice(tidx)
        tdVsPt, tdKsdSt = ldsm_dkv_A.partition_S(sPt), ldsm_dkv_A.partition_S(sdSt)
        tdVsdOt, tdKsQt = ldsm_dkv_B.partition_S(sdOt), ldsm_dkv_B.partition_S(sQt)
        # dQ = dS K
        tdQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdS))
        tdQrKt = thr_dq.make_fragment_B(thr_dq.partition_B(sKt))
        ldsm_dq_A = cute.make_tiled_copy_A(ldsm, mma_dq).get_slice(tidx)
        ldsm_dq_B = cute.make_tiled_copy_B(ldsm_t, mma_dq).get_slice(tidx)
        tdQsdS, tdQsKt = ldsm_dq_A.partition_S(sdS), ldsm_dq_B.partition_S(sKt)
        # P and dS: registers (S/dP accumulator layout) -> shared memory
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=2 * self.dtype.width),
            mma_sdp,
        ).get_slice(tidx)
        tPsP, tdSsdS = r2s.partition_D(sP), r2s.partition_D(sdS)

        cS = cute.make_identity_tensor((tm, tn))
        tScS = thr_sdp.partition_C(cS)
        tScS_thread0 = mma_sdp.get_slice(0).partition_C(cS)
        # the tile rows this thread's S/dP accumulator rows are, to read LSE_log2 and D
        rows = acc_to_rows_cols(tScS)

        ctx = (
            thr_sdp, thr_dq, mma_sdp, mma_dkv, mma_dq,
            tSrQ, tSrK, tdPrdO, tdPrV, tSsQ, tdPsdO, tSsK, tdPsV, ldsm_sdp_A, ldsm_sdp_B,
            tdVrPt, tdVrdOt, tdKrdSt, tdKrQt, tdVsPt, tdKsdSt, tdVsdOt, tdKsQt, ldsm_dkv_A, ldsm_dkv_B,
            tdQrdS, tdQrKt, tdQsdS, tdQsKt, ldsm_dq_A, ldsm_dq_B,
            r2s, tPsP, tdSsdS, acc_dK, acc_dV, tScS, tScS_thread0, rows, sLSE, sD,
            mdQ_accum, mSemaphore, seq, n_block, softmax_scale_log2, window_left, window_right, softcap_scale,
            mAlibiSlopes,
        )

        # ---- main loop over (query head of the group, Q block), flattened to one index t
        num_iters = group * num_m
        if num_iters > 0:
            self._load_q_block(copy_load, copy_row, thr_load, tQsQ, tdOsdO, sLSE, sD, cQ, mQ, mdO, mLSE_log2, mD,
                               seq, head_kv * group, m_min, 0, head_dim, tidx)
        cute.arch.cp_async_commit_group()
        for t in cutlass.range(num_iters, unroll=1):
            head = head_kv * group + t // num_m
            m_block = m_min + t % num_m
            stage = t % 2
            cute.arch.cp_async_wait_group(0)  # this block's Q, dO, LSE, D (and K, V) landed ...
            cute.arch.barrier()  # ... for everyone, and everyone is done with the other stage
            if t + 1 < num_iters:
                self._load_q_block(copy_load, copy_row, thr_load, tQsQ, tdOsdO, sLSE, sD, cQ, mQ, mdO, mLSE_log2, mD,
                                   seq, head_kv * group + (t + 1) // num_m, m_min + (t + 1) % num_m, 1 - stage,
                                   head_dim, tidx)
            cute.arch.cp_async_commit_group()
            need_mask = partial_n
            if const_expr(self.causal or self.features.local):
                need_mask = need_mask or m_block < m_mask_right_end
            if const_expr(self.features.local):
                need_mask = need_mask or m_block >= m_mask_left_start
            if need_mask:
                self._backward_block(ctx, head, m_block, stage, masked=True)
            else:
                self._backward_block(ctx, head, m_block, stage, masked=False)

        # ---- epilogue: dK * scale, dV through shared memory (reusing sK, sV) to global
        cute.arch.cp_async_wait_group(0)
        acc_dK.store(acc_dK.load() * softmax_scale)
        rdK = convert(acc_dK, self.dtype)
        rdV = convert(acc_dV, self.dtype)
        cute.arch.barrier()  # everyone is done reading sK, sV
        gdK = cute.local_tile(seq.k_rows(mdK[b, None, head_kv, None]), (tn, d), (n_block, 0))
        gdV = cute.local_tile(seq.k_rows(mdV[b, None, head_kv, None]), (tn, d), (n_block, 0))
        common.store_acc_tile(rdK, sK, mma_dkv, copy_store, gdK, tidx, kv_rows_left, head_dim, self.check_hdim)
        common.store_acc_tile(rdV, sV, mma_dkv, copy_store, gdV, tidx, kv_rows_left, head_dim, self.check_hdim)

    @cute.jit
    def _load_q_block(self, copy_load, copy_row, thr_load, tQsQ, tdOsdO, sLSE, sD, cQ, mQ, mdO, mLSE_log2, mD,
                      seq: SeqlenInfo, head, m_block, stage, head_dim, tidx):
        """cp.async Q, dO (zero-filled past seqlen_q / head_dim) and LSE_log2, D (padded rows) of one
        Q block into ``stage``."""
        tile = (self.tile_m, self.head_dim)
        rows_left = seq.seqlen_q - m_block * self.tile_m
        b = seq.tensor_batch
        gQ = cute.local_tile(seq.q_rows(mQ[b, None, head, None]), tile, (m_block, 0))
        gdO = cute.local_tile(seq.q_rows(mdO[b, None, head, None]), tile, (m_block, 0))
        common.copy_rows(copy_load, thr_load.partition_S(gQ), tQsQ[None, None, None, stage], cQ,
                         rows_left, head_dim, True, self.check_hdim)
        common.copy_rows(copy_load, thr_load.partition_S(gdO), tdOsdO[None, None, None, stage], cQ,
                         rows_left, head_dim, True, self.check_hdim)
        if tidx < self.tile_m // 4:
            self._load_rows(copy_row, sLSE, sD, mLSE_log2, mD, seq, head, m_block, stage, tidx)

    @cute.jit
    def _load_rows(self, copy_row, sLSE, sD, mLSE_log2, mD, seq: SeqlenInfo, head, m_block, stage, tidx):
        """cp.async LSE_log2 and D of one Q block (the buffers hold whole Q blocks from the
        sequence's padded offset) into ``stage``; threads below tile_m / 4 only."""
        thr_row = copy_row.get_slice(tidx)
        gL = cute.local_tile(seq.padded_q_rows(mLSE_log2[seq.tensor_batch, head, None]), (self.tile_m,), (m_block,))
        gD = cute.local_tile(seq.padded_q_rows(mD[seq.tensor_batch, head, None]), (self.tile_m,), (m_block,))
        cute.copy(copy_row, thr_row.partition_S(gL), thr_row.partition_D(sLSE[None, stage]))
        cute.copy(copy_row, thr_row.partition_S(gD), thr_row.partition_D(sD[None, stage]))

    @cute.jit
    def _scores_to_p(self, acc_S: cute.Tensor, tScS, tScS_thread0, rows, sLSE, seq: SeqlenInfo, head, m_block,
                     n_block, stage, softmax_scale_log2: Float32, window_left, window_right, mAlibiSlopes,
                     masked: cutlass.Constexpr[bool]):
        """The forward's scores from S (already softcapped): ALiBi, the masks where ``masked``, then
        P = exp2(S * scale_log2 - LSE_log2) in place."""
        if const_expr(masked or self.features.alibi):
            alibi_slope = None
            if const_expr(self.features.alibi):
                # read here rather than once per Q block: nothing extra stays live across the GEMMs
                alibi_slope = alibi_slope_units(mAlibiSlopes, seq.batch, head, softmax_scale_log2)
            apply_mask(acc_S, tScS, tScS_thread0, m_block, n_block, self.tile_m, self.tile_n, seq.seqlen_q,
                       seq.seqlen_k, self.causal, window_left, window_right, alibi_slope, check_bounds=masked)
        S = acc_to_rows_cols(acc_S)
        for r in cutlass.range_constexpr(cute.size(S.shape[0])):
            lse_log2 = sLSE[rows[r, 0][0], stage]
            S[r, None].store(cute.math.exp2(S[r, None].load() * softmax_scale_log2 - lse_log2, fastmath=True))

    @cute.jit
    def _backward_block(self, ctx, head: Int32, m_block: Int32, stage: Int32, masked: cutlass.Constexpr[bool]):
        (thr_sdp, thr_dq, mma_sdp, mma_dkv, mma_dq,
         tSrQ, tSrK, tdPrdO, tdPrV, tSsQ, tdPsdO, tSsK, tdPsV, ldsm_sdp_A, ldsm_sdp_B,
         tdVrPt, tdVrdOt, tdKrdSt, tdKrQt, tdVsPt, tdKsdSt, tdVsdOt, tdKsQt, ldsm_dkv_A, ldsm_dkv_B,
         tdQrdS, tdQrKt, tdQsdS, tdQsKt, ldsm_dq_A, ldsm_dq_B,
         r2s, tPsP, tdSsdS, acc_dK, acc_dV, tScS, tScS_thread0, rows, sLSE, sD,
         mdQ_accum, mSemaphore, seq, n_block, softmax_scale_log2, window_left, window_right, softcap_scale,
         mAlibiSlopes) = ctx
        tm, tn, d = self.tile_m, self.tile_n, self.head_dim
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k

        acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tm, tn)), Float32)
        acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((tm, tn)), Float32)
        S = acc_to_rows_cols(acc_S)
        dP = acc_to_rows_cols(acc_dP)
        if const_expr(not self.dp_first):
            # S = Q K^T, P = exp2(S * scale_log2 - LSE_log2)
            acc_S.fill(0.0)
            common.gemm(mma_sdp, acc_S, tSrQ, tSrK, tSsQ[None, None, None, stage], tSsK, ldsm_sdp_A, ldsm_sdp_B)
            self._scores_to_p(acc_S, tScS, tScS_thread0, rows, sLSE, seq, head, m_block, n_block, stage,
                              softmax_scale_log2, window_left, window_right, mAlibiSlopes, masked)
            # dP = dO V^T, dS = P * (dP - D)
            acc_dP.fill(0.0)
            common.gemm(mma_sdp, acc_dP, tdPrdO, tdPrV, tdPsdO[None, None, None, stage], tdPsV, ldsm_sdp_A,
                        ldsm_sdp_B)
            for r in cutlass.range_constexpr(cute.size(dP.shape[0])):
                dP[r, None].store(S[r, None].load() * (dP[r, None].load() - sD[rows[r, 0][0], stage]))
        else:
            # dP = dO V^T, then S = Q K^T and dS = P * (dP - D) (softcap: * (1 - tanh^2), taken
            # while S holds tanh, before the mask and the exp2 overwrite it)
            acc_dP.fill(0.0)
            common.gemm(mma_sdp, acc_dP, tdPrdO, tdPrV, tdPsdO[None, None, None, stage], tdPsV, ldsm_sdp_A,
                        ldsm_sdp_B)
            acc_S.fill(0.0)
            common.gemm(mma_sdp, acc_S, tSrQ, tSrK, tSsQ[None, None, None, stage], tSsK, ldsm_sdp_A, ldsm_sdp_B)
            if const_expr(self.features.softcap):
                apply_softcap(acc_S, softcap_scale)
            for r in cutlass.range_constexpr(cute.size(dP.shape[0])):
                dP_minus_D = dP[r, None].load() - sD[rows[r, 0][0], stage]
                if const_expr(self.features.softcap):
                    t = S[r, None].load()
                    dP_minus_D = dP_minus_D * (1.0 - t * t)
                dP[r, None].store(dP_minus_D)
            self._scores_to_p(acc_S, tScS, tScS_thread0, rows, sLSE, seq, head, m_block, n_block, stage,
                              softmax_scale_log2, window_left, window_right, mAlibiSlopes, masked)
            acc_dP.store(acc_S.load() * acc_dP.load())

        # P and dS to shared memory (the dV/dK GEMMs read them transposed, the dQ GEMM as is)
        rP = convert(acc_S, self.dtype)
        rdS = convert(acc_dP, self.dtype)
        cute.copy(r2s, r2s.retile(rP), tPsP)
        cute.copy(r2s, r2s.retile(rdS), tdSsdS)
        cute.arch.barrier()

        # dV += P^T dO, dK += dS^T Q
        common.gemm(mma_dkv, acc_dV, tdVrPt, tdVrdOt, tdVsPt, tdVsdOt[None, None, None, stage], ldsm_dkv_A, ldsm_dkv_B)
        common.gemm(mma_dkv, acc_dK, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt[None, None, None, stage], ldsm_dkv_A, ldsm_dkv_B)

        # dQ (this K/V block's share) = dS K, added to the fp32 accumulator in global memory
        acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((tm, d)), Float32)
        acc_dQ.fill(0.0)
        common.gemm(mma_dq, acc_dQ, tdQrdS, tdQrKt, tdQsdS, tdQsKt, ldsm_dq_A, ldsm_dq_B)
        tdQgdQ = dq_accum_thread_view(mdQ_accum, seq, head, m_block, tm, d, self.num_threads, cute.size(acc_dQ),
                                      cute.arch.thread_idx()[0])
        if const_expr(not self.deterministic):
            for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                cute.arch.atomic_add(_elem_ptr(tdQgdQ, i), acc_dQ[i])
        else:
            # K/V blocks add their share of a Q block in increasing n_block order: wait for the
            # semaphore to reach this block's turn among the Q block's K/V blocks (n_block, less
            # the first one a left window lets in), add with plain loads/stores, publish turn + 1.
            # The semaphores are per real batch index (varlen: not the packed tensors' 0).
            turn = block_info.dq_turn(m_block, n_block, tm, tn, seqlen_q, seqlen_k, window_left)
            sem = _elem_ptr(mSemaphore[seq.batch, head, None], m_block)
            if cute.arch.thread_idx()[0] == 0:
                while cute.arch.load(sem, Int32, sem="acquire", scope="gpu") != turn:
                    pass
            cute.arch.barrier()
            for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                tdQgdQ[i] = tdQgdQ[i] + acc_dQ[i]
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier()
            if cute.arch.thread_idx()[0] == 0:
                cute.arch.store(sem, turn + 1, sem="release", scope="gpu")


class BackwardPostprocessSm80:
    """dQ = dQ_accum * softmax_scale in the input dtype, one (Q block, head, batch) per CTA.

    Reads each thread's slots of the accumulator (see ``dq_accum_thread_view``) into the main
    kernel's dQ MMA fragment layout, then writes through shared memory like any accumulator tile.
    varlen: the accumulator from the sequence's padded offset, dQ rows of the sequence only."""

    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int, check_hdim: bool, tile_m: int,
                 num_warps: int, dq_warps_m: int, varlen: bool = False):
        self.dtype = dtype
        self.head_dim = head_dim
        self.check_hdim = check_hdim
        self.tile_m = tile_m
        self.num_warps = num_warps
        self.num_threads = num_warps * 32
        self.dq_warps_m = dq_warps_m
        self.varlen = varlen

    @cute.jit
    def __call__(
        self,
        mdQ_accum: cute.Tensor,  # (batch, heads, seqlen_q_padded, head_dim_padded) fp32
        mdQ: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        softmax_scale: Float32,
        mCuSeqlensQ: cute.Tensor | None,  # varlen: (batch + 1,) int32; the tensors then have batch 1
        max_seqlen_q: Int32,  # varlen: the longest sequence (the grid)
        stream: cuda.CUstream,
    ):
        sdQ_layout = cute.tile_to_shape(common.smem_layout_atom(self.dtype, self.head_dim),
                                        (self.tile_m, self.head_dim), (0, 1))

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdQ_layout)], 1024]

        copy_store = common.gmem_tiled_copy(self.dtype, self.head_dim, self.num_threads, asynchronous=False)
        mma_dq = common.tiled_mma(self.dtype, self.num_warps, warps_n=self.num_warps // self.dq_warps_m)
        varlen = const_expr(mCuSeqlensQ is not None)
        num_m_blocks = cute.ceil_div(max_seqlen_q if varlen else mdQ.shape[1], self.tile_m)
        batch = mCuSeqlensQ.shape[0] - 1 if varlen else mdQ.shape[0]
        self.kernel(mdQ_accum, mdQ, softmax_scale, mCuSeqlensQ, sdQ_layout, copy_store, mma_dq, SharedStorage).launch(
            grid=(num_m_blocks, cute.size(mdQ.shape[2]), cute.size(batch)),
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mdQ_accum, mdQ, softmax_scale: Float32, mCuSeqlensQ: cute.Tensor | None,
               sdQ_layout: cute.ComposedLayout, copy_store: cute.TiledCopy, mma_dq: cute.TiledMma,
               SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        # (the row kernels have no keys: the K side mirrors Q and goes unused)
        seq = SeqlenInfo(batch, mdQ.shape[1], mdQ.shape[1], mCuSeqlensQ, mCuSeqlensQ)
        if const_expr(self.varlen):
            if m_block * self.tile_m < seq.seqlen_q:  # the grid is sized for the longest sequence
                self._block(mdQ_accum, mdQ, softmax_scale, sdQ_layout, copy_store, mma_dq, SharedStorage, seq,
                            m_block, head, tidx)
        else:
            self._block(mdQ_accum, mdQ, softmax_scale, sdQ_layout, copy_store, mma_dq, SharedStorage, seq,
                        m_block, head, tidx)

    @cute.jit
    def _block(self, mdQ_accum, mdQ, softmax_scale: Float32, sdQ_layout: cute.ComposedLayout,
               copy_store: cute.TiledCopy, mma_dq: cute.TiledMma, SharedStorage: cutlass.Constexpr,
               seq: SeqlenInfo, m_block: Int32, head: Int32, tidx: Int32):
        tile = (self.tile_m, self.head_dim)
        acc = cute.make_rmem_tensor(mma_dq.get_slice(tidx).partition_shape_C(tile), Float32)
        slots = dq_accum_thread_view(mdQ_accum, seq, head, m_block, self.tile_m, self.head_dim,
                                     self.num_threads, cute.size(acc), tidx)
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = slots[i] * softmax_scale
        rdQ = convert(acc, self.dtype)
        sdQ = cutlass.memory.SmemAllocator().allocate(SharedStorage).sdQ.get_tensor(sdQ_layout)
        gdQ = cute.local_tile(seq.q_rows(mdQ[seq.tensor_batch, None, head, None]), tile, (m_block, 0))
        common.store_acc_tile(rdQ, sdQ, mma_dq, copy_store, gdQ, tidx, seq.seqlen_q - m_block * self.tile_m,
                              mdQ.shape[3], self.check_hdim)
