"""Compile forward variants without a GPU and check what the generated code contains (CPU).

By default a representative subset per target; ``pytest --all-variants`` compiles every variant.
"""

import pytest

from cute_attn import artifacts
from cute_attn.compile import (
    TARGETS,
    BackwardKey,
    backward_variants,
    build,
    build_forward,
    forward_key,
    forward_variants,
)
from cute_attn.traits import HEAD_DIMS, SM80_FORWARD, fit_to_smem, padded_head_dim

SUBSET = [  # (head_dim, dtype, causal): smallest/largest tiles, a padded head dim, both dtypes
    (64, "bf16", False),
    (128, "fp16", True),
    (40, "bf16", True),
    (256, "bf16", False),
]


def _keys(all_variants):
    if all_variants:
        return forward_variants(TARGETS, HEAD_DIMS + (40, 120, 200))
    return [forward_key(t, dt, d, c) for t in TARGETS for d, dt, c in SUBSET]


BWD_SUBSET = [  # (head_dim, dtype, causal, deterministic)
    (64, "bf16", True, False),
    (128, "fp16", False, True),
    (72, "bf16", True, False),
]


def _bwd_keys(all_variants):
    if all_variants:
        return backward_variants(TARGETS, HEAD_DIMS + (72,), deterministic=(False, True))
    keys = {
        k: None
        for t in TARGETS for d, dt, c, det in BWD_SUBSET
        for k in backward_variants([t], [d], [dt], [c], [det])
    }
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
    assert counts["mma.sync"] > 0, "no mma.sync.aligned.m16n8k16"
    assert counts["cp.async"] > 0, "no 128-bit cp.async"
    assert counts["ldmatrix"] > 0, "no ldmatrix"
    assert counts["ld.local/st.local"] == 0, "local memory in the PTX itself"
    res = artifacts.cubin_resources(cubin)
    assert res["registers"] and res["registers"] <= 255
    assert fn.traits in fwd_key.candidates
    if fwd_key.head_dim <= 128:
        assert res["stack_frame"] == 0, f"{fwd_key.name}: {res['stack_frame']} bytes of local memory (spills)"


def test_backward_kernel_compiles_to_expected_instructions(bwd_key):
    fn = build(bwd_key, keep_artifacts=True)
    ptx, cubin = fn.__ptx__, fn.__cubin__
    assert artifacts.ptx_target(ptx) == bwd_key.target
    res = artifacts.cubin_resources(cubin)
    if isinstance(bwd_key, BackwardKey):
        counts = artifacts.count_ptx(ptx)
        assert counts["mma.sync"] > 0 and counts["cp.async"] > 0 and counts["ldmatrix"] > 0
        if bwd_key.deterministic:
            assert "ld.acquire.gpu" in ptx and "st.release.gpu" in ptx, "no semaphore ordering for dQ"
        else:
            assert "atom.global.add.f32" in ptx or "red.global.add.f32" in ptx, "no fp32 atomics for dQ"
    if bwd_key.head_dim <= 128:
        assert res["stack_frame"] == 0, f"{bwd_key.name}: {res['stack_frame']} bytes of local memory (spills)"


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
