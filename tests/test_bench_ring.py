"""tools/bench_ring.py without GPUs: the FLOP count, the scaling model and its table."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "tools", "bench_ring.py")


@pytest.fixture
def bench_ring():
    spec = importlib.util.spec_from_file_location("bench_ring", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flops_and_model(bench_ring):
    # causal halves the forward; the backward adds 2.5x
    assert bench_ring.attention_flops(1, 1024, 16, 128, True) == pytest.approx(3.5 * 2 * 1024**2 * 16 * 128)
    args = dict(seqlen=131072, batch=1, heads=16, heads_kv=16, head_dim=128, causal=True, tflops=500.0)
    for world in (2, 8, 64):
        fast = bench_ring.ring_model(world=world, link_gb_s=450.0, **args)
        slow = bench_ring.ring_model(world=world, link_gb_s=5.0, **args)
        assert 0 < slow["speedup"] <= fast["speedup"] <= world * (1 + 1e-9)
        single_ms = bench_ring.attention_flops(1, 131072, 16, 128, True) / 500e12 * 1e3
        assert fast["ring_ms"] >= single_ms / world * (1 - 1e-9)  # never better than perfect scaling
    # S 131072 on NVLink: the sends (a 64 MB K/V slice over 450 GB/s) hide under each step's compute
    assert bench_ring.ring_model(world=2, link_gb_s=450.0, **args)["efficiency"] == pytest.approx(1.0)
    # a slow link with many GPUs: the step is bound by the link
    bound = bench_ring.ring_model(world=64, link_gb_s=5.0, **args)
    assert bound["comm_per_step_ms"] > bound["compute_per_step_ms"] and bound["efficiency"] < 1.0


def test_model_only_prints_the_table(bench_ring, capsys):
    bench_ring.main(["--model-only", "--seqlen", "131072"])
    out = capsys.readouterr().out
    assert "| NVLink 4 (450 GB/s) | 2 |" in out and "| InfiniBand NDR (50 GB/s) | 64 |" in out
    with pytest.raises(SystemExit):
        bench_ring.main(["--model-only", "--seqlen", "1000", "--world", "16"])
