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
    assert lines == ["| 128 | 0 | 4096 | 660 | 330 | 600 | 750 | 2.00x | 1.10x | - | 0.88x |"]
    assert (tmp_path / "bench.json").exists()


def test_gqa_argument_and_title(bench, tmp_path, monkeypatch, capsys):
    # --gqa G: K/V with heads / G heads; the report's title says so (FLOPs stay per query head)
    assert bench._parser().parse_args([]).gqa == 1
    args = bench._parser().parse_args(["--gqa", "4", "--modes", "bwd", "--out", str(tmp_path)])
    assert args.gqa == 4 and args.modes == ["bwd"]
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "FakeGPU")
    monkeypatch.setattr(bench, "_plot", lambda *a, **k: None)
    row = {"mode": "bwd", "head_dim": 128, "causal": 1, "seqlen": 2048, "batch": 8, "heads": 16, "heads_kv": 4,
           "cute_attn": 400.0, "FA4 (CuTe DSL)": 500.0}
    bench._report([row], ["cute_attn"], ["FA4 (CuTe DSL)"], [], args)
    out = capsys.readouterr().out
    assert "GQA 4 query heads per K/V head" in out and "| 128 | 1 | 2048 | 400 | 500 | - | 0.80x | - |" in out


def test_per_round_ratio_against_the_best_peer(bench, tmp_path, monkeypatch, capsys):
    """The per-round column: the median of the rounds' speed ratios to the best peer (by the
    table's medians) and the rounds won; '-' without two rounds of both."""
    rounds = {"cute_attn": [1.0, 1.0, 2.0, 1.0, 1.0], "FA4 (CuTe DSL)": [1.1, 0.9, 1.0, 1.02, 1.0],
              "FA2 (SDPA flash)": [3.0] * 5}
    assert bench.round_ratios({"round_ms": rounds}, "FA4 (CuTe DSL)") == [1.1, 0.9, 0.5, 1.02, 1.0]
    assert bench.per_round(bench.round_ratios({"round_ms": rounds}, "FA4 (CuTe DSL)")) == "1.00 (2/5)"
    assert bench.per_round(bench.round_ratios({"round_ms": rounds}, "FA2 (SDPA flash)")) == "3.00 (5/5)"
    assert bench.per_round([2.0]) == "-"  # one round
    assert bench.round_ratios({"round_ms": {"cute_attn": [1.0, 1.0], "FA4 (CuTe DSL)": None}}, "FA4 (CuTe DSL)") == []
    assert bench.round_ratios({}, "FA4 (CuTe DSL)") == []
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "FakeGPU")
    monkeypatch.setattr(bench, "_plot", lambda *a, **k: None)
    row = {"mode": "bwd", "head_dim": 64, "causal": 0, "seqlen": 8192, "batch": 2, "heads": 32, "heads_kv": 32,
           "cute_attn": 500.0, "FA2 (SDPA flash)": 250.0, "FA4 (CuTe DSL)": 510.0, "round_ms": rounds}

    class Args:
        modes, dtype, tokens, out, gqa = ["bwd"], "bf16", 16384, str(tmp_path), 1

    bench._report([row], ["cute_attn"], ["FA2 (SDPA flash)", "FA4 (CuTe DSL)"], [], Args)
    out = capsys.readouterr().out
    assert "| cute_attn / best peer | per round (won) |" in out
    assert "| 64 | 0 | 8192 | 500 | 250 | 510 | 2.00x | 0.98x | 1.00 (2/5) |" in out


def test_clock_samples_and_cycles_per_round(bench, tmp_path, monkeypatch, capsys):
    """--clocks: nvidia-smi's lines become (time, MHz, W, power-capped) samples; each timing window
    gets its mean clock, and a row its per-round ratio in cycles (ms x MHz) beside the one in
    time: a round cute_attn lost in time on a lower clock can be won in cycles."""
    import datetime

    def stamp(seconds):
        return datetime.datetime.fromtimestamp(1_800_000_000 + seconds).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]

    lines = [f"{stamp(0.00)}, 1980, 150.5, 0x0000000000000000", f"{stamp(0.01)}, 1500, 690.0, 0x0000000000000004",
             f"{stamp(0.02)}, 1200, 700.1, 0x0000000000000004", f"{stamp(0.03)}, 1600, 699.0, 0x0000000000000004",
             f"{stamp(0.04)}, 1800", "not a sample"]  # the last sample cut off, then a stray line
    samples = bench.parse_clock_samples(lines)
    t0 = 1_800_000_000
    assert [(round(t - t0, 2), mhz, watts, capped) for t, mhz, watts, capped in samples] == [
        (0.0, 1980.0, 150.5, False), (0.01, 1500.0, 690.0, True), (0.02, 1200.0, 700.1, True),
        (0.03, 1600.0, 699.0, True)]
    assert bench.window_clock(samples, t0 + 0.005, t0 + 0.025) == 1350.0
    assert bench.window_clock(samples, t0 + 1.0, t0 + 2.0) is None

    # round 1: FA4 faster in time (1.0 vs 1.1 ms) but on a higher clock; round 2: level
    row = {"mode": "fwdbwd", "head_dim": 128, "causal": 0, "seqlen": 8192, "batch": 2, "heads": 16, "heads_kv": 16,
           "cute_attn": 600.0, "FA4 (CuTe DSL)": 610.0,
           "round_ms": {"cute_attn": [1.1, 1.0], "FA4 (CuTe DSL)": [1.0, 1.0]},
           "windows": {"cute_attn": [(t0 + 0.015, t0 + 0.025), (t0 - 1, t0 - 0.5)],
                       "FA4 (CuTe DSL)": [(t0 - 0.005, t0 + 0.005), (t0 + 0.025, t0 + 0.035)]}}
    bench.add_round_clocks(row, samples)
    assert row["round_mhz"] == {"cute_attn": [1200.0, None], "FA4 (CuTe DSL)": [1980.0, 1600.0]}
    assert row["power_capped"] == 2 / 3  # the samples inside any timing window: 1200 (capped), 1980, 1600 (capped)
    assert bench.cycle_ratios(row, "FA4 (CuTe DSL)") == []  # a round without a sample: no cycles ratio
    row["round_mhz"]["cute_attn"][1] = 1600.0
    cycles = bench.cycle_ratios(row, "FA4 (CuTe DSL)")
    assert [round(x, 3) for x in cycles] == [round(1.0 * 1980 / (1.1 * 1200), 3), 1.0]
    assert bench.per_round(bench.round_ratios(row, "FA4 (CuTe DSL)")) == "0.95 (0/2)"
    assert bench.per_round(cycles) == "1.25 (1/2)"

    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "FakeGPU")
    monkeypatch.setattr(bench, "_plot", lambda *a, **k: None)
    del row["windows"]

    class Args:
        modes, dtype, tokens, out, gqa, sustained = ["fwdbwd"], "bf16", 16384, str(tmp_path), 1, 2.0

    bench._report([row], ["cute_attn"], ["FA4 (CuTe DSL)"], [], Args)
    out = capsys.readouterr().out
    assert "| d | causal | S | cute_attn MHz | best peer MHz | power-capped | per round (won) " \
           "| per round in cycles (won) |" in out
    assert "| 128 | 0 | 8192 | 1400 | 1790 (FA4 (CuTe DSL)) | 67% | 0.95 (0/2) | 1.25 (1/2) |" in out
    Args.sustained = 0.0  # bursts: the clock reading lags them, so no cycles column
    bench._report([row], ["cute_attn"], ["FA4 (CuTe DSL)"], [], Args)
    out = capsys.readouterr().out
    assert "| 128 | 0 | 8192 | 1400 | 1790 (FA4 (CuTe DSL)) | 67% | 0.95 (0/2) |\n" in out
    assert "in cycles" not in out
    assert bench._parser().parse_args(["--clocks"]).clocks and not bench._parser().parse_args([]).clocks
    # a row without --clocks prints no clocks table
    bench._report([{k: v for k, v in row.items() if k not in ("round_mhz", "power_capped")}], ["cute_attn"],
                  ["FA4 (CuTe DSL)"], [], Args)
    assert "cute_attn MHz" not in capsys.readouterr().out


def test_clock_windows_cover_the_timed_calls_only(bench, monkeypatch):
    """--clocks: a timing's window is its timed calls (do_bench's ~rep_ms at the end, or the
    sustained seconds), not the first calls before them, where a peer may compile while the GPU
    idles at its top clock."""
    clock = [100.0]

    def fake_timed(fn, q, k, v, causal, mode, rep_ms, sustained_s=0.0):
        clock[0] += 10.0  # a compile, warm-up, then the timed calls
        return 30.0

    monkeypatch.setattr(bench, "_timed", fake_timed)
    monkeypatch.setattr(bench.time, "time", lambda: clock[0])
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    windows = {}
    bench._time_interleaved({"a": lambda *a: None}, None, None, None, False, "bwd", 2, "test", windows=windows)
    # 2 rounds: rep_ms 50 (more than a 30 ms call), so the last 0.05 s of each timing
    assert windows == {"a": [(pytest.approx(109.95), 110.0), (pytest.approx(119.95), 120.0)]}
    windows = {}
    bench._time_interleaved({"a": lambda *a: None}, None, None, None, False, "bwd", 9, "test", sustained_s=2.0,
                            windows=windows)
    assert windows["a"][0] == (128.0, 130.0) and len(windows["a"]) == 9
    windows = {}
    monkeypatch.setattr(bench, "_timed", lambda *a: (clock.__setitem__(0, clock[0] + 0.01), 30.0)[1])
    bench._time_interleaved({"a": lambda *a: None}, None, None, None, False, "bwd", 2, "test", windows=windows)
    assert windows["a"][0][1] - windows["a"][0][0] == pytest.approx(0.01)  # never before the timing's start


def test_clocks_without_nvidia_smi_is_a_clear_exit(bench, tmp_path, monkeypatch):
    def no_smi(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr("subprocess.Popen", no_smi)
    monkeypatch.setattr(bench.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(bench.torch.cuda, "get_device_properties", lambda i: type("Props", (), {"uuid": "x"})())
    with pytest.raises(SystemExit, match="nvidia-smi"):
        bench.ClockLog(str(tmp_path / "clocks.csv"))


def test_decode_arguments(bench):
    args = bench._parser().parse_args(["--decode"])
    assert args.decode and not args.decode_latency and not args.decode_sweep_only
    assert args.paged == [64, 256] and args.decode_head_dim == 128 and args.dtype == "bf16"
    assert args.decode_sk == [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    assert args.decode_sweep_heads == [32, 8]
    args = bench._parser().parse_args(["--decode", "--paged", "--decode-sk", "--dtype", "fp16", "--sustained", "2"])
    assert args.paged == [] and args.decode_sk == [] and args.dtype == "fp16" and args.sustained == 2.0
    args = bench._parser().parse_args(["--decode-latency", "--paged", "128"])
    assert args.decode_latency and not args.decode and args.paged == [128]


def test_paged_varlen_arguments_and_cases(bench):
    args = bench._parser().parse_args(["--paged-varlen"])
    assert args.paged_varlen and args.paged_varlen_page == 16 and not args.decode
    assert bench._parser().parse_args(["--paged-varlen", "--paged-varlen-page", "1"]).paged_varlen_page == 1
    for name, lens_q, lens_k in bench.PAGED_VARLEN_CASES:  # one query and key count per sequence
        assert len(lens_q) == len(lens_k) and min(lens_k) >= 1, name


def test_decode_rows_and_bytes(bench):
    shapes = bench.decode_shapes(bench.DECODE_TABLE, [1024, 4096], (32, 8), [64, 256], 128)
    table = [s for s in shapes if s["part"] == "table"]
    sweep = [s for s in shapes if s["part"] == "sweep"]
    # issue 14's table, each dense then paged 64 and 256
    assert [(s["batch"], s["seqlen_q"], s["seqlen_k"], s["heads"], s["heads_kv"], s["page_size"]) for s in table] == [
        (b, sq, sk, h, hkv, page)
        for b, sq, sk, h, hkv in [(1, 1, 131072, 8, 8), (1, 1, 8192, 32, 32), (64, 1, 8192, 32, 8),
                                  (16, 4, 16384, 32, 8)]
        for page in (0, 64, 256)]
    assert [(s["batch"], s["seqlen_q"], s["seqlen_k"], s["heads"], s["heads_kv"], s["page_size"]) for s in sweep] == [
        (1, 1, sk, 32, 8, page) for sk in (1024, 4096) for page in (0, 64, 256)]
    assert all(s["head_dim"] == 128 for s in shapes)
    assert len(bench.decode_shapes(bench.DECODE_TABLE, [1024], (32, 8), [], 64, include_table=False)) == 1
    # bytes: q + out (B*Sq*H*d each) + K + V attended (B*Sk*Hkv*d each), times the element size
    assert bench.decode_bytes(table[0], 2) == 2 * (2 * 1 * 1 * 8 * 128 + 2 * 131072 * 8 * 128)
    row4 = table[9]
    assert bench.decode_bytes(row4, 2) == 2 * (2 * 16 * 4 * 32 * 128 + 2 * 16 * 16384 * 8 * 128)
    assert bench.decode_bytes(table[1], 2) == bench.decode_bytes(table[0], 2)  # paged: the same bytes
    assert bench.decode_pages(8192, 64) == 128 and bench.decode_pages(1000, 256) == 4


def test_decode_table_lines(bench):
    row = {"part": "table", "batch": 64, "seqlen_q": 1, "seqlen_k": 8192, "heads": 32, "heads_kv": 8,
           "head_dim": 128, "page_size": 0, "bytes": 1, "num_splits": 2, "notes": [], "round_ms": {},
           "cute_attn": 2.9, "cute_attn (no split)": 1.45, "SDPA flash": 2.46, "SDPA cuDNN": 3.04, "FA4": None}
    paged = dict(row, page_size=64, num_splits="?", **{"cute_attn": None, "FA4 paged": 2.0})
    del paged["SDPA flash"], paged["SDPA cuDNN"]
    cols = bench.decode_columns([row, paged])
    assert cols == ["cute_attn", "cute_attn (no split)", "SDPA flash", "SDPA cuDNN", "FA4 paged"]  # FA4: no timing
    lines = bench.decode_table_lines([row, paged], cols, 3.0)
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == lines[3].count("|")
    assert lines[2] == ("| 64 | 1 | 8192 | 32/8 | - | 2 | 2.90 | 1.45 | 2.46 | 3.04 | - | 3.04 (SDPA cuDNN) | 0.95x "
                        "| 97% |")
    assert lines[3] == "| 64 | 1 | 8192 | 32/8 | 64 | ? | - | 1.45 | - | - | 2.00 | 2.00 (FA4 paged) | - | - |"
    # --decode-read-floor: two more columns where a row has the plain read, never a peer
    floored = dict(row, read_floor={"ms": 1.0, "tbs": 2.9, "config": [4, 2048, 4]})
    assert bench.decode_columns([floored, paged]) == cols
    lines = bench.decode_table_lines([floored, paged], cols, 3.0)
    assert lines[0].endswith("| cute_attn / copy | plain read | cute_attn / plain read |")
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == lines[3].count("|")
    assert lines[2].endswith("| 0.95x | 97% | 2.90 | 100% |") and lines[3].endswith("| - | - | - | - |")
    lat = {"us": {"cute_attn": 22.0, "SDPA flash": 20.0}}
    assert bench.decode_latency_lines(lat)[2:] == ["| cute_attn | 22.0 | 1.10x |", "| SDPA flash | 20.0 | 1.00x |"]


def test_decode_num_splits_reads_the_interface(bench):
    shape = {"batch": 1, "seqlen_q": 1, "seqlen_k": 131072, "heads": 8, "heads_kv": 8, "head_dim": 128, "page_size": 0}

    class Plan:
        num_splits = 7

    class Iface:
        last_decode_plan = None

    assert bench._decode_num_splits(shape, 132, Iface) == "?"
    Iface.last_decode_plan = {"num_splits": 3}
    assert bench._decode_num_splits(shape, 132, Iface) == 3
    Iface.last_decode_plan = Plan()
    assert bench._decode_num_splits(shape, 132, Iface) == 7
    Iface.last_decode_splits = 5  # cute_attn.interface's name for it; 0 = no launcher built yet
    assert bench._decode_num_splits(shape, 132, Iface) == 5
    Iface.last_decode_splits = 0
    assert bench._decode_num_splits(shape, 132, Iface) == 7

    class ByName:
        @staticmethod
        def decode_num_splits(batch, heads_kv, seqlen_q, seqlen_k, num_sms, max_splits=128):
            return min(num_sms // (batch * heads_kv), max_splits)

    assert bench._decode_num_splits(shape, 132, ByName) == 16

    class Unknown:
        @staticmethod
        def decode_num_splits(batch, heads_kv_or_heads, seqlen_q, seqlen_k, num_sms):
            return 1

    assert bench._decode_num_splits(shape, 132, Unknown) == "?"


def test_startup_repeats_report_medians(monkeypatch, capsys):
    """tools/startup.py --repeat: every row runs that many times, interleaved, and the table shows
    each row's medians and its first call's range; --only drops the others (the runs are faked)."""
    spec = importlib.util.spec_from_file_location("startup", os.path.join(os.path.dirname(_PATH), "startup.py"))
    startup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(startup)
    calls = []

    def fake_run(which, seqlen, env, train=False):
        calls.append((which, seqlen, train, "CUTE_ATTN_CACHE_DIR" in env))
        first = [3.0, 1.0, 2.0][sum(c[0] == "fa4" for c in calls) - 1]  # by round
        return dict(import_s=0.5, first_s=first, second_s=0.001, per_call_us=20.0)

    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "fake GPU")
    monkeypatch.setattr(startup, "run", fake_run)
    startup.main(["--repeat", "3", "--seqlens", "128", "--train-seqlens", "--only", "fa4", "cute_attn"])
    out = capsys.readouterr().out
    assert {c[0] for c in calls} == {"fa4", "cute_attn"} and len(calls) == 9  # fa4, cold, warm, 3 times
    assert [c[0] for c in calls[:3]] == ["fa4", "cute_attn", "cute_attn"]  # interleaved rounds
    assert "median of 3 runs" in out
    for name in ("FA4 (CuTe DSL)", "cute_attn cold (empty disk cache)", "cute_attn warm (disk cache filled)"):
        assert f"| {name} | 1 x 128 | 0.50 | 2.00 | 1.00-3.00 | 1.00 | 20.0 |" in out
    assert "SDPA" not in out


def test_merge_reports_each_rows_median_ratio(bench, tmp_path, capsys):
    """--merge: the rows every run measured, cute_attn and the best peer per run (not cute_attn's
    own sweep columns, not the GEMM ceiling), the ratios and their median; no GPU, no timing."""
    import json

    def row(mode, s, ours, fa4, cudnn, sweep=None, ceiling=None):
        # two rounds each: cute_attn at 1 ms, the peers at their ratio to it, then 10% and 20% slower
        round_ms = {"cute_attn": [1.0, 1.0], "FA4 (CuTe DSL)": [ours / fa4, 1.1], "cuDNN (SDPA)": [ours / cudnn, 1.2]}
        r = {"mode": mode, "head_dim": 128, "causal": 1, "seqlen": s, "batch": 16384 // s, "heads": 16,
             "heads_kv": 16, "cute_attn": ours, "FA4 (CuTe DSL)": fa4, "cuDNN (SDPA)": cudnn, "round_ms": round_ms}
        if sweep:
            r["cute_attn m64n128s2"] = sweep
        if ceiling:
            r[bench.CEILING] = ceiling
        return r

    runs = [
        [row("bwd", 2048, 500, 490, 400, sweep=900, ceiling=800), row("bwd", 8192, 600, 610, 500)],
        [row("bwd", 2048, 505, 500, 510), row("bwd", 8192, 620, 600, 500)],
        [row("bwd", 2048, 495, 480, 400), row("bwd", 8192, 590, 600, 500), row("bwd", 16384, 1, 1, 1)],
    ]
    dirs = []
    for i, rows in enumerate(runs):
        d = tmp_path / f"run{i}"
        d.mkdir()
        (d / "bench.json").write_text(json.dumps({"meta": {}, "rows": rows}))
        dirs.append(str(d))
    bench.main(["--merge", *dirs])
    out = capsys.readouterr().out
    assert "median of 3 runs" in out
    # S 2048: best peers FA4 490 (not the sweep's 900 or the ceiling's 800), cuDNN 510, FA4 480
    # per round, pooled over the runs against each run's best peer: 1.02, 1.1 / 0.99, 1.2 / 1.03, 1.1
    assert ("| 128 | 1 | 2048 | 16/16 | 500 / 505 / 495 | 490 (FA4 (CuTe DSL)) / 510 (cuDNN (SDPA)) / "
            "480 (FA4 (CuTe DSL)) | 1.02 / 0.99 / 1.03 | 1.02x | 1.07 (5/6) |") in out
    assert "| 128 | 1 | 8192 | 16/16 | 600 / 620 / 590 |" in out and "| 0.98 / 1.03 / 0.98 | 0.98x | 1.07 (4/6) |" in out
    assert "16384" not in out  # measured by one run only
