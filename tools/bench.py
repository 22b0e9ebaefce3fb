"""TFLOP/s of cute_attn and its peers, on the same inputs, in one run (needs a GPU).

    python tools/bench.py                       # the ANCHORS grid: bf16, 16k tokens, d 64/128, causal 0/1
    python tools/bench.py --modes fwd bwd fwdbwd   # forward, backward, forward+backward tables
    python tools/bench.py --seqlens 2048 8192 --head-dims 128 --causal 1
    python tools/bench.py --sweep m128n64w4s2 m128n128s2o0  # cute_attn with other traits too (SM80, SM90)
    python tools/bench.py --ceiling             # and a bf16 8192^3 matmul in every round, as a ceiling
    python tools/bench.py --sustained 2         # 2 s of back-to-back calls per timing (power-limited)
    python tools/bench.py --modes bwd --deterministic  # and cute_attn's backward with deterministic=True
    python tools/bench.py --window 1024 --seqlens 16384   # sliding window (1024, 0): vs dense causal, FA4
    python tools/bench.py --softcap 30                    # with softcap 30 vs without, FA4 with it
    python tools/bench.py --varlen                        # random lengths 128...4096 packed into 16k tokens

Peers: torch SDPA with the flash (FlashAttention-2) and cuDNN backends, and FlashAttention-4
(``flash_attn.cute``) when importable. Batch = tokens / seqlen, heads = 2048 / head_dim.
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
Prints a markdown table (TFLOP/s, and cute_attn over the best peer); writes JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def _peers():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def sdpa_with(backend):
        def run(q, k, v, causal):
            with sdpa_kernel(backend):
                return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)

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
    do_bench's short bursts may still run on clocks a cooler GPU allows."""
    import time

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


def _time_interleaved(impls: dict, q, k, v, causal: bool, mode: str, rounds: int, where: str,
                      sustained_s: float = 0.0) -> dict:
    """Milliseconds per implementation in each of ``rounds`` rounds, each round timing every
    implementation once, in an order shuffled anew each round: clock and power drift during a run
    then reach every column alike instead of favouring whichever ran first (the caller takes the
    median). None for one that failed; the ceiling matmul is always timed as a forward."""
    times = {name: [] for name in impls}
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
                times[name].append(_timed(fn, q, k, v, causal, "fwd" if name == CEILING else mode,
                                          max(100 / rounds, 20), sustained_s))
            except Exception as e:  # noqa: BLE001
                print(f"# {name} {mode} failed at {where}: {type(e).__name__}: {e}", file=sys.stderr)
                times[name] = None
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    p.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--modes", nargs="+", choices=["fwd", "bwd", "fwdbwd"], default=["fwd"])
    p.add_argument("--sweep", nargs="*", default=[], help="cute_attn with other forward traits too: SM80 m128n64w4s2, SM90 m128n128s2 (o0: no intra-warpgroup overlap, p0: no ping-pong)")
    p.add_argument("--bwd-sweep", nargs="*", default=[], help="extra cute_attn backward traits: SM80 m64n128w8a2b4c2, SM90 m64n128s2")
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
    p.add_argument("--out", default="bench_results", help="directory for JSON and PNG")
    args = p.parse_args(argv)
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
    for mode in args.modes:
        impls = {**ours, **peers} if mode == "fwd" else {"cute_attn": ours["cute_attn"], **ours_bwd, **peers}
        impls.update(extra)
        for d in args.head_dims:
            for causal in args.causal:
                for s in args.seqlens:
                    batch, heads = max(args.tokens // s, 1), 2048 // d
                    q, k, v = (torch.randn(batch, s, heads, d, device="cuda", dtype=dtype) for _ in range(3))
                    flops = 4 * batch * heads * s * s * d / (2 if causal else 1)
                    flops *= {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}[mode]
                    row = {"mode": mode, "head_dim": d, "causal": causal, "seqlen": s, "batch": batch, "heads": heads}
                    times = _time_interleaved(impls, q, k, v, bool(causal), mode, args.rounds,
                                              f"d={d} causal={causal} S={s}", args.sustained)
                    for name, t in times.items():
                        row[name] = None if not t else (CEILING_FLOPS if name == CEILING else flops) / statistics.median(t) / 1e9
                    row["round_ms"] = times  # every round's milliseconds, for the spread
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
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
    try:
        from flash_attn.cute import flash_attn_func as fa4, flash_attn_varlen_func as fa4_varlen
    except Exception as e:  # noqa: BLE001
        fa4 = fa4_varlen = None
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
                            lengths.append(min(rng.randint(128, 4096), args.tokens - sum(lengths)))
                        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
                        mx = max(lengths)
                        q, k, v = (torch.randn(sum(lengths), heads, d, device="cuda", dtype=dtype) for _ in range(3))
                        flops_pairs, feature = _visible_pairs(lengths, bool(causal)), "varlen 128-4096"
                        impls["cute_attn varlen"] = lambda q, k, v, c: cute_attn.flash_attn_varlen_func(
                            q, k, v, cu, cu, mx, mx, causal=c)
                        # equal lengths, the same tokens (a power of two near the mean length): the
                        # dense kernel this must keep up with, on views of the same packed tensors
                        mean = min(max(2 ** round(math.log2(args.tokens / len(lengths))), 128), args.tokens)
                        dense_pairs = _visible_pairs([mean] * (args.tokens // mean), bool(causal))
                        impls["cute_attn dense (equal lengths)"] = lambda q, k, v, c: cute_attn.flash_attn_func(
                            *(t.view(-1, mean, heads, d) for t in (q, k, v)), causal=c).view(q.shape)
                        if fa4_varlen is not None:
                            impls["FA4 varlen"] = lambda q, k, v, c: first(fa4_varlen(
                                q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=c))
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
              f"{args.tokens} tokens, {title} TFLOP/s\n")
        tail = " | cute_attn / ceiling |" if extra else " |"
        print("| d | causal | S | " + " | ".join(cols) + " | cute_attn / FA2 | cute_attn / best peer" + tail)
        print("|---|---|---|" + "---|" * (len(cols) + 2 + bool(extra)))
        for r in sel:
            best = max((r[p] for p in peers if r.get(p)), default=None)
            cells = [f"{r[c]:.0f}" if r.get(c) else "-" for c in cols]
            ceiling = f" {ratio(r, r.get(CEILING))} |" if extra else ""
            print(f"| {r['head_dim']} | {r['causal']} | {r['seqlen']} | " + " | ".join(cells)
                  + f" | {ratio(r, r.get(fa2))} | {ratio(r, best)} |" + ceiling)
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


if __name__ == "__main__":
    main()
