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
import cutlass.cute as cute
from cutlass import Int32, const_expr

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


# A varlen tile number past the last tile of the batch decodes to this Q block, beyond any
# sequence's end.
PAST_THE_LAST_TILE = 1 << 20

# Non-causal varlen tiles are numbered without holes (no tile past a sequence's end), from
# cu_seqlens_q in the kernel: the functions below are called by a whole warp (convergent), each
# lane reading the length of one of 32 sequences at a time. (Causal varlen keeps the dense
# longest-first order over the longest sequence's Q blocks, skipping the tiles past a sequence's
# end: measured faster on H100 than numbering its tiles without holes, sequence by sequence or
# level by level; docs/performance.md.)


@cute.jit
def q_blocks(mCuSeqlensQ: cute.Tensor, b: Int32, batches: Int32, tile_m: cutlass.Constexpr[int]):
    """Q blocks of sequence ``b`` (0 past the batch)."""
    seqlen = Int32(0)
    if b < batches:
        seqlen = mCuSeqlensQ[b + 1] - mCuSeqlensQ[b]
    return (seqlen + (tile_m - 1)) // tile_m


@cute.jit
def varlen_q_blocks(mCuSeqlensQ: cute.Tensor, batches: Int32, tile_m: cutlass.Constexpr[int]):
    """The Q blocks of all the batch's sequences (the tiles of one head)."""
    lane = cute.arch.lane_idx()
    total = Int32(0)
    group = Int32(0)
    while group < batches:
        total += cute.arch.warp_redux_sync(q_blocks(mCuSeqlensQ, group + lane, batches, tile_m), "add")
        group += 32
    return total


@cute.jit
def varlen_tile_coords(tile: Int32, mCuSeqlensQ: cute.Tensor, tile_m: cutlass.Constexpr[int], heads: Int32,
                       batches: Int32):
    """(m_block, head, batch) of tile number ``tile`` of a varlen batch in sequence order: sequence
    by sequence, head by head, Q block by Q block (the non-causal tiles are alike). The tile's
    sequence is found with a prefix sum over 32 sequences' tile counts at a time. A tile past the
    batch's last tile gets m_block PAST_THE_LAST_TILE (batch 0, head 0)."""
    lane = cute.arch.lane_idx()
    first_tile = Int32(0)  # the first tile of the group of sequences at hand
    group = Int32(0)  # its first sequence
    batch = Int32(0)
    local = Int32(0)  # tile's number within its sequence
    blocks = Int32(0)  # Q blocks of the tile's sequence
    found = Int32(0)
    while (group < batches) & (found == 0):
        nb = q_blocks(mCuSeqlensQ, group + lane, batches, tile_m)
        tiles_incl = nb * heads
        for i in cutlass.range_constexpr(5):  # inclusive prefix sum over the warp
            other = cute.arch.shuffle_sync_up(tiles_incl, offset=1 << i, mask_and_clamp=0)
            if lane >= (1 << i):
                tiles_incl += other
        group_tiles = cute.arch.shuffle_sync(tiles_incl, 31)
        if tile < first_tile + group_tiles:
            # lanes whose sequences end at or before the tile: the tile's sequence is the next one
            index = cute.arch.popc(cute.arch.vote_ballot_sync(first_tile + tiles_incl <= tile))
            before = cute.arch.shuffle_sync(tiles_incl - nb * heads, index)
            blocks = cute.arch.shuffle_sync(nb, index)
            batch = group + index
            local = tile - first_tile - before
            found = Int32(1)
        else:
            first_tile += group_tiles
            group += 32
    m_block, head = Int32(PAST_THE_LAST_TILE), Int32(0)
    if found != 0:
        head = local // blocks
        m_block = local - head * blocks
    else:
        batch = Int32(0)
    return m_block, head, batch
