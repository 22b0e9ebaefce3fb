"""Which (Q block, head, batch) tile a CTA of a 1-D grid computes, and in which order.

Tiles are numbered head by head (Q block fastest, then head, then batch), so the tiles running at
any moment share the K and V of a few heads in L2.

Causal tiles differ in length (the last Q block sees the most keys), so they run longest first
(longest-processing-time, the FlashAttention-3 idea): the long tiles start early and the short
ones fill the tail. Over all heads at once that would stream every head's K and V through L2
once per Q block, so the (batch, head) pairs are cut into sections of ``heads_per_section`` and
the longest-first order runs inside each section. The host picks the section (a kernel argument):
- one CTA per tile (the hardware launches them in order): K and V of a section's heads within an
  L2 budget (``heads_per_section``);
- a persistent grid, which deals the tiles out statically round by round (``nth_tile``): a
  section of one head. Measured on H100 (docs/performance.md), wider sections there lost up to
  30% at d128 causal S 1024-8192: each round then held the same Q block of many heads, which
  re-read K and V from DRAM (ncu: 1.4x the bytes Q, K, V and O occupy) and dealt unequal work.
"""

import cutlass
from cutlass import Int32

# the host's choice of the section (free of the DSL, with the other host-side sizes)
from cute_attn.traits import L2_BYTES_FOR_KV, heads_per_section  # noqa: F401


def tile_coords(block: Int32, num_m_blocks: Int32, heads: Int32, batch: Int32, section: Int32):
    """(m_block, head, batch) of tile number ``block`` in longest-first order within sections of
    ``section`` (batch, head) pairs; a section of 1 is head by head, last Q block first."""
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
