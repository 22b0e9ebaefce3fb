"""FlashAttention-2 forward for SM80+ (mma.sync, cp.async, ldmatrix), written with the CuTe DSL.

Grid: (Q block, head, batch). Each CTA keeps its Q tile in shared memory and walks the K/V blocks
from the last visible one down to block 0, so the only partial (seqlen_k boundary) block and the
blocks that cross the causal diagonal come first and the mask-free blocks run in a tight loop.
Warps are stacked along the Q rows: every warp owns whole rows of S, so the softmax needs only
quad shuffles, never shared memory.

Per K/V block n (``_attend_block``):
    wait for K[n] -> issue cp.async for V[n-1] -> S = Q K[n]^T -> mask -> online softmax
    -> wait for V[n] -> O += P V[n] -> issue cp.async for K[n-2]
K and V each have ``num_stages`` shared-memory buffers, so with 2 stages the loads of blocks
n-1 and n-2 overlap the MMAs of block n. (With one stage K[n-1] is issued right after S.)

KV-cache decode (features kvcache, paged, split, pack_gqa; interface.flash_attn_with_kvcache) is
this kernel too, on every GPU: decoding is bound by reading K and V, which cp.async does as well as
TMA, so what matters is how many CTAs read at once.
- kvcache: per-sequence key ranges from cache_seqlens / cache_leftpad / cache_batch_idx (seqlen_info).
- paged: K/V block n of sequence b is rows (n * tile_n) % page_size.. of page
  block_table[b, n * tile_n // page_size] where tile_n divides the page size; otherwise
  (paged_rows: pages of any size) key j of a block is row j % page_size of page
  block_table[b, j // page_size], one block-table read per row a thread copies.
- split: the grid's z is (sequence, split); each split walks its share of the K/V blocks
  (block_info.clip_walk) and writes O and LSE in fp32 to the split's slice of the accumulators, which
  kernels/combine.py merges. A split that sees no key writes O = 0 and LSE = +inf. With
  ``merge_in_cta`` (a decode step's few rows per tile) the tile's last split to finish merges them
  itself (``_merge_splits``: a counter per tile, kept at zero between launches), which saves the
  combine kernel's launch; otherwise the combine kernel runs after this one.
- varlen with paged (flash_attn_varlen_func's block_table): packed queries (cu_seqlens_q) over
  paged keys counted by seqused; the split accumulators and LSE are then (.., 1, total_q, ..).
- pack_gqa: the grid's y is the K/V head; tile row p is query p // g of query head
  head_kv * g + p % g (g query heads per K/V head), so the g heads of a decode step (seqlen_q = 1)
  share one CTA and each K/V block is read once. Q is loaded and O stored row by row.
"""

from functools import partial
from typing import Type

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_attn.kernels import block_info
from cute_attn.kernels.combine import SplitCombine, row_copy, row_lanes
from cute_attn.kernels.features import NO_FEATURES, Features
from cute_attn.kernels.layout import acc_to_operand_a, acc_to_rows_cols, convert, transpose_smem
from cute_attn.kernels.mask import alibi_slope_units, apply_score_mods
from cute_attn.kernels.seqlen_info import SeqlenInfo
from cute_attn.kernels.softmax import OnlineSoftmax
from cute_attn.kernels.sm80 import common
from cute_attn.traits import SPLIT_MERGE_LANES_PER_ROW


class FlashAttentionForwardSm80:
    """Compile-time configuration of one forward variant; ``__call__`` is the host-side launch.

    head_dim: the padded head dim of the traits entry (the actual one is a run-time shape and
    columns past it are zero-filled on load and skipped on store when ``check_hdim``).
    features: local window, softcap, ALiBi, varlen (kernels/features.py).
    """

    def __init__(
        self,
        dtype: Type[cutlass.Numeric],
        head_dim: int,
        tile_m: int,
        tile_n: int,
        num_warps: int,
        num_stages: int,
        causal: bool,
        check_hdim: bool,
        pv_chunks: int = 1,
        features: Features = NO_FEATURES,
    ):
        assert tile_m % (16 * num_warps) == 0 and tile_n % 16 == 0 and head_dim % 16 == 0
        assert num_stages in (1, 2)
        rows = common.copy_rows_per_pass(dtype, head_dim, num_warps * 32)
        assert tile_m % rows == 0 and tile_n % rows == 0, f"tiles of whole {rows}-row copy passes, got {tile_m}x{tile_n}"
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_warps = num_warps
        self.num_threads = num_warps * 32
        self.num_stages = num_stages
        self.causal = causal
        self.check_hdim = check_hdim
        self.pv_chunks = pv_chunks
        self.features = features
        f = features
        if f.split:  # _merge_splits' row merge: 8 lanes per row (4 rows per warp, 16 per CTA of 4
            # warps: a decode tile's rows in one pass), 16 fp32 loads in flight per lane
            tpr = min(SPLIT_MERGE_LANES_PER_ROW, row_lanes(head_dim)[0])
            chunks = head_dim // 4 // tpr
            self.row_merge = SplitCombine(dtype, head_dim, check_hdim, num_warps=num_warps,
                                          unroll=max(1, min(8, 16 // chunks)), threads_per_row=tpr)
            # its count and sums live in sQ's memory
            assert 16 + 4 * num_warps * self.row_merge.rows_per_warp * head_dim <= tile_m * head_dim * dtype.width // 8
        # the decode features serve dense batches (flash_attn_with_kvcache, forward's split path)
        # (varlen with paged / split / pack_gqa: flash_attn_varlen_func's block_table, keys counted by seqused)
        assert not (f.varlen and f.kvcache), "a KV cache's batches are dense (varlen pages through seqused)"
        assert not (f.paged and not f.seqused_k), "a paged cache needs the per-sequence key counts (kvcache, seqused)"
        assert not (f.paged_rows and not f.paged), "paged_rows is a way of paging: it comes with paged"
        # packed rows mix query heads: a per-head ALiBi slope would have to be per row
        assert not (f.pack_gqa and f.alibi), "pack_gqa without ALiBi"

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim)
        mV: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim)
        mO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q) float32
        softmax_scale_log2: Float32,
        mCuSeqlensQ: cute.Tensor | None,  # varlen: (batch + 1,) int32; the tensors then have batch 1
        mCuSeqlensK: cute.Tensor | None,
        # seqused: (batch,) int32, each sequence's keys; kvcache: one past each sequence's last key row
        mSeqUsedK: cute.Tensor | None,
        mAlibiSlopes: cute.Tensor | None,  # ALiBi: (batch, heads) fp32
        max_seqlen_q: Int32,  # varlen: the longest sequence (the grid)
        window_left: Int32,  # local: the window's edges (an unbounded side is huge)
        window_right: Int32,
        softcap_scale: Float32,  # softcap: softmax_scale / softcap
        mLeftPadK: cute.Tensor | None,  # kvcache: (batch,) int32, each sequence's first key row
        mKVBatchIdx: cute.Tensor | None,  # kvcache: (batch,) int32, each sequence's K/V batch row
        mBlockTable: cute.Tensor | None,  # paged: (batch, max_pages) int32; K/V (pages, page_size, heads_kv, d)
        mOAccum: cute.Tensor | None,  # split: (num_splits, batch, seqlen_q, heads, d) fp32
        mLSEAccum: cute.Tensor | None,  # split: (num_splits, batch, heads, seqlen_q) fp32
        num_splits: Int32,  # split: K/V pieces per (Q block, head, sequence)
        mSplitCounter: cute.Tensor | None,  # split: (tiles,) int32, zero at launch and left at zero
        merge_in_cta: Int32,  # split: 1: each tile's last split merges the tile (else the combine kernel)
        stream: cuda.CUstream,
    ):
        atom = common.smem_layout_atom(self.dtype, self.head_dim)
        sQ_layout = cute.tile_to_shape(atom, (self.tile_m, self.head_dim), (0, 1))
        sKV_layout = cute.tile_to_shape(atom, (self.tile_n, self.head_dim, self.num_stages), (0, 1, 2))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]

        copy_load = common.gmem_tiled_copy(self.dtype, self.head_dim, self.num_threads, asynchronous=True)
        copy_store = common.gmem_tiled_copy(self.dtype, self.head_dim, self.num_threads, asynchronous=False)
        mma = common.tiled_mma(self.dtype, self.num_warps)
        varlen = const_expr(mCuSeqlensQ is not None)
        rows = max_seqlen_q if varlen else mQ.shape[1]
        heads = mQ.shape[2]
        if const_expr(self.features.pack_gqa):  # a tile's rows: (query, query head of this K/V head)
            rows, heads = rows * (mQ.shape[2] // mK.shape[2]), mK.shape[2]
        num_m_blocks = cute.ceil_div(rows, self.tile_m)
        batch = mCuSeqlensQ.shape[0] - 1 if varlen else mQ.shape[0]
        if const_expr(self.features.split):
            batch = batch * num_splits
        self.kernel(
            mQ, mK, mV, mO, mLSE, softmax_scale_log2, mCuSeqlensQ, mCuSeqlensK, mAlibiSlopes,
            window_left, window_right, softcap_scale, mSeqUsedK, mLeftPadK, mKVBatchIdx, mBlockTable,
            mOAccum, mLSEAccum, num_splits, mSplitCounter, merge_in_cta,
            sQ_layout, sKV_layout, copy_load, copy_store, mma, SharedStorage,
        ).launch(
            grid=(num_m_blocks, cute.size(heads), cute.size(batch)),
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale_log2: Float32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mAlibiSlopes: cute.Tensor | None,
        window_left: Int32,
        window_right: Int32,
        softcap_scale: Float32,
        mSeqUsedK: cute.Tensor | None,
        mLeftPadK: cute.Tensor | None,
        mKVBatchIdx: cute.Tensor | None,
        mBlockTable: cute.Tensor | None,
        mOAccum: cute.Tensor | None,
        mLSEAccum: cute.Tensor | None,
        num_splits: Int32,
        mSplitCounter: cute.Tensor | None,
        merge_in_cta: Int32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        copy_load: cute.TiledCopy,
        copy_store: cute.TiledCopy,
        mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block_raw, head, batch = cute.arch.block_idx()
        num_m_blocks, num_heads_grid, _ = cute.arch.grid_dim()
        split = Int32(0)
        tile_id = Int32(0)  # split: the tile's counter, the same for all its splits
        if const_expr(self.features.split):
            split = batch % num_splits
            batch = batch // num_splits
            tile_id = (batch * num_heads_grid + head) * num_m_blocks + m_block_raw
        # causal: the last Q blocks see the most keys; launching them first evens out the tail
        m_block = num_m_blocks - 1 - m_block_raw if const_expr(self.causal) else m_block_raw
        seq = SeqlenInfo(batch, mQ.shape[1], mK.shape[1], mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mLeftPadK, mKVBatchIdx)
        tile = partial(
            self._tile, mQ, mK, mV, mO, mLSE, softmax_scale_log2, mAlibiSlopes, window_left, window_right,
            softcap_scale, mBlockTable, mOAccum, mLSEAccum, num_splits, split, mSplitCounter, merge_in_cta, tile_id,
            sQ_layout, sKV_layout, copy_load, copy_store, mma, SharedStorage, seq, m_block, head, tidx,
        )
        if const_expr(self.features.varlen):
            rows_q = seq.seqlen_q
            if const_expr(self.features.pack_gqa):  # the tile rows of the query heads of a K/V head
                rows_q = seq.seqlen_q * (mQ.shape[2] // mK.shape[2])
            if m_block * self.tile_m < rows_q:  # the grid is sized for the longest sequence
                tile()
        else:
            tile()

    @cute.jit
    def _tile(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        softmax_scale_log2: Float32,
        mAlibiSlopes: cute.Tensor | None,
        window_left: Int32,
        window_right: Int32,
        softcap_scale: Float32,
        mBlockTable: cute.Tensor | None,
        mOAccum: cute.Tensor | None,
        mLSEAccum: cute.Tensor | None,
        num_splits: Int32,
        split: Int32,
        mSplitCounter: cute.Tensor | None,
        merge_in_cta: Int32,
        tile_id: Int32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        copy_load: cute.TiledCopy,
        copy_store: cute.TiledCopy,
        mma: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        seq: SeqlenInfo,
        m_block: Int32,
        head: Int32,
        tidx: Int32,
    ):
        """One (Q block, head, sequence) tile (pack_gqa: K/V head; split: one split of it): the
        whole CTA's work."""
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        head_dim = mQ.shape[3]
        qhead_per_kvhead = mQ.shape[2] // mK.shape[2]  # GQA/MQA: K/V are shared, never copied
        pack = None  # packed GQA: tile row p is query p // pack of query head head_kv * pack + p % pack
        if const_expr(self.features.pack_gqa):
            head_kv, pack = head, qhead_per_kvhead
            rows_q = seqlen_q * qhead_per_kvhead
        else:
            head_kv = head // qhead_per_kvhead
            rows_q = seqlen_q
        window_left = window_left if const_expr(self.features.local) else None
        window_right = window_right if const_expr(self.features.local) else None
        walk = block_info.forward_walk(
            m_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k, self.causal, window_left, window_right,
            qhead_per_kvhead=pack,
        )
        if const_expr(self.features.split):  # this split's share of the K/V blocks
            per_split = block_info.split_blocks(seqlen_k, self.tile_n, num_splits)
            walk = block_info.clip_walk(walk, split * per_split, (split + 1) * per_split)
        n_block_max, n_masked_right, n_unmasked, n_masked_left = walk
        n_first = cutlass.max(n_block_max - 1, 0)

        # ---- tiles of this CTA in global memory
        tile_q = (self.tile_m, self.head_dim)
        tile_kv = (self.tile_n, self.head_dim)
        b = seq.tensor_batch
        gQ = cute.local_tile(seq.q_rows(mQ[b, None, head if const_expr(pack is None) else 0, None]), tile_q,
                             (m_block, 0))  # pack_gqa: only its column layout is used (_copy_packed_rows)
        kv_b = 0 if const_expr(self.features.paged) else seq.kv_batch  # paged: the page (_load_kv)
        gK = cute.local_tile(seq.k_rows(mK[kv_b, None, head_kv, None]), tile_kv, (None, 0))  # (n, d, n_block)
        gV = cute.local_tile(seq.k_rows(mV[kv_b, None, head_kv, None]), tile_kv, (None, 0))

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sKV_layout)
        sV = storage.sV.get_tensor(sKV_layout)
        sVt = transpose_smem(sV)  # (d, n, stage): V as the B operand of O = P V

        # ---- global -> shared copies (cp.async, 128-bit)
        thr_load = copy_load.get_slice(tidx)
        tQgQ, tQsQ = thr_load.partition_S(gQ), thr_load.partition_D(sQ)
        tKgK, tKsK = thr_load.partition_S(gK), thr_load.partition_D(sK)
        tVgV, tVsV = thr_load.partition_S(gV), thr_load.partition_D(sV)
        tQcQ = thr_load.partition_S(cute.make_identity_tensor(tile_q))
        tKVcKV = thr_load.partition_S(cute.make_identity_tensor(tile_kv))

        # ---- MMA partitions and shared -> register copies (ldmatrix)
        thr_mma = mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.head_dim)), Float32)
        acc_O.fill(0.0)
        ldsm_Q = cute.make_tiled_copy_A(common.ldmatrix_atom(self.dtype), mma).get_slice(tidx)
        ldsm_K = cute.make_tiled_copy_B(common.ldmatrix_atom(self.dtype), mma).get_slice(tidx)
        ldsm_V = cute.make_tiled_copy_B(common.ldmatrix_atom(self.dtype, transpose=True), mma).get_slice(tidx)
        tSsQ = ldsm_Q.partition_S(sQ)
        tSsK = ldsm_K.partition_S(sK)
        tOsVt = ldsm_V.partition_S(sVt)

        # (row, col) of every S element this thread holds, and of thread 0's, for masking
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS = thr_mma.partition_C(cS)
        tScS_thread0 = mma.get_slice(0).partition_C(cS)

        softmax = OnlineSoftmax(softmax_scale_log2, num_rows=cute.size(acc_O.shape[0][1]) * cute.size(acc_O.shape[1]))
        alibi_slope = None
        if const_expr(self.features.alibi):
            alibi_slope = alibi_slope_units(mAlibiSlopes, seq.batch, head, softmax_scale_log2)
        # softcap, ALiBi and the masks of one S tile (mask.py), given n_block and check_bounds
        score_mod = partial(
            apply_score_mods, tScS=tScS, tScS_thread0=tScS_thread0, m_block=m_block, tile_m=self.tile_m,
            tile_n=self.tile_n, causal=self.causal, seqlen_q=seqlen_q,
            seqlen_k=seqlen_k, window_left=window_left, window_right=window_right, alibi_slope=alibi_slope,
            softcap_scale=softcap_scale if const_expr(self.features.softcap) else None, qhead_per_kvhead=pack,
        )

        pages_k = pages_v = page_of = None
        if const_expr(self.features.paged_rows):  # (K or V of this head by page, the copy slice)
            # pages shorter than a block, or not a multiple of it: each copy pass's row finds its
            # own page, by multiply and shift (an integer division cost ~20 instructions)
            page_rows = cute.FastDivmodDivisorV2(mK.shape[1])
            page_of = partial(self._pages_of_rows, mBlockTable[seq.batch, None], page_rows, tKVcKV)
            pages_k = (mK[None, None, head_kv, None], thr_load)
            pages_v = (mV[None, None, head_kv, None], thr_load)
        elif const_expr(self.features.paged):
            # the page of block n is n // blocks_per_page (tile_n divides the page size), by
            # multiply and shift
            blocks_per_page = cute.FastDivmodDivisorV2(mK.shape[1] // self.tile_n)
            page_of = partial(self._page_of, mBlockTable[seq.batch, None], blocks_per_page)
            pages_k = (mK[None, None, head_kv, None], thr_load)
            pages_v = (mV[None, None, head_kv, None], thr_load)
        load_K = partial(self._load_kv, copy_load, tKgK, tKsK, tKVcKV, seqlen_k, head_dim, pages_k)
        load_V = partial(self._load_kv, copy_load, tVgV, tVsV, tKVcKV, seqlen_k, head_dim, pages_v)

        # the rows of one packed-GQA tile: (query, query head) of this Q block's row p
        row_q_head = partial(self._row_q_head, m_block, head, pack)

        # ---- prologue: Q and the first K (one cp.async group), then the other stages.
        # Group order: [Q, K0] V0 K1 (2 stages) or [Q, K0] (1 stage); each iteration then commits
        # one V and one K group, so "wait until at most 2*s - 2 groups are pending" always means
        # "the oldest group has landed".
        rows_left = rows_q - m_block * self.tile_m
        if const_expr(pack is None):
            common.copy_rows(copy_load, tQgQ, tQsQ, tQcQ, rows_left, head_dim, True, self.check_hdim)
        else:
            mQ_rows = seq.q_rows(mQ[b, None, None, None])  # (seqlen_q, heads, d)
            self._copy_packed_rows(copy_load, tQgQ, tQsQ, tQcQ, rows_left, head_dim, mQ_rows, row_q_head,
                                   to_global=False)
        page_first = page_second = page_carry = None
        if const_expr(self.features.paged):
            page_first, page_second = page_of(n_first), page_of(n_first - 1)
        if const_expr(self.features.paged_rows):
            # the pages of the next V load (its block's K load read them: _keep_pages)
            page_carry = cute.make_rmem_tensor((cute.size(tKVcKV.shape[1]), 2), Int32)
            self._keep_pages(page_carry, page_second if const_expr(self.num_stages == 2) else page_first)
        load_K(n_first, 0, boundary=True, page=page_first)
        cute.arch.cp_async_commit_group()
        if const_expr(self.num_stages == 2):
            load_V(n_first, 0, boundary=True, page=page_first)
            cute.arch.cp_async_commit_group()
            if n_first - 1 >= 0:
                load_K(n_first - 1, 1, boundary=False, page=page_second)
            cute.arch.cp_async_commit_group()

        attend = self._attend_block
        ctx = (
            thr_mma, mma, tSrQ, tSrK, tOrVt, tSsQ, tSsK, tOsVt, ldsm_Q, ldsm_K, ldsm_V,
            acc_O, softmax, load_K, load_V, score_mod, page_of, page_carry,
        )
        # From the last visible block down: the blocks crossing the seqlen_k end or the right edge
        # (causal diagonal / window) are masked, then the fully visible ones, then those crossing
        # the window's left edge (block_info.forward_walk).
        read_stage = Int32(0)
        write_stage = Int32(self.num_stages - 1)
        for i in cutlass.range(n_masked_right, unroll=1):
            attend(ctx, n_first - i, read_stage, write_stage, masked=True)
            read_stage, write_stage = self._advance(read_stage), self._advance(write_stage)
        for i in cutlass.range(n_unmasked, unroll=1):
            attend(ctx, n_first - n_masked_right - i, read_stage, write_stage, masked=False)
            read_stage, write_stage = self._advance(read_stage), self._advance(write_stage)
        if const_expr(self.features.local):
            for i in cutlass.range(n_masked_left, unroll=1):
                attend(ctx, n_first - n_masked_right - n_unmasked - i, read_stage, write_stage, masked=True)
                read_stage, write_stage = self._advance(read_stage), self._advance(write_stage)
        cute.arch.cp_async_wait_group(0)

        # ---- epilogue: O /= rowsum, LSE; O goes registers -> shared (reusing sQ) -> global
        lse = softmax.finalize(acc_O)
        tOcO = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        if const_expr(self.features.split):
            # fp32 partials of this split, straight from registers (a decode tile has few rows)
            self._store_partial(acc_O, lse, tOcO, mOAccum[split, b, None, None, None],
                                mLSEAccum[split, b, None, None], rows_left, head_dim, row_q_head, seq.offset_q)
            if merge_in_cta != 0:
                self._merge_splits(mOAccum, mLSEAccum, mO, mLSE, num_splits, mSplitCounter, tile_id, sQ, seq,
                                   rows_left, row_q_head)
        else:
            rO = convert(acc_O, self.dtype)
            # LSE: the thread holding column 0 of a row writes it
            gLSE = cute.local_tile(seq.q_rows(mLSE[b, head, None]), (self.tile_m,), (m_block,))
            mLSE_rows = None  # varlen packed GQA: (heads, this sequence's queries)
            if const_expr(self.features.varlen and pack is not None):
                mLSE_rows = cute.domain_offset((0, seq.offset_q), mLSE[b, None, None])
            if tOcO[0][1] == 0:
                for r in cutlass.range_constexpr(cute.size(lse)):
                    row = tOcO[(0, r % 2), r // 2, 0][0]
                    if row < rows_left:
                        if const_expr(pack is None):
                            gLSE[row] = lse[r]
                        else:
                            q_idx, h = row_q_head(row)
                            if const_expr(self.features.varlen):
                                mLSE_rows[h, q_idx] = lse[r]
                            else:
                                mLSE[b, h, q_idx] = lse[r]

            cute.arch.barrier()  # every warp is done reading sQ and sV: O reuses sQ's memory
            sO = cute.make_tensor(sQ.iterator, sQ_layout)
            if const_expr(pack is None):
                gO = cute.local_tile(seq.q_rows(mO[b, None, head, None]), tile_q, (m_block, 0))
                common.store_acc_tile(rO, sO, mma, copy_store, gO, tidx, rows_left, head_dim, self.check_hdim)
            else:  # through shared memory as store_acc_tile does, then row by row to (query, head)
                thr_store, tOrO, tOcO_store = common.acc_tile_to_rows(rO, sO, mma, copy_store, tidx)
                tOgO = thr_store.partition_D(gQ)  # the column layout of a row (like Q's)
                self._copy_packed_rows(copy_store, tOgO, tOrO, tOcO_store, rows_left, head_dim,
                                       seq.q_rows(mO[b, None, None, None]), row_q_head, to_global=True)

    @cute.jit
    def _merge_splits(self, mOAccum: cute.Tensor, mLSEAccum: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                      num_splits: Int32, mSplitCounter: cute.Tensor, tile_id: Int32, sQ: cute.Tensor,
                      seq: SeqlenInfo, rows_left: Int32, row_q_head):
        """Split-KV, after this split stored its partials: the tile's last split to get here merges
        every split's partials of the tile's rows into O and LSE (kernels/combine.py's row merge).
        Each split publishes its stores (barrier, fence, then one atomic add on the tile's counter);
        the one that takes the count to num_splits acquires theirs (fence, which also invalidates
        the SM's L1, then barrier) and resets the counter to zero for the next launch. ``sQ``'s
        memory (Q is no longer read) holds the count and the merge's sums."""
        tidx, _, _ = cute.arch.thread_idx()
        counter = mSplitCounter.iterator + tile_id
        sFlag = cute.make_tensor(cute.recast_ptr(sQ.iterator, dtype=Int32), cute.make_layout(1))
        # one thread releases the whole CTA's stores (the barrier, then its fence: CUTLASS's
        # semaphore arrive) and, after the count, acquires the other splits' for the CTA
        cute.arch.barrier()  # (every warp is also done with sQ)
        if tidx == 0:
            cute.arch.fence_acq_rel_gpu()
            sFlag[0] = cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu")
            cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()
        if sFlag[0] == num_splits - 1:
            if tidx == 0:
                cute.arch.store(counter, Int32(0))
            rows_per_warp, threads_per_row = self.row_merge.rows_per_warp, self.row_merge.threads_per_row
            rows = cutlass.min(rows_left, self.tile_m)
            # several warps share a row's splits when the tile's rows fit one pass of fewer warps
            # (a decode step: one to a few rows, up to ~128 splits; summed through shared memory)
            group = Int32(1)
            for k in cutlass.range_constexpr(self.num_warps.bit_length() - 1):
                warps = 2 ** (k + 1)
                if (num_splits >= warps) & (rows <= rows_per_warp * (self.num_warps // warps)):
                    group = Int32(warps)
            rows_per_pass = rows_per_warp * (self.num_warps // group)
            sacc_layout = cute.make_ordered_layout((self.num_warps, rows_per_warp, self.head_dim),
                                                   order=(2, 1, 0))
            # past the count's 16 bytes, so no warp's sums can land on it before all have read it
            sAcc = cute.make_tensor(cute.recast_ptr(sQ.iterator + 16 // (self.dtype.width // 8), dtype=Float32),
                                    sacc_layout)
            copy_acc = row_copy(Float32, threads_per_row)
            copy_out = row_copy(self.dtype, threads_per_row)
            b = seq.tensor_batch
            lse_out = mLSE[b, None, None]  # (heads, seqlen_q; varlen: total_q)
            out_rows = mO[b, None, None, None]
            warp, lane = tidx // 32, tidx % 32
            for base in cutlass.range(0, rows, rows_per_pass, unroll=1):
                row = base + (warp // group) * rows_per_warp + lane // threads_per_row
                row_ok = row < rows
                q_idx, h = row_q_head(cutlass.min(row, rows - 1))
                if const_expr(self.features.varlen):  # the packed tensors' rows of this sequence
                    q_idx = q_idx + seq.offset_q
                self.row_merge.merge_row(mOAccum[None, b, q_idx, None, None], mLSEAccum[None, b, h, q_idx],
                                         out_rows[q_idx, None, None], h, lse_out, (h, q_idx), row_ok, group,
                                         sAcc, copy_acc, copy_out)

    def _row_q_head(self, m_block: Int32, head: Int32, pack, row: Int32):
        """(query, query head) of tile row ``row`` of Q block ``m_block``: with packed GQA (``pack``
        query heads per K/V head ``head``) row p of the packed rows is query p // pack of head
        head * pack + p % pack; otherwise the row's own query of ``head``."""
        p = m_block * self.tile_m + row
        if const_expr(pack is None):
            return p, head
        q_idx = p // pack
        return q_idx, head * pack + (p - q_idx * pack)

    @cute.jit
    def _copy_packed_rows(self, tiled_copy: cute.TiledCopy, tXgX: cute.Tensor, tXrX: cute.Tensor, tXcX: cute.Tensor,
                          rows_left: Int32, head_dim: Int32, mRows: cute.Tensor, row_q_head,
                          to_global: cutlass.Constexpr[bool]):
        """Copy a (CPY, ROWS, COLS) partition row by row between a tile and the rows of ``mRows``
        (seqlen_q, heads, d) that ``row_q_head`` names (packed GQA): ``tXgX``, a partition of any
        dense tile, gives the column layout of one row; each row's address is its own. Rows at or
        past ``rows_left`` are skipped (zero-filled on load); columns past ``head_dim`` too."""
        for m in cutlass.range_constexpr(cute.size(tXrX.shape[1])):
            # (a row past rows_left has an address past the tensor; its predicate keeps it untouched)
            q_idx, h = row_q_head(tXcX[0, m, 0][0])
            row_ptr = mRows[q_idx, h, None].iterator + tXcX[0, m, 0][1]
            g_row = cute.make_tensor(row_ptr, tXgX[None, m, None].layout)
            pred = common.vector_predicate(tXrX, tXcX, m, rows_left, head_dim, True, self.check_hdim)
            if const_expr(to_global):
                cute.copy(tiled_copy, tXrX[None, m, None], g_row, pred=pred)
            else:
                cute.copy(tiled_copy, g_row, tXrX[None, m, None], pred=pred)

    @cute.jit
    def _store_partial(self, acc_O: cute.Tensor, lse: cute.Tensor, tOcO: cute.Tensor, mOAccum: cute.Tensor,
                       mLSEAccum: cute.Tensor, rows_left: Int32, head_dim: Int32, row_q_head, offset_q):
        """Split-KV: this split's O (normalised by its own row sums) and LSE, fp32, to its slices
        mOAccum (seqlen_q, heads, d) and mLSEAccum (heads, seqlen_q); varlen: the sequence's rows
        from ``offset_q`` of the packed (total_q) ones."""
        O = acc_to_rows_cols(acc_O)
        coords = acc_to_rows_cols(tOcO)
        for r in cutlass.range_constexpr(cute.size(O.shape[0])):
            row = coords[r, 0][0]
            if row < rows_left:
                q_idx, h = row_q_head(row)
                if const_expr(self.features.varlen):
                    q_idx = q_idx + offset_q
                out_row = mOAccum[q_idx, h, None]
                for c in cutlass.range_constexpr(cute.size(O.shape[1])):
                    col = coords[r, c][1]
                    if const_expr(self.check_hdim):
                        if col < head_dim:
                            out_row[col] = O[r, c]
                    else:
                        out_row[col] = O[r, c]
                if coords[0, 0][1] == 0:  # the thread holding column 0 of the row
                    mLSEAccum[h, q_idx] = lse[r]

    @cute.jit
    def _load_kv(
        self,
        copy_load: cute.TiledCopy,
        tXgX: cute.Tensor,
        tXsX: cute.Tensor,
        tXcX: cute.Tensor,
        seqlen_k: Int32,
        head_dim: Int32,
        pages,
        n_block: Int32,
        stage,
        boundary: cutlass.Constexpr[bool],
        page=None,
    ):
        """cp.async one K or V block into a stage; ``boundary``: the block may end past seqlen_k.
        ``pages``: a paged cache (K or V by page, the thread's copy slice), ``page`` then the
        block's (page, block within the page) from ``_page_of``, or with paged_rows the (page, row
        within the page) of each copy pass's row from ``_pages_of_rows`` (the row's own address)."""
        if const_expr(self.features.paged_rows):  # ``page``: (page, row within it) of each pass
            mX_pages = pages[0]
            dst = tXsX[None, None, None, stage]
            rows_left = seqlen_k - n_block * self.tile_n
            for m in cutlass.range_constexpr(cute.size(dst.shape[1])):
                page_idx, row_in_page = page[m]
                row_ptr = mX_pages[page_idx, row_in_page, None].iterator + tXcX[0, m, 0][1]
                src_row = cute.make_tensor(row_ptr, tXgX[None, m, None, 0].layout)
                if const_expr(boundary or self.check_hdim):
                    pred = common.vector_predicate(dst, tXcX, m, rows_left, head_dim, boundary, self.check_hdim)
                    cute.copy(copy_load, src_row, dst[None, m, None], pred=pred)
                else:
                    cute.copy(copy_load, src_row, dst[None, m, None])
        else:
            if const_expr(pages is None):
                src = tXgX[None, None, None, n_block]
            else:
                mX_pages, thr_load = pages
                page_idx, block_in_page = page
                g_block = cute.local_tile(mX_pages[page_idx, None, None], (self.tile_n, self.head_dim),
                                          (block_in_page, 0))
                src = thr_load.partition_S(g_block)
            common.copy_rows(copy_load, src, tXsX[None, None, None, stage], tXcX,
                             seqlen_k - n_block * self.tile_n, head_dim, boundary, self.check_hdim)

    @cute.jit
    def _keep_pages(self, page_carry: cute.Tensor, pages):
        """paged_rows: keep the (page, row) pairs of a K load (``_pages_of_rows``) in registers for
        the V load of the same block, an iteration later: half the block-table reads, and none in
        front of a V load (H100, pages of 1-16 keys: +1.5-6% at B1, level elsewhere)."""
        for m in cutlass.range_constexpr(cute.size(page_carry.shape[0])):
            page_carry[m, 0] = pages[m][0]
            page_carry[m, 1] = pages[m][1]

    def _kept_pages(self, page_carry: cute.Tensor):
        """The (page, row) pairs ``_keep_pages`` stored."""
        return [(page_carry[m, 0], page_carry[m, 1]) for m in range(cute.size(page_carry.shape[0]))]

    @cute.jit
    def _page_of(self, table: cute.Tensor, blocks_per_page, n_block: Int32):
        """Paged cache: (page, block within the page) of K/V block ``n_block`` (a tile_n-row slice
        of one page), from the sequence's block table row. A block before 0 (no load follows) and
        a sequence without keys (block 0, every row predicated off) read a valid entry."""
        page_idx, block_in_page = divmod(cutlass.max(n_block, 0), blocks_per_page)
        return table[cutlass.min(page_idx, cute.size(table.shape[0]) - 1)], block_in_page

    @cute.jit
    def _pages_of_rows(self, table: cute.Tensor, page_rows, tXcX: cute.Tensor, n_block: Int32):
        """Paged cache by rows (pages of any size): (page, row within the page) of this thread's
        row in each copy pass of K/V block ``n_block`` (``tXcX``: the copy slice's coordinates).
        Rows past the sequence's last page (predicated off) and a block before 0 read a valid entry."""
        first_key = cutlass.max(n_block, 0) * self.tile_n
        last_page = cute.size(table.shape[0]) - 1
        pages = []
        for m in cutlass.range_constexpr(cute.size(tXcX.shape[1])):
            page_idx, row_in_page = divmod(first_key + tXcX[0, m, 0][0], page_rows)
            pages.append((table[cutlass.min(page_idx, last_page)], row_in_page))
        return pages

    def _advance(self, stage: Int32) -> Int32:
        return (stage + 1) % self.num_stages

    @cute.jit
    def _attend_block(
        self,
        ctx,
        n_block: Int32,
        read_stage: Int32,
        write_stage: Int32,
        masked: cutlass.Constexpr[bool],
    ):
        """One K/V block: S = Q K^T, mask, online softmax, O += P V, with the next loads in flight."""
        (thr_mma, mma, tSrQ, tSrK, tOrVt, tSsQ, tSsK, tOsVt, ldsm_Q, ldsm_K, ldsm_V,
         acc_O, softmax, load_K, load_V, score_mod, page_of, page_carry) = ctx
        s = self.num_stages
        stage_r = read_stage if const_expr(s > 1) else 0
        page_v = page_k = None
        if const_expr(page_of is not None):
            # the block-table reads of this iteration's loads come first, so that their latency
            # passes in the wait below rather than in front of each load
            if const_expr(page_carry is None):
                page_v = page_of(n_block - (s - 1))
            else:  # paged_rows: V[n - s + 1]'s pages were read last iteration, for its K
                page_v = self._kept_pages(page_carry)
            page_k = page_of(n_block - s)  # K[n - s] (one stage: K[n - 1])
            if const_expr(page_carry is not None):
                self._keep_pages(page_carry, page_k)

        cute.arch.cp_async_wait_group(2 * s - 2)  # K[n_block] landed ...
        cute.arch.barrier()  # ... for every thread, and everyone is done with the buffer reused next
        # V of block n - (s - 1) into the buffer that V[n - s] used
        v_block = n_block - (s - 1)
        if v_block >= 0:
            # (one stage: the first block's V, the seqlen_k boundary, is loaded here)
            load_V(v_block, write_stage if const_expr(s > 1) else 0, boundary=masked and s == 1, page=page_v)
        cute.arch.cp_async_commit_group()

        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_S.fill(0.0)
        common.gemm(mma, acc_S, tSrQ, tSrK, tSsQ, tSsK[None, None, None, stage_r], ldsm_Q, ldsm_K)

        if const_expr(s == 1):
            # K's only buffer is free once every warp has finished the GEMM above
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()
            if n_block - 1 >= 0:
                load_K(n_block - 1, 0, boundary=False, page=page_k)
            cute.arch.cp_async_commit_group()

        score_mod(acc_S, n_block=n_block, check_bounds=masked)
        # a masked block may leave a row without any key so far (causal, window)
        softmax.step(acc_S, acc_O, check_inf=masked and (self.causal or self.features.local))
        tOrP = acc_to_operand_a(convert(acc_S, self.dtype))

        if const_expr(s > 1):
            cute.arch.cp_async_wait_group(2 * s - 2)  # V[n_block] landed
            cute.arch.barrier()  # (and every warp is done reading K[n_block])

        common.gemm_rs(mma, acc_O, tOrP, tOrVt, tOsVt[None, None, None, stage_r], ldsm_V, self.pv_chunks)

        if const_expr(s > 1):
            # K of block n - s into the buffer K[n_block] used. Issued after the P V GEMM rather
            # than before it: its address arithmetic then does not compete with P and O for
            # registers, and it still has a whole iteration to land.
            if n_block - s >= 0:
                load_K(n_block - s, read_stage, boundary=False, page=page_k)
            cute.arch.cp_async_commit_group()
