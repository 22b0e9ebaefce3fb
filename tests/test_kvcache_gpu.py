"""KV-cache decode (``flash_attn_with_kvcache``, issue 14) on the GPU (marker ``gpu``), against the
float32 reference (reference.attention_kvcache_reference, FlashAttention-2's semantics) on fresh
random caches (never zeros), on both kernel families (``arch``; on Hopper the decode path runs the
SM80-family kernel either way, both are still run).

Every call is checked whole: out against the reference (2x the error of the same computation in
the input dtype, helpers.check_close), the LSE, rows without a key exactly 0, and the entire K and
V caches against the reference's caches after the append (element by element: unwritten rows and
V bit-exact, rotated K within 2 units in the last place, the kernel rotating in float32 as the
reference does but not necessarily with the same roundings).

Compile-time choices (head dim, dtype, causal, features) are few on purpose, each a kernel to
build; the cases vary mostly over run-time values (lengths, cache_seqlens, splits, batch, pages).
The API has no ``out`` argument, so instead of an output buffer full of NaN the caching allocator
is left holding NaN blocks of the output's size before each call (``poison_allocator``).
"""

import math
import sys

import pytest
import torch

import cute_attn
from cute_attn.reference import attention_kvcache_reference
from helpers import check_close, check_lse, max_err
from helpers import arch  # noqa: F401  (autouse: every test under both kernel families)

pytestmark = pytest.mark.gpu


BF16, FP16 = torch.bfloat16, torch.float16
REFERENCE_ARGS = ("rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table",
                  "softmax_scale", "causal", "window_size", "softcap", "rotary_interleaved", "alibi_slopes")


# ---------------------------------------------------------------------------- inputs
def generator():
    g = torch.Generator(device="cuda")
    g.seed()  # fresh inputs for every case
    return g


def decode_inputs(batch, seqlen_q, heads, heads_kv, head_dim, seqlen_cache, dtype, seqlen_new=0, batch_cache=None):
    """q, k_cache, v_cache and (with seqlen_new) the new k, v: all random."""
    g = generator()

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    q = randn(batch, seqlen_q, heads, head_dim)
    k_cache = randn(batch_cache or batch, seqlen_cache, heads_kv, head_dim)
    v_cache = randn(batch_cache or batch, seqlen_cache, heads_kv, head_dim)
    k = randn(batch, seqlen_new, heads_kv, head_dim) if seqlen_new else None
    v = randn(batch, seqlen_new, heads_kv, head_dim) if seqlen_new else None
    return q, k_cache, v_cache, k, v


def cache_lengths(batch, capacity, seqlen_new=0):
    """Per-sequence cache_seqlens (int32): 0, 1 and the full cache (less the appended rows) first,
    then random ones."""
    room = capacity - seqlen_new
    values = [0, 1, room] + torch.randint(0, room + 1, (max(batch - 3, 0),)).tolist()
    values = values[:batch]
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def to_paged(k_cache, v_cache, page_size, extra_pages=5):
    """The same caches paged: (num_pages, page_size, heads_kv, d) through a shuffled block_table
    (batch, seqlen_cache / page_size) int32; pages no sequence uses hold other random values."""
    batch, seqlen_cache, heads_kv, d = k_cache.shape
    assert seqlen_cache % page_size == 0
    pages = seqlen_cache // page_size
    num_pages = batch * pages + extra_pages
    g = generator()
    table = torch.randperm(num_pages, device="cuda", generator=g)[:batch * pages].view(batch, pages).to(torch.int32)
    k_paged = torch.randn(num_pages, page_size, heads_kv, d, device="cuda", dtype=k_cache.dtype, generator=g)
    v_paged = torch.randn(num_pages, page_size, heads_kv, d, device="cuda", dtype=v_cache.dtype, generator=g)
    k_paged[table.long()] = k_cache.view(batch, pages, page_size, heads_kv, d)
    v_paged[table.long()] = v_cache.view(batch, pages, page_size, heads_kv, d)
    return k_paged, v_paged, table


def from_paged(cache, table):
    """(batch, max_pages * page_size, heads_kv, d): the pages of each sequence in table order."""
    return cache[table.long()].flatten(1, 2)


def rotary_tables(seqlen_ro, rotary_dim, dtype):
    angles = torch.rand(seqlen_ro, rotary_dim // 2, device="cuda", generator=generator()) * 2 * math.pi
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def alibi(batch, heads, per_batch):
    shape = (batch, heads) if per_batch else (heads,)
    return torch.rand(shape, device="cuda", dtype=torch.float32) * 0.48 + 0.02


def poison_allocator(*shapes_dtypes, count=4):
    """Best effort in place of an ``out`` argument: free blocks full of NaN, of the outputs' sizes,
    that the caching allocator hands to the next allocations of those sizes."""
    blocks = [torch.full(shape, float("nan"), dtype=dtype, device="cuda")
              for shape, dtype in shapes_dtypes for _ in range(count)]
    del blocks


def compile_counts():
    """(kernels held, builds, loads) of every kernel cache of cute_attn (forward_cache, and the
    combine kernel's wherever it lives)."""
    from cute_attn.compile import KernelCache

    caches = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("cute_attn") and module is not None:
            for value in list(vars(module).values()):
                if isinstance(value, KernelCache):
                    caches[id(value)] = value
    return sorted((len(c._fns), c.builds, c.loads) for c in caches.values())


# ---------------------------------------------------------------------------- checks
def check_cache(name, got, want, before, case, rotated=False):
    """The whole cache after the call against the reference's: rows the reference left alone
    bit-exact (so untouched), written rows bit-exact, or with rotary within 2 ulps."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{name}: {got.shape} {got.dtype} ({case})"
    written = (want != before).flatten(2).any(-1)  # (rows or pages, positions)
    kept = ~written
    bad = (got[kept] != want[kept]).flatten(1).any(-1)
    assert not bad.any(), f"{name}: {int(bad.sum())} rows that must stay untouched changed ({case})"
    g, w = got[written].float(), want[written].float()
    if rotated:
        tol = 2 * torch.finfo(got.dtype).eps * w.abs() + 1e-6
        bad = ((g - w).abs() > tol).flatten(1).any(-1)
    else:
        bad = (g != w).flatten(1).any(-1)
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {int(written.sum())} appended rows wrong, max error "
                           f"{max_err(g, w):.3g} ({case})")


def check_kvcache(q, k_cache, v_cache, case, k=None, v=None, atol=1e-4, num_splits=0, **options):
    """One call of flash_attn_with_kvcache (which appends into k_cache/v_cache in place) against the
    reference computed on the caches as they were. Returns (out, lse, same): same is the
    same-dtype computation, for comparing two kernel outputs with each other."""
    for name in options:
        assert name in REFERENCE_ARGS, name
    k_before, v_before = k_cache.clone(), v_cache.clone()
    ref, ref_lse, k_after, v_after = attention_kvcache_reference(q, k_before, v_before, k, v, **options)
    same = attention_kvcache_reference(q, k_before, v_before, k, v, compute_dtype=q.dtype, **options)[0]
    batch, seqlen_q, heads, _ = q.shape
    poison_allocator((q.shape, q.dtype), ((batch, heads, seqlen_q), torch.float32))
    out, lse = cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, num_splits=num_splits,
                                                 return_softmax_lse=True, **options)
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype, case)
    assert lse.shape == (batch, heads, seqlen_q) and lse.dtype == torch.float32, (lse.shape, lse.dtype, case)
    check_close("out", out, ref, same, atol, case)
    check_lse(lse, ref_lse, case)
    empty = torch.isinf(ref_lse).transpose(1, 2)  # (batch, seqlen_q, heads): queries without a key
    assert torch.all(out[empty] == 0), f"out: rows without a key are not 0 ({case})"
    check_cache("k_cache", k_cache, k_after, k_before, case, rotated=options.get("rotary_cos") is not None)
    check_cache("v_cache", v_cache, v_after, v_before, case)
    return out, lse, same


# ---------------------------------------------------------------------------- plain decode
SEQLENS_Q = [1, 4, 17]
# (head_dim, dtype): every head dim in bf16 (72 is padded), fp16 at d128
DECODE_CONFIGS = [(64, BF16), (128, BF16), (256, BF16), (72, BF16), (128, FP16)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,dtype", DECODE_CONFIGS, ids=lambda x: str(x).replace("torch.", ""))
def test_decode(head_dim, dtype, causal):
    """No append: per-sequence cache_seqlens 0, 1, full and random over caches of 77 and 1000 rows,
    seqlen_q 1, 4 and 17 (causal: a query past the keys sees none), GQA 32/8 (MHA 16/16 and MQA
    32/1 too at d128), and cache_seqlens None (the whole cache) and a python int."""
    heads_list = [(32, 8), (16, 16), (32, 1)] if head_dim == 128 else [(32, 8)]
    for heads, heads_kv in heads_list:
        for seqlen_q in SEQLENS_Q:
            for capacity in (77, 1000):
                batch = 5
                q, k_cache, v_cache, _, _ = decode_inputs(batch, seqlen_q, heads, heads_kv, head_dim, capacity, dtype)
                lengths = cache_lengths(batch, capacity)
                case = (f"d={head_dim} {dtype} causal={causal} h={heads}/{heads_kv} sq={seqlen_q} cap={capacity} "
                        f"lens={lengths.tolist()}")
                check_kvcache(q, k_cache, v_cache, case, cache_seqlens=lengths, causal=causal)
    q, k_cache, v_cache, _, _ = decode_inputs(3, 4, 32, 8, head_dim, 300, dtype)
    check_kvcache(q, k_cache, v_cache, f"d={head_dim} cache_seqlens=None", causal=causal)
    check_kvcache(q, k_cache, v_cache, f"d={head_dim} cache_seqlens=200", cache_seqlens=200, causal=causal)


def test_strided_caches_and_query():
    """Caches that are views of one K/V buffer (last dim contiguous only, as FlashAttention-2
    accepts) and q a slice of a packed buffer; the append lands in the shared buffer."""
    batch, capacity, heads_kv, d = 4, 500, 8, 128
    g = generator()
    kv = torch.randn(batch, capacity, 2, heads_kv, d, device="cuda", dtype=BF16, generator=g)
    k_cache, v_cache = kv.unbind(2)
    qkv = torch.randn(batch, 4, 32 + 2 * heads_kv, d, device="cuda", dtype=BF16, generator=g)
    q, k, v = qkv.split([32, heads_kv, heads_kv], dim=2)
    lengths = cache_lengths(batch, capacity, 4)
    check_kvcache(q, k_cache, v_cache, "strided", k, v, cache_seqlens=lengths, causal=True)


# ---------------------------------------------------------------------------- append, paged
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [None, 64])
def test_append(page_size, causal):
    """k/v appended at cache_seqlens are attended to by the same call and land at exactly rows
    cache_seqlens[b] .. + seqlen_new (paged: through the block table), the rest of the cache
    untouched; seqlen_new equal to seqlen_q or not."""
    capacity, batch = 512, 4
    for seqlen_q, seqlen_new in [(1, 1), (4, 4), (17, 17), (4, 2), (1, 3)]:
        q, k_cache, v_cache, k, v = decode_inputs(batch, seqlen_q, 32, 8, 128, capacity, BF16, seqlen_new)
        table = None
        if page_size:
            k_cache, v_cache, table = to_paged(k_cache, v_cache, page_size)
        lengths = cache_lengths(batch, capacity, seqlen_new)
        case = f"page={page_size} causal={causal} sq={seqlen_q} new={seqlen_new} lens={lengths.tolist()}"
        check_kvcache(q, k_cache, v_cache, case, k, v, cache_seqlens=lengths, block_table=table, causal=causal)


# A block per page: 64, 256, and 192 (3 blocks of 64 keys: the kernel's page index is a true
# division by blocks per page, not a shift). A page per row (features.paged_rows): 1, 5, 16, 48,
# 100, at every kind of shared-memory atom (32 columns at d32/d72/d96, 64 at d64/d128/d256).
# (Until 2026-11-26 pages of 16 keys ran 16-key blocks, whose copy passes of 32 rows at d32/d96
# wrote past the block: an illegal address, found by test_fuzz_gpu.py.)
@pytest.mark.parametrize("page_size,head_dim", [(16, 128), (48, 128), (64, 128), (192, 128), (256, 128),
                                                (16, 96), (48, 72), (16, 32), (64, 96), (1, 128), (5, 64),
                                                (100, 256), (24, 96), (1, 32)])
def test_paged_equals_contiguous(page_size, head_dim):
    """The same cache contiguous and paged through a shuffled block table (pages beyond those of the
    sequences in the pool): both match the reference, each other, and the caches after the append
    hold the same rows."""
    capacity, batch = 1024 // page_size * page_size, 4
    for seqlen_q, causal in [(1, False), (4, True), (17, False)]:
        q, k_cache, v_cache, k, v = decode_inputs(batch, seqlen_q, 32, 8, head_dim, capacity, BF16, seqlen_q)
        k_paged, v_paged, table = to_paged(k_cache, v_cache, page_size)
        lengths = cache_lengths(batch, capacity, seqlen_q)
        case = f"page={page_size} d={head_dim} sq={seqlen_q} causal={causal} lens={lengths.tolist()}"
        dense, dense_lse, same = check_kvcache(q, k_cache, v_cache, case + " contiguous", k, v,
                                               cache_seqlens=lengths, causal=causal)
        paged, paged_lse, _ = check_kvcache(q, k_paged, v_paged, case + " paged", k, v, cache_seqlens=lengths,
                                            block_table=table, causal=causal)
        check_close("paged vs contiguous", paged, dense.float(), same, 1e-4, case)
        check_lse(paged_lse, dense_lse, case)
        assert torch.equal(from_paged(k_paged, table), k_cache) and torch.equal(from_paged(v_paged, table), v_cache)


# ---------------------------------------------------------------------------- rotary
ROTARY = [  # (interleaved, rotary_dim of d128, causal, window, page_size)
    (True, 128, False, (-1, -1), None),
    (True, 64, True, (-1, -1), None),
    (False, 128, True, (-1, -1), None),
    (False, 64, False, (-1, -1), None),
    (True, 128, False, (100, 0), None),  # a local window: q rotated at its own position, as causal
    (False, 64, True, (-1, -1), 64),
    # wider than the 512-row cache on both sides: not local (FlashAttention-2 drops both sides), so
    # every query at cache_seqlens[b]; with one side inside the cache it stays local
    (False, 128, False, (600, 700), None),
    (True, 64, False, (1000, 3), 64),
]


@pytest.mark.parametrize("interleaved,rotary_dim,causal,window,page_size", ROTARY)
def test_rotary(interleaved, rotary_dim, causal, window, page_size):
    """q and the new k rotated (interleaved pairs or GPT-NeoX halves, all of d128 or its first 64
    columns): new key i at cache_seqlens[b] + i, queries there too when causal or local, else all
    at cache_seqlens[b]; the rotated k is what lands in the cache."""
    capacity, batch = 512, 4
    cos, sin = rotary_tables(capacity, rotary_dim, BF16)
    for seqlen_q, seqlen_new in [(1, 1), (4, 4), (17, 17), (4, 2)]:
        q, k_cache, v_cache, k, v = decode_inputs(batch, seqlen_q, 32, 8, 128, capacity, BF16, seqlen_new)
        table = None
        if page_size:
            k_cache, v_cache, table = to_paged(k_cache, v_cache, page_size)
        lengths = cache_lengths(batch, capacity, max(seqlen_q, seqlen_new))
        case = (f"interleaved={interleaved} rotary_dim={rotary_dim} causal={causal} window={window} "
                f"page={page_size} sq={seqlen_q} new={seqlen_new} lens={lengths.tolist()}")
        check_kvcache(q, k_cache, v_cache, case, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths,
                      block_table=table, causal=causal, window_size=window, rotary_interleaved=interleaved)


# ---------------------------------------------------------------------------- split-KV
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("page_size", [None, 64, 16])
def test_num_splits(page_size, causal):
    """num_splits 1, 2, 7 and 0 (the heuristic) give the reference's result and each other's, over
    long caches with short sequences among them (splits without a key)."""
    capacity, batch = 4096, 4
    for seqlen_q in (1, 4):
        q, k_cache, v_cache, k, v = decode_inputs(batch, seqlen_q, 32, 8, 128, capacity, BF16, seqlen_q)
        table = None
        if page_size:
            k_cache, v_cache, table = to_paged(k_cache, v_cache, page_size)
        lengths = cache_lengths(batch, capacity, seqlen_q)
        start_k, start_v = k_cache.clone(), v_cache.clone()
        outs = {}
        for num_splits in (1, 2, 7, 0):
            case = f"page={page_size} causal={causal} sq={seqlen_q} splits={num_splits} lens={lengths.tolist()}"
            k_cache.copy_(start_k)
            v_cache.copy_(start_v)
            outs[num_splits] = check_kvcache(q, k_cache, v_cache, case, k, v, num_splits=num_splits,
                                             cache_seqlens=lengths, block_table=table, causal=causal)
        same = outs[1][2]
        for num_splits in (2, 7, 0):
            case = f"page={page_size} causal={causal} sq={seqlen_q} splits={num_splits} vs 1"
            check_close("out vs num_splits=1", outs[num_splits][0], outs[1][0].float(), same, 1e-4, case)
            check_lse(outs[num_splits][1], outs[1][1], case)


# ---------------------------------------------------------------------------- masks and biases
FEATURES = [  # (name, causal, options); alibi: "shared" (heads,) or "per_batch" (batch, heads)
    ("window", False, dict(window_size=(100, 8))),
    ("window_causal_softcap", True, dict(window_size=(300, -1), softcap=5.0)),
    ("alibi_per_batch_causal", True, dict(alibi="per_batch")),
    ("window_softcap_alibi", False, dict(window_size=(60, 0), softcap=5.0, alibi="shared")),
]


def _options(options, batch, heads):
    options = dict(options)
    if "alibi" in options:
        options["alibi_slopes"] = alibi(batch, heads, options.pop("alibi") == "per_batch")
    return options


@pytest.mark.parametrize("name,causal,options", FEATURES, ids=[f[0] for f in FEATURES])
def test_window_softcap_alibi(name, causal, options):
    """Windows narrower and wider than a K/V block (splits entirely outside the window hold no
    key), softcap and ALiBi, with an append, split and not."""
    capacity, batch = 1024, 4
    for seqlen_q in (1, 17):
        for num_splits in (1, 4):
            q, k_cache, v_cache, k, v = decode_inputs(batch, seqlen_q, 32, 8, 128, capacity, BF16, seqlen_q)
            lengths = cache_lengths(batch, capacity, seqlen_q)
            case = f"{name} sq={seqlen_q} splits={num_splits} lens={lengths.tolist()}"
            check_kvcache(q, k_cache, v_cache, case, k, v, num_splits=num_splits, cache_seqlens=lengths,
                          causal=causal, **_options(options, batch, 32))


def test_all_features_fp16():
    capacity, batch = 1024, 4
    q, k_cache, v_cache, k, v = decode_inputs(batch, 4, 32, 8, 128, capacity, FP16, 4)
    lengths = cache_lengths(batch, capacity, 4)
    options = _options(dict(window_size=(200, 0), softcap=5.0, alibi="per_batch"), batch, 32)
    check_kvcache(q, k_cache, v_cache, "fp16 window softcap alibi", k, v, cache_seqlens=lengths, **options)


# ---------------------------------------------------------------------------- cache rows and left padding
BATCH_ROWS = [  # (name, causal, batch_idx, leftpad, options)
    ("batch_idx", True, True, False, dict()),
    ("leftpad", True, False, True, dict()),
    ("leftpad_window_alibi", False, False, True, dict(window_size=(50, 10), alibi="per_batch")),
    ("batch_idx_leftpad_rotary", True, True, True, dict(rotary=(False, 128))),
]


@pytest.mark.parametrize("name,causal,batch_idx,leftpad,options", BATCH_ROWS, ids=[c[0] for c in BATCH_ROWS])
def test_cache_batch_idx_and_leftpad(name, causal, batch_idx, leftpad, options):
    """cache_batch_idx: sequence b reads and appends to cache row cache_batch_idx[b] (a permutation
    of rows of a cache twice the batch, the other rows untouched); cache_leftpad: the keys start at
    cache_leftpad[b] (0, equal to cache_seqlens: only the new keys, and random), causal, window and
    ALiBi distances counted from there, rotary positions not."""
    capacity, batch = 600, 4
    for seqlen_q in (1, 4):
        q, k_cache, v_cache, k, v = decode_inputs(batch, seqlen_q, 32, 8, 128, capacity, BF16, seqlen_q,
                                                  batch_cache=2 * batch if batch_idx else None)
        lengths = cache_lengths(batch, capacity, seqlen_q)
        opts = _options(options, batch, 32)
        if batch_idx:
            opts["cache_batch_idx"] = torch.randperm(2 * batch, device="cuda")[:batch].to(torch.int32)
        if leftpad:
            ends = lengths.tolist()
            pads = [0, ends[1]] + [int(torch.randint(0, n + 1, ())) for n in ends[2:]]
            opts["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32, device="cuda")
        if "rotary" in opts:
            interleaved, rotary_dim = opts.pop("rotary")
            opts["rotary_cos"], opts["rotary_sin"] = rotary_tables(capacity, rotary_dim, BF16)
            opts["rotary_interleaved"] = interleaved
        case = f"{name} sq={seqlen_q} lens={lengths.tolist()}"
        check_kvcache(q, k_cache, v_cache, case, k, v, cache_seqlens=lengths, causal=causal, **opts)


def test_return_softmax_lse_flag():
    """Without return_softmax_lse the call returns out alone, the same out."""
    q, k_cache, v_cache, _, _ = decode_inputs(3, 4, 32, 8, 128, 300, BF16)
    lengths = cache_lengths(3, 300)
    out = cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    assert isinstance(out, torch.Tensor)
    again, lse = cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                   return_softmax_lse=True)
    assert torch.equal(out, again) and lse.shape == (3, 32, 4)


# (seqlen_q, heads, heads_kv, head_dim): tiles of 1 row (MHA), 4 and 16 rows (GQA 4 at Sq 1 and 4),
# 8 (MQA), a padded head dim; the in-kernel merge's one pass covers all of them
MERGE_CASES = [(1, 16, 16, 128), (1, 32, 8, 128), (4, 32, 8, 64), (1, 8, 1, 256), (4, 16, 4, 72)]


@pytest.mark.parametrize("page_size", [None, 64])
def test_split_merge_in_kernel_equals_combine_kernel(page_size, monkeypatch):
    """A split launch whose tiles hold a decode step's few rows merges its splits in the kernel (the
    tile's last split, interface.decode_merges_in_cta); the same calls through the combine kernel
    agree with it and both with the reference, and every counter the merge used is back at zero."""
    from cute_attn import interface

    batch, capacity = 3, 2048
    for seqlen_q, heads, heads_kv, head_dim in MERGE_CASES:
        assert interface.decode_merges_in_cta(seqlen_q * (heads // heads_kv), 4)
        q, k_cache, v_cache, _, _ = decode_inputs(batch, seqlen_q, heads, heads_kv, head_dim, capacity, BF16)
        table = None
        if page_size:
            k_cache, v_cache, table = to_paged(k_cache, v_cache, page_size)
        lengths = cache_lengths(batch, capacity)
        outs = {}
        for merged in (True, False):
            monkeypatch.setattr(interface, "_DECODE_LAUNCHES", {})  # no launch remembered from the other rule
            if not merged:
                monkeypatch.setattr(interface, "decode_merges_in_cta", lambda tile_rows, num_warps: False)
            for num_splits in (3, 16):
                case = (f"merged={merged} page={page_size} sq={seqlen_q} h={heads}/{heads_kv} d={head_dim} "
                        f"splits={num_splits} lens={lengths.tolist()}")
                outs[merged, num_splits] = check_kvcache(q, k_cache, v_cache, case, num_splits=num_splits,
                                                         cache_seqlens=lengths, block_table=table)
            monkeypatch.undo()
        for num_splits in (3, 16):
            case = f"in-kernel merge vs combine kernel, sq={seqlen_q} h={heads}/{heads_kv} splits={num_splits}"
            (out, lse, same), (out_c, lse_c, _) = outs[True, num_splits], outs[False, num_splits]
            check_close("out vs the combine kernel's", out, out_c.float(), same, 1e-4, case)
            check_lse(lse, lse_c, case)
    torch.cuda.synchronize()
    for buf in interface._SPLIT_COUNTERS.values():
        assert not buf.any(), "split counters left non-zero"


def test_split_merge_on_two_streams():
    """Split decode calls queued on two streams at once, unsynchronised (each stream has its own
    tile counters), each with its own inputs: every result is the reference's."""
    from cute_attn import interface

    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    batch, capacity = 1, 8192
    inputs = [decode_inputs(batch, 1, 32, 8, 128, capacity, BF16)[:3] for _ in streams]
    lengths = torch.tensor([capacity - 5], dtype=torch.int32, device="cuda")
    refs = [attention_kvcache_reference(q, k, v, cache_seqlens=lengths) for q, k, v in inputs]
    torch.cuda.synchronize()
    outs = [[] for _ in streams]
    for _ in range(8):
        for i, stream in enumerate(streams):
            stream.wait_stream(torch.cuda.current_stream())  # the inputs, made on the default stream
            with torch.cuda.stream(stream):
                q, k, v = inputs[i]
                outs[i].append(cute_attn.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths, num_splits=16,
                                                                 return_softmax_lse=True))
    torch.cuda.synchronize()
    for i, (ref, ref_lse, _, _) in enumerate(refs):
        q, k, v = inputs[i]
        same = attention_kvcache_reference(q, k, v, cache_seqlens=lengths, compute_dtype=BF16)[0]
        for j, (out, lse) in enumerate(outs[i]):
            check_close("out", out, ref, same, 1e-4, f"stream {i} call {j}")
            check_lse(lse, ref_lse, f"stream {i} call {j}")
    for buf in interface._SPLIT_COUNTERS.values():
        assert not buf.any(), "split counters left non-zero"


# ---------------------------------------------------------------------------- CUDA graphs, no recompiles
@pytest.mark.parametrize("page_size", [None, 64, 16])
def test_cuda_graph_decode_step(page_size):
    """A decode step (append one token, attend; num_splits auto) captured once and replayed with new
    cache_seqlens values and new q/k/v: no host synchronisation (the capture would fail), the right
    result each replay, nothing compiled; then eagerly new cache lengths and batch sizes with a fixed
    split count compile nothing either."""
    batch, capacity = 4, 2048
    q, k_cache, v_cache, k, v = decode_inputs(batch, 1, 32, 8, 128, capacity, BF16, 1)
    table = None
    if page_size:
        k_cache, v_cache, table = to_paged(k_cache, v_cache, page_size)
    lengths = cache_lengths(batch, capacity, 1)

    def step():
        return cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                                 block_table=table, causal=True, return_softmax_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    counts = compile_counts()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    g = generator()
    for values in ([0, 1, capacity - 1, 700], [1500, 3, 17, 2046], [capacity - 1] * batch, [5, 0, 64, 63]):
        with torch.no_grad():
            lengths.copy_(torch.tensor(values, dtype=torch.int32))
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=g))
        k_before, v_before = k_cache.clone(), v_cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        case = f"graph replay page={page_size} lens={values}"
        ref, ref_lse, k_after, v_after = attention_kvcache_reference(q, k_before, v_before, k, v,
                                                                     cache_seqlens=lengths, block_table=table,
                                                                     causal=True)
        same = attention_kvcache_reference(q, k_before, v_before, k, v, cache_seqlens=lengths, block_table=table,
                                           causal=True, compute_dtype=q.dtype)[0]
        check_close("out", out, ref, same, 1e-4, case)
        check_lse(lse, ref_lse, case)
        check_cache("k_cache", k_cache, k_after, k_before, case)
        check_cache("v_cache", v_cache, v_after, v_before, case)
        assert compile_counts() == counts, case

    # eagerly: fixed split counts (each warmed once), then new cache lengths and batch sizes
    for num_splits in (1, 3):
        q, k_cache, v_cache, k, v = decode_inputs(batch, 1, 32, 8, 128, capacity, BF16, 1)
        if page_size:
            k_cache, v_cache, table = to_paged(k_cache, v_cache, page_size)
        cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_lengths(batch, capacity, 1),
                                          block_table=table, causal=True, num_splits=num_splits)
    counts = compile_counts()
    for new_batch, new_capacity in ((4, 4096), (7, 1024), (1, 8192), (16, 512)):
        for num_splits in (1, 3):
            q, k_cache, v_cache, k, v = decode_inputs(new_batch, 1, 32, 8, 128, new_capacity, BF16, 1)
            table = None
            if page_size:
                k_cache, v_cache, table = to_paged(k_cache, v_cache, page_size)
            lengths = cache_lengths(new_batch, new_capacity, 1)
            case = f"b={new_batch} cap={new_capacity} splits={num_splits} page={page_size}"
            check_kvcache(q, k_cache, v_cache, case, k, v, num_splits=num_splits, cache_seqlens=lengths,
                          block_table=table, causal=True)
            assert compile_counts() == counts, f"recompiled: {case}"


# ---------------------------------------------------------------------------- edges and entry points
@pytest.mark.parametrize("page_size", [None, 64, 16])
def test_exact_size_cache_with_empty_splits(page_size):
    """A cache with no rows past the keys (full sequences) and more splits than the blocks fill:
    the splits past the last block walk nothing and must load nothing past the cache (this ran
    clean under compute-sanitizer memcheck on the H100), and still merge to the exact result."""
    batch, capacity = 2, 4096
    q, k_cache, v_cache, _, _ = decode_inputs(batch, 1, 32, 8, 128, capacity, BF16)
    lengths = torch.tensor([capacity, 1000], dtype=torch.int32, device="cuda")
    options = {}
    if page_size:
        k_cache, v_cache, table = to_paged(k_cache, v_cache, page_size, extra_pages=0)
        options["block_table"] = table
    for num_splits in (29, 128):
        check_kvcache(q, k_cache, v_cache, f"exact cache, {num_splits} splits, page={page_size}",
                      num_splits=num_splits, cache_seqlens=lengths, **options)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_takes_the_split_path(causal):
    """forward / flash_attn_func with few query rows over many keys run split-KV by themselves;
    the result, the LSE and the gradients (the backward is the regular kernel's, from that LSE)
    match the reference."""
    from cute_attn.reference import attention_reference

    for batch, seqlen_q, heads, heads_kv, seqlen_k in [(1, 1, 8, 8, 8192), (1, 17, 32, 8, 4096), (2, 128, 4, 1, 2048)]:
        q, k, v, _, _ = decode_inputs(batch, seqlen_q, heads, heads_kv, 128, seqlen_k, BF16)
        case = f"forward split b={batch} sq={seqlen_q} h={heads}/{heads_kv} sk={seqlen_k} causal={causal}"
        assert cute_attn.interface._underfilled(q, k), case
        ref, ref_lse = attention_reference(q, k, v, causal=causal)
        same, _ = attention_reference(q, k, v, causal=causal, compute_dtype=BF16)
        out, lse = cute_attn.forward(q, k, v, causal=causal, return_lse=True)
        check_close("out", out, ref, same, 1e-4, case)
        check_lse(lse, ref_lse, case)
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        dout = torch.randn_like(q)
        cute_attn.flash_attn_func(qg, kg, vg, causal=causal).backward(dout)
        qr, kr, vr = (t.float().clone().requires_grad_(True) for t in (q, k, v))
        attention_reference(qr, kr, vr, causal=causal)[0].backward(dout.float())
        for name, got, want in (("dq", qg.grad, qr.grad), ("dk", kg.grad, kr.grad), ("dv", vg.grad, vr.grad)):
            err, scale = max_err(got.float(), want), want.abs().max().item()
            assert err <= 2e-2 * scale + 1e-3, f"{name}: {err:.3g} (scale {scale:.3g}, {case})"


def test_torch_compile_and_opcheck():
    """flash_attn_with_kvcache under torch.compile(fullgraph=True) (the custom op fwd_kvcache, which
    mutates the caches) equals the eager call, appending into the caches the same way; opcheck passes."""
    q, k_cache, v_cache, k, v = decode_inputs(3, 2, 16, 4, 64, 512, BF16, seqlen_new=2)
    lengths = torch.tensor([0, 100, 510], dtype=torch.int32, device="cuda")
    kc_eager, vc_eager = k_cache.clone(), v_cache.clone()
    eager = cute_attn.flash_attn_with_kvcache(q, kc_eager, vc_eager, k, v, cache_seqlens=lengths, causal=True)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda *a: cute_attn.flash_attn_with_kvcache(*a, cache_seqlens=lengths, causal=True), fullgraph=True)
    got = compiled(q, k_cache, v_cache, k, v)
    assert torch.equal(got, eager) and torch.equal(k_cache, kc_eager) and torch.equal(v_cache, vc_eager)
    args = (q, k_cache.clone(), v_cache.clone(), k, v, None, None, lengths, None, None, None, None, None, True, -1, -1,
            0.0, True, None, 0)
    torch.library.opcheck(torch.ops.cute_attn.fwd_kvcache, args)


# ---------------------------------------------------------------------------- chunked prefill
@pytest.mark.parametrize("page_size,head_dim,options", [
    (None, 128, dict(causal=True)), (16, 128, dict(causal=True)), (64, 64, dict()),
    (None, 256, dict(causal=True, window_size=(200, 0))), (16, 96, dict(causal=True, softcap=30.0)),
    (128, 128, dict(causal=True, alibi="per_batch")), (None, 192, dict()), (32, 128, dict(causal=True, rotary=64)),
])
def test_chunked_prefill(page_size, head_dim, options):
    """flash_attn_with_kvcache with chunks of 128 and 200 queries whose own keys are appended first
    (chunked prefill; on Hopper the SM90 forward, which reads a contiguous cache as a page per cache
    row: here through cache_batch_idx into a cache of 5 rows), against the reference; cache_seqlens
    0, 1, full and random; GQA 16/4; rotary on one case. A contiguous cache of 1000 rows is no
    multiple of 16 keys: the decode kernel there."""
    batch, heads, heads_kv = 4, 16, 4
    for seqlen_q, capacity in ((128, 1000 if page_size is None else 1024), (200, 1024)):
        q, k_cache, v_cache, k, v = decode_inputs(batch, seqlen_q, heads, heads_kv, head_dim, capacity, BF16, seqlen_q,
                                                  batch_cache=None if page_size else 5)
        opts = _options(options, batch, heads)
        rotary_dim = opts.pop("rotary", 0)
        if rotary_dim:
            opts["rotary_cos"], opts["rotary_sin"] = rotary_tables(capacity, rotary_dim, BF16)
        if page_size:
            k_cache, v_cache, opts["block_table"] = to_paged(k_cache, v_cache, page_size)
        else:
            opts["cache_batch_idx"] = torch.tensor([4, 0, 2, 1], dtype=torch.int32, device="cuda")
        lengths = cache_lengths(batch, capacity, seqlen_q)
        case = f"page={page_size} d={head_dim} sq={seqlen_q} cap={capacity} {options} lens={lengths.tolist()}"
        check_kvcache(q, k_cache, v_cache, case, k, v, cache_seqlens=lengths, **opts)


# ---------------------------------------------------------------------------- rows past the keys
@pytest.mark.parametrize("page_size", [None, 16])
def test_cache_rows_past_the_keys_may_hold_nan(page_size):
    """A cache allocated with torch.empty and filled only up to each sequence's length: FlashAttention-2
    reads nothing past cache_seqlens (its loads zero-fill those rows), so neither may a kernel here,
    where a 0 probability times a NaN value would still make NaN. Every row past a sequence's keys
    (and every slot of its pages past them) holds NaN; chunks of 200 queries (on Hopper under the
    sm90 family the SM90 forward, which loads whole 16-key pieces and K/V blocks) and decode steps,
    causal or not, against the reference on the rows in use."""
    batch, heads, heads_kv, head_dim, capacity = 4, 16, 4, 128, 512
    lengths = torch.tensor([37, 300, 1, 129], dtype=torch.int32, device="cuda")
    for seqlen_q in (200, 1):
        q, k_cache, v_cache, _, _ = decode_inputs(batch, seqlen_q, heads, heads_kv, head_dim, capacity, BF16)
        past = torch.arange(capacity, device="cuda")[None, :] >= lengths[:, None]
        k_cache[past], v_cache[past] = float("nan"), float("nan")
        opts = {}
        if page_size:
            k_cache, v_cache, opts["block_table"] = to_paged(k_cache, v_cache, page_size)
        for causal in (False, True):
            case = f"page={page_size} sq={seqlen_q} causal={causal}"
            ref, ref_lse, _, _ = attention_kvcache_reference(q, k_cache, v_cache, cache_seqlens=lengths, causal=causal,
                                                             **opts)
            same = attention_kvcache_reference(q, k_cache, v_cache, cache_seqlens=lengths, causal=causal,
                                               compute_dtype=BF16, **opts)[0]
            out, lse = cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=causal,
                                                         return_softmax_lse=True, **opts)
            check_close("out", out, ref, same, 1e-4, case)
            check_lse(lse, ref_lse, case)
            if page_size:  # the paged varlen call over the same pages
                cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device="cuda")
                cu_k = torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])
                with torch.no_grad():
                    out_v = cute_attn.flash_attn_varlen_func(q.flatten(0, 1), k_cache, v_cache, cu_q, cu_k, seqlen_q,
                                                             int(lengths.max()), causal=causal,
                                                             block_table=opts["block_table"])
                check_close("out", out_v.view(q.shape), ref, same, 1e-4, f"varlen {case}")


# ---------------------------------------------------------------------------- flash_attn_varlen_func(block_table=)
@pytest.mark.parametrize("page_size,head_dim,options", [
    (16, 128, dict(causal=True)), (64, 128, dict()), (16, 64, dict(window_size=(100, 0))),
    (1, 96, dict(causal=True, softcap=20.0)), (48, 256, dict(causal=True)),
    (16, 128, dict(causal=True, alibi_slopes="per batch")), (32, 128, dict(causal=True, seqused_k="7 fewer")),
])
def test_varlen_block_table(page_size, head_dim, options):
    """FlashAttention-2's paged varlen call (vLLM's chunked prefill and decode in one batch): packed
    queries of 0, 1, 17, 5, 129 and 40 rows over paged keys of 0, 30, 17, 200, 129 and 1000
    positions, GQA 8/2, against the fp32 reference run sequence by sequence; max_seqlen_q above the
    longest; outputs poisoned first; split-KV as the heuristic picks it (num_splits is not an
    argument here: auto only). Under torch.no_grad (no backward). 32 queries per sequence on
    average, 128 tile rows with the 4 query heads of a K/V head packed: under the sm90 family the
    SM90 forward with packed GQA where the page size allows (kvcache.sm90_paged_varlen), else and
    under sm80 the decode kernel."""
    check_varlen_block_table(page_size, head_dim, options, [0, 1, 17, 5, 129, 40], [0, 30, 17, 200, 129, 1000], 140)


@pytest.mark.parametrize("page_size,head_dim,options", [
    (16, 128, dict(causal=True)), (32, 64, dict()), (256, 128, dict(window_size=(500, 0))),
    (48, 96, dict(causal=True, softcap=30.0)), (16, 192, dict(causal=True)), (64, 256, dict()),
    (128, 128, dict(causal=True, alibi_slopes="per batch")), (16, 128, dict(causal=True, seqused_k="7 fewer")),
    (16, 64, dict(window_size=(300, 50))), (16, 32, dict(causal=True)),
    (16, 128, dict(causal=True, heads=(6, 2))), (32, 96, dict(heads=(4, 4))), (16, 64, dict(causal=True, heads=(16, 2))),
])
def test_varlen_block_table_prefill(page_size, head_dim, options):
    """The paged varlen call on chunked-prefill batches (long query chunks, the SM90 forward's
    case on Hopper: a TMA load per 16 keys of a page): chunks of 0, 1, 130, 1000, 257 and 64
    queries over 5, 64, 300, 1000, 2000 and 17 keys (the last sees fewer keys than it has queries:
    bottom-right aligned, its first rows see none under causal), every head dim, page sizes 16 to
    256, causal, windows, softcap, ALiBi, seqused_k; GQA 8/2 (packed on SM90), 6/2 and 16/2 (3 and
    8 query heads per K/V head: not packed there, tile_m / g is no whole number of 16-row pieces in
    every tier) and MHA."""
    check_varlen_block_table(page_size, head_dim, options, [0, 1, 130, 1000, 257, 64], [5, 64, 300, 1000, 2000, 17],
                             1000)


def test_varlen_block_table_compiled():
    """The paged varlen call under torch.compile(fullgraph=True) (the custom op fwd_varlen_paged)
    equals the eager call; opcheck passes on the op."""
    g = generator()
    lens_q, lens_k, page = [130, 3, 300], [300, 40, 300], 16  # 144 queries per sequence: the SM90 forward
    q = torch.randn(sum(lens_q), 8, 128, device="cuda", dtype=BF16, generator=g)
    k_dense, v_dense = (torch.randn(3, 304, 2, 128, device="cuda", dtype=BF16, generator=g) for _ in range(2))
    k_pages, v_pages, table = to_paged(k_dense, v_dense, page)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")  # noqa: E731
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    call = lambda q, kp, vp, cq, ck, t: cute_attn.flash_attn_varlen_func(  # noqa: E731
        q, kp, vp, cq, ck, 300, 300, causal=True, block_table=t)
    with torch.no_grad():
        eager = call(q, k_pages, v_pages, cu_q, cu_k, table)
        torch._dynamo.reset()
        got = torch.compile(call, fullgraph=True)(q, k_pages, v_pages, cu_q, cu_k, table)
    assert torch.equal(got, eager)
    torch.library.opcheck(torch.ops.cute_attn.fwd_varlen_paged,
                          (q, k_pages, v_pages, cu_q, cu_k, 300, 300, table, None, None, True, -1, -1, 0.0, None))


def check_varlen_block_table(page_size, head_dim, options, lens_q, lens_k, max_q):
    from cute_attn.reference import attention_reference

    g = generator()
    options = dict(options)
    heads, heads_kv = options.pop("heads", (8, 2))
    if options.get("alibi_slopes") == "per batch":
        options["alibi_slopes"] = alibi(len(lens_q), heads, per_batch=True)
    used = None
    if options.pop("seqused_k", None):
        used = [max(0, n - 7) for n in lens_k]
    q = torch.randn(sum(lens_q), heads, head_dim, device="cuda", dtype=BF16, generator=g)
    ks = [torch.randn(n, heads_kv, head_dim, device="cuda", dtype=BF16, generator=g) for n in lens_k]
    vs = [torch.randn(n, heads_kv, head_dim, device="cuda", dtype=BF16, generator=g) for n in lens_k]
    capacity = -(-max(lens_k) // page_size) * page_size
    # the rows past each sequence's keys hold other numbers: they must not be attended
    k_dense, v_dense = (torch.randn(len(lens_k), capacity, heads_kv, head_dim, device="cuda", dtype=BF16, generator=g)
                        for _ in range(2))
    for b, n in enumerate(lens_k):
        k_dense[b, :n], v_dense[b, :n] = ks[b], vs[b]
    k_pages, v_pages, table = to_paged(k_dense, v_dense, page_size)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")  # noqa: E731
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    seqused = None if used is None else torch.tensor(used, dtype=torch.int32, device="cuda")
    poison_allocator((q.shape, BF16), ((heads, q.shape[0]), torch.float32))
    with torch.no_grad():
        out, lse, _ = cute_attn.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max_q, max(lens_k),
                                                       return_attn_probs=True, block_table=table, seqused_k=seqused,
                                                       **options)
        if not options and used is None:  # FlashAttention-2's positional order: block_table after return_attn_probs
            again = cute_attn.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, max_q, max(lens_k), 0.0, None,
                                                     False, (-1, -1), 0.0, None, False, False, table)
            assert torch.equal(again, out)
    assert out.shape == q.shape and lse.shape == (heads, q.shape[0])
    for b, (q0, q1) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist())):
        if q1 == q0:
            continue
        n = lens_k[b] if used is None else used[b]
        case = f"page={page_size} d={head_dim} seq {b} (sq={q1 - q0}, sk={n})"
        opts = dict(options)
        if "alibi_slopes" in opts:
            opts["alibi_slopes"] = opts["alibi_slopes"][b]
        ref, ref_lse = attention_reference(q[None, q0:q1], ks[b][None, :n], vs[b][None, :n], **opts)
        same, _ = attention_reference(q[None, q0:q1], ks[b][None, :n], vs[b][None, :n], compute_dtype=BF16, **opts)
        check_close("out", out[None, q0:q1], ref, same, 1e-4, case)
        check_lse(lse[None, :, q0:q1], ref_lse, case)
