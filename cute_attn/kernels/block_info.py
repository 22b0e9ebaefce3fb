"""Which K/V blocks a Q block visits, and which of them need masking.

Causal attention is bottom-right aligned: query row i sees key j iff j <= i + seqlen_k - seqlen_q.
For a Q block [m*tile_m, (m+1)*tile_m) that means:
- K/V blocks at or past ``n_block_max`` are entirely above the diagonal (or past seqlen_k): skipped.
- blocks in [n_block_mask_start, n_block_max) cross the diagonal (or the seqlen_k end): masked.
- blocks below ``n_block_mask_start`` are fully visible: no mask at all.
The same functions serve the backward (seen from a K/V block: which Q blocks touch it).

Written with plain operators plus ``cutlass.min``/``max`` so they trace inside kernels and also run
on Python ints in the CPU tests.
"""

import cutlass


def _ceil_div(a, b):
    return (a + (b - 1)) // b


def n_block_max(m_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, causal: bool):
    """One past the last K/V block that Q block ``m_block`` sees (<= 0: it sees no key)."""
    n_max = _ceil_div(seqlen_k, tile_n)
    if causal:
        last_visible_key_plus_1 = (m_block + 1) * tile_m + seqlen_k - seqlen_q
        n_max = cutlass.min(n_max, _ceil_div(cutlass.max(last_visible_key_plus_1, 0), tile_n))
    return n_max


def n_block_mask_start(m_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, causal: bool):
    """First K/V block that needs a causal mask: blocks below it are fully visible to every row of
    the Q block. (The seqlen_k boundary block is always the first one processed and is masked too.)"""
    if causal:
        first_row_last_key_plus_1 = m_block * tile_m + seqlen_k - seqlen_q + 1
        return cutlass.max(first_row_last_key_plus_1, 0) // tile_n
    return n_block_max(m_block, tile_m, tile_n, seqlen_q, seqlen_k, causal)


def m_block_min(n_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, causal: bool):
    """Backward: first Q block that sees any key of K/V block ``n_block``."""
    if causal:
        # row i sees key n*tile_n iff i >= n*tile_n - (seqlen_k - seqlen_q)
        first_row = cutlass.max(n_block * tile_n - (seqlen_k - seqlen_q), 0)
        return first_row // tile_m
    return 0


def m_block_mask_end(n_block, tile_m: int, tile_n: int, seqlen_q, seqlen_k, causal: bool):
    """Backward: Q blocks in [m_block_min, m_block_mask_end) cross the diagonal of K/V block
    ``n_block`` and need the causal mask; later Q blocks see the whole K/V block."""
    if causal:
        # every row of a Q block sees the block's last key iff its first row >= last_key - offset
        last_key = (n_block + 1) * tile_n - 1
        first_full_row = cutlass.max(last_key - (seqlen_k - seqlen_q), 0)
        return _ceil_div(first_full_row, tile_m)
    return 0
