"""tools/bench.py's timing schedule and report, without a GPU (the timings are faked)."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "tools", "bench.py")


@pytest.fixture
def bench():
    spec = importlib.util.spec_from_file_location("bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rounds_shuffle_the_order_and_keep_every_timing(bench, monkeypatch):
    order = []

    def fake_timed(fn, q, k, v, causal, mode, rep_ms, sustained_s=0.0):
        order.append(fn.name)
        return {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}[fn.name] + len(order) / 1000

    monkeypatch.setattr(bench, "_timed", fake_timed)
    impls = {}
    for name in "abcd":
        impls[name] = lambda *a: None
        impls[name].name = name
    rounds = 6
    times = bench._time_interleaved(impls, None, None, None, False, "fwd", rounds, "test")
    assert {n: len(t) for n, t in times.items()} == {n: rounds for n in "abcd"}
    assert times["c"][0] == pytest.approx(3.003)  # round 0 keeps the given order
    per_round = [order[i * 4:(i + 1) * 4] for i in range(rounds)]
    assert all(sorted(r) == list("abcd") for r in per_round)
    # no implementation runs right after the same one every time (a fixed or rotated order, which
    # keeps the cyclic order, would give each the same predecessor in every round)
    for name in "abcd":
        before = {r[r.index(name) - 1] for r in per_round if r.index(name)}
        assert len(before) > 1, (name, per_round)
    # the same orders in every run, so that two runs are comparable
    order.clear()
    bench._time_interleaved(impls, None, None, None, False, "fwd", rounds, "test")
    assert [order[i * 4:(i + 1) * 4] for i in range(rounds)] == per_round


def test_a_failing_implementation_is_dropped_not_fatal(bench, monkeypatch, capsys):
    def fake_timed(fn, *a, **k):
        if fn.name == "bad":
            raise RuntimeError("boom")
        return 1.0

    monkeypatch.setattr(bench, "_timed", fake_timed)
    good, bad = (lambda *a: None), (lambda *a: None)
    good.name, bad.name = "good", "bad"
    times = bench._time_interleaved({"good": good, "bad": bad}, None, None, None, True, "fwd", 3, "here")
    assert times == {"good": [1.0, 1.0, 1.0], "bad": None}
    assert "bad fwd failed at here: RuntimeError: boom" in capsys.readouterr().err


def test_report_prints_the_ceiling_column(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "FakeGPU")
    monkeypatch.setattr(bench, "_plot", lambda *a, **k: None)
    row = {"mode": "fwd", "head_dim": 128, "causal": 0, "seqlen": 4096, "batch": 4, "heads": 16,
           "cute_attn": 660.0, "FA2 (SDPA flash)": 330.0, "FA4 (CuTe DSL)": 600.0, bench.CEILING: 750.0}

    class Args:
        modes, dtype, tokens, out = ["fwd"], "bf16", 16384, str(tmp_path)

    bench._report([row], ["cute_attn"], ["FA2 (SDPA flash)", "FA4 (CuTe DSL)"], [bench.CEILING], Args)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 128")]
    assert lines == ["| 128 | 0 | 4096 | 660 | 330 | 600 | 750 | 2.00x | 1.10x | 0.88x |"]
    assert (tmp_path / "bench.json").exists()
