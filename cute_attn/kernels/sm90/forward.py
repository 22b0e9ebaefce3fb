"""FlashAttention-3 style forward for Hopper (wgmma, TMA, warp specialisation), written with the CuTe DSL.

Tiles of ``tile_m = 64 * consumer warpgroups`` Q rows, numbered Q block fastest, then head, then
batch (causal: longest first, kernels/tile_scheduler.py). One CTA per tile, or with ``persistent``
one CTA per SM walking the tiles (``_nth_tile``): the next tile's loads overlap this tile, and
with ``overlap_tiles`` (two Q buffers) its first S = Q K^T runs under this tile's epilogue
(``_tile_boundary``). With ``kv_multicast`` (non-causal), CTAs run in clusters of two on adjacent
Q blocks of one head: each CTA's TMA loads half of every K/V block into the shared memory of both,
which halves the K/V reads from L2.

Warp specialisation (``kernel``):
- warpgroup 0, the producer: its first warp issues every TMA load (Q once, then K and V block by
  block into ``num_stages`` shared-memory buffers each, guarded by mbarrier pipelines) and gives
  most of its registers back (``setmaxnreg`` down).
- warpgroups 1.., the consumers: take the registers (``setmaxnreg`` up); each owns 64 rows of the
  Q tile and runs S = Q K^T with both operands in shared memory (wgmma SS), the online softmax,
  and O += P V with P straight from registers (wgmma RS).

Overlap inside a consumer warpgroup (``_attend_overlapped``): the Q K^T of block n is issued, then
the P V of block n+1 (the previous one), and the softmax of block n runs while P V is still in
flight. Between consumer warpgroups (ping-pong): named barriers let one warpgroup issue its GEMMs
while the other does its softmax, so the tensor cores and the exp2 units stay busy.

K/V blocks are visited from the last visible one down, as in the SM80 kernel, so the blocks that
need a mask (the seqlen_k end, the causal diagonal or a window's right edge) come first, then the
mask-free ones, then (local) those crossing the window's left edge; the masking, softcap, ALiBi,
block ranges and softmax are the same code (kernels/mask.py, block_info.py, softmax.py). O leaves
through shared memory and TMA stores, which clip rows past seqlen_q and padded columns:
persistent, each consumer warpgroup stores its 64 rows from a buffer of O's own; otherwise the
whole tile goes out through Q's buffer.

Varlen (packed sequences, kernels/seqlen_info.py): the tiles cover the longest sequence's Q blocks
for every sequence, and a tile past its own sequence's end is skipped by every role alike
(``_next_tile``); non-causal batches of up to 32 sequences number their tiles without holes
instead (tile_scheduler.varlen_tile_coords). Causal varlen and causal windowed batches (d64, d128)
run a persistent grid with a dynamic deal (``dynamic_tiles``): the producer warp takes each next
tile number from a counter, skips those past their sequence's end, and hands the tile to the
consumers. Q loads start at the sequence's first row (rows past its end are the next sequence's:
masked, or never stored); K, V (not paged) and O go through ragged views (seqlen_info's
``ragged_load_view`` and ``ragged_view``) that end at the sequence's last key / query: a K/V
block past the keys reads zeros there (TMA's out-of-bounds fill), never the next sequence's rows
or a buffer's unwritten tail (NaN among them: masked scores give them probability 0, but 0 x NaN
is NaN), and a partial last tile of O is clipped at the sequence's end.

Paged K/V (``paged``, varlen: flash_attn_varlen_func's block_table and the KV-cache chunks): the
producer warp loads a K/V block as pieces of traits.SM90_PAGE_ROWS rows, one TMA load per piece
from the page lane j of the warp read from the block table (``_block_pages``, ``_tma_load_pages``).
Packed GQA (``pack_gqa``, varlen): the tiles run over K/V heads, tile row r holding query
m_block * tile_m / g + r % (tile_m / g) of query head r // (tile_m / g); Q and O move in 16-row
TMA pieces, each a run of one head's queries (``_load_packed_q``, ``_store_packed_o``).
"""

from functools import partial
from typing import Type

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from cute_attn.kernels import block_info, tile_scheduler
from cute_attn.kernels.features import NO_FEATURES, Features
from cute_attn.kernels.layout import acc_to_operand_a, acc_to_rows_cols, convert, transpose_smem
from cute_attn.kernels.mask import alibi_slope_units, apply_score_mods
from cute_attn.kernels.seqlen_info import SeqlenInfo, ragged_load_view, ragged_view
from cute_attn.kernels.softmax import OnlineSoftmax
from cute_attn.kernels.sm90 import common
from cute_attn.kernels.sm90.common import WARPGROUP_THREADS, NamedBarrier
from cute_attn.traits import SM90_PAGE_ROWS

# (consumer, producer) registers per thread after setmaxnreg, by number of consumer warpgroups:
# the most the consumers can take while the whole CTA stays within 64K registers.
REGISTER_SPLIT = {1: (256, 56), 2: (240, 24), 3: (160, 32)}
# paged K/V: the producer's page lookups (a division by the page size, the pages of the block in
# flight and the next) do not fit 24 registers (ptxas spilled 24-56 bytes); with two consumer
# warpgroups the consumers give 8 of theirs (no spills at 232)
PAGED_REGISTER_SPLIT = {2: (232, 40)}
# dynamic_tiles: tile numbers in flight from the producer to the consumers (this tile's and the next)
TILE_ID_STAGES = 2


class FlashAttentionForwardSm90:
    """Compile-time configuration of one forward variant; ``__call__`` is the host-side launch.

    head_dim: the padded head dim (TMA zero-fills the columns past the actual one on load and
    clips them on store, so ``check_hdim`` needs no code here). intra_wg_overlap / pingpong switch
    the two overlap techniques; persistent: one CTA per SM walking the tiles; overlap_tiles
    (persistent only): the next tile's first Q K^T under this tile's epilogue; dynamic_tiles
    (persistent only): the CTAs take their tiles from an atomic counter instead of a static deal.
    features: local window, softcap, ALiBi, varlen (kernels/features.py).
    """

    def __init__(
        self,
        dtype: Type[cutlass.Numeric],
        head_dim: int,
        tile_m: int,
        tile_n: int,
        num_stages: int,
        causal: bool,
        check_hdim: bool,
        intra_wg_overlap: bool = True,
        pingpong: bool = True,
        persistent: bool = False,
        overlap_tiles: bool = False,
        kv_multicast: bool = False,
        features: Features = NO_FEATURES,
        dynamic_tiles: bool = False,
        mask_every_block: bool = False,
    ):
        assert tile_m % 64 == 0 and tile_m // 64 in REGISTER_SPLIT, "tile_m: 64, 128 or 192"
        assert tile_n % 16 == 0 and head_dim % 16 == 0 and tile_n <= 256
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_stages = num_stages
        self.causal = causal
        self.intra_wg_overlap = intra_wg_overlap
        self.num_consumer_wgs = tile_m // 64
        self.pingpong = pingpong and self.num_consumer_wgs > 1
        self.num_consumer_threads = self.num_consumer_wgs * WARPGROUP_THREADS
        self.num_threads = self.num_consumer_threads + WARPGROUP_THREADS
        self.consumer_regs, self.producer_regs = REGISTER_SPLIT[self.num_consumer_wgs]
        if features.paged:
            self.consumer_regs, self.producer_regs = PAGED_REGISTER_SPLIT.get(
                self.num_consumer_wgs, (self.consumer_regs, self.producer_regs))
        # persistent: one CTA per SM walks the tiles, so a tile's loads overlap the previous tile's
        # epilogue; O then needs a buffer of its own (otherwise it reuses Q's), from which each
        # consumer warpgroup stores its 64 rows without waiting for the others (in Q's buffer,
        # every warpgroup must be done reading Q first)
        self.persistent = persistent
        # overlap_tiles (persistent, with the intra-warpgroup overlap): the next tile's first Q K^T
        # runs under this tile's epilogue (``_tile_boundary``), so the next tile's Q must be in
        # shared memory by then: two Q buffers
        self.overlap_tiles = overlap_tiles and persistent and intra_wg_overlap
        self.q_stages = 2 if self.overlap_tiles else 1
        # dynamic_tiles (persistent): the producer warp takes each next tile number from a global
        # counter (zeroed by the host for every launch) as it starts loading the current tile, and
        # hands it to the consumer warpgroups through shared memory (``pipe_tile``), so a CTA that
        # finishes early takes the next tile in order, as the hardware does with one CTA per tile,
        # while the next tile's loads still overlap this one's epilogue
        self.dynamic_tiles = dynamic_tiles and persistent
        assert not (self.dynamic_tiles and self.overlap_tiles), "dynamic tiles: without overlapping tiles"
        # mask_every_block (the bootstrap kernel, without the overlap): one loop over a tile's K/V
        # blocks, each through the masked path, in place of the masked / unmasked / masked walk.
        # The masks change nothing in a block inside the edges and the softmax's -inf guard
        # nothing in a row with a finite max, so the bits are the same; one copy of the block's
        # code instead of two (three with a window) compiles ~20-30% faster
        assert not (mask_every_block and intra_wg_overlap), "mask_every_block: without intra-warpgroup overlap"
        self.mask_every_block = mask_every_block
        # kv_multicast: both CTAs of a cluster must walk the same K/V blocks, which causal Q blocks
        # do not (each sees a different number of keys)
        assert not (kv_multicast and causal), "K/V multicast is for non-causal attention"
        # a window or per-sequence lengths give the two Q blocks of a cluster different K/V blocks
        # too (and varlen tiles are skipped one by one, not in pairs)
        assert not (kv_multicast and (features.local or features.varlen)), "K/V multicast: no local, no varlen"
        # paged K/V (flash_attn_varlen_func's block_table): a TMA load per SM90_PAGE_ROWS rows of a
        # block, each from its own page (``_produce``); the queries are packed (varlen)
        assert not features.paged or (features.varlen and tile_n % SM90_PAGE_ROWS == 0), "paged: varlen"
        # packed GQA (varlen): a tile holds tile_m / g queries of each of the g query heads of one
        # K/V head (query fastest within a head, so each head's rows are whole TMA pieces of
        # SM90_PAGE_ROWS queries: g divides tile_m / 16, a run-time fact the host checks), and each
        # K/V block is read once for the g heads
        self.pack_gqa = features.pack_gqa
        # the (rows, head_dim) box of one TMA piece (paged K/V, packed Q and O)
        self.piece = (SM90_PAGE_ROWS, head_dim)
        assert not self.pack_gqa or (features.varlen and not features.alibi), "packed GQA: varlen, no ALiBi"
        assert not (features.kvcache or features.split or features.paged_rows), "decode features: the SM80 kernel"
        self.cluster_size = 2 if kv_multicast else 1
        self.features = features
        # a paged cache's slots past a sequence's keys may hold rows never written, NaN among them:
        # the V rows of a tile's first block past its keys are zeroed in shared memory before its
        # P V (``_clear_v_tail``). Contiguous varlen K/V (seqused_k too) need none: their loads go
        # through ragged views that end at the sequence's keys (TMA fills zeros past them).
        self.clears_v_tail = features.paged
        # Three consumer warpgroups have 160 registers a thread: softcap's or ALiBi's per-element
        # work on S does not fit beside the operands of the P V still in flight (P and O stay
        # pinned until it completes; ptxas spilled 8-96 bytes at d64). Those variants wait for
        # P V before modifying S; the other warpgroups' GEMMs still keep the tensor cores busy.
        self.pv_before_score_mod = (
            self.intra_wg_overlap and self.num_consumer_wgs == 3 and (features.softcap or features.alibi)
        )

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
        num_sms: Int32,  # CTAs of a persistent grid
        heads_per_section: Int32,  # causal tile order (tile_scheduler): chosen by the host
        mTileCounter: cute.Tensor | None,  # dynamic_tiles: (1,) int32, zero at launch
        mCuSeqlensQ: cute.Tensor | None,  # varlen: (batch + 1,) int32; the tensors then have batch 1
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,  # seqused: (batch,) int32, the keys each sequence attends to
        mAlibiSlopes: cute.Tensor | None,  # ALiBi: (batch, heads) fp32
        max_seqlen_q: Int32,  # varlen: the longest sequence (the tiles)
        window_left: Int32,  # local: the window's edges (an unbounded side is huge)
        window_right: Int32,
        softcap_scale: Float32,  # softcap: softmax_scale / softcap
        mPageTable: cute.Tensor | None,  # paged: (batch, max_pages) int32; K/V are (pages, page_size, heads_kv, d)
        stream: cuda.CUstream,
    ):
        # TMA copies tiles of the first two modes: view the tensors as (seqlen, head_dim, heads, batch)
        # (paged K/V: (page_size, head_dim, heads_kv, pages))
        mQ, mK, mV, mO = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in (mQ, mK, mV, mO)
        ]
        d, m, n, s = self.head_dim, self.tile_m, self.tile_n, self.num_stages
        sQ_layout = common.smem_layout(self.dtype, m, d, self.q_stages)
        sQ_stage = cute.select(sQ_layout, mode=[0, 1])  # also O's, when O reuses Q's buffer
        sKV_layout = common.smem_layout(self.dtype, n, d, s)
        sKV_stage = cute.select(sKV_layout, mode=[0, 1])

        load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        # packed GQA: Q and O move in pieces of SM90_PAGE_ROWS rows, each from its own query head
        piece = self.piece
        q_box = piece if const_expr(self.pack_gqa) else (m, d)
        atom_Q, tma_Q = cpasync.make_tiled_tma_atom(load, mQ, self._box_layout(sQ_stage, q_box), q_box)
        # K/V: with multicast, each CTA of a cluster loads 1 / cluster_size of a block into all of them
        load_kv = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_size > 1) else load
        # paged: one page's piece of SM90_PAGE_ROWS rows per TMA load
        kv_box = piece if const_expr(self.features.paged) else (n, d)
        sKV_box = self._box_layout(sKV_stage, kv_box)
        # varlen K/V (not paged; batch 1): ragged views, out of bounds past each sequence's keys (_produce)
        ragged_kv = self.features.varlen and not self.features.paged
        mK_load, mV_load = (mK, mV)
        if const_expr(ragged_kv):
            mK_load, mV_load = (ragged_load_view(t[None, None, None, 0]) for t in (mK, mV))
        atom_K, tma_K = cpasync.make_tiled_tma_atom(load_kv, mK_load, sKV_box, kv_box, num_multicast=self.cluster_size)
        atom_V, tma_V = cpasync.make_tiled_tma_atom(load_kv, mV_load, sKV_box, kv_box, num_multicast=self.cluster_size)
        # varlen: O's store clips at each sequence's end, not at the packed batch's (seqlen_info)
        mO_store = ragged_view(mO) if const_expr(self.features.varlen) else mO
        # O's buffer: (64, d, warpgroup) of its own when each warpgroup stores its own rows, else Q's
        if const_expr(self.persistent):
            sO_layout = common.smem_layout(self.dtype, 64, d, self.num_consumer_wgs)
            o_box = piece if const_expr(self.pack_gqa) else (64, d)
            atom_O, tma_O = cpasync.make_tiled_tma_atom(
                store, mO_store, self._box_layout(cute.select(sO_layout, mode=[0, 1]), o_box), o_box)
        else:
            sO_layout = sQ_stage
            atom_O, tma_O = cpasync.make_tiled_tma_atom(store, mO_store, self._box_layout(sQ_stage, q_box), q_box)

        mma_qk = common.tiled_mma(self.dtype, self.num_consumer_wgs, n, b_major_mn=False, a_in_registers=False)
        mma_pv = common.tiled_mma(self.dtype, self.num_consumer_wgs, d, b_major_mn=True, a_in_registers=True)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]  # full + empty barrier per stage
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * s]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * s]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout) if self.persistent else 64], 1024]
            # dynamic tiles: the tile numbers handed from the producer to the consumers (last, so
            # that the other fields keep their offsets)
            mbar_tile: cute.struct.MemRange[cutlass.Int64, 2 * TILE_ID_STAGES if self.dynamic_tiles else 1]
            tile_ids: cute.struct.MemRange[Int32, TILE_ID_STAGES if self.dynamic_tiles else 1]

        # Tiles are numbered (Q block fastest, then head, then batch): one head's Q blocks run
        # together and share its K/V in L2. Causal: longest first in sections of heads (tile_scheduler).
        # Varlen: as many Q blocks per (batch, head) as the longest sequence has.
        qheads_per_kvhead = mQ.shape[2] // mK.shape[2]  # GQA/MQA: K/V are shared, never copied
        num_tiles = self._num_tiles(mQ, mCuSeqlensQ, max_seqlen_q, qheads_per_kvhead)
        grid = num_tiles  # a multiple of the cluster size (_num_m_blocks)
        if const_expr(self.persistent):
            grid = cutlass.min(num_tiles, num_sms // self.cluster_size * self.cluster_size)
        self.kernel(
            tma_Q, tma_K, tma_V, tma_O, mLSE, softmax_scale_log2, heads_per_section, qheads_per_kvhead, mTileCounter,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mAlibiSlopes, max_seqlen_q, window_left, window_right, softcap_scale,
            mPageTable, atom_Q, atom_K, atom_V, atom_O, sQ_layout, sKV_layout, sO_layout, mma_qk, mma_pv, SharedStorage,
        ).launch(
            grid=(grid, 1, 1),
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
            **({"cluster": [self.cluster_size, 1, 1]} if self.cluster_size > 1 else {}),
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA views, (seqlen, head_dim, heads, batch)
        mK: cute.Tensor,  # varlen, not paged: the ragged load view (seqlen_info.ragged_load_view)
        mV: cute.Tensor,
        mO: cute.Tensor,  # varlen: the ragged view
        mLSE: cute.Tensor,
        softmax_scale_log2: Float32,
        heads_per_section: Int32,
        qheads_per_kvhead: Int32,
        mTileCounter: cute.Tensor | None,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mAlibiSlopes: cute.Tensor | None,
        max_seqlen_q: Int32,
        window_left: Int32,
        window_right: Int32,
        softcap_scale: Float32,
        mPageTable: cute.Tensor | None,
        atom_Q: cute.CopyAtom,
        atom_K: cute.CopyAtom,
        atom_V: cute.CopyAtom,
        atom_O: cute.CopyAtom,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (atom_Q, atom_K, atom_V, atom_O):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        # Pipelines: full barriers complete when TMA has written a stage's bytes; empty barriers
        # when every consumer warp has released the stage (one arrive per warp).
        tma_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads // 32)
        stage_bytes = self.dtype.width // 8 * self.head_dim
        make_pipeline = partial(
            pipeline.PipelineTmaAsync.create, producer_group=tma_thread, consumer_group=consumer_warps, defer_sync=True
        )
        pipe_q = make_pipeline(
            barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_stages, tx_count=stage_bytes * self.tile_m
        )
        # K/V multicast: a stage is free once the consumer warps of every CTA it is loaded into
        # have released it, so each consumer warp arrives on the empty barrier of each CTA
        make_kv_pipeline = partial(
            make_pipeline, num_stages=self.num_stages, tx_count=stage_bytes * self.tile_n,
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.num_consumer_threads // 32 * self.cluster_size
            ),
            cta_layout_vmnk=self._cluster_vmnk(), mcast_mode_mn=(1, 0),
        )
        pipe_k = make_kv_pipeline(barrier_storage=storage.mbar_k.data_ptr())
        pipe_v = make_kv_pipeline(barrier_storage=storage.mbar_v.data_ptr())
        pipe_tile = sTileIds = None
        if const_expr(self.dynamic_tiles):
            # one producer thread writes a tile number; every consumer thread reads it, then arrives
            pipe_tile = pipeline.PipelineAsync.create(
                num_stages=TILE_ID_STAGES, producer_group=tma_thread,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_threads),
                barrier_storage=storage.mbar_tile.data_ptr(), defer_sync=True,
            )
            sTileIds = storage.tile_ids.get_tensor(cute.make_layout(TILE_ID_STAGES))
        pipeline.pipeline_init_arrive(cluster_shape_mn=self._cluster_vmnk(), is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)

        if const_expr(self.persistent):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:
            sO = sQ[None, None, 0]
        # every role walks the same tiles: ``tiles`` describes one, ``next_tile`` finds the next
        # (each role computes the number of tiles itself, as it always did)
        count_tiles = partial(self._tiles_to_walk, mQ, mCuSeqlensQ, max_seqlen_q, qheads_per_kvhead)
        coords = partial(self._tile_coords, mQ, mCuSeqlensQ, max_seqlen_q, heads_per_section, qheads_per_kvhead)
        past_end = partial(self._past_end, coords, mCuSeqlensQ, qheads_per_kvhead)
        holes_end = partial(self._holes_end, mQ, mCuSeqlensQ, max_seqlen_q, heads_per_section, qheads_per_kvhead)
        tiles = partial(
            self._tile, coords, mQ, mK, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, qheads_per_kvhead,
            window_left if const_expr(self.features.local) else None,
            window_right if const_expr(self.features.local) else None,
        )
        # (first_tile(num_tiles) and next_tile(num_tiles, cursor) give (cursor, tile); the cursor is
        # the round of a static deal, or the position in the tile-number handoff of a dynamic one)
        if const_expr(self.dynamic_tiles):
            walk_producer = (
                partial(self._claim_first_tile, past_end, holes_end, mTileCounter, pipe_tile, sTileIds),
                partial(self._claim_next_tile, past_end, holes_end, mTileCounter, pipe_tile, sTileIds),
            )
            walk_consumer = (partial(self._receive_first_tile, pipe_tile, sTileIds),
                             partial(self._receive_tile, pipe_tile, sTileIds))
        else:
            walk_producer = walk_consumer = (partial(self._first_dealt_tile, past_end, holes_end, mCuSeqlensQ),
                                             partial(self._next_dealt_tile, past_end, holes_end, mCuSeqlensQ))
        pipeline.pipeline_init_wait(cluster_shape_mn=self._cluster_vmnk())

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self._produce(mQ, mK, mV, sQ, sK, sV, atom_Q, atom_K, atom_V, pipe_q, pipe_k, pipe_v, tiles,
                              *walk_producer, count_tiles, mPageTable, qheads_per_kvhead)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self._consume(
                mO, mLSE, sQ, sK, sV, sO, atom_O, mma_qk, mma_pv, pipe_q, pipe_k, pipe_v, softmax_scale_log2,
                tiles, *walk_consumer, count_tiles, mAlibiSlopes, window_left, window_right, softcap_scale,
                qheads_per_kvhead,
            )
        if const_expr(self.cluster_size > 1):
            # the other CTA's consumers arrive on this CTA's empty barriers until their last
            # K/V block: no CTA of the cluster may exit before all are done (a releasing arrive,
            # so this CTA's remote arrives are complete before the other CTA leaves the wait)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def _cluster_vmnk(self):
        """The cluster as the pipelines see it: ``cluster_size`` CTAs along N sharing (multicast
        mode M) the K/V blocks."""
        return cute.make_layout((1, 1, self.cluster_size, 1))

    @cute.jit
    def _tile_coords(self, mQ: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, max_seqlen_q: Int32,
                     heads_per_section: Int32, group: Int32, tile: Int32):
        """(m_block, head, batch) of tile number ``tile`` (packed GQA: head is the K/V head)."""
        num_m_blocks, heads, batches = self._tile_grid(mQ, mCuSeqlensQ, max_seqlen_q, group)
        if const_expr(self._maybe_compact()):
            m_block, head, batch = Int32(0), Int32(0), Int32(0)
            if batches <= tile_scheduler.VARLEN_COMPACT_BATCH:
                # numbered without holes, sequence by sequence (the non-causal tiles are alike)
                m_block, head, batch = tile_scheduler.varlen_tile_coords(tile, mCuSeqlensQ, self.tile_m, heads,
                                                                         batches)
            else:
                pair = tile // num_m_blocks
                m_block, head, batch = tile - pair * num_m_blocks, pair % heads, pair // heads
        elif const_expr(self.causal):
            # longest tiles first, in L2-sized sections of heads. Varlen: Q block m of every
            # sequence long enough to have one, the longest sequences' last blocks first (tiles
            # past a sequence's end are skipped at once)
            m_block, head, batch = tile_scheduler.tile_coords(tile, num_m_blocks, heads, batches, heads_per_section)
        else:
            pair = tile // num_m_blocks
            m_block, head, batch = tile - pair * num_m_blocks, pair % heads, pair // heads
        return m_block, head, batch

    @cute.jit
    def _tile(self, coords, mQ: cute.Tensor, mK: cute.Tensor, mCuSeqlensQ: cute.Tensor | None,
              mCuSeqlensK: cute.Tensor | None, mSeqUsedK: cute.Tensor | None, qheads_per_kvhead: Int32, window_left,
              window_right, tile: Int32):
        """(m_block, head, head_kv, seq, walk) of tile number ``tile``: its sequence (SeqlenInfo)
        and its K/V blocks (block_info.forward_walk: n_block_max, n_masked_right, n_unmasked,
        n_masked_left). At least one block: a Q block that sees no key (causal or local, or a
        sequence without keys) runs one fully masked block and ends with O = 0 and LSE = +inf,
        like any other empty row; the pipelines need no special case."""
        m_block, head, batch = coords(tile)
        seq = SeqlenInfo(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        n_block_max, n_masked_right, n_unmasked, n_masked_left = block_info.forward_walk(
            m_block, self._tile_queries(qheads_per_kvhead), self.tile_n, seq.seqlen_q, seq.seqlen_k, self.causal,
            window_left, window_right, at_least_one=True,
        )
        if const_expr(not self.features.local):
            # without a window the walk ends at block 0 and, non-causal, masks just its first
            # block: the same values, as compile-time facts (no loop over the one masked block)
            n_masked_left = 0
            if const_expr(not self.causal):
                n_masked_right = 1
            n_unmasked = n_block_max - n_masked_right
        head_kv = head if const_expr(self.pack_gqa) else head // qheads_per_kvhead
        return m_block, head, head_kv, seq, (n_block_max, n_masked_right, n_unmasked, n_masked_left)

    @cute.jit
    def _next_tile(self, past_end, holes_end, mCuSeqlensQ: cute.Tensor | None, num_tiles: Int32, rounds: Int32):
        """(round, tile) of this CTA's first tile from round ``rounds`` on (tile >= num_tiles: none
        left). Varlen: the tiles past their sequence's end are skipped, by the producer and the
        consumers alike, so that every role (and ``overlap_tiles``' look at the next tile) sees
        the same tiles, a run of them at once (the rounds whose tiles all lie before
        ``holes_end``); numbered without holes (``_maybe_compact``), there are none."""
        tile = self._nth_tile(rounds)
        if const_expr(self.features.varlen):
            holes = True
            if const_expr(self._maybe_compact()):
                holes = mCuSeqlensQ.shape[0] - 1 > tile_scheduler.VARLEN_COMPACT_BATCH
            if holes:
                skip = past_end(num_tiles, tile)
                while skip:
                    rounds += 1
                    if const_expr(self.persistent):
                        # round r's tiles are numbered from r * grid on
                        rounds = cutlass.max(rounds, holes_end(tile) // cute.arch.grid_dim()[0])
                    tile = self._nth_tile(rounds)
                    skip = past_end(num_tiles, tile)
        return rounds, tile

    @cute.jit
    def _first_dealt_tile(self, past_end, holes_end, mCuSeqlensQ: cute.Tensor | None, num_tiles: Int32):
        """Static deal: (round, tile) of this CTA's first tile."""
        return self._next_tile(past_end, holes_end, mCuSeqlensQ, num_tiles, Int32(0))

    @cute.jit
    def _next_dealt_tile(self, past_end, holes_end, mCuSeqlensQ: cute.Tensor | None, num_tiles: Int32,
                         rounds: Int32):
        """Static deal: (round, tile) of this CTA's tile after round ``rounds``."""
        return self._next_tile(past_end, holes_end, mCuSeqlensQ, num_tiles, rounds + 1)

    @cute.jit
    def _fetch_tile(self, mTileCounter: cute.Tensor):
        """Dynamic deal (the producer warp): the next tile number nobody has taken. Each CTA's
        first tile is its own index, so the counter hands out the numbers from the grid size on."""
        taken = Int32(0)
        if cute.arch.lane_idx() == 0:
            taken = cute.arch.atomic_add(mTileCounter.iterator, Int32(1))
        return cute.arch.grid_dim()[0] + cute.arch.shuffle_sync(taken, 0)

    @cute.jit
    def _claim_after_holes(self, mTileCounter: cute.Tensor, end: Int32):
        """Dynamic deal (the producer warp), every number from the last one claimed up to ``end``
        past its sequence's end: number ``end`` where the counter has not reached it (one atomic
        max moves the counter past the run and claims it: the numbers it passes are all past their
        ends, or first tiles, which the counter never hands out), else the next number nobody has
        taken."""
        grid = cute.arch.grid_dim()[0]
        taken = Int32(0)
        if cute.arch.lane_idx() == 0:
            taken = end
            if cute.arch.atomic_max(mTileCounter.iterator, end + 1 - grid) > end - grid:
                taken = grid + cute.arch.atomic_add(mTileCounter.iterator, Int32(1))
        return cute.arch.shuffle_sync(taken, 0)

    @cute.jit
    def _claim_tile(self, past_end, holes_end, mTileCounter: cute.Tensor, pipe_tile, sTileIds: cute.Tensor,
                    num_tiles: Int32, state, tile: Int32):
        """Dynamic deal (the producer warp): from tile number ``tile`` on, the first tile that
        exists (varlen: one past its sequence's end takes another number, after the run of such
        numbers it starts: ``holes_end``), handed to the consumers. A number past the last tile is
        handed over too: it ends their walk."""
        if const_expr(self.features.varlen):
            skip = past_end(num_tiles, tile)
            while skip:
                tile = self._claim_after_holes(mTileCounter, holes_end(tile))
                skip = past_end(num_tiles, tile)
        pipe_tile.producer_acquire(state)
        if cute.arch.lane_idx() == 0:
            sTileIds[state.index] = tile
            pipe_tile.producer_commit(state)  # a releasing arrive: the number is visible first
        state.advance()
        return state, tile

    @cute.jit
    def _claim_first_tile(self, past_end, holes_end, mTileCounter, pipe_tile, sTileIds, num_tiles: Int32):
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, TILE_ID_STAGES)
        return self._claim_tile(past_end, holes_end, mTileCounter, pipe_tile, sTileIds, num_tiles, state,
                                cute.arch.block_idx()[0])

    @cute.jit
    def _claim_next_tile(self, past_end, holes_end, mTileCounter, pipe_tile, sTileIds, num_tiles: Int32, state):
        return self._claim_tile(past_end, holes_end, mTileCounter, pipe_tile, sTileIds, num_tiles, state,
                                self._fetch_tile(mTileCounter))

    @cute.jit
    def _receive_tile(self, pipe_tile, sTileIds: cute.Tensor, num_tiles: Int32, state):
        """Dynamic deal (the consumer threads): (handoff position, tile) of the next tile the
        producer claimed for this CTA."""
        pipe_tile.consumer_wait(state)
        tile = sTileIds[state.index]
        pipe_tile.consumer_release(state)
        state.advance()
        return state, tile

    @cute.jit
    def _receive_first_tile(self, pipe_tile, sTileIds: cute.Tensor, num_tiles: Int32):
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TILE_ID_STAGES)
        return self._receive_tile(pipe_tile, sTileIds, num_tiles, state)

    @cute.jit
    def _past_end(self, coords, mCuSeqlensQ: cute.Tensor, group: Int32, num_tiles: Int32, tile: Int32):
        """Varlen: whether ``tile`` exists but starts past its sequence's last query. Both sides
        of the ``and`` are evaluated: a tile past the end is read as tile 0 (cu_seqlens in bounds)."""
        exists = tile < num_tiles
        m_block, _, batch = coords(tile if exists else 0)
        seqlen_q = mCuSeqlensQ[batch + 1] - mCuSeqlensQ[batch]
        return exists and m_block * self._tile_queries(group) >= seqlen_q

    @cute.jit
    def _holes_end(self, mQ: cute.Tensor, mCuSeqlensQ: cute.Tensor, max_seqlen_q: Int32, heads_per_section: Int32,
                   group: Int32, tile: Int32):
        """Varlen, ``tile`` a number past its sequence's end: the first number after it that may
        not be one. Causal order: tile_scheduler.tile_holes_end (the section's longest sequence
        read a lane per batch); Q block fastest: tile_scheduler.pair_holes_end. Called by a whole
        warp (convergent)."""
        num_m_blocks, heads, batches = self._tile_grid(mQ, mCuSeqlensQ, max_seqlen_q, group)
        if const_expr(self.causal):
            first, last = tile_scheduler.section_batches(tile, num_m_blocks, heads, batches, heads_per_section)
            longest = Int32(0)
            for b in cutlass.range(first + cute.arch.lane_idx(), last + 1, 32, unroll=1):
                longest = cutlass.max(longest, mCuSeqlensQ[b + 1] - mCuSeqlensQ[b])
            longest = cute.arch.warp_redux_sync(longest, "max")
            queries = self._tile_queries(group)
            end = tile_scheduler.tile_holes_end(tile, num_m_blocks, heads, batches, heads_per_section,
                                                (longest + queries - 1) // queries)
        else:
            end = tile_scheduler.pair_holes_end(tile, num_m_blocks)
        return end

    def _nth_tile(self, r: Int32) -> Int32:
        """This CTA's r-th tile (tile_scheduler.nth_tile; a non-persistent grid has one round)."""
        return tile_scheduler.nth_tile(r, cute.arch.block_idx()[0], cute.arch.grid_dim()[0])

    def _tile_grid(self, mQ: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, max_seqlen_q: Int32, group: Int32):
        """(Q blocks per (batch, head), heads, batch) of a (seqlen, head_dim, heads, batch) view;
        varlen: the longest sequence's Q blocks, the batch of cu_seqlens. Packed GQA: blocks of
        tile_m / g queries per K/V head (``group`` = g)."""
        if const_expr(self.pack_gqa):
            return cute.ceil_div(max_seqlen_q * group, self.tile_m), mQ.shape[2] // group, mCuSeqlensQ.shape[0] - 1
        if const_expr(self.features.varlen):
            return self._num_m_blocks(max_seqlen_q), mQ.shape[2], mCuSeqlensQ.shape[0] - 1
        return self._num_m_blocks(mQ.shape[0]), mQ.shape[2], mQ.shape[3]

    def _tile_queries(self, group: Int32):
        """Queries per tile: tile_m, or packed GQA tile_m / g of each of g query heads."""
        if const_expr(self.pack_gqa):
            return self.tile_m // group
        return self.tile_m

    def _box_layout(self, stage: cute.ComposedLayout, box: tuple):
        """The shared-memory layout a TMA atom of ``box`` (rows, cols) writes: the stage's, or for a
        piece of fewer rows, the stage's first rows (whole swizzle atoms: any piece has it)."""
        if const_expr(box[0] == cute.size(stage, mode=[0])):
            return stage
        return cute.select(cute.flat_divide(stage, box), mode=[0, 1])

    def _maybe_compact(self) -> bool:
        """Whether varlen tiles are numbered without holes for batches of up to
        tile_scheduler.VARLEN_COMPACT_BATCH sequences (non-causal; +5-14% on H100 and H200 over
        skipping the holes on a persistent grid, docs/performance.md)."""
        return self.features.varlen and not self.causal and not self.pack_gqa

    @cute.jit
    def _num_tiles(self, mQ: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, max_seqlen_q: Int32, group: Int32):
        """Q blocks x heads x batch, for the grid. Numbered without holes: a bound known without
        reading cu_seqlens (each sequence has at most seqlen / tile_m + 1 Q blocks)."""
        num_m_blocks, heads, batches = self._tile_grid(mQ, mCuSeqlensQ, max_seqlen_q, group)
        count = num_m_blocks * heads * batches
        if const_expr(self._maybe_compact()):
            if batches <= tile_scheduler.VARLEN_COMPACT_BATCH:
                count = (cute.ceil_div(mQ.shape[0], self.tile_m) + batches) * heads
        return count

    @cute.jit
    def _tiles_to_walk(self, mQ: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, max_seqlen_q: Int32, group: Int32):
        """The tile numbers the roles walk: ``_num_tiles``, or numbered without holes the batch's
        real count (read from cu_seqlens by the warp)."""
        count = self._num_tiles(mQ, mCuSeqlensQ, max_seqlen_q, group)
        if const_expr(self._maybe_compact()):
            batches = mCuSeqlensQ.shape[0] - 1
            if batches <= tile_scheduler.VARLEN_COMPACT_BATCH:
                count = tile_scheduler.varlen_num_tiles(mCuSeqlensQ, self.tile_m, mQ.shape[2], batches)
        return count

    def _num_m_blocks(self, seqlen_q: Int32):
        """Q blocks per head, rounded up to whole clusters: a cluster's CTAs share a head's K/V,
        so with an odd count the last cluster of each head runs one Q block past seqlen_q (all
        rows zero-filled by TMA on load and clipped on store, the LSE not written)."""
        num_m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        if const_expr(self.cluster_size > 1):
            num_m_blocks = cute.ceil_div(num_m_blocks, self.cluster_size) * self.cluster_size
        return num_m_blocks

    # ------------------------------------------------------------------ producer warp
    @cute.jit
    def _produce(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        atom_Q: cute.CopyAtom,
        atom_K: cute.CopyAtom,
        atom_V: cute.CopyAtom,
        pipe_q: pipeline.PipelineAsync,
        pipe_k: pipeline.PipelineAsync,
        pipe_v: pipeline.PipelineAsync,
        tiles,
        first_tile,
        next_tile,
        count_tiles,
        mPageTable: cute.Tensor | None,
        group: Int32,
    ):
        """TMA loads in the order the consumers need them: K[last], Q, then per block K[n-1]
        before V[n] (the consumers issue the next Q K^T before this block's P V); tile by tile.
        The blocks are n_block_max - 1 down to n_block_max - num_blocks, as the consumers walk them.
        Paged: each block's pages are read once, for its K (``_block_pages``), and kept for its V."""
        tile_q, tile_kv = (self.tile_m, self.head_dim), (self.tile_n, self.head_dim)
        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        cta_rank = cute.arch.block_idx_in_cluster() if const_expr(self.cluster_size > 1) else 0
        num_tiles = count_tiles()
        rounds, tile = first_tile(num_tiles)
        while tile < num_tiles:
            m_block, head, head_kv, seq, walk = tiles(tile)
            n_block_max, n_masked_right, n_unmasked, n_masked_left = walk
            num_blocks = n_masked_right + n_unmasked + n_masked_left
            b = seq.tensor_batch
            # varlen: from the sequence's first row (the rows after its end are masked or not stored)
            if const_expr(not self.pack_gqa):
                gQ = cute.local_tile(seq.q_rows(mQ[None, None, head, b]), tile_q, (m_block, 0))
                tQsQ, tQgQ = common.tma_tiles(atom_Q, gQ, sQ)
            if const_expr(self.features.paged):
                # (rows, d, piece of a page, page) from the pool; a stage as (rows, d, piece, 1, stage)
                piece = self.piece
                gK = cute.local_tile(mK[None, None, head_kv, None], piece, (None, 0, None))
                gV = cute.local_tile(mV[None, None, head_kv, None], piece, (None, 0, None))
                tKsK, tKgK = common.tma_tiles(atom_K, gK, cute.flat_divide(sK, piece))
                tVsV, tVgV = common.tma_tiles(atom_V, gV, cute.flat_divide(sV, piece))
                load_K = partial(self._tma_load_pages, pipe_k, atom_K, tKgK, tKsK)
                load_V = partial(self._tma_load_pages, pipe_v, atom_V, tVgV, tVsV)
                pages_of = partial(self._block_pages, mPageTable, seq.batch, seq.seqlen_k, mK.shape[0])
            else:
                # varlen: the sequence's seqlen_k keys (seqused_k's count), zeros past them
                gK = cute.local_tile(seq.tma_k_rows(mK, head_kv), tile_kv, (None, 0))
                gV = cute.local_tile(seq.tma_k_rows(mV, head_kv), tile_kv, (None, 0))
                tKsK, tKgK = common.tma_tiles(atom_K, gK, sK, cta_rank, self.cluster_size)
                tVsV, tVgV = common.tma_tiles(atom_V, gV, sV, cta_rank, self.cluster_size)
                load_K = partial(self._tma_load, pipe_k, atom_K, tKgK, tKsK)
                load_V = partial(self._tma_load, pipe_v, atom_V, tVgV, tVsV)
                pages_of = self._no_pages

            pages = pages_of(n_block_max - 1)
            load_K(n_block_max - 1, kv, pages)
            pipe_q.producer_acquire(q_state)  # the consumers are done with this Q buffer's previous tile
            if const_expr(self.pack_gqa):
                self._load_packed_q(mQ, sQ, atom_Q, pipe_q, q_state, m_block, head, seq, group)
            else:
                cute.copy(atom_Q, tQgQ, tQsQ[None, q_state.index], tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
            next_tile_ = tile
            if const_expr(self.dynamic_tiles):
                # claimed as this tile's loads start: the consumers learn it before this tile's epilogue
                rounds, next_tile_ = next_tile(num_tiles, rounds)
            if const_expr(self.intra_wg_overlap):
                for i in cutlass.range(num_blocks - 1, unroll=1):
                    v_state = kv.clone()
                    kv.advance()
                    next_pages = pages_of(n_block_max - 2 - i)
                    load_K(n_block_max - 2 - i, kv, next_pages)
                    load_V(n_block_max - 1 - i, v_state, pages)
                    pages = next_pages
                load_V(n_block_max - num_blocks, kv, pages)
                kv.advance()
            else:
                load_V(n_block_max - 1, kv, pages)
                kv.advance()
                for i in cutlass.range(num_blocks - 1, unroll=1):
                    pages = pages_of(n_block_max - 2 - i)
                    load_K(n_block_max - 2 - i, kv, pages)
                    load_V(n_block_max - 2 - i, kv, pages)
                    kv.advance()
            if const_expr(not self.dynamic_tiles):
                rounds, next_tile_ = next_tile(num_tiles, rounds)
            tile = next_tile_

    @cute.jit
    def _load_packed_q(self, mQ: cute.Tensor, sQ: cute.Tensor, atom_Q: cute.CopyAtom, pipe_q, q_state, m_block: Int32,
                       head_kv: Int32, seq: SeqlenInfo, group: Int32):
        """Packed GQA: tile row r is query m_block * (tile_m / g) + r % (tile_m / g) of query head
        head_kv * g + r // (tile_m / g); one TMA load per SM90_PAGE_ROWS rows (a run of queries of
        one head), all completing the Q stage's barrier."""
        piece = self.piece
        sQ_pieces = cute.flat_divide(sQ, piece)  # (rows, d, piece, 1, stage)
        queries = self.tile_m // group
        for j in cutlass.range_constexpr(self.tile_m // SM90_PAGE_ROWS):
            row = j * SM90_PAGE_ROWS
            hh = row // queries
            first = m_block * queries + row - hh * queries
            gQ = cute.local_tile(seq.q_rows(mQ[None, None, head_kv * group + hh, seq.tensor_batch]), piece, (None, 0))
            tQsQ, tQgQ = common.tma_tiles(atom_Q, gQ, sQ_pieces)
            cute.copy(atom_Q, tQgQ[None, first // SM90_PAGE_ROWS], tQsQ[None, j, 0, q_state.index],
                      tma_bar_ptr=pipe_q.producer_get_barrier(q_state))

    @cute.jit
    def _tma_load(self, pipe, atom, src: cute.Tensor, dst: cute.Tensor, n_block: Int32, state, pages=None):
        """Wait until ``state``'s stage is free, arm its barrier with the bytes to expect, load block n_block."""
        pipe.producer_acquire(state)
        multicast = {"mcast_mask": cutlass.Int16((1 << self.cluster_size) - 1)} if const_expr(self.cluster_size > 1) else {}
        cute.copy(atom, src[None, n_block], dst[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state),
                  **multicast)

    def _no_pages(self, n_block: Int32):
        """Not paged: a block is rows of the sequence's own K/V, no pages to look up."""
        return None

    @cute.jit
    def _block_pages(self, mPageTable: cute.Tensor, batch: Int32, seqlen_k: Int32, page_size: Int32, n_block: Int32):
        """Paged: lane j's (page, piece within the page) of rows [SM90_PAGE_ROWS j, SM90_PAGE_ROWS (j + 1))
        of K/V block n_block, one block-table read per lane. A piece past the sequence's keys gets
        page -1: TMA fills it with zeros without reading (and the table past its pages is never read)."""
        row = n_block * self.tile_n + cute.arch.lane_idx() * SM90_PAGE_ROWS
        column = row // page_size
        page = Int32(-1)
        if row < seqlen_k and cute.arch.lane_idx() < self.tile_n // SM90_PAGE_ROWS:
            page = mPageTable[batch, cutlass.min(column, mPageTable.shape[1] - 1)]
        return page, (row - column * page_size) // SM90_PAGE_ROWS

    @cute.jit
    def _tma_load_pages(self, pipe, atom, src: cute.Tensor, dst: cute.Tensor, n_block: Int32, state, pages):
        """``_tma_load`` of a paged block: a TMA load per piece of SM90_PAGE_ROWS rows, piece j from
        lane j's page (``_block_pages``), all completing the stage's one barrier."""
        page, piece = pages
        pipe.producer_acquire(state)
        for j in cutlass.range_constexpr(self.tile_n // SM90_PAGE_ROWS):
            cute.copy(atom, src[None, cute.arch.shuffle_sync(piece, j), cute.arch.shuffle_sync(page, j)],
                      dst[None, j, 0, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))

    # ------------------------------------------------------------------ consumer warpgroups
    @cute.jit
    def _consume(
        self,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sO: cute.Tensor,
        atom_O: cute.CopyAtom,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        pipe_q: pipeline.PipelineAsync,
        pipe_k: pipeline.PipelineAsync,
        pipe_v: pipeline.PipelineAsync,
        softmax_scale_log2: Float32,
        tiles,
        first_tile,
        next_tile,
        count_tiles,
        mAlibiSlopes: cute.Tensor | None,
        window_left: Int32,
        window_right: Int32,
        softcap_scale: Float32,
        group: Int32,
    ):
        tidx = cute.arch.thread_idx()[0] - WARPGROUP_THREADS  # index among the consumer threads
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
        # wgmma operands are described per warpgroup (shared-memory descriptors); the
        # accumulators per thread
        wg_layout = cute.make_layout(self.num_consumer_wgs, stride=WARPGROUP_THREADS)
        wg_qk, wg_pv = mma_qk.get_slice(wg_layout(wg)), mma_pv.get_slice(wg_layout(wg))
        thr_qk, thr_pv = mma_qk.get_slice(tidx), mma_pv.get_slice(tidx)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(transpose_smem(sV)))
        tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((self.tile_m, self.tile_n)))
        acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((self.tile_m, self.head_dim)), Float32)
        cS = cute.make_identity_tensor((self.tile_m, self.tile_n))
        tScS, tScS_thread0 = thr_qk.partition_C(cS), mma_qk.get_slice(0).partition_C(cS)
        num_rows = cute.size(acc_to_rows_cols(acc_O).shape[0])

        if const_expr(self.pingpong):
            if wg == 0:  # the first consumer warpgroup issues its GEMMs first
                self._scheduler_arrive_own(wg)
        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        softmax = OnlineSoftmax(softmax_scale_log2, num_rows)
        # softcap, ALiBi and the masks of one S tile (mask.py); ``mask_of`` binds a tile's part
        score_mod = partial(
            apply_score_mods, tScS=tScS, tScS_thread0=tScS_thread0, tile_m=self.tile_m, tile_n=self.tile_n,
            causal=self.causal,
            window_left=window_left if const_expr(self.features.local) else None,
            window_right=window_right if const_expr(self.features.local) else None,
            softcap_scale=softcap_scale if const_expr(self.features.softcap) else None,
        )
        mask_of = partial(self._tile_mask, score_mod, mAlibiSlopes, softmax_scale_log2, group)
        clear_v_tail = partial(self._clear_v_tail, pipe_v, sV, wg)
        num_tiles = count_tiles()
        rounds, tile = first_tile(num_tiles)
        if const_expr(self.overlap_tiles):
            # the first tile's first block; every later tile's comes with the previous tile's last
            # block (_tile_boundary)
            if const_expr(self.features.varlen):
                # a CTA may have no tile at all (its tiles past their sequence's end, or past the
                # batch's last tile): the next-tile path, whose wgmma is issued either way
                # (see _next_first_qk)
                acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
                has_first = tile < num_tiles
                self._next_first_qk(has_first, mma_qk, acc_S, tSrQ, tSrK, pipe_q, q_state, pipe_k, kv)
                self._next_first_softmax(has_first, acc_S, tOrP, acc_O, softmax, pipe_k, kv, mask_of, tiles, tile,
                                         clear_v_tail)
            else:
                # every CTA has a first tile: the grid is at most the number of tiles
                first_m_block, first_head, _, first_seq, first_walk = tiles(tile)
                self._start_tile(acc_O, softmax)
                pipe_q.consumer_wait(q_state)
                self._first_block(mma_qk, thr_qk, tSrQ[None, None, None, q_state.index], tSrK, tOrP, softmax,
                                  mask_of(first_m_block, first_head, first_seq), pipe_k, kv, first_walk[0] - 1)
                clear_v_tail(kv, first_seq.seqlen_k, first_walk[0] - 1)
        while tile < num_tiles:
            m_block, head, _, seq, walk = tiles(tile)
            n_block_max = walk[0]
            mask = mask_of(m_block, head, seq)
            tSrQ_tile = tSrQ[None, None, None, q_state.index]
            ctx = (mma_qk, mma_pv, thr_qk, tSrQ_tile, tSrK, tOrVt, tOrP, acc_O, softmax, mask, pipe_k, pipe_v, wg)
            # From n_block_max - 1 down (block_info.forward_walk, ``_walk_blocks``)
            if const_expr(self.intra_wg_overlap):
                if const_expr(not self.overlap_tiles):
                    self._start_tile(acc_O, softmax)
                    pipe_q.consumer_wait(q_state)
                    self._first_block(mma_qk, thr_qk, tSrQ_tile, tSrK, tOrP, softmax, mask, pipe_k, kv, n_block_max - 1)
                    clear_v_tail(kv, seq.seqlen_k, n_block_max - 1)
                # (the first block's S is in flight: the walk goes on from the block below it)
                kv = self._walk_blocks(self._attend_overlapped, ctx, kv, walk, first=1)
                if const_expr(self.persistent):
                    pipe_q.consumer_release(q_state)  # every Q K^T of this tile has completed
                q_state.advance()
                rounds, next_tile_ = next_tile(num_tiles, rounds)
                # the last block's P V and the epilogue (overlap_tiles: the next tile's first Q K^T under it)
                v_state = kv.clone()
                kv.advance()
                self._tile_boundary(
                    ctx, v_state, kv, q_state, pipe_q, tSrQ, mask_of, clear_v_tail, tiles, next_tile_, num_tiles,
                    partial(self._epilogue, acc_O, softmax, mO, mLSE, sO, atom_O, mma_pv, thr_pv, tidx,
                            m_block, head, seq, group=group),
                )
            else:
                self._start_tile(acc_O, softmax)
                pipe_q.consumer_wait(q_state)
                clear_v_tail(kv, seq.seqlen_k, n_block_max - 1)
                self._scheduler_sync(wg)
                kv = self._walk_blocks(self._attend_serial, ctx, kv, walk, first=0)
                self._scheduler_arrive_next(wg)
                if const_expr(self.persistent):
                    pipe_q.consumer_release(q_state)
                q_state.advance()
                self._epilogue(acc_O, softmax, mO, mLSE, sO, atom_O, mma_pv, thr_pv, tidx, m_block, head, seq,
                               group=group)
                rounds, next_tile_ = next_tile(num_tiles, rounds)
            tile = next_tile_
        if self._issues_store(tidx):
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # sO stays valid until the last store read it

    @cute.jit
    def _walk_blocks(self, attend, ctx, kv, walk, first: cutlass.Constexpr[int]):
        """``attend`` each K/V block of a tile's ``walk`` (block_info.forward_walk) but its top
        ``first`` ones (already issued), from n_block_max - 1 down: n_masked_right crossing the
        seqlen_k end or the right edge (causal diagonal / window; non-causal: only the first),
        n_unmasked needing no mask, then (local) n_masked_left crossing the window's left edge.
        ``mask_every_block``: all of them through the masked path, in one loop."""
        n_block_max, n_masked_right, n_unmasked, n_masked_left = walk
        if const_expr(self.mask_every_block):
            for i in cutlass.range(n_masked_right + n_unmasked + n_masked_left - first, unroll=1):
                kv = attend(ctx, kv, n_block_max - 1 - first - i, masked=True)
        else:
            n_left_start = n_block_max - n_masked_right - n_unmasked  # one past the first left-masked block
            for i in cutlass.range(n_masked_right - first, unroll=1):
                kv = attend(ctx, kv, n_block_max - 1 - first - i, masked=True)
            for i in cutlass.range(n_unmasked, unroll=1):
                kv = attend(ctx, kv, n_block_max - n_masked_right - 1 - i, masked=False)
            if const_expr(self.features.local):
                for i in cutlass.range(n_masked_left, unroll=1):
                    kv = attend(ctx, kv, n_left_start - 1 - i, masked=True)
        return kv

    @cute.jit
    def _clear_v_tail(self, pipe_v, sV: cute.Tensor, wg, kv, seqlen_k: Int32, n_block: Int32):
        """``clears_v_tail`` (paged): the rows of V block ``n_block`` (a tile's first, the one holding
        its sequence's last key) past seqlen_k, zeroed in its stage by this consumer warpgroup once
        TMA has written it, before the warpgroup's P V reads it (common.zero_rows_from). Every
        consumer warpgroup zeroes the same rows (the same value), each before its own P V."""
        if const_expr(self.clears_v_tail):
            rows = seqlen_k - n_block * self.tile_n
            if rows < self.tile_n:
                pipe_v.consumer_wait(kv)
                common.zero_rows_from(sV[None, None, kv.index], cutlass.max(rows, 0),
                                      cute.arch.thread_idx()[0] % WARPGROUP_THREADS, WARPGROUP_THREADS)
                cute.arch.fence_view_async_shared()  # visible to the wgmma (async proxy)
                cute.arch.barrier(barrier_id=int(NamedBarrier.V_TAIL_WG1) + wg, number_of_threads=WARPGROUP_THREADS)

    @cute.jit
    def _tile_mask(self, score_mod, mAlibiSlopes: cute.Tensor | None, softmax_scale_log2: Float32, group: Int32,
                   m_block: Int32, head: Int32, seq: SeqlenInfo):
        """``score_mod`` for one tile: called as mask(acc_S, n_block=, check_bounds=)."""
        alibi_slope = None
        if const_expr(self.features.alibi):
            alibi_slope = alibi_slope_units(mAlibiSlopes, seq.batch, head, softmax_scale_log2)
        packed = {}
        if const_expr(self.pack_gqa):
            packed = dict(rows_per_head=self.tile_m // group)
        return partial(score_mod, m_block=m_block, seqlen_q=seq.seqlen_q, seqlen_k=seq.seqlen_k,
                       alibi_slope=alibi_slope, **packed)

    def _check_inf(self, masked: bool) -> bool:
        """Whether a block's softmax must allow rows without any key so far: masked blocks with a
        causal or window mask, and (varlen) the first block of a sequence that has no key."""
        return masked and (self.causal or self.features.local or self.features.varlen)

    @staticmethod
    def _start_tile(acc_O: cute.Tensor, softmax: OnlineSoftmax):
        """O = 0 and fresh row statistics (a helper: a method call on ``softmax`` in a run-time
        loop's body would make the DSL carry it through the loop)."""
        acc_O.fill(0.0)
        softmax.reset()

    @cute.jit
    def _first_block(self, mma_qk, thr_qk, tSrQ, tSrK, tOrP, softmax, mask, pipe_k, kv, n_block: Int32):
        """S of a tile's first (always masked) block and its P; its P V is issued with the next block's S."""
        pipe_k.consumer_wait(kv)
        acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        common.wgmma(mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv.index], zero_init=True, wait=0)
        pipe_k.consumer_release(kv)
        self._first_softmax(acc_S, tOrP, softmax, mask, n_block)

    @cute.jit
    def _first_softmax(self, acc_S, tOrP, softmax, mask, n_block: Int32):
        """Mask, softmax with fresh statistics, and P of a tile's first block."""
        mask(acc_S, n_block=n_block, check_bounds=True)
        softmax.update(acc_S, check_inf=self._check_inf(True))  # O is still zero: no rescale
        tOrP.store(acc_to_operand_a(acc_S).load().to(self.dtype))

    @cute.jit
    def _tile_boundary(self, ctx, v_state, kv, q_state, pipe_q, tSrQ_stages, mask_of, clear_v_tail, tiles,
                       next_tile: Int32, num_tiles: Int32, epilogue):
        """O += P V of this tile's last block, then the epilogue. With ``overlap_tiles``, once O is
        final and converted, S = Q K^T of the next tile's first block (when this CTA has a next
        tile) is issued and runs under the rest of the epilogue (LSE, shared-memory and TMA stores),
        then the next first block's softmax. Otherwise this warpgroup's tensor cores would idle
        from its last P V until the next tile's first softmax is done, a large share of the time
        on short sequences (4 blocks per tile at S = 512). The next S is issued only after O is
        converted, so that both accumulators are never live at once (register pressure)."""
        mma_qk, mma_pv, thr_qk, _, tSrK, tOrVt, tOrP, acc_O, softmax, _, pipe_k, pipe_v, wg = ctx
        pipe_v.consumer_wait(v_state)
        self._scheduler_sync(wg)
        common.wgmma(mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index], zero_init=False, wait=-1)
        self._scheduler_arrive_next(wg)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)

        if const_expr(not self.overlap_tiles):
            epilogue()
        else:
            has_next = next_tile < num_tiles
            acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
            epilogue(issue_next=partial(self._next_first_qk, has_next, mma_qk, acc_S, tSrQ_stages, tSrK, pipe_q,
                                        q_state, pipe_k, kv))
            self._next_first_softmax(has_next, acc_S, tOrP, acc_O, softmax, pipe_k, kv, mask_of, tiles, next_tile,
                                     clear_v_tail)

    @cute.jit
    def _next_first_qk(self, has_next, mma_qk, acc_S, tSrQ_stages, tSrK, pipe_q, q_state, pipe_k, kv):
        """Issue (without waiting) S = Q K^T of the next tile's first block. The wgmma is issued
        even when there is no next tile (a discarded product of buffers no longer written): ptxas
        serialises every wgmma of a kernel that issues one under a run-time branch."""
        if has_next:
            pipe_q.consumer_wait(q_state)
            pipe_k.consumer_wait(kv)
        common.wgmma(mma_qk, acc_S, tSrQ_stages[None, None, None, q_state.index], tSrK[None, None, None, kv.index],
                     zero_init=True, wait=-1)

    @cute.jit
    def _next_first_softmax(self, has_next, acc_S, tOrP, acc_O, softmax, pipe_k, kv, mask_of, tiles, next_tile: Int32,
                            clear_v_tail):
        """Wait for the next tile's first S and turn it into P, with fresh statistics and O = 0."""
        warpgroup.wait_group(0)
        if has_next:
            next_m_block, next_head, _, next_seq, next_walk = tiles(next_tile)
            self._start_tile(acc_O, softmax)
            pipe_k.consumer_release(kv)
            self._first_softmax(acc_S, tOrP, softmax, mask_of(next_m_block, next_head, next_seq), next_walk[0] - 1)
            clear_v_tail(kv, next_seq.seqlen_k, next_walk[0] - 1)

    @cute.jit
    def _attend_overlapped(self, ctx, kv, n_block: Int32, masked: cutlass.Constexpr[bool]):
        """Issue S = Q K[n] and O += P V[n+1] back to back; softmax of S while P V runs."""
        mma_qk, mma_pv, thr_qk, tSrQ, tSrK, tOrVt, tOrP, acc_O, softmax, mask, pipe_k, pipe_v, wg = ctx
        v_state = kv.clone()  # V of the previous block
        kv.advance()
        pipe_k.consumer_wait(kv)
        self._scheduler_sync(wg)
        acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        common.wgmma(mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv.index], zero_init=True, wait=-1)
        pipe_v.consumer_wait(v_state)
        common.wgmma(mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index], zero_init=False, wait=-1)
        self._scheduler_arrive_next(wg)
        if const_expr(self.pv_before_score_mod):
            warpgroup.wait_group(0)  # S has landed and P V is done (see __init__)
            pipe_k.consumer_release(kv)
            pipe_v.consumer_release(v_state)
        else:
            warpgroup.wait_group(1)  # S has landed (P V may still run)
            pipe_k.consumer_release(kv)
        mask(acc_S, n_block=n_block, check_bounds=masked)
        factors = softmax.update(acc_S, check_inf=self._check_inf(masked))
        if const_expr(not self.pv_before_score_mod):
            warpgroup.wait_group(0)  # P V done: O and P's registers are free again
            pipe_v.consumer_release(v_state)
        softmax.rescale(acc_O, factors)
        tOrP.store(acc_to_operand_a(acc_S).load().to(self.dtype))
        return kv

    @cute.jit
    def _attend_serial(self, ctx, kv, n_block: Int32, masked: cutlass.Constexpr[bool]):
        """Without intra-warpgroup overlap: S, softmax, then O += P V of the same block."""
        mma_qk, mma_pv, thr_qk, tSrQ, tSrK, tOrVt, tOrP, acc_O, softmax, mask, pipe_k, pipe_v, wg = ctx
        pipe_k.consumer_wait(kv)
        acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        common.wgmma(mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv.index], zero_init=True, wait=-1)
        self._scheduler_arrive_next(wg)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(kv)
        mask(acc_S, n_block=n_block, check_bounds=masked)
        softmax.step(acc_S, acc_O, check_inf=self._check_inf(masked))
        tOrP.store(acc_to_operand_a(acc_S).load().to(self.dtype))
        pipe_v.consumer_wait(kv)
        self._scheduler_sync(wg)
        common.wgmma(mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv.index], zero_init=False, wait=0)
        pipe_v.consumer_release(kv)
        kv.advance()
        return kv

    # ping-pong: warpgroup i may issue GEMMs once warpgroup i-1 has issued its own
    def _scheduler_sync(self, wg):
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=int(NamedBarrier.SCHEDULER_WG1) + wg, number_of_threads=2 * WARPGROUP_THREADS)

    def _scheduler_arrive_next(self, wg):
        if const_expr(self.pingpong):
            next_wg = (wg + 1) % self.num_consumer_wgs
            cute.arch.barrier_arrive(
                barrier_id=int(NamedBarrier.SCHEDULER_WG1) + next_wg, number_of_threads=2 * WARPGROUP_THREADS
            )

    def _scheduler_arrive_own(self, wg):
        cute.arch.barrier_arrive(barrier_id=int(NamedBarrier.SCHEDULER_WG1) + wg, number_of_threads=2 * WARPGROUP_THREADS)

    @cute.jit
    def _epilogue(self, acc_O, softmax, mO, mLSE, sO, atom_O, mma_pv, thr_pv, tidx, m_block, head, seq: SeqlenInfo,
                  issue_next=None, group=None):
        """O /= rowsum and LSE; O -> shared memory (its own buffer when persistent, else Q's; stmatrix)
        -> global (one TMA store, left in flight until sO is needed again). ``issue_next`` is
        called once O has left its accumulator (_tile_boundary)."""
        lse = softmax.finalize(acc_O)
        rO = convert(acc_O, self.dtype)
        if const_expr(issue_next is not None):
            issue_next()

        # LSE: the thread holding column 0 of a row writes it
        b = seq.tensor_batch
        rows = acc_to_rows_cols(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim))))
        if const_expr(self.pack_gqa):  # row r: query head head * g + r // queries (_load_packed_q)
            queries = self.tile_m // group
            offset_q, seqlen_q = seq.offset_q, seq.seqlen_q
            if rows[0, 0][1] == 0:
                for r in cutlass.range_constexpr(cute.size(lse)):
                    hh = rows[r, 0][0] // queries
                    query = m_block * queries + rows[r, 0][0] - hh * queries
                    if query < seqlen_q:
                        mLSE[b, head * group + hh, offset_q + query] = lse[r]
        else:
            gLSE = cute.local_tile(seq.q_rows(mLSE[b, head, None]), (self.tile_m,), (m_block,))
            rows_left = seq.seqlen_q - m_block * self.tile_m
            if rows[0, 0][1] == 0:
                for r in cutlass.range_constexpr(cute.size(lse)):
                    if rows[r, 0][0] < rows_left:
                        gLSE[rows[r, 0][0]] = lse[r]

        # sO is free once the previous store from it has read it and, when it is Q's buffer, every
        # consumer warpgroup's last Q K^T has completed (the barrier below). Persistent: each
        # warpgroup writes and stores its own 64 rows of O's own buffer, waiting for no other.
        wg = tidx // WARPGROUP_THREADS
        if const_expr(self.persistent):
            barrier = partial(cute.arch.barrier, barrier_id=int(NamedBarrier.EPILOGUE_WG1) + wg,
                              number_of_threads=WARPGROUP_THREADS)
        else:
            barrier = partial(cute.arch.barrier, barrier_id=int(NamedBarrier.EPILOGUE),
                              number_of_threads=self.num_consumer_threads)
        if self._issues_store(tidx):
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        barrier()
        stmatrix = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), self.dtype)
        if const_expr(self.persistent):  # this warpgroup's (64, d) slice, as one warpgroup's MMA sees it
            mma_wg = common.tiled_mma(self.dtype, 1, self.head_dim, b_major_mn=True, a_in_registers=True)
            thr_copy_O = cute.make_tiled_copy_C(stmatrix, mma_wg).get_slice(tidx % WARPGROUP_THREADS)
            sO_rows = sO[None, None, wg]
        else:
            thr_copy_O = cute.make_tiled_copy_C(stmatrix, mma_pv).get_slice(tidx)
            sO_rows = sO
        cute.copy(thr_copy_O, thr_copy_O.retile(rO), thr_copy_O.partition_D(sO_rows))
        cute.arch.fence_view_async_shared()  # the generic-proxy writes above, visible to TMA
        barrier()
        # varlen: clipped past the sequence's rows (outside the branch: the DSL would carry seq through it)
        mO_rows = seq.tma_q_rows(mO, head, load=False)
        if const_expr(self.pack_gqa):
            if self._issues_store(tidx):
                self._store_packed_o(mO, sO_rows, atom_O, m_block, head, seq, group, wg)
        elif self._issues_store(tidx):
            if const_expr(self.persistent):
                gO = cute.local_tile(mO_rows, (64, self.head_dim), (m_block * self.num_consumer_wgs + wg, 0))
            else:
                gO = cute.local_tile(mO_rows, (self.tile_m, self.head_dim), (m_block, 0))
            tOsO, tOgO = common.tma_tiles(atom_O, gO, sO_rows)
            cute.copy(atom_O, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def _store_packed_o(self, mO: cute.Tensor, sO_rows: cute.Tensor, atom_O: cute.CopyAtom, m_block: Int32,
                        head_kv: Int32, seq: SeqlenInfo, group: Int32, wg: Int32):
        """Packed GQA: O's rows (the tile's, or persistent this warpgroup's 64) leave in pieces of
        SM90_PAGE_ROWS rows, each to its query head's rows of the sequence (clipped at its end)."""
        piece = self.piece
        sO_pieces = cute.flat_divide(sO_rows, piece)  # (rows, d, piece, 1)
        queries = self.tile_m // group
        first_row = wg * 64 if const_expr(self.persistent) else 0
        for j in cutlass.range_constexpr(cute.size(sO_pieces, mode=[2])):
            row = first_row + j * SM90_PAGE_ROWS
            hh = row // queries
            first = m_block * queries + row - hh * queries
            mO_rows = seq.tma_q_rows(mO, head_kv * group + hh, load=False)
            gO = cute.local_tile(mO_rows, piece, (None, 0))
            tOsO, tOgO = common.tma_tiles(atom_O, gO, sO_pieces)
            cute.copy(atom_O, tOsO[None, j, 0], tOgO[None, first // SM90_PAGE_ROWS])
        cute.arch.cp_async_bulk_commit_group()

    def _issues_store(self, tidx):
        """The thread that issues (and waits for) O's TMA stores: one per warpgroup when each
        stores its own rows, else one in all."""
        if const_expr(self.persistent):
            return tidx % WARPGROUP_THREADS == 0
        return tidx == 0
