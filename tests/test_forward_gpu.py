"""Forward kernels against the fp32 reference on the GPU (marker ``gpu``; skipped without CUDA).

Every test runs once per forward kernel family the GPU can run (``arch``): SM80 everywhere, SM90
on compute capability 9.0.
"""

import itertools

import pytest
import torch

import cute_attn
from helpers import check_close, check_lse, poisoned_like, random_qkv, reference_pair
from helpers import arch  # noqa: F401  (autouse: every test under both kernel families)

pytestmark = pytest.mark.gpu


HEAD_DIMS = [32, 64, 96, 128, 192, 256, 40, 120, 200]  # table entries, then padded ones
SEQLENS = [  # (seqlen_q, seqlen_k): odd lengths, tile +-1, and seqlen_q != seqlen_k both ways
    (1, 1), (17, 17), (113, 113), (127, 127), (128, 128), (129, 129), (255, 255), (1000, 1000),
    (2048, 2048), (1, 1000), (17, 255), (113, 203), (1000, 129), (255, 1), (2048, 127),
]
HEADS = [(4, 4), (6, 2), (4, 1)]  # MHA, GQA, MQA


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_forward_matches_reference(head_dim, dtype, causal):
    for seqlen_q, seqlen_k in SEQLENS:
        for heads, heads_kv in HEADS:
            batch = 2 if seqlen_q * seqlen_k < 10**6 else 1
            case = f"d={head_dim} {dtype} causal={causal} sq={seqlen_q} sk={seqlen_k} h={heads}/{heads_kv}"
            q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype)
            out = poisoned_like(q)
            out, lse = cute_attn.forward(q, k, v, causal=causal, out=out, return_lse=True)
            ref, same, ref_lse = reference_pair(q, k, v, causal)
            check_close("out", out, ref, same, 1e-5, case)
            check_lse(lse, ref_lse, case)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_forward_many_tiles_per_cta(head_dim, causal):
    """More Q tiles than SMs: a persistent grid's CTAs walk several tiles each, and every tile
    after the first starts under the previous one's epilogue (SM90 ``_tile_boundary``)."""
    for batch, seqlen_q, seqlen_k, dtype in [(4, 1000, 1000, torch.bfloat16), (4, 700, 1500, torch.float16),
                                             (24, 1, 1500, torch.bfloat16), (3, 1500, 300, torch.float16)]:
        case = f"d={head_dim} {dtype} causal={causal} b={batch} sq={seqlen_q} sk={seqlen_k}"
        q, k, v = random_qkv(batch, seqlen_q, seqlen_k, 16, 4, head_dim, dtype)
        out, lse = cute_attn.forward(q, k, v, causal=causal, out=poisoned_like(q), return_lse=True)
        ref, same, ref_lse = reference_pair(q, k, v, causal)
        check_close("out", out, ref, same, 1e-5, case)
        check_lse(lse, ref_lse, case)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_strided_inputs_and_scale(causal):
    """Non-contiguous q/k/v (a packed qkv buffer), an explicit scale, and an explicit out."""
    batch, seqlen, heads, head_dim = 2, 333, 4, 64
    qkv = torch.randn(batch, seqlen, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    out = poisoned_like(q)
    cute_attn.forward(q, k, v, causal=causal, softmax_scale=0.3, out=out)
    ref, same, _ = reference_pair(q, k, v, causal, softmax_scale=0.3)
    check_close("out", out, ref, same, 1e-5, "strided")


def test_forward_rows_without_keys_are_zero():
    """causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k queries see no key."""
    q, k, v = random_qkv(1, 300, 100, 2, 2, 64, torch.bfloat16)
    out, lse = cute_attn.forward(q, k, v, causal=True, out=poisoned_like(q), return_lse=True)
    assert torch.all(out[:, :200] == 0) and torch.all(torch.isinf(lse[:, :, :200]))
    assert not torch.isnan(out).any()


def test_forward_runs_on_current_stream():
    q, k, v = random_qkv(2, 512, 512, 4, 4, 128, torch.float16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = cute_attn.forward(q, k, v)
    stream.synchronize()
    ref, same, _ = reference_pair(q, k, v, False)
    check_close("out", out, ref, same, 1e-5, "side stream")


@pytest.mark.parametrize("head_dim,causal", [(64, False), (64, True), (128, False), (128, True)])
def test_new_shapes_do_not_recompile(head_dim, causal):
    """Nor a new SM90 length tier: the first call builds every tier of its configuration, or (disk
    cache on) has a background process build the others, which later lengths load from disk
    (once it is done: a call right after the first may compile a tier the child has not reached
    yet, which the child then loads)."""
    from cute_attn import compile as compile_mod

    cache = compile_mod.forward_cache
    q, k, v = random_qkv(1, 64, 64, 2, 2, head_dim, torch.bfloat16)
    cute_attn.forward(q, k, v, causal=causal)
    assert compile_mod.wait_for_background_builds(600)
    builds = cache.builds
    for seqlen in (65, 300, 1025, 2049, 4097, 8193):
        q, k, v = random_qkv(2, seqlen, seqlen + 7, 4, 2, head_dim, torch.bfloat16)
        cute_attn.forward(q, k, v, causal=causal)
    assert cache.builds == builds
    held = (len(cache._fns), cache.loads)
    for seqlen in (100, 3000, 9000):  # every tier is in memory now
        q, k, v = random_qkv(1, seqlen, seqlen, 2, 2, head_dim, torch.bfloat16)
        cute_attn.forward(q, k, v, causal=causal)
    assert (len(cache._fns), cache.loads, cache.builds) == (*held, builds)


def test_first_backward_after_an_autograd_forward_compiles_nothing(tmp_path):
    """flash_attn_func's forward has the backward's kernels compiled in the background (disk cache
    on): the first backward in this process loads them."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch, cute_attn
        from cute_attn import compile as c
        q, k, v = (torch.randn(2, 333, 4, 96, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
        out = cute_attn.flash_attn_func(q, k, v, causal=True)
        assert c.wait_for_background_builds(900)
        out.sum().backward()
        print(c.backward_cache.builds, c.backward_cache.loads, bool(torch.isfinite(q.grad).all()))
    """)
    env = {**os.environ, "CUTE_ATTN_CACHE_DIR": str(tmp_path), "CUTE_ATTN_BACKGROUND_BUILD": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0", "3", "True"], done.stdout


@pytest.mark.parametrize("causal", [False, True])
def test_forward_row_max_growing_block_by_block(causal):
    """Keys grow in magnitude toward the start of the sequence, which the kernels visit last, so a
    row's max rises in many blocks: by less than the lazy-rescale threshold (the old reference is
    kept and P exceeds 1) and by more (O is rescaled)."""
    seqlen = 1500
    q, k, v = random_qkv(2, seqlen, seqlen, 4, 2, 128, torch.bfloat16)
    ramp = torch.linspace(4.0, 0.5, seqlen, device="cuda").view(1, seqlen, 1, 1)
    k = (k.float() * ramp).to(k.dtype)
    out, lse = cute_attn.forward(q, k, v, causal=causal, out=poisoned_like(q), return_lse=True)
    ref, same, ref_lse = reference_pair(q, k, v, causal)
    check_close("out", out, ref, same, 1e-5, "growing max")
    check_lse(lse, ref_lse, "growing max")


# SM90 traits beside the table's (tools/bench.py --sweep): schedules and tiles the table does not
# pick, with and without the persistent grid
SM90_OTHER_SPECS = [
    (128, "m128n128s2o0p0"), (64, "m192n128s2o0ps"), (128, "m128n176s2p0"), (64, "m128n192s2ps"),
    (128, "m128n128s2psot"), (96, "m128n128s2p0psot"),
    # K/V multicast in clusters of two (non-causal only): odd Q block counts leave a cluster's
    # second CTA past seqlen_q
    (128, "m128n128s2p0psmc"), (128, "m128n128s2p0mc"), (64, "m192n128s2psotmc"), (64, "m192n128s2mc"),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,spec", SM90_OTHER_SPECS)
def test_forward_sm90_other_traits(arch, head_dim, spec, causal):
    import math

    from cute_attn.interface import _launch_forward
    from cute_attn.traits import parse_traits

    if arch != "sm90":
        pytest.skip("SM90 traits")
    traits = parse_traits(spec, head_dim)
    if causal and traits.kv_multicast:
        q, k, v = random_qkv(1, 128, 128, 4, 2, head_dim, torch.bfloat16)
        with pytest.raises(ValueError, match="multicast"):
            _launch_forward(q, k, v, torch.empty_like(q), None, causal, 1.0, traits=traits)
        return
    # the last case has more tiles than SMs: a persistent grid's CTAs walk several each
    for batch, seqlen_q, seqlen_k, dtype in [(2, 1000, 1000, torch.bfloat16), (2, 300, 2048, torch.float16),
                                             (2, 2048, 127, torch.bfloat16), (8, 700, 1500, torch.float16),
                                             (3, 1, 17, torch.bfloat16)]:
        case = f"{spec} causal={causal} b={batch} sq={seqlen_q} sk={seqlen_k} {dtype}"
        q, k, v = random_qkv(batch, seqlen_q, seqlen_k, 4, 2, head_dim, dtype)
        out, lse = poisoned_like(q), poisoned_like(q, (batch, 4, seqlen_q), torch.float32)
        _launch_forward(q, k, v, out, lse, causal, 1 / math.sqrt(head_dim), traits=traits)
        ref, same, ref_lse = reference_pair(q, k, v, causal)
        check_close("out", out, ref, same, 1e-5, case)
        check_lse(lse, ref_lse, case)


# (head dim, causal, seqlen_q, seqlen_k, heads, heads_kv, window, softcap, alibi): the table's SM90
# forward keys at each length tier, GQA, odd lengths and the features, for the bootstrap kernels
BOOTSTRAP_CASES = [
    (64, False, 2048, 2048, 4, 4, None, 0.0, False), (64, True, 1000, 1000, 6, 2, None, 0.0, False),
    (64, True, 3000, 3000, 4, 1, None, 0.0, False), (64, True, 5000, 4999, 4, 4, None, 0.0, False),
    (128, False, 700, 700, 4, 4, None, 0.0, False), (128, False, 2048, 2048, 4, 2, None, 0.0, False),
    (128, True, 2048, 2048, 4, 4, None, 0.0, False), (128, True, 9000, 9000, 2, 2, None, 0.0, False),
    (128, True, 1000, 1500, 4, 4, (256, 0), 0.0, False), (128, False, 1000, 1000, 4, 4, None, 30.0, False),
    (128, True, 777, 777, 4, 4, None, 0.0, True), (64, False, 1000, 1000, 4, 4, (100, 50), 5.0, True),
    (96, True, 1000, 1000, 4, 4, None, 0.0, False), (256, False, 1000, 1000, 4, 4, None, 0.0, False),
    (32, False, 1000, 1000, 4, 4, None, 0.0, False), (192, True, 1000, 1000, 4, 4, None, 0.0, False),
]
# (head dim, causal, per-sequence query lengths, key lengths, heads, heads_kv): varlen batches
BOOTSTRAP_VARLEN_CASES = [
    (128, True, (17, 0, 300, 1000), (17, 5, 450, 1000), 4, 4),
    (64, False, (129, 1, 2000), (1000, 1, 2000), 8, 2),
]


def test_bootstrap_forward_is_bitwise_equal(arch):
    """compile.forward_bootstrap_key's kernel (the table's SM90 forward without the intra-warpgroup
    overlap and with every block through the masked path, which a cold start runs while the
    table's compiles) writes the same bits as the table's kernel: outputs and LSE, into poisoned
    buffers, dense and varlen."""
    import math

    from cute_attn import compile as compile_mod
    from cute_attn import dispatch, interface
    from cute_attn.traits import sm90_tier_seqlen

    if arch != "sm90":
        pytest.skip("the bootstrap kernels are SM90 forwards")
    plan = dispatch.plan_for_device(torch.device("cuda"))
    for d, causal, sq, sk, heads, heads_kv, window, softcap, alibi in BOOTSTRAP_CASES:
        case = f"d={d} causal={causal} sq={sq} sk={sk} h={heads}/{heads_kv} window={window} softcap={softcap} alibi={alibi}"
        q, k, v = random_qkv(2, sq, sk, heads, heads_kv, d, torch.bfloat16)
        scale = 1 / math.sqrt(d)
        opts = interface._score_options(causal, scale, d, window or (-1, -1), softcap, alibi)
        slopes = interface._alibi_slopes(torch.rand(heads, device="cuda") if alibi else None, 2, heads, q.device)
        key = compile_mod.forward_key(plan.target, "bf16", d, opts.causal, plan.smem_capacity, kernel="sm90",
                                      seqlen=sm90_tier_seqlen(sq, sk, opts.causal), features=opts.features)
        boot = compile_mod.forward_bootstrap_key(key)
        assert boot is not None, case
        results = []
        for traits in (key.candidates[0], boot.candidates[0]):
            out, lse = poisoned_like(q), torch.full((2, heads, sq), float("nan"), device="cuda")
            interface._forward_launcher(q, k, opts, traits, sq, sk)(q, k, v, out, lse, None, None, slopes)
            results.append((out, lse))
        (out, lse), (boot_out, boot_lse) = results
        assert not out.isnan().any(), case
        assert torch.equal(out, boot_out) and torch.equal(lse, boot_lse), case
    for d, causal, lens_q, lens_k, heads, heads_kv in BOOTSTRAP_VARLEN_CASES:
        case = f"varlen d={d} causal={causal} lens_q={lens_q} lens_k={lens_k} h={heads}/{heads_kv}"
        cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
                      for lens in (lens_q, lens_k))
        q, k, v = random_qkv(1, sum(lens_q), sum(lens_k), heads, heads_kv, d, torch.bfloat16)
        opts = interface._score_options(causal, 1 / math.sqrt(d), d, varlen=True)
        key = compile_mod.forward_key(plan.target, "bf16", d, opts.causal, plan.smem_capacity, kernel="sm90",
                                      seqlen=sm90_tier_seqlen(max(lens_q), max(lens_k), opts.causal),
                                      features=opts.features)
        results = []
        for traits in (key.candidates[0], compile_mod.forward_bootstrap_key(key).candidates[0]):
            out, lse = poisoned_like(q), torch.full((1, heads, sum(lens_q)), float("nan"), device="cuda")
            interface._forward_launcher(q, k, opts, traits, max(lens_q), max(lens_k))(q, k, v, out, lse, cu_q, cu_k, None)
            results.append((out, lse))
        (out, lse), (boot_out, boot_lse) = results
        assert not out.isnan().any(), case
        assert torch.equal(out, boot_out) and torch.equal(lse, boot_lse), case


def test_a_cold_forward_runs_the_bootstrap_then_the_table_kernel(arch, tmp_path, monkeypatch):
    """A cold disk cache: the first forward runs the bootstrap kernel while a background process
    builds the table's; once that lands, the same call runs the table's kernel, with the same bits."""
    from cute_attn import compile as compile_mod
    from cute_attn import interface

    if arch != "sm90":
        pytest.skip("the bootstrap kernels are SM90 forwards")
    monkeypatch.delenv("CUTE_ATTN_BACKGROUND_BUILD", raising=False)
    cache = compile_mod.KernelCache(compile_mod.build_forward, str(tmp_path), group=compile_mod.forward_tier_siblings,
                                    background=True, bootstrap=compile_mod.forward_bootstrap_key)
    monkeypatch.setattr(compile_mod, "forward_cache", cache)
    monkeypatch.setattr(interface, "_FORWARD_LAUNCHES", {})
    q, k, v = random_qkv(2, 1000, 1000, 4, 2, 128, torch.bfloat16)
    first = cute_attn.forward(q, k, v, causal=True)
    (slot,) = cache._slots.values()
    assert slot.bootstrapped
    assert compile_mod.wait_for_background_builds(900)
    again = cute_attn.forward(q, k, v, causal=True)
    assert not slot.bootstrapped and slot.traits.intra_wg_overlap and cache.loads >= 1
    assert torch.equal(first, again)
