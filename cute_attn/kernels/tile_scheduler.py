"""Which (Q block, head, batch) tile a CTA of a 1-D grid computes.

Longest-processing-time first, L2-aware (the FlashAttention-3 idea): with causal masking the last
Q blocks see the most keys, so every head's last Q block is launched before any head's
second-to-last, and so on; the short tiles fill the tail of the grid instead of the long ones.
Done over all heads at once, that would stream every head's K and V through L2 once per Q
block, so the (batch, head) pairs are cut into sections of ``heads_per_section`` whose K and V fit
in L2 together, and the LPT order runs inside each section.

A persistent grid deals the numbered tiles out round by round (``nth_tile``).
"""

import cutlass
from cutlass import Int32

# of H100's 50 MB L2 (two 25 MB halves), what one section's K and V may take
L2_BYTES_FOR_KV = 32 * 1024 * 1024


def heads_per_section(seqlen_k, head_dim: int, elem_bytes: int):
    """How many heads' K and V fit in the L2 budget together (at least 1). Host side, traced."""
    kv_bytes = cutlass.Int64(seqlen_k) * (2 * head_dim * elem_bytes)
    return Int32(cutlass.max(cutlass.Int64(L2_BYTES_FOR_KV) // cutlass.max(kv_bytes, 1), 1))


def tile_coords(block: Int32, num_m_blocks: Int32, heads: Int32, batch: Int32, section: Int32):
    """(m_block, head, batch) of tile number ``block`` in longest-first order."""
    pairs = heads * batch
    section_blocks = section * num_m_blocks
    index = block // section_blocks
    width = cutlass.min(section, pairs - index * section)  # the last section may hold fewer pairs
    rest = block - index * section_blocks
    m_index = rest // width
    pair = index * section + (rest - m_index * width)
    return num_m_blocks - 1 - m_index, pair % heads, pair // heads


def nth_tile(r, cta, grid):
    """Tile number of CTA ``cta``'s r-th round in a grid of ``grid`` CTAs. Round r covers tiles
    [r * grid, (r + 1) * grid), dealt in alternating directions (a snake), so that with tiles in
    longest-first order the CTA that got one round's longest tile gets the next round's shortest.
    Increasing in r, so a CTA stops at its first tile number past the end."""
    return r * grid + cta + (r % 2) * (grid - 1 - 2 * cta)
