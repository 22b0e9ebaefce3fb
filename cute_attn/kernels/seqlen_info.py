"""Where one sequence of a batch lives in the tensors, and how long it is (dense or varlen).

Dense batches: q (batch, seqlen_q, heads, d), every sequence seqlen_q rows long, at row 0 of its
batch index. Variable-length batches (FlashAttention's varlen layout) come packed: the host views
q (total_q, heads, d) as (1, total_q, heads, d) and passes ``cu_seqlens_q`` (batch + 1 int32
offsets); sequence b holds rows cu_seqlens_q[b] : cu_seqlens_q[b + 1] of batch index 0. K/V the
same with cu_seqlens_k; the LSE is (1, heads, total_q).

The backward's fp32 row buffers (LSE in log2, D, the dQ accumulator) are written and read in whole
Q blocks, so in varlen each sequence starts there at a row padded to ``VARLEN_ROW_PAD``:
``padded_offset_q(b) = (cu_seqlens_q[b] + b * PAD) // PAD * PAD``. Consecutive sequences then own
disjoint whole blocks of every tile_m dividing PAD, and the buffers hold
``total_q + batch * PAD`` rows (rounded up to PAD) (``varlen_padded_rows``).

Per-sequence key counts (``mSeqUsedK``, (batch,) int32): in varlen, FlashAttention-3's seqused_k
(sequence b attends to rows cu_seqlens_k[b] : cu_seqlens_k[b] + seqused_k[b]); in a KV cache (the
``kvcache`` feature, dense batches only) sequence b's keys are rows cache_leftpad[b] :
cache_seqlens[b] of cache batch row cache_batch_idx[b] (``mSeqUsedK``, ``mLeftPadK``,
``mKVBatchIdx``).

``SeqlenInfo`` is read once per tile by every kernel; a dense kernel gets plain Python zeros for
the offsets, so its code is what it was before varlen existed.
"""

import cutlass.cute as cute
from cutlass import Int32, const_expr

# every kernel's tile_m (64 or 128) and the preprocess' divide it (host-side sizes live in traits)
from cute_attn.traits import VARLEN_ROW_PAD, varlen_padded_rows  # noqa: F401


class SeqlenInfo:
    """Sequence ``batch``'s lengths and row offsets. ``mCuSeqlensQ``/``mCuSeqlensK`` None: dense,
    the lengths are the tensors' (``seqlen_q_static``/``seqlen_k_static``)."""

    def __init__(self, batch, seqlen_q_static, seqlen_k_static, mCuSeqlensQ=None, mCuSeqlensK=None,
                 mSeqUsedK=None, mLeftPadK=None, mKVBatchIdx=None):
        self.varlen = mCuSeqlensQ is not None
        self.batch = batch
        if const_expr(self.varlen):
            self.offset_q = mCuSeqlensQ[batch]
            self.offset_k = mCuSeqlensK[batch]
            self.seqlen_q = mCuSeqlensQ[batch + 1] - self.offset_q
            self.seqlen_k = mCuSeqlensK[batch + 1] - self.offset_k
            padded = (self.offset_q + batch * VARLEN_ROW_PAD) // VARLEN_ROW_PAD * VARLEN_ROW_PAD
            self.padded_offset_q = cute.assume(padded, divby=VARLEN_ROW_PAD)
            self.tensor_batch = Int32(0)  # the packed tensors have one batch index
        else:
            self.offset_q = self.offset_k = self.padded_offset_q = 0
            self.seqlen_q, self.seqlen_k = seqlen_q_static, seqlen_k_static
            self.tensor_batch = batch
        self.kv_batch = self.tensor_batch  # K/V's batch index
        self.shift_k = self.varlen
        if const_expr(self.varlen and mSeqUsedK is not None):  # seqused_k: the keys used
            self.seqlen_k = mSeqUsedK[batch]
        elif const_expr(mSeqUsedK is not None):  # a KV cache (dense batch)
            self.offset_k = mLeftPadK[batch]
            self.seqlen_k = mSeqUsedK[batch] - self.offset_k
            self.kv_batch = mKVBatchIdx[batch]
            self.shift_k = True

    # Tensors of one (batch, head) with the sequence mode first: shift it to the sequence's first row.
    def q_rows(self, mX: cute.Tensor) -> cute.Tensor:
        """``mX`` (seqlen_q, ...) of this batch index, from the sequence's first query."""
        return _shift(mX, self.offset_q, self.varlen)

    def k_rows(self, mX: cute.Tensor) -> cute.Tensor:
        """``mX`` (seqlen_k, ...) of this batch index, from the sequence's first key."""
        return _shift(mX, self.offset_k, self.shift_k)

    def padded_q_rows(self, mX: cute.Tensor) -> cute.Tensor:
        """A backward row buffer (seqlen_q_padded, ...) from the sequence's first padded row."""
        return _shift(mX, self.padded_offset_q, self.varlen)

    # The SM90 kernels' TMA tensors (seqlen, head_dim, heads, batch), varlen ones through ragged
    # views (below): one head's (seqlen, head_dim) rows of this sequence. ``load``: a tensor of
    # ``ragged_load_view`` (zeros past the sequence's rows), else of ``ragged_view`` (stores clip there).
    def tma_q_rows(self, mX: cute.Tensor, head, load: bool = True) -> cute.Tensor:
        return self._tma_rows(mX, head, self.offset_q, self.seqlen_q, load)

    def tma_k_rows(self, mX: cute.Tensor, head, load: bool = True) -> cute.Tensor:
        return self._tma_rows(mX, head, self.offset_k, self.seqlen_k, load)

    def _tma_rows(self, mX: cute.Tensor, head, offset, length, load: bool) -> cute.Tensor:
        if const_expr(not self.varlen):
            return mX[None, None, head, self.tensor_batch]
        if const_expr(load):
            return ragged_load_rows(mX[None, None, head, None, None], offset, length)
        return ragged_rows(mX[None, None, head, self.tensor_batch, None], offset, length)


def _shift(mX: cute.Tensor, offset, varlen: bool) -> cute.Tensor:
    if const_expr(not varlen):
        return mX
    return cute.domain_offset((offset,) + (None,) * (cute.rank(mX) - 1), mX)


# ---------------------------------------------------------------------------- TMA stores in varlen
# A TMA store clips rows at the tensor's extent, which in a packed batch is the end of the whole
# batch, not of one sequence: a partial last tile would overwrite the next sequence's first rows.
# ``ragged_view`` (host side) rebuilds a (seqlen, ...) tensor with a huge sequence extent RAGGED,
# its pointer moved back by RAGGED rows, and one more mode of the row stride; ``ragged_rows``
# (device side) picks, for a sequence of ``length`` rows at ``offset``, index offset + length in
# that extra mode and starts the sequence mode at RAGGED - length. Row r of the sequence then has
# coordinate RAGGED - length + r (in bounds iff r < length) at address
# base - RAGGED + (RAGGED - length + r) + (offset + length) = base + offset + r rows.
RAGGED = 2**30
_RAGGED_EXTRA = 2**31 - 1


def ragged_view(mX: cute.Tensor) -> cute.Tensor:
    """``mX`` (seqlen, ...) of rank <= 4 with the extra mode; build the TMA atom from this."""
    shape = (RAGGED,) + tuple(mX.shape[1:]) + (_RAGGED_EXTRA,)
    stride = tuple(mX.stride) + (mX.stride[0],)
    base = cute.domain_offset((-RAGGED,) + (None,) * (cute.rank(mX) - 1), mX).iterator
    return cute.make_tensor(base, cute.make_layout(shape, stride=stride))


def ragged_rows(mX: cute.Tensor, offset: Int32, length: Int32) -> cute.Tensor:
    """The TMA tensor of a ``ragged_view``, as the ``length`` rows from ``offset``: (RAGGED, ...)
    whose coordinates past ``length`` are out of bounds."""
    rank = cute.rank(mX)
    picked = mX[(None,) * (rank - 1) + (offset + length,)]
    return cute.domain_offset((RAGGED - length,) + (None,) * (rank - 2), picked)


# ---------------------------------------------------------------------------- TMA loads in varlen
# A load through ``ragged_view`` has TMA start from the moved-back pointer, which must lie in
# mapped memory (on the H100 it faulted where a sequence has no keys), so loads take the variant
# with two extra modes and the pointer left in place: a (seqlen, d, heads) tensor becomes
# (RAGGED, d, heads, EXTRA, EXTRA) with strides (s, ..., 2^34 - s, s), s the row stride. Row r of
# the sequence of ``length`` rows at ``offset`` has coordinates RAGGED - length + r, RAGGED and
# offset + length in those three modes, at address base + (RAGGED - length + r) * s + RAGGED *
# (2^34 - s) + (offset + length) * s = base + 2^64 + (offset + r) * s elements, which wraps to
# base + (offset + r) * s (the byte offset is a multiple of 2^64 for any element size); rows past
# ``length`` are out of bounds, read as zeros. (quack's copy_utils, after Triton's ragged TMA.)
_WRAP = 2**34  # RAGGED * _WRAP = 2^64


def ragged_load_view(mX: cute.Tensor) -> cute.Tensor:
    """``mX`` (seqlen, ...) of rank <= 3 with the two extra modes; build the TMA load atom from this."""
    shape = (RAGGED,) + tuple(mX.shape[1:]) + (_RAGGED_EXTRA, _RAGGED_EXTRA)
    stride = tuple(mX.stride) + (_WRAP - mX.stride[0], mX.stride[0])
    return cute.make_tensor(mX.iterator, cute.make_layout(shape, stride=stride))


def ragged_load_rows(mX: cute.Tensor, offset: Int32, length: Int32) -> cute.Tensor:
    """The TMA tensor of a ``ragged_load_view`` (after any other modes are indexed), as the
    ``length`` rows from ``offset``: (RAGGED, ...) whose coordinates past ``length`` are out of
    bounds (zeros), even where ``length`` is 0."""
    rank = cute.rank(mX)
    picked = mX[(None,) * (rank - 2) + (RAGGED, offset + length)]
    return cute.domain_offset((RAGGED - length,) + (None,) * (rank - 3), picked)

