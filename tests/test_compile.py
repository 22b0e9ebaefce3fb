"""Compile forward variants without a GPU and check what the generated code contains (CPU).

By default a representative subset per target; ``pytest --all-variants`` compiles every variant.
"""

import dataclasses
import re

import pytest

from cute_attn import artifacts
from cute_attn.compile import (
    TARGETS,
    BackwardKey,
    RowKernelKey,
    backward_keys,
    backward_variants,
    build,
    build_forward,
    forward_bootstrap_key,
    forward_key,
    forward_variants,
    sm90_split_dkv_fp32,
)
from cute_attn.kernels.features import Features
from cute_attn.traits import (
    BACKWARD_ROW_PAD,
    HEAD_DIMS,
    SM80_FORWARD,
    SM90_BACKWARD,
    SM90_FORWARD,
    Sm90BackwardTraits,
    Sm90ForwardTraits,
    backward_padded_rows,
    fit_to_smem,
    padded_head_dim,
    parse_backward_traits,
    parse_traits,
    sm90_tier_seqlen,
)

SUBSET = [  # (head_dim, dtype, causal): smallest/largest tiles, a padded head dim, both dtypes
    (64, "bf16", False),
    (128, "fp16", True),
    (40, "bf16", True),
    (256, "bf16", False),
]


SM90_SUBSET = [  # (head_dim, dtype, causal): 3 and 2 consumer warpgroups, the largest head dim, padded
    (64, "bf16", True),
    (128, "bf16", False),
    (256, "fp16", True),
    (120, "bf16", False),
]


def _keys(all_variants):
    if all_variants:
        return forward_variants(TARGETS, HEAD_DIMS + (40, 120, 200))
    return [forward_key(t, dt, d, c) for t in TARGETS for d, dt, c in SUBSET] + [
        forward_key("sm_90a", dt, d, c, kernel="sm90") for d, dt, c in SM90_SUBSET
    ] + [forward_key("sm_90a", "bf16", 128, False, kernel="sm90", seqlen=8192)] + [  # K/V multicast
        # KV-cache decode: the SM80-family kernel with its decode traits on every target
        forward_key(t, dt, d, c, kernel="sm90", features=f, page_size=page) for t, dt, d, c, f, page in DECODE_SUBSET
    ] + [  # flash_attn_varlen_func's block_table on the SM90 forward: a TMA load per 16 keys of a page
        forward_key("sm_90a", "bf16", 128, True, kernel="sm90", seqlen=1024, features=SM90_PAGED, page_size=16),
        forward_key("sm_90a", "fp16", 256, False, kernel="sm90", seqlen=4096, features=SM90_PAGED, page_size=64),
        forward_key("sm_90a", "bf16", 64, True, kernel="sm90", seqlen=4096, page_size=16,
                    features=dataclasses.replace(SM90_PAGED, pack_gqa=True, local=True, softcap=True)),
    ] + [  # varlen with seqused_k and the other score features, both families
        forward_key("sm_90a", "bf16", 128, True, kernel="sm90", features=VARLEN_ALL),
        forward_key("sm_80", "fp16", 64, False, features=VARLEN_ALL),
    ] + [  # a cold start's bootstrap kernels (one loop, every block masked): plain causal, every feature
        forward_bootstrap_key(forward_key("sm_90a", "bf16", 128, True, kernel="sm90")),
        forward_bootstrap_key(forward_key("sm_90a", "bf16", 128, True, kernel="sm90", features=VARLEN_ALL)),
    ]


SM90_PAGED = Features(varlen=True, seqused=True, paged=True)
# varlen + seqused_k + window + softcap + ALiBi in one kernel
VARLEN_ALL = Features(varlen=True, seqused=True, local=True, softcap=True, alibi=True)


DECODE_SUBSET = [  # (target, dtype, head_dim, causal, features, page size): a paged packed split cache,
    # the same with pages of 16 keys (a page per row) on both targets, a padded head dim with
    # window + softcap + ALiBi, forward's own split path, and a paged varlen call
    ("sm_90a", "bf16", 128, True, Features(kvcache=True, paged=True, split=True, pack_gqa=True), 64),
    ("sm_90a", "bf16", 128, False, Features(kvcache=True, paged=True, split=True, pack_gqa=True), 16),
    ("sm_80", "fp16", 96, True, Features(kvcache=True, paged=True, local=True, pack_gqa=True), 1),
    # flash_attn_varlen_func's block_table: packed queries over paged keys counted by seqused
    ("sm_90a", "bf16", 128, True, Features(varlen=True, seqused=True, paged=True, split=True, pack_gqa=True), 16),
    ("sm_80", "fp16", 72, False, Features(local=True, softcap=True, alibi=True, kvcache=True, split=True), 0),
    ("sm_90a", "fp16", 256, False, Features(split=True, pack_gqa=True), 0),
]


BWD_SUBSET = [  # (head_dim, dtype, causal, deterministic): with the SM90 kernel on sm_90a, every
    # entry of its traits table (d32/64: 128-row Q blocks; d96 (72 padded)/128 causal: 64-row;
    # d128 non-causal: 80-row, dQ^T)
    (64, "bf16", True, False),
    (128, "fp16", False, True),
    (72, "bf16", True, False),
    (32, "bf16", True, True),
    (64, "fp16", False, False),  # the persistent grid
    (128, "bf16", False, False),  # d128 non-causal with its persistent Stream-K tier (m80n128s2pk)
]


_FEATURES_ALL = Features(local=True, softcap=True, alibi=True, varlen=True, seqused=True)
BWD_LARGE_SUBSET = [  # (head_dim, dtype, causal, deterministic, features): the SM90 large-head-dim
    # kernel (kernels/sm90/backward_large.py) on sm_90a: both entries, both dtypes, causal or not,
    # deterministic, every optional feature, a padded head dim (160 -> 192)
    (192, "bf16", False, False, Features()),
    (256, "fp16", True, False, Features()),
    (256, "bf16", True, True, Features()),
    (160, "fp16", True, False, _FEATURES_ALL),
    (256, "bf16", False, True, _FEATURES_ALL),
]


def _bwd_keys(all_variants):
    if all_variants:
        return backward_variants(TARGETS, HEAD_DIMS + (72,), deterministic=(False, True))
    keys = {
        k: None
        for t in TARGETS for d, dt, c, det in BWD_SUBSET
        for k in backward_variants([t], [d], [dt], [c], [det])
    }
    for t, d in (("sm_90a", 128), ("sm_80", 64)):  # varlen + seqused_k + the score features
        keys.update(dict.fromkeys(backward_variants([t], [d], ["bf16"], [True], [False], features=[VARLEN_ALL])))
    # the score features on the 80-row (dQ^T) kernel, and varlen non-causal, which keeps 64 rows
    for f in (Features(local=True, softcap=True, alibi=True), VARLEN_ALL):
        keys.update(dict.fromkeys(backward_variants(["sm_90a"], [128], ["bf16"], [False], [False], features=[f])))
    # combinations whose first candidate needs local memory take the next one
    # (traits.sm90_backward_fallbacks): d64 persistent + softcap, d128 80 rows + window + ALiBi
    for d, f in ((64, Features(softcap=True)), (128, Features(local=True, alibi=True))):
        keys.update(dict.fromkeys(backward_variants(["sm_90a"], [d], ["bf16"], [False], [False], kernels=("sm90",),
                                                    features=(f,))))
    for d, dt, c, det, f in BWD_LARGE_SUBSET:
        keys.update(dict.fromkeys(backward_variants(["sm_90a"], [d], [dt], [c], [det], kernels=("sm90",),
                                                    features=(f,))))
    return list(keys)


def pytest_generate_tests(metafunc):
    all_variants = metafunc.config.getoption("--all-variants")
    if "fwd_key" in metafunc.fixturenames:
        keys = _keys(all_variants)
        metafunc.parametrize("fwd_key", keys, ids=[k.name for k in keys])
    if "bwd_key" in metafunc.fixturenames:
        keys = _bwd_keys(all_variants)
        metafunc.parametrize("bwd_key", keys, ids=[k.name for k in keys])


def test_forward_variant_compiles_to_expected_instructions(fwd_key):
    fn = build_forward(fwd_key, keep_artifacts=True)
    ptx, cubin = fn.__ptx__, fn.__cubin__
    assert artifacts.ptx_target(ptx) == fwd_key.target
    counts = artifacts.count_ptx(ptx)
    assert counts["ld.local/st.local"] == 0, "local memory in the PTX itself"
    res = artifacts.cubin_resources(cubin)
    assert res["registers"] and res["registers"] <= 255
    assert fn.traits in fwd_key.candidates
    if fwd_key.kernel == "sm90":
        assert counts["wgmma"] > 0, "no wgmma.mma_async"
        assert counts["cp.async.bulk.tensor"] > 0, "no TMA (cp.async.bulk.tensor)"
        assert counts["mbarrier"] > 0, "no mbarrier pipeline"
        assert counts["setmaxnreg"] == 2, "producer and consumers should each set their register count"
        assert counts["mma.sync"] == 0 and counts["cp.async"] == 0
        # a dynamic deal of tiles (causal varlen) takes tile numbers from a global counter; the
        # static deals have no atomics
        assert ("atom.global.add" in ptx) == fn.traits.dynamic_tiles, f"{fwd_key.name}: tile counter"
        if fn.traits.kv_multicast:  # K/V reach both CTAs of a cluster through TMA multicast
            assert "multicast::cluster" in ptx and "barrier.cluster.wait" in ptx
            assert "mbarrier.arrive.shared::cluster" in ptx, "consumers release the other CTA's stages"
        if fwd_key.features.pack_gqa:  # Q in and O out in 16-row pieces, each from its own query head
            assert counts["cp.async.bulk.tensor"] >= 2 * fn.traits.tile_m // 16, fwd_key.name
        if fwd_key.features.paged:  # a TMA load per 16-key piece of a block (each from its own page)
            pieces = fn.traits.tile_n // 16
            assert counts["cp.async.bulk.tensor"] >= 4 * pieces, f"{fwd_key.name}: too few TMA loads for the pieces"
            assert "shfl.sync" in ptx, "the pieces' pages are read by one lane each and shuffled"
        # paged: the rows of a tile's first V block past its keys zeroed in shared memory before
        # its P V (16-bit stores, which nothing else in the kernel makes); contiguous varlen K/V
        # (seqused_k too) load through ragged views instead (5-d boxes, out of bounds past the keys)
        assert ("st.shared.b16" in ptx) == fwd_key.features.paged, f"{fwd_key.name}: V's rows past the keys"
        ragged_loads = ptx.count("cp.async.bulk.tensor.5d.shared::")
        assert (ragged_loads >= 2) == (fwd_key.features.varlen and not fwd_key.features.paged), fwd_key.name
        # the register split leaves no room for spills anywhere in the SM90 table
        assert res["stack_frame"] == 0, f"{fwd_key.name}: {res['stack_frame']} bytes of local memory (spills)"
        return
    if fwd_key.features.decode:  # the decode traits, wherever the family was asked for
        assert fwd_key.kernel == "sm80" and fwd_key.candidates[0].tile_m == 64
    # split-KV: each tile's last split merges it in the kernel (one atomic on its counter, with
    # the fences that publish and acquire the partials, read back 128 bits at a time); no other
    # SM80 forward has atomics
    body = "\n".join(line.split("//", 1)[0] for line in ptx.splitlines())
    assert ("atom.global.add" in body) == fwd_key.features.split, f"{fwd_key.name}: split counter"
    if fwd_key.features.split:
        assert body.count("fence.acq_rel.gpu") == 2, fwd_key.name
        assert re.search(r"\bld\.global(\.\w+)*\.v4\.(b|f)32\b", body), "the partials not in 128-bit loads"
    assert counts["mma.sync"] > 0, "no mma.sync.aligned.m16n8k16"
    assert counts["cp.async"] > 0, "no 128-bit cp.async"
    assert counts["ldmatrix"] > 0, "no ldmatrix"
    if fwd_key.head_dim <= 128:
        assert res["stack_frame"] == 0, f"{fwd_key.name}: {res['stack_frame']} bytes of local memory (spills)"


def test_sm90_falls_back_to_sm80_where_it_cannot_run():
    # another target, or no SM90 entry fitting the GPU's shared memory: the SM80 forward
    assert forward_key("sm_80", "bf16", 128, False, kernel="sm90").kernel == "sm80"
    assert forward_key("sm_90a", "bf16", 128, False, 100 * 1024, kernel="sm90").kernel == "sm80"
    assert forward_key("sm_90a", "bf16", 128, False, kernel="sm90").kernel == "sm90"
    sm90 = parse_traits("m128n128s2o0p0", 128)
    assert sm90 == Sm90ForwardTraits(128, 128, 128, 2, intra_wg_overlap=False, pingpong=False)
    assert sm90.spec == "m128n128s2o0p0"
    options = parse_traits("m192n128s2p0ps", 64)
    assert (options.pingpong, options.persistent) == (False, True)
    assert options.spec == "m192n128s2p0ps"
    tiles = parse_traits("m192n128s2psot", 64)
    assert (tiles.persistent, tiles.overlap_tiles, tiles.spec) == (True, True, "m192n128s2psot")
    # overlapping tiles keep a second Q buffer: d128 m128 then takes 224 KB (still fits H100)
    assert parse_traits("m128n128s2psot", 128).smem_bytes() - parse_traits("m128n128s2ps", 128).smem_bytes() == 128 * 128 * 2
    with pytest.raises(ValueError):
        forward_key("sm_86", "bf16", 128, False, traits=sm90)
    with pytest.raises(ValueError, match="shared memory"):  # 3 stages + O's buffer: 264 KB
        forward_key("sm_90a", "bf16", 128, False, 227 * 1024, traits=parse_traits("m128n128s3p0ps", 128))
    with pytest.raises(ValueError, match="multicast"):  # causal Q blocks of a cluster see different keys
        forward_key("sm_90a", "bf16", 128, True, traits=parse_traits("m128n128s2p0psmc", 128))


def test_sm90_traits_fit_hopper_shared_memory():
    for d, by_causal in SM90_FORWARD.items():
        for tiers in by_causal.values():
            assert tiers[-1][0] is None, f"d{d}: the last tier must serve any sequence length"
            for _, t in tiers:
                assert t.head_dim == d and t.tile_m % 64 == 0 and t.tile_n % 16 == 0
                assert t.smem_bytes() <= 227 * 1024, f"d{d} {t.spec} does not fit H100"


def test_sm90_seqlen_tiers_pick_their_traits():
    # d128 causal: persistent up to 8192, one CTA per tile beyond; non-causal: one entry
    assert forward_key("sm_90a", "bf16", 128, True, kernel="sm90", seqlen=8192).candidates[0].persistent
    assert not forward_key("sm_90a", "bf16", 128, True, kernel="sm90", seqlen=8193).candidates[0].persistent
    assert forward_key("sm_90a", "bf16", 64, True, kernel="sm90", seqlen=1000).candidates[0].tile_m == 128
    assert forward_key("sm_90a", "bf16", 64, True, kernel="sm90", seqlen=2048).candidates[0].tile_m == 192
    # causal varlen and windowed d64/d128: the persistent grid with a dynamic deal at every tier;
    # non-causal varlen and the other features keep the table's deal. A window, causal or not, is a
    # local kernel with the causal flag off (its right edge is a run-time value): both flags checked
    for f, flags in ((Features(varlen=True), (True,)), (Features(local=True), (False, True)),
                     (Features(varlen=True, local=True, softcap=True), (False, True))):
        for causal in flags:
            for d, seqlen in ((128, 1000), (128, 16384), (64, 1000), (64, 8192)):
                t = forward_key("sm_90a", "bf16", d, causal, kernel="sm90", seqlen=seqlen, features=f).candidates[0]
                assert t.persistent and t.dynamic_tiles and not t.overlap_tiles and t.spec.endswith("psdt")
        assert not forward_key("sm_90a", "bf16", 256, True, kernel="sm90", features=f).candidates[0].persistent
    assert not forward_key("sm_90a", "bf16", 128, False, kernel="sm90",
                           features=Features(varlen=True)).candidates[0].dynamic_tiles
    # what a causal window's call compiles (interface: window (1024, 0) -> local, causal off)
    from cute_attn.interface import _score_options

    opts = _score_options(True, None, 128, window_size=(1024, 0))
    assert not opts.causal and opts.features.local
    assert forward_key("sm_90a", "bf16", 128, opts.causal, kernel="sm90", seqlen=16384,
                       features=opts.features).candidates[0].dynamic_tiles
    assert not forward_key("sm_90a", "bf16", 128, True, kernel="sm90", seqlen=1000,
                           features=Features(softcap=True)).candidates[0].dynamic_tiles
    assert parse_traits("m128n128s2p0psdt", 128).dynamic_tiles
    # d128 non-causal: K/V multicast once both the query and the keys are longer than 1024
    assert not forward_key("sm_90a", "bf16", 128, False, kernel="sm90", seqlen=1024).candidates[0].kv_multicast
    assert forward_key("sm_90a", "bf16", 128, False, kernel="sm90", seqlen=2048).candidates[0].kv_multicast
    assert sm90_tier_seqlen(128, 16384, False) == 128 and sm90_tier_seqlen(128, 16384, True) == 16384
    sm90 = [k for k in forward_variants(["sm_90a"], [64], ["bf16"], [True], kernels=["sm90"])]
    assert len(sm90) == len(SM90_FORWARD[64][True])  # every tier listed once
    # lengths of one tier share one key (the key cache does not grow with every new length)
    assert forward_key("sm_90a", "bf16", 64, True, kernel="sm90", seqlen=300) is forward_key(
        "sm_90a", "bf16", 64, True, kernel="sm90", seqlen=1000)


def test_tile_scheduler_visits_every_tile_once_longest_first():
    import itertools

    from cute_attn.kernels.tile_scheduler import tile_coords

    for m_blocks, heads, batch, section in [(5, 3, 2, 4), (16, 8, 2, 32), (3, 7, 1, 2), (1, 1, 1, 5), (4, 6, 3, 1)]:
        tiles = [tile_coords(i, m_blocks, heads, batch, section) for i in range(m_blocks * heads * batch)]
        assert sorted(tiles) == sorted(itertools.product(range(m_blocks), range(heads), range(batch)))
        # within the first section, every pair's last Q block comes before any pair's next-to-last
        width = min(section, heads * batch)
        assert all(m == m_blocks - 1 for m, _, _ in tiles[:width])
        if section == 1:  # head by head, longest first
            assert [t[0] for t in tiles[:m_blocks]] == list(range(m_blocks - 1, -1, -1))


def _varlen_tiles(lens, queries, heads, section, causal):
    """The SM90 forward's varlen tile numbering over the longest sequence's Q blocks: (number of
    tiles, whether a number is past its sequence's end, the run end the kernel's _holes_end gives)."""
    from cute_attn.kernels import tile_scheduler as ts

    batch, m_blocks = len(lens), max(-(-max(lens) // queries), 1)
    blocks = [-(-n // queries) for n in lens]

    def coords(t):
        if causal:
            return ts.tile_coords(t, m_blocks, heads, batch, section)
        pair = t // m_blocks
        return t % m_blocks, pair % heads, pair // heads

    def hole(t):
        m, _, b = coords(t)
        return m * queries >= lens[b]

    def holes_end(t):
        if causal:
            first, last = ts.section_batches(t, m_blocks, heads, batch, section)
            return ts.tile_holes_end(t, m_blocks, heads, batch, section, max(blocks[first:last + 1]))
        return ts.pair_holes_end(t, m_blocks)

    return m_blocks * heads * batch, hole, holes_end


def _dynamic_deal(num_tiles, grid, hole, holes_end, rng):
    """A model of the SM90 forward's dynamic deal (_claim_tile, _claim_after_holes, _fetch_tile),
    the CTAs' atomics interleaved at random: (tiles run, in claim order; atomics issued)."""
    counter, run, atomics = [0], [], [0]

    def atomic(op, value):
        atomics[0] += 1
        old = counter[0]
        counter[0] = max(old, value) if op == "max" else old + value
        return old

    def cta(first):
        tile = first
        while True:
            while tile < num_tiles and hole(tile):
                end = holes_end(tile)
                yield
                if atomic("max", end + 1 - grid) > end - grid:
                    yield
                    tile = grid + atomic("add", 1)
                else:
                    tile = end
            if tile >= num_tiles:
                return
            run.append(tile)
            yield
            tile = grid + atomic("add", 1)

    live = [cta(i) for i in range(grid)]
    while live:
        g = rng.choice(live)
        try:
            next(g)
        except StopIteration:
            live.remove(g)
    return run, atomics[0]


def test_varlen_deals_skip_runs_of_tiles_past_the_ends():
    """Every tile that exists runs once under the dynamic and the static deal, which jump over
    runs of numbers past their sequences' ends (tile_scheduler.tile_holes_end, pair_holes_end)."""
    import random

    from cute_attn.kernels.tile_scheduler import nth_tile

    rng = random.Random(0)
    cases = [([4096] + [1] * 31, 32, 8, 16, True),  # a chunk and decode rows, packed GQA g = 4
             ([1] * 31 + [4096], 32, 8, 16, True), ([0, 5, 0, 300, 17, 0], 128, 3, 4, True),
             ([129, 0, 1000, 1, 127], 64, 2, 1, True), ([0, 0], 128, 4, 3, True)]
    cases += [(lens, q, h, s, False) for lens, q, h, s, _ in cases]
    for _ in range(6):
        lens = [rng.choice([0, 1, 17, 113, 129, rng.randrange(1, 3000)]) for _ in range(rng.randrange(1, 40))]
        cases.append((lens, rng.choice([32, 64, 128]), rng.randrange(1, 9), rng.randrange(1, 50), rng.random() < 0.5))
    for lens, queries, heads, section, causal in cases:
        num_tiles, hole, holes_end = _varlen_tiles(lens, queries, heads, section, causal)
        real = [t for t in range(num_tiles) if not hole(t)]
        next_real = num_tiles  # the first tile that exists at or after t
        for t in range(num_tiles - 1, -1, -1):
            if hole(t):
                end = holes_end(t)
                assert t < end <= next_real, (lens, t, end)
            else:
                next_real = t
        for grid in (7, 132):
            run, atomics = _dynamic_deal(num_tiles, grid, hole, holes_end, rng)
            assert sorted(run) == real, (lens, grid)
            # the static deal: a CTA's rounds jump to the first whose tile may lie past the run
            dealt = []
            for cta in range(grid):
                r = 0
                while True:
                    tile = nth_tile(r, cta, grid)
                    while tile < num_tiles and hole(tile):
                        r = max(r + 1, holes_end(tile) // grid)
                        tile = nth_tile(r, cta, grid)
                    if tile >= num_tiles:
                        break
                    dealt.append(tile)
                    r += 1
            assert sorted(dealt) == real
    # the chunk of 4096 queries beside 31 decode rows: 32768 numbers for 1272 tiles, which took an
    # atomic a number before; ~3.4k now (the model's CTAs contend on every step)
    num_tiles, hole, holes_end = _varlen_tiles([4096] + [1] * 31, 32, 8, 16, True)
    run, atomics = _dynamic_deal(num_tiles, 132, hole, holes_end, rng)
    assert num_tiles == 32768 and len(run) == 1024 + 31 * 8 and atomics < num_tiles // 6, atomics


def test_backward_causal_order_runs_block_0_of_a_section_first():
    import itertools

    from cute_attn.kernels.tile_scheduler import backward_heads_per_section, section_coords
    from cute_attn.traits import L2_BYTES_FOR_KV

    for n_blocks, heads, batch, section in [(64, 16, 2, 4), (16, 32, 8, 16), (3, 7, 1, 2), (5, 3, 2, 64)]:
        order = [section_coords(cta, n_blocks, heads, batch, section) for cta in range(n_blocks * heads * batch)]
        assert sorted(order) == sorted(itertools.product(range(n_blocks), range(heads), range(batch)))
        width = min(section, heads * batch)
        assert [n for n, _, _ in order[:width]] == [0] * width  # the longest CTAs first
        assert order[width][0] == min(1, n_blocks - 1)
    # the kernel takes the order only where it is causal, dense and not deterministic
    import cutlass

    from cute_attn.kernels.sm90.backward import FlashAttentionBackwardSm90

    def order(causal, deterministic, features=Features()):
        return FlashAttentionBackwardSm90(cutlass.BFloat16, 128, 64, 128, 2, causal, deterministic, features,
                                          longest_first=True).longest_first

    assert order(True, False) and not order(False, False) and not order(True, True)
    assert not order(True, False, Features(varlen=True)) and not order(True, False, Features(softcap=True))
    # Q, dO (bf16) and the fp32 dQ accumulator of a section's query heads fit the L2 budget
    assert backward_heads_per_section(8192, 1, 128) == L2_BYTES_FOR_KV // (8192 * 128 * 8) == 4
    assert backward_heads_per_section(2048, 4, 128) == 4
    assert backward_heads_per_section(10**7, 1, 256) == 1 and backward_heads_per_section(0, 1, 64) > 1


def test_heads_per_section_fits_the_l2_budget():
    from cute_attn.traits import L2_BYTES_FOR_KV, heads_per_section

    per_head = 1024 * 2 * 128 * 2  # K and V of one head: seqlen 1024, d128, bf16
    assert heads_per_section(1024, 128, 2) == L2_BYTES_FOR_KV // per_head
    assert heads_per_section(10**7, 256, 2) == 1  # one head over the budget still makes a section


def test_persistent_rounds_deal_every_tile_once():
    from cute_attn.kernels.tile_scheduler import nth_tile

    for num_tiles, grid in [(10, 3), (132, 132), (1000, 132), (5, 8), (264, 132)]:
        dealt = []
        for cta in range(grid):
            r = 0
            while nth_tile(r, cta, grid) < num_tiles:
                dealt.append(nth_tile(r, cta, grid))
                r += 1
        assert sorted(dealt) == list(range(num_tiles))
        # rounds alternate direction: CTA 0 takes tile 0, then the last tile of round 1
        assert nth_tile(1, 0, grid) == 2 * grid - 1


@pytest.mark.parametrize("per_block,sk_blocks,ctas", [
    (205, 200, 132),  # d128 S 16384, 16 heads: 15.5 rounds of 132 SMs
    (103, 200, 132), (7, 168, 132), (5, 200, 132), (1, 133, 132),
    (26, 32, 132),  # forced counts (tests): more CTAs than blocks, pieces inside one block
    (1000, 10, 132), (300, 40, 132),
])
def test_stream_k_deals_every_unit_once(per_block, sk_blocks, ctas):
    """traits.stream_k_items: every (block, unit) of the Stream-K blocks goes to exactly one item;
    a CTA's items run PUBLISH, whole blocks, FINISH; a cut block has one FINISH piece, and its
    first publisher and the CTAs up to the finishing one hold its other pieces, all published."""
    from cute_attn import traits as tr

    owner = {}
    for j, row in enumerate(tr.stream_k_items(per_block, sk_blocks, ctas)):
        items = row[0]
        assert 1 <= items <= tr.STREAM_K_MAX_ITEMS and row[1] == j and len(row) == tr.STREAM_K_ROW
        modes = []
        for k in range(items):
            block, u_lo, u_hi, mode, first = row[2 + tr.STREAM_K_ITEM_FIELDS * k:][:tr.STREAM_K_ITEM_FIELDS]
            assert 0 <= u_lo < u_hi <= per_block
            assert mode != tr.STREAM_K_WHOLE or (u_lo, u_hi) == (0, per_block)
            for u in range(u_lo, u_hi):
                assert (block, u) not in owner
                owner[block, u] = (j, mode)
            if mode == tr.STREAM_K_FINISH:
                others = {c: m for (b, _), (c, m) in owner.items() if b == block and c != j}
                assert set(others) == set(range(first, j)) and set(others.values()) == {tr.STREAM_K_PUBLISH}
            modes.append(mode)
        order = [tr.STREAM_K_PUBLISH, tr.STREAM_K_WHOLE, tr.STREAM_K_FINISH]
        assert modes == sorted(modes, key=order.index)
    assert len(owner) == sk_blocks * per_block
    for block in range(sk_blocks):
        modes = {owner[block, u][1] for u in range(per_block)}
        assert modes in ({tr.STREAM_K_WHOLE}, {tr.STREAM_K_PUBLISH, tr.STREAM_K_FINISH})


def test_stream_k_blocks_follow_the_rule():
    """traits.stream_k_blocks: the remainder and one full round where the idle SMs would wait at
    least STREAM_K_MIN_IDLE_UNITS units each; none for whole rounds, short grids or short walks."""
    from cute_attn.traits import STREAM_K_MIN_IDLE_UNITS, stream_k_blocks

    assert stream_k_blocks(2048, 205, 132) == 132 + 2048 % 132  # d128 S 16384 x 16 heads
    assert stream_k_blocks(2048, 52, 132) == 200  # S 4096 x 4 sequences: 64 idle x 52 units
    assert stream_k_blocks(2048, 26, 132) == 0  # S 2048: 64 x 26 < 24 x 132
    assert stream_k_blocks(2112, 205, 132) == 0  # whole rounds
    assert stream_k_blocks(200, 205, 132) == 0  # under two rounds
    idle = 132 - 2048 % 132
    assert stream_k_blocks(2048, -(-STREAM_K_MIN_IDLE_UNITS * 132 // idle), 132) == 200


def test_backward_kernel_compiles_to_expected_instructions(bwd_key):
    fn = build(bwd_key, keep_artifacts=True)
    ptx, cubin = fn.__ptx__, fn.__cubin__
    assert artifacts.ptx_target(ptx) == bwd_key.target
    res = artifacts.cubin_resources(cubin)
    if isinstance(bwd_key, BackwardKey) and bwd_key.kernel == "sm90":
        counts = artifacts.count_ptx(ptx)
        assert counts["wgmma"] > 0, "no wgmma.mma_async"
        assert counts["cp.async.bulk.tensor"] > 0, "no TMA (cp.async.bulk.tensor)"
        assert counts["mbarrier"] > 0, "no mbarrier pipeline"
        assert counts["setmaxnreg"] == 2, "producer and MMA warpgroups should each set their register count"
        assert counts["mma.sync"] == 0 and counts["cp.async"] == 0
        assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx, "no bulk dQ reduction"
        assert "stmatrix" in ptx, "dS and the dK/dV epilogue go through stmatrix"
        if bwd_key.deterministic:
            assert "ld.acquire.gpu" in ptx and "st.release.gpu" in ptx, "no semaphore ordering for dQ"
        else:
            # the first dQ share of a Q block goes to the K/V block that takes the semaphore's
            # first ticket, which publishes its landing; the others wait for it (dq_first_share)
            assert "atom.global.add.u32" in ptx and "atom.global.release.add.u32" in ptx, "no dQ ticket"
            assert "ld.acquire.gpu" in ptx, "no wait for the first dQ share"
        # the accumulator is not zeroed: every bulk dQ reduction has a bulk store beside it for
        # a Q block's first share
        assert (ptx.count("cp.async.bulk.global.shared::cta.bulk_group")
                == ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32")), "no first-share store"
        # varlen: Q, dO, K and V load through ragged views (5-d boxes, out of bounds past the
        # sequence's queries / keys), so no rows are zeroed in shared memory (16-bit stores)
        assert "st.shared.b16" not in ptx, f"{bwd_key.name}: rows zeroed in shared memory"
        ragged_loads = ptx.count("cp.async.bulk.tensor.5d.shared::")
        assert (ragged_loads >= 4) == bwd_key.features.varlen, f"{bwd_key.name}: {ragged_loads} ragged loads"
        t = fn.traits
        # split query heads' fp32 dK, dV (compile.sm90_split_dkv_fp32): TMA reductions into the
        # shared accumulators, four 32-column boxes of the swizzled fp32 tile per head dim of 128;
        # deterministic kernels store one tile per split instead
        reductions = ptx.count("cp.reduce.async.bulk.tensor")
        if sm90_split_dkv_fp32(t) and not bwd_key.deterministic:
            assert reductions == 2 * -(-t.head_dim // 32), "no TMA reductions of split heads' dK, dV"
        else:
            assert reductions == 0
        if t.swap_dkv:
            # S and dP in each warpgroup's keys; dK^T, dV^T with both operands MN-major (the two
            # trailing transpose flags); dK, dV out through stmatrix.trans
            keys_wg = t.tile_n // 2
            assert f"wgmma.mma_async.sync.aligned.m64n{keys_wg}k16" in ptx
            dkv_n = keys_wg if (t.head_dim // 2) % 64 else t.tile_n
            dkv = [line for line in ptx.splitlines() if f"aligned.m64n{dkv_n}k16" in line]
            assert any(line.rstrip().endswith("1, 1;") for line in dkv), "no MN-major dK^T / dV^T wgmma"
            assert "stmatrix.sync.aligned.m8n8.x4.trans" in ptx
            # dQ = dS K: each warpgroup's head-dim columns, in dq_parts GEMMs of 64 rows by
            # head_dim / 2 / dq_parts columns over the CTA's keys, each part one bulk reduction
            # per warpgroup
            dq_n = t.head_dim // 2 // t.dq_parts
            assert sum(f"aligned.m64n{dq_n}k16" in line for line in ptx.splitlines()) >= t.dq_parts * t.tile_n // 16
            assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 2 * t.dq_parts
        elif t.tile_m % 64:
            # 80-row Q blocks: S^T, dP^T with N = 80 (both K-major), and dQ^T = K^T dS^T with K^T
            # MN-major (the first trailing transpose flag), 8 k-steps over the 128 keys
            rows = [line for line in ptx.splitlines() if f"aligned.m64n{t.tile_m}k16" in line]
            assert sum(line.rstrip().endswith("1, 0;") for line in rows) == t.tile_n // 16, "no dQ^T wgmma"
            assert sum(line.rstrip().endswith("0, 0;") for line in rows) == 2 * t.head_dim // 16
        if t.stream_k:
            # Stream-K's cut blocks: a piece's fp32 dK, dV published behind a GPU-scope fence and a
            # release flag, which the finishing CTA acquires before adding them
            assert "fence.acq_rel.gpu" in ptx and "st.release.gpu" in ptx, "no Stream-K publication"
        assert counts["ld.local/st.local"] == 0 and res["stack_frame"] == 0, (
            f"{bwd_key.name}: {res['stack_frame']} bytes of local memory (spills)")
        return
    if isinstance(bwd_key, RowKernelKey) and bwd_key.kind == "bwd_pre":
        # 128-bit stores of zeros into the dQ accumulator: for the SM80 backward only
        zeroes = "st.global.v4.b32" in ptx and "0f00000000, 0f00000000" in ptx
        assert zeroes == bwd_key.zero_dq_accum, f"{bwd_key.name}: zeroes the accumulator: {zeroes}"
    if isinstance(bwd_key, BackwardKey):
        counts = artifacts.count_ptx(ptx)
        assert counts["mma.sync"] > 0 and counts["cp.async"] > 0 and counts["ldmatrix"] > 0
        if bwd_key.deterministic:
            assert "ld.acquire.gpu" in ptx and "st.release.gpu" in ptx, "no semaphore ordering for dQ"
        else:
            assert "atom.global.add.f32" in ptx or "red.global.add.f32" in ptx, "no fp32 atomics for dQ"
    if bwd_key.head_dim <= 128:
        assert res["stack_frame"] == 0, f"{bwd_key.name}: {res['stack_frame']} bytes of local memory (spills)"


def test_sm90_backward_table_and_fallback():
    # every SM90 backward entry fits Hopper's 227 KB; d192/d256 take the large-head-dim kernel
    # (swap_dkv: dK^T, dV^T), the others 128 keys per CTA; other targets run the SM80 kernel
    for d, by_causal in SM90_BACKWARD.items():
        for causal, t in by_causal.items():
            assert t.smem_bytes() <= 227 * 1024 and t.head_dim == d
            assert t.swap_dkv == (d > 128)
            assert t.tile_n == 128 if not t.swap_dkv else (t.tile_m == 64 and t.tile_n % 16 == 0)
            _, main = backward_keys("sm_90a", "bf16", d, causal, False, kernel="sm90")
            assert main.kernel == "sm90" and main.traits == t
            assert parse_backward_traits(t.spec, d) == t
    for d in (192, 256):
        for f in (Features(), Features(local=True, softcap=True, alibi=True, varlen=True)):
            _, main = backward_keys("sm_90a", "bf16", d, True, True, kernel="sm90", features=f)
            assert main.kernel == "sm90" and main.traits.swap_dkv
        # a GPU with less shared memory than H100 falls back to the SM80 kernel
        assert backward_keys("sm_90a", "bf16", d, False, False, kernel="sm90",
                             smem_capacity=200 * 1024)[1].kernel == "sm80"
    assert backward_keys("sm_90a", "bf16", 160, False, False, kernel="sm90")[1].traits == SM90_BACKWARD[192][False]
    large = parse_backward_traits("m64n48s2d1t", 256)
    assert large == Sm90BackwardTraits(256, 64, 48, 2, do_stages=1, swap_dkv=True) and large.spec == "m64n48s2d1t"
    assert large.dout_stages == 1 and parse_backward_traits("m64n128s2", 64).dout_stages == 2
    # d256: 64 keys, its dQ in two column parts (half the fp32 staging buffer)
    assert SM90_BACKWARD[256][True] == parse_backward_traits("m64n64s2d1tq2", 256)
    assert SM90_BACKWARD[256][True].dq_parts == 2 and SM90_BACKWARD[192][True].dq_parts == 1
    with pytest.raises(ValueError, match="dQ parts"):
        parse_backward_traits("m64n128s2q2", 128)
    assert backward_keys("sm_90a", "bf16", 72, True, False, kernel="sm90")[1].traits == SM90_BACKWARD[96][True]
    assert backward_keys("sm_80", "bf16", 64, False, False, kernel="sm90")[1].kernel == "sm80"
    # the SM90 backward needs no zeroed dQ accumulator, the SM80 one does (a preprocess of its own)
    pre90, _ = backward_keys("sm_90a", "bf16", 64, False, False, kernel="sm90")
    pre80, _ = backward_keys("sm_90a", "bf16", 64, False, False, kernel="sm80")
    assert not pre90.zero_dq_accum and pre80.zero_dq_accum and pre90.name != pre80.name
    assert backward_keys("sm_90a", "bf16", 64, False, False, kernel="sm90", smem_capacity=100 * 1024)[1].kernel == "sm80"
    assert backward_keys("sm_90a", "bf16", 64, False, False)[1].kernel == "sm80"  # forced sm80 on Hopper
    spec = parse_backward_traits("m64n128s2", 128)
    assert spec == Sm90BackwardTraits(128, 64, 128, 2) and spec.spec == "m64n128s2"
    # causal d128 runs its CTAs longest first (measured; d64 measured slower with it)
    assert SM90_BACKWARD[128][True].longest_first and SM90_BACKWARD[128][True].spec == "m64n128s2l"
    # d128 non-causal: 80-row Q blocks (dQ^T), except varlen, whose sequences start every 128 rows
    assert SM90_BACKWARD[128][False].spec == "m80n128s2"
    for f, tile_m in ((Features(), 80), (Features(softcap=True, alibi=True, local=True), 80),
                      (Features(varlen=True), 64), (Features(varlen=True, seqused=True, softcap=True), 64)):
        for d in (128, 112):
            assert backward_keys("sm_90a", "bf16", d, False, True, kernel="sm90", features=f)[1].traits.tile_m == tile_m
    # explicit 80-row traits (tools): only where the kernel can run them
    for d, f in ((64, Features()), (128, Features(varlen=True))):
        with pytest.raises(ValueError, match="80 rows"):
            backward_keys("sm_90a", "bf16", d, False, False, traits=parse_backward_traits("m80n128s2", d), features=f)
    assert not any(t.longest_first for d, by in SM90_BACKWARD.items() for c, t in by.items() if (d, c) != (128, True))
    # d64 non-causal: a persistent grid (measured), but never deterministic (dQ's turns follow the
    # one-CTA-per-block launch order)
    assert SM90_BACKWARD[64][False].persistent and SM90_BACKWARD[64][False].spec == "m128n128s2p"
    assert SM90_BACKWARD[32][False].persistent
    assert not any(t.persistent for d, by in SM90_BACKWARD.items() for c, t in by.items()
                   if (d, c) not in ((64, False), (32, False)))
    assert backward_keys("sm_90a", "bf16", 64, False, False, kernel="sm90")[1].traits.persistent
    assert not backward_keys("sm_90a", "bf16", 64, False, True, kernel="sm90")[1].traits.persistent
    assert not backward_keys("sm_90a", "bf16", 64, False, False, kernel="sm90",
                             features=Features(varlen=True))[1].traits.persistent
    # a window, causal or not, is a local kernel with the causal flag off: the non-causal entry
    # (d64 on its persistent grid, d128 80-row blocks one CTA per K/V block; measured level with
    # 64-row blocks on the persistent grid), and without the persistent grid when varlen
    for d, entry in ((64, "m128n128s2p"), (128, "m80n128s2")):
        assert backward_keys("sm_90a", "bf16", d, False, False, kernel="sm90",
                             features=Features(local=True, softcap=True))[1].traits.spec == entry
        assert not backward_keys("sm_90a", "bf16", d, False, False, kernel="sm90",
                                 features=Features(local=True, varlen=True))[1].traits.persistent
    # after the table's entry, the candidates a feature combination that spills falls back to
    # (traits.sm90_backward_fallbacks); deterministic drops the persistent grid without repeats
    fallbacks = {d: [t.spec for t in backward_keys("sm_90a", "bf16", d, False, False, kernel="sm90")[1].candidates]
                 for d in (64, 128, 192, 256)}
    assert fallbacks == {64: ["m128n128s2p", "m128n128s2"], 128: ["m80n128s2", "m64n128s2"],
                         192: ["m64n96s2d1t"], 256: ["m64n64s2d1tq2"]}
    assert [t.spec for t in backward_keys("sm_90a", "bf16", 64, False, True, kernel="sm90")[1].candidates] == [
        "m128n128s2"]
    assert [t.spec for t in backward_keys("sm_90a", "bf16", 128, True, False, kernel="sm90")[1].candidates] == [
        "m64n128s2l"]
    assert parse_backward_traits("m64n128s2lp", 128).persistent
    assert backward_keys("sm_90a", "fp16", 128, True, True, traits=spec)[1].kernel == "sm90"
    with pytest.raises(ValueError, match="sm_90a"):
        backward_keys("sm_80", "fp16", 128, True, True, traits=spec)
    with pytest.raises(ValueError, match="m64n128s2"):
        parse_backward_traits("m64x", 128)
    # the tools list the SM90 backward only for sm_90a, beside the SM80 one
    kernels = {k.kernel for k in backward_variants(["sm_80", "sm_90a"], [64], ["bf16"], [True])
               if isinstance(k, BackwardKey)}
    assert kernels == {"sm80", "sm90"}
    assert all(k.target == "sm_90a" for k in backward_variants(["sm_80", "sm_90a"], [64], ["bf16"], [True])
               if isinstance(k, BackwardKey) and k.kernel == "sm90")


def test_backward_padded_rows_hold_whole_q_blocks():
    # the dense row buffers hold every Q block of the main kernel and of the preprocess (128 rows)
    for tile_m in (64, 80, 128):
        for seqlen in (1, 17, 79, 80, 81, 113, 127, 128, 129, 160, 1000, 8192, 8193):
            rows = backward_padded_rows(seqlen, tile_m)
            assert rows % BACKWARD_ROW_PAD == 0 and rows >= -(-seqlen // tile_m) * tile_m
            assert rows - seqlen < tile_m + BACKWARD_ROW_PAD
    assert backward_padded_rows(8192, 80) == 8320 and backward_padded_rows(113, 80) == 256
    assert backward_padded_rows(8192, 64) == 8192


def test_traits_fit_ampere_and_shrink_for_small_smem():
    for d, candidates in SM80_FORWARD.items():
        for t in candidates:
            assert t.smem_bytes() <= 163 * 1024, f"d{d} does not fit A100"
            small = fit_to_smem(t, 99 * 1024)
            assert small.smem_bytes() <= 99 * 1024 and small.head_dim == d


def test_padded_head_dims():
    assert [padded_head_dim(d) for d in (8, 32, 40, 64, 72, 128, 136, 200, 256)] == [32, 32, 64, 64, 96, 128, 192, 256, 256]
    with pytest.raises(ValueError):
        padded_head_dim(264)


def test_cubin_resources_reads_registers_and_frame():
    key = forward_key("sm_80", "bf16", 32, False)
    fn = build_forward(key, keep_artifacts=True)
    res = artifacts.cubin_resources(fn.__cubin__)
    assert 32 < res["registers"] <= 255 and res["stack_frame"] == 0



def test_gqa_backward_head_splits_follow_the_measured_rule():
    # causal GQA splits a K/V head's query heads over CTAs so that the longest sequence's K/V
    # block 0 walks about a quarter of an SM's share (H100, 2026-11-26, splits 1/2/4/8 timed on
    # dense and varlen batches of 16k tokens); never non-causal or MHA
    from cute_attn.interface import backward_head_splits

    # (num_seqs, heads, heads_kv, K/V blocks of all sequences, of the longest, causal, SMs)
    assert backward_head_splits(8, 16, 2, 128, 16, True, 132) == 4  # d128 G8 8 x 2048: imbalance 0.97
    assert backward_head_splits(2, 16, 2, 128, 64, True, 132) == 4  # d128 G8 2 x 8192
    assert backward_head_splits(8, 16, 2, 128, 30, True, 132) == 4  # d128 G8 varlen, 8 sequences
    assert backward_head_splits(8, 16, 4, 128, 16, True, 132) == 2  # d128 G4 8 x 2048: 0.49
    assert backward_head_splits(2, 16, 4, 128, 64, True, 132) == 2  # d128 G4 2 x 8192
    assert backward_head_splits(8, 32, 4, 128, 16, True, 132) == 2  # d64 G8 8 x 2048
    assert backward_head_splits(8, 32, 8, 128, 16, True, 132) == 1  # d64 G4 8 x 2048: 0.24
    assert backward_head_splits(8, 32, 8, 128, 30, True, 132) == 1  # d64 G4 varlen
    assert backward_head_splits(2, 32, 8, 128, 64, True, 132) == 2  # d64 G4 2 x 8192: long CTAs
    assert backward_head_splits(1, 16, 1, 64, 64, True, 132) == 16  # MQA, one sequence: every head
    assert backward_head_splits(8, 12, 2, 128, 16, True, 132) == 3  # group 6: a divisor of it
    assert backward_head_splits(2, 16, 2, 128, 64, False, 132) == 1  # non-causal: CTAs alike
    # non-causal varlen G >= 8 with fp32 dK/dV accumulators: 4 splits (the longest sequences' CTAs)
    assert backward_head_splits(8, 16, 2, 128, 32, False, 132, accumulate=True, varlen=True) == 4
    assert backward_head_splits(8, 16, 2, 128, 32, False, 132, accumulate=False, varlen=True) == 1
    assert backward_head_splits(8, 16, 2, 128, 16, False, 132, accumulate=True, varlen=False) == 1  # dense
    assert backward_head_splits(8, 16, 4, 128, 32, False, 132, accumulate=True, varlen=True) == 1  # G4
    assert backward_head_splits(8, 24, 2, 128, 32, False, 132, accumulate=True, varlen=True) == 4  # G12
    assert backward_head_splits(2, 16, 16, 128, 64, True, 132) == 1  # MHA: nothing to split
