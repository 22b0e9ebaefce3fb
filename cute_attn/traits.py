"""Kernel traits: one readable table per arch and direction, keyed by the padded head dim.

A head dim that is not a table entry (any multiple of 8 up to 256) runs the next larger entry's
kernel; the extra columns are zero-filled on load and never stored.

Shared memory per CTA (2-byte elements), forward: Q tile + num_stages * (K tile + V tile).
H100 has 227 KB per CTA / 228 KB per SM and 64K registers per SM; A100 164 KB; sm_86/89 ~100 KB.
With 4 warps of up to 255 registers a CTA takes 32K registers, so at most 2 CTAs fit per SM; the
tables aim for 2 CTAs per SM on H100 (<= ~113 KB of shared memory each) wherever registers allow.
``fit_to_smem`` shrinks an entry (fewer stages, then a smaller tile_n) for GPUs with less.
"""

from dataclasses import dataclass, replace

HEAD_DIMS = (32, 64, 96, 128, 192, 256)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class ForwardTraits:
    head_dim: int  # padded head dim the kernel is compiled for
    tile_m: int  # Q rows per CTA
    tile_n: int  # K/V rows per inner iteration
    num_warps: int  # stacked along tile_m: each warp owns tile_m / num_warps whole rows
    num_stages: int  # shared-memory buffers for each of K and V
    # ptxas --register-usage-level (0..10, ptxas default 5); lower trades some scheduling freedom
    # for fewer live registers, which is what keeps the fullest tiles from spilling
    reg_level: int | None = None
    # O += P V in this many column slices, so only one slice of V's registers is live at a time
    pv_chunks: int = 1

    @property
    def spec(self) -> str:
        """'m128n32w4s2' (+ 'c2' / 'r2' when set): the form parse_traits and --sweep take."""
        return (f"m{self.tile_m}n{self.tile_n}w{self.num_warps}s{self.num_stages}"
                f"{f'c{self.pv_chunks}' if self.pv_chunks != 1 else ''}"
                f"{f'r{self.reg_level}' if self.reg_level is not None else ''}")

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        return elem_bytes * self.head_dim * (self.tile_m + 2 * self.num_stages * self.tile_n)


# SM80 forward (mma.sync). Measured on H100 (tools/bench.py --sweep, docs/performance.md). An entry
# may list fallbacks: the compiler takes the first candidate whose cubin needs no local memory
# (compile.build_forward), because at 255 registers whether ptxas spills a few bytes flips with
# the target, dtype, causal and padded variants.
SM80_FORWARD = {
    # d32/d64: 128x64 beat 128x128 by 10-60% (less S per thread, no spills) and 64x64 at S >= 1024.
    # At 255 registers a variant may spill a few bytes (d64 causal padded on sm_90a: 8 B); it then
    # takes the same tile with O += P V in two column slices.
    32: (
        ForwardTraits(32, tile_m=128, tile_n=64, num_warps=4, num_stages=2),
        ForwardTraits(32, tile_m=128, tile_n=64, num_warps=4, num_stages=2, pv_chunks=2),
    ),
    64: (
        ForwardTraits(64, tile_m=128, tile_n=64, num_warps=4, num_stages=2),
        ForwardTraits(64, tile_m=128, tile_n=64, num_warps=4, num_stages=2, pv_chunks=2),
    ),
    # d96: 128x64, two stages (72 KB, 2 CTAs/SM); 1.08-1.14x FA2 at S >= 1024. The causal
    # variants spill 32-40 B on sm_90a and take a 32-wide S tile instead.
    96: (
        ForwardTraits(96, tile_m=128, tile_n=64, num_warps=4, num_stages=2),
        ForwardTraits(96, tile_m=128, tile_n=32, num_warps=4, num_stages=2),
    ),
    # d128: O alone is 128 fp32 registers per thread. A 64-wide S tile spills 24-72 bytes; 32 wide
    # runs 1.02-1.06x FA2 and compiles clean in most variants; the others take the same tile with
    # O += P V in two column slices, or ptxas register-usage level 2. 16 wide never spills but ran
    # 35% slower; 8 warps (16 rows each) never spill but ran 15% slower.
    128: (
        ForwardTraits(128, tile_m=128, tile_n=32, num_warps=4, num_stages=2),
        ForwardTraits(128, tile_m=128, tile_n=32, num_warps=4, num_stages=2, pv_chunks=2),
        ForwardTraits(128, tile_m=128, tile_n=32, num_warps=4, num_stages=2, reg_level=2),
        ForwardTraits(128, tile_m=128, tile_n=16, num_warps=4, num_stages=2),
    ),
    # d192: 8 warps share the 128-row Q tile so O stays at 96 registers per thread; one stage
    # (96 KB) keeps 2 CTAs/SM.
    192: (ForwardTraits(192, tile_m=128, tile_n=64, num_warps=8, num_stages=1),),
    # d256: 8 warps, one stage: 128 KB, 1 CTA/SM (two stages would need 192 KB for no occupancy gain).
    256: (ForwardTraits(256, tile_m=128, tile_n=64, num_warps=8, num_stages=1),),
}


@dataclass(frozen=True)
class Sm90ForwardTraits:
    """Hopper forward: one producer warpgroup plus tile_m / 64 consumer warpgroups."""

    head_dim: int
    tile_m: int  # 64 rows per consumer warpgroup
    tile_n: int  # K/V rows per block (the N of S = Q K^T's wgmma, the K of P V's)
    num_stages: int  # shared-memory buffers for each of K and V
    intra_wg_overlap: bool = True  # issue the next Q K^T before this block's softmax
    pingpong: bool = True  # named barriers alternate the consumer warpgroups' GEMMs
    persistent: bool = False  # one CTA per SM walks the tiles (O gets its own shared buffer)
    # persistent, with the intra-warpgroup overlap: the next tile's first Q K^T runs under this
    # tile's epilogue (Q gets a second shared buffer)
    overlap_tiles: bool = False
    # non-causal only: CTAs in clusters of two take adjacent Q blocks of one head, and each loads
    # half of every K/V block into both CTAs' shared memory (TMA multicast): half the L2 reads
    kv_multicast: bool = False
    # persistent: each CTA takes its next tile from an atomic counter (in the one-CTA-per-tile
    # order) instead of a static deal of rounds
    dynamic_tiles: bool = False
    # without intra-warpgroup overlap: every K/V block of a tile takes the masked path (one loop,
    # not the masked/unmasked/masked walk): the same bits, ~20-30% less to compile, slower to
    # run. A cold start's bootstrap kernel (compile.forward_bootstrap_key), never a table entry
    mask_every_block: bool = False

    @property
    def spec(self) -> str:
        """'m128n128s2' (+ 'o0' without intra-warpgroup overlap, 'p0' without ping-pong, 'ps'
        persistent, 'ot' overlapping tiles, 'mc' K/V multicast in clusters of two, 'dt' dynamic tiles,
        'mb' every block masked)."""
        return (f"m{self.tile_m}n{self.tile_n}s{self.num_stages}"
                f"{'' if self.intra_wg_overlap else 'o0'}{'' if self.pingpong else 'p0'}"
                f"{'ps' if self.persistent else ''}{'ot' if self.overlap_tiles else ''}"
                f"{'mc' if self.kv_multicast else ''}{'dt' if self.dynamic_tiles else ''}"
                f"{'mb' if self.mask_every_block else ''}")

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        # persistent: O has a buffer of its own; overlapping tiles: Q has two
        q_tiles = 2 if self.overlap_tiles and self.persistent and self.intra_wg_overlap else 1
        o_tile = self.tile_m if self.persistent else 0
        return elem_bytes * self.head_dim * (q_tiles * self.tile_m + o_tile + 2 * self.num_stages * self.tile_n) + 2048


# SM90 forward (wgmma, TMA, warp specialisation): one CTA per SM, so the tiles take as much of the
# 227 KB of shared memory as helps. Per head dim and causality, tiers of (the longest sequence the
# tier serves, max(seqlen_q, seqlen_k); None: any) and traits, first match wins. Measured on H100
# (tools/bench.py --sweep, peers in the same runs; docs/performance.md):
# - persistent ('ps') where O's extra buffer fits: non-causal +1-20% at S 512-2048 (the next tile's
#   loads overlap this one's epilogue) and level from 4096. Causal, with tiles dealt head by head
#   (kernels/tile_scheduler.py): d128 +12% at S 2048, +7% at 4096, +3% at 8192, but -28% at 16384,
#   where a static deal of tiles from 1 to 128 blocks long balances worse than the hardware's launch
#   order; d64 +7% at S 2048-4096 and -8% to -10% from 8192. A dynamic deal (an atomic tile counter
#   read by the producer warp) measured -6%..+3% against these choices and was not kept.
# - d64 causal at S <= 1024 takes 128-row tiles: +13% over 192 rows.
# - d128: ping-pong on top of the intra-warpgroup overlap measured -7%..+1% in one sweep and
#   -1%..+1.5% in another (S 1024-16384), so d128 runs the simpler schedule, the overlap alone.
# - overlapping tiles ('ot': the next tile's first Q K^T under this tile's epilogue, two Q buffers),
#   same-process A/B against the kernel without it (10:47-11:09 UTC): d64 non-causal +10-13% at
#   S 512, +5% at 1024, +1-4% from 2048 (with one Q buffer it lost: the next Q arrives too late);
#   d64 causal level (-2%..+1%); d128 -3..-5% from S 2048 (a second Q buffer takes shared memory
#   to 224 KB; with one, level from 4096 but -4% at 1024). So d32/d64 non-causal, and d128
#   non-causal up to S 1024 (below).
# - larger K/V blocks lost everywhere: d64 m128n192 -19%, m128n160 -20%, m192n96 -8%; d128 m128n176
#   -6% to -23%, m128n160 -3% to -12% (S 1024-16384, 09:03 UTC run); d128 m128n192 spills.
# - K/V multicast in clusters of two ('mc', non-causal): halves the L2 sectors read (ncu, d128
#   S 8192: 247 M -> 138 M, FA4 130 M); d128 +1.5-2% sustained from S 2048 (13:11-13:15 UTC, two
#   runs), -1% at 1024; d64 (192-row tiles) -2% to -9%. So d128 non-causal from S 2048.
#   Below that d128 non-causal takes overlapping tiles after all (13:54-13:56 UTC, two burst runs
#   of 7 and 9 rounds and one sustained): S 512 +3.3% / +3.9% burst, +2.7% sustained; S 1024
#   +1.5% / +2.4% burst, level sustained; level at 2048.
# - re-checked in sustained runs (tools/bench.py --sustained, 1% resolution; 12:37-12:56 UTC): every
#   choice above is the best timed or within 1.5% of it at S 1024-16384.
_m192 = dict(tile_m=192, tile_n=128, num_stages=2)
_m128 = dict(tile_m=128, tile_n=128, num_stages=2)
_T = Sm90ForwardTraits
SM90_FORWARD = {
    32: {
        False: ((None, _T(32, **_m192, persistent=True, overlap_tiles=True)),),
        True: ((1024, _T(32, **_m128, persistent=True)), (None, _T(32, **_m192))),
    },
    64: {
        False: ((None, _T(64, **_m192, persistent=True, overlap_tiles=True)),),
        True: ((1024, _T(64, **_m128, persistent=True)), (4096, _T(64, **_m192, persistent=True)),
               (None, _T(64, **_m192))),
    },
    96: {
        False: ((None, _T(96, **_m128, persistent=True)),),
        True: ((1024, _T(96, **_m128, persistent=True)), (None, _T(96, **_m128))),
    },
    128: {
        False: ((1024, _T(128, **_m128, pingpong=False, persistent=True, overlap_tiles=True)),
                (None, _T(128, **_m128, pingpong=False, persistent=True, kv_multicast=True))),
        True: ((8192, _T(128, **_m128, pingpong=False, persistent=True)), (None, _T(128, **_m128, pingpong=False))),
    },
    # d192/d256: Q, K and V fill shared memory; O reuses Q's buffer, so no persistent grid
    192: dict.fromkeys((False, True), ((None, _T(192, tile_m=128, tile_n=112, num_stages=2)),)),
    256: dict.fromkeys((False, True), ((None, _T(256, tile_m=128, tile_n=80, num_stages=2)),)),
}


# Causal varlen and windowed batches (causal or not: a window is a local kernel) of these head dims
# run their SM90 tier on a persistent grid whose CTAs take their tiles from an atomic counter
# (dynamic_tiles), in the order one CTA per tile would run them. Sequences of different lengths
# make the static rounds of a persistent grid unequal (varlen d128: 462 against 479 TFLOP/s one
# CTA per tile), and one CTA per tile pays every
# tile's start (launch, pipeline set-up, the first loads: ~3.6 us of fixed cost per tile plus ~1.1 us
# between tiles on an SM, from a per-tile timeline on H100) and ~1 us for each tile past a
# sequence's end. Measured on H100 beside the previous choice in one device call
# (docs/performance.md): `tools/bench.py --varlen --causal 1` (lengths 128-4096, 16k tokens) d128
# 555 against 467 TFLOP/s (one CTA per tile), d64 436 against 379 (static persistent); causal
# windows (W, 0), S 4096-16384, W 256-4096, each deal forced: d128 -1..+9%, d64 +0..+13%, where a
# static persistent deal measured level with one CTA per tile (-1..+3%). (Windows took the dynamic
# deal only from 2026-11-26 04:00 UTC: before, the selection tested the kernel's causal flag, which
# a window's kernel does not set; `tools/bench.py --window 1024` against the static persistent grid
# they ran until then: d128 +6% / +11% at S 4096 / 16384, d64 +12% / +7%.)
SM90_CAUSAL_DYNAMIC_TILES = frozenset({64, 128})


# KV-cache decode and split-KV (the SM80-family forward with the decode features, on every GPU).
# A decode tile holds a few query rows (seqlen_q x the query heads of one K/V head), so 64 rows
# (4 warps of 16) and the S width and stages are what sets how many K/V bytes are in flight per SM.
# The second candidate is taken where the first spills (the compiler keeps the first without local
# memory). A paged cache reads K/V blocks of 64 keys or more from one page each (pages_by_rows).
SM80_DECODE = {
    32: (ForwardTraits(32, tile_m=64, tile_n=128, num_warps=4, num_stages=2),),
    64: (ForwardTraits(64, tile_m=64, tile_n=128, num_warps=4, num_stages=2),
         ForwardTraits(64, tile_m=64, tile_n=64, num_warps=4, num_stages=2)),
    96: (ForwardTraits(96, tile_m=64, tile_n=64, num_warps=4, num_stages=2),
         ForwardTraits(96, tile_m=64, tile_n=32, num_warps=4, num_stages=2)),
    128: (ForwardTraits(128, tile_m=64, tile_n=64, num_warps=4, num_stages=2),
          ForwardTraits(128, tile_m=64, tile_n=32, num_warps=4, num_stages=2)),
    192: (ForwardTraits(192, tile_m=64, tile_n=64, num_warps=4, num_stages=1),
          ForwardTraits(192, tile_m=64, tile_n=32, num_warps=4, num_stages=1)),
    256: (ForwardTraits(256, tile_m=64, tile_n=64, num_warps=4, num_stages=1),
          ForwardTraits(256, tile_m=64, tile_n=32, num_warps=4, num_stages=1)),
}


# Split-KV tiles whose rows fit one pass of the in-kernel merge (kernels/sm80/forward.py's
# _merge_splits: this many lanes per row, so 32 / 8 = 4 rows per warp, 16 per 4-warp decode CTA)
# are merged by their last split instead of by the combine kernel (interface.decode_merges_in_cta).
SPLIT_MERGE_LANES_PER_ROW = 8


def sm80_decode_traits(head_dim: int, smem_capacity: int | None = None, page_size: int = 0,
                       spec: str | None = None) -> tuple[ForwardTraits, ...]:
    """The decode candidates for ``head_dim`` (``spec``: one given instead, as in parse_traits),
    shrunk to ``smem_capacity``; for a paged cache read a block per page (``pages_by_rows`` false)
    with tile_n dividing ``page_size``."""
    candidates = SM80_DECODE[padded_head_dim(head_dim)] if spec is None else (parse_traits(spec, head_dim),)
    if page_size and not pages_by_rows(page_size):
        largest_pow2 = page_size & -page_size
        candidates = tuple(replace(t, tile_n=min(t.tile_n, largest_pow2)) for t in candidates)
    if smem_capacity:
        candidates = tuple(fit_to_smem(t, smem_capacity) for t in candidates)
    return tuple(dict.fromkeys(candidates))


# Pages whose largest power-of-two factor is at least this many keys are read a K/V block of that
# many keys per page; others (1, 16, 48, 100...) with full tiles and a page per row. 16-key blocks
# read at 0.59-0.69x the rate of 64-key ones (docs/performance.md, "Pages of any size").
PAGE_BLOCK_MIN = 64


# The SM90 forward reads a paged cache (flash_attn_varlen_func's block_table) with one TMA load per
# SM90_PAGE_ROWS keys of a page, so it takes pages of a multiple of that many keys (vLLM's default
# 16, 32, 64, ...); others run the decode kernel. Every SM90 tile_n (128, 112, 80) is a multiple.
SM90_PAGE_ROWS = 16


# A paged varlen batch (and a KV-cache call) runs the SM90 forward when its sequences have at least
# this many tile rows on average: queries, times the query heads per K/V head where those are
# packed into the tiles (kvcache.sm90_paged_varlen). Measured on H100 (d128 bf16 heads 32/8, causal,
# 16-key pages; us): unpacked SM90 forward against the decode kernel, 4 chunks of 1024 queries
# 237 / 522, 16 of 128 188 / 381, but 8 chunks of 64 over 8192 keys 226 / 263 (half of each tile
# empty) and 2 chunks of 512 + 30 decode rows 457 / 275. Packed (a 128-row tile holds 32 queries
# of each of the 4 heads): 8 chunks of 64 130 us, 2 of 512 + 30 decode rows 239; 64 decode rows
# 378 against the decode kernel's 374 (4 rows per sequence: the decode kernel keeps them). Fewer
# on average still run it packed where one sequence has this many rows and the batch's tiles fill
# the GPU (a prefill chunk beside decode rows: 1.01-1.29x faster than the decode kernel on the 13
# such batches measured, docs/performance.md).
SM90_PAGED_MIN_QUERIES = 128


def sm90_packs_gqa(head_dim: int, causal: bool, group: int) -> bool:
    """Whether the SM90 forward packs ``group`` query heads per K/V head into its tiles (the
    paged varlen and KV-cache calls): each head's share of a tile, tile_m / group queries, must be
    whole TMA pieces of SM90_PAGE_ROWS rows in every length tier (the tiers are built together)."""
    tiles = {t.tile_m for _, t in _sm90_tiers(head_dim, causal)}
    return group > 1 and bool(tiles) and all(m % (group * SM90_PAGE_ROWS) == 0 for m in tiles)


def sm90_pages(page_size: int) -> bool:
    """Whether the SM90 forward can read a paged cache of ``page_size`` keys."""
    return page_size > 0 and page_size % SM90_PAGE_ROWS == 0


def pages_by_rows(page_size: int) -> bool:
    """Whether a paged cache of ``page_size`` keys runs the decode kernel with a page per row
    (features.paged_rows) rather than a K/V block per page."""
    return bool(page_size) and (page_size & -page_size) < PAGE_BLOCK_MIN


def padded_head_dim(head_dim: int) -> int:
    """The traits entry that serves ``head_dim`` (the smallest entry >= head_dim)."""
    for d in HEAD_DIMS:
        if head_dim <= d:
            return d
    raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")


def fit_to_smem(traits: ForwardTraits, smem_capacity: int) -> ForwardTraits:
    """Shrink ``traits`` until its shared memory fits ``smem_capacity`` bytes."""
    while traits.smem_bytes() > smem_capacity:
        if traits.num_stages > 1:
            traits = replace(traits, num_stages=traits.num_stages - 1)
        elif traits.tile_n > 32:
            traits = replace(traits, tile_n=traits.tile_n // 2)
        else:
            raise ValueError(f"no forward tile for head_dim {traits.head_dim} fits {smem_capacity} bytes")
    return traits


def parse_traits(spec: str, head_dim: int):
    """A traits spec for tools and sweeps -> traits. SM80: 'm128n64w4s2' (optionally followed by
    'c2' and/or 'r3'); SM90: 'm128n128s2' (optionally 'o0', 'p0', 'ps', 'ot', 'mc', 'dt', 'mb')."""
    import re

    d = padded_head_dim(head_dim)
    m = re.fullmatch(r"m(\d+)n(\d+)s(\d+)(o0)?(p0)?(ps)?(ot)?(mc)?(dt)?(mb)?", spec)
    if m:
        tile_m, tile_n, stages, no_overlap, no_pingpong, persistent, overlap_tiles, multicast, dynamic, masked = m.groups()
        if masked and not no_overlap:
            raise ValueError(f"traits spec {spec!r}: 'mb' (every block masked) needs 'o0' (no intra-warpgroup overlap)")
        return Sm90ForwardTraits(d, int(tile_m), int(tile_n), int(stages), not no_overlap, not no_pingpong,
                                 bool(persistent), bool(overlap_tiles), bool(multicast), bool(dynamic), bool(masked))
    m = re.fullmatch(r"m(\d+)n(\d+)w(\d+)s(\d+)(?:c(\d+))?(?:r(\d+))?", spec)
    if not m:
        raise ValueError(f"traits spec must look like m128n64w4s2 (SM80, optionally c2/r3) or m128n128s2 "
                         f"(SM90, optionally o0/p0/ps/ot/mc/dt/mb), got {spec!r}")
    tile_m, tile_n, warps, stages, chunks, level = m.groups()
    return ForwardTraits(d, int(tile_m), int(tile_n), int(warps), int(stages),
                         int(level) if level is not None else None, int(chunks) if chunks is not None else 1)


def sm80_forward_traits(head_dim: int, causal: bool = False,
                        smem_capacity: int | None = None) -> tuple[ForwardTraits, ...]:
    """The candidates for ``head_dim``, in order of preference, shrunk to ``smem_capacity``."""
    candidates = SM80_FORWARD[padded_head_dim(head_dim)]
    if smem_capacity:
        candidates = tuple(dict.fromkeys(fit_to_smem(t, smem_capacity) for t in candidates))
    return candidates


def _sm90_tiers(head_dim: int, causal: bool) -> tuple:
    """The SM90 table's (longest sequence or None, traits) tiers for ``head_dim`` (empty: none)."""
    return SM90_FORWARD.get(padded_head_dim(head_dim), {}).get(bool(causal), ())


def sm90_forward_traits(head_dim: int, causal: bool = False, smem_capacity: int | None = None,
                        seqlen: int = 0) -> tuple[Sm90ForwardTraits, ...]:
    """The SM90 candidates for ``head_dim`` and ``seqlen`` = max(seqlen_q, seqlen_k) that fit
    ``smem_capacity`` (empty: use SM80)."""
    chosen = next((t for longest, t in _sm90_tiers(head_dim, causal) if longest is None or seqlen <= longest), None)
    return tuple(t for t in (chosen,) if t is not None and (not smem_capacity or t.smem_bytes() <= smem_capacity))


def sm90_tier_seqlen(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """The length that picks an SM90 tier. Causal: max(seqlen_q, seqlen_k), which sets how long
    the longest tiles are. Non-causal, whose only split is K/V multicast for d128: min(seqlen_q,
    seqlen_k), since it pays only with long tiles (seqlen_k) and many Q blocks (seqlen_q: a short
    query would leave a cluster's second CTA past its end)."""
    return max(seqlen_q, seqlen_k) if causal else min(seqlen_q, seqlen_k)


def sm90_seqlen_tiers(head_dim: int, causal: bool) -> tuple[int, ...]:
    """One sequence length per tier of the SM90 table (for listing every variant)."""
    tiers = _sm90_tiers(head_dim, causal)
    return tuple(longest for longest, _ in tiers[:-1]) + ((1 << 30,) if tiers else ())


def sm90_seqlen_tier(head_dim: int, causal: bool, seqlen: int) -> int:
    """The member of ``sm90_seqlen_tiers`` whose tier serves ``seqlen``."""
    return next((t for t in sm90_seqlen_tiers(head_dim, causal) if seqlen <= t), 1 << 30)


@dataclass(frozen=True)
class BackwardTraits:
    head_dim: int  # padded head dim
    tile_m: int  # Q rows per inner iteration
    tile_n: int  # K/V rows per CTA (dK, dV stay in registers)
    num_warps: int
    sdp_warps_m: int  # warps along tile_m for S = Q K^T and dP = dO V^T (the rest along tile_n)
    dkv_warps_n: int  # warps along tile_n for dK, dV (the rest along head_dim)
    dq_warps_m: int  # warps along tile_m for dQ (the rest along head_dim)

    @property
    def spec(self) -> str:
        """'m64n128w8a2b4c2': tiles, warps, then the S/dP, dK/dV and dQ warp splits."""
        return (f"m{self.tile_m}n{self.tile_n}w{self.num_warps}"
                f"a{self.sdp_warps_m}b{self.dkv_warps_n}c{self.dq_warps_m}")

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        d, m, n = self.head_dim, self.tile_m, self.tile_n
        # K, V + 2 stages of Q, dO + P, dS (+ LSE, D)
        return elem_bytes * (2 * n * d + 4 * m * d + 2 * m * n) + 2 * 2 * 4 * m


# SM80 backward (mma.sync), 8 warps as in FlashAttention-2: per CTA dK and dV of a K/V tile live in
# registers while Q blocks stream by. Like the forward table, an entry may list fallbacks (the first
# that compiles without local memory wins; the dQ postprocess follows the one taken).
SM80_BACKWARD = {
    32: (BackwardTraits(32, tile_m=64, tile_n=128, num_warps=8, sdp_warps_m=2, dkv_warps_n=4, dq_warps_m=4),),
    # d64: 128x128 tiles ran 5-10% faster than 64x128 (1.05-1.10x FA2) but spill 24-40 bytes in
    # some causal/fp16 variants, which then take 64x128 (0.95-1.06x FA2); 128x64 never spills but
    # ran 20% slower.
    64: (
        BackwardTraits(64, tile_m=128, tile_n=128, num_warps=8, sdp_warps_m=2, dkv_warps_n=4, dq_warps_m=4),
        BackwardTraits(64, tile_m=128, tile_n=128, num_warps=8, sdp_warps_m=4, dkv_warps_n=4, dq_warps_m=4),
        BackwardTraits(64, tile_m=64, tile_n=128, num_warps=8, sdp_warps_m=2, dkv_warps_n=4, dq_warps_m=2),
    ),
    96: (BackwardTraits(96, tile_m=64, tile_n=128, num_warps=8, sdp_warps_m=2, dkv_warps_n=4, dq_warps_m=4),),
    # d128: FlashAttention-2's 64x128; 160 KB of shared memory, 1 CTA (8 warps) per SM; 1.03-1.12x FA2.
    # Other warp splits of the S/dP, dK/dV and dQ GEMMs ran 2-12% slower.
    128: (
        BackwardTraits(128, tile_m=64, tile_n=128, num_warps=8, sdp_warps_m=2, dkv_warps_n=4, dq_warps_m=2),
        BackwardTraits(128, tile_m=64, tile_n=128, num_warps=8, sdp_warps_m=4, dkv_warps_n=4, dq_warps_m=2),
    ),
    # d192/d256: 64-row K/V tiles keep dK + dV at 96/128 fp32 registers per thread and smem <= 208 KB.
    192: (BackwardTraits(192, tile_m=64, tile_n=64, num_warps=8, sdp_warps_m=2, dkv_warps_n=2, dq_warps_m=2),),
    256: (BackwardTraits(256, tile_m=64, tile_n=64, num_warps=8, sdp_warps_m=2, dkv_warps_n=2, dq_warps_m=2),),
}


def sm80_backward_traits(head_dim: int) -> tuple[BackwardTraits, ...]:
    """The backward candidates for ``head_dim``, in order of preference."""
    return SM80_BACKWARD[padded_head_dim(head_dim)]


def parse_backward_traits(spec: str, head_dim: int):
    """'m64n128w8a2b4c2' -> BackwardTraits (SM80), 'm64n128s2' -> Sm90BackwardTraits, 'm64n48s2d1t' ->
    Sm90BackwardTraits of the large-head-dim kernel (one dO stage, transposed dK/dV) (for tools and sweeps)."""
    import re

    m = re.fullmatch(r"m(\d+)n(\d+)s(\d+)(?:d(\d+))?(t)?(?:q(\d+))?(l)?(p)?(k)?", spec)
    if m:
        tile_m, tile_n, stages, do_stages, swap, dq_parts, longest, persistent, stream_k = m.groups()
        if dq_parts is not None and not swap:
            raise ValueError(f"backward traits spec {spec!r}: dQ parts (q) only with the large-head-dim kernel (t)")
        return Sm90BackwardTraits(padded_head_dim(head_dim), int(tile_m), int(tile_n), int(stages),
                                  int(do_stages) if do_stages is not None else None, bool(swap), bool(longest),
                                  bool(persistent), int(dq_parts) if dq_parts is not None else 1, bool(stream_k))
    m = re.fullmatch(r"m(\d+)n(\d+)w(\d+)a(\d+)b(\d+)c(\d+)", spec)
    if not m:
        raise ValueError(f"backward traits spec must look like m64n128w8a2b4c2 (SM80) or m64n128s2 (SM90, "
                         f"optionally d1, t, q2, l, p and k), got {spec!r}")
    return BackwardTraits(padded_head_dim(head_dim), *map(int, m.groups()))


@dataclass(frozen=True)
class Sm90BackwardTraits:
    """Hopper backward: a producer warpgroup and two MMA warpgroups. ``swap_dkv`` False: the
    kernel of kernels/sm90/backward.py (S^T, dP^T with 64 keys per warpgroup, dK and dV in
    registers); True: kernels/sm90/backward_large.py (S, dP with 64 Q rows, P and dS through
    shared memory, dK^T and dV^T in registers)."""

    head_dim: int
    tile_m: int  # Q rows per block (the N of S^T = K Q^T): 64 or 128; swap_dkv: 64
    tile_n: int = 128  # K/V rows per CTA: 64 per MMA warpgroup; swap_dkv: a multiple of 16
    num_stages: int = 2  # shared-memory buffers for each of Q (+ LSE), dO (+ D) and dS; swap_dkv: Q only
    do_stages: int | None = None  # swap_dkv: shared-memory buffers for dO (+ D) (None: num_stages)
    swap_dkv: bool = False  # the large-head-dim kernel: one buffer each for P and dS
    # causal: the CTAs in longest-first order within L2-sized sections of heads
    # (tile_scheduler.section_coords) instead of the grid's own (K/V block fastest)
    longest_first: bool = False
    # a persistent grid (not deterministic, not swap_dkv): one CTA per SM walks the K/V blocks
    persistent: bool = False
    # swap_dkv: each warpgroup's dQ computed and staged in this many column parts (1 or 2): half
    # the fp32 staging buffer, so that d256 fits 64 keys beside two Q stages
    dq_parts: int = 1
    # plain non-causal: the grid's last round dealt out Stream-K style (stream_k_items below; how
    # many blocks: ``stream_k_blocks``, a run-time value); with ``persistent``, each CTA takes its
    # Stream-K share after its whole blocks, else Stream-K CTAs come after one CTA per block
    stream_k: bool = False

    @property
    def spec(self) -> str:
        """'m64n128s2' (+ 'd1': dO stages, 't': swap_dkv, 'q2': dQ parts, 'l': longest_first, 'p':
        persistent, 'k': stream_k): the form parse_backward_traits and --bwd-sweep take."""
        return (f"m{self.tile_m}n{self.tile_n}s{self.num_stages}"
                f"{f'd{self.do_stages}' if self.do_stages is not None else ''}{'t' if self.swap_dkv else ''}"
                f"{f'q{self.dq_parts}' if self.dq_parts != 1 else ''}"
                f"{'l' if self.longest_first else ''}{'p' if self.persistent else ''}{'k' if self.stream_k else ''}")

    @property
    def dout_stages(self) -> int:
        return self.num_stages if self.do_stages is None else self.do_stages

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        d, m, n, s, sdo = self.head_dim, self.tile_m, self.tile_n, self.num_stages, self.dout_stages
        if self.swap_dkv:
            # Q, dO (their stages) + K, V + one P and one dS + the fp32 dQ of one Q block (or of one
            # column part of it) + LSE, D + barriers
            return (elem_bytes * ((s + sdo) * m * d + 2 * n * d + 2 * m * n) + 4 * m * d // self.dq_parts
                    + 4 * m * (s + sdo) + 1024)
        # Q, dO, dS (per stage) + K, V + the fp32 dQ of one Q block + LSE, D (per stage) + barriers
        return elem_bytes * (s * (2 * m * d + m * n) + 2 * n * d) + 4 * m * d + 2 * 4 * m * s + 1024


# SM90 backward (wgmma, TMA, warp specialisation), FlashAttention-3's tiles: 128 keys per CTA in two
# MMA warpgroups, per head dim and causality. Q blocks of 128 rows where the S^T and dP^T
# accumulators (tile_m / 2 fp32 each per thread) fit beside dK and dV (head_dim / 2 each); 64 rows
# for larger head dims. Measured on H100 (docs/performance.md, 2026-11-23): d64 at 1.00-1.03x and
# d128 at 0.95-0.98x FlashAttention-4 sustained. d128 non-causal takes FA3's 80-row Q blocks (dQ
# computed as dQ^T = K^T dS^T, the head dim along wgmma's M): the per-Q-block work outside the
# element-wise math (~225 instructions per MMA warp: descriptors, barriers, LSE/D loads) spreads
# over 80 rows instead of 64, 6.0 instead of 6.5 loop instructions per Q row; measured
# against 64 rows in one run (2026-11-24): +5-6% from S 4096, level at 1024-2048 (ncu at S 8192:
# 64 rows executed 14% more instructions than FA4's 80). Varlen keeps 64 rows (sm90_backward_traits).
# d192/d256: that kernel's dK and dV alone would take 192/256 registers per thread at 128 keys per
# CTA, so they run kernels/sm90/backward_large.py (FlashAttention-3/4's decomposition for large
# head dims: 64 Q rows, S and dP not transposed, dK^T and dV^T with the head dim on the wgmma M
# axis). What limits them is shared memory, 227 KB: Q takes two stages, dO one, P and dS one
# buffer each, and the fp32 dQ staging buffer must fit beside them. d192: 96 keys
# (FlashAttention-4's tile, 218 KB; dK^T + dV^T 144 registers per thread, the warpgroups split the
# keys, since 192 rows of the head dim do not halve into 64-row wgmma tiles). d256: 64 keys with
# dQ computed and staged in two column parts (dq_parts, 'q2': a 32 KB staging buffer instead of 64;
# 210 KB; dK^T + dV^T 128 registers, the warpgroups split the head dim). At d256 the kernel is
# bound by L2 traffic (a Q block's Q, dO and fp32 dQ, 2 KB per row, per K/V block: ~5.2 TB/s at
# 48 keys), so 64 keys instead of FlashAttention-4's 48 bought +19-43% (H100, 2026-11-26: 254-437
# against 214-314 TFLOP/s, 1.03-1.22x cuDNN). d192 with dQ parts and two dO stages measured 6-10%
# slower (its K then takes a narrower swizzle), so d192 keeps FA4's tile.
# Causal d128 runs its CTAs longest first (K/V block 0 of each head of a section, then block 1...;
# plain causal only, without window, softcap, ALiBi or varlen: the variant measured): +2..+8% at
# S 2048-8192 in burst, +2..+4% sustained; -2% at S 1024; d64 measured -1..-11% with it and keeps
# the grid's order. The order alone explains little of it: at S 8192 sections of 1 and 4
# heads ran alike, and the SASS inner loop is unchanged but starts 128-byte aligned
# (docs/performance.md, "Causal CTA order of the backward").
# d32/d64 non-causal run a persistent grid ('p': one CTA per SM walks the K/V blocks round by round,
# the next block's first Q and dO loads overlapping this one's end): d64 +5-7%, d32 +4-11% at S
# 1024-16384 on H100 (2026-11-26, beside the one-CTA-per-block grid in one run); d96 measured
# -1..+9% (noisy) and keeps one CTA per block. Not elsewhere: d128 non-causal gained
# 0.2-2% but its 80-row kernel then spills 4 bytes; causal K/V blocks differ in length, and the
# static rounds balanced them badly (d64 -7..-31%, d128 longest first -20..-38%); a dynamic deal
# (an atomic counter, as the forward's dynamic_tiles) measured level with one CTA per block
# (-5..+2.5%), so causal keeps the one-CTA-per-block grid. Stream-K for the grid's last round
# (its blocks dealt out as (query head, Q block) steps over every SM, the cut blocks' dK and dV
# partials added by the CTA that finishes them) is d128 non-causal's tier where the rule deals
# blocks out (SM90_BACKWARD_STREAM_K below); on every grid it measured -2% at S 2048 and -2..-5% at
# d64 (docs/performance.md, "Stream-K for the last round" and "Stream-K as a tier").
_B = Sm90BackwardTraits
SM90_BACKWARD = {
    32: {False: _B(32, tile_m=128, persistent=True), True: _B(32, tile_m=128)},
    64: {False: _B(64, tile_m=128, persistent=True), True: _B(64, tile_m=128)},
    96: dict.fromkeys((False, True), _B(96, tile_m=64)),
    128: {False: _B(128, tile_m=80), True: _B(128, tile_m=64, longest_first=True)},
    192: dict.fromkeys((False, True), _B(192, tile_m=64, tile_n=96, num_stages=2, do_stages=1, swap_dkv=True)),
    256: dict.fromkeys((False, True), _B(256, tile_m=64, tile_n=64, num_stages=2, do_stages=1, swap_dkv=True,
                                         dq_parts=2)),
}

# d128 plain causal (no window, softcap, ALiBi or varlen; not deterministic) from this many query rows:
# 80-row Q blocks (the non-causal tile), the table's 64 below. H100, 2026-11-26, backward burst beside
# the 64-row kernel in two runs: S 2048 +2.5% / -4%, 4096 +6% / 0%, 8192 +7% / +2%, 16384 +6.5% /
# +2% (an earlier run, 2026-11-24: -4% at S 1024, +3% at 16384). Both tiers of a configuration are
# built together (compile.backward_tier_siblings), so a new length never compiles.
SM90_BACKWARD_LONG = {128: _B(128, tile_m=80, longest_first=True)}
SM90_BACKWARD_LONG_SEQLEN = 8192

# d128 plain non-causal (no window, softcap, ALiBi or varlen; not deterministic, no head splits)
# where ``stream_k_blocks`` deals out the grid's last round: the table's kernel with Stream-K
# (``stream_k_items``), on a persistent grid (below). Built together with the table's kernel, so a new length never
# compiles. H100, 2026-11-27, beside the same kernel without it (alternating bursts, 16k tokens):
# backward +3.9% / +1.3% / +1.0% at S 4096 / 8192 / 16384, forward+backward +1.7% / +0.4% / +1.1%
# (docs/performance.md, "Stream-K as a tier"). On a persistent grid ('pk': one CTA per SM walks its
# whole blocks j, j + 132, ... and then its Stream-K share, a block's start overlapping the previous
# one's end): backward +2.4% / +1.0% / +0.7% at S 4096 / 8192 / 16384 over the one-CTA-per-block
# Stream-K kernel (H100, 2026-11-27, 16 alternating rounds, 13 / 11 / 12 won; dK and dV bitwise
# equal); without blocks to deal out (below S 4096) the persistent grid measured -1.5..-4% (S
# 512-2048), so the tier stays where the rule deals (docs/performance.md, "A persistent Stream-K tier").
SM90_BACKWARD_STREAM_K = {128: _B(128, tile_m=80, persistent=True, stream_k=True)}
# Stream-K where the SMs the last round leaves idle would otherwise wait this many units (a query
# head's Q block each) per SM: below it the cut blocks' fp32 round trip and the waits cost more
# than the idle SMs (the ninth session's rule, 24 x 132 units on H100: d128 from S 4096 at 16k tokens)
STREAM_K_MIN_IDLE_UNITS = 24


# The deal (host side, plain ints; the kernel reads a Stream-K CTA's row of ``stream_k_items``). The
# blocks are numbered as the grid orders them and cut into units of one (query head, Q block) step
# each, ``units_per_block`` per block. The last ``sk_blocks`` go to ``ctas`` CTAs (persistent: the
# grid's CTAs, after their whole blocks; else CTAs launched after one CTA per block), CTA j taking
# units [j U / ctas, (j + 1) U / ctas) of those U, so each takes 1-2 blocks' worth, in at most
# three items:
# - PUBLISH: the start of the last block it touches (it ends mid-block): its fp32 dK and dV, a
#   partial sum, go to a workspace slot of the CTA's own and a flag is raised;
# - whole blocks (WHOLE), as every other CTA computes them;
# - FINISH: the end of the first block it touches (it starts mid-block): it adds the slots of the
#   lower-numbered CTAs that published pieces of that block, in their order, and stores dK and dV.
# Publishing comes first and finishing last, and a CTA waits only on lower numbers, which the
# hardware launched before it (persistent: every CTA is resident, one per SM): no wait can block a
# CTA that is needed to end it. dQ needs nothing: every (K/V block, Q block) pair is still visited
# once and its share added as always.
STREAM_K_WHOLE, STREAM_K_PUBLISH, STREAM_K_FINISH = 0, 1, 2
STREAM_K_MAX_ITEMS = 3  # a CTA's units span less than two blocks (stream_k_blocks deals P + r of them)
STREAM_K_ITEM_FIELDS = 5  # block, first unit, end unit (in the block), mode, first publisher
STREAM_K_ROW = 2 + STREAM_K_ITEM_FIELDS * STREAM_K_MAX_ITEMS  # items, slot, the items


def stream_k_units(j: int, units_per_block: int, sk_blocks: int, ctas: int) -> tuple[int, int]:
    """The units [lo, hi) of Stream-K CTA ``j``, numbered from the first Stream-K block's."""
    total = sk_blocks * units_per_block
    return j * total // ctas, (j + 1) * total // ctas


def stream_k_item_list(lo: int, hi: int, units_per_block: int) -> list[tuple[int, int, int, int]]:
    """The items of the units [lo, hi): (block, first unit, end unit (offsets in the block), mode),
    PUBLISH first, then WHOLE blocks, FINISH last."""
    b_first, b_last = lo // units_per_block, (hi - 1) // units_per_block
    cut = lambda b: (b, max(lo, b * units_per_block) - b * units_per_block,
                     min(hi, (b + 1) * units_per_block) - b * units_per_block)
    starts_mid, ends_mid = lo > b_first * units_per_block, hi < (b_last + 1) * units_per_block
    if b_first == b_last and starts_mid and ends_mid:  # inside one block: a piece others finish
        return [(*cut(b_first), STREAM_K_PUBLISH)]
    items = [(*cut(b_last), STREAM_K_PUBLISH)] if ends_mid else []
    items += [(*cut(b), STREAM_K_WHOLE) for b in range(b_first + starts_mid, b_last + 1 - ends_mid)]
    return items + ([(*cut(b_first), STREAM_K_FINISH)] if starts_mid else [])


def stream_k_items(units_per_block: int, sk_blocks: int, ctas: int) -> list[list[int]]:
    """One row per Stream-K CTA j (STREAM_K_ROW ints): [items, j, then per item (block among the
    Stream-K ones, first unit, end unit, mode, the first Stream-K CTA that holds a piece of the
    block, which a FINISH piece adds from up to j - 1)]."""
    rows = []
    for j in range(ctas):
        lo, hi = stream_k_units(j, units_per_block, sk_blocks, ctas)
        items = stream_k_item_list(lo, hi, units_per_block)
        row = [len(items), j]
        for block, u_lo, u_hi, mode in items:
            # the CTA whose units hold the block's first unit: the largest j with lo(j) <= it
            first = ((block * units_per_block + 1) * ctas - 1) // (sk_blocks * units_per_block)
            row += [block, u_lo, u_hi, mode, first]
        rows.append(row + [0] * (STREAM_K_ROW - len(row)))
    return rows


def stream_k_blocks(blocks: int, units_per_block: int, num_sms: int) -> int:
    """How many of a one-CTA-per-K/V-block grid's last ``blocks`` the Stream-K CTAs share (0:
    none): the remainder of a round of ``num_sms`` and the full round before it, so that each
    Stream-K CTA takes 1-2 blocks' worth; none where the grid fills its rounds, has fewer than two,
    or the idle SMs would wait fewer than STREAM_K_MIN_IDLE_UNITS units each."""
    rest = blocks % num_sms
    if rest == 0 or blocks < 2 * num_sms or (num_sms - rest) * units_per_block < STREAM_K_MIN_IDLE_UNITS * num_sms:
        return 0
    return num_sms + rest


def sm90_backward_traits(head_dim: int, causal: bool = False, smem_capacity: int | None = None,
                         varlen: bool = False) -> tuple[Sm90BackwardTraits, ...]:
    """The SM90 backward candidates for ``head_dim`` that fit ``smem_capacity`` (empty: use SM80):
    the table's entry, then ``sm90_backward_fallbacks``. Varlen takes 64-row Q blocks where the
    table has 80 (a sequence's rows start at a multiple of VARLEN_ROW_PAD in the row buffers,
    which 80-row blocks would overrun), and no persistent grid.
    A window, causal or not, is a kernel with ``causal`` False (its right edge is a run-time value)
    and takes the non-causal entry: 64-row blocks on a persistent grid instead measured level at
    d128 (window (1024, 0), S 4096 / 16384 on H100, 2026-11-26: 370 / 385 against 375 / 385
    TFLOP/s; docs/performance.md)."""
    t = SM90_BACKWARD.get(padded_head_dim(head_dim), {}).get(bool(causal))
    if t is None:
        return ()
    if varlen and VARLEN_ROW_PAD % t.tile_m:
        t = replace(t, tile_m=64)
    if varlen:
        # a varlen grid covers the longest sequence's K/V blocks: fixed rounds deal the real ones
        # out unevenly (persistent d128 non-causal 499 against 544 TFLOP/s, docs/performance.md)
        t = replace(t, persistent=False)
    candidates = (t, *sm90_backward_fallbacks(t))
    return tuple(c for c in candidates if not smem_capacity or c.smem_bytes() <= smem_capacity)


def sm90_backward_fallbacks(t: Sm90BackwardTraits) -> tuple[Sm90BackwardTraits, ...]:
    """The candidates after ``t``, taken where ``t`` compiles with local memory (the compile takes
    the first that needs none, compile._first_without_local_memory). Every non-varlen combination
    of window, softcap and ALiBi compiled for sm_90a (2026-11-26): the d64 persistent grid spills
    with softcap (8-16 bytes of stack), d128's 80-row blocks with window + ALiBi (24 bytes); one
    CTA per K/V block and 64-row Q blocks compile without, and measured (H100, S 2048 / 8192,
    beside the spilling kernels in one run) level at d64 (softcap: 342 / 394 against 344 / 395
    TFLOP/s) and +7-9% at d128 (window (1024, 0) + ALiBi: 359 / 394 against 335 / 362). The plain
    kernels and every other combination keep the first candidate, so they compile and run as
    before. d192 with all three spills 8 bytes and keeps them: its 64-key fallback measured 11%
    slower (281 / 306 against 318 / 342)."""
    fallbacks = []
    if t.persistent:
        fallbacks.append(replace(t, persistent=False))
    if t.tile_m == 80:
        fallbacks.append(replace(t, tile_m=64))
    return tuple(fallbacks)


# ---------------------------------------------------------------------------- host-side sizes the kernels share
# Kept here, free of the DSL, so that a call whose kernels come from the disk cache imports no DSL
# (compile.KernelCache loads them through TVM-FFI alone).

# The backward's fp32 row buffers (LSE in log2, D, the dQ accumulator) are padded to whole blocks of
# this many rows (the preprocess's blocks; every backward tile_m divides it but the 80 of d128
# non-causal, whose last Q block the padding covers too: ``backward_padded_rows``).
BACKWARD_ROW_PAD = 128
# varlen: each sequence's rows in those buffers start at a multiple of this (kernels/seqlen_info.py)
VARLEN_ROW_PAD = 128


def backward_padded_rows(seqlen_q: int, tile_m: int) -> int:
    """Rows of the backward's dense row buffers (host side): whole Q blocks of the main kernel, then
    whole blocks of the preprocess (which writes every row: LSE_log2 = +inf, D = 0 past seqlen_q)."""
    rows = -(-seqlen_q // tile_m) * tile_m
    return -(-rows // BACKWARD_ROW_PAD) * BACKWARD_ROW_PAD


def varlen_padded_rows(total_q: int, batch: int) -> int:
    """Rows of the backward's varlen row buffers (host side): total_q + batch * PAD, rounded up to PAD."""
    return -(-(total_q + batch * VARLEN_ROW_PAD) // VARLEN_ROW_PAD) * VARLEN_ROW_PAD


# The SM90 forward's causal tile order (kernels/tile_scheduler.py): of H100's 50 MB L2 (two 25 MB
# halves), what one section's K and V may take.
L2_BYTES_FOR_KV = 32 * 1024 * 1024


def heads_per_section(seqlen_k: int, head_dim: int, elem_bytes: int) -> int:
    """How many heads' K and V fit in the L2 budget together (at least 1); host side."""
    return max(L2_BYTES_FOR_KV // max(seqlen_k * 2 * head_dim * elem_bytes, 1), 1)
