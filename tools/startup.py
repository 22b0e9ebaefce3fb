"""First-call latency and per-call host overhead of cute_attn beside SDPA flash, SDPA cuDNN and FA4 (needs a GPU).

    python tools/startup.py                      # d128 bf16 forward, B1 S128 H16 (host overhead) and B2 S2048 H16
    python tools/startup.py --cache-dir DIR      # cute_attn's warm run reads this disk cache

Every first call runs in a fresh Python process (``python -c``), timed inside it: ``import`` of the
library, then the first call (CUDA context and torch's own kernels already warmed by one torch op,
as in a real program), synchronised. Three cute_attn rows: a cold one (an empty cache directory:
compiles), a warm one (``--cache-dir`` filled, e.g. by a cold run: loads), and a second call in
the warm process. The fwd+bwd rows time the first forward and backward (``torch.autograd.grad``)
as a training step's first call. Host overhead: wall time per call over 2000 back-to-back calls of a tiny shape
(B1 S128 H16 d128), where the GPU work is a few microseconds and the host's share shows.
Prints a markdown table. ``--repeat N`` runs every row N times (a fresh process and, for the cold
rows, a fresh empty cache each time, interleaved with the other rows) and reports the median, the
first call's range beside it; ``--only`` keeps some implementations (``sdpa cudnn fa4 cute_attn``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch
torch.ones(1, device="cuda").add_(1); torch.cuda.synchronize()  # the CUDA context, as any program has it
t_torch = time.perf_counter()
which, seqlen, train = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
q, k, v = (torch.randn(1 if seqlen <= 128 else 2, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16,
                       requires_grad=train) for _ in range(3))
dout = torch.randn_like(q)
torch.cuda.synchronize()
t1 = time.perf_counter()
if which == "cute_attn":
    import cute_attn
    fn = (lambda: cute_attn.flash_attn_func(q, k, v, causal=True)) if train else \
        (lambda: cute_attn.forward(q, k, v, causal=True))
elif which in ("sdpa", "cudnn"):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    backend = SDPBackend.FLASH_ATTENTION if which == "sdpa" else SDPBackend.CUDNN_ATTENTION
    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
else:
    from flash_attn.cute import flash_attn_func
    fn = lambda: flash_attn_func(q, k, v, causal=True)
if train:  # forward and backward (transposed back for SDPA; FA4 returns (out, lse))
    step = fn
    def fn():
        out = step()
        out = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(out, (q, k, v), dout.transpose(1, 2) if out.shape != dout.shape else dout)
t2 = time.perf_counter()
fn(); torch.cuda.synchronize()
t3 = time.perf_counter()
fn(); torch.cuda.synchronize()
t4 = time.perf_counter()
for _ in range(20):
    fn()
torch.cuda.synchronize()
t5 = time.perf_counter()
for _ in range(2000):
    fn()
torch.cuda.synchronize()
t6 = time.perf_counter()
print(json.dumps(dict(import_s=t2 - t1, first_s=t3 - t2, second_s=t4 - t3, per_call_us=(t6 - t5) / 2000 * 1e6)))
if which == "cute_attn":  # the background builds finish before the next row's process starts
    from cute_attn import compile as cc
    cc.wait_for_background_builds(900)
"""


def run(which: str, seqlen: int, env: dict, train: bool = False) -> dict | None:
    proc = subprocess.run([sys.executable, "-c", _CHILD, which, str(seqlen), "1" if train else "0"], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        print(f"# {which} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}",
              file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median_row(results: list) -> dict | None:
    """The per-field median of several runs of one row (None where every run failed), with the
    first call's range."""
    results = [r for r in results if r is not None]
    if not results:
        return None
    row = {f: statistics.median(r[f] for r in results) for f in results[0]}
    row["first_range"] = (min(r["first_s"] for r in results), max(r["first_s"] for r in results))
    row["runs"] = len(results)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", default=None, help="cute_attn's warm disk cache (default: a fresh one, filled by the cold run)")
    p.add_argument("--seqlens", type=int, nargs="+", default=[128, 2048])
    p.add_argument("--train-seqlens", type=int, nargs="*", default=[2048],
                   help="forward+backward rows (flash_attn_func / autograd) at these lengths")
    p.add_argument("--repeat", type=int, default=1, help="fresh processes per row (median reported)")
    p.add_argument("--only", nargs="+", choices=["sdpa", "cudnn", "fa4", "cute_attn"],
                   default=["sdpa", "cudnn", "fa4", "cute_attn"], help="implementations to time")
    args = p.parse_args(argv)
    import torch

    base = dict(os.environ)
    names = {"sdpa": "SDPA flash", "cudnn": "SDPA cuDNN", "fa4": "FA4 (CuTe DSL)"}
    rows: dict = {}  # (name, seqlen) -> results of every repeat, in the order first run

    def add(name, seqlen, result):
        rows.setdefault((name, seqlen), []).append(result)

    for _ in range(args.repeat):
        for s, train in [(s, False) for s in args.seqlens] + [(s, True) for s in args.train_seqlens]:
            suffix = ", fwd+bwd" if train else ""
            with tempfile.TemporaryDirectory(prefix="cute_attn_cold_") as cold:
                warm = args.cache_dir or cold
                for which in ("sdpa", "cudnn", "fa4"):
                    if which in args.only:
                        add(names[which] + suffix, s, run(which, s, base, train))
                if "cute_attn" in args.only:
                    if not args.cache_dir:
                        cold_name = "cute_attn cold, fwd+bwd" if train else "cute_attn cold (empty disk cache)"
                        add(cold_name, s, run("cute_attn", s, {**base, "CUTE_ATTN_CACHE_DIR": cold}, train))
                    warm_name = "cute_attn warm, fwd+bwd" if train else "cute_attn warm (disk cache filled)"
                    add(warm_name, s, run("cute_attn", s, {**base, "CUTE_ATTN_CACHE_DIR": warm}, train))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 d128 heads 16 causal forward "
          f"(fwd+bwd rows: forward and backward), fresh process per row"
          f"{f', median of {args.repeat} runs per row' if args.repeat > 1 else ''}\n")
    ranged = args.repeat > 1
    print("| implementation | B x S | import (s) | first call (s) | " + ("first call, range (s) | " if ranged else "")
          + "second call (ms) | per call, 2000 calls (us) |")
    print("|---|---|---|---|---|---|" + ("---|" if ranged else ""))
    for (name, s), results in rows.items():
        r = _median_row(results)
        shape = f"{1 if s <= 128 else 2} x {s}"
        if r is None:
            print(f"| {name} | {shape} | - | - | " + ("- | " if ranged else "") + "- | - |")
            continue
        spread = f"{r['first_range'][0]:.2f}-{r['first_range'][1]:.2f} | " if ranged else ""
        print(f"| {name} | {shape} | {r['import_s']:.2f} | {r['first_s']:.2f} | {spread}"
              f"{r['second_s'] * 1e3:.2f} | {r['per_call_us']:.1f} |")


if __name__ == "__main__":
    main()
