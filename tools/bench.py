"""TFLOP/s of cute_attn and its peers, on the same inputs, in one run (needs a GPU).

    python tools/bench.py                       # the ANCHORS grid: bf16, 16k tokens, d 64/128, causal 0/1
    python tools/bench.py --modes fwd bwd fwdbwd   # forward, backward, forward+backward tables
    python tools/bench.py --seqlens 2048 8192 --head-dims 128 --causal 1
    python tools/bench.py --sweep m128n64w4s2 m128n128s2o0  # cute_attn with other traits too (SM80, SM90)
    python tools/bench.py --ceiling             # and a bf16 8192^3 matmul in every round, as a ceiling
    python tools/bench.py --sustained 2         # 2 s of back-to-back calls per timing (power-limited)
    python tools/bench.py --clocks              # and the SM clock per row (nvidia-smi), cycles when sustained
    python tools/bench.py --modes bwd --deterministic  # and cute_attn's backward with deterministic=True
    python tools/bench.py --window 1024 --seqlens 16384   # sliding window (1024, 0): vs dense causal, FA4
    python tools/bench.py --softcap 30                    # with softcap 30 vs without, FA4 with it
    python tools/bench.py --varlen                        # random lengths 128...4096 packed into 16k tokens
    python tools/bench.py --decode                        # KV-cache decode: issue 14's table (dense, paged), Sk sweep
    python tools/bench.py --decode --decode-sk            # the decode table only (--decode-sweep-only: the sweep only)
    python tools/bench.py --decode-latency                # wall time per decode call from Python (host overhead)
    python tools/bench.py --paged-varlen                  # flash_attn_varlen_func(block_table=): chunked-prefill batches
    python tools/bench.py --merge run1 run2 run3          # the --out dirs of one command run N times: median ratios

Peers: torch SDPA with the flash (FlashAttention-2) and cuDNN backends, and FlashAttention-4
(``flash_attn.cute``) when importable. Batch = tokens / seqlen, heads = 2048 / head_dim (``--gqa G``:
K and V with heads / G heads, GQA as in Llama-style models).
FLOPs = 4 * batch * heads * seqlen^2 * head_dim, halved when causal; backward counts 2.5x that,
forward+backward 3.5x. Backward is timed as autograd.grad of an existing output (each
implementation's own backward kernels, pre/postprocessing included).
Each shape is timed in ``--rounds`` rounds (each implementation once per round, in an order
shuffled anew each round; the median is reported), so clock and power drift during a run reach
every column alike. By default a timing is ``triton.testing.do_bench``'s median over a ~20 ms
burst; ``--sustained SECONDS`` times seconds of back-to-back calls instead, the regime of a
training run, where the H100 sits at its power limit and each kernel gets the clocks its own
power draw allows.
With ``--ceiling`` every round also times a bf16 8192^3 ``torch.mm`` (cuBLAS), the practical
tensor-core ceiling of the GPU at its clocks of that moment, and the table gains its TFLOP/s and
cute_attn's fraction of it.
With ``--window W``, ``--softcap C`` or ``--varlen``, the table is of that feature instead
(``feature_rows``): FLOPs counted over the (query, key) pairs that are visible, cute_attn with the
feature beside cute_attn's dense kernel (causal for a window; no softcap; equal lengths for varlen)
and the peers that have the feature: FA4 (window, softcap, varlen) and torch's
``varlen_attn`` (FlashAttention-2's varlen kernel, where this torch has it).
Prints a markdown table (TFLOP/s, cute_attn over the best peer, and the same round by round:
``per_round``); writes JSON and a PNG plot.
A burst row of several milliseconds moves by 2-4% between runs (the clocks under the power limit),
so a bar is judged on several runs of the same command (``--out`` one directory each, fresh
processes): ``--merge DIR...`` reads their bench.json and prints each row's cute_attn and best peer
per run, their ratios and the median ratio, and every run's rounds pooled (``merge_lines``).

``--decode`` (``decode_rows``) is memory-bound decoding against a KV cache: rows (B, Sq, Sk, heads
q/kv) = DECODE_TABLE, d ``--decode-head-dim`` (128), each dense and with a paged cache of every
``--paged`` page size (block_table a random permutation of the pages), then the ``--decode-sk``
sweep at B1 Sq1 heads 32/8. Bytes per call = q + out + the K and V rows attended
(2 * B * Sk * heads_kv * d elements), reported as TB/s beside the device's copy rate (a 1 GiB
``copy_``, bytes read + written). cute_attn is ``flash_attn_with_kvcache(q, k_cache, v_cache,
cache_seqlens=...)`` with a cache of exactly Sk rows, and again with num_splits=1; peers on the
same tensors: SDPA flash and cuDNN (q/k/v transposed to (B, H, S, d), enable_gqa), FA4
``flash_attn_func`` (dense rows) and ``flash_attn_varlen_func(page_table=, seqused_k=)`` ("FA4
paged", paged rows), both with num_splits=0 (FA4's own split heuristic) where accepted, and
FlashAttention-2's ``flash_attn_with_kvcache`` where importable. Every path is first checked
against an fp32 reference (a wrong one is not timed). Timing: per-call CUDA events after an L2
flush (``--decode-flush``: clean, a 256 MB read, by default; zero, a 256 MB write as triton's
``do_bench``, which leaves ~50 MB of dirty lines that each call then writes back) and a ~0.5 ms
sleep kernel (so a path's host time, FA4's ~0.1 ms, does not count as GPU time), in shuffled
rounds. ``--decode-read-floor`` adds per row the fastest plain read of the same bytes (a triton
streaming kernel over READ_FLOOR_CONFIGS, timed the same way): the launch, ramp and drain of a
short read make it the ceiling there, below the 1 GiB copy's rate. ``--decode-latency``: wall
time per call over back-to-back calls at B1 Sq1 Sk4096 heads 32/8, the host-overhead bar (within
10% of SDPA flash). Writes
bench_decode.json, bench_decode_sweep.json, bench_decode.png, bench_decode_latency.json.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def _peers():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def sdpa_with(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                            enable_gqa=k.shape[2] != q.shape[2]).transpose(1, 2)

        return run

    peers = {"FA2 (SDPA flash)": sdpa_with(SDPBackend.FLASH_ATTENTION), "cuDNN (SDPA)": sdpa_with(SDPBackend.CUDNN_ATTENTION)}
    try:
        from flash_attn.cute import flash_attn_func as fa4

        def run_fa4(q, k, v, causal):
            out = fa4(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out

        peers["FA4 (CuTe DSL)"] = run_fa4
    except Exception as e:  # noqa: BLE001
        print(f"# FlashAttention-4 not importable ({type(e).__name__}: {e}); skipped", file=sys.stderr)
    return peers


def _cute_attn_runners(sweep: list[str]):
    import cute_attn
    from cute_attn.interface import _launch_forward
    from cute_attn.traits import parse_traits

    def run(q, k, v, causal):
        if torch.is_grad_enabled():
            return cute_attn.flash_attn_func(q, k, v, causal=causal)
        return cute_attn.forward(q, k, v, causal=causal)

    runners = {"cute_attn": run}
    for spec in sweep:

        def run(q, k, v, causal, spec=spec):
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device, dtype=torch.float32)
            traits = parse_traits(spec, q.shape[3])
            _launch_forward(q, k, v, out, lse, causal, 1 / math.sqrt(q.shape[3]), traits=traits)
            return out

        runners[f"cute_attn {spec}"] = run
    return runners


def _cute_attn_backward_runners(sweep: list[str], deterministic: bool = False):
    """cute_attn with other backward traits: an autograd function over forward + _launch_backward;
    with ``deterministic``, also the default kernels with a fixed dQ summation order."""
    import cute_attn
    from cute_attn.interface import _launch_backward
    from cute_attn.traits import parse_backward_traits

    runners = {}
    if deterministic:
        runners["cute_attn deterministic"] = lambda q, k, v, causal: cute_attn.flash_attn_func(
            q, k, v, causal=causal, deterministic=True)
    for spec in sweep:

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, causal, spec=spec):
                out, lse = cute_attn.forward(q, k, v, causal=causal, return_lse=True)
                ctx.save_for_backward(q, k, v, out, lse)
                ctx.causal, ctx.spec = causal, spec
                return out

            @staticmethod
            def backward(ctx, dout):
                q, k, v, out, lse = ctx.saved_tensors
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                traits = parse_backward_traits(ctx.spec, q.shape[3])
                _launch_backward(dout.contiguous(), q, k, v, out, lse, dq, dk, dv, ctx.causal,
                                 1 / math.sqrt(q.shape[3]), False, traits=traits)
                return dq, dk, dv, None

        runners[f"cute_attn bwd {spec}"] = lambda q, k, v, causal, Fn=Fn: Fn.apply(q, k, v, causal)
    return runners


CEILING = "GEMM 8192^3 (cuBLAS)"
CEILING_FLOPS = 2 * 8192**3


def _ceiling_runner():
    """A bf16 8192^3 matmul: timed like the others but ignoring the attention inputs."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return lambda q, k, v, causal: torch.mm(a, b)


def _timed(fn, q, k, v, causal: bool, mode: str, rep_ms: float, sustained_s: float = 0.0) -> float:
    """Milliseconds for one forward, one backward, or both."""
    if mode == "fwd":
        with torch.no_grad():
            return _time_ms(lambda: fn(q, k, v, causal), rep_ms, sustained_s)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    dout = torch.randn_like(q)
    if mode == "bwd":
        out = fn(q, k, v, causal)
        return _time_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), rep_ms, sustained_s)
    return _time_ms(lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), dout), rep_ms, sustained_s)


def _time_ms(fn, rep_ms: float, sustained_s: float = 0.0) -> float:
    if sustained_s:
        return _sustained_ms(fn, sustained_s)
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")


def _sustained_ms(fn, seconds: float) -> float:
    """Mean milliseconds per call over ``seconds`` of back-to-back calls after half a second of
    warm-up: the GPU at its power limit and the clocks that holds, as in training, where
    do_bench's short bursts may still run on clocks a cooler GPU allows. A first call beforehand
    (a peer may compile its backward there, for seconds, while the GPU cools) does not count as
    warm-up."""
    fn()
    torch.cuda.synchronize()
    for budget in (0.5, seconds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0, calls = time.perf_counter(), 0
        start.record()
        while time.perf_counter() - t0 < budget:
            for _ in range(5):
                fn()
            calls += 5
            if calls % 50 == 0:  # keep the queue short so that the wall clock tracks the GPU
                torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def _settle_cute_attn_builds(calls) -> None:
    """Call each of ``calls`` once, then wait for cute_attn's background builds: a key that is not
    in the disk cache first runs a bootstrap kernel (compile.KernelCache.slot: the same results,
    slower) while its table kernel builds in a child process, and the first call after that build
    switches. Without this a cold process would time the bootstrap kernel (measured: a paged
    varlen prefill row 278 us against 228 us with its table kernel, H100, 2026-11-27)."""
    for call in calls:
        try:
            with torch.no_grad():
                call()
        except Exception:  # noqa: BLE001  (reported where it is timed)
            pass
    if "cute_attn" in sys.modules:
        from cute_attn import compile as cute_attn_compile

        cute_attn_compile.wait_for_background_builds(900)


class ClockLog:
    """The GPU's SM clock, power draw and clock-limit reasons, sampled every 10 ms by
    ``nvidia-smi -lms`` into a file for the length of a run (``--clocks``). A timing's window
    (wall-clock start and end) then gets its mean clock (``window_clock``). The reading changes
    in steps some 20-150 ms apart (H100, 2026-11-27), so within a ~20 ms burst it tells the
    regime (clocks between ~1200 and 1980 MHz under the 700 W cap) rather than the clock the
    kernel ran at: a burst timed at 1920 MHz was also seen to run slower than one at 1560. Over
    a ``--sustained`` timing of seconds the mean holds, and the rounds' cycles per call
    (``cycle_ratios``) tell a kernel that needs fewer cycles from one that met higher clocks."""

    def __init__(self, path: str):
        import subprocess

        self.path = path
        # the GPU torch uses, by UUID (nvidia-smi numbers GPUs without CUDA_VISIBLE_DEVICES)
        uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
        device = f"GPU-{uuid}" if uuid is not None else str(torch.cuda.current_device())
        query = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"
        self._file = open(path, "w")
        try:
            self._proc = subprocess.Popen(["nvidia-smi", "-i", device, f"--query-gpu={query}",
                                           "--format=csv,noheader,nounits", "-lms", "10"],
                                          stdout=self._file, stderr=subprocess.DEVNULL)
        except FileNotFoundError:
            self._file.close()
            raise SystemExit("--clocks samples the clock with nvidia-smi, which is not on PATH") from None

    def stop(self) -> list[tuple]:
        self._proc.terminate()
        self._proc.wait()
        self._file.close()
        with open(self.path) as f:
            return parse_clock_samples(f)


# nvidia-smi's clocks_event_reasons bit for the software power cap (the board's power limit)
SW_POWER_CAP = 0x4


def parse_clock_samples(lines) -> list[tuple]:
    """(unix time, SM MHz, watts, power-capped) per ``nvidia-smi --query-gpu=timestamp,clocks.sm,
    power.draw,clocks_event_reasons.active --format=csv,noheader,nounits`` line (local time, as
    ``time.time()`` reads it); lines that do not parse (a sample cut off at the end) are skipped."""
    samples = []
    for line in lines:
        fields = [x.strip() for x in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((stamp, float(fields[1]), float(fields[2]), bool(int(fields[3], 16) & SW_POWER_CAP)))
        except (ValueError, IndexError):
            continue
    return samples


def window_clock(samples: list[tuple], start: float, end: float) -> float | None:
    """Mean SM MHz of the samples within [start, end] (None: no sample there)."""
    inside = [mhz for t, mhz, _, _ in samples if start <= t <= end]
    return statistics.mean(inside) if inside else None


def add_round_clocks(row: dict, samples: list[tuple]) -> None:
    """``row["round_mhz"]``: each implementation's mean SM MHz in each round (from the timing
    windows in ``row["windows"]``), and ``row["power_capped"]``: the share of the row's samples
    taken under the power cap."""
    windows = row.get("windows") or {}
    row["round_mhz"] = {name: [window_clock(samples, *w) for w in ws] for name, ws in windows.items()}
    spans = [w for ws in windows.values() for w in ws]
    inside = [capped for t, _, _, capped in samples if any(a <= t <= b for a, b in spans)]
    row["power_capped"] = sum(inside) / len(inside) if inside else None


def cycle_ratios(row: dict, peer: str) -> list[float]:
    """As ``round_ratios``, in GPU cycles per call (milliseconds x that round's mean MHz,
    ``round_mhz``) instead of time: above 1 where cute_attn took fewer cycles than ``peer``."""
    mhz = row.get("round_mhz") or {}
    ours, theirs = mhz.get("cute_attn"), mhz.get(peer)
    ratios = round_ratios(row, peer)
    if not ratios or not ours or not theirs or None in ours or None in theirs:
        return []
    return [r * p / o for r, o, p in zip(ratios, ours, theirs)]


def _time_interleaved(impls: dict, q, k, v, causal: bool, mode: str, rounds: int, where: str,
                      sustained_s: float = 0.0, timed=None, windows: dict | None = None) -> dict:
    """Milliseconds per implementation in each of ``rounds`` rounds, each round timing every
    implementation once, in an order shuffled anew each round: clock and power drift during a run
    then reach every column alike instead of favouring whichever ran first (the caller takes the
    median). None for one that failed; the ceiling matmul is always timed as a forward. ``timed``
    replaces ``_timed`` (the decode mode's timer). cute_attn's kernels are settled first
    (``_settle_cute_attn_builds``). ``windows``: filled with the wall-clock (start, end) of
    each timing's timed calls per implementation, for ``ClockLog``."""
    _settle_cute_attn_builds([lambda fn=fn: fn(q, k, v, causal) for fn in impls.values()])
    times = {name: [] for name in impls}
    rep_ms = max(100 / rounds, 20)
    for r in range(rounds):
        # A new order every round (seeded: the same in every run), so that no implementation always
        # follows the same one: the one right after a power-hungry kernel starts on lowered clocks
        # (up to 10% after cuBLAS's GEMM, measured), and a fixed or rotated order, which keeps
        # each one's predecessor, would charge that to one column.
        names = list(impls)
        if r:
            random.Random(r).shuffle(names)
        for name in names:
            fn = impls[name]
            if times[name] is None:
                continue
            try:
                if windows is not None:
                    torch.cuda.synchronize()
                    start = time.time()
                ms = (timed or _timed)(fn, q, k, v, causal, "fwd" if name == CEILING else mode, rep_ms, sustained_s)
                times[name].append(ms)
                if windows is not None:
                    torch.cuda.synchronize()
                    end = time.time()
                    # the timed calls are the last ones (do_bench's ~rep_ms, or the sustained
                    # seconds): not the warm-up and first calls before them, which may compile
                    # while the GPU idles at its top clock
                    timed_s = sustained_s if sustained_s else max(rep_ms, ms) / 1e3
                    windows.setdefault(name, []).append((max(start, end - timed_s), end))
            except Exception as e:  # noqa: BLE001
                print(f"# {name} {mode} failed at {where}: {type(e).__name__}: {e}", file=sys.stderr)
                times[name] = None
    return times


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    p.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--gqa", type=int, default=1, metavar="G",
                   help="query heads per K/V head (GQA; 1: MHA) in the dense and --varlen tables; FLOPs are counted "
                        "over the query heads")
    p.add_argument("--modes", nargs="+", choices=["fwd", "bwd", "fwdbwd"], default=["fwd"])
    p.add_argument("--sweep", nargs="*", default=[], help="cute_attn with other forward traits too: SM80 m128n64w4s2, SM90 m128n128s2 (o0: no intra-warpgroup overlap, p0: no ping-pong)")
    p.add_argument("--bwd-sweep", nargs="*", default=[], help="extra cute_attn backward traits: SM80 m64n128w8a2b4c2, SM90 m64n128s2, SM90 large head dims m64n48s2d1t (d1: dO stages, t: transposed dK/dV, q2: dQ in two column parts)")
    p.add_argument("--deterministic", action="store_true",
                   help="bwd/fwdbwd: also cute_attn with deterministic=True (the cost of a fixed dQ order)")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--ceiling", action="store_true",
                   help="also time a bf16 8192^3 matmul in every round (the tensor-core ceiling)")
    p.add_argument("--rounds", type=int, default=3,
                   help="time every implementation once per round (shuffled order) and report the median")
    p.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                   help="time each implementation as SECONDS of back-to-back calls (after 0.5 s of warm-up) "
                        "instead of do_bench's short bursts: throughput at the GPU's power limit")
    p.add_argument("--window", type=int, default=None, metavar="W",
                   help="sliding window (W, 0): cute_attn and FA4 with it, beside cute_attn's dense causal kernel")
    p.add_argument("--softcap", type=float, default=None, metavar="C",
                   help="softcap C: cute_attn with and without it, FA4 with it")
    p.add_argument("--varlen", action="store_true",
                   help="a batch of random lengths 128...4096 (seeded) packed into --tokens: cute_attn varlen, "
                        "cute_attn dense on equal lengths, FA4 varlen, torch varlen_attn")
    p.add_argument("--varlen-lengths", type=int, nargs=2, default=[128, 4096], metavar=("MIN", "MAX"),
                   help="--varlen: the range of the random lengths (short ones make batches of many sequences: "
                        "the SM90 forward numbers non-causal tiles without holes up to 32)")
    p.add_argument("--clocks", action="store_true",
                   help="dense tables: log the SM clock (nvidia-smi, every 10 ms) and add a table of each row's clocks, "
                        "its share of samples under the power cap and, with --sustained 1 or more, its per-round "
                        "ratio in GPU cycles per call beside the one in time (ClockLog)")
    p.add_argument("--out", default="bench_results", help="directory for JSON and PNG")
    p.add_argument("--merge", nargs="+", metavar="DIR", default=None,
                   help="no timing: the bench.json of several runs' --out directories, each row's median ratio")
    d = p.add_argument_group("decode (KV cache, issue 14): TB/s of q, out and the K/V rows attended")
    d.add_argument("--decode", action="store_true",
                   help="the decode table (DECODE_TABLE, dense and with each --paged page size) and the --decode-sk "
                        "sweep: cute_attn.flash_attn_with_kvcache (and with num_splits=1) beside SDPA flash and "
                        "cuDNN, FA4, FA4 paged and FlashAttention-2's flash_attn_with_kvcache where importable")
    d.add_argument("--paged", type=int, nargs="*", default=[64, 256], metavar="PAGE",
                   help="decode: also every row with a paged cache of these page sizes (none: dense only)")
    d.add_argument("--decode-sk", type=int, nargs="*", default=list(DECODE_SWEEP_SK), metavar="SK",
                   help="decode: the sweep's cache lengths at B1 Sq1, heads --decode-sweep-heads (none: no sweep)")
    d.add_argument("--decode-sweep-heads", type=int, nargs=2, default=list(DECODE_SWEEP_HEADS), metavar=("H", "HKV"))
    d.add_argument("--decode-sweep-only", action="store_true", help="decode: the sweep without the table")
    d.add_argument("--decode-head-dim", type=int, default=128, help="decode: head dim (--head-dims is not used)")
    d.add_argument("--decode-latency", action="store_true",
                   help="wall time per call from Python over back-to-back calls at B1 Sq1 Sk4096 heads 32/8 "
                        "(host overhead); alone or with --decode")
    d.add_argument("--decode-latency-calls", type=int, default=2000)
    d.add_argument("--decode-read-floor", action="store_true",
                   help="decode: also per row the fastest plain read of the row's bytes (a triton streaming kernel, "
                        "READ_FLOOR_CONFIGS, timed as the rows are): what any kernel that must read them can reach")
    d.add_argument("--decode-flush", choices=FLUSH_MODES, default="clean",
                   help="how L2 is emptied before each timed decode call: clean (read 256 MB) or zero (write it, "
                        "as triton's do_bench; the call then also writes back ~50 MB of dirty lines)")
    d.add_argument("--paged-varlen", action="store_true",
                   help="flash_attn_varlen_func(..., block_table) on PAGED_VARLEN_CASES (prefill chunks and decode "
                        "rows over a paged cache, causal, d --decode-head-dim, heads 32/8) beside FA4's "
                        "flash_attn_varlen_func(page_table, seqused_k): microseconds per call")
    d.add_argument("--paged-varlen-page", type=int, default=16, help="--paged-varlen: keys per page")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.merge:
        print("\n".join(merge_lines(args.merge)))
        return
    _FLUSH_MODE[0] = args.decode_flush
    if args.paged_varlen:
        return paged_varlen_rows(args)
    if args.decode or args.decode_latency:
        return decode_rows(args)
    if args.window is not None or args.softcap is not None or args.varlen:
        return feature_rows(args)

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    ours = _cute_attn_runners(args.sweep)
    ours_bwd = _cute_attn_backward_runners(args.bwd_sweep, args.deterministic)
    peers = {} if args.no_peers else _peers()
    extra = {}
    if args.ceiling:
        extra[CEILING] = _ceiling_runner()
    rows = []
    os.makedirs(args.out, exist_ok=True)
    clocks = ClockLog(os.path.join(args.out, "clocks.csv")) if args.clocks else None
    for mode in args.modes:
        impls = {**ours, **peers} if mode == "fwd" else {"cute_attn": ours["cute_attn"], **ours_bwd, **peers}
        impls.update(extra)
        for d in args.head_dims:
            for causal in args.causal:
                for s in args.seqlens:
                    batch, heads = max(args.tokens // s, 1), 2048 // d
                    heads_kv = max(heads // args.gqa, 1)  # GQA: query heads share K/V heads
                    q = torch.randn(batch, s, heads, d, device="cuda", dtype=dtype)
                    k, v = (torch.randn(batch, s, heads_kv, d, device="cuda", dtype=dtype) for _ in range(2))
                    flops = 4 * batch * heads * s * s * d / (2 if causal else 1)
                    flops *= {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[mode]
                    row = {"mode": mode, "head_dim": d, "causal": causal, "seqlen": s, "batch": batch, "heads": heads,
                           "heads_kv": heads_kv}
                    windows = {} if clocks else None
                    times = _time_interleaved(impls, q, k, v, bool(causal), mode, args.rounds,
                                              f"d={d} causal={causal} S={s}", args.sustained, windows=windows)
                    for name, t in times.items():
                        row[name] = None if not t else (CEILING_FLOPS if name == CEILING else flops) / statistics.median(t) / 1e9
                    row["round_ms"] = times  # every round's milliseconds, for the spread
                    if windows is not None:
                        row["windows"] = windows  # (replaced by the rounds' clocks below)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    if clocks:
        samples = clocks.stop()
        for row in rows:
            add_round_clocks(row, samples)
    for row in rows:
        row.pop("windows", None)
    _report(rows, list(ours) + list(ours_bwd), list(peers), list(extra), args)


def _visible_pairs(lengths, causal: bool, window: int | None = None) -> int:
    """(query, key) pairs a batch of (seqlen_q = seqlen_k) sequences computes: the FLOP count's base."""
    total = 0
    for s in lengths:
        if window is not None:  # (window, 0): query i sees min(i, window) + 1 keys
            w = min(window, s - 1)
            total += (w + 1) * (w + 2) // 2 - (w + 1) + (s - w) * (w + 1) if s > w else s * (s + 1) // 2
        else:
            total += s * (s + 1) // 2 if causal else s * s
    return total


def feature_rows(args):
    """The --window / --softcap / --varlen tables (one shape family each, modes as asked)."""
    import cute_attn

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    fa4 = fa4_varlen = None
    try:
        if not args.no_peers:
            from flash_attn.cute import flash_attn_func as fa4, flash_attn_varlen_func as fa4_varlen
    except Exception as e:  # noqa: BLE001
        print(f"# FlashAttention-4 not importable ({type(e).__name__}: {e}); skipped", file=sys.stderr)
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    rows = []
    for mode in args.modes:
        for d in args.head_dims:
            heads = 2048 // d
            for causal in args.causal:
                for s in (args.seqlens if not args.varlen else [0]):
                    impls, feature = {}, ""
                    if args.varlen:
                        rng = random.Random(0)
                        lengths = []
                        while sum(lengths) < args.tokens:
                            lengths.append(min(rng.randint(*args.varlen_lengths), args.tokens - sum(lengths)))
                        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
                        mx = max(lengths)
                        heads_kv = max(heads // args.gqa, 1)  # GQA: query heads share K/V heads
                        q = torch.randn(sum(lengths), heads, d, device="cuda", dtype=dtype)
                        k, v = (torch.randn(sum(lengths), heads_kv, d, device="cuda", dtype=dtype) for _ in range(2))
                        lo, hi = args.varlen_lengths
                        flops_pairs, feature = _visible_pairs(lengths, bool(causal)), f"varlen {lo}-{hi}"
                        impls["cute_attn varlen"] = lambda q, k, v, c: cute_attn.flash_attn_varlen_func(
                            q, k, v, cu, cu, mx, mx, causal=c)
                        # equal lengths, the same tokens (a power of two near the mean length): the
                        # dense kernel this must keep up with, on views of the same packed tensors
                        mean = min(max(2 ** round(math.log2(args.tokens / len(lengths))), 128), args.tokens)
                        dense_pairs = _visible_pairs([mean] * (args.tokens // mean), bool(causal))
                        impls["cute_attn dense (equal lengths)"] = lambda q, k, v, c: cute_attn.flash_attn_func(
                            *(t.view(-1, mean, t.shape[1], d) for t in (q, k, v)), causal=c).view(q.shape)
                        if fa4_varlen is not None:
                            impls["FA4 varlen"] = lambda q, k, v, c: first(fa4_varlen(
                                q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=c))
                        if not args.no_peers and heads_kv == heads:  # (torch's varlen_attn: no GQA)
                            try:
                                from torch.nn.attention.varlen import varlen_attn

                                impls["FA2 varlen (torch varlen_attn)"] = lambda q, k, v, c: first(varlen_attn(
                                    q, k, v, cu, cu, mx, mx, window_size=(-1, 0) if c else (-1, -1)))
                            except Exception as e:  # noqa: BLE001
                                print(f"# torch varlen_attn not available ({type(e).__name__}: {e})", file=sys.stderr)
                    else:
                        batch = max(args.tokens // s, 1)
                        q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=dtype) for _ in range(3))
                        if args.window is not None:
                            w = args.window
                            feature = f"window ({w}, 0)"
                            flops_pairs = batch * _visible_pairs([s], True, w)
                            dense_pairs = batch * _visible_pairs([s], True)
                            impls["cute_attn window"] = lambda q, k, v, c: cute_attn.flash_attn_func(
                                q, k, v, causal=True, window_size=(w, 0))
                            impls["cute_attn dense causal"] = lambda q, k, v, c: cute_attn.flash_attn_func(
                                q, k, v, causal=True)
                            if fa4 is not None:
                                impls["FA4 window"] = lambda q, k, v, c: first(fa4(q, k, v, causal=True,
                                                                                   window_size=(w, 0)))
                        else:
                            cap = args.softcap
                            feature = f"softcap {cap:g}"
                            flops_pairs = dense_pairs = batch * _visible_pairs([s], bool(causal))
                            impls["cute_attn softcap"] = lambda q, k, v, c: cute_attn.flash_attn_func(
                                q, k, v, causal=c, softcap=cap)
                            impls["cute_attn no softcap"] = lambda q, k, v, c: cute_attn.flash_attn_func(q, k, v, causal=c)
                            if fa4 is not None:
                                impls["FA4 softcap"] = lambda q, k, v, c: first(fa4(q, k, v, causal=c, softcap=cap))
                    scale = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[mode] * 4 * heads * d
                    times = _time_interleaved(impls, q, k, v, bool(causal), mode, args.rounds,
                                              f"{feature} d={d} causal={causal} S={s}", args.sustained)
                    row = {"mode": mode, "feature": feature, "head_dim": d, "causal": causal, "seqlen": s}
                    for name, t in times.items():
                        pairs = dense_pairs if "dense" in name or "no softcap" in name else flops_pairs
                        row[name] = None if not t else scale * pairs / statistics.median(t) / 1e9
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    gpu = torch.cuda.get_device_name()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    import cutlass

    print(f"\n{gpu}, {stamp}, torch {torch.__version__}, nvidia-cutlass-dsl {getattr(cutlass, '__version__', '?')}, "
          f"{args.dtype}, {args.tokens} tokens, TFLOP/s over visible (query, key) pairs\n")
    cols = list(dict.fromkeys(c for r in rows for c in r if c not in ("mode", "feature", "head_dim", "causal", "seqlen")))
    ours = cols[0]
    print("| mode | feature | d | causal | S | " + " | ".join(cols) + f" | {ours} / {cols[1]} | {ours} / best peer |")
    print("|---|---|---|---|---|" + "---|" * (len(cols) + 2))
    for r in rows:
        peers = [r[c] for c in cols if not c.startswith("cute_attn") and r.get(c)]
        best = max(peers, default=None)
        cells = [f"{r[c]:.0f}" if r.get(c) else "-" for c in cols]
        own = f"{r[ours] / r[cols[1]]:.2f}x" if r.get(ours) and r.get(cols[1]) else "-"
        vs = f"{r[ours] / best:.2f}x" if r.get(ours) and best else "-"
        print(f"| {r['mode']} | {r['feature']} | {r['head_dim']} | {r['causal']} | {r['seqlen'] or '-'} | "
              + " | ".join(cells) + f" | {own} | {vs} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_features.json"), "w") as f:
        json.dump({"gpu": gpu, "date": stamp, "rows": rows}, f, indent=1)


def _gqa_note(args) -> str:
    g = getattr(args, "gqa", 1)
    return f", GQA {g} query heads per K/V head" if g > 1 else ""


# the fields of a bench.json row that are not an implementation's TFLOP/s
_ROW_FIELDS = ("mode", "head_dim", "causal", "seqlen", "batch", "heads", "heads_kv", "round_ms", "round_mhz",
               "power_capped")


def merge_lines(dirs: list[str]) -> list[str]:
    """Markdown tables of the rows that every run in ``dirs`` (``--out`` directories of one
    command) measured: per run cute_attn's TFLOP/s and the best peer's (not cute_attn's own sweep
    columns, not the GEMM ceiling), their ratios, and the median ratio, the figure a bar is judged
    on; then every run's rounds pooled (``round_ratios`` against that run's best peer: their median
    and the rounds won). A run without a peer in a row counts no ratio there."""
    runs = []
    for d in dirs:
        with open(os.path.join(d, "bench.json")) as f:
            runs.append({_row_key(r): r for r in json.load(f)["rows"]})
    keys = [k for k in runs[0] if all(k in run for run in runs)]
    lines = [f"median of {len(runs)} runs ({', '.join(dirs)})"]
    for mode in dict.fromkeys(k[0] for k in keys):
        lines += ["", f"{mode}:", "",
                  "| d | causal | S | heads q/kv | cute_attn per run | best peer per run | cute_attn / best peer per run "
                  "| median | per round, all runs (won) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for k in (k for k in keys if k[0] == mode):
            ours, peers, ratios, rounds = [], [], [], []
            for run in runs:
                row = run[k]
                best = _best_peer(row, [c for c in row if c not in _ROW_FIELDS])
                ours.append(f"{row['cute_attn']:.0f}" if row.get("cute_attn") else "-")
                peers.append(f"{best[0]:.0f} ({best[1]})" if best else "-")
                if best and row.get("cute_attn"):
                    ratios.append(row["cute_attn"] / best[0])
                    rounds += round_ratios(row, best[1])
            median = f"{statistics.median(ratios):.2f}x" if ratios else "-"
            lines.append(f"| {k[1]} | {k[2]} | {k[3]} | {k[4]}/{k[5]} | {' / '.join(ours)} | {' / '.join(peers)} | "
                         f"{' / '.join(f'{x:.2f}' for x in ratios) or '-'} | {median} | {per_round(rounds)} |")
    return lines


def _best_peer(row: dict, cols) -> tuple[float, str] | None:
    """(value, column) of the fastest peer of ``row`` among ``cols``: not cute_attn's own columns,
    not the GEMM ceiling, timed (None where no peer is)."""
    return max(((row[c], c) for c in cols if not c.startswith("cute_attn") and c != CEILING and row.get(c)),
               default=None)


def round_ratios(row: dict, peer: str) -> list[float]:
    """cute_attn's speed over ``peer`` in each round of ``row`` (``round_ms``: both timed once per
    round, in an order shuffled anew each round); empty where either was not timed every round."""
    rounds = row.get("round_ms") or {}
    ours, theirs = rounds.get("cute_attn"), rounds.get(peer)
    if not ours or not theirs or len(ours) != len(theirs):
        return []
    return [p / o for o, p in zip(ours, theirs)]


def per_round(ratios: list[float]) -> str:
    """Per-round ratios (``round_ratios``) as their median and the rounds cute_attn was the faster,
    e.g. '1.01 (6/9)'. A single round of a long burst row moves by up to +-20% (H100, 2026-11-27),
    which a ratio of medians hides; '-' with fewer than two rounds."""
    if len(ratios) < 2:
        return "-"
    return f"{statistics.median(ratios):.2f} ({sum(x > 1 for x in ratios)}/{len(ratios)})"


def clock_lines(rows: list[dict], peers: list[str], cycles: bool) -> list[str]:
    """``--clocks``: per row the median SM MHz of cute_attn's and the best peer's timings, the share
    of samples under the power cap, the per-round ratio in time and, with ``cycles`` (sustained
    timings, where a window's mean clock holds: ``ClockLog``), the one in cycles per call."""
    lines = ["| d | causal | S | cute_attn MHz | best peer MHz | power-capped | per round (won) |"
             + (" per round in cycles (won) |" if cycles else ""), "|---|---|---|---|---|---|---|" + "---|" * cycles]
    def median_mhz(row, name):
        values = [x for x in (row.get("round_mhz") or {}).get(name) or [] if x is not None]
        return f"{statistics.median(values):.0f}" if values else "-"

    for r in rows:
        best = _best_peer(r, peers)
        capped = "-" if r.get("power_capped") is None else f"{100 * r['power_capped']:.0f}%"
        peer = best[1] if best else None
        lines.append(f"| {r['head_dim']} | {r['causal']} | {r['seqlen']} | {median_mhz(r, 'cute_attn')} | "
                     f"{median_mhz(r, peer) if peer else '-'} ({peer or '-'}) | {capped} | "
                     f"{per_round(round_ratios(r, peer)) if peer else '-'} |"
                     + (f" {per_round(cycle_ratios(r, peer)) if peer else '-'} |" if cycles else ""))
    return lines


def _row_key(row: dict) -> tuple:
    return (row["mode"], row["head_dim"], row["causal"], row["seqlen"], row["heads"], row["heads_kv"])


def _report(rows, ours, peers, extra, args):
    gpu = torch.cuda.get_device_name()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        import cutlass

        dsl = getattr(cutlass, "__version__", "?")
    except Exception:  # noqa: BLE001
        dsl = "?"
    fa2 = "FA2 (SDPA flash)"

    def ratio(r, ref):
        return f"{r['cute_attn'] / ref:.2f}x" if ref and r.get("cute_attn") else "-"

    for mode in args.modes:
        sel = [r for r in rows if r["mode"] == mode]
        cols = [c for c in ours + peers + extra if any(c in r for r in sel)]
        title = {"fwd": "forward", "bwd": "backward", "fwdbwd": "forward+backward"}[mode]
        print(f"\n{gpu}, {stamp}, torch {torch.__version__}, nvidia-cutlass-dsl {dsl}, {args.dtype}, "
              f"{args.tokens} tokens{_gqa_note(args)}, "
              f"{title} TFLOP/s\n")
        tail = " | cute_attn / ceiling |" if extra else " |"
        print("| d | causal | S | " + " | ".join(cols) + " | cute_attn / FA2 | cute_attn / best peer"
              + " | per round (won)" + tail)
        print("|---|---|---|" + "---|" * (len(cols) + 3 + bool(extra)))
        for r in sel:
            best, best_name = _best_peer(r, peers) or (None, None)
            cells = [f"{r[c]:.0f}" if r.get(c) else "-" for c in cols]
            ceiling = f" {ratio(r, r.get(CEILING))} |" if extra else ""
            print(f"| {r['head_dim']} | {r['causal']} | {r['seqlen']} | " + " | ".join(cells)
                  + f" | {ratio(r, r.get(fa2))} | {ratio(r, best)} | {per_round(round_ratios(r, best_name))} |"
                  + ceiling)
        if any(r.get("round_mhz") for r in sel):
            print("\n" + "\n".join(clock_lines(sel, peers, cycles=args.sustained >= 1)))
    os.makedirs(args.out, exist_ok=True)
    meta = {"gpu": gpu, "date": stamp, "torch": torch.__version__, "cutlass_dsl": dsl, "dtype": args.dtype}
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    try:
        for mode in args.modes:
            sel = [r for r in rows if r["mode"] == mode]
            _plot(sel, [c for c in ours + peers + extra if any(c in r for r in sel)],
                  os.path.join(args.out, f"bench_{mode}.png"), f"{gpu} {mode}, {args.dtype}")
    except Exception as e:  # noqa: BLE001
        print(f"# plot skipped: {e}", file=sys.stderr)


def _plot(rows, cols, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.8), squeeze=False)
    for ax, (d, c) in zip(axes[0], groups):
        sel = [r for r in rows if r["head_dim"] == d and r["causal"] == c]
        for col in cols:
            ax.plot([r["seqlen"] for r in sel], [r.get(col) or float("nan") for r in sel], marker="o", label=col)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d={d} causal={c}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------------------------
# --decode: KV-cache decode (issue 14). Memory-bound: the figure of merit is the bytes a call must
# move (q and out, and the K and V rows attended) per second, against the device's copy rate.

# (batch, seqlen_q, seqlen_k, heads, heads_kv): issue 14's table
DECODE_TABLE = ((1, 1, 131072, 8, 8), (1, 1, 8192, 32, 32), (64, 1, 8192, 32, 8), (16, 4, 16384, 32, 8))
DECODE_SWEEP_SK = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
DECODE_SWEEP_HEADS = (32, 8)
DECODE_LATENCY_SHAPE = (1, 1, 4096, 32, 8)  # the host-overhead bar: B1, Sk 4096
COPY_ELEMENTS = 2**29  # the device-copy reference: 1 GiB of bf16 copied (2 GiB moved)


# flash_attn_varlen_func(block_table=): (name, query rows per sequence, keys per sequence), causal
PAGED_VARLEN_CASES = (
    ("4 prefill chunks of 1024 queries", (1024,) * 4, (2048, 3072, 4096, 1024)),
    ("64 decode rows over 4096 keys", (1,) * 64, (4096,) * 64),
    ("2 chunks of 512 queries + 30 decode rows", (512, 512) + (1,) * 30, (2048, 1024) + (4096,) * 30),
    ("16 chunks of 128 queries", (128,) * 16, (1024, 4096) * 8),
    ("8 chunks of 64 queries over 8192 keys", (64,) * 8, (8192,) * 8),
    ("a chunk of 4096 queries + 31 decode rows", (4096,) + (1,) * 31, (4096,) * 32),
    ("a chunk of 512 queries + 63 decode rows", (512,) + (1,) * 63, (4096,) * 64),
    ("16 rows of 4 queries (speculative decoding)", (4,) * 16, (4096,) * 16),
)


def paged_varlen_rows(args) -> list[dict]:
    """``--paged-varlen``: cute_attn's paged varlen call and FA4's on the same packed queries and
    shuffled page pool, each checked against the other first; median microseconds per call over
    --rounds shuffled rounds of ``_gpu_ms`` (a sleep kernel queued before each timed call, as the
    decode rows: a call shorter than its host time would otherwise time the host). On Hopper also cute_attn's decode kernel alone (under
    force_arch("sm80")) and its SM90 forward alone (the rule's row threshold set to 0), beside the
    kernel the rule picks (kvcache.sm90_paged_varlen)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    import cute_attn

    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4_varlen
    except Exception as e:  # noqa: BLE001
        fa4_varlen = None
        print(f"# FlashAttention-4 not importable ({type(e).__name__}: {e}): cute_attn alone", file=sys.stderr)
    heads, heads_kv, d, page = 32, 8, args.decode_head_dim, args.paged_varlen_page
    print(f"flash_attn_varlen_func(block_table=), {page}-key pages, d{d} heads {heads}/{heads_kv}, causal: us per call")
    hopper = torch.cuda.get_device_capability() == (9, 0)
    print("| batch | kernel picked | cute_attn | cute_attn decode kernel | cute_attn SM90 forward | FA4 paged "
          "| cute_attn speed / FA4 |\n|---|---|---|---|---|---|---|")
    rows = []
    for name, lens_q, lens_k in PAGED_VARLEN_CASES:
        torch.manual_seed(0)
        batch = len(lens_q)
        q = torch.randn(sum(lens_q), heads, d, device="cuda", dtype=dtype)
        max_pages = max(-(-n // page) for n in lens_k)
        k_pages, v_pages = (torch.randn(batch * max_pages, page, heads_kv, d, device="cuda", dtype=dtype)
                            for _ in range(2))
        table = torch.randperm(batch * max_pages, device="cuda").view(batch, max_pages).to(torch.int32)

        def offsets(lens):
            return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")

        cu_q, cu_k = offsets(lens_q), offsets(lens_k)
        used = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
        call = lambda: cute_attn.flash_attn_varlen_func(  # noqa: E731
            q, k_pages, v_pages, cu_q, cu_k, max(lens_q), max(lens_k), causal=True, block_table=table)
        impls = {"cute_attn": call}
        if hopper:
            impls["cute_attn decode kernel"] = lambda: _under_sm80(call)
            impls["cute_attn SM90 forward"] = lambda: _sm90_always(call)
        if fa4_varlen is not None:
            impls["FA4 paged"] = lambda: fa4_varlen(q, k_pages, v_pages, cu_seqlens_q=cu_q, max_seqlen_q=max(lens_q),
                                                    seqused_k=used, page_table=table, causal=True)
        times = {n: [] for n in impls}
        with torch.no_grad():
            outs = {n: (lambda o: o[0] if isinstance(o, tuple) else o)(fn()) for n, fn in impls.items()}
            if "FA4 paged" in outs:
                diff = max((o.float() - outs["FA4 paged"].float()).abs().max().item() for o in outs.values())
                if diff > 0.05:
                    print(f"# {name}: cute_attn and FA4 differ by {diff:.3g}; not timed", file=sys.stderr)
                    continue
            _settle_cute_attn_builds(impls.values())
            for _ in range(args.rounds):
                order = list(impls)
                random.shuffle(order)
                for n in order:
                    times[n].append(_gpu_ms(impls[n], 100) * 1e3)
        from cute_attn import kvcache

        opts = cute_attn.interface._score_options(True, None, d)
        sm90 = kvcache.sm90_paged_varlen(q, heads_kv, opts, max(lens_q), page, batch)
        picked = "decode" if sm90 is None else "sm90 packed" if sm90.pack_gqa else "sm90"
        row = {"case": name, "page_size": page, "picked": picked,
               **{n: statistics.median(t) for n, t in times.items()}}
        rows.append(row)
        ratio = f"{row['FA4 paged'] / row['cute_attn']:.2f}x" if "FA4 paged" in row else "-"
        cells = " | ".join(f"{row[n]:.0f}" if n in row else "-"
                           for n in ("cute_attn", "cute_attn decode kernel", "cute_attn SM90 forward", "FA4 paged"))
        print(f"| {name} | {picked} | {cells} | {ratio} |", flush=True)
    return rows


def _sm90_always(fn):
    """``fn()`` with the paged varlen call's SM90 threshold at 0 (the SM90 forward wherever it can run).
    Its calls keep a fast path of their own (kvcache._PAGED_VARLEN_RUNS swapped): the threshold is
    not part of the signature, so a run stored under either rule would serve the other, and
    emptying the store instead would time every forced call's checks."""
    from cute_attn import kvcache, traits

    saved, traits.SM90_PAGED_MIN_QUERIES = traits.SM90_PAGED_MIN_QUERIES, 0
    runs, kvcache._PAGED_VARLEN_RUNS = kvcache._PAGED_VARLEN_RUNS, _SM90_ALWAYS_RUNS
    try:
        return fn()
    finally:
        traits.SM90_PAGED_MIN_QUERIES = saved
        kvcache._PAGED_VARLEN_RUNS = runs


_SM90_ALWAYS_RUNS: dict = {}  # _sm90_always's calls' fast path


def _under_sm80(fn):
    """``fn()`` with the SM80-family kernels forced (on Hopper: the decode kernel for paged varlen)."""
    from cute_attn import dispatch

    with dispatch.force_arch("sm80"):
        return fn()


def decode_pages(seqlen_k: int, page_size: int) -> int:
    """Pages one sequence of ``seqlen_k`` keys takes."""
    return -(-seqlen_k // page_size)


def decode_bytes(shape: dict, elem_size: int) -> int:
    """Bytes a decode call must move: q read and out written (batch * seqlen_q * heads * d each) and
    the K and V rows attended (batch * seqlen_k * heads_kv * d each). Block table, cache_seqlens and
    split partials are not counted (the paged rows count the same bytes as the dense ones)."""
    qo = 2 * shape["batch"] * shape["seqlen_q"] * shape["heads"] * shape["head_dim"]
    kv = 2 * shape["batch"] * shape["seqlen_k"] * shape["heads_kv"] * shape["head_dim"]
    return (qo + kv) * elem_size


def decode_shapes(table, sweep_sk, sweep_heads, page_sizes, head_dim: int, include_table: bool = True) -> list[dict]:
    """The rows of --decode: every table shape dense, then with each page size; then the sweep
    (B1 Sq1, heads ``sweep_heads``) over ``sweep_sk``, likewise. page_size 0 = dense."""
    shapes = []

    def add(part, b, sq, sk, h, hkv):
        for page in [0, *page_sizes]:
            shapes.append({"part": part, "batch": b, "seqlen_q": sq, "seqlen_k": sk, "heads": h, "heads_kv": hkv,
                           "head_dim": head_dim, "page_size": page})

    if include_table:
        for b, sq, sk, h, hkv in table:
            add("table", b, sq, sk, h, hkv)
    for sk in sweep_sk:
        add("sweep", 1, 1, sk, *sweep_heads)
    return shapes


def _decode_label(shape: dict) -> str:
    page = f" paged {shape['page_size']}" if shape["page_size"] else ""
    return (f"B{shape['batch']} Sq{shape['seqlen_q']} Sk{shape['seqlen_k']} H{shape['heads']}/{shape['heads_kv']} "
            f"d{shape['head_dim']}{page}")


def _decode_num_splits(shape: dict, num_sms: int, interface=None):
    """cute_attn's split count for this shape, if its interface says, read right after the first call
    of this shape (which builds its launcher): ``last_decode_splits`` (an int, 0 before any) or
    ``last_decode_plan`` (an int, a dict or an object with ``num_splits``), else ``decode_num_splits``
    called by parameter names when every required one is known here; '?' if none works."""
    try:
        if interface is None:
            from cute_attn import interface
        if getattr(interface, "last_decode_splits", 0):
            return int(interface.last_decode_splits)
        plan = getattr(interface, "last_decode_plan", None)
        if plan is not None:
            n = plan if isinstance(plan, int) else plan.get("num_splits") if isinstance(plan, dict) \
                else getattr(plan, "num_splits")
            return int(n)
        import inspect

        fn = interface.decode_num_splits
        known = {"batch": shape["batch"], "batch_size": shape["batch"], "heads": shape["heads"],
                 "num_heads": shape["heads"], "nheads": shape["heads"], "heads_kv": shape["heads_kv"],
                 "num_heads_kv": shape["heads_kv"], "nheads_kv": shape["heads_kv"], "seqlen_q": shape["seqlen_q"],
                 "seqlen_k": shape["seqlen_k"], "num_sms": num_sms, "head_dim": shape["head_dim"],
                 "page_size": shape["page_size"] or None}
        kwargs = {}
        for name, par in inspect.signature(fn).parameters.items():
            if name in known:
                kwargs[name] = known[name]
            elif par.default is inspect.Parameter.empty:
                return "?"
        return int(fn(**kwargs))
    except Exception:  # noqa: BLE001
        return "?"


def _decode_modules(no_peers: bool) -> dict:
    """The decode functions that import here; the reason printed for each that does not."""
    mods = {}
    try:
        import cute_attn

        mods["cute_attn"] = cute_attn.flash_attn_with_kvcache
    except Exception as e:  # noqa: BLE001
        print(f"# cute_attn.flash_attn_with_kvcache not available ({type(e).__name__}: {e}); skipped", file=sys.stderr)
    if no_peers:
        return mods
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        mods["sdpa"] = (scaled_dot_product_attention, sdpa_kernel,
                        {"SDPA flash": SDPBackend.FLASH_ATTENTION, "SDPA cuDNN": SDPBackend.CUDNN_ATTENTION})
    except Exception as e:  # noqa: BLE001
        print(f"# torch SDPA backends not available ({type(e).__name__}: {e}); skipped", file=sys.stderr)
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        mods["fa4"], mods["fa4_varlen"] = flash_attn_func, flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001
        print(f"# FlashAttention-4 (flash_attn.cute) not importable ({type(e).__name__}: {e}); skipped",
              file=sys.stderr)
    try:
        from flash_attn import flash_attn_with_kvcache

        mods["fa2"] = flash_attn_with_kvcache
    except Exception as e:  # noqa: BLE001
        print(f"# FlashAttention-2 (flash_attn.flash_attn_with_kvcache) not importable ({type(e).__name__}: {e}); "
              f"skipped", file=sys.stderr)
    return mods


def _decode_reference(q, k, v):
    """fp32 attention of q (b, sq, h, d) over dense k, v (b, sk, hkv, d), query head i on K/V head
    i // (h / hkv): the check that every timed path computes the same thing."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    qf = q.float().view(b, sq, hkv, h // hkv, d)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qf, k.float()) / math.sqrt(d)
    o = torch.einsum("bhgqk,bkhd->bqhgd", s.softmax(-1), v.float())
    return o.reshape(b, sq, h, d)


def _decode_impls(shape: dict, dtype, mods: dict, num_sms: int, where: str):
    """Fresh random inputs for one row and the implementations that run on them: {column: fn()}, the
    notes on how each peer was called, and cute_attn's split count. Each candidate is called once
    (compiles, warms up) and checked against the fp32 reference; a failing or wrong one is dropped
    with the reason printed, and a peer with several ways to call it keeps the first that works."""
    b, sq, sk, h, hkv, d, page = (shape[k] for k in ("batch", "seqlen_q", "seqlen_k", "heads", "heads_kv",
                                                       "head_dim", "page_size"))
    torch.manual_seed(0)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    seqlens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
    if page:
        n = decode_pages(sk, page)
        kc, vc = (torch.randn(b * n, page, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
        table = torch.randperm(b * n, device="cuda").view(b, n).to(torch.int32)  # a real gather
        kd, vd = (c[table.long()].flatten(1, 2)[:, :sk] for c in (kc, vc))
    else:
        kc, vc = (torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype) for _ in range(2))  # exactly Sk rows
        table, kd, vd = None, kc, vc
    ref = _decode_reference(q, kd, vd)
    del kd, vd
    first = lambda out: out[0] if isinstance(out, (tuple, list)) else out  # noqa: E731

    candidates = []  # (column, [(note or None, fn), ...]): the first variant that works is kept
    if "cute_attn" in mods:
        f = mods["cute_attn"]
        candidates.append(("cute_attn", [(None, lambda: first(f(
            q, kc, vc, cache_seqlens=seqlens, block_table=table)))]))
        candidates.append(("cute_attn (no split)", [(None, lambda: first(f(
            q, kc, vc, cache_seqlens=seqlens, block_table=table, num_splits=1)))]))
    if not page and "sdpa" in mods:
        sdpa, sdpa_kernel, backends = mods["sdpa"]
        qt, kt, vt = (t.transpose(1, 2) for t in (q, kc, vc))  # (b, heads, s, d) views
        repeated = {}  # K/V repeated to h heads, made once for both backends, only if needed

        def sdpa_run(backend, gqa=False, repeat=False):
            def run():
                k_, v_ = kt, vt
                if repeat:
                    if not repeated:
                        repeated["k"], repeated["v"] = (t.repeat_interleave(h // hkv, dim=1) for t in (kt, vt))
                    k_, v_ = repeated["k"], repeated["v"]
                with sdpa_kernel(backend):
                    return sdpa(qt, k_, v_, **({"enable_gqa": True} if gqa else {})).transpose(1, 2)

            return run

        for col, backend in backends.items():
            if h == hkv:
                candidates.append((col, [(None, sdpa_run(backend))]))
            else:
                candidates.append((col, [
                    ("enable_gqa=True", sdpa_run(backend, gqa=True)),
                    (f"no GQA: K/V repeated to {h} heads outside the timing, reads {h // hkv}x the counted K/V bytes",
                     sdpa_run(backend, repeat=True))]))
    if not page and "fa4" in mods:
        fa4 = mods["fa4"]
        candidates.append(("FA4", [
            ("flash_attn_func, num_splits=0 (its split heuristic)", lambda: first(fa4(q, kc, vc, num_splits=0))),
            ("flash_attn_func, its default num_splits (no split heuristic in this version)",
             lambda: first(fa4(q, kc, vc)))]))
    if page and "fa4_varlen" in mods:
        fa4v = mods["fa4_varlen"]
        candidates.append(("FA4 paged", [
            ("flash_attn_varlen_func(page_table, seqused_k), num_splits=0 (its split heuristic)",
             lambda: first(fa4v(q, kc, vc, seqused_k=seqlens, page_table=table, num_splits=0))),
            ("flash_attn_varlen_func(page_table, seqused_k), its default num_splits",
             lambda: first(fa4v(q, kc, vc, seqused_k=seqlens, page_table=table)))]))
    if "fa2" in mods:
        fa2 = mods["fa2"]
        candidates.append(("FA2 kvcache", [("flash_attn_with_kvcache, num_splits=0", lambda: first(fa2(
            q, kc, vc, cache_seqlens=seqlens, block_table=table, num_splits=0)))]))

    impls, notes, splits = {}, [], "-"
    scale = ref.abs().max().item()
    for col, variants in candidates:
        for note, fn in variants:
            try:
                with torch.no_grad():
                    out = fn()
                torch.cuda.synchronize()
                err = (out.float() - ref).abs().max().item()
                if not err <= 0.02 * scale + 1e-3:  # also catches NaN
                    print(f"# {col} ({note or 'default'}) WRONG at {where}: max error {err:.3g}, reference max "
                          f"{scale:.3g}; not timed", file=sys.stderr)
                    continue
            except Exception as e:  # noqa: BLE001
                print(f"# {col} ({note or 'default'}) failed at {where}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            impls[col] = lambda *_, fn=fn: fn()  # _time_interleaved passes (q, k, v, causal)
            if note:
                notes.append(f"{col}: {note}")
            if col == "cute_attn":
                splits = _decode_num_splits(shape, num_sms)
            break
    return impls, notes, splits


_FLUSH = []


# How _gpu_ms empties L2 before each timed call (--decode-flush): "clean" reads a 256 MB buffer
# (L2 then holds only clean lines, which the call's reads evict for free), "zero" writes it, as
# triton's do_bench does (L2 then holds ~50 MB of dirty lines, which every implementation's call
# writes back to HBM while it reads K/V: ~11 us of a 60 us decode call on the H100, measured).
FLUSH_MODES = ("clean", "zero")
_FLUSH_MODE = ["clean"]


def _flush_l2(buf: torch.Tensor) -> None:
    if _FLUSH_MODE[0] == "zero":
        buf.zero_()
    else:
        buf.sum()  # reads all of it; writes one scalar


def _gpu_ms(fn, rep_ms: float) -> float:
    """Median milliseconds of one call on the GPU, as ``do_bench`` (256 MB read or written before
    each call flushes L2, so K/V come from HBM: ``_flush_l2``) plus a ~0.5 ms sleep kernel queued
    before each timed call: a decode call takes microseconds of GPU time and up to ~0.15 ms of host
    time (FA4's Python), and without the sleep the host's time would show up between the start
    event and the kernel."""
    if not _FLUSH:
        _FLUSH.append(torch.zeros(256 * 2**20 // 4, dtype=torch.int32, device="cuda"))
    flush = _FLUSH[0]
    sleep = getattr(torch.cuda, "_sleep", lambda cycles: None)
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    n = int(min(max(rep_ms / max(start.elapsed_time(end) / 5, 1e-3), 20), 200))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        _flush_l2(flush)
        sleep(1_000_000)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _decode_timed(fn, q, k, v, causal, mode, rep_ms, sustained_s=0.0) -> float:
    """The decode mode's ``_timed``: GPU milliseconds per call (``_gpu_ms``), or with ``--sustained``
    the mean over seconds of back-to-back calls (no L2 flush there: a cache smaller than the 50 MB
    L2 is then read from L2, and a call shorter than its host time is host-bound)."""
    with torch.no_grad():
        call = lambda: fn(q, k, v, causal)  # noqa: E731
        return _sustained_ms(call, sustained_s) if sustained_s else _gpu_ms(call, rep_ms)


# --decode-read-floor: (CTAs per SM, int32 per load step, warps) of the plain read. Swept on the H100
# for a 134 MB read (B1 H32/32 Sk 8192's K/V) among 45 such configs: the fastest take 2-8 CTAs per SM
# with 1024-4096 int32 per step, 2.74-2.79 TB/s (docs/performance.md).
READ_FLOOR_CONFIGS = ((2, 4096, 8), (4, 2048, 4), (4, 4096, 8), (6, 2048, 8), (8, 1024, 4), (8, 2048, 4))
_READ_KERNEL = []


def _read_kernel():
    """A triton kernel that reads n int32 once (program p: a contiguous chunk of ``chunk``, a step of
    BLOCK at a time, through L2 only, masked at the chunk's end) and stores one sum per lane, so no
    load is dead."""
    if not _READ_KERNEL:
        import triton
        import triton.language as tl

        @triton.jit
        def read(x_ptr, out_ptr, n, chunk, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            start = pid.to(tl.int64) * chunk
            end = tl.minimum(start + chunk, n)
            acc = tl.zeros([BLOCK], dtype=tl.int32)
            for i in range(0, chunk, BLOCK):
                offs = start + i + tl.arange(0, BLOCK)
                acc += tl.load(x_ptr + offs, mask=offs < end, other=0, cache_modifier=".cg")
            tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)

        _READ_KERNEL.append(read)
    return _READ_KERNEL[0]


def read_floor(nbytes: int, rounds: int, sustained_s: float = 0.0) -> dict | None:
    """The fastest plain read of ``nbytes`` (one fresh buffer read once per call), timed like the
    decode rows: TB/s and the config (READ_FLOOR_CONFIGS, whole steps or not) of the best median
    over ``rounds``. What a decode call that must read those bytes can reach in this timing (its
    launch, ramp and drain included); None without triton."""
    try:
        kernel = _read_kernel()
    except ImportError as e:
        print(f"# plain read skipped (no triton: {e})", file=sys.stderr)
        return None
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = nbytes // 4
    x = torch.randint(0, 100, (n,), dtype=torch.int32, device="cuda")
    best = None
    for (per_sm, block, warps), whole_steps in itertools.product(READ_FLOOR_CONFIGS, (True, False)):
        ctas = per_sm * num_sms
        # whole steps per program (the last programs idle), or even shares of 128-byte lines (each
        # program's last step masked): which reads faster moved between runs by up to 5%
        chunk = -(-n // (ctas * block)) * block if whole_steps else -(-n // (32 * ctas)) * 32
        out = torch.empty(ctas * block, dtype=torch.int32, device="cuda")
        fn = lambda *_, out=out, ctas=ctas, chunk=chunk, block=block, warps=warps: kernel[(ctas,)](  # noqa: E731
            x, out, n, chunk, BLOCK=block, num_warps=warps)
        fn()
        torch.cuda.synchronize()
        if out.sum().item() != x.sum().item():  # every element read once
            raise RuntimeError(f"plain read config {(per_sm, block, warps)} read the wrong elements")
        ms = statistics.median(_decode_timed(fn, None, None, None, False, "fwd", 100, sustained_s)
                               for _ in range(max(rounds, 1)))
        if best is None or ms < best["ms"]:
            best = {"ms": ms, "tbs": n * 4 / ms / 1e9, "config": [per_sm, block, warps, whole_steps]}
    del x
    torch.cuda.empty_cache()
    return best


def _copy_rate(args) -> dict:
    """The reference ceiling: ``dst.copy_(src)`` of 1 GiB, bytes read + written per second, timed
    like the decode rows (median over ``--rounds``)."""
    src = torch.randn(COPY_ELEMENTS, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = statistics.median(_decode_timed(lambda *_: dst.copy_(src), None, None, None, False, "fwd", 100, args.sustained)
                           for _ in range(max(args.rounds, 1)))
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": moved, "ms": ms, "tbs": moved / ms / 1e9}


def _host_us(fn, calls: int) -> float:
    """Wall microseconds per call from Python over ``calls`` back-to-back calls, one sync at the end."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _decode_latency(args, dtype, mods, num_sms) -> dict:
    """Host overhead: wall time per call at DECODE_LATENCY_SHAPE, dense (and cute_attn with the first
    --paged page size), every implementation once per round in a shuffled order, median of rounds."""
    b, sq, sk, h, hkv = DECODE_LATENCY_SHAPE
    base = {"part": "latency", "batch": b, "seqlen_q": sq, "seqlen_k": sk, "heads": h, "heads_kv": hkv,
            "head_dim": args.decode_head_dim, "page_size": 0}
    where = _decode_label(base) + " (latency)"
    impls, notes, _ = _decode_impls(base, dtype, mods, num_sms, where)
    if args.paged and "cute_attn" in mods:
        paged = dict(base, page_size=args.paged[0])
        more, _, _ = _decode_impls(paged, dtype, {"cute_attn": mods["cute_attn"]}, num_sms, where)
        impls.update({f"{name} paged {args.paged[0]}": fn for name, fn in more.items()})
    times = {name: [] for name in impls}
    with torch.no_grad():
        for r in range(max(args.rounds, 1)):
            names = list(impls)
            if r:
                random.Random(r).shuffle(names)
            for name in names:
                if times[name] is None:
                    continue
                try:
                    times[name].append(_host_us(impls[name], args.decode_latency_calls))
                except Exception as e:  # noqa: BLE001
                    print(f"# {name} failed at {where}: {type(e).__name__}: {e}", file=sys.stderr)
                    times[name] = None
    us = {name: statistics.median(t) for name, t in times.items() if t}
    return {"shape": base, "calls": args.decode_latency_calls, "us": us, "round_us": times, "notes": notes}


def decode_latency_lines(latency: dict) -> list[str]:
    """The host-overhead table: microseconds per call and the ratio to SDPA flash (the bar: <= 1.10)."""
    ref = latency["us"].get("SDPA flash")
    lines = ["| implementation | wall time per call (us) | / SDPA flash |", "|---|---|---|"]
    for name, us in latency["us"].items():
        lines.append(f"| {name} | {us:.1f} | " + (f"{us / ref:.2f}x" if ref else "-") + " |")
    return lines


def decode_columns(rows: list[dict]) -> list[str]:
    """Implementation columns: cute_attn's two always, then the peers in a fixed order and any other,
    those with a timing in some row."""
    order = ["SDPA flash", "SDPA cuDNN", "FA4", "FA4 paged", "FA2 kvcache"]
    skip = {"part", "batch", "seqlen_q", "seqlen_k", "heads", "heads_kv", "head_dim", "page_size", "bytes",
            "num_splits", "notes", "round_ms", "cute_attn", "cute_attn (no split)", "read_floor"}
    seen = [c for r in rows for c in r if c not in skip and r[c]]
    return (["cute_attn", "cute_attn (no split)"] + [c for c in order if c in seen]
            + [c for c in dict.fromkeys(seen) if c not in order])


def decode_table_lines(rows: list[dict], cols: list[str], copy_tbs: float | None) -> list[str]:
    """Markdown: TB/s per implementation, the best peer (columns not named cute_attn*), cute_attn
    over it and over the device copy; where a row has it (--decode-read-floor), the plain read and
    cute_attn over it."""
    floor = any(r.get("read_floor") for r in rows)
    head = ("| B | Sq | Sk | heads q/kv | paged | splits | " + " | ".join(cols)
            + " | best peer | cute_attn / best peer | cute_attn / copy |"
            + (" plain read | cute_attn / plain read |" if floor else ""))
    lines = [head, "|" + "---|" * (len(cols) + 9 + 2 * floor)]
    for r in rows:
        best = _best_peer(r, cols)
        ours = r.get("cute_attn")
        cells = [f"{r[c]:.2f}" if r.get(c) else "-" for c in cols]
        read = r.get("read_floor")
        lines.append(
            f"| {r['batch']} | {r['seqlen_q']} | {r['seqlen_k']} | {r['heads']}/{r['heads_kv']} | "
            f"{r['page_size'] or '-'} | {r.get('num_splits', '?')} | " + " | ".join(cells)
            + (f" | {best[0]:.2f} ({best[1]})" if best else " | -")
            + (f" | {ours / best[0]:.2f}x" if best and ours else " | -")
            + (f" | {ours / copy_tbs:.0%}" if ours and copy_tbs else " | -") + " |"
            + ((f" {read['tbs']:.2f} | {ours / read['tbs']:.0%} |" if read and ours else " - | - |") if floor else ""))
    return lines


def decode_rows(args):
    """--decode / --decode-latency: the decode table, the Sk sweep, the host-overhead table."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    mods = _decode_modules(args.no_peers)
    copy = _copy_rate(args)
    print(f"# device copy (1 GiB dst.copy_(src), read + written): {copy['tbs']:.2f} TB/s", file=sys.stderr)
    shapes = []
    if args.decode:
        shapes = decode_shapes(DECODE_TABLE, args.decode_sk, args.decode_sweep_heads, args.paged, args.decode_head_dim,
                               include_table=not args.decode_sweep_only)
    rows = []
    for shape in shapes:
        where = _decode_label(shape)
        impls, notes, splits = _decode_impls(shape, dtype, mods, num_sms, where)
        nbytes = decode_bytes(shape, elem)
        times = _time_interleaved(impls, None, None, None, False, "fwd", args.rounds, where, args.sustained,
                                  timed=_decode_timed)
        row = {**shape, "bytes": nbytes, "num_splits": splits, "notes": notes}
        for name, t in times.items():
            row[name] = None if not t else nbytes / statistics.median(t) / 1e9
        row["round_ms"] = times
        if args.decode_read_floor:
            row["read_floor"] = read_floor(nbytes, args.rounds, args.sustained)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "round_ms"}), file=sys.stderr)
        del impls
        torch.cuda.empty_cache()
    latency = _decode_latency(args, dtype, mods, num_sms) if args.decode_latency else None
    _decode_report(rows, copy, latency, args)


def _decode_report(rows, copy, latency, args):
    gpu = torch.cuda.get_device_name()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    versions = {"torch": torch.__version__}
    for key, dist in (("cutlass_dsl", "nvidia-cutlass-dsl"), ("fa4", "flash-attn-4"), ("flash_attn", "flash-attn")):
        try:
            from importlib.metadata import version

            versions[key] = version(dist)
        except Exception:  # noqa: BLE001
            versions[key] = None
    timing = (f"--sustained {args.sustained:g} s of back-to-back calls, no L2 flush" if args.sustained
              else f"median of per-call CUDA-event timings, L2 flushed ({args.decode_flush}) and a sleep kernel "
                   "before each call")
    print(f"\n{gpu}, {stamp}, " + ", ".join(f"{k} {v}" for k, v in versions.items() if v)
          + f", {args.dtype}, d {args.decode_head_dim}; {timing}; median of {args.rounds} rounds (shuffled order)")
    print(f"device copy (1 GiB dst.copy_(src), bytes read + written / time): {copy['tbs']:.2f} TB/s")
    meta = {"gpu": gpu, "date": stamp, **versions, "dtype": args.dtype, "head_dim": args.decode_head_dim,
            "timing": timing, "rounds": args.rounds, "copy": copy}
    os.makedirs(args.out, exist_ok=True)
    for part, title, name in (("table", "decode table", "bench_decode.json"),
                              ("sweep", "Sk sweep", "bench_decode_sweep.json")):
        sel = [r for r in rows if r["part"] == part]
        if not sel:
            continue
        print(f"\n{title}: TB/s of q + out + the K/V rows attended (splits: cute_attn's num_splits, '?' if its "
              f"interface does not say)\n")
        print("\n".join(decode_table_lines(sel, decode_columns(sel), copy["tbs"])))
        notes = list(dict.fromkeys(n for r in sel for n in r["notes"]))
        if notes:
            print("\nhow the peers were called: " + "; ".join(notes))
        with open(os.path.join(args.out, name), "w") as f:
            json.dump({"meta": meta, "rows": sel}, f, indent=1)
    sweep = [r for r in rows if r["part"] == "sweep"]
    if sweep:
        try:
            _plot_decode(sweep, decode_columns(sweep), copy["tbs"], os.path.join(args.out, "bench_decode.png"),
                         f"{gpu} decode, B1 Sq1 H{sweep[0]['heads']}/{sweep[0]['heads_kv']} d{args.decode_head_dim} "
                         f"{args.dtype}")
        except Exception as e:  # noqa: BLE001
            print(f"# plot skipped: {e}", file=sys.stderr)
    if latency is not None:
        s = latency["shape"]
        print(f"\nhost overhead: wall time per call from Python, {latency['calls']} back-to-back calls and one sync, "
              f"B{s['batch']} Sq{s['seqlen_q']} Sk{s['seqlen_k']} H{s['heads']}/{s['heads_kv']} d{s['head_dim']} "
              f"(bar: cute_attn within 10% of SDPA flash)\n")
        print("\n".join(decode_latency_lines(latency)))
        with open(os.path.join(args.out, "bench_decode_latency.json"), "w") as f:
            json.dump({"meta": meta, **latency}, f, indent=1)


def _plot_decode(rows, cols, copy_tbs, path, title):
    """TB/s against Sk, one panel per cache layout (dense, each page size), the device copy dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pages = sorted({r["page_size"] for r in rows})
    fig, axes = plt.subplots(1, len(pages), figsize=(4.8 * len(pages), 3.8), squeeze=False, sharey=True)
    for ax, page in zip(axes[0], pages):
        sel = [r for r in rows if r["page_size"] == page]
        for col in cols:
            if any(r.get(col) for r in sel):
                ax.plot([r["seqlen_k"] for r in sel], [r.get(col) or float("nan") for r in sel], marker="o", label=col)
        ax.axhline(copy_tbs, color="gray", linestyle="--", label="device copy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"paged {page}" if page else "dense")
        ax.set_xlabel("seqlen_k")
        ax.set_ylabel("TB/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
