"""Which K/V blocks a Q block visits, and which of them need masking.

Causal attention is bottom-right aligned: query row i sees key j iff j <= i + seqlen_k - seqlen_q.
For a Q block [m*tile_m, (m+1)*tile_m) that means:
- K/V blocks at or past ``n_block_max`` are entirely above the diagonal (or past seqlen_k): skipped.
- blocks in [n_block_mask_start, n_block_max) cross the diagonal (or the seqlen_k end): masked.
- blocks below ``n_block_mask_start`` are fully visible: no mask at all.
The same functions serve the backward (seen from a K/V block: which Q blocks touch it).

A local (sliding-window) attention keeps, FlashAttention style, the keys j with
i' - window_left <= j <= i' + window_right, i' = i + seqlen_k - seqlen_q; ``None`` leaves a side
unbounded (a compile-time choice; the value itself may be a run-time integer), and causal means
window_right = 0. The left side adds ``n_block_min`` / ``n_block_left_mask_end`` (forward) and
``m_block_max`` / ``m_block_left_mask_start`` (backward).

Written with plain operators plus ``cutlass.min``/``max`` so they trace inside kernels and also run
on Python ints in the CPU tests.
"""

import cutlass


def _ceil_div(a, b):
    return (a + (b - 1)) // b


def _right(causal: bool, window_right):
    """The right window edge: 0 when causal, else ``window_right`` (None: unbounded)."""
    return 0 if causal else window_right


def _query_rows(m_block, tile_m: int, qhead_per_kvhead=None):
    """(first query, one past the last query) of Q block ``m_block``. With packed GQA
    (``qhead_per_kvhead``: the query heads per K/V head, a run-time value) tile row p holds query
    p // qhead_per_kvhead of head p % qhead_per_kvhead (kernels/sm80/forward.py)."""
    if qhead_per_kvhead is None:
        return m_block * tile_m, (m_block + 1) * tile_m
    return m_block * tile_m // qhead_per_kvhead, ((m_block + 1) * tile_m - 1) // qhead_per_kvhead + 1


def n_block_max(m_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, causal: bool, window_right=None,
                qhead_per_kvhead=None):
    """One past the last K/V block that Q block ``m_block`` sees (<= 0: it sees no key)."""
    n_max = _ceil_div(seqlen_k, tile_n)
    right = _right(causal, window_right)
    if right is not None:
        _, end = _query_rows(m_block, tile_m, qhead_per_kvhead)
        last_visible_key_plus_1 = end + seqlen_k - seqlen_q + right
        n_max = cutlass.min(n_max, _ceil_div(cutlass.max(last_visible_key_plus_1, 0), tile_n))
    return n_max


def n_block_mask_start(m_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, causal: bool, window_right=None,
                       qhead_per_kvhead=None):
    """First K/V block that needs the causal (right-window) mask: blocks below it are fully visible
    on that side to every row of the Q block. (The seqlen_k boundary block is always the first one
    processed and is masked too.)"""
    right = _right(causal, window_right)
    if right is not None:
        first, _ = _query_rows(m_block, tile_m, qhead_per_kvhead)
        first_row_last_key_plus_1 = first + seqlen_k - seqlen_q + right + 1
        return cutlass.max(first_row_last_key_plus_1, 0) // tile_n
    return n_block_max(m_block, tile_m, tile_n, seqlen_q, seqlen_k, causal)


def n_block_min(m_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, window_left=None, qhead_per_kvhead=None):
    """First K/V block that Q block ``m_block`` sees (0 without a left window)."""
    if window_left is None:
        return 0
    first, _ = _query_rows(m_block, tile_m, qhead_per_kvhead)
    first_row_first_key = first + seqlen_k - seqlen_q - window_left
    return cutlass.max(first_row_first_key, 0) // tile_n


def n_block_left_mask_end(m_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, window_left=None,
                          qhead_per_kvhead=None):
    """K/V blocks in [n_block_min, n_block_left_mask_end) hold keys that some row of the Q block has
    already left behind (left-window mask); from there on every row sees them on that side."""
    if window_left is None:
        return 0
    _, end = _query_rows(m_block, tile_m, qhead_per_kvhead)
    last_row_first_key = end - 1 + seqlen_k - seqlen_q - window_left
    return _ceil_div(cutlass.max(last_row_first_key, 0), tile_n)


def m_block_min(n_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, causal: bool, window_right=None):
    """Backward: first Q block that sees any key of K/V block ``n_block``."""
    right = _right(causal, window_right)
    if right is not None:
        # row i sees key n*tile_n iff i >= n*tile_n - (seqlen_k - seqlen_q) - right
        first_row = cutlass.max(n_block * tile_n - (seqlen_k - seqlen_q) - right, 0)
        return first_row // tile_m
    return 0


def m_block_mask_end(n_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, causal: bool, window_right=None):
    """Backward: Q blocks in [m_block_min, m_block_mask_end) cross the diagonal (right window edge)
    of K/V block ``n_block`` and need the mask; later Q blocks see the whole K/V block on that side."""
    right = _right(causal, window_right)
    if right is not None:
        # every row of a Q block sees the block's last key iff its first row >= last_key - offset - right
        last_key = (n_block + 1) * tile_n - 1
        first_full_row = cutlass.max(last_key - (seqlen_k - seqlen_q) - right, 0)
        return _ceil_div(first_full_row, tile_m)
    return 0


def m_block_max(n_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, window_left=None):
    """Backward: one past the last Q block that sees any key of K/V block ``n_block``."""
    num_m = _ceil_div(seqlen_q, tile_m)
    if window_left is None:
        return num_m
    # row i sees key j iff i <= j - (seqlen_k - seqlen_q) + window_left; j = the block's last key
    last_row_plus_1 = (n_block + 1) * tile_n - (seqlen_k - seqlen_q) + window_left
    return cutlass.min(num_m, _ceil_div(cutlass.max(last_row_plus_1, 0), tile_m))


def m_block_left_mask_start(n_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, window_left=None):
    """Backward: Q blocks from here to ``m_block_max`` have rows that left some key of K/V block
    ``n_block`` behind (left-window mask); earlier ones see its keys on that side."""
    if window_left is None:
        return _ceil_div(seqlen_q, tile_m)
    # a Q block is clear iff its last row still sees the block's first key n*tile_n
    clear_rows = n_block * tile_n - (seqlen_k - seqlen_q) + window_left + 1
    return cutlass.max(clear_rows, 0) // tile_m


def forward_walk(m_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, causal: bool, window_left=None,
                 window_right=None, at_least_one: bool = False, qhead_per_kvhead=None):
    """How Q block ``m_block`` walks its K/V blocks, from the last visible one down:
    (n_block_max, n_masked_right, n_unmasked, n_masked_left). The blocks are n_block_max - 1 down
    to n_block_max - (n_masked_right + n_unmasked + n_masked_left); the first n_masked_right cross
    the seqlen_k end or the right edge (causal diagonal / window), the last n_masked_left the
    window's left edge, the rest need no mask. The first block is always masked (it may end past
    seqlen_k). ``at_least_one``: a Q block that sees no key still runs one (fully masked) block,
    for kernels whose pipelines expect one (its rows end with O = 0, LSE = +inf).
    ``qhead_per_kvhead``: packed GQA rows (``_query_rows``)."""
    right = _right(causal, window_right)
    pack = qhead_per_kvhead
    n_max = n_block_max(m_block, tile_m, tile_n, seqlen_q, seqlen_k, causal, window_right, pack)
    n_min = n_block_min(m_block, tile_m, tile_n, seqlen_q, seqlen_k, window_left, pack)
    if at_least_one:
        n_max = cutlass.max(n_max, 1)
        n_min = cutlass.min(n_min, n_max - 1)
    total = cutlass.max(n_max - n_min, 0)
    n_right = cutlass.min(total, 1)
    if right is not None:
        mask_start = n_block_mask_start(m_block, tile_m, tile_n, seqlen_q, seqlen_k, causal, window_right, pack)
        n_right = cutlass.max(n_max - cutlass.max(mask_start, n_min), n_right)
    n_left = 0
    if window_left is not None:
        left_end = n_block_left_mask_end(m_block, tile_m, tile_n, seqlen_q, seqlen_k, window_left, pack)
        n_left = cutlass.max(cutlass.min(left_end, n_max - n_right) - n_min, 0)
    return n_max, n_right, total - n_right - n_left, n_left


def split_blocks(seqlen_k, tile_n: int, num_splits):
    """Split-KV: K/V blocks per split, so that ``num_splits`` splits cover this sequence's keys."""
    return _ceil_div(_ceil_div(seqlen_k, tile_n), num_splits)


def clip_walk(walk, n_lo, n_hi):
    """The part of a ``forward_walk`` within K/V blocks [n_lo, n_hi) (one split of split-KV), in
    the same form; empty (0 blocks) when they do not meet. The masked blocks stay masked: those
    crossing the right edge are the top of the walk, those crossing the left edge its bottom. An
    empty part still ends within [n_min, n_max] (a kernel's prologue loads the block below its end,
    which must lie within the keys)."""
    n_max, n_right, n_unmasked, n_left = walk
    n_min = n_max - n_right - n_unmasked - n_left
    lo = cutlass.min(cutlass.max(n_min, n_lo), n_max)
    hi = cutlass.max(cutlass.min(n_max, n_hi), lo)
    right = cutlass.max(hi - cutlass.max(n_max - n_right, lo), 0)
    left = cutlass.max(cutlass.min(n_min + n_left, hi - right) - lo, 0)
    return hi, right, hi - lo - right - left, left


def backward_walk(n_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, causal: bool, window_left=None,
                  window_right=None):
    """The Q blocks that see K/V block ``n_block``: (m_block_min, m_block_max, m_mask_right_end,
    m_mask_left_start). Q blocks below m_mask_right_end cross the right edge (causal diagonal /
    window), those from m_mask_left_start on the window's left edge; a K/V block that ends past
    seqlen_k needs the mask in every Q block."""
    m_min = m_block_min(n_block, tile_m, tile_n, seqlen_q, seqlen_k, causal, window_right)
    m_max = m_block_max(n_block, tile_m, tile_n, seqlen_q, seqlen_k, window_left)
    right_end = m_block_mask_end(n_block, tile_m, tile_n, seqlen_q, seqlen_k, causal, window_right)
    left_start = m_block_left_mask_start(n_block, tile_m, tile_n, seqlen_q, seqlen_k, window_left)
    return m_min, m_max, right_end, left_start


def dq_turn(m_block, n_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, window_left=None):
    """Deterministic backward: the place of K/V block ``n_block`` among the K/V blocks that add to
    Q block ``m_block``'s dQ, in increasing n_block order (the semaphore value it waits for)."""
    return n_block - n_block_min(m_block, tile_m, tile_n, seqlen_q, seqlen_k, window_left)
