"""What happens to one S = Q K^T tile in registers between the GEMM and the softmax.

In this order, FlashAttention-2's (and the reference's) semantics:
1. softcap (``apply_softcap``): S = tanh(S * softmax_scale / softcap); the host then runs the
   softmax with scale softcap, so the scores are softcap * tanh(S * scale / softcap).
2. ALiBi: the bias -slope * |i' - j| (i' = i + seqlen_k - seqlen_q) in score units, added in the
   units of S (the slope divided by the softmax's scale: ``alibi_slope_units``).
3. masks: keys a query must not see become -inf: past seqlen_k; causal (j <= i'); a local window
   (i' - window_left <= j <= i' + window_right). Only the blocks that ``block_info`` marks as
   crossing an edge call the masks (``check_bounds``); ALiBi applies to every block.

Every option is a compile-time choice (None: absent), so a kernel without them compiles to what
it was before they existed. The window edges themselves are run-time integers (an unbounded side
of a local window is a huge value, see interface._window_args).
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_attn.kernels.layout import acc_to_rows_cols

LOG2E = math.log2(math.e)


@cute.jit
def apply_softcap(acc_S: cute.Tensor, softcap_scale: Float32, dtanh: cute.Tensor = None):
    """S = tanh(S * softcap_scale) in place; with ``dtanh`` (a fragment like ``acc_S``) also
    1 - tanh^2, the derivative the backward multiplies dS by.

    The hardware's one-instruction ``tanh.approx.f32`` (relative error <= 2^-11, so a softcap-30
    score moves by at most ~0.015, less than bf16's rounding of that score), as FlashAttention 2-4
    use: one MUFU operation per score beside the softmax's exp2. The accurate form
    1 - 2 / (exp2(2x log2 e) + 1) costs two (exp2, rcp) and measured 37% slower forward than no
    softcap (docs/performance.md)."""
    for i in cutlass.range_constexpr(cute.size(acc_S)):
        t = cute.math.tanh(acc_S[i] * softcap_scale, approx=True)
        acc_S[i] = t
        if const_expr(dtanh is not None):
            dtanh[i] = 1.0 - t * t


def alibi_slope_units(mAlibiSlopes: cute.Tensor, batch, head, softmax_scale_log2: Float32) -> Float32:
    """The ALiBi slope of (batch, head) in units of S: slope / scale, where the softmax computes
    exp2(S * scale * log2(e)) (scale: softmax_scale, or softcap with a softcap). ``mAlibiSlopes``
    is (batch, heads), with batch stride 0 for slopes shared by the whole batch."""
    return mAlibiSlopes[batch, head] * LOG2E / softmax_scale_log2


@cute.jit
def _add_alibi(acc: cute.Tensor, coord0: cute.Tensor, r: cutlass.Constexpr[int], diag_r: Int32, alibi_slope: Float32):
    """Row ``r`` of a (rows, cols) accumulator view += -slope * |diagonal - column|: ``diag_r`` is
    the column (in thread 0's coordinates) where this row's query and key coincide (i' = j)."""
    for c in cutlass.range_constexpr(cute.size(acc.shape[1])):
        acc[r, c] = acc[r, c] - alibi_slope * Float32(cutlass.max(diag_r - coord0[0, c][1], coord0[0, c][1] - diag_r))


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
    window_left=None,
    window_right=None,
    alibi_slope=None,
    check_bounds: cutlass.Constexpr[bool] = True,
    qhead_per_kvhead=None,
    rows_per_head=None,
):
    """ALiBi (when ``alibi_slope`` is given) and, with ``check_bounds``, the masks, on ``acc_S``
    (rows: queries, columns: keys). ``window_left``/``window_right``: a local window's run-time
    edges (None: none; causal is its own flag). ``qhead_per_kvhead``: packed GQA rows, tile row p
    is query p // qhead_per_kvhead (block_info._query_rows). ``rows_per_head``: the SM90 forward's
    packed GQA, tile row p is query m_block * rows_per_head + p % rows_per_head.

    ``tScS`` holds each accumulator element's (row, col) within the tile for this thread and
    ``tScS_thread0`` the same for thread 0. Comparing thread 0's columns (compile-time constants)
    against a limit shifted by this thread's column offset leaves one compare and one select per
    element and mask.
    """
    acc = acc_to_rows_cols(acc_S)
    coord = acc_to_rows_cols(tScS)
    coord0 = acc_to_rows_cols(tScS_thread0)
    # this thread's (row, col) offset from thread 0: the only run-time part of the coordinates
    row_offset = coord[0, 0][0] - coord0[0, 0][0]
    col_offset = coord[0, 0][1] - coord0[0, 0][1]
    k_base = n_block * tile_n
    seqlen_limit = seqlen_k - k_base - col_offset
    # the diagonal key i' = i + seqlen_k - seqlen_q of this thread's row r, in thread 0's column
    # coordinates: diagonal + coord0[r, 0][0]
    diagonal = m_block * tile_m + row_offset + seqlen_k - seqlen_q - k_base - col_offset
    for r in cutlass.range_constexpr(cute.size(acc.shape[0])):
        if const_expr(rows_per_head is not None):
            query = m_block * rows_per_head + (row_offset + coord0[r, 0][0]) % rows_per_head
            diag_r = query + seqlen_k - seqlen_q - k_base - col_offset
        elif const_expr(qhead_per_kvhead is None):
            diag_r = diagonal + coord0[r, 0][0]
        else:
            query = (m_block * tile_m + row_offset + coord0[r, 0][0]) // qhead_per_kvhead
            diag_r = query + seqlen_k - seqlen_q - k_base - col_offset
        if const_expr(alibi_slope is not None):
            _add_alibi(acc, coord0, r, diag_r, alibi_slope)
        if const_expr(check_bounds):
            # keys at tile column >= limit are past seqlen_k or right of the diagonal / window
            limit = seqlen_limit
            if const_expr(causal):
                limit = cutlass.min(limit, diag_r + 1)
            if const_expr(window_right is not None):
                limit = cutlass.min(limit, diag_r + window_right + 1)
            for c in cutlass.range_constexpr(cute.size(acc.shape[1])):
                # a select, not an `if`: a run-time `if` that writes one element makes the compiler
                # carry the whole fragment through every branch (measured: ~16 selects per element)
                acc[r, c] = -Float32.inf if coord0[0, c][1] >= limit else acc[r, c]
            if const_expr(window_left is not None):
                low = diag_r - window_left  # keys left of the window
                for c in cutlass.range_constexpr(cute.size(acc.shape[1])):
                    acc[r, c] = -Float32.inf if coord0[0, c][1] < low else acc[r, c]


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
    window_left=None,
    window_right=None,
    alibi_slope=None,
    check_bounds: cutlass.Constexpr[bool] = True,
):
    """``apply_mask`` for a transposed tile S^T = K Q^T (rows are keys, columns queries), as the
    SM90 backward computes it: the same visibility rule and bias, one compare and one select per
    element and mask against thread 0's compile-time column coordinates. (Per-row bit words read
    by ``R2P``, FlashAttention-4's way, issue fewer instructions here but measured 0.5-2% slower:
    docs/performance.md, "Fewer mask instructions in the backward's loop".)"""
    acc = acc_to_rows_cols(acc_St)
    coord = acc_to_rows_cols(tScS)
    coord0 = acc_to_rows_cols(tScS_thread0)
    row_offset = coord[0, 0][0] - coord0[0, 0][0]
    col_offset = coord[0, 0][1] - coord0[0, 0][1]
    key_base = n_block * tile_n + row_offset
    # query q has key j on its diagonal iff q = j - (seqlen_k - seqlen_q): that query's column for
    # this thread's row r is diagonal + coord0[r, 0][0] (in thread 0's column coordinates)
    diagonal = key_base - (seqlen_k - seqlen_q) - m_block * tile_m - col_offset
    for r in cutlass.range_constexpr(cute.size(acc.shape[0])):
        diag_r = diagonal + coord0[r, 0][0]
        if const_expr(alibi_slope is not None):
            _add_alibi(acc, coord0, r, diag_r, alibi_slope)
        if const_expr(check_bounds):
            # tile columns below ``limit`` cannot see this row's key; a key past seqlen_k hides from all
            limit = Int32(-1)
            if const_expr(causal):
                limit = diag_r
            if const_expr(window_right is not None):
                limit = diag_r - window_right
            limit = tile_m if key_base + coord0[r, 0][0] >= seqlen_k else limit
            for c in cutlass.range_constexpr(cute.size(acc.shape[1])):
                acc[r, c] = -Float32.inf if coord0[0, c][1] < limit else acc[r, c]
            if const_expr(window_left is not None):
                high = diag_r + window_left  # queries whose window has left this key behind
                for c in cutlass.range_constexpr(cute.size(acc.shape[1])):
                    acc[r, c] = -Float32.inf if coord0[0, c][1] > high else acc[r, c]


@cute.jit
def apply_score_mods(
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
    softcap_scale=None,
    window_left=None,
    window_right=None,
    alibi_slope=None,
    check_bounds: cutlass.Constexpr[bool] = True,
    qhead_per_kvhead=None,
    rows_per_head=None,
):
    """The forward kernels' whole step between the S GEMM and the softmax: softcap (when
    ``softcap_scale`` is given), then ALiBi and (``check_bounds``) the masks; nothing at all for an
    unmasked block of a kernel without softcap and ALiBi."""
    if const_expr(softcap_scale is not None):
        apply_softcap(acc_S, softcap_scale)
    if const_expr(check_bounds or alibi_slope is not None):
        apply_mask(acc_S, tScS, tScS_thread0, m_block, n_block, tile_m, tile_n, seqlen_q, seqlen_k, causal,
                   window_left, window_right, alibi_slope, check_bounds, qhead_per_kvhead, rows_per_head)
