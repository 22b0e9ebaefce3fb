"""Hopper backward for large head dims (192, 256): FlashAttention-3/4's decomposition with dK and
dV transposed, written with the CuTe DSL.

kernels/sm90/backward.py computes S^T and dP^T with 64 keys per MMA warpgroup and keeps dK and dV
(keys x head dim) in registers: 2 * head_dim / 2 fp32 registers per thread, which at head dim 192
or 256 leaves nothing for S^T, dP^T and dQ. This kernel turns the GEMMs around so that the
registers of dK and dV shrink with the K/V block instead:

    S  = Q K^T,  P  = exp2(S * scale_log2 - LSE_log2)    (64 Q rows on the wgmma M axis; the two
    dP = dO V^T, dS = P * (dP - D)                        MMA warpgroups split the keys along N)
    dV^T += dO^T P,  dK^T += Q^T dS                       (head dim on M, from shared memory)
    dQ = dS K                                             (the warpgroups split the head dim)

P and dS go to shared memory (one buffer each), where dV^T and dK^T read them as the B operand
and dQ reads dS as its A operand. dK^T and dV^T take head_dim * tile_n / 256 fp32 registers each
per thread: the two warpgroups split the head dim into 64-row wgmma tiles where it halves into
them (d256: 128 rows each) and the keys otherwise (d192: 48 keys each). With the tiles of
traits.SM90_BACKWARD that is 144 (d192, 96 keys) and 128 (d256, 64 keys) registers.

``dq_parts`` = 2 (d256): each warpgroup computes its dQ in two GEMMs of half its columns and
stages each half in a buffer of half the size (16 KB instead of 32 KB per warpgroup), the second
GEMM running while the dQ writer reduces the first. That frees the shared memory for 64 keys
per CTA beside two Q stages: the kernel reads Q and dO and adds a Q block's dQ once per 64 keys
instead of per 48, and at d256 that L2 traffic is what bounds it (+19-43%, docs/performance.md).

Everything else is the kernel of backward.py, which this class extends: the grid (one CTA per K/V
block, K/V head and batch; every Q block of every query head of the K/V head, GQA/MQA summed in
registers), the producer warp (Q + LSE in ``num_stages`` buffers, dO + D in ``do_stages``), the dQ
writer warp (fp32 bulk reductions into the global accumulator, in the semaphore order when
deterministic), the dQ accumulator's slot order (this kernel's dQ MMA is backward.py's for 64-row
Q blocks, so ``BackwardPostprocessSm90`` reads it as it is; in parts, ``_dq_cols_per_warpgroup``
says how the same order is kept), the features (local window, softcap,
ALiBi, varlen; masks on the non-transposed tile through ``mask.apply_mask``, as the forward) and
the epilogue (dK, dV through K's and V's buffers and TMA stores; here with stmatrix.trans).
"""

import math
from functools import partial
from typing import Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp, warpgroup

from cute_attn.kernels.features import NO_FEATURES, Features
from cute_attn.kernels.layout import acc_to_rows_cols, convert, transpose_smem
from cute_attn.kernels.mask import apply_mask, apply_softcap
from cute_attn.kernels.sm90 import common
from cute_attn.kernels.sm90.backward import (
    NUM_MMA_WARPGROUPS,
    Barrier,
    FlashAttentionBackwardSm90,
    dq_slot_copy,
    dq_tiled_mma,
    mma_thread_slices,
)
from cute_attn.kernels.sm90.common import WARPGROUP_THREADS

# stages of the one shared P + dS buffer: P at 0, dS at 1
P_STAGE, DS_STAGE = 0, 1


class FlashAttentionBackwardSm90LargeHeadDim(FlashAttentionBackwardSm90):
    """Compile-time configuration of one large-head-dim backward variant; ``__call__`` (the same
    arguments as ``FlashAttentionBackwardSm90``'s) launches it.

    head_dim: the padded head dim, a multiple of 64. tile_m: 64 Q rows per block. tile_n: keys per
    CTA, a multiple of 16 (each warpgroup's half of S a multiple of 8). num_stages / do_stages:
    shared-memory buffers for Q (+ LSE) and for dO (+ D). features: kernels/features.py.
    """

    dkv_transposed = True

    def __init__(
        self,
        dtype: Type[cutlass.Numeric],
        head_dim: int,
        tile_m: int,
        tile_n: int,
        num_stages: int,
        do_stages: int,
        causal: bool,
        deterministic: bool,
        features: Features = NO_FEATURES,
        dq_parts: int = 1,
    ):
        assert tile_m == 64, "tile_m: one 64-row wgmma tile of Q rows"
        assert dq_parts in (1, NUM_MMA_WARPGROUPS), "dq_parts: whole, or one part per warpgroup"
        assert head_dim % 64 == 0, "head_dim: whole 64-row wgmma tiles of dK^T and dV^T"
        assert tile_n % (8 * NUM_MMA_WARPGROUPS) == 0 and tile_n % 16 == 0
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_stages = num_stages
        self.q_stages, self.do_stages = num_stages, do_stages
        self.causal = causal
        self.deterministic = deterministic
        self.features = features
        self.dq_parts = dq_parts
        self.longest_first = False  # (not measured for the large head dims)
        self.num_mma_threads = NUM_MMA_WARPGROUPS * WARPGROUP_THREADS
        self.num_threads = self.num_mma_threads + WARPGROUP_THREADS
        # dK^T, dV^T: the warpgroups split the head dim into whole 64-row tiles, else the keys
        self.dkv_split_keys = (head_dim // NUM_MMA_WARPGROUPS) % 64 != 0
        assert not self.dkv_split_keys or (tile_n // NUM_MMA_WARPGROUPS) % 8 == 0

    def _dq_cols_per_warpgroup(self) -> int:
        """Head-dim columns of one dQ GEMM per warpgroup: in parts, part p of warpgroup w is
        columns (p * NUM_MMA_WARPGROUPS + w) * cols, so that its registers are the slots of the
        postprocess's chunk p, sub-part w (``_write_dq``), and the global accumulator's order is the
        one-part kernel's."""
        return self.head_dim // NUM_MMA_WARPGROUPS // self.dq_parts

    def _keys_per_warpgroup(self) -> int:
        """Keys (columns of S and dP) per MMA warpgroup."""
        return self.tile_n // NUM_MMA_WARPGROUPS

    # ------------------------------------------------------------------ host side
    # ``__call__`` is FlashAttentionBackwardSm90's, with these layouts and MMAs
    def _smem_layouts(self):
        d, m, n = self.head_dim, self.tile_m, self.tile_n
        keys_wg = self._keys_per_warpgroup()
        keys_dkv = keys_wg if self.dkv_split_keys else n
        # Q and dO: K-major A of S and dP, MN-major A (Q^T, dO^T) of dK^T and dV^T in 64-row tiles
        sQ_layout = common.smem_layout(self.dtype, m, d, self.q_stages)
        sdO_layout = common.smem_layout(self.dtype, m, d, self.do_stages)
        # K and V (then dK and dV): K-major B of S and dP; K also MN-major B of dQ = dS K in each
        # warpgroup's head-dim columns
        sKV_layout = common.smem_layout(self.dtype, n, d, slice_cols=self._dq_cols_per_warpgroup())
        # P and dS (queries x keys): written in each warpgroup's keys, read MN-major by dV^T and
        # dK^T in theirs and K-major by dQ: the swizzle must start at both column slices
        sPdS_layout = common.smem_layout(self.dtype, m, n, 2, slice_cols=math.gcd(keys_wg, keys_dkv))
        return sQ_layout, sdO_layout, sKV_layout, sPdS_layout

    def _tiled_mmas(self):
        m, d, n = self.tile_m, self.head_dim, self.tile_n
        keys_wg = self._keys_per_warpgroup()
        keys_dkv = keys_wg if self.dkv_split_keys else n
        # S = Q K^T and dP = dO V^T: 64 Q rows, the warpgroups side by side along the keys
        mma_sdp = common.tiled_mma(self.dtype, NUM_MMA_WARPGROUPS, keys_wg, b_major_mn=False, a_in_registers=False,
                                   warpgroups_along_n=True)
        # dV^T += dO^T P and dK^T += Q^T dS: both operands MN-major from shared memory
        mma_dkv = common.tiled_mma(self.dtype, NUM_MMA_WARPGROUPS, keys_dkv, b_major_mn=True, a_in_registers=False,
                                   warpgroups_along_n=self.dkv_split_keys, a_major_mn=True)
        return mma_sdp, mma_dkv, dq_tiled_mma(self.dtype, m, d // self.dq_parts)

    # ------------------------------------------------------------------ MMA warpgroups
    @cute.jit
    def _mma(self, dkv_out, mAlibiSlopes, sQ, sK, sV, sdO, sPdS, sLSE, sD, sdQ, atom_dK, atom_dV, mma_sdp, mma_dkv,
             mma_dq, pipe_kv, pipe_q, pipe_do, softmax_scale, softmax_scale_log2, window_left, window_right,
             softcap_scale, work):
        n_block, head_dkv, seq, head0, group, m_min, num_m, _, _ = work
        mdK, mdV, _ = dkv_out  # (no fp32 accumulators: dK^T, dV^T per split)
        tidx, wg, (wg_sdp, wg_dkv, wg_dq), (thr_sdp, thr_dkv, thr_dq) = mma_thread_slices(mma_sdp, mma_dkv, mma_dq)
        tSrQ = wg_sdp.make_fragment_A(wg_sdp.partition_A(sQ))
        tSrK = wg_sdp.make_fragment_B(wg_sdp.partition_B(sK))
        tdPrdO = wg_sdp.make_fragment_A(wg_sdp.partition_A(sdO))
        tdPrV = wg_sdp.make_fragment_B(wg_sdp.partition_B(sV))
        # dV^T = dO^T P, dK^T = Q^T dS: A (head dim x queries) and B (keys x queries: P^T at stage
        # P_STAGE, dS^T at DS_STAGE) are transposed views
        tdVrdOt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transpose_smem(sdO)))
        tdKVrPdS = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sPdS)))
        tdKrQt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transpose_smem(sQ)))
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sPdS))
        # K^T (head dim x keys) for each dQ part: head_dim / dq_parts of its rows
        dq_rows = self.head_dim // self.dq_parts
        tdQrKt = tuple(wg_dq.make_fragment_B(wg_dq.partition_B(
            cute.local_tile(transpose_smem(sK), (dq_rows, self.tile_n), (p, 0)))) for p in range(self.dq_parts))
        tile_dkv = (self.head_dim, self.tile_n)
        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C(tile_dkv), Float32)  # dK^T
        acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C(tile_dkv), Float32)  # dV^T
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # P and dS (queries x keys, as computed) -> shared memory: stmatrix, 16x8 per warp where a
        # warpgroup's keys are not a multiple of 16
        matrices = 4 if const_expr(self._keys_per_warpgroup() % 16 == 0) else 2
        stsm_PdS = cute.make_tiled_copy_C(cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, matrices), self.dtype),
                                          mma_sdp).get_slice(tidx)
        tPdSsPdS = stsm_PdS.partition_D(sPdS)
        copy_dQ = dq_slot_copy(NUM_MMA_WARPGROUPS).get_slice(tidx)
        tdQsdQ = copy_dQ.partition_D(sdQ)
        # each accumulator element's (query, key) in the tile, for the masks
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS, tScS_thread0 = thr_sdp.partition_C(cS), mma_sdp.get_slice(0).partition_C(cS)

        ctx = (mma_sdp, mma_dkv, mma_dq, thr_sdp, thr_dq, tSrQ, tSrK, tdPrdO, tdPrV, tdVrdOt, tdKVrPdS, tdKrQt, tdQrdS,
               tdQrKt, acc_dK, acc_dV, stsm_PdS, tPdSsPdS, tdQsdQ, tScS, tScS_thread0, sLSE, sD, pipe_q, pipe_do,
               softmax_scale_log2, n_block, seq.seqlen_q, seq.seqlen_k, wg, window_left, window_right, softcap_scale)

        unmasked = self._unmasked_q_blocks(n_block, seq, window_left, window_right)
        self._walk_q_blocks(ctx, pipe_kv, mAlibiSlopes, seq, head0, group, n_block, m_min, num_m, softmax_scale_log2,
                            unmasked)
        # (a K/V block that no query sees still stores its dK = dV = 0)
        self._epilogue(acc_dK, acc_dV, mdK, mdV, sK, sV, atom_dK, atom_dV, mma_dkv, tidx, softmax_scale,
                       n_block, head_dkv, seq)

    @cute.jit
    def _backward_block(self, ctx, q_state, do_state, m_block: Int32, alibi_slope, unmasked):
        """The five GEMMs of one Q block. wgmma groups complete in issue order, so each
        ``wait=1`` below means "everything but the GEMM just issued is done"."""
        (mma_sdp, mma_dkv, mma_dq, thr_sdp, thr_dq, tSrQ, tSrK, tdPrdO, tdPrV, tdVrdOt, tdKVrPdS, tdKrQt, tdQrdS,
         tdQrKt, acc_dK, acc_dV, stsm_PdS, tPdSsPdS, tdQsdQ, tScS, tScS_thread0, sLSE, sD, pipe_q, pipe_do,
         softmax_scale_log2, n_block, seqlen_q, seqlen_k, wg, window_left, window_right, softcap_scale) = ctx
        q_stage, do_stage = q_state.index, do_state.index

        # S = Q K^T and dP = dO V^T (this warpgroup's keys), back to back
        pipe_q.consumer_wait(q_state)
        acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        common.wgmma(mma_sdp, acc_S, tSrQ[None, None, None, q_stage], tSrK, zero_init=True, wait=-1)
        pipe_do.consumer_wait(do_state)
        acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        common.wgmma(mma_sdp, acc_dP, tdPrdO[None, None, None, do_stage], tdPrV, zero_init=True, wait=1)
        # the LSE and D of this thread's two rows
        lse_log2 = self._per_row(thr_sdp, sLSE, q_stage)
        d = self._per_row(thr_sdp, sD, do_stage)

        # P = exp2(S * scale_log2 - LSE_log2[query]) while dP is in flight. Softcap first
        # (S = tanh(S * softcap_scale); scale_log2 is then softcap * log2(e)), then ALiBi and the masks
        dtanh = None
        if const_expr(self.features.softcap):
            dtanh = cute.make_rmem_tensor_like(acc_S)
            apply_softcap(acc_S, softcap_scale, dtanh)
        self._mask(partial(apply_mask, acc_S, tScS, tScS_thread0, m_block, n_block, self.tile_m, self.tile_n,
                           seqlen_q, seqlen_k, self.causal, window_left, window_right, alibi_slope), m_block, unmasked)
        S = acc_to_rows_cols(acc_S)
        for r in cutlass.range_constexpr(cute.size(S.shape[0])):
            for c in cutlass.range_constexpr(cute.size(S.shape[1])):
                S[r, c] = cute.math.exp2(S[r, c] * softmax_scale_log2 - lse_log2[r], fastmath=True)
        rP = convert(acc_S, self.dtype)
        # P and dS have one buffer each: both warpgroups must be done with the last Q block's
        # (the other warpgroup's dV^T / dK^T read this warpgroup's keys too, and dQ all of dS)
        cute.arch.barrier(barrier_id=int(Barrier.PDS_FREE), number_of_threads=self.num_mma_threads)
        cute.copy(stsm_PdS, stsm_PdS.retile(rP), tPdSsPdS[None, None, None, P_STAGE])
        if const_expr(self.features.softcap):
            # dS = P * (1 - tanh^2) * (dP - D): the derivative folded into P
            acc_S.store(acc_S.load() * dtanh.load())

        # dS = P * (dP - D[query])
        warpgroup.wait_group(0)
        dP = acc_to_rows_cols(acc_dP)
        for r in cutlass.range_constexpr(cute.size(dP.shape[0])):
            for c in cutlass.range_constexpr(cute.size(dP.shape[1])):
                dP[r, c] = S[r, c] * (dP[r, c] - d[r])
        rdS = convert(acc_dP, self.dtype)
        cute.copy(stsm_PdS, stsm_PdS.retile(rdS), tPdSsPdS[None, None, None, DS_STAGE])
        cute.arch.fence_view_async_shared()  # P's and dS's generic-proxy writes, visible to wgmma
        cute.arch.barrier(barrier_id=int(Barrier.PDS), number_of_threads=self.num_mma_threads)

        # dV^T += dO^T P, dQ = dS K (all the CTA's keys; in dq_parts column parts), dK^T += Q^T dS
        common.wgmma(mma_dkv, acc_dV, tdVrdOt[None, None, None, do_stage], tdKVrPdS[None, None, None, P_STAGE],
                     zero_init=False, wait=-1)
        dq_shape = thr_dq.partition_shape_C((self.tile_m, self.head_dim // self.dq_parts))
        acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
        common.wgmma(mma_dq, acc_dQ, tdQrdS[None, None, None, DS_STAGE], tdQrKt[0], zero_init=True, wait=1)
        common.release_stage(pipe_do, do_state)  # dO: read by dP and dV^T, both done
        common.wgmma(mma_dkv, acc_dK, tdKrQt[None, None, None, q_stage], tdKVrPdS[None, None, None, DS_STAGE],
                     zero_init=False, wait=1)
        self._stage_dq(acc_dQ, tdQsdQ, wg)
        for p in cutlass.range_constexpr(1, self.dq_parts):
            # the next part's GEMM runs while the dQ writer reduces the last one
            acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
            common.wgmma(mma_dq, acc_dQ, tdQrdS[None, None, None, DS_STAGE], tdQrKt[p], zero_init=True, wait=1)
            if const_expr(p == 1):
                common.release_stage(pipe_q, q_state)  # Q: read by S and dK^T, both done
            warpgroup.wait_group(0)
            self._stage_dq(acc_dQ, tdQsdQ, wg)

        if const_expr(self.dq_parts == 1):
            warpgroup.wait_group(0)
            common.release_stage(pipe_q, q_state)  # Q: read by S and dK^T, both done

    @cute.jit
    def _stage_dq(self, acc_dQ: cute.Tensor, tdQsdQ: cute.Tensor, wg: Int32):
        """dQ (one part) -> this warpgroup's shared buffer, once the dQ writer has handed it back."""
        cute.arch.barrier(barrier_id=int(Barrier.DQ_EMPTY_WG1) + wg, number_of_threads=WARPGROUP_THREADS + 32)
        cute.autovec_copy(cute.make_tensor(acc_dQ.iterator, cute.make_layout(tdQsdQ.shape)), tdQsdQ)
        cute.arch.fence_view_async_shared()  # visible to the bulk reduction (async proxy)
        cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_FULL_WG1) + wg, number_of_threads=WARPGROUP_THREADS + 32)

    @cute.jit
    def _per_row(self, thr_sdp: cute.ThrMma, sRow: cute.Tensor, stage: Int32) -> cute.Tensor:
        """sRow[query, stage] for each accumulator row (query) of this thread, in registers."""
        rows_of_one = cute.make_tensor(sRow[None, stage].iterator,
                                       cute.make_layout((self.tile_m, self.tile_n), stride=(1, 0)))
        view = acc_to_rows_cols(thr_sdp.partition_C(rows_of_one))[None, 0]
        values = cute.make_rmem_tensor(cute.size(view), Float32)
        for r in cutlass.range_constexpr(cute.size(view)):
            values[r] = view[r]
        return values
