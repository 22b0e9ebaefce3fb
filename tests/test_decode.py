"""CPU checks of the decode path's host logic and block walks: packed-GQA block ranges against
every visible (query, key) pair, split-KV clipping against the whole walk, the split heuristic,
and the decode traits' page-size rule."""

import pytest

from cute_attn import interface
from cute_attn.kernels import block_info
from cute_attn.traits import HEAD_DIMS, padded_head_dim, pages_by_rows, sm80_decode_traits


def _visible(i, j, seqlen_q, seqlen_k, causal, left, right):
    d = i + seqlen_k - seqlen_q
    if causal:
        right = 0
    return j < seqlen_k and (left is None or j >= d - left) and (right is None or j <= d + right)


def _walk_blocks(walk):
    """{block: masked} of a forward_walk tuple, in visiting order."""
    n_max, n_right, n_unmasked, n_left = walk
    order = list(range(n_max - 1, n_max - 1 - (n_right + n_unmasked + n_left), -1))
    masked = [True] * n_right + [False] * n_unmasked + [True] * n_left
    return dict(zip(order, masked))


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("causal,left,right", [(False, None, None), (True, None, None), (False, 5, 0),
                                               (False, 40, 7), (True, 130, None)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 300), (4, 1000), (17, 129), (33, 33)])
def test_packed_gqa_walk_covers_visible_keys(group, causal, left, right, seqlen_q, seqlen_k):
    """Tile row p of a packed Q block is query p // group: the walk must visit every block a row
    sees, and blocks it runs unmasked must be fully visible to every (valid) row."""
    tile_m, tile_n = 64, 32
    rows_total = seqlen_q * group
    for m in range(-(-rows_total // tile_m)):
        walk = block_info.forward_walk(m, tile_m, tile_n, seqlen_q, seqlen_k, causal, left, right,
                                       qhead_per_kvhead=group)
        blocks = _walk_blocks(walk)
        queries = {p // group for p in range(m * tile_m, min((m + 1) * tile_m, rows_total))}
        for n in range(-(-seqlen_k // tile_n)):
            keys = range(n * tile_n, min((n + 1) * tile_n, seqlen_k))
            seen = [_visible(i, j, seqlen_q, seqlen_k, causal, left, right) for i in queries for j in keys]
            if any(seen):
                assert n in blocks, (m, n)
            if n in blocks and not blocks[n]:
                assert all(seen) and len(keys) == tile_n, (m, n)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("causal,left,right", [(False, None, None), (True, None, None), (False, 100, 3)])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 1000), (4, 4097), (200, 300)])
def test_split_walks_partition_the_walk(num_splits, causal, left, right, seqlen_q, seqlen_k):
    """The splits' clipped walks visit each block of the whole walk exactly once, masked exactly
    when the whole walk masks it."""
    tile_m, tile_n = 64, 64
    per_split = block_info.split_blocks(seqlen_k, tile_n, num_splits)
    for m in range(-(-seqlen_q // tile_m)):
        walk = block_info.forward_walk(m, tile_m, tile_n, seqlen_q, seqlen_k, causal, left, right)
        whole = _walk_blocks(walk)
        union = {}
        for s in range(num_splits):
            clipped = block_info.clip_walk(walk, s * per_split, (s + 1) * per_split)
            # an empty split still ends inside the walk (the kernel's prologue loads below its end)
            assert walk[0] - sum(walk[1:]) <= clipped[0] <= walk[0]
            part = _walk_blocks(clipped)
            assert all(s * per_split <= n < (s + 1) * per_split for n in part), (s, part)
            assert not set(part) & set(union)
            union.update(part)
        assert union == whole


def test_decode_num_splits():
    # a full grid or a short key range: no split
    assert interface.decode_num_splits(ctas=132, n_blocks=1000, slots=132) == 1
    assert interface.decode_num_splits(ctas=8, n_blocks=4, slots=132) == 1
    # one CTA per (batch, K/V head) on a long cache: enough splits to fill the slots, capped
    s = interface.decode_num_splits(ctas=8, n_blocks=2048, slots=132)
    assert 8 * s >= 0.9 * 132 and s <= 128
    # in one wave as full as it gets (8 x 16 = 128 of 132), where one wave fills 90% of the best
    assert s == 16
    assert interface.decode_num_splits(ctas=32, n_blocks=128, slots=132) == 4
    assert interface.decode_num_splits(ctas=24, n_blocks=300, slots=132) == 5  # 120 of 132, not 2 waves
    # one wave would leave a quarter idle: the fewest splits whose last wave is 90% full
    assert interface.decode_num_splits(ctas=100, n_blocks=1000, slots=132) == 5
    # never more splits than blocks / 4
    assert interface.decode_num_splits(ctas=1, n_blocks=40, slots=132) <= 10


def test_decode_splits_of_fewer_blocks_where_they_merge_in_the_kernel():
    """Splits that merge in the kernel keep one K/V block each with one CTA per SM; with two, two
    blocks while the splits stay within one CTA per SM, else four, as the combine kernel's always
    do. Caches of fewer than 8 blocks never split."""
    def splits(ctas, n_blocks, slots, merges=True):
        return interface.decode_num_splits(
            ctas, n_blocks, slots, min_blocks=interface.decode_min_blocks(merges, ctas, n_blocks, 132, slots))

    # B1 H32/8 (8 packed CTAs), 64-key blocks: Sk 512 / 1024 / 2048 / 4096 / 8192
    for n_blocks, combined, merged, merged_two_slots in ((8, 2, 8, 4), (16, 4, 16, 8), (32, 8, 16, 16),
                                                          (64, 16, 16, 16), (128, 16, 16, 32)):
        assert splits(8, n_blocks, 132, merges=False) == combined
        assert splits(8, n_blocks, 132) == merged
        assert splits(8, n_blocks, 264) == merged_two_slots
    assert splits(8, 48, 264) == 12  # 24 two-block splits would fill both slots: four blocks each
    assert splits(8, 2048, 264) == 33  # B1 H8 Sk 131072: as before
    for slots in (132, 264):
        for merges in (False, True):
            assert splits(8, 7, slots, merges) == 1  # Sk < 512: no split
            assert splits(slots, 1000, slots, merges) == 1  # a full grid


@pytest.mark.parametrize("head_dim", HEAD_DIMS + (72,))
@pytest.mark.parametrize("page_size", [0, 1, 16, 48, 64, 100, 192, 256])
def test_decode_traits_fit_pages(head_dim, page_size):
    unpaged = sm80_decode_traits(head_dim, 227 * 1024)
    candidates = sm80_decode_traits(head_dim, 227 * 1024, page_size)
    for t in candidates:
        assert t.tile_m == 16 * t.num_warps
        assert t.smem_bytes() <= 113 * 1024  # two CTAs fit an H100 SM (interface.decode_slots)
        assert t.head_dim == padded_head_dim(head_dim)
    if pages_by_rows(page_size):  # a page per row: the unpaged tiles
        assert candidates == unpaged
    else:  # a block per page: blocks of at least 64 keys (16-key ones read at 0.6-0.7x)
        assert all(page_size % t.tile_n == 0 and t.tile_n >= min(64, u.tile_n) for t, u in zip(candidates, unpaged))


@pytest.mark.parametrize("head_dim", [32, 64, 72, 96, 128, 256])
def test_page_sizes_share_kernels(head_dim):
    """Any page size runs (none is refused), and page sizes compile at most a few kernels: a page
    per row (features.paged_rows) for those without a power-of-two factor of 64, else a block per
    page of the page's power-of-two factor, capped at the table's tile_n."""
    from cute_attn.compile import forward_key
    from cute_attn.kernels.features import Features

    paged = Features(kvcache=True, paged=True, split=True, pack_gqa=True)
    keys = {}
    for page_size in range(1, 1025):
        key = forward_key("sm_90a", "bf16", head_dim, False, 227 * 1024, features=paged, page_size=page_size)
        assert key.features.paged_rows == (page_size % 64 != 0), (page_size, key.name)
        assert key.head_dim == padded_head_dim(head_dim)
        keys.setdefault(key.name, []).append(page_size)
    assert len(keys) <= 3, sorted(keys)
    rows = forward_key("sm_90a", "bf16", head_dim, False, 227 * 1024, features=paged, page_size=16)
    assert rows.candidates == forward_key("sm_90a", "bf16", head_dim, False, 227 * 1024,
                                          features=Features(kvcache=True, split=True, pack_gqa=True)).candidates


@pytest.mark.parametrize("head_dim,causal", [(64, False), (128, True), (192, True), (256, False)])
def test_sm90_paged_varlen_keys(head_dim, causal):
    """flash_attn_varlen_func's block_table asked of the SM90 family: one SM90 forward key for
    every page size that is a multiple of 16 keys, its length tiers built together (with the
    packed key and the decode keys its lengths can move it to); other page sizes, the sm80 family
    and the sm_80 target run the decode kernel."""
    from cute_attn.compile import forward_key, forward_tier_siblings
    from cute_attn.kernels.features import Features

    paged = Features(varlen=True, seqused=True, paged=True)
    smem = 227 * 1024
    keys = {forward_key("sm_90a", "bf16", head_dim, causal, smem, kernel="sm90", seqlen=1000, features=paged,
                        page_size=p) for p in range(16, 1025, 16)}
    assert len(keys) == 1
    key = keys.pop()
    assert key.kernel == "sm90" and key.features == paged and key.head_dim == head_dim
    assert all(t.tile_n % 16 == 0 and not t.kv_multicast for t in key.candidates)
    siblings = forward_tier_siblings(key)  # its tiers, then the paged call's other routes
    tiers = [s for s in siblings if s.features == paged]
    assert siblings[0] == key and all(s.kernel == "sm90" for s in tiers)
    assert all(s.kernel == "sm80" or s.features.pack_gqa for s in siblings if s not in tiers)
    for page_size in (1, 5, 8, 24, 40, 100):
        other = forward_key("sm_90a", "bf16", head_dim, causal, smem, kernel="sm90", seqlen=1000, features=paged,
                            page_size=page_size)
        assert other.kernel == "sm80" and other.features.paged_rows and other.candidates[0].tile_m == 64
    for target, kernel in (("sm_90a", "sm80"), ("sm_80", "sm80")):
        other = forward_key(target, "bf16", head_dim, causal, smem, kernel=kernel, seqlen=1000, features=paged,
                            page_size=64)
        assert other.kernel == "sm80" and other.candidates[0].tile_m == 64
    # packed GQA too (not with ALiBi: a slope per query head); the split-KV and KV-cache features
    # keep the decode kernel whatever the family
    packed = Features(varlen=True, seqused=True, paged=True, pack_gqa=True)
    assert forward_key("sm_90a", "bf16", head_dim, causal, smem, kernel="sm90", features=packed,
                       page_size=64).kernel == "sm90"
    for decode in (Features(varlen=True, seqused=True, paged=True, split=True, pack_gqa=True),
                   Features(varlen=True, seqused=True, paged=True, pack_gqa=True, alibi=True),
                   Features(kvcache=True, paged=True, pack_gqa=True)):
        assert forward_key("sm_90a", "bf16", head_dim, causal, smem, kernel="sm90", features=decode,
                           page_size=64).kernel == "sm80", decode


def test_paged_varlen_route(monkeypatch):
    """kvcache.sm90_paged_varlen on an H100 (132 SMs; d128 causal, heads 32/8, 16-key pages): chunks
    run the SM90 forward, packed where the batch has short sequences; a chunk beside decode rows
    runs it packed when the batch's tiles fill the GPU; decode rows alone, speculative-decode rows
    and few rows over long caches keep the decode kernel (which splits them)."""
    import torch

    from cute_attn import dispatch, interface, kvcache

    h100 = dispatch.DevicePlan(kernel="sm90", target="sm_90a", smem_capacity=227 * 1024, num_sms=132)
    monkeypatch.setattr(dispatch, "plan_for_device", lambda device: h100)
    opts = interface._score_options(True, None, 128)

    def route(lengths_q):
        q = torch.empty(sum(lengths_q), 32, 128)
        f = kvcache.sm90_paged_varlen(q, 8, opts, max(lengths_q), 16, len(lengths_q))
        return None if f is None else "packed" if f.pack_gqa else "sm90"

    assert route([1024] * 4) == "sm90" and route([128] * 16) == "sm90" and route([64] * 8) == "packed"
    assert route([512, 512] + [1] * 30) == "packed" and route([4096] + [1] * 31) == "packed"
    # a chunk beside decode rows, fewer rows than a tile's on average (measured faster packed)
    assert route([512] + [1] * 63) == "packed" and route([64] + [1] * 63) == "packed"
    assert route([128] + [1] * 500) == "packed" and route([2048] + [1] * 255) == "packed"
    # the decode kernel: decode rows alone, 4-query rows, a chunk of 64 queries beside 3 rows (32 tiles)
    assert route([1] * 64) is None and route([4] * 16) is None and route([64, 1, 1, 1]) is None
    # ALiBi (no packing): the average rule alone
    alibi = interface._score_options(True, None, 128, alibi=True)
    q = torch.empty(575, 32, 128)
    assert kvcache.sm90_paged_varlen(q, 8, alibi, 512, 16, 64) is None


def test_paged_route_kernels_are_built_together():
    """A paged call's lengths pick the decode kernel or the SM90 forward, packed or not
    (kvcache.sm90_paged_varlen): on sm_90a the keys of either route are built beside the first one
    used (compile.forward_tier_siblings), so a new batch composition does not compile; on sm_80
    only the split-KV pair."""
    from cute_attn.compile import forward_key, forward_tier_siblings
    from cute_attn.kernels.features import Features

    smem = 227 * 1024
    sm90 = {pack: forward_key("sm_90a", "bf16", 128, True, smem, kernel="sm90", seqlen=1000, page_size=16,
                              features=Features(varlen=True, seqused=True, paged=True, pack_gqa=pack))
            for pack in (False, True)}
    decode = forward_key("sm_90a", "bf16", 128, True, smem, page_size=16,
                         features=Features(varlen=True, seqused=True, paged=True, split=True, pack_gqa=True))
    kvcache = forward_key("sm_90a", "bf16", 128, True, smem, page_size=64,
                          features=Features(kvcache=True, paged=True, split=True, pack_gqa=True))
    assert {sm90[False].kernel, sm90[True].kernel, decode.kernel} == {"sm90", "sm80"}
    for key in (sm90[False], sm90[True]):
        siblings = forward_tier_siblings(key)
        assert siblings[0] == key and sm90[not key.features.pack_gqa] in siblings and decode in siblings
    for key in (decode, kvcache):
        siblings = forward_tier_siblings(key)
        assert siblings[0] == key and sm90[False] in siblings and sm90[True] in siblings
    sm80 = forward_key("sm_80", "bf16", 128, True, smem, page_size=16,
                       features=Features(kvcache=True, paged=True, split=True, pack_gqa=True))
    assert len(forward_tier_siblings(sm80)) == 2
    # ALiBi: no packed variant anywhere
    alibi = forward_key("sm_90a", "bf16", 128, True, smem, page_size=16,
                        features=Features(varlen=True, seqused=True, paged=True, alibi=True, split=True))
    assert not any(k.features.pack_gqa for k in forward_tier_siblings(alibi))


def test_sm90_packs_gqa():
    """The SM90 forward packs g query heads per K/V head where tile_m / g is a whole number of
    16-row TMA pieces in every length tier: d128 (128-row tiles) g = 2, 4, 8; d64 causal (128- and
    192-row tiers) g = 2, 4; d64 non-causal (192 rows) g = 2, 3, 4, 6, 12; never g = 1."""
    from cute_attn.traits import sm90_packs_gqa

    assert [g for g in range(1, 17) if sm90_packs_gqa(128, True, g)] == [2, 4, 8]
    assert [g for g in range(1, 17) if sm90_packs_gqa(64, True, g)] == [2, 4]
    assert [g for g in range(1, 17) if sm90_packs_gqa(64, False, g)] == [2, 3, 4, 6, 12]
    assert [g for g in range(1, 17) if sm90_packs_gqa(256, True, g)] == [2, 4, 8]


def test_two_ctas_per_sm_where_one_waits():
    """Pages read a page per row and the one-stage kernels (d192, d256) fill both decode slots of
    an SM where two CTAs fit; dense and block-per-page caches at d32-d128 one."""
    smem = 227 * 1024

    def slots(head_dim, page_size=0, capacity=smem):
        return interface.decode_slots(132, sm80_decode_traits(head_dim, capacity, page_size)[0], capacity, page_size)

    for d in (32, 64, 96, 128):
        assert slots(d) == slots(d, 64) == slots(d, 256) == 132
        assert slots(d, 16) == slots(d, 1) == slots(d, 48) == 264
    for d in (192, 256):
        assert slots(d) == slots(d, 64) == slots(d, 16) == 264
    assert slots(128, 16, capacity=99 * 1024) == 132  # sm_86: two 2-stage d128 CTAs do not fit
    # B16 Sq4 H32/8 (128 packed CTAs): 2 splits with 16-key pages, none with 64-key ones
    assert interface.decode_num_splits(128, 256, slots(128, 16)) == 2
    assert interface.decode_num_splits(128, 256, slots(128, 64)) == 1


@pytest.mark.parametrize("head_dim", HEAD_DIMS + (72,))
def test_in_kernel_merge_covers_its_tiles_in_one_pass(head_dim):
    """interface.decode_merges_in_cta sends a split launch to the kernel's own merge exactly where
    the kernel's row merge covers a tile's rows in one pass, and that covers a decode step's tiles
    (16 rows: GQA 4 at seqlen_q 4, GQA 16 at 1)."""
    import cutlass

    from cute_attn.kernels.features import Features
    from cute_attn.kernels.sm80.forward import FlashAttentionForwardSm80

    for t in sm80_decode_traits(head_dim, 227 * 1024):
        kernel = FlashAttentionForwardSm80(cutlass.BFloat16, t.head_dim, t.tile_m, t.tile_n, t.num_warps,
                                           t.num_stages, False, t.head_dim != head_dim,
                                           features=Features(kvcache=True, split=True, pack_gqa=True))
        rows = kernel.row_merge.rows_per_warp * t.num_warps
        assert interface.decode_merges_in_cta(rows, t.num_warps)
        assert not interface.decode_merges_in_cta(rows + 1, t.num_warps)
        assert rows >= 16


def test_split_counters_one_zeroed_buffer_per_stream(monkeypatch):
    """The in-kernel merge's counters: one zeroed buffer per stream, reused while large enough,
    replaced when a launch needs more tiles, and at most _SPLIT_COUNTER_STREAMS streams kept."""
    import torch

    stream = {"now": 0}
    monkeypatch.setattr(interface, "_RAW_STREAM", lambda index: stream["now"])
    monkeypatch.setattr(interface, "_SPLIT_COUNTERS", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    device = torch.device("cpu")  # (the buffers' logic only; the kernels run on CUDA devices)
    first = interface._split_counters(device, 10)
    assert first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    assert interface._split_counters(device, 10) is first
    larger = interface._split_counters(device, 5000)
    assert larger.numel() >= 5000 and not larger.any() and interface._split_counters(device, 10) is larger
    stream["now"] = 1
    assert interface._split_counters(device, 10) is not larger  # another stream, another buffer
    for s in range(2, 3 * interface._SPLIT_COUNTER_STREAMS):
        stream["now"] = s
        interface._split_counters(device, 10)
    assert len(interface._SPLIT_COUNTERS) == interface._SPLIT_COUNTER_STREAMS
