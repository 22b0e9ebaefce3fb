"""Which (Q block, head, batch) tile a CTA of a 1-D grid computes, and in which order.

Tiles are numbered head by head (Q block fastest, then head, then batch), so the tiles running at
any moment share the K and V of a few heads in L2.

Causal tiles differ in length (the last Q block sees the most keys), so they run longest first
(longest-processing-time, the FlashAttention-3 idea): the long tiles start early and the short
ones fill the tail. Over all heads at once that would stream every head's K and V through L2
once per Q block, so the (batch, head) pairs are cut into sections of ``heads_per_section`` and
the longest-first order runs inside each section. The host picks the section (a kernel argument):
- one CTA per tile (the hardware launches them in order), or a persistent grid whose CTAs take
  the tiles in order from an atomic counter (the SM90 forward's ``dynamic_tiles``): K and V of a
  section's heads within an L2 budget (``heads_per_section``);
- a persistent grid, which deals the tiles out statically round by round (``nth_tile``): a
  section of one head. Measured on H100 (docs/performance.md), wider sections there lost up to
  30% at d128 causal S 1024-8192: each round then held the same Q block of many heads, which
  re-read K and V from DRAM (ncu: 1.4x the bytes Q, K, V and O occupy) and dealt unequal work.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

# the host's choice of the section (free of the DSL, with the other host-side sizes)
from cute_attn.traits import L2_BYTES_FOR_KV, heads_per_section  # noqa: F401


def section_row(block: Int32, num_blocks: Int32, heads: Int32, batch: Int32, section: Int32):
    """Where number ``block`` sits when the (batch, head) pairs are cut into sections of ``section``
    pairs and each section runs its pairs' k-th blocks side by side: (the section's first number,
    its first pair, its width in pairs, the row k, the pair). Plain operators (min aside): runs on
    Python ints in the CPU tests."""
    pairs = heads * batch
    section_blocks = section * num_blocks
    index = block // section_blocks
    first_pair = index * section
    width = cutlass.min(section, pairs - first_pair)  # the last section may hold fewer pairs
    rest = block - index * section_blocks
    k = rest // width
    return index * section_blocks, first_pair, width, k, first_pair + (rest - k * width)


def section_coords(block: Int32, num_blocks: Int32, heads: Int32, batch: Int32, section: Int32,
                   reverse: bool = False):
    """(k, head, batch) of number ``block`` in sections of ``section`` pairs (``section_row``),
    k = 0, 1, ... (``reverse``: k = num_blocks - 1, num_blocks - 2, ...)."""
    _, _, _, k, pair = section_row(block, num_blocks, heads, batch, section)
    return num_blocks - 1 - k if reverse else k, pair % heads, pair // heads


def section_batches(block: Int32, num_blocks: Int32, heads: Int32, batch: Int32, section: Int32):
    """(first, last) batch of the pairs in number ``block``'s section."""
    _, first_pair, width, _, _ = section_row(block, num_blocks, heads, batch, section)
    return first_pair // heads, (first_pair + width - 1) // heads


def tile_holes_end(block: Int32, num_blocks: Int32, heads: Int32, batch: Int32, section: Int32,
                   section_m_blocks: Int32):
    """Varlen in ``tile_coords``' order, ``block`` a tile past its sequence's end: the first number
    after it that may not be one (all numbers in between are past their sequences' ends too). The
    rest of its batch's pairs in its row are (the same Q block of the same sequence), and so is
    every row of a Q block that no sequence of the section reaches (``section_m_blocks``: the
    section's longest sequence in Q blocks). A batch of a few long sequences among many short ones
    has rows upon rows of such numbers (a chunk of 4096 queries and 31 decode rows: ~28k), which a
    dynamic deal would otherwise hand out one atomic at a time."""
    start, first_pair, width, k, pair = section_row(block, num_blocks, heads, batch, section)
    row = start + k * width
    end = row + cutlass.min((pair // heads + 1) * heads, first_pair + width) - first_pair
    # (the rows before the section's longest Q block end there; from that row on, this bound is
    # below ``end`` already)
    return cutlass.max(end, start + (num_blocks - section_m_blocks) * width)


def pair_holes_end(block: Int32, num_blocks: Int32):
    """Varlen in Q-block-fastest order (pair = block // num_blocks), ``block`` a tile past its
    sequence's end: the first number after the rest of its (batch, head)'s blocks. (Skipping a
    sequence without queries whole, every head at once, spilled registers in the kernels of a
    static deal.)"""
    return (block // num_blocks + 1) * num_blocks


def tile_coords(block: Int32, num_m_blocks: Int32, heads: Int32, batch: Int32, section: Int32):
    """(m_block, head, batch) of tile number ``block`` in longest-first order within sections of
    ``section`` (batch, head) pairs; a section of 1 is head by head, last Q block first."""
    return section_coords(block, num_m_blocks, heads, batch, section, reverse=True)


# The SM90 backward's causal CTAs (one per K/V block; block 0 visits the most Q blocks) can run the
# same longest-first order (traits: longest_first). In the grid's own order (K/V block fastest) the
# last head's block 0 starts near the end; a list-scheduling model put that tail at ~6% at d128
# S 512-8192, but on the H100 sections of 1 and 4 heads ran alike (docs/performance.md). A
# section's query heads keep their Q and dO (2 bytes each) and the fp32 dQ accumulator in the L2
# budget, 8 bytes per element.
BACKWARD_BYTES_PER_Q_ELEMENT = 8


def backward_heads_per_section(seqlen_q: Int32, qheads_per_kvhead: Int32, head_dim: int):
    """(batch, K/V head) pairs per section of the backward's causal order (at least 1): as many as
    fit their query heads' Q, dO and dQ accumulator in ``L2_BYTES_FOR_KV``. (With the query heads
    split over CTAs, a pair is a (batch, K/V head split) and ``qheads_per_kvhead`` its share.)"""
    rows = L2_BYTES_FOR_KV // (BACKWARD_BYTES_PER_Q_ELEMENT * head_dim) // qheads_per_kvhead
    return cutlass.max(rows // cutlass.max(seqlen_q, 1), 1)


def nth_tile(r, cta, grid):
    """Tile number of CTA ``cta``'s r-th round in a grid of ``grid`` CTAs. Round r covers tiles
    [r * grid, (r + 1) * grid), dealt in alternating directions (a snake), so that with tiles in
    longest-first order the CTA that got one round's longest tile gets the next round's shortest.
    Increasing in r, so a CTA stops at its first tile number past the end."""
    return r * grid + cta + (r % 2) * (grid - 1 - 2 * cta)


# Non-causal varlen batches of up to VARLEN_COMPACT_BATCH sequences number their tiles without
# holes (no tile past a sequence's end), from cu_seqlens_q in the kernel: a lane per sequence, so
# one warp pass (called by a whole warp, convergent). Larger batches, and causal ones, keep the
# dense order over the longest sequence's Q blocks and skip the tiles past a sequence's end, a run
# of them at a time (tile_holes_end, pair_holes_end): a
# many-sequence decode would loop over groups of 32 on every tile, and for causal batches the
# numbering without holes measured slower on H100 (docs/performance.md).
VARLEN_COMPACT_BATCH = 32


@cute.jit
def _q_blocks_of_lane(mCuSeqlensQ: cute.Tensor, batches: Int32, tile_m: cutlass.Constexpr[int]):
    """Q blocks of this lane's sequence (0 past the batch)."""
    b = cute.arch.lane_idx()
    seqlen = Int32(0)
    if b < batches:
        seqlen = mCuSeqlensQ[b + 1] - mCuSeqlensQ[b]
    return (seqlen + (tile_m - 1)) // tile_m


@cute.jit
def varlen_num_tiles(mCuSeqlensQ: cute.Tensor, tile_m: cutlass.Constexpr[int], heads: Int32, batches: Int32):
    """The tiles of a batch of at most 32 sequences: its Q blocks times the heads."""
    return cute.arch.warp_redux_sync(_q_blocks_of_lane(mCuSeqlensQ, batches, tile_m), "add") * heads


@cute.jit
def varlen_tile_coords(tile: Int32, mCuSeqlensQ: cute.Tensor, tile_m: cutlass.Constexpr[int], heads: Int32,
                       batches: Int32):
    """(m_block, head, batch) of tile number ``tile`` (below ``varlen_num_tiles``) of a batch of at
    most 32 sequences, numbered sequence by sequence, head by head, Q block by Q block: the
    sequence is the first whose tiles, summed over the warp, reach past ``tile``."""
    lane = cute.arch.lane_idx()
    nb = _q_blocks_of_lane(mCuSeqlensQ, batches, tile_m)
    tiles_incl = nb * heads
    for i in cutlass.range_constexpr(5):  # inclusive prefix sum over the warp
        other = cute.arch.shuffle_sync_up(tiles_incl, offset=1 << i, mask_and_clamp=0)
        if lane >= (1 << i):
            tiles_incl += other
    # lanes whose sequences end at or before the tile: the tile's sequence is the next one
    batch = cute.arch.popc(cute.arch.vote_ballot_sync(tiles_incl <= tile))
    batch = cutlass.min(batch, 31)  # (a tile past the last: not asked for)
    before = cute.arch.shuffle_sync(tiles_incl - nb * heads, batch)
    blocks = cutlass.max(cute.arch.shuffle_sync(nb, batch), 1)
    local = tile - before
    head = local // blocks
    return local - head * blocks, head, batch
