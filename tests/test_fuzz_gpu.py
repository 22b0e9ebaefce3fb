"""Seeded random cases over the run-time values the fixed grids of the other GPU tests pick by hand
(marker ``gpu``): forward and backward of dense and varlen attention, on both kernel families
(``arch``), against the float32 reference, outputs and gradients poisoned before launch.

Each seed draws one configuration (head dim, dtype, causal, window / softcap / ALiBi / varlen /
seqused_k, deterministic, entry point), which is what compiles, and then ``INSTANCES`` calls of it
with run-time values drawn freely: batch, heads and GQA group, lengths (0, 1, odd, tile edges,
up to ~2000; per sequence in a varlen batch, seqlen_q != seqlen_k), window edges (narrower than a
tile, wider than several, one side open), softcap and ALiBi values, softmax_scale, max_seqlen
above the longest sequence, and memory layouts (heads-major, a packed qkv tensor, rows padded
past the head dim). The inputs themselves are fresh random numbers on every run; the seed fixes
only the shapes and options, so a failure names its seed and instance and reruns with the same
shapes (``CUTE_ATTN_FUZZ_FIRST`` = seed, ``CUTE_ATTN_FUZZ_SEEDS`` = 1).

``CUTE_ATTN_FUZZ_SEEDS`` (default 8: each seed compiles kernels of its own) and
``CUTE_ATTN_FUZZ_FIRST`` (default 0) choose the seeds; ``fuzz_keys`` lists the kernels they
compile, for building ahead of time (prebuild.prebuild). ``test_fuzz_kvcache`` does the same for
``flash_attn_with_kvcache`` (its own configuration per seed).
"""

import dataclasses
import os
import random
from dataclasses import dataclass

import pytest
import torch

import cute_attn
from cute_attn.reference import attention_reference
from helpers import (alibi, check_close, check_dense, check_lse, check_varlen, flash_baselines, grad_floor,
                     reference_grads)
from helpers import arch  # noqa: F401  (autouse: every test under both kernel families)

pytestmark = pytest.mark.gpu

FIRST_SEED = int(os.environ.get("CUTE_ATTN_FUZZ_FIRST", "0"))
NUM_SEEDS = int(os.environ.get("CUTE_ATTN_FUZZ_SEEDS", "8"))
INSTANCES = 4  # run-time draws per configuration (per compiled kernel set)

HEAD_DIMS = [32, 64, 96, 128, 128, 128, 160, 192, 256, 72]  # d128 weighted; 72 and 160 padded / between tiers
# lengths at and around tile edges (64, 80, 128, 176 rows or keys), odd ones, 0 and 1
EDGE_LENGTHS = [0, 1, 2, 17, 63, 64, 65, 79, 80, 81, 113, 127, 128, 129, 175, 176, 177, 255, 256, 257]
WINDOW_EDGES = [0, 1, 7, 37, 63, 64, 65, 127, 128, 129, 300]
MAX_SCORES = 48_000_000  # batch * heads * seqlen_q * seqlen_k of one dense call (the references' memory)


@dataclass(frozen=True)
class ScoreConfig:
    """The compile-time choices every entry point shares."""

    head_dim: int
    dtype: torch.dtype
    causal: bool
    window: bool
    softcap: bool
    alibi: bool


@dataclass(frozen=True)
class FuzzConfig(ScoreConfig):
    """The compile-time choices of one seed (dense and varlen)."""

    varlen: bool
    seqused: bool
    deterministic: bool
    autograd: bool  # flash_attn_func / flash_attn_varlen_func instead of forward/backward with buffers


def fuzz_config(seed: int) -> FuzzConfig:
    rng = random.Random(seed)
    varlen = rng.random() < 0.4
    return FuzzConfig(
        head_dim=rng.choice(HEAD_DIMS),
        dtype=torch.float16 if rng.random() < 0.3 else torch.bfloat16,
        causal=rng.random() < 0.5,
        window=rng.random() < 0.35,
        softcap=rng.random() < 0.3,
        alibi=rng.random() < 0.3,
        varlen=varlen,
        seqused=varlen and rng.random() < 0.3,
        deterministic=rng.random() < 0.2,
        autograd=rng.random() < 0.3,
    )


def _length(rng: random.Random, allow_zero: bool) -> int:
    while True:
        n = rng.choice(EDGE_LENGTHS) if rng.random() < 0.5 else rng.randint(1, 2000)
        if n or allow_zero:
            return n


def _window(rng: random.Random, causal: bool) -> tuple[int, int]:
    """Edges that keep the local kernel (not (-1, -1), not plain causal)."""
    edge = lambda: rng.choice(WINDOW_EDGES) if rng.random() < 0.7 else rng.randint(0, 1500)  # noqa: E731
    if causal:
        return edge(), 0
    while True:
        left = -1 if rng.random() < 0.25 else edge()
        right = -1 if rng.random() < 0.25 else edge()
        if left >= 0 or right > 0:
            return left, right


def fuzz_instances(seed: int) -> list[dict]:
    """The run-time draws of one seed: plain values (no tensors), so that keys can be listed on a
    machine without a GPU."""
    cfg, rng = fuzz_config(seed), random.Random(seed * 7919 + 1)
    instances = []
    for _ in range(INSTANCES):
        heads_kv = rng.randint(1, 4)
        heads = heads_kv * rng.choice([1, 1, 2, 3, 4, 8])
        inst = dict(
            heads=heads, heads_kv=heads_kv,
            window_size=_window(rng, cfg.causal) if cfg.window else (-1, -1),
            softcap=rng.choice([0.5, 2.0, 5.0, 30.0]) if cfg.softcap else 0.0,
            alibi_per_batch=rng.random() < 0.5,
            softmax_scale=None if rng.random() < 0.6 else round(rng.uniform(0.03, 0.3), 4),
            layout=rng.choice(["contiguous", "contiguous", "heads_major", "padded_rows", "packed_qkv"]),
        )
        if cfg.varlen:
            num_seqs = rng.randint(1, 12)
            inst["lengths_q"] = [_length(rng, True) for _ in range(num_seqs)]
            inst["lengths_k"] = [_length(rng, True) for _ in range(num_seqs)]
            inst["seqused_k"] = [rng.randint(0, n) for n in inst["lengths_k"]] if cfg.seqused else None
            extra = rng.random() < 0.3
            inst["max_seqlens"] = (max(inst["lengths_q"]) + (rng.randint(1, 200) if extra else 0),
                                   max(inst["lengths_k"]) + (rng.randint(1, 200) if extra else 0))
        else:
            batch = rng.randint(1, 3)
            seqlen_q, seqlen_k = _length(rng, rng.random() < 0.1), _length(rng, rng.random() < 0.1)
            while batch * heads * seqlen_q * seqlen_k > MAX_SCORES:
                seqlen_q, seqlen_k = max(1, seqlen_q // 2), max(1, seqlen_k // 2)
            inst.update(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        instances.append(inst)
    return instances


def _describe(seed: int, index: int, cfg: FuzzConfig, inst: dict) -> str:
    return f"seed {seed} instance {index}: {cfg} {inst}"


# ---------------------------------------------------------------------------- inputs
def _strided(shape, dtype, layout: str, seq_dim: int) -> torch.Tensor:
    """A fresh random tensor of ``shape`` (..., seqlen, heads, head_dim) in ``layout``:
    heads-major (a transposed view), rows padded past the head dim, or contiguous."""
    if layout == "heads_major":
        dims = list(shape)
        dims[seq_dim], dims[seq_dim + 1] = dims[seq_dim + 1], dims[seq_dim]
        return torch.randn(dims, device="cuda", dtype=dtype).transpose(seq_dim, seq_dim + 1)
    if layout == "padded_rows":
        return torch.randn(*shape[:-1], shape[-1] + 8, device="cuda", dtype=dtype)[..., : shape[-1]]
    return torch.randn(shape, device="cuda", dtype=dtype)


def _qkv(shape_q, shape_k, dtype, layout: str, seq_dim: int):
    if layout == "packed_qkv" and shape_q == shape_k:  # q, k, v as views of one (..., 3, heads, d) tensor
        packed = torch.randn(*shape_q[:-2], 3, *shape_q[-2:], device="cuda", dtype=dtype)
        return packed.unbind(-3)
    layout = "contiguous" if layout == "packed_qkv" else layout
    return _strided(shape_q, dtype, layout, seq_dim), _strided(shape_k, dtype, layout, seq_dim), \
        _strided(shape_k, dtype, layout, seq_dim)


def _options(cfg: FuzzConfig, inst: dict, batch: int) -> dict:
    options = dict(window_size=inst["window_size"], softcap=inst["softcap"], softmax_scale=inst["softmax_scale"])
    if cfg.alibi:
        options["alibi_slopes"] = alibi(batch, inst["heads"], inst["alibi_per_batch"])
    return options


# ---------------------------------------------------------------------------- checks
def _check_autograd_dense(q, k, v, cfg: FuzzConfig, options: dict, case: str):
    """flash_attn_func (FlashAttention-2's positional order) forward and backward through autograd."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse, _ = cute_attn.flash_attn_func(q, k, v, 0.0, options["softmax_scale"], cfg.causal, options["window_size"],
                                            options["softcap"], options.get("alibi_slopes"), cfg.deterministic, True)
    ref, ref_lse = attention_reference(q, k, v, cfg.causal, **options)
    same, _ = attention_reference(q, k, v, cfg.causal, compute_dtype=q.dtype, **options)
    check_close("out", out.detach(), ref, same, 1e-4, case)
    check_lse(lse, ref_lse, case)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_grads = reference_grads(q, k, v, dout, cfg.causal, options, torch.float32)
    same_grads = reference_grads(q, k, v, dout, cfg.causal, options, q.dtype)
    flash_grads = flash_baselines(q, k, v, dout, cfg.causal, options, out)
    for name, got, r, s, f in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref_grads, same_grads, flash_grads):
        check_close(name, got, r, (s, *f), 1e-4, case, floor=grad_floor(r, got.dtype))


def _check_repeatable(run, case: str):
    """A deterministic backward gives the same bits twice."""
    first, again = run(), run()
    for name, a, b in zip(("dq", "dk", "dv"), first, again):
        assert torch.equal(a, b), f"{name}: deterministic backward not bitwise repeatable ({case})"


def _run_dense(cfg: FuzzConfig, inst: dict, case: str):
    batch, sq, sk = inst["batch"], inst["seqlen_q"], inst["seqlen_k"]
    q, k, v = _qkv((batch, sq, inst["heads"], cfg.head_dim), (batch, sk, inst["heads_kv"], cfg.head_dim), cfg.dtype,
                   inst["layout"], 1)
    options = _options(cfg, inst, batch)
    if cfg.autograd:
        _check_autograd_dense(q, k, v, cfg, options, case)
        return
    check_dense(q, k, v, cfg.causal, options, case, deterministic=cfg.deterministic)
    if cfg.deterministic:
        out, lse = cute_attn.forward(q, k, v, causal=cfg.causal, return_lse=True, **options)
        dout = torch.randn_like(out)
        _check_repeatable(lambda: cute_attn.backward(dout, q, k, v, out, lse, causal=cfg.causal, deterministic=True,
                                                     **options), case)


def _run_varlen(cfg: FuzzConfig, inst: dict, case: str):
    lengths_q, lengths_k = inst["lengths_q"], inst["lengths_k"]
    cu_q = torch.tensor([0] + lengths_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lengths_k, device="cuda").cumsum(0).to(torch.int32)
    layout = "contiguous" if inst["layout"] == "packed_qkv" and lengths_q != lengths_k else inst["layout"]
    q, k, v = _qkv((sum(lengths_q), inst["heads"], cfg.head_dim), (sum(lengths_k), inst["heads_kv"], cfg.head_dim),
                   cfg.dtype, layout, 0)
    options = _options(cfg, inst, len(lengths_q))
    if inst["seqused_k"] is not None:
        options["seqused_k"] = torch.tensor(inst["seqused_k"], device="cuda", dtype=torch.int32)
    max_q, max_k = inst["max_seqlens"]
    check_varlen(q, k, v, cu_q, cu_k, cfg.causal, options, case, deterministic=cfg.deterministic,
                 max_seqlens=(max_q, max_k))
    if cfg.autograd:
        # flash_attn_varlen_func (FA2's positional order) through autograd against the direct calls
        # just checked, with one dout: the same kernels, so equal up to the order of fp32 atomics
        # (bitwise when deterministic)
        qa, ka, va = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = cute_attn.flash_attn_varlen_func(qa, ka, va, cu_q, cu_k, max_q, max_k, 0.0, options["softmax_scale"],
                                               cfg.causal, options["window_size"], options["softcap"],
                                               options.get("alibi_slopes"), cfg.deterministic,
                                               seqused_k=options.get("seqused_k"))
        dout = torch.randn_like(out)
        out.backward(dout)
        out_d, lse_d = cute_attn.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=cfg.causal,
                                                return_lse=True, **options)
        direct = cute_attn.varlen_backward(dout, q, k, v, out_d, lse_d, cu_q, cu_k, max_q, max_k, causal=cfg.causal,
                                           deterministic=cfg.deterministic, **options)
        assert torch.equal(out.detach(), out_d), f"out: autograd differs from varlen_forward ({case})"
        for name, a, b in zip(("dq", "dk", "dv"), (qa.grad, ka.grad, va.grad), direct):
            if cfg.deterministic:
                assert torch.equal(a, b), f"{name}: autograd differs from varlen_backward ({case})"
            elif b.numel():  # a few units in the last place of the largest element
                tol = 2 * torch.finfo(b.dtype).eps * b.abs().max().item() + 1e-4
                assert (a.float() - b.float()).abs().max().item() <= tol, f"{name}: autograd vs direct ({case})"
        return
    if cfg.deterministic:
        out, lse = cute_attn.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=cfg.causal, return_lse=True,
                                            **options)
        dout = torch.randn_like(out)
        _check_repeatable(lambda: cute_attn.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                                            causal=cfg.causal, deterministic=True, **options), case)


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + NUM_SEEDS))
def test_fuzz(seed):
    cfg = fuzz_config(seed)
    for index, inst in enumerate(fuzz_instances(seed)):
        case = _describe(seed, index, cfg, inst)
        (_run_varlen if cfg.varlen else _run_dense)(cfg, inst, case)


# ---------------------------------------------------------------------------- KV-cache decode
# a compile-time choice: pages of 64 keys or a multiple are read a K/V block per page, others
# (1, 5, 16, 40, 48, 100) a page per row (features.paged_rows)
KV_PAGE_SIZES = [None, None, 16, 48, 64, 256, 1, 5, 40, 100]


@dataclass(frozen=True)
class KvcacheConfig(ScoreConfig):
    """The compile-time choices of one seed's KV-cache test."""

    page_size: int | None


def kvcache_config(seed: int) -> KvcacheConfig:
    rng = random.Random(seed + 100_003)
    return KvcacheConfig(
        head_dim=rng.choice([64, 96, 128, 128, 256, 72]),
        dtype=torch.float16 if rng.random() < 0.3 else torch.bfloat16,
        causal=rng.random() < 0.5,
        window=rng.random() < 0.3,
        softcap=rng.random() < 0.25,
        alibi=rng.random() < 0.25,
        page_size=rng.choice(KV_PAGE_SIZES),
    )


def kvcache_instances(seed: int) -> list[dict]:
    """Run-time draws of a decode step: batch, heads, seqlen_q, the cache's capacity and per-sequence
    lengths (0, 1, full, random), an append (with rotary, interleaved or not), cache_batch_idx and
    cache_leftpad (contiguous caches), num_splits (auto, 1, 2, 7), window edges and scale."""
    cfg, rng = kvcache_config(seed), random.Random(seed * 104_729 + 7)
    instances = []
    for _ in range(INSTANCES):
        heads_kv = rng.randint(1, 8)
        # 130 and 300: chunked prefill (on Hopper the SM90 forward where the cache allows it)
        seqlen_q = rng.choice([1, 1, 1, 2, 4, 7, 17, 40, 130, 300])
        seqlen_new = 0 if rng.random() < 0.5 else rng.choice([1, seqlen_q, rng.randint(1, 40)])
        page = cfg.page_size
        capacity = rng.randint(1, 3000) + seqlen_new
        if page:
            capacity = -(-capacity // page) * page
        batch = rng.randint(1, 6)
        room = capacity - seqlen_new
        lengths = [rng.choice([0, 1, room, rng.randint(0, room), rng.randint(0, room)]) for _ in range(batch)]
        paged = page is not None
        inst = dict(
            batch=batch, heads=heads_kv * rng.choice([1, 2, 4, 8]), heads_kv=heads_kv, seqlen_q=seqlen_q,
            seqlen_new=seqlen_new, capacity=capacity, cache_seqlens=lengths,
            batch_idx=not paged and rng.random() < 0.25,
            leftpad=[rng.randint(0, n) for n in lengths] if not paged and rng.random() < 0.25 else None,
            rotary=(rng.random() < 0.5, 16 * rng.randint(1, cfg.head_dim // 16)) if seqlen_new and rng.random() < 0.4
            else None,
            num_splits=rng.choice([0, 0, 0, 1, 2, 7]),
            window_size=_window(rng, cfg.causal) if cfg.window else (-1, -1),
            softcap=rng.choice([0.5, 2.0, 5.0, 30.0]) if cfg.softcap else 0.0,
            alibi_per_batch=rng.random() < 0.5,
            softmax_scale=None if rng.random() < 0.6 else round(rng.uniform(0.03, 0.3), 4),
        )
        instances.append(inst)
    return instances


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + NUM_SEEDS))
def test_fuzz_kvcache(seed):
    cfg = kvcache_config(seed)
    for index, inst in enumerate(kvcache_instances(seed)):
        _run_kvcache(cfg, inst, f"seed {seed} instance {index}: {cfg} {inst}")


def _run_kvcache(cfg: KvcacheConfig, inst: dict, case: str):
    from test_kvcache_gpu import check_kvcache, decode_inputs, rotary_tables, to_paged

    batch, heads = inst["batch"], inst["heads"]
    q, k_cache, v_cache, k, v = decode_inputs(batch, inst["seqlen_q"], heads, inst["heads_kv"], cfg.head_dim,
                                              inst["capacity"], cfg.dtype, inst["seqlen_new"],
                                              batch_cache=2 * batch if inst["batch_idx"] else None)
    options = dict(cache_seqlens=torch.tensor(inst["cache_seqlens"], dtype=torch.int32, device="cuda"),
                   causal=cfg.causal, window_size=inst["window_size"], softcap=inst["softcap"],
                   softmax_scale=inst["softmax_scale"])
    if cfg.page_size:
        k_cache, v_cache, options["block_table"] = to_paged(k_cache, v_cache, cfg.page_size)
    if inst["batch_idx"]:
        options["cache_batch_idx"] = torch.randperm(2 * batch, device="cuda")[:batch].to(torch.int32)
    if inst["leftpad"] is not None:
        options["cache_leftpad"] = torch.tensor(inst["leftpad"], dtype=torch.int32, device="cuda")
    if inst["rotary"] is not None:
        interleaved, rotary_dim = inst["rotary"]
        options["rotary_cos"], options["rotary_sin"] = rotary_tables(inst["capacity"] + inst["seqlen_q"],
                                                                      rotary_dim, cfg.dtype)
        options["rotary_interleaved"] = interleaved
    if cfg.alibi:
        options["alibi_slopes"] = alibi(batch, heads, inst["alibi_per_batch"])
    check_kvcache(q, k_cache, v_cache, case, k, v, num_splits=inst["num_splits"], **options)


def fuzz_keys(seeds=None, smem_capacity: int = 227 * 1024) -> list:
    """The kernels the seeds compile (``test_fuzz`` and ``test_fuzz_kvcache``) on an H100 with either
    kernel family (both run as target sm_90a there), with what the runtime builds beside each: for
    building the cache ahead of time."""
    from cute_attn.compile import backward_keys, backward_post_key, combine_key, forward_key, forward_tier_siblings
    from cute_attn.interface import _DTYPE_NAMES, _score_options
    from cute_attn.traits import (SM90_PAGED_MIN_QUERIES, sm80_decode_traits, sm90_packs_gqa, sm90_pages,
                                  sm90_tier_seqlen)

    seeds = range(FIRST_SEED, FIRST_SEED + NUM_SEEDS) if seeds is None else seeds
    keys: dict = {}
    for seed in seeds:
        cfg = fuzz_config(seed)
        dtype = _DTYPE_NAMES[cfg.dtype]
        for inst in fuzz_instances(seed):
            opts = _score_options(cfg.causal, inst["softmax_scale"], cfg.head_dim, inst["window_size"], inst["softcap"],
                                  cfg.alibi, varlen=cfg.varlen, seqused=cfg.seqused)
            sq, sk = (inst["max_seqlens"] if cfg.varlen else (inst["seqlen_q"], inst["seqlen_k"]))
            for kernel in ("sm80", "sm90"):
                fwd = forward_key("sm_90a", dtype, cfg.head_dim, opts.causal, smem_capacity, kernel=kernel,
                                  seqlen=sm90_tier_seqlen(sq, sk, opts.causal), features=opts.features)
                keys.update(dict.fromkeys(forward_tier_siblings(fwd)))
                pre, main = backward_keys("sm_90a", dtype, cfg.head_dim, opts.causal, cfg.deterministic, kernel=kernel,
                                          smem_capacity=smem_capacity, features=opts.features)
                keys.update(dict.fromkeys([pre, main] + [backward_post_key(main, t) for t in main.candidates]))
        # the KV-cache test of the seed: the SM80-family decode kernel under either family, split and
        # not (built together), and the split's combine kernel
        kv = kvcache_config(seed)
        kv_dtype = _DTYPE_NAMES[kv.dtype]
        page_size = kv.page_size or 0
        for inst in kvcache_instances(seed):
            opts = _score_options(kv.causal, inst["softmax_scale"], kv.head_dim, inst["window_size"], inst["softcap"],
                                  kv.alibi)
            features = dataclasses.replace(opts.features, kvcache=True, paged=page_size > 0, split=True,
                                           pack_gqa=not kv.alibi)
            fwd = forward_key("sm_90a", kv_dtype, kv.head_dim, opts.causal, smem_capacity, features=features,
                              traits=sm80_decode_traits(kv.head_dim, smem_capacity, page_size), page_size=page_size)
            keys.update(dict.fromkeys(forward_tier_siblings(fwd) + [combine_key("sm_90a", kv_dtype, kv.head_dim)]))
            # a chunk of queries: the SM90 forward over the cache as pages (kvcache.sm90_kvcache_launcher),
            # the query heads of a K/V head packed where they fit its tiles (kvcache.sm90_paged_varlen)
            pages = page_size or inst["capacity"]
            pack = (inst["seqlen_q"] < SM90_PAGED_MIN_QUERIES and not kv.alibi  # a batch of short chunks
                    and sm90_packs_gqa(kv.head_dim, opts.causal, inst["heads"] // inst["heads_kv"]))
            rows = inst["seqlen_q"] * (inst["heads"] // inst["heads_kv"] if pack else 1)
            if rows >= SM90_PAGED_MIN_QUERIES and sm90_pages(pages):
                paged = dataclasses.replace(opts.features, varlen=True, seqused=True, paged=True, pack_gqa=pack)
                fwd = forward_key("sm_90a", kv_dtype, kv.head_dim, opts.causal, smem_capacity, kernel="sm90",
                                  seqlen=inst["seqlen_q"], features=paged, page_size=pages)
                keys.update(dict.fromkeys(forward_tier_siblings(fwd)))
    return list(keys)
