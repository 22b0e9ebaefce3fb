"""KV-cache decode, host side (cute_attn/kvcache.py), on CPU: every bad argument raises a
ValueError/TypeError naming it before the device check; the rotary embedding against a direct
formula; the in-place append writes exactly the expected cache rows and nothing else."""

import pytest
import torch

from cute_attn import kvcache
from cute_attn.kvcache import append_kv, apply_rotary, check_kvcache_args, rotate_q

BF16 = torch.bfloat16


def args(batch=2, seqlen_q=1, heads=4, heads_kv=2, d=64, seqlen_cache=64, new=0, rotary_dim=0, seqlen_ro=None,
         paged=False, page_size=16, max_pages=4, num_pages=None, dtype=BF16, seed=0):
    """Valid keyword arguments for check_kvcache_args (CPU tensors)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    kw = dict(q=rnd(batch, seqlen_q, heads, d))
    if paged:
        num_pages = batch * max_pages if num_pages is None else num_pages
        kw["k_cache"], kw["v_cache"] = rnd(num_pages, page_size, heads_kv, d), rnd(num_pages, page_size, heads_kv, d)
        perm = torch.randperm(num_pages, generator=g)[: batch * max_pages]
        kw["block_table"] = perm.view(batch, max_pages).to(torch.int32)
        cache_len = max_pages * page_size
    else:
        kw["k_cache"], kw["v_cache"] = rnd(batch, seqlen_cache, heads_kv, d), rnd(batch, seqlen_cache, heads_kv, d)
        cache_len = seqlen_cache
    if new:
        kw["k"], kw["v"] = rnd(batch, new, heads_kv, d), rnd(batch, new, heads_kv, d)
        kw["cache_seqlens"] = torch.zeros(batch, dtype=torch.int32)
    if rotary_dim:
        seqlen_ro = cache_len if seqlen_ro is None else seqlen_ro
        angles = torch.rand(seqlen_ro, rotary_dim // 2, generator=g) * 6.0
        kw["rotary_cos"], kw["rotary_sin"] = angles.cos().to(dtype), angles.sin().to(dtype)
    return kw


def raises(exc, match, **kw):
    with pytest.raises(exc, match=match):
        check_kvcache_args(**kw)


@pytest.fixture
def no_device_check(monkeypatch):
    """Let CPU tensors through the last (CUDA) check, to inspect the plan and run the torch parts."""
    monkeypatch.setattr(kvcache, "_check_cuda", lambda name, t: None)


# ---------------------------------------------------------------------------- valid calls
@pytest.mark.parametrize("kw", [
    dict(), dict(new=3), dict(new=2, rotary_dim=32), dict(paged=True), dict(paged=True, new=1, rotary_dim=64),
    dict(heads=8, heads_kv=1, seqlen_q=4), dict(dtype=torch.float16, new=1),
], ids=["plain", "append", "rotary", "paged", "paged-rotary", "mqa", "fp16"])
def test_valid_cpu_input_reaches_only_the_device_check(kw):
    raises(ValueError, "q must be a CUDA tensor", **args(**kw))


def test_larger_cache_batch_is_accepted():
    kw = args(batch=2)
    kw["k_cache"], kw["v_cache"] = (torch.cat([t, t]) for t in (kw["k_cache"], kw["v_cache"]))
    raises(ValueError, "CUDA tensor", **kw)


def test_smaller_cache_batch_with_cache_batch_idx_is_accepted():
    kw = args(batch=3)
    kw["k_cache"], kw["v_cache"] = kw["k_cache"][:1], kw["v_cache"][:1]
    raises(ValueError, "CUDA tensor", cache_batch_idx=torch.zeros(3, dtype=torch.int32), **kw)


# ---------------------------------------------------------------------------- q and the caches
def test_q_not_a_tensor():
    kw = args()
    kw["q"] = kw["q"].tolist()
    raises(TypeError, "q must be a torch.Tensor", **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_q_dtype(dtype):
    kw = args()
    kw["q"] = kw["q"].to(dtype)
    raises(TypeError, "q must be float16 or bfloat16", **kw)


def test_q_rank():
    kw = args()
    kw["q"] = kw["q"][0]
    raises(ValueError, "q must have 4 dims", **kw)


def test_q_head_dim():
    raises(ValueError, "q's head_dim must be a multiple of 8", **args(d=12))


@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_cache_dtype_differs_from_q(name):
    kw = args()
    kw[name] = kw[name].half()
    raises(TypeError, f"{name} must have q's dtype", **kw)


def test_cache_not_fp16_bf16():
    kw = args()
    kw["v_cache"] = kw["v_cache"].float()
    raises(TypeError, "v_cache must be float16 or bfloat16", **kw)


def test_cache_not_a_tensor():
    kw = args()
    kw["k_cache"] = None
    raises(TypeError, "k_cache must be a torch.Tensor", **kw)


def test_cache_rank():
    kw = args()
    kw["k_cache"] = kw["k_cache"][0]
    raises(ValueError, "k_cache must have 4 dims", **kw)


def test_cache_device():
    kw = args()
    kw["k_cache"] = torch.empty(kw["k_cache"].shape, dtype=BF16, device="meta")
    raises(ValueError, "k_cache must be on q's device", **kw)


def test_cache_shapes_differ():
    kw = args()
    kw["v_cache"] = kw["v_cache"][:, :32]
    raises(ValueError, "k_cache and v_cache must have the same shape", **kw)


def test_cache_head_dim():
    kw = args()
    kw["k_cache"], kw["v_cache"] = (t[..., :32] for t in (kw["k_cache"], kw["v_cache"]))
    raises(ValueError, "k_cache/v_cache head_dim 32", **kw)


def test_cache_heads_not_a_divisor():
    raises(ValueError, r"q heads \(4\) must be a multiple of k_cache/v_cache heads \(3\)", **args(heads_kv=3))


def test_cache_batch_too_small():
    kw = args(batch=3)
    kw["k_cache"], kw["v_cache"] = kw["k_cache"][:2], kw["v_cache"][:2]
    raises(ValueError, r"k_cache/v_cache batch \(2\) must be at least q's batch \(3\)", **kw)


def test_cache_last_dim_not_contiguous():
    kw = args()
    kw["k_cache"] = kw["k_cache"].transpose(1, 3).contiguous().transpose(1, 3)
    raises(ValueError, "k_cache must be contiguous in its last dim", **kw)


def test_cache_strides_not_16_bytes():
    kw = args()
    kw["v_cache"] = torch.empty(2, 64, 2, 68, dtype=BF16)[..., :64]
    kw["k_cache"] = kw["k_cache"]
    raises(ValueError, "v_cache's strides", **kw)


# ---------------------------------------------------------------------------- new k, v
def test_k_without_v():
    kw = args(new=2)
    del kw["v"]
    raises(ValueError, "k and v must both be given", **kw)


def test_v_without_k():
    kw = args(new=2)
    del kw["k"]
    raises(ValueError, "k and v must both be given", **kw)


def test_k_dtype():
    kw = args(new=2)
    kw["k"] = kw["k"].half()
    raises(TypeError, "k must have q's dtype", **kw)


def test_v_not_a_tensor():
    kw = args(new=2)
    kw["v"] = 1.0
    raises(TypeError, "v must be a torch.Tensor", **kw)


def test_k_v_shapes_differ():
    kw = args(new=2)
    kw["v"] = kw["v"][:, :1]
    raises(ValueError, "k and v must have the same shape", **kw)


@pytest.mark.parametrize("bad", ["batch", "heads", "head_dim"])
def test_k_shape(bad):
    kw = args(new=2, batch=2, heads_kv=2)
    index = {"batch": (slice(0, 1),), "heads": (slice(None), slice(None), slice(0, 1)),
             "head_dim": (Ellipsis, slice(0, 32))}[bad]
    kw["k"], kw["v"] = kw["k"][index], kw["v"][index]
    raises(ValueError, "k/v must have shape", **kw)


def test_k_longer_than_the_cache():
    raises(ValueError, r"seqlen_new \(65\) must be at most the cache length \(64\)", **args(new=65))


def test_k_requires_cache_seqlens():
    kw = args(new=2)
    kw["cache_seqlens"] = None
    raises(ValueError, "requires cache_seqlens", **kw)


def test_k_layout():
    kw = args(new=2)
    kw["k"] = kw["k"].transpose(2, 3).contiguous().transpose(2, 3)
    raises(ValueError, "k must be contiguous in its last dim", **kw)


# ---------------------------------------------------------------------------- rotary
@pytest.mark.parametrize("missing", ["rotary_cos", "rotary_sin"])
def test_rotary_one_of_two(missing):
    kw = args(new=1, rotary_dim=32)
    del kw[missing]
    raises(ValueError, "rotary_cos and rotary_sin must both be given", **kw)


def test_rotary_requires_k():
    kw = args(new=1, rotary_dim=32)
    del kw["k"], kw["v"]
    raises(ValueError, "rotary_cos/rotary_sin require new k and v", **kw)


@pytest.mark.parametrize("name", ["rotary_cos", "rotary_sin"])
def test_rotary_dtype(name):
    kw = args(new=1, rotary_dim=32)
    kw[name] = kw[name].float()
    raises(TypeError, f"{name} must have q's dtype", **kw)


def test_rotary_not_a_tensor():
    kw = args(new=1, rotary_dim=32)
    kw["rotary_cos"] = kw["rotary_cos"].tolist()
    raises(TypeError, "rotary_cos must be a torch.Tensor", **kw)


def test_rotary_rank():
    kw = args(new=1, rotary_dim=32)
    kw["rotary_sin"] = kw["rotary_sin"][0]
    raises(ValueError, "rotary_sin must have 2 dims", **kw)


def test_rotary_shapes_differ():
    kw = args(new=1, rotary_dim=32)
    kw["rotary_sin"] = torch.cat([kw["rotary_sin"]] * 2)
    raises(ValueError, "rotary_cos and rotary_sin must have the same shape", **kw)


def test_rotary_dim_not_a_multiple_of_16():
    raises(ValueError, r"rotary_dim \(2 \* shape\[1\] = 24\) must be a multiple of 16", **args(new=1, rotary_dim=24))


def test_rotary_dim_above_head_dim():
    raises(ValueError, "at most head_dim", **args(new=1, rotary_dim=80))


@pytest.mark.parametrize("paged", [False, True])
def test_rotary_shorter_than_the_cache(paged):
    raises(ValueError, r"rotary_cos/rotary_sin must have at least the cache length \(64\) rows, got 63",
           **args(new=1, rotary_dim=32, seqlen_ro=63, paged=paged, max_pages=4, page_size=16))


def test_rotary_not_contiguous():
    kw = args(new=1, rotary_dim=32)
    kw["rotary_cos"] = torch.cat([kw["rotary_cos"]] * 2, dim=1)[:, ::2]
    raises(ValueError, "rotary_cos must be contiguous", **kw)


def test_rotary_interleaved_not_a_bool():
    raises(TypeError, "rotary_interleaved must be a bool", rotary_interleaved=1, **args(new=1, rotary_dim=32))


# ---------------------------------------------------------------------------- cache_seqlens, batch idx, leftpad
@pytest.mark.parametrize("value", [1.0, True, [1, 2]])
def test_cache_seqlens_type(value):
    raises(TypeError, "cache_seqlens must be a torch.Tensor, an int or None", cache_seqlens=value, **args())


def test_cache_seqlens_dtype():
    raises(TypeError, "cache_seqlens must be int32", cache_seqlens=torch.zeros(2, dtype=torch.int64), **args())


@pytest.mark.parametrize("shape", [(3,), (2, 1), ()])
def test_cache_seqlens_shape(shape):
    raises(ValueError, r"cache_seqlens must have shape \(2,\)", cache_seqlens=torch.zeros(shape, dtype=torch.int32),
           **args())


def test_cache_seqlens_device():
    raises(ValueError, "cache_seqlens must be on q's device",
           cache_seqlens=torch.zeros(2, dtype=torch.int32, device="meta"), **args())


def test_cache_seqlens_not_contiguous():
    raises(ValueError, "cache_seqlens must be contiguous",
           cache_seqlens=torch.zeros(4, dtype=torch.int32)[::2], **args())


@pytest.mark.parametrize("value", [-1, 65])
def test_cache_seqlens_int_out_of_range(value):
    raises(ValueError, r"cache_seqlens must be in \[0, cache length \(64\)\]", cache_seqlens=value, **args())


def test_cache_seqlens_int_plus_new_past_the_cache():
    kw = args(new=4)
    kw["cache_seqlens"] = 61
    raises(ValueError, r"cache_seqlens must be in \[0, cache length \(64\) - seqlen_new \(4\)\], got 61", **kw)
    kw["cache_seqlens"] = 60
    raises(ValueError, "CUDA tensor", **kw)


@pytest.mark.parametrize("name", ["cache_batch_idx", "cache_leftpad"])
def test_index_tensors(name):
    kw = args()
    raises(TypeError, f"{name} must be a torch.Tensor", **{name: [0, 1]}, **kw)
    raises(TypeError, f"{name} must be int32", **{name: torch.zeros(2, dtype=torch.int64)}, **kw)
    raises(ValueError, rf"{name} must have shape \(2,\)", **{name: torch.zeros(1, dtype=torch.int32)}, **kw)
    raises(ValueError, f"{name} must be on q's device", **{name: torch.zeros(2, dtype=torch.int32, device="meta")},
           **kw)
    raises(ValueError, f"{name} must be contiguous", **{name: torch.zeros(4, dtype=torch.int32)[::2]}, **kw)


# ---------------------------------------------------------------------------- block_table
def test_block_table_not_a_tensor():
    kw = args(paged=True)
    kw["block_table"] = kw["block_table"].tolist()
    raises(TypeError, "block_table must be a torch.Tensor", **kw)


def test_block_table_dtype():
    kw = args(paged=True)
    kw["block_table"] = kw["block_table"].long()
    raises(TypeError, "block_table must be int32", **kw)


def test_block_table_rank():
    kw = args(paged=True)
    kw["block_table"] = kw["block_table"].flatten()
    raises(ValueError, "block_table must have 2 dims", **kw)


def test_block_table_batch():
    kw = args(paged=True, batch=2)
    kw["block_table"] = kw["block_table"][:1]
    raises(ValueError, r"block_table must have shape \(2, 4\)", **kw)


def test_block_table_device():
    kw = args(paged=True)
    kw["block_table"] = kw["block_table"].to("meta")
    raises(ValueError, "block_table must be on q's device", **kw)


def test_block_table_last_dim_not_contiguous():
    kw = args(paged=True)
    kw["block_table"] = kw["block_table"].t().contiguous().t()
    raises(ValueError, "block_table must be contiguous in its last dim", **kw)


def test_page_size_zero():
    raises(ValueError, r"page size \(k_cache.shape\[1\]\) must be positive, got 0", **args(paged=True, page_size=0))


@pytest.mark.parametrize("page_size", [1, 3, 8, 24, 100])
def test_any_page_size(no_device_check, page_size):
    plan = check_kvcache_args(**args(paged=True, page_size=page_size, max_pages=5, new=2))
    assert (plan.paged, plan.page_size, plan.cache_len) == (True, page_size, 5 * page_size)


@pytest.mark.parametrize("name", ["cache_batch_idx", "cache_leftpad"])
def test_paged_with_batch_idx_or_leftpad(name):
    raises(ValueError, f"{name} is not supported with a paged cache", **{name: torch.zeros(2, dtype=torch.int32)},
           **args(paged=True))


# ---------------------------------------------------------------------------- num_splits
@pytest.mark.parametrize("value", [True, 1.0, None])
def test_num_splits_type(value):
    raises(TypeError, "num_splits must be an int", num_splits=value, **args())


def test_num_splits_negative():
    raises(ValueError, "num_splits must be >= 0", num_splits=-1, **args())


# ---------------------------------------------------------------------------- the plan
def test_plan_fields(no_device_check):
    plan = check_kvcache_args(**args(batch=3, seqlen_q=2, heads=8, heads_kv=2, d=128, new=2, rotary_dim=64),
                              num_splits=7, rotary_interleaved=False)
    assert (plan.batch, plan.seqlen_q, plan.heads, plan.heads_kv, plan.head_dim) == (3, 2, 8, 2, 128)
    assert (plan.seqlen_new, plan.paged, plan.page_size, plan.cache_len, plan.rotary_dim) == (2, False, 0, 64, 64)
    assert (plan.num_splits, plan.rotary_interleaved, plan.max_seqlen_k) == (7, False, 64)
    assert plan.cache_batch_idx is None and plan.cache_leftpad is None and plan.block_table is None
    with pytest.raises(AttributeError):
        plan.batch = 4  # frozen


def test_plan_paged(no_device_check):
    kw = args(paged=True, page_size=32, max_pages=3, num_pages=11)
    plan = check_kvcache_args(**kw)
    assert (plan.paged, plan.page_size, plan.cache_len) == (True, 32, 96)
    assert plan.block_table is kw["block_table"]
    assert plan.cache_seqlens.tolist() == [96, 96]


def test_cache_seqlens_normalised(no_device_check):
    kw = args(batch=3)
    plan = check_kvcache_args(**kw)  # None: the whole cache
    assert plan.cache_seqlens.dtype == torch.int32 and plan.cache_seqlens.shape == (3,)
    assert plan.cache_seqlens.device == kw["q"].device and plan.cache_seqlens.tolist() == [64] * 3
    assert plan.max_seqlen_k == 64
    again = check_kvcache_args(**kw)
    assert again.cache_seqlens is plan.cache_seqlens  # built once

    plan = check_kvcache_args(cache_seqlens=5, **kw)
    assert plan.cache_seqlens.dtype == torch.int32 and plan.cache_seqlens.tolist() == [5] * 3
    assert check_kvcache_args(cache_seqlens=5, **kw).cache_seqlens is plan.cache_seqlens
    assert check_kvcache_args(cache_seqlens=6, **kw).cache_seqlens.tolist() == [6] * 3
    assert check_kvcache_args(**args(batch=2), cache_seqlens=5).cache_seqlens.tolist() == [5] * 2

    given = torch.tensor([0, 1, 64], dtype=torch.int32)
    plan = check_kvcache_args(cache_seqlens=given, **kw)
    assert plan.cache_seqlens is given and plan.max_seqlen_k == 64

    kw = args(batch=3, new=4)
    kw["cache_seqlens"] = 10
    plan = check_kvcache_args(**kw)
    assert plan.cache_seqlens.tolist() == [10] * 3 and plan.max_seqlen_k == 14


# ---------------------------------------------------------------------------- rotary
def rotary_expected(x, cos, sin, positions, interleaved):
    """The rotation written out pair by pair (float64)."""
    x = x.double()
    out = x.clone()
    half = cos.shape[1]
    positions = positions.expand(x.shape[0], x.shape[1])
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            p = int(positions[b, i])
            for j in range(half):
                c, s = float(cos[p, j]), float(sin[p, j])
                a, o = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
                out[b, i, :, a] = x[b, i, :, a] * c - x[b, i, :, o] * s
                out[b, i, :, o] = x[b, i, :, a] * s + x[b, i, :, o] * c
    return out


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("rotary_dim", [32, 64], ids=["partial", "full"])
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_apply_rotary(interleaved, rotary_dim, dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 2, 64, generator=g).to(dtype)
    angles = torch.rand(20, rotary_dim // 2, generator=g) * 6.0
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.tensor([[0, 7, 19], [3, 3, 11]], dtype=torch.int32)
    before = x.clone()
    out = apply_rotary(x, cos, sin, positions, interleaved)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(x, before)  # not in place
    expected = rotary_expected(x, cos, sin, positions, interleaved)
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), atol=1e-2, rtol=1e-2)
    # fp32 math, one rounding: within one unit in the last place of the exact result
    ulp = expected.abs().clamp_min(1e-3) * torch.finfo(dtype).eps
    assert ((out.double() - expected).abs() <= ulp + 1e-6).all()
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])  # the columns past rotary_dim untouched


def test_apply_rotary_one_position_per_sequence():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 3, 32, generator=g).to(BF16)
    angles = torch.rand(9, 16, generator=g) * 6.0
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    positions = torch.tensor([[5], [8]], dtype=torch.int32)
    out = apply_rotary(x, cos, sin, positions, False)
    expected = rotary_expected(x, cos, sin, positions, False)
    torch.testing.assert_close(out.double(), expected.to(BF16).double(), atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------------------- append_kv
def expected_append(kw, seqlens, rotated_k=None, batch_idx=None, block_table=None, page_size=0):
    """The caches after the append, written row by row."""
    k_cache, v_cache = kw["k_cache"].clone(), kw["v_cache"].clone()
    k = kw["k"] if rotated_k is None else rotated_k
    for b in range(k.shape[0]):
        for i in range(k.shape[1]):
            pos = int(seqlens[b]) + i
            if block_table is not None:
                where = (int(block_table[b, pos // page_size]), pos % page_size)
            else:
                where = (b if batch_idx is None else int(batch_idx[b]), pos)
            k_cache[where] = k[b, i]
            v_cache[where] = kw["v"][b, i]
    return k_cache, v_cache


def append(plan, kw, **extra):
    append_kv(plan, kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], kw.get("rotary_cos"), kw.get("rotary_sin"),
              plan.cache_seqlens, plan.cache_batch_idx, plan.block_table, plan.rotary_interleaved, **extra)


def test_append_dense(no_device_check):
    kw = args(batch=3, new=4, seqlen_cache=16)
    kw["cache_seqlens"] = torch.tensor([3, 0, 12], dtype=torch.int32)  # 12 + 4: fills the cache
    plan = check_kvcache_args(**kw)
    want_k, want_v = expected_append(kw, kw["cache_seqlens"])
    assert not torch.equal(want_k, kw["k_cache"])
    append(plan, kw)
    assert torch.equal(kw["k_cache"], want_k) and torch.equal(kw["v_cache"], want_v)


def test_append_int_cache_seqlens(no_device_check):
    kw = args(batch=2, new=3, seqlen_cache=16)
    kw["cache_seqlens"] = 5
    plan = check_kvcache_args(**kw)
    want_k, want_v = expected_append(kw, [5, 5])
    append(plan, kw)
    assert torch.equal(kw["k_cache"], want_k) and torch.equal(kw["v_cache"], want_v)


def test_append_cache_batch_idx(no_device_check):
    kw = args(batch=3, new=2, seqlen_cache=32)
    kw["k_cache"], kw["v_cache"] = (torch.cat([t, t[:2]]) for t in (kw["k_cache"], kw["v_cache"]))  # 5 cache rows
    kw["cache_seqlens"] = torch.tensor([7, 0, 30], dtype=torch.int32)
    kw["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32)
    plan = check_kvcache_args(**kw)
    want_k, want_v = expected_append(kw, kw["cache_seqlens"], batch_idx=kw["cache_batch_idx"])
    append(plan, kw)
    assert torch.equal(kw["k_cache"], want_k) and torch.equal(kw["v_cache"], want_v)
    for row in (1, 3):  # rows no sequence maps to: untouched
        assert torch.equal(kw["k_cache"][row], want_k[row])


def test_append_paged_shuffled(no_device_check):
    kw = args(batch=3, new=5, paged=True, page_size=16, max_pages=3, num_pages=12)
    # a page boundary crossed (14..18), the start (0..4), the last rows (43..47)
    kw["cache_seqlens"] = torch.tensor([14, 0, 43], dtype=torch.int32)
    plan = check_kvcache_args(**kw)
    want_k, want_v = expected_append(kw, kw["cache_seqlens"], block_table=kw["block_table"], page_size=16)
    append(plan, kw)
    assert torch.equal(kw["k_cache"], want_k) and torch.equal(kw["v_cache"], want_v)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_append_rotary(no_device_check, paged, interleaved):
    kw = args(batch=2, new=3, rotary_dim=32, paged=paged, seqlen_cache=64, page_size=16, max_pages=4)
    kw["cache_seqlens"] = torch.tensor([9, 30], dtype=torch.int32)
    plan = check_kvcache_args(rotary_interleaved=interleaved, **kw)
    positions = kw["cache_seqlens"][:, None].long() + torch.arange(3)
    rotated = apply_rotary(kw["k"], kw["rotary_cos"], kw["rotary_sin"], positions, interleaved)
    expected = rotary_expected(kw["k"], kw["rotary_cos"], kw["rotary_sin"], positions, interleaved)
    torch.testing.assert_close(rotated.double(), expected.to(BF16).double(), atol=1e-2, rtol=1e-2)
    want_k, want_v = expected_append(kw, kw["cache_seqlens"], rotated_k=rotated,
                                     block_table=kw.get("block_table"), page_size=16)
    k_before, v_before = kw["k"].clone(), kw["v"].clone()
    append(plan, kw)
    assert torch.equal(kw["k_cache"], want_k) and torch.equal(kw["v_cache"], want_v)
    assert torch.equal(kw["k"], k_before) and torch.equal(kw["v"], v_before)  # inputs untouched


def test_append_nothing_without_k(no_device_check):
    kw = args()
    plan = check_kvcache_args(**kw)
    before = kw["k_cache"].clone()
    append_kv(plan, kw["k_cache"], kw["v_cache"], None, None)
    assert torch.equal(kw["k_cache"], before)


# ---------------------------------------------------------------------------- rotate_q
@pytest.mark.parametrize("causal_or_local", [True, False])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_rotate_q(no_device_check, causal_or_local, interleaved):
    kw = args(batch=2, seqlen_q=3, new=3, rotary_dim=32)
    kw["cache_seqlens"] = torch.tensor([4, 20], dtype=torch.int32)
    plan = check_kvcache_args(rotary_interleaved=interleaved, **kw)
    out = rotate_q(plan, kw["q"], kw["rotary_cos"], kw["rotary_sin"], plan.cache_seqlens, causal_or_local,
                   interleaved)
    seqlens = kw["cache_seqlens"][:, None].long()
    positions = seqlens + torch.arange(3) if causal_or_local else seqlens.expand(2, 3)
    expected = rotary_expected(kw["q"], kw["rotary_cos"], kw["rotary_sin"], positions, interleaved)
    torch.testing.assert_close(out.double(), expected.to(BF16).double(), atol=1e-2, rtol=1e-2)
    assert torch.equal(out[..., 32:], kw["q"][..., 32:])


def test_rotate_q_without_rotary(no_device_check):
    kw = args(new=1)
    plan = check_kvcache_args(**kw)
    assert rotate_q(plan, kw["q"], None, None) is kw["q"]


# ---------------------------------------------------------------------------- append_kv with q (one rotary pass)
@pytest.mark.parametrize("layout", ["dense", "batch_idx", "paged"])
@pytest.mark.parametrize("causal_or_local", [True, False])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("rotary_dim", [32, 64], ids=["partial", "full"])
def test_append_with_q_equals_two_calls(no_device_check, layout, causal_or_local, interleaved, rotary_dim):
    kw = args(batch=3, seqlen_q=3, heads=4, heads_kv=2, new=2, rotary_dim=rotary_dim, paged=layout == "paged",
              seqlen_cache=64, page_size=16, max_pages=4)
    kw["cache_seqlens"] = torch.tensor([0, 15, 61], dtype=torch.int32)  # q rows up to 63: in the cos table
    if layout == "batch_idx":
        kw["cache_batch_idx"] = torch.tensor([2, 0, 1], dtype=torch.int32)
    plan = check_kvcache_args(rotary_interleaved=interleaved, **kw)
    caches = kw["k_cache"].clone(), kw["v_cache"].clone()
    q_before = kw["q"].clone()
    q_rot = append_kv(plan, kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], kw["rotary_cos"], kw["rotary_sin"],
                      rotary_interleaved=interleaved, q=kw["q"], causal_or_local=causal_or_local)
    want_q = rotate_q(plan, q_before, kw["rotary_cos"], kw["rotary_sin"], None, causal_or_local, interleaved)
    assert append_kv(plan, *caches, kw["k"], kw["v"], kw["rotary_cos"], kw["rotary_sin"],
                     rotary_interleaved=interleaved) is None
    assert torch.equal(q_rot, want_q) and q_rot.shape == kw["q"].shape
    assert torch.equal(kw["k_cache"], caches[0]) and torch.equal(kw["v_cache"], caches[1])
    assert torch.equal(kw["q"], q_before)  # q itself untouched
    seqlens = kw["cache_seqlens"][:, None].long()
    positions = seqlens + torch.arange(3) if causal_or_local else seqlens.expand(3, 3)
    expected = rotary_expected(q_before, kw["rotary_cos"], kw["rotary_sin"], positions, interleaved)
    torch.testing.assert_close(q_rot.double(), expected.to(BF16).double(), atol=1e-2, rtol=1e-2)


def test_append_with_q_without_rotary(no_device_check):
    kw = args(batch=2, new=1, seqlen_cache=16)
    kw["cache_seqlens"] = torch.tensor([3, 9], dtype=torch.int32)
    plan = check_kvcache_args(**kw)
    want_k, want_v = expected_append(kw, kw["cache_seqlens"])
    assert append_kv(plan, kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], q=kw["q"]) is kw["q"]
    assert torch.equal(kw["k_cache"], want_k) and torch.equal(kw["v_cache"], want_v)


def test_append_into_a_cache_with_uneven_rows(no_device_check):
    """A cache whose batch rows are not (seqlen_cache * row) apart (a slice of a longer one) is written
    through the (batch row, slot) index instead of the flat view."""
    kw = args(batch=2, new=3, seqlen_cache=32)
    big_k, big_v = torch.randn(2, 48, 2, 64).to(BF16), torch.randn(2, 48, 2, 64).to(BF16)
    kw["k_cache"], kw["v_cache"] = big_k[:, :32], big_v[:, :32]
    kw["cache_seqlens"] = torch.tensor([29, 4], dtype=torch.int32)
    plan = check_kvcache_args(**kw)
    want_k, want_v = expected_append(kw, kw["cache_seqlens"])
    tail_k = big_k[:, 32:].clone()
    append(plan, kw)
    assert torch.equal(kw["k_cache"], want_k) and torch.equal(kw["v_cache"], want_v)
    assert torch.equal(big_k[:, 32:], tail_k)


# ---------------------------------------------------------------------------- host cost (ops per call)
def aten_ops(fn) -> list:
    """The non-view aten ops ``fn`` runs (each costs host time on the decode path)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"view", "unsqueeze", "slice", "select", "expand", "unflatten", "_unsafe_view", "alias", "t",
             "transpose", "reshape", "as_strided", "flatten", "squeeze"}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    fn()  # the cached constants built
    with Count() as count:
        fn()
    return [op for op in count.ops if op not in views]


@pytest.mark.parametrize("case, budget", [
    (dict(), 3), (dict(batch_idx=True), 4), (dict(paged=True), 7),
    (dict(rotary_dim=64), 11), (dict(rotary_dim=32), 12), (dict(rotary_dim=32, paged=True), 15),
    (dict(rotary_dim=64, with_q=True), 12), (dict(rotary_dim=32, with_q=True, paged=True), 16),
], ids=["dense", "batch_idx", "paged", "rotary", "rotary-partial", "rotary-paged", "with-q", "with-q-paged"])
def test_append_op_count(no_device_check, case, budget):
    kw = args(batch=2, new=1, seqlen_q=1, rotary_dim=case.get("rotary_dim", 0), paged=case.get("paged", False))
    kw["cache_seqlens"] = torch.tensor([3, 5], dtype=torch.int32)
    if case.get("batch_idx"):
        kw["cache_batch_idx"] = torch.tensor([1, 0], dtype=torch.int32)
    plan = check_kvcache_args(**kw)
    q = kw["q"] if case.get("with_q") else None
    ops = aten_ops(lambda: append_kv(plan, kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], kw.get("rotary_cos"),
                                     kw.get("rotary_sin"), q=q, causal_or_local=True))
    assert len(ops) <= budget, ops
    assert not {"item", "_local_scalar_dense", "nonzero"} & set(ops)  # nothing that waits for the device


@pytest.mark.parametrize("causal_or_local, rotary_dim, budget", [(True, 64, 8), (False, 64, 7), (True, 32, 9)])
def test_rotate_q_op_count(no_device_check, causal_or_local, rotary_dim, budget):
    kw = args(batch=2, new=1, seqlen_q=2, rotary_dim=rotary_dim)
    plan = check_kvcache_args(**kw)
    ops = aten_ops(lambda: rotate_q(plan, kw["q"], kw["rotary_cos"], kw["rotary_sin"], None, causal_or_local))
    assert len(ops) <= budget, ops


def test_check_runs_no_op_on_tensors(no_device_check):
    kw = args(new=1, rotary_dim=32)
    kw["cache_seqlens"] = 7
    assert aten_ops(lambda: check_kvcache_args(**kw)) == []  # an int's tensor is built once, then cached


def test_constants_are_not_cached_while_capturing(monkeypatch):
    """During CUDA-graph capture a filled tensor holds its values only on replay, and one that a
    graph reads must never be evicted: _constant builds a fresh one then and caches nothing."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    a = kvcache._constant(("test-capture",), cuda, object)
    assert kvcache._constant(("test-capture",), cuda, object) is not a
    assert ("test-capture", cuda) not in kvcache._CONSTANTS
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    b = kvcache._constant(("test-capture",), cuda, object)
    assert kvcache._constant(("test-capture",), cuda, object) is b


def test_rotary_query_positions_follow_fa2s_window_rule():
    """Queries rotate at their own positions when causal or local, where a window side that
    reaches the cache length is dropped first (FlashAttention-2's mha_fwd_kvcache)."""
    from cute_attn.interface import _rotary_local, _score_options

    def local(causal, window, cache_len=512):
        return _rotary_local(_score_options(causal, None, 64, window), cache_len)

    assert local(True, (-1, -1)) and local(True, (600, -1)) and local(True, (3, 9))
    assert not local(False, (-1, -1))
    assert local(False, (-1, 0))  # plain causal spelled as a window
    assert local(False, (100, 0)) and local(False, (600, 5)) and local(False, (5, 600))
    assert not local(False, (600, 700)) and not local(False, (512, -1)) and not local(False, (-1, 512))
    assert local(False, (511, -1))


# ---------------------------------------------------------------------------- flash_attn_varlen_func(block_table=)
def _paged_varlen_case(lens_q, lens_k, page_size, heads=4, heads_kv=2, d=32, seed=0):
    """q (total_q, heads, d), per-sequence dense K/V and the same keys in a shuffled page pool."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(BF16)  # noqa: E731
    q = rnd(sum(lens_q), heads, d)
    ks = [rnd(n, heads_kv, d) for n in lens_k]
    vs = [rnd(n, heads_kv, d) for n in lens_k]
    max_pages = max(-(-n // page_size) for n in lens_k) or 1
    pool = len(lens_k) * max_pages + 3
    k_pages, v_pages = rnd(pool, page_size, heads_kv, d), rnd(pool, page_size, heads_kv, d)
    table = torch.randperm(pool, generator=g)[: len(lens_k) * max_pages].view(len(lens_k), max_pages).to(torch.int32)
    for b, n in enumerate(lens_k):
        for pos in range(n):
            k_pages[table[b, pos // page_size], pos % page_size] = ks[b][pos]
            v_pages[table[b, pos // page_size], pos % page_size] = vs[b][pos]
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return q, ks, vs, k_pages, v_pages, table, cu(lens_q), cu(lens_k)


def test_varlen_block_table_errors(no_device_check):
    from cute_attn import interface

    q, ks, vs, k_pages, v_pages, table, cu_q, cu_k = _paged_varlen_case([2, 3], [4, 5], page_size=4)
    call = lambda *a, **kw: interface.flash_attn_varlen_func(*a, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"k must have 4 dims \(num_pages, page_size, heads_kv, head_dim\)"):
        call(q, torch.cat(ks), torch.cat(vs), cu_q, cu_k, 3, 5, block_table=table)
    with pytest.raises(TypeError, match="block_table must be int32"):
        call(q, k_pages, v_pages, cu_q, cu_k, 3, 5, block_table=table.long())
    with pytest.raises(ValueError, match="block_table must have shape"):
        call(q, k_pages, v_pages, cu_q, cu_k, 3, 5, block_table=table[:1])
    with pytest.raises(ValueError, match="q must be contiguous in its last dim"):
        call(q.transpose(1, 2).contiguous().transpose(1, 2), k_pages, v_pages, cu_q, cu_k, 3, 5, block_table=table)
    with pytest.raises(NotImplementedError, match="block_table has no backward"):
        call(q.requires_grad_(), k_pages, v_pages, cu_q, cu_k, 3, 5, block_table=table)
