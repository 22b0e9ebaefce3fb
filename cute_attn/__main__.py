"""``python -m cute_attn``: the main job.

With a CUDA GPU: run a forward, check it against the fp32 reference and print its speed beside
torch SDPA. Without one: compile the forward kernels for sm_80 and sm_90a (no GPU needed) and
print the variant table (registers, local memory, instruction counts).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _gpu_demo(args) -> int:
    import torch
    import torch.nn.functional as F

    import cute_attn

    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    b, s, h, d = args.batch, args.seqlen, args.heads, args.head_dim
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(3))
    print(f"{torch.cuda.get_device_name()}: batch {b}, seqlen {s}, heads {h}, head_dim {d}, {args.dtype}")
    ok = True
    for causal in (False, True):
        t0 = time.time()
        out, lse = cute_attn.forward(q, k, v, causal=causal, return_lse=True)
        torch.cuda.synchronize()
        first = time.time() - t0
        ref, _ = cute_attn.attention_reference(q, k, v, causal)
        same, _ = cute_attn.attention_reference(q, k, v, causal, compute_dtype=dtype)
        err = (out.float() - ref.float()).abs().max().item()
        base = (same.float() - ref.float()).abs().max().item()
        passed = err <= 2 * base + 1e-5 and not torch.isnan(out).any().item()
        ok &= passed
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        ours = _median_ms(lambda: cute_attn.forward(q, k, v, causal=causal))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        sdpa = _median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal))
        print(f"causal={causal!s:5}  max err {err:.2e} (same-dtype torch: {base:.2e}) {'OK' if passed else 'FAIL'}"
              f"  first call {first:.2f}s  cute_attn {flops / ours / 1e9:.0f} TFLOP/s"
              f"  torch SDPA {flops / sdpa / 1e9:.0f} TFLOP/s")
    return 0 if ok else 1


def _median_ms(fn, iters: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _compile_demo(args) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "tools"))
    from cute_attn.artifacts import format_table, report
    from cute_attn.compile import build_forward, forward_variants

    keys = forward_variants(("sm_80", "sm_90a"), (64, 128), ("bf16",), (False, True))
    print(f"no CUDA GPU: compiling {len(keys)} forward variants for sm_80 and sm_90a (CUTE_DSL, no GPU needed)")
    reports = []
    for i, key in enumerate(keys, 1):
        t0 = time.time()
        fn = build_forward(key, keep_artifacts=True)
        reports.append(report(key.name, fn.__ptx__, fn.__cubin__))
        print(f"  [{i}/{len(keys)}] {key.name} ({time.time() - t0:.1f}s)", flush=True)
    print(format_table(reports))
    print("tools/compile_variants.py compiles any other variant; tools/inspect_ptx.py reads PTX files.")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cute_attn", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--compile-only", action="store_true", help="compile and list kernels even with a GPU")
    args = p.parse_args(argv)
    import torch

    if torch.cuda.is_available() and not args.compile_only:
        return _gpu_demo(args)
    return _compile_demo(args)


if __name__ == "__main__":
    sys.exit(main())
