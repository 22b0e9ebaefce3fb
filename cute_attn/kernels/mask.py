"""Masking of one S = Q K^T tile in registers: causal (bottom-right aligned) and the seqlen_k end.

Scores that a query must not see become -inf before the softmax. Only the blocks that
``block_info`` marks as crossing the diagonal or the seqlen_k end call this.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_attn.kernels.layout import acc_to_rows_cols


@cute.jit
def apply_mask(
    acc_S: cute.Tensor,
    tScS: cute.Tensor,
    tScS_thread0: cute.Tensor,
    m_block: Int32,
    n_block: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal: cutlass.Constexpr[bool],
):
    """Set the entries of ``acc_S`` that a query must not see to -inf.

    ``tScS`` holds each accumulator element's (row, col) within the tile for this thread and
    ``tScS_thread0`` the same for thread 0. Comparing thread 0's columns (compile-time constants)
    against a limit shifted by this thread's column offset leaves one compare and one select per
    element.
    """
    acc = acc_to_rows_cols(acc_S)
    coord = acc_to_rows_cols(tScS)
    coord0 = acc_to_rows_cols(tScS_thread0)
    # this thread's (row, col) offset from thread 0: the only run-time part of the coordinates
    row_offset = coord[0, 0][0] - coord0[0, 0][0]
    col_offset = coord[0, 0][1] - coord0[0, 0][1]
    k_base = n_block * tile_n
    seqlen_limit = seqlen_k - k_base - col_offset
    # key j is visible to query i iff j <= i + seqlen_k - seqlen_q (bottom-right aligned)
    causal_base = m_block * tile_m + row_offset + 1 + seqlen_k - seqlen_q - k_base - col_offset
    for r in cutlass.range_constexpr(cute.size(acc.shape[0])):
        # keys at tile column >= limit are past seqlen_k or above the diagonal
        limit = seqlen_limit
        if const_expr(causal):
            limit = cutlass.min(limit, causal_base + coord0[r, 0][0])
        for c in cutlass.range_constexpr(cute.size(acc.shape[1])):
            # a select, not an `if`: a run-time `if` that writes one element makes the compiler
            # carry the whole fragment through every branch (measured: ~16 selects per element)
            acc[r, c] = -Float32.inf if coord0[0, c][1] >= limit else acc[r, c]


@cute.jit
def apply_mask_transposed(
    acc_St: cute.Tensor,
    tScS: cute.Tensor,
    tScS_thread0: cute.Tensor,
    m_block: Int32,
    n_block: Int32,
    tile_m: cutlass.Constexpr[int],
    tile_n: cutlass.Constexpr[int],
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal: cutlass.Constexpr[bool],
):
    """``apply_mask`` for a transposed tile S^T = K Q^T (rows are keys, columns queries), as the
    SM90 backward computes it: the same visibility rule, the same one compare and one select per
    element against thread 0's compile-time column coordinates."""
    acc = acc_to_rows_cols(acc_St)
    coord = acc_to_rows_cols(tScS)
    coord0 = acc_to_rows_cols(tScS_thread0)
    row_offset = coord[0, 0][0] - coord0[0, 0][0]
    col_offset = coord[0, 0][1] - coord0[0, 0][1]
    key_base = n_block * tile_n + row_offset
    # query q sees key j iff j <= q + seqlen_k - seqlen_q, i.e. q >= j - (seqlen_k - seqlen_q)
    causal_base = key_base - (seqlen_k - seqlen_q) - m_block * tile_m - col_offset
    for r in cutlass.range_constexpr(cute.size(acc.shape[0])):
        # tile columns below ``limit`` cannot see this row's key; a key past seqlen_k hides from all
        limit = Int32(-1)
        if const_expr(causal):
            limit = causal_base + coord0[r, 0][0]
        limit = tile_m if key_base + coord0[r, 0][0] >= seqlen_k else limit
        for c in cutlass.range_constexpr(cute.size(acc.shape[1])):
            acc[r, c] = -Float32.inf if coord0[0, c][1] < limit else acc[r, c]
