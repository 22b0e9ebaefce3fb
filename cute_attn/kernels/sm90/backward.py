"""FlashAttention-3 style backward for Hopper (wgmma, TMA, warp specialisation), written with the CuTe DSL.

The preprocess (D = rowsum(dO * O), LSE in log2) is the SM80 one (kernels/sm80/backward.py), built
without its zeroing of the dQ accumulator; this file holds the main kernel and the dQ postprocess.

Grid: one CTA per (K/V block of ``tile_n`` keys, K/V head, batch). The CTA keeps K and V in shared
memory and dK, dV in registers, and walks every Q block of every query head that reads its K/V
head (GQA/MQA: dK and dV are summed in registers), from the first Q block that sees any of its
keys (causal) to the last. With ``head_splits`` > 1 (a run-time value: GQA where one CTA per K/V
block would run long and unbalanced, ``interface.backward_head_splits``) the grid's y is (K/V
head, split) and each CTA walks its share of the query heads. Its dK and dV then leave in fp32
through ``mdKV_split`` (staged in shared memory): added by TMA reductions into accumulators
every split of a K/V head shares or, deterministic, stored per split for the host to sum in a fixed
order (either way rounded to the input dtype once, on the host). backward_large.py's kernel and
the persistent grids write them per split in the input dtype (``compile.sm90_split_dkv_fp32``).
With ``longest_first`` (traits: d128 plain causal) the CTAs run K/V block 0 of each head of an
L2-sized section first, then block 1, ... (``tile_scheduler.section_coords``).
With ``stream_k`` (traits: d128 plain non-causal, where traits.stream_k_blocks deals blocks out)
the grid is 1-D: a CTA per K/V block but the last ``stream_k_blocks``, then ``num_sms`` CTAs that
share those blocks' (query head, Q block) steps as 1-3 items each (traits.stream_k_items, dealt on
the host): a piece that starts a cut block publishes its fp32 dK, dV partials to a workspace slot
and raises a flag; the piece that ends it adds the published ones (``_stream_k_roles``). The
grid's last round then keeps every SM busy instead of leaving some idle. With ``persistent`` too
(the tier traits.SM90_BACKWARD_STREAM_K) the grid is ``num_sms`` CTAs and CTA j walks the whole
blocks j, j + num_sms, ... before the Stream-K ones, then Stream-K CTA j's items.
Per Q block, recomputing attention from the saved LSE:

    S^T  = K Q^T,  P^T = exp2(S^T * scale_log2 - LSE_log2)    (masked on the diagonal / seqlen_k end)
    dP^T = V dO^T, dS^T = P^T * (dP^T - D)
    dV += P^T dO,  dK += dS^T Q,  dQ = dS K  (this K/V block's share, fp32)

Optional features (kernels/features.py, each compiled in only when asked for): a sliding window
(the Q block range of ``block_info.backward_walk`` and the window edges in the mask), softcap
(S^T = tanh(S^T * softcap_scale) before the mask and dS^T times its derivative 1 - tanh^2), ALiBi
(its bias in the mask) and varlen (packed sequences: ``seqlen_info``; the grid covers the longest
sequence's K/V blocks and those past a shorter one's end do nothing). Varlen tensors go through
ragged views that end at the sequence's last query (Q, dO) or key (K, V, dK, dV; seqlen_info's
``ragged_load_view`` for loads, ``ragged_view`` for stores): a block past the end reads zeros
(TMA's out-of-bounds fill), never the next sequence's rows or a buffer's unwritten tail (NaN
among them: a 0 probability times NaN is NaN), and a store is clipped there.

S and dP are computed transposed (keys along the wgmma M dimension, one warpgroup per 64 keys),
so P^T and dS^T land in registers exactly as the A operand of the dV and dK GEMMs need them: P
never touches shared memory, dS does once, for dQ = dS K, which needs all the CTA's keys. With
80-row Q blocks (d128 non-causal, traits.py: fewer instructions per row than 64) wgmma's M cannot
take the rows, so that GEMM runs as dQ^T = K^T dS^T (``dq_transposed``) and the postprocess
reads dQ^T's fragments back.

Warp specialisation (``kernel``):
- warp 0 (producer): TMA loads K and V once, then per Q block Q + LSE and dO + D into
  ``num_stages`` buffers each (mbarrier pipelines ``pipe_q`` and ``pipe_do``).
- warp 1 (dQ writer): per Q block, adds each MMA warpgroup's fp32 dQ from shared memory into the
  global accumulator with one bulk reduction (``cp.reduce.async.bulk ... .add.f32``), in a fixed
  order per Q block when deterministic (a semaphore per Q block, FlashAttention-3 style; causal:
  from the diagonal K/V block down, with the grid launching the last K/V blocks first). The
  first share of a Q block is stored instead (``cp.async.bulk``), so that nothing zeroes the
  accumulator: deterministic, turn 0; otherwise the K/V block that takes the Q block semaphore's
  first ticket, the others adding once it has landed (``dq_first_share``).
- warpgroups 1-2 (MMA): the five GEMMs and the element-wise work; ``setmaxnreg`` moves the
  producer warpgroup's registers to them.

The dQ accumulator holds each Q block's tile_m x head_dim floats in the order of the dQ MMA's
register fragments (``dq_accum_slots``): the MMA warpgroups write shared memory with 128-bit
stores free of bank conflicts, and one contiguous bulk reduction per warpgroup adds it to global
memory. ``BackwardPostprocessSm90`` reads it back in the same order, scales by softmax_scale and
converts to the input dtype.
"""

import enum
from functools import partial
from typing import Type

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.experimental import primitives

from cute_attn.kernels import block_info, tile_scheduler
from cute_attn.kernels.features import NO_FEATURES, Features
from cute_attn.kernels.layout import acc_to_operand_a, acc_to_rows_cols, convert, transpose_smem
from cute_attn.kernels.mask import alibi_slope_units, apply_mask_transposed, apply_softcap
from cute_attn.kernels.seqlen_info import SeqlenInfo, ragged_load_view, ragged_view
from cute_attn.kernels.sm80 import common as sm80_common
from cute_attn.kernels.sm90 import common
from cute_attn.kernels.sm90.common import WARPGROUP_THREADS
from cute_attn.traits import STREAM_K_FINISH, STREAM_K_ITEM_FIELDS, STREAM_K_PUBLISH, STREAM_K_ROW, STREAM_K_WHOLE

NUM_MMA_WARPGROUPS = 2
# registers per thread after setmaxnreg: the MMA warpgroups take what the producer warpgroup gives
# back (24 * 128 + 2 * 240 * 128 <= 64K)
MMA_REGISTERS, PRODUCER_REGISTERS = 240, 24
# dQ accumulator slots: 128-bit vectors of fp32
DQ_VECTOR = 4


class Barrier(enum.IntEnum):
    """Named barriers of the backward (0 is __syncthreads)."""

    PDS = 1  # both MMA warpgroups: this Q block's dS is in shared memory
    EPILOGUE = 2  # both MMA warpgroups: done reading K and V (dK, dV reuse their buffers)
    DQ_FULL_WG1 = 3  # MMA warpgroup i + the dQ writer: its dQ is in shared memory (3, 4)
    DQ_EMPTY_WG1 = 5  # MMA warpgroup i + the dQ writer: its dQ buffer may be written (5, 6)
    PDS_FREE = 7  # backward_large.py, both MMA warpgroups: the last Q block's P and dS are read


def dq_accum_slots(mdQ_accum: cute.Tensor, seq: SeqlenInfo, head, m_block, tile_m: int, head_dim: int,
                   num_chunks: int) -> cute.Tensor:
    """One Q block's fp32 dQ accumulator as (tile_m * head_dim / num_chunks, num_chunks): a
    contiguous chunk per MMA warpgroup, in the slot order of ``dq_slot_copy``. Varlen: the
    sequence's blocks start at its padded row (seqlen_info), so whole blocks never overlap."""
    rows = seq.padded_q_rows(mdQ_accum[seq.tensor_batch, head, None, None])
    block = cute.local_tile(rows, (tile_m, head_dim), (m_block, 0))
    return cute.make_tensor(block.iterator, cute.make_layout((tile_m * head_dim // num_chunks, num_chunks)))


def kv_block_of_cta(cta, tile_n: int, seqlen_k, reverse: bool):
    """The K/V block of grid column ``cta``: the last one first when ``reverse`` (deterministic
    causal, see ``dq_semaphore_turn``). Plain operators: runs on Python ints in the CPU tests."""
    return (seqlen_k + tile_n - 1) // tile_n - 1 - cta if reverse else cta


def dq_semaphore_turn(m_block, n_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, causal: bool,
                      window_left=None):
    """Deterministic dQ: the semaphore value K/V block ``n_block`` waits for on Q block
    ``m_block``. The K/V blocks that see the Q block take turns 0, 1, ... in the grid's launch
    order, so the ones a block waits for started before it. Causal: from the diagonal block down,
    with the grid reversed (``kv_block_of_cta``): a Q block is the first one its diagonal K/V
    block visits, while in increasing n order every Q block waits for K/V block 0, which reaches
    the last Q blocks last (40-51% slower than non-deterministic). Otherwise increasing n (a
    window: from its first visible block, ``block_info.dq_turn``)."""
    if causal:
        return block_info.n_block_max(m_block, tile_m, tile_n, seqlen_q, seqlen_k, True) - 1 - n_block
    return block_info.dq_turn(m_block, n_block, tile_m, tile_n, seqlen_q, seqlen_k, window_left)


# added to a Q block's semaphore once its first dQ share has landed (non-deterministic; far above any
# count of K/V blocks that may take a ticket before it)
DQ_STORED = 1 << 30


@cute.jit
def dq_first_share(sem, lane) -> Int32:
    """Non-deterministic dQ: 1 where this K/V block is the first to reach the Q block whose
    semaphore is ``sem`` (it stores its share, so that the accumulator needs no zeroing: 134 MB
    at d128 and 16k tokens; +6-7% on a d128 causal backward at S 2048 without it), else 0 once
    the first share has landed (``DQ_STORED``; the others add theirs). Lane 0 takes a ticket; the
    warp gets the answer."""
    ticket = Int32(0)
    if lane == 0:
        ticket = cute.arch.atomic_add(sem, Int32(1), sem="relaxed", scope="gpu")
        if ticket != 0:
            while cute.arch.load(sem, Int32, sem="acquire", scope="gpu") < DQ_STORED:
                pass
    ticket = cute.arch.shuffle_sync(ticket, 0)
    return Int32(ticket == 0)


def dq_slot_copy(num_chunks: int) -> cute.TiledCopy:
    """Thread t of warpgroup w owns 128-bit vectors t, t + 128, t + 256, ... of chunk w, in the
    order of its dQ accumulator registers: each warp stores 512 contiguous bytes at a time."""
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=32 * DQ_VECTOR),
        cute.make_layout((WARPGROUP_THREADS, num_chunks)),
        cute.make_layout(DQ_VECTOR),
    )


def dq_transposed(tile_m: int) -> bool:
    """Q blocks of a row count wgmma's M cannot take (80: FlashAttention-3's d128 non-causal tile)
    compute dQ^T = K^T dS^T, the head dim along M."""
    return tile_m % 64 != 0


def dq_tiled_mma(dtype, tile_m: int, head_dim: int) -> cute.TiledMma:
    """dQ = dS K: with 128-row Q blocks the two warpgroups take 64 rows each, with 64 half the
    head dim each; either way every warpgroup reads all of dS's keys. ``dq_transposed``: dQ^T =
    K^T dS^T, each warpgroup 64 of the head dim's columns (M, K^T read MN-major) by all tile_m rows
    (N), also over all keys."""
    if dq_transposed(tile_m):
        return common.tiled_mma(dtype, NUM_MMA_WARPGROUPS, tile_m, b_major_mn=False, a_in_registers=False,
                                a_major_mn=True)
    if tile_m == 64 * NUM_MMA_WARPGROUPS:
        return common.tiled_mma(dtype, NUM_MMA_WARPGROUPS, head_dim, b_major_mn=True, a_in_registers=False)
    return common.tiled_mma(dtype, NUM_MMA_WARPGROUPS, head_dim // NUM_MMA_WARPGROUPS, b_major_mn=True,
                            a_in_registers=False, warpgroups_along_n=True)


def mma_thread_slices(*mmas: cute.TiledMma, zero=0):
    """In an MMA thread: its index among the MMA threads, its warpgroup, and each tiled MMA sliced
    per warpgroup (wgmma operands: shared-memory descriptors) and per thread (accumulators).
    ``zero``: a run-time 0 the compiler cannot see through, added to the index, so that the
    offsets derived from it are computed where used rather than held across a loop around them
    (Stream-K's items: held across the walk, they spilled)."""
    tidx = cute.arch.thread_idx()[0] - WARPGROUP_THREADS + zero
    wg = cute.arch.make_warp_uniform(tidx // WARPGROUP_THREADS)
    wg_first_thread = cute.make_layout(NUM_MMA_WARPGROUPS, stride=WARPGROUP_THREADS)(wg)
    return tidx, wg, tuple(m.get_slice(wg_first_thread) for m in mmas), tuple(m.get_slice(tidx) for m in mmas)


class FlashAttentionBackwardSm90:
    """Compile-time configuration of one main backward variant; ``__call__`` launches it.

    head_dim: the padded head dim (TMA zero-fills the columns past the actual one on load and
    clips them on store). tile_n: 64 keys per MMA warpgroup. tile_m: Q rows per block (64 or 128;
    80 at d128, with dQ^T: ``dq_transposed``).
    num_stages: shared-memory buffers for each of Q and dO (and dS).
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
        deterministic: bool,
        features: Features = NO_FEATURES,
        longest_first: bool = False,
        persistent: bool = False,
        stream_k: bool = False,
    ):
        assert tile_n == 64 * NUM_MMA_WARPGROUPS, "tile_n: 64 keys per MMA warpgroup"
        assert tile_m in (64, 80, 128) and head_dim % 16 == 0
        assert tile_m == 128 or head_dim % (16 * NUM_MMA_WARPGROUPS) == 0
        assert not dq_transposed(tile_m) or head_dim == 64 * NUM_MMA_WARPGROUPS, "dQ^T: 64 columns per warpgroup"
        # (a varlen sequence's rows start at a multiple of 128 in the row buffers: traits.sm90_backward_traits)
        assert not (dq_transposed(tile_m) and features.varlen), "varlen: 64- or 128-row Q blocks"
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.num_stages = num_stages
        # shared-memory buffers of Q (+ LSE) and of dO (+ D): both num_stages here
        # (backward_large.py gives dO fewer)
        self.q_stages = self.do_stages = num_stages
        self.causal = causal
        self.deterministic = deterministic
        self.features = features
        # plain causal (no optional feature: the variant measured), not deterministic: CTAs longest
        # first in sections of heads (traits.py)
        self.longest_first = longest_first and causal and not deterministic and features == NO_FEATURES
        # persistent (not deterministic): one CTA per SM walks the K/V blocks of the grid's order,
        # round by round, so a K/V block's start (launch, set-up, its first Q and dO loads) overlaps
        # the previous one's end; K and V wait for the previous dK and dV to leave their buffers
        assert not (persistent and deterministic), "persistent: not deterministic"
        self.persistent = persistent
        # Stream-K (plain non-causal): the grid's last ``stream_k_blocks`` blocks dealt out over
        # ``num_sms`` more CTAs after one CTA per K/V block (traits.stream_k_items); every CTA walks
        # its items, its pipeline states carried from one to the next as in a persistent grid.
        # With ``persistent`` as well, the grid is one CTA per SM: CTA j walks the whole blocks j,
        # j + grid, ... before the Stream-K ones, then Stream-K CTA j's items
        assert not stream_k or not (causal or deterministic or features != NO_FEATURES), \
            "Stream-K: plain non-causal"
        self.stream_k = stream_k
        self.num_mma_threads = NUM_MMA_WARPGROUPS * WARPGROUP_THREADS
        self.num_threads = self.num_mma_threads + WARPGROUP_THREADS

    # the dK and dV accumulators hold dK^T and dV^T (head dim x keys; backward_large.py)
    dkv_transposed = False
    # (backward_large.py's kernel always runs one CTA per K/V block)
    persistent = False
    stream_k = False
    # each MMA warpgroup's dQ of a Q block is computed and staged in this many column parts
    # (backward_large.py at d256: halves, so the fp32 staging buffer fits beside 64 keys)
    dq_parts = 1

    def _dq_cols_per_warpgroup(self) -> int:
        """Head-dim columns of dQ = dS K per MMA warpgroup (``dq_tiled_mma``)."""
        return self.head_dim if self.tile_m == 64 * NUM_MMA_WARPGROUPS else self.head_dim // NUM_MMA_WARPGROUPS

    # ------------------------------------------------------------------ host side
    def _smem_layouts(self):
        """Shared-memory layouts (Q, dO, K/V, dS) at trace time; the large-head-dim kernel has its own."""
        d, m, n, s = self.head_dim, self.tile_m, self.tile_n, self.num_stages
        sQ_layout = common.smem_layout(self.dtype, m, d, s)  # Q and dO
        # K and V, then dK and dV; K is also read MN-major by dQ = dS K in each warpgroup's columns
        sKV_layout = common.smem_layout(self.dtype, n, d, slice_cols=self._dq_cols_per_warpgroup())
        sdS_layout = common.smem_layout(self.dtype, m, n, s)
        return sQ_layout, sQ_layout, sKV_layout, sdS_layout

    def _tiled_mmas(self):
        """The S/dP, dK/dV and dQ tiled MMAs at trace time."""
        m, d = self.tile_m, self.head_dim
        # S^T = K Q^T and dP^T = V dO^T: one warpgroup per 64 keys, both operands K-major
        mma_sdp = common.tiled_mma(self.dtype, NUM_MMA_WARPGROUPS, m, b_major_mn=False, a_in_registers=False)
        # dV += P^T dO and dK += dS^T Q: P^T, dS^T from registers, dO and Q read MN-major
        mma_dkv = common.tiled_mma(self.dtype, NUM_MMA_WARPGROUPS, d, b_major_mn=True, a_in_registers=True)
        return mma_sdp, mma_dkv, dq_tiled_mma(self.dtype, m, d)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mK: cute.Tensor,  # (batch, seqlen_k, heads_kv, head_dim)
        mV: cute.Tensor,
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mLSE_log2: cute.Tensor,  # (batch, heads, seqlen_q_padded) fp32
        mD: cute.Tensor,  # (batch, heads, seqlen_q_padded) fp32
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
        max_seqlen_k: Int32,  # varlen: the longest sequence's keys (the grid)
        window_left: Int32,  # local: the window's edges (an unbounded side is huge)
        window_right: Int32,
        softcap_scale: Float32,  # softcap: softmax_scale / softcap
        num_sms: Int32,  # CTAs of a persistent grid
        head_splits: Int32,  # > 1: the query heads of a K/V head in this many CTAs (see mdKV_split)
        mSeqOrder: cute.Tensor | None,  # varlen, not causal: (batch,) int32, the sequences longest first
        # (2, batch, seqlen_k, heads, head_dim_padded) fp32, the dK (scaled) and dV of split heads
        # (head_splits > 1; mdK, mdV are then left alone): zeroed accumulators of the heads_kv K/V heads
        # that every split adds to, or, deterministic, heads_kv * head_splits heads, one per split.
        # None: dK, dV per split in mdK, mdV (heads_kv * head_splits heads; dK^T/dV^T accumulators)
        mdKV_split: cute.Tensor | None,
        # Stream-K (traits: stream_k): the blocks the num_sms Stream-K CTAs share (0: none), the
        # fp32 dK and dV a CTA publishes (num_sms, 2, tile_n * head_dim), a zeroed flag per CTA and
        # their items (num_sms, traits.STREAM_K_ROW) int32 (traits.stream_k_items)
        stream_k_blocks: Int32,
        mStreamK: cute.Tensor | None,
        mStreamKFlags: cute.Tensor | None,
        mStreamKItems: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        assert mdKV_split is None or not self.dkv_transposed, "fp32 dK, dV of split heads: dK, dV accumulators"

        varlen = const_expr(self.features.varlen)
        num_batches = mCuSeqlensQ.shape[0] - 1 if varlen else mQ.shape[0]
        num_n_blocks = cute.ceil_div(max_seqlen_k if varlen else mK.shape[1], self.tile_n)
        # TMA copies tiles of the first two modes: view the tensors as (seqlen, head_dim, heads, batch)
        mQ, mK, mV, mdO, mdK, mdV = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in (mQ, mK, mV, mdO, mdK, mdV)
        ]
        q_rows = mQ.shape[0]  # (varlen: the packed total) for the causal order's sections
        if const_expr(varlen):
            # a TMA copy clips at the tensor's end, not the sequence's: every tensor goes through a
            # ragged view that ends at the sequence's last query or key (batch 1; _produce, _epilogue)
            mQ, mK, mV, mdO = [ragged_load_view(t[None, None, None, 0]) for t in (mQ, mK, mV, mdO)]
            mdK, mdV = ragged_view(mdK), ragged_view(mdV)
        d, m, n = self.head_dim, self.tile_m, self.tile_n
        sQ_layout, sdO_layout, sKV_layout, sdS_layout = self._smem_layouts()
        sQ_stage = cute.select(sQ_layout, mode=[0, 1])
        sdO_stage = cute.select(sdO_layout, mode=[0, 1])

        load, store = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        atom_Q, tma_Q = cpasync.make_tiled_tma_atom(load, mQ, sQ_stage, (m, d))
        atom_dO, tma_dO = cpasync.make_tiled_tma_atom(load, mdO, sdO_stage, (m, d))
        atom_K, tma_K = cpasync.make_tiled_tma_atom(load, mK, sKV_layout, (n, d))
        atom_V, tma_V = cpasync.make_tiled_tma_atom(load, mV, sKV_layout, (n, d))
        atom_dK, tma_dK = cpasync.make_tiled_tma_atom(store, mdK, sKV_layout, (n, d))
        atom_dV, tma_dV = cpasync.make_tiled_tma_atom(store, mdV, sKV_layout, (n, d))
        split_out = (None, None, None, None)  # split heads' fp32 dK and dV and their TMA reductions / stores
        if const_expr(mdKV_split is not None):
            op = store if const_expr(self.deterministic) else cpasync.CopyReduceBulkTensorTileS2GOp()
            split_out = ()
            for i in cutlass.range_constexpr(2):
                mX = mdKV_split[i, None, None, None, None]
                mX = cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[1, 3, 2, 0]))
                atom, tma = cpasync.make_tiled_tma_atom(op, ragged_view(mX) if const_expr(varlen) else mX,
                                                        self._split_layout(), (n, d))
                split_out += (tma, atom)
        mma_sdp, mma_dkv, mma_dq = self._tiled_mmas()

        items_table = STREAM_K_ROW if const_expr(self.stream_k) else 1

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.do_stages]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, m * self.q_stages], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, m * self.do_stages], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]  # (P,) dS
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, m * d // self.dq_parts], 1024]
            # Stream-K: this CTA's items (``_stream_k_table``)
            sItems: cute.struct.MemRange[Int32, items_table]

        grid = (num_n_blocks, cute.size(mK.shape[2]) * head_splits, cute.size(num_batches))
        if const_expr(self.persistent):
            grid = (cutlass.min(num_n_blocks * mK.shape[2] * head_splits * num_batches, num_sms), 1, 1)
            if const_expr(self.stream_k):  # every Stream-K CTA where blocks are dealt out
                grid = (cutlass.max(grid[0], cutlass.min(stream_k_blocks, 1) * num_sms), 1, 1)
        if const_expr(self.stream_k and not self.persistent):  # 1-D: a CTA per block before the Stream-K ones, then num_sms
            grid = (num_n_blocks * mK.shape[2] * head_splits * num_batches - stream_k_blocks
                    + cutlass.min(stream_k_blocks, 1) * num_sms, 1, 1)
        self.kernel(
            tma_Q, tma_K, tma_V, tma_dO, tma_dK, tma_dV, mLSE_log2, mD, mdQ_accum, mSemaphore,
            softmax_scale, softmax_scale_log2, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mAlibiSlopes, window_left,
            window_right, softcap_scale, atom_Q, atom_K, atom_V, atom_dO, atom_dK, atom_dV,
            sQ_layout, sdO_layout, sKV_layout, sdS_layout, mma_sdp, mma_dkv, mma_dq, SharedStorage,
            num_n_blocks, num_batches, q_rows, head_splits, mSeqOrder, *split_out, stream_k_blocks, mStreamK,
            mStreamKFlags, mStreamKItems,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA views, (seqlen, head_dim, heads, batch); varlen: ragged (load) views
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mLSE_log2: cute.Tensor,
        mD: cute.Tensor,
        mdQ_accum: cute.Tensor,
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
        atom_Q: cute.CopyAtom,
        atom_K: cute.CopyAtom,
        atom_V: cute.CopyAtom,
        atom_dO: cute.CopyAtom,
        atom_dK: cute.CopyAtom,
        atom_dV: cute.CopyAtom,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
        num_n_blocks: Int32,  # the grid's (K/V blocks, K/V heads, batch), for a persistent grid
        num_batches: Int32,
        q_rows: Int32,  # Q's rows (varlen: the packed total, which the ragged view hides)
        head_splits: Int32,
        mSeqOrder: cute.Tensor | None,
        mdK_split: cute.Tensor | None,  # TMA views, (seqlen, head_dim, heads, batch) fp32
        atom_dK_split: cute.CopyAtom | None,
        mdV_split: cute.Tensor | None,
        atom_dV_split: cute.CopyAtom | None,
        stream_k_blocks: Int32,
        mStreamK: cute.Tensor | None,
        mStreamKFlags: cute.Tensor | None,
        mStreamKItems: cute.Tensor | None,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (atom_Q, atom_K, atom_V, atom_dO, atom_dK, atom_dV):
                cpasync.prefetch_descriptor(atom)
            if const_expr(atom_dK_split is not None):
                cpasync.prefetch_descriptor(atom_dK_split)
                cpasync.prefetch_descriptor(atom_dV_split)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        # Pipelines: a full barrier completes when TMA has written a stage's bytes, an empty
        # barrier when every MMA thread has released the stage (common.release_stage).
        make_pipeline = partial(
            pipeline.PipelineTmaAsync.create,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads),
            defer_sync=True,
        )
        tile_bytes = self.dtype.width // 8 * self.head_dim
        row_bytes = self.tile_m * Float32.width // 8  # LSE or D of one Q block
        pipe_kv = make_pipeline(barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1,
                                tx_count=2 * tile_bytes * self.tile_n)
        pipe_q = make_pipeline(barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_stages,
                               tx_count=tile_bytes * self.tile_m + row_bytes)
        pipe_do = make_pipeline(barrier_storage=storage.mbar_do.data_ptr(), num_stages=self.do_stages,
                                tx_count=tile_bytes * self.tile_m + row_bytes)
        pipeline.pipeline_init_arrive(is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sLSE = storage.sLSE.get_tensor(cute.make_layout((self.tile_m, self.q_stages)))
        sD = storage.sD.get_tensor(cute.make_layout((self.tile_m, self.do_stages)))
        sdQ = storage.sdQ.get_tensor(cute.make_layout((self.tile_m * self.head_dim // NUM_MMA_WARPGROUPS
                                                       // self.dq_parts, NUM_MMA_WARPGROUPS)))
        # the window's edges only where the kernel has one (None: compiled out)
        window_left = window_left if const_expr(self.features.local) else None
        window_right = window_right if const_expr(self.features.local) else None
        grid_shape = (num_n_blocks, mK.shape[2] * head_splits, num_batches)
        work_of = partial(self._work, mQ, mK, q_rows, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, window_left,
                          window_right, head_splits=head_splits, mSeqOrder=mSeqOrder)
        sItems = None
        if const_expr(self.stream_k):
            sItems = storage.sItems.get_tensor(cute.make_layout(STREAM_K_ROW))
            if cute.arch.thread_idx()[0] == 0:  # before the CTA barrier below, with every register
                self._stream_k_table(sItems, mStreamKItems, work_of, grid_shape, stream_k_blocks)
        pipeline.pipeline_init_wait()

        role_args = (
            warp_idx, mQ, mK, mV, mdO, (mdK, mdV, (mdK_split, mdV_split, atom_dK_split, atom_dV_split)),
            mLSE_log2, mD, mdQ_accum, mSemaphore, mAlibiSlopes,
            sQ, sK, sV, sdO, sdS, sLSE, sD, sdQ, atom_Q, atom_K, atom_V, atom_dO, atom_dK, atom_dV,
            mma_sdp, mma_dkv, mma_dq, pipe_kv, pipe_q, pipe_do, softmax_scale, softmax_scale_log2,
            window_left, window_right, softcap_scale,
        )
        if const_expr(self.persistent and not self.stream_k):
            self._persistent_roles(*role_args, work_of, grid_shape)
        elif const_expr(self.stream_k):
            self._stream_k_roles(*role_args, work_of, grid_shape, sItems, mStreamK, mStreamKFlags,
                                  stream_k_blocks)
        else:
            work = self._work(mQ, mK, q_rows, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, window_left, window_right,
                              cute.arch.block_idx(), cute.arch.grid_dim(), head_splits=head_splits,
                              mSeqOrder=mSeqOrder)
            roles = partial(self._roles, *role_args, work)
            if const_expr(self.features.varlen):
                # the grid covers the longest sequence: a K/V block past this one's keys does nothing
                # (no role runs, so no barrier waits for a missing peer; its dK/dV rows do not exist)
                n_block_raw, _, _ = cute.arch.block_idx()
                if n_block_raw * self.tile_n < work[2].seqlen_k:
                    roles()
            else:
                roles()

    @cute.jit
    def _persistent_roles(self, warp_idx, mQ, mK, mV, mdO, dkv_out, mLSE_log2, mD, mdQ_accum, mSemaphore,
                          mAlibiSlopes, sQ, sK, sV, sdO, sdS, sLSE, sD, sdQ, atom_Q, atom_K, atom_V, atom_dO, atom_dK,
                          atom_dV, mma_sdp, mma_dkv, mma_dq, pipe_kv, pipe_q, pipe_do, softmax_scale,
                          softmax_scale_log2, window_left, window_right, softcap_scale, work_of, grid_shape):
        """The roles of a persistent grid: each walks the one-CTA-per-K/V-block grid's CTAs
        ``block, block + grid, ...`` (fixed rounds: for K/V blocks alike in length, as non-causal
        and windowed ones are), its pipeline states carried from one K/V block to the next.
        Varlen (explicit traits only): K/V blocks past their sequence's keys are skipped by every role."""
        num_n, heads_kv, batches = grid_shape
        num_ctas = num_n * heads_kv * batches
        first, stride = cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                states = self._pipeline_states(pipeline.PipelineUserType.Producer)
                cta = first
                while cta < num_ctas:
                    work = work_of(self._grid_coords(cta, num_n, heads_kv), grid_shape)
                    if self._has_keys(work):
                        states = self._produce(mQ, mK, mV, mdO, mLSE_log2, mD, sQ, sK, sV, sdO, sLSE, sD, atom_Q,
                                               atom_K, atom_V, atom_dO, pipe_kv, pipe_q, pipe_do, work, states)
                    cta += stride
            if warp_idx == 1:
                cta = first
                while cta < num_ctas:
                    work = work_of(self._grid_coords(cta, num_n, heads_kv), grid_shape)
                    if self._has_keys(work):
                        self._write_dq(mdQ_accum, mSemaphore, sdQ, window_left, work, last=False)
                    cta += stride
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            cute.arch.setmaxregister_increase(MMA_REGISTERS)
            states = self._pipeline_states(pipeline.PipelineUserType.Consumer)
            cta = first
            while cta < num_ctas:
                work = work_of(self._grid_coords(cta, num_n, heads_kv), grid_shape)
                if self._has_keys(work):
                    states = self._mma(dkv_out, mAlibiSlopes, sQ, sK, sV, sdO, sdS, sLSE, sD, sdQ, atom_dK, atom_dV,
                                       mma_sdp, mma_dkv, mma_dq, pipe_kv, pipe_q, pipe_do, softmax_scale,
                                       softmax_scale_log2, window_left, window_right, softcap_scale, work, states)
                cta += stride

    @cute.jit
    def _stream_k_table(self, sItems, mStreamKItems, work_of, grid_shape, stream_k_blocks: Int32):
        """Thread 0 of a Stream-K kernel: this CTA's items into ``sItems`` (traits.STREAM_K_ROW
        ints), which every role reads back. One CTA per K/V block: a CTA before the Stream-K ones
        has one, its block whole; Stream-K CTA j copies row j of ``mStreamKItems``
        (traits.stream_k_items, dealt on the host), its blocks renumbered from the grid's first.
        Persistent: CTA j copies row j where blocks are dealt out (its whole blocks come before,
        ``_stream_k_count``), else has none."""
        num_n, heads_kv, batches = grid_shape
        first_sk = num_n * heads_kv * batches - stream_k_blocks
        cta = cute.arch.block_idx()[0]
        if const_expr(self.persistent):
            sItems[0] = Int32(0)
            sItems[1] = cta
            if stream_k_blocks > 0:
                self._copy_stream_k_row(sItems, mStreamKItems, cta, first_sk)
        else:
            if cta < first_sk:
                units = self._block_units(work_of, grid_shape)
                for f, value in enumerate((1, 0, cta, 0, units, STREAM_K_WHOLE, 0)):
                    sItems[f] = Int32(value)
            else:
                self._copy_stream_k_row(sItems, mStreamKItems, cta - first_sk, first_sk)

    @cute.jit
    def _copy_stream_k_row(self, sItems, mStreamKItems, row, first_sk):
        """Row ``row`` of ``mStreamKItems`` into ``sItems``, its blocks numbered from the grid's first."""
        for f in cutlass.range_constexpr(STREAM_K_ROW):
            sItems[f] = mStreamKItems[row, f]
        for k in cutlass.range_constexpr((STREAM_K_ROW - 2) // STREAM_K_ITEM_FIELDS):
            sItems[2 + STREAM_K_ITEM_FIELDS * k] = sItems[2 + STREAM_K_ITEM_FIELDS * k] + first_sk

    @cute.jit
    def _block_units(self, work_of, grid_shape):
        """A whole K/V block's Stream-K units (query heads x Q blocks: alike for every block of a
        plain non-causal grid); a block no Q block sees gets one empty unit, so that dK = dV = 0
        still go out."""
        _, _, _, _, group, _, num_m, _, _ = work_of((Int32(0), Int32(0), Int32(0)), grid_shape)
        return cutlass.max(group * num_m, 1)

    @cute.jit
    def _stream_k_count(self, sItems, work_of, grid_shape, stream_k_blocks: Int32):
        """(whole, the CTA's items in all). Persistent: ``whole`` = (the whole blocks j, j + grid,
        ... below the first Stream-K block that CTA j walks before its items, j, the grid's size,
        a block's units); else None (a CTA before the Stream-K ones has its block as an item)."""
        if const_expr(self.persistent):
            num_n, heads_kv, batches = grid_shape
            first_sk = num_n * heads_kv * batches - stream_k_blocks
            first, stride = cute.arch.block_idx()[0], cute.arch.grid_dim()[0]
            n_whole = cutlass.max(first_sk - first + stride - 1, 0) // stride
            return (n_whole, first, stride, self._block_units(work_of, grid_shape)), n_whole + sItems[0]
        return None, sItems[0]

    @cute.jit
    def _stream_k_item(self, sItems, work_of, grid_shape, whole, k: Int32):
        """Item ``k`` of the CTA (``whole``: ``_stream_k_count``'s whole blocks first, or None):
        (work, its units (first, end) in the block, (mode, first publisher, this CTA's slot))."""
        num_n, heads_kv, _ = grid_shape
        if const_expr(whole is None):
            row = 2 + STREAM_K_ITEM_FIELDS * k
            work = work_of(self._grid_coords(sItems[row], num_n, heads_kv), grid_shape)
            return work, (sItems[row + 1], sItems[row + 2]), (sItems[row + 3], sItems[row + 4], sItems[1])
        else:
            n_whole, first, stride, units = whole
            row = 2 + STREAM_K_ITEM_FIELDS * cutlass.max(k - n_whole, 0)
            block, lo, hi, mode, first_publisher = (sItems[row + f] for f in range(STREAM_K_ITEM_FIELDS))
            if k < n_whole:
                block, lo, hi, mode, first_publisher = first + k * stride, Int32(0), units, \
                    Int32(STREAM_K_WHOLE), Int32(0)
            work = work_of(self._grid_coords(block, num_n, heads_kv), grid_shape)
            return work, (lo, hi), (mode, first_publisher, sItems[1])

    @cute.jit
    def _stream_k_roles(self, warp_idx, mQ, mK, mV, mdO, dkv_out, mLSE_log2, mD, mdQ_accum, mSemaphore,
                        mAlibiSlopes, sQ, sK, sV, sdO, sdS, sLSE, sD, sdQ, atom_Q, atom_K, atom_V, atom_dO, atom_dK,
                        atom_dV, mma_sdp, mma_dkv, mma_dq, pipe_kv, pipe_q, pipe_do, softmax_scale,
                        softmax_scale_log2, window_left, window_right, softcap_scale, work_of, grid_shape, sItems,
                        mStreamK, mStreamKFlags, stream_k_blocks):
        """The roles of a Stream-K kernel: each walks the CTA's items (``_stream_k_table``;
        persistent: its whole blocks first), its pipeline states carried from one to the next as
        in a persistent grid."""
        # (each role computes its item count after its setmaxnreg: the producer's registers are few)
        items = partial(self._stream_k_count, sItems, work_of, grid_shape, stream_k_blocks)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                whole, count = items()
                item = partial(self._stream_k_item, sItems, work_of, grid_shape, whole)
                states = self._pipeline_states(pipeline.PipelineUserType.Producer)
                for k in cutlass.range(count, unroll=1):
                    work, units, _ = item(k)
                    states = self._produce(mQ, mK, mV, mdO, mLSE_log2, mD, sQ, sK, sV, sdO, sLSE, sD, atom_Q, atom_K,
                                           atom_V, atom_dO, pipe_kv, pipe_q, pipe_do, work, states, units)
            if warp_idx == 1:
                whole, count = items()
                item = partial(self._stream_k_item, sItems, work_of, grid_shape, whole)
                for k in cutlass.range(count, unroll=1):
                    work, units, _ = item(k)
                    self._write_dq(mdQ_accum, mSemaphore, sdQ, window_left, work, last=False, units=units)
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            cute.arch.setmaxregister_increase(MMA_REGISTERS)
            whole, count = items()
            item = partial(self._stream_k_item, sItems, work_of, grid_shape, whole)
            states = self._pipeline_states(pipeline.PipelineUserType.Consumer)
            for k in cutlass.range(count, unroll=1):
                work, units, piece = item(k)
                states = self._mma(dkv_out, mAlibiSlopes, sQ, sK, sV, sdO, sdS, sLSE, sD, sdQ, atom_dK, atom_dV,
                                   mma_sdp, mma_dkv, mma_dq, pipe_kv, pipe_q, pipe_do, softmax_scale,
                                   softmax_scale_log2, window_left, window_right, softcap_scale, work, states, units,
                                   (*piece, mStreamK, mStreamKFlags))

    @staticmethod
    def _heads_walked(group, num_m, units):
        """(first, end) of the query heads (offsets in the K/V head's group) a walk visits: all
        ``group``, or those of the Stream-K units [first, end) of ``units`` (unit u: step u % num_m
        of query head u // num_m)."""
        if const_expr(units is None):
            return 0, group
        per_head = cutlass.max(num_m, 1)
        return units[0] // per_head, (units[1] + per_head - 1) // per_head

    @staticmethod
    def _steps_walked(g, num_m, units):
        """(first, end) of the steps (``_q_block``'s i) a walk takes on query head ``g``: all
        ``num_m``, or those of the Stream-K ``units``."""
        if const_expr(units is None):
            return 0, num_m
        return cutlass.max(units[0] - g * num_m, 0), cutlass.min(units[1] - g * num_m, num_m)

    def _pipeline_states(self, role):
        """Fresh (K/V, Q, dO) pipeline states of ``role`` (a pipeline.PipelineUserType)."""
        return (pipeline.make_pipeline_state(role, 1), pipeline.make_pipeline_state(role, self.q_stages),
                pipeline.make_pipeline_state(role, self.do_stages))

    @staticmethod
    def _grid_coords(cta: Int32, num_n: Int32, heads_kv: Int32):
        """(K/V block, K/V head, batch) of CTA number ``cta`` of the (K/V blocks, K/V heads, batch)
        grid, K/V block fastest (the hardware's order)."""
        pair = cta // num_n
        return cta - pair * num_n, pair % heads_kv, pair // heads_kv

    def _has_keys(self, work):
        """Whether the K/V block of ``work`` holds keys (varlen: the grid covers the longest
        sequence; without varlen, a compile-time True)."""
        if const_expr(self.features.varlen):
            return work[0] * self.tile_n < work[2].seqlen_k
        return True

    @cute.jit
    def _roles(self, warp_idx, mQ, mK, mV, mdO, dkv_out, mLSE_log2, mD, mdQ_accum, mSemaphore, mAlibiSlopes,
               sQ, sK, sV, sdO, sdS, sLSE, sD, sdQ, atom_Q, atom_K, atom_V, atom_dO, atom_dK, atom_dV,
               mma_sdp, mma_dkv, mma_dq, pipe_kv, pipe_q, pipe_do, softmax_scale, softmax_scale_log2,
               window_left, window_right, softcap_scale, work):
        """Warp specialisation: the producer warp, the dQ writer warp, the MMA warpgroups."""
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                self._produce(mQ, mK, mV, mdO, mLSE_log2, mD, sQ, sK, sV, sdO, sLSE, sD, atom_Q, atom_K, atom_V,
                              atom_dO, pipe_kv, pipe_q, pipe_do, work)
            if warp_idx == 1:
                self._write_dq(mdQ_accum, mSemaphore, sdQ, window_left, work)
        else:
            cute.arch.setmaxregister_increase(MMA_REGISTERS)
            self._mma(dkv_out, mAlibiSlopes, sQ, sK, sV, sdO, sdS, sLSE, sD, sdQ, atom_dK, atom_dV, mma_sdp, mma_dkv,
                      mma_dq, pipe_kv, pipe_q, pipe_do, softmax_scale, softmax_scale_log2, window_left, window_right,
                      softcap_scale, work)

    @cute.jit
    def _work(self, mQ: cute.Tensor, mK: cute.Tensor, q_rows: Int32, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, window_left,
              window_right, cta_coords, grid_shape, head_splits: Int32, mSeqOrder=None):
        """The K/V block, K/V head and sequence of the CTA at ``cta_coords`` of a (K/V blocks,
        K/V heads x head_splits, batch) grid, and the Q blocks it visits: (n_block, head of dK and
        dV, seq, first query head, query heads, first Q block, Q blocks per head, K/V head, whether
        the K/V head's query heads are split). Every role walks the same (head, Q block) sequence.
        ``head_splits`` > 1 (GQA): split s of K/V head h takes the s-th share of h's query heads;
        its dK, dV go to ``mdKV_split`` (added into head h, or, deterministic, head h * head_splits
        + s) or, without one, to head h * head_splits + s of per-split dK, dV in the input dtype;
        the host sums the per-split ones. ``mSeqOrder`` (non-causal varlen): grid batch index b
        runs sequence mSeqOrder[b], so the hardware, which starts CTAs in grid order, starts the
        longest sequences' (longest) CTAs first and ends on short ones."""
        n_block, head_dkv, batch = cta_coords
        group_all = mQ.shape[2] // mK.shape[2]  # query heads per K/V head
        if const_expr(not self.features.varlen):
            q_rows = mQ.shape[0]  # (the same value; a varlen mQ is a ragged view)
        group = group_all // head_splits  # ... per CTA
        if const_expr(self.longest_first):
            # block 0 of every (batch, K/V head split) pair of an L2-sized section, then block 1, ...
            num_n, heads_dkv, batches = grid_shape
            cta = n_block + num_n * (head_dkv + heads_dkv * batch)
            section = tile_scheduler.backward_heads_per_section(q_rows, group, self.head_dim)
            n_block, head_dkv, batch = tile_scheduler.section_coords(cta, num_n, heads_dkv, batches, section)
        if const_expr(mSeqOrder is not None):
            batch = mSeqOrder[batch]
        seq = SeqlenInfo(batch, q_rows, mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        if const_expr(self.causal and self.deterministic):
            # the last K/V blocks first: the order their dQ shares are added in (dq_semaphore_turn)
            n_block = kv_block_of_cta(n_block, self.tile_n, seq.seqlen_k, reverse=True)
        head_kv = head_dkv // head_splits
        head0 = head_kv * group_all + (head_dkv - head_kv * head_splits) * group
        m_min, m_max, _, _ = block_info.backward_walk(n_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                                                      self.causal, window_left, window_right)
        num_m = cutlass.max(m_max - m_min, 0)
        return n_block, head_dkv, seq, head0, group, m_min, num_m, head_kv, head_splits > 1

    # ------------------------------------------------------------------ producer warp
    @cute.jit
    def _produce(self, mQ, mK, mV, mdO, mLSE_log2, mD, sQ, sK, sV, sdO, sLSE, sD, atom_Q, atom_K, atom_V, atom_dO,
                 pipe_kv, pipe_q, pipe_do, work, states=None, units=None):
        """TMA loads: K and V once, then Q + LSE and dO + D per Q block, in the MMA warpgroups' order
        (Stream-K ``units``: the item's share of them).
        Persistent (``states``: the pipeline states, returned advanced): K and V after the first Q
        block's loads, which may then arrive while the previous K/V block's dK and dV still occupy
        K's and V's buffers."""
        n_block, _, seq, head0, group, m_min, num_m, head_kv, _ = work
        b = seq.tensor_batch
        tile_q = (self.tile_m, self.head_dim)
        kv_state, q_state, do_state = self._pipeline_states(pipeline.PipelineUserType.Producer) \
            if const_expr(states is None) else states
        load_kv = partial(self._load_kv, mK, mV, sK, sV, atom_K, atom_V, pipe_kv, n_block, head_kv, seq)
        if const_expr(states is None):
            load_kv(kv_state)
        else:
            kv_pending = Int32(1)  # K and V go out after the first Q block's loads

        bulk = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32)
        # (bound before the loop: the DSL would carry an object whose method a loop body calls)
        q_rows, padded_q_rows = seq.tma_q_rows, seq.padded_q_rows
        g_first, g_end = self._heads_walked(group, num_m, units)
        for g in cutlass.range(g_first, g_end, unroll=1):
            head = head0 + g
            gQ = cute.local_tile(q_rows(mQ, head), tile_q, (None, 0))
            gdO = cute.local_tile(q_rows(mdO, head), tile_q, (None, 0))
            tQsQ, tQgQ = common.tma_tiles(atom_Q, gQ, sQ)
            tdOsdO, tdOgdO = common.tma_tiles(atom_dO, gdO, sdO)
            # the row buffers hold LSE_log2 = +inf (P = 0) and D = 0 past seqlen_q, up to the next
            # sequence's padded start (varlen)
            gLSE = cute.local_tile(padded_q_rows(mLSE_log2[b, head, None]), (self.tile_m,), (None,))
            gD = cute.local_tile(padded_q_rows(mD[b, head, None]), (self.tile_m,), (None,))
            i_first, i_end = self._steps_walked(g, num_m, units)
            for i in cutlass.range(i_first, i_end, unroll=1):
                m_block = self._q_block(n_block, m_min, num_m, i)
                pipe_q.producer_acquire(q_state)
                bar = pipe_q.producer_get_barrier(q_state)
                cute.copy(atom_Q, tQgQ[None, m_block], tQsQ[None, q_state.index], tma_bar_ptr=bar)
                with cute.arch.elect_one():
                    cute.copy(bulk, gLSE[None, m_block], sLSE[None, q_state.index], mbar_ptr=bar)
                q_state.advance()
                pipe_do.producer_acquire(do_state)
                bar = pipe_do.producer_get_barrier(do_state)
                cute.copy(atom_dO, tdOgdO[None, m_block], tdOsdO[None, do_state.index], tma_bar_ptr=bar)
                with cute.arch.elect_one():
                    cute.copy(bulk, gD[None, m_block], sD[None, do_state.index], mbar_ptr=bar)
                do_state.advance()
                if const_expr(states is not None):
                    if kv_pending != 0:
                        load_kv(kv_state)
                        kv_pending = Int32(0)
        if const_expr(states is not None):
            if kv_pending != 0:  # a K/V block that no query sees (its dK = dV = 0 still go out)
                load_kv(kv_state)
            kv_state.advance()
            return kv_state, q_state, do_state

    @cute.jit
    def _load_kv(self, mK, mV, sK, sV, atom_K, atom_V, pipe_kv, n_block, head_kv, seq, kv_state):
        """K and V of this K/V block into their buffers (one pipeline stage)."""
        tile_kv = (self.tile_n, self.head_dim)
        pipe_kv.producer_acquire(kv_state)
        for atom, mX, sX in ((atom_K, mK, sK), (atom_V, mV, sV)):
            gX = cute.local_tile(seq.tma_k_rows(mX, head_kv), tile_kv, (n_block, 0))
            tXsX, tXgX = common.tma_tiles(atom, gX, sX)
            cute.copy(atom, tXgX, tXsX, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

    # ------------------------------------------------------------------ dQ writer warp
    @cute.jit
    def _write_dq(self, mdQ_accum, mSemaphore, sdQ, window_left, work, last: bool = True, units=None):
        """Per Q block, add each MMA warpgroup's dQ chunk from shared memory into the global fp32
        accumulator (one bulk operation each; ``dq_parts`` of them, one per column part). A
        chunk's buffer is handed back to its warpgroup once the previous operation has read it.
        The accumulator is not zeroed beforehand: the first K/V block to reach a Q block stores
        its share (``dq_first_share``) and the others add theirs after it has landed.
        ``last``: this CTA's last K/V block (wait for the copies to read shared memory before
        the CTA ends). Stream-K ``units``: the item's share of the Q blocks."""
        n_block, _, seq, head0, group, m_min, num_m, _, _ = work
        lane = cute.arch.lane_idx()
        part_elems = self.tile_m * self.head_dim // NUM_MMA_WARPGROUPS // self.dq_parts
        g_first, g_end = self._heads_walked(group, num_m, units)
        for g in cutlass.range(g_first, g_end, unroll=1):
            head = head0 + g
            i_first, i_end = self._steps_walked(g, num_m, units)
            for i in cutlass.range(i_first, i_end, unroll=1):
                m_block = self._q_block(n_block, m_min, num_m, i)
                sem = mSemaphore[seq.batch, head, None].iterator + m_block
                turn = Int32(0)
                first = Int32(0)
                for part in cutlass.range_constexpr(self.dq_parts):
                    for wg in cutlass.range_constexpr(NUM_MMA_WARPGROUPS):
                        # copies complete in order: at most the later warpgroups' may still read
                        cute.arch.cp_async_bulk_wait_group(NUM_MMA_WARPGROUPS - 1 - wg, read=True)
                        cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_EMPTY_WG1) + wg,
                                                 number_of_threads=WARPGROUP_THREADS + 32)
                    if const_expr(part == 0):
                        if const_expr(self.deterministic):
                            # the K/V blocks that see a Q block add their shares in a fixed order
                            turn = dq_semaphore_turn(m_block, n_block, self.tile_m, self.tile_n, seq.seqlen_q,
                                                     seq.seqlen_k, self.causal, window_left)
                            if lane == 0:
                                while cute.arch.load(sem, Int32, sem="acquire", scope="gpu") != turn:
                                    pass
                            cute.arch.sync_warp()
                            first = Int32(turn == 0)
                        else:
                            first = dq_first_share(sem, lane)
                    gdQ = dq_accum_slots(mdQ_accum, seq, head, m_block, self.tile_m, self.head_dim,
                                         NUM_MMA_WARPGROUPS)
                    for wg in cutlass.range_constexpr(NUM_MMA_WARPGROUPS):
                        cute.arch.barrier(barrier_id=int(Barrier.DQ_FULL_WG1) + wg,
                                          number_of_threads=WARPGROUP_THREADS + 32)
                        # in parts, warpgroup wg's part ``part`` is the slots of the postprocess's
                        # chunk ``part``, sub-part wg (backward_large.py, ``dq_part_slots``)
                        dst = (gdQ[None, wg].iterator if const_expr(self.dq_parts == 1)
                               else gdQ[None, part].iterator + wg * part_elems)
                        nbytes = part_elems * Float32.width // 8
                        with cute.arch.elect_one():
                            if first != 0:
                                primitives.cp_async_bulk_global_shared_cta(dst, sdQ[None, wg].iterator, nbytes)
                            else:
                                primitives.cp_reduce_async_bulk_global_shared_cta(
                                    dst, sdQ[None, wg].iterator, nbytes,
                                    op=primitives.CpReduceOp.ADD, type=primitives.CpReduceType.F32,
                                )
                        cute.arch.cp_async_bulk_commit_group()
                if const_expr(self.deterministic):
                    cute.arch.cp_async_bulk_wait_group(0, read=False)  # the share has landed
                    if lane == 0:
                        cute.arch.store(sem, turn + 1, sem="release", scope="gpu")
                else:
                    if first != 0:
                        cute.arch.cp_async_bulk_wait_group(0, read=False)  # the stored share has landed
                        if lane == 0:
                            cute.arch.atomic_add(sem, Int32(DQ_STORED), sem="release", scope="gpu")
        if const_expr(last):
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    # ------------------------------------------------------------------ MMA warpgroups
    @cute.jit
    def _mma(self, dkv_out, mAlibiSlopes, sQ, sK, sV, sdO, sdS, sLSE, sD, sdQ, atom_dK, atom_dV, mma_sdp, mma_dkv,
             mma_dq, pipe_kv, pipe_q, pipe_do, softmax_scale, softmax_scale_log2, window_left, window_right,
             softcap_scale, work, states=None, units=None, piece=None):
        """One K/V block. Persistent (``states``: the pipeline states, returned advanced): K's and
        V's stage is released once dK and dV have left their buffers. Stream-K: ``units`` (first,
        end) of the block's walk and ``piece`` (mode, first publisher, this CTA's slot, workspace,
        flags): a PUBLISH piece leaves its partial dK and dV in the workspace, a FINISH piece
        adds the published ones before storing."""
        n_block, head_dkv, seq, head0, group, m_min, num_m, head_kv, split = work
        mdK, mdV, split_out = dkv_out
        # Stream-K: the item's mode (0-2) shifted out, a 0 that differs per item for the compiler
        zero = 0 if const_expr(piece is None) else piece[0] >> 2
        tidx, wg, (wg_sdp, wg_dkv, wg_dq), (thr_sdp, thr_dkv, thr_dq) = mma_thread_slices(mma_sdp, mma_dkv, mma_dq,
                                                                                            zero=zero)
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tdPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        tdVrP = wg_dkv.make_fragment_A(wg_dkv.partition_shape_A((self.tile_n, self.tile_m)))
        tdKrdS = wg_dkv.make_fragment_A(wg_dkv.partition_shape_A((self.tile_n, self.tile_m)))
        tdVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sdO)))
        tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(sQ)))
        if const_expr(dq_transposed(self.tile_m)):  # dQ^T = K^T dS^T: K^T (MN-major) as A, dS as B
            tdQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))
            tdQrKt = wg_dq.make_fragment_A(wg_dq.partition_A(transpose_smem(sK)))
        else:
            tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
            tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_smem(sK)))
        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((self.tile_n, self.head_dim)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C((self.tile_n, self.head_dim)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # dS^T (keys x queries in registers) -> dS (queries x keys, K-major for dQ = dS K): stmatrix.trans
        stsm_dS = cute.make_tiled_copy_C(cute.make_copy_atom(warp.StMatrix8x8x16bOp(True, 4), self.dtype),
                                         mma_sdp).get_slice(tidx)
        tdSsdS = stsm_dS.partition_D(transpose_smem(sdS))
        copy_dQ = dq_slot_copy(NUM_MMA_WARPGROUPS).get_slice(tidx)
        tdQsdQ = copy_dQ.partition_D(sdQ)
        # each accumulator element's (key, query) in the tile, for the masks
        cS = cute.make_identity_tensor((self.tile_n, self.tile_m))
        tScS, tScS_thread0 = thr_sdp.partition_C(cS), mma_sdp.get_slice(0).partition_C(cS)

        ctx = (mma_sdp, mma_dkv, mma_dq, thr_sdp, thr_dq, tSrK, tSrQ, tdPrV, tdPrdO, tdVrP, tdKrdS, tdVrdOt, tdKrQt,
               tdQrdS, tdQrKt, acc_dK, acc_dV, stsm_dS, tdSsdS, tdQsdQ, tScS, tScS_thread0, sLSE, sD,
               pipe_q, pipe_do, softmax_scale_log2, n_block, seq.seqlen_q, seq.seqlen_k, wg, window_left, window_right,
               softcap_scale)

        unmasked = self._unmasked_q_blocks(n_block, seq, window_left, window_right)
        states = self._walk_q_blocks(ctx, pipe_kv, mAlibiSlopes, seq, head0, group, n_block, m_min, num_m,
                                     softmax_scale_log2, unmasked, states, units)
        # (a K/V block that no query sees still stores its dK = dV = 0)
        epilogue = partial(self._epilogue, acc_dK, acc_dV, mdK, mdV, sK, sV, atom_dK, atom_dV, mma_dkv, tidx,
                           softmax_scale, n_block, head_dkv, seq)
        write_split = None
        if const_expr(split_out[0] is not None):
            # deterministic: one fp32 tile per split (stored); otherwise added into the K/V head's
            write_split = partial(self._write_split_dkv, acc_dK, acc_dV, split_out, sQ, sK, mma_dkv, tidx,
                                  softmax_scale, n_block, head_dkv if const_expr(self.deterministic) else head_kv, seq)
        if const_expr(piece is None):
            self._store_dkv(epilogue, write_split, split)
        else:
            mode, first_publisher, slot, mStreamK, mFlags = piece
            if mode == STREAM_K_PUBLISH:
                self._publish_dkv(acc_dK, acc_dV, mStreamK, mFlags, slot, tidx)
            else:
                if mode == STREAM_K_FINISH:
                    self._gather_dkv(acc_dK, acc_dV, mStreamK, mFlags, first_publisher, slot, tidx)
                self._store_dkv(epilogue, write_split, split)
        if const_expr(states is not None):
            kv_state, q_state, do_state = states
            # the dK/dV stores' issuing thread has waited for them to read K's and V's buffers
            cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE), number_of_threads=self.num_mma_threads)
            common.release_stage(pipe_kv, kv_state)
            kv_state.advance()
            return kv_state, q_state, do_state

    @cute.jit
    def _store_dkv(self, epilogue, write_split, split):
        """dK and dV out: ``write_split`` (fp32 split heads, where compiled in) for a split K/V
        head, else ``epilogue``."""
        if const_expr(write_split is not None):
            if split:
                write_split()
            else:
                epilogue()
        else:
            epilogue()

    def _stream_k_slot(self, mStreamK: cute.Tensor, slot, i: int, tidx) -> cute.Tensor:
        """This thread's share of workspace slot ``slot``'s dK (i = 0) or dV (1): 128-bit vectors
        in the order of its accumulator registers (``dq_slot_copy``'s, over the keys x head dim)."""
        elems = self.tile_n * self.head_dim
        tile = cute.make_tensor(mStreamK[slot, i, None].iterator,
                                cute.make_layout((elems // NUM_MMA_WARPGROUPS, NUM_MMA_WARPGROUPS)))
        return dq_slot_copy(NUM_MMA_WARPGROUPS).get_slice(tidx).partition_D(tile)

    @cute.jit
    def _publish_dkv(self, acc_dK, acc_dV, mStreamK, mFlags, slot, tidx):
        """A Stream-K PUBLISH piece: the partial dK (unscaled) and dV to this CTA's workspace slot,
        then its flag, raised once every MMA thread's stores are visible GPU-wide."""
        for i, acc in enumerate((acc_dK, acc_dV)):
            dst = self._stream_k_slot(mStreamK, slot, i, tidx)
            cute.autovec_copy(cute.make_tensor(acc.iterator, cute.make_layout(dst.shape)), dst)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE), number_of_threads=self.num_mma_threads)
        if tidx == 0:
            cute.arch.store(mFlags.iterator + slot, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def _gather_dkv(self, acc_dK, acc_dV, mStreamK, mFlags, first_publisher, slot, tidx):
        """A Stream-K FINISH piece: add the partial dK and dV of the Stream-K CTAs first_publisher
        ... slot - 1 (the block's earlier pieces) in that order, each once its flag is up."""
        for p in cutlass.range(first_publisher, slot, unroll=1):
            while cute.arch.load(mFlags.iterator + p, Int32, sem="acquire", scope="gpu") == 0:
                pass
            for i, acc in enumerate((acc_dK, acc_dV)):
                src = self._stream_k_slot(mStreamK, p, i, tidx)
                part = cute.make_rmem_tensor(src.shape, Float32)
                cute.autovec_copy(src, part)
                mine = cute.make_tensor(acc.iterator, cute.make_layout(src.shape))
                mine.store(mine.load() + part.load())

    @cute.jit
    def _walk_q_blocks(self, ctx, pipe_kv, mAlibiSlopes, seq, head0, group, n_block, m_min, num_m,
                       softmax_scale_log2, unmasked, states=None, units=None):
        """Once K and V are in: ``_backward_block`` on the ``num_m`` Q blocks from ``m_min`` of
        each of the ``group`` query heads of this K/V head, in ``_q_block``'s order
        (``unmasked``: ``_unmasked_q_blocks``; ``units``: Stream-K's share of them, ``_heads_walked``).
        ``states``: the pipeline states to start from (persistent; returned advanced), else fresh ones."""
        kv_state, q_state, do_state = self._pipeline_states(pipeline.PipelineUserType.Consumer) \
            if const_expr(states is None) else states
        pipe_kv.consumer_wait(kv_state)
        g_first, g_end = self._heads_walked(group, num_m, units)
        for g in cutlass.range(g_first, g_end, unroll=1):
            alibi_slope = None
            if const_expr(self.features.alibi):
                alibi_slope = alibi_slope_units(mAlibiSlopes, seq.batch, head0 + g, softmax_scale_log2)
            i_first, i_end = self._steps_walked(g, num_m, units)
            for i in cutlass.range(i_first, i_end, unroll=1):
                self._backward_block(ctx, q_state, do_state, self._q_block(n_block, m_min, num_m, i), alibi_slope,
                                     unmasked)
                q_state.advance()
                do_state.advance()
        return kv_state, q_state, do_state

    @property
    def staggered(self) -> bool:
        """Plain non-causal, one CTA per K/V block (or persistent Stream-K, the d128 tier), not
        deterministic: each K/V block's walk starts at its own Q block (``_q_block``). H100,
        2026-11-26, S 512-16384 beside the same kernels walking from Q block 0: d128 +1..+9% (one
        row, S 4096, -3..-5%), d256 +2..+10% (walking from 0, the unzeroed accumulator cost d256
        up to 6%: docs/performance.md); the persistent d64 grid measured -2..-4% at S 512/1024 with
        it, level beyond, and walks from 0."""
        return (not self.causal and not self.deterministic and not self.features.local
                and (not self.persistent or self.stream_k))

    @cute.jit
    def _q_block(self, n_block: Int32, m_min: Int32, num_m: Int32, i: Int32) -> Int32:
        """The ``i``-th of the ``num_m`` Q blocks from ``m_min`` that K/V block ``n_block`` visits
        (every role walks the same order). ``staggered``: the walk starts at Q block ``n_block``
        mod ``num_m`` and wraps around, so the CTAs of one head, which start together, reach each
        Q block one after another instead of all at once (the first dQ share must land before the
        others add theirs: ``dq_first_share``)."""
        m_block = m_min + i
        if const_expr(self.staggered):
            m_block += n_block % num_m
            if m_block >= m_min + num_m:
                m_block -= num_m
        return m_block

    @cute.jit
    def _backward_block(self, ctx, q_state, do_state, m_block: Int32, alibi_slope, unmasked):
        """The five GEMMs of one Q block. wgmma groups complete in issue order, so each
        ``wait=1`` below means "everything but the GEMM just issued is done"."""
        (mma_sdp, mma_dkv, mma_dq, thr_sdp, thr_dq, tSrK, tSrQ, tdPrV, tdPrdO, tdVrP, tdKrdS, tdVrdOt, tdKrQt,
         tdQrdS, tdQrKt, acc_dK, acc_dV, stsm_dS, tdSsdS, tdQsdQ, tScS, tScS_thread0, sLSE, sD,
         pipe_q, pipe_do, softmax_scale_log2, n_block, seqlen_q, seqlen_k, wg, window_left, window_right,
         softcap_scale) = ctx
        q_stage, do_stage = q_state.index, do_state.index

        # S^T = K Q^T and dP^T = V dO^T, back to back (softcap: dP^T after P^T, below)
        late_dp = const_expr(self.features.softcap)
        pipe_q.consumer_wait(q_state)
        acc_S = cute.make_rmem_tensor(thr_sdp.partition_shape_C((self.tile_n, self.tile_m)), Float32)
        common.wgmma(mma_sdp, acc_S, tSrK, tSrQ[None, None, None, q_stage], zero_init=True, wait=-1)
        pipe_do.consumer_wait(do_state)
        acc_dP = cute.make_rmem_tensor(thr_sdp.partition_shape_C((self.tile_n, self.tile_m)), Float32)
        if const_expr(not late_dp):
            common.wgmma(mma_sdp, acc_dP, tdPrV, tdPrdO[None, None, None, do_stage], zero_init=True, wait=-1)
        # the LSE and D of this thread's queries, read from shared memory where used: loading them
        # into registers up front measured slower (tile_m / 2 more live registers; d64 spills)
        lse_log2 = self._per_query(thr_sdp, sLSE, q_stage)
        d = self._per_query(thr_sdp, sD, do_stage)
        warpgroup.wait_group(0 if late_dp else 1)

        # P^T = exp2(S^T * scale_log2 - LSE_log2[query]) while dP^T is in flight (not yet issued
        # with softcap). Softcap first
        # (S^T = tanh(S^T * softcap_scale); scale_log2 is then softcap * log2(e)), then ALiBi and the masks
        dtanh = None
        if const_expr(self.features.softcap):
            dtanh = cute.make_rmem_tensor_like(acc_S)
            apply_softcap(acc_S, softcap_scale, dtanh)
        self._mask(partial(apply_mask_transposed, acc_S, tScS, tScS_thread0, m_block, n_block, self.tile_m,
                           self.tile_n, seqlen_q, seqlen_k, self.causal, window_left, window_right, alibi_slope),
                   m_block, unmasked)
        S = acc_to_rows_cols(acc_S)
        for c in cutlass.range_constexpr(cute.size(S.shape[1])):
            for r in cutlass.range_constexpr(cute.size(S.shape[0])):
                S[r, c] = cute.math.exp2(S[r, c] * softmax_scale_log2 - lse_log2[c], fastmath=True)
        tdVrP.store(acc_to_operand_a(acc_S).load().to(self.dtype))
        if const_expr(self.features.softcap):
            # dS^T = P^T * (1 - tanh^2) * (dP^T - D): the derivative folded into P^T
            acc_S.store(acc_S.load() * dtanh.load())

        if const_expr(late_dp):
            # softcap: 1 - tanh^2 beside the in-flight dP^T accumulator spilled (d64 up to 136 bytes,
            # d128 causal 8, also with it in fp16), and so did dV under dS^T (its P^T operand
            # pinned). So dV, then dP^T, both done before dS^T: no GEMM runs under the element-wise
            # work, but nothing spills.
            common.wgmma(mma_dkv, acc_dV, tdVrP, tdVrdOt[None, None, None, do_stage], zero_init=False, wait=-1)
            common.wgmma(mma_sdp, acc_dP, tdPrV, tdPrdO[None, None, None, do_stage], zero_init=True, wait=0)
        else:
            warpgroup.wait_group(0)
        # dS^T = P^T * (dP^T - D[query])
        dP = acc_to_rows_cols(acc_dP)
        for c in cutlass.range_constexpr(cute.size(dP.shape[1])):
            for r in cutlass.range_constexpr(cute.size(dP.shape[0])):
                dP[r, c] = S[r, c] * (dP[r, c] - d[c])
        rdS = convert(acc_dP, self.dtype)
        tdKrdS.store(acc_to_operand_a(rdS).load())
        # this stage's dS buffer was last read by the dQ GEMM of two Q blocks ago, which both
        # warpgroups waited for before the last PDS barrier
        cute.copy(stsm_dS, stsm_dS.retile(rdS), tdSsdS[None, None, None, q_stage])

        if const_expr(not late_dp):
            # dV += P^T dO
            common.wgmma(mma_dkv, acc_dV, tdVrP, tdVrdOt[None, None, None, do_stage], zero_init=False, wait=-1)
        cute.arch.fence_view_async_shared()  # dS's generic-proxy writes, visible to wgmma
        cute.arch.barrier(barrier_id=int(Barrier.PDS), number_of_threads=self.num_mma_threads)

        # dQ = dS K (both warpgroups' keys), then dK += dS^T Q
        if const_expr(dq_transposed(self.tile_m)):
            acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((self.head_dim, self.tile_m)), Float32)
            common.wgmma(mma_dq, acc_dQ, tdQrKt, tdQrdS[None, None, None, q_stage], zero_init=True, wait=1)
        else:
            acc_dQ = cute.make_rmem_tensor(thr_dq.partition_shape_C((self.tile_m, self.head_dim)), Float32)
            common.wgmma(mma_dq, acc_dQ, tdQrdS[None, None, None, q_stage], tdQrKt, zero_init=True, wait=1)
        common.release_stage(pipe_do, do_state)  # dO: read by dP^T and dV, both done
        common.wgmma(mma_dkv, acc_dK, tdKrdS, tdKrQt[None, None, None, q_stage], zero_init=False, wait=1)

        # dQ -> this warpgroup's shared buffer, once the dQ writer has handed it back
        cute.arch.barrier(barrier_id=int(Barrier.DQ_EMPTY_WG1) + wg, number_of_threads=WARPGROUP_THREADS + 32)
        cute.autovec_copy(cute.make_tensor(acc_dQ.iterator, cute.make_layout(tdQsdQ.shape)), tdQsdQ)
        cute.arch.fence_view_async_shared()  # visible to the bulk reduction (async proxy)
        cute.arch.barrier_arrive(barrier_id=int(Barrier.DQ_FULL_WG1) + wg, number_of_threads=WARPGROUP_THREADS + 32)

        warpgroup.wait_group(0)
        common.release_stage(pipe_q, q_state)  # Q: read by S^T and dK, both done

    @cute.jit
    def _unmasked_q_blocks(self, n_block: Int32, seq: SeqlenInfo, window_left, window_right):
        """The Q blocks [first, end) that see all of K/V block ``n_block`` on both window edges, so
        that ``_mask`` skips them; None: every Q block takes the mask. One loop body serves every
        Q block (a second, unmasked copy of it, as the forward has, measured slower), and only a
        window's mask (two compares and selects per element) goes under a branch: +3-6% on d64
        windows, level to +7% at d128 (H100), where the causal mask's one compare and select
        measured slower under one, and so did the plain non-causal kernels' seqlen_k mask skipped
        on every K/V block but the one that crosses seqlen_k (-1..-6%; docs/performance.md, "Fewer
        mask instructions in the backward's loop"). ALiBi's bias goes on every block."""
        if const_expr(not self.features.local or self.features.alibi):
            return None
        _, _, first, end = block_info.backward_walk(n_block, self.tile_m, self.tile_n, seq.seqlen_q, seq.seqlen_k,
                                                    self.causal, window_left, window_right)
        if (n_block + 1) * self.tile_n > seq.seqlen_k:
            end = Int32(0)  # the block ends past seqlen_k: every Q block masks it
        return first, end

    @cute.jit
    def _mask(self, mask, m_block: Int32, unmasked):
        """``mask()`` unless Q block ``m_block`` lies in ``unmasked`` (``_unmasked_q_blocks``)."""
        if const_expr(unmasked is None):
            mask()
        else:
            first, end = unmasked
            if m_block < first or m_block >= end:
                mask()

    @cute.jit
    def _per_query(self, thr_sdp: cute.ThrMma, sRow: cute.Tensor, stage: Int32) -> cute.Tensor:
        """A shared-memory view of sRow[query, stage] for each accumulator column (query) of this
        thread, indexed by column."""
        rows_of_one = cute.make_tensor(sRow[None, stage].iterator, cute.make_layout((self.tile_n, self.tile_m), stride=(0, 1)))
        return acc_to_rows_cols(thr_sdp.partition_C(rows_of_one))[0, None]

    def _split_layout(self):
        """dK's or dV's fp32 tile in shared memory: as many bytes as K's and V's buffers together
        (they follow each other in ``SharedStorage``, as do Q's and dO's), swizzled for TMA."""
        return common.smem_layout(Float32, self.tile_n, self.head_dim)

    @cute.jit
    def _write_split_dkv(self, acc_dK, acc_dV, split_out, sQ, sK, mma_dkv, tidx, softmax_scale, n_block, head,
                         seq: SeqlenInfo):
        """A split's dK * softmax_scale and its dV in fp32 to head ``head`` of ``mdKV_split``: staged
        in shared memory, then TMA reductions (``.add.f32``: the additions land in any order) or,
        deterministic, TMA stores, which clip rows past the sequence's keys (varlen: through the
        ragged view). One CTA per K/V block: dK over Q's and dO's buffers (the producer loads no
        further Q block) and dV over K's and V's, both at once; persistent, the producer may
        already load the next K/V block's Q blocks, so dK and dV take turns in K's and V's."""
        mdK_split, mdV_split, atom_dK_split, atom_dV_split = split_out
        acc_dK.store(acc_dK.load() * softmax_scale)
        layout = self._split_layout()
        buffer = lambda s: cute.make_tensor(cute.recast_ptr(s.iterator, layout.inner, dtype=Float32), layout.outer)
        at_once = const_expr(not (self.persistent or self.stream_k) and (self.q_stages + self.do_stages) * self.tile_m >= 2 * self.tile_n)
        tiles = ((acc_dK, atom_dK_split, mdK_split, buffer(sQ if at_once else sK)),
                 (acc_dV, atom_dV_split, mdV_split, buffer(sK)))
        copy = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64),
                                      mma_dkv).get_slice(tidx)
        barrier = partial(cute.arch.barrier, barrier_id=int(Barrier.EPILOGUE), number_of_threads=self.num_mma_threads)
        tile = (self.tile_n, self.head_dim)
        k_rows = seq.tma_k_rows  # (bound outside the branch below: the DSL would carry seq through it)
        for turn in ((tiles,) if at_once else ((tiles[0],), (tiles[1],))):
            barrier()  # K and V read by both warpgroups (in turns, dV: dK's copy has read the buffer)
            for acc, _, _, sX in turn:
                cute.copy(copy, copy.retile(acc), copy.partition_D(sX))
            cute.arch.fence_view_async_shared()
            barrier()
            # (a whole warp: the copy elects one lane itself, with elect.sync over the warp)
            if cute.arch.make_warp_uniform(tidx // 32) == 0:
                for _, atom, mX, sX in turn:
                    gX = cute.local_tile(k_rows(mX, head, load=False), tile, (n_block, 0))
                    tXsX, tXgX = common.tma_tiles(atom, gX, sX)
                    cute.copy(atom, tXsX, tXgX)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _epilogue(self, acc_dK, acc_dV, mdK, mdV, sK, sV, atom_dK, atom_dV, mma_dkv, tidx, softmax_scale,
                  n_block, head_dkv, seq: SeqlenInfo):
        """dK * softmax_scale; dK and dV -> shared memory (K's and V's buffers, stmatrix; transposed
        accumulators through stmatrix.trans) -> global (TMA stores, which clip rows past seqlen_k
        and columns past the actual head dim; varlen: through the ragged view, which ends at the
        sequence's last key)."""
        acc_dK.store(acc_dK.load() * softmax_scale)
        rdK, rdV = convert(acc_dK, self.dtype), convert(acc_dV, self.dtype)
        barrier = partial(cute.arch.barrier, barrier_id=int(Barrier.EPILOGUE), number_of_threads=self.num_mma_threads)
        barrier()  # both warpgroups are done reading K and V
        stsm = cute.make_tiled_copy_C(cute.make_copy_atom(warp.StMatrix8x8x16bOp(self.dkv_transposed, 4), self.dtype),
                                      mma_dkv).get_slice(tidx)
        dst = transpose_smem if const_expr(self.dkv_transposed) else (lambda t: t)
        cute.copy(stsm, stsm.retile(rdK), stsm.partition_D(dst(sK)))
        cute.copy(stsm, stsm.retile(rdV), stsm.partition_D(dst(sV)))
        cute.arch.fence_view_async_shared()
        barrier()
        k_rows = seq.tma_k_rows  # (bound outside the branch below: the DSL would carry seq through it)
        if tidx == 0:
            tile = (self.tile_n, self.head_dim)
            for atom, mX, sX in ((atom_dK, mdK, sK), (atom_dV, mdV, sV)):
                gX = cute.local_tile(k_rows(mX, head_dkv, load=False), tile, (n_block, 0))
                tXsX, tXgX = common.tma_tiles(atom, gX, sX)
                cute.copy(atom, tXsX, tXgX)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)


class BackwardPostprocessSm90:
    """dQ = dQ_accum * softmax_scale in the input dtype, one (Q block, head, batch) per CTA of two
    warpgroups, reading the accumulator in the main kernel's slot order (``dq_slot_copy``). A Q
    block whose semaphore is still 0 was reached by no K/V block (no key visible to any of its
    rows): its dQ is 0 and its accumulator, never written (not zeroed), is not read.
    varlen: packed sequences; the grid covers the longest one and Q blocks past a sequence's end
    do nothing."""

    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int, check_hdim: bool, tile_m: int,
                 varlen: bool = False):
        self.dtype = dtype
        self.head_dim = head_dim
        self.check_hdim = check_hdim
        self.tile_m = tile_m
        self.varlen = varlen
        self.num_threads = NUM_MMA_WARPGROUPS * WARPGROUP_THREADS

    @cute.jit
    def __call__(
        self,
        mdQ_accum: cute.Tensor,  # (batch, heads, seqlen_q_padded, head_dim_padded) fp32
        mdQ: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mSemaphore: cute.Tensor,  # (batch, heads, seqlen_q_padded / tile_m) int32, the main kernel's (0: no share)
        softmax_scale: Float32,
        mCuSeqlensQ: cute.Tensor | None,  # varlen: (batch + 1,) int32; the tensors then have batch 1
        max_seqlen_q: Int32,  # varlen: the longest sequence (the grid)
        stream: cuda.CUstream,
    ):
        # rows padded by 16 bytes rather than swizzled: the 2-element stores of the wgmma C layout
        # and the 128-bit row reads are both free of bank conflicts, for every head dim (the
        # DSL cannot partition a 96-column swizzled tile by the 48-column dQ fragments of d96)
        sdQ_layout = cute.make_layout((self.tile_m, self.head_dim), stride=(self.head_dim + 8, 1))

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdQ_layout)], 1024]

        # whole rows of 64 columns take 32 rows per pass of the 256 threads; an 80-row tile takes
        # rows of 128 (16 per pass), so no pass reads past the tile
        cols = self.head_dim if self.tile_m % (self.num_threads * 8 // 64) else None
        copy_store = sm80_common.gmem_tiled_copy(self.dtype, self.head_dim, self.num_threads, asynchronous=False,
                                                 cols=cols)
        mma_dq = dq_tiled_mma(self.dtype, self.tile_m, self.head_dim)
        varlen = const_expr(self.varlen)
        num_batches = mCuSeqlensQ.shape[0] - 1 if varlen else mdQ.shape[0]
        self.kernel(mdQ_accum, mdQ, mSemaphore, softmax_scale, mCuSeqlensQ, sdQ_layout, copy_store, mma_dq,
                    SharedStorage).launch(
            grid=(cute.ceil_div(max_seqlen_q if varlen else mdQ.shape[1], self.tile_m), cute.size(mdQ.shape[2]),
                  cute.size(num_batches)),
            block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mdQ_accum, mdQ, mSemaphore, softmax_scale: Float32, mCuSeqlensQ: cute.Tensor | None,
               sdQ_layout, copy_store: cute.TiledCopy, mma_dq: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        m_block, head, batch = cute.arch.block_idx()
        # (only the query side exists here: cu_seqlens_q stands in for the keys' too, unread)
        seq = SeqlenInfo(batch, mdQ.shape[1], mdQ.shape[1], mCuSeqlensQ, mCuSeqlensQ)
        tile = partial(self._tile, mdQ_accum, mdQ, mSemaphore, softmax_scale, sdQ_layout, copy_store, mma_dq,
                       SharedStorage, seq, m_block, head)
        if const_expr(self.varlen):
            if m_block * self.tile_m < seq.seqlen_q:  # the grid is sized for the longest sequence
                tile()
        else:
            tile()

    @cute.jit
    def _tile(self, mdQ_accum, mdQ, mSemaphore, softmax_scale: Float32, sdQ_layout, copy_store: cute.TiledCopy,
              mma_dq: cute.TiledMma, SharedStorage: cutlass.Constexpr, seq: SeqlenInfo, m_block: Int32, head: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        tile = (self.tile_m, self.head_dim)
        transposed = dq_transposed(self.tile_m)  # the slots hold dQ^T's fragments
        acc = cute.make_rmem_tensor(mma_dq.get_slice(tidx).partition_shape_C(
            (self.head_dim, self.tile_m) if const_expr(transposed) else tile), Float32)
        slots = dq_slot_copy(NUM_MMA_WARPGROUPS).get_slice(tidx).partition_S(
            dq_accum_slots(mdQ_accum, seq, head, m_block, self.tile_m, self.head_dim, NUM_MMA_WARPGROUPS))
        flat = cute.make_tensor(acc.iterator, cute.make_layout(slots.shape))
        acc.fill(0.0)
        if mSemaphore[seq.batch, head, m_block] != 0:
            cute.autovec_copy(slots, flat)
        acc.store(acc.load() * softmax_scale)
        rdQ = convert(acc, self.dtype)
        sdQ = cutlass.memory.SmemAllocator().allocate(SharedStorage).sdQ.get_tensor(sdQ_layout)
        gdQ = cute.local_tile(seq.q_rows(mdQ[seq.tensor_batch, None, head, None]), tile, (m_block, 0))
        sm80_common.store_acc_tile(rdQ, sdQ, mma_dq, copy_store, gdQ, tidx, seq.seqlen_q - m_block * self.tile_m,
                                   mdQ.shape[3], self.check_hdim, transposed=transposed)
