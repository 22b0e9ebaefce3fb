"""A few small backward cases for head dims 192 and 256, small enough for compute-sanitizer.

    python tools/check_bwd_large.py                      # errors against the float64 reference
    compute-sanitizer --tool memcheck python tools/check_bwd_large.py --quick
    compute-sanitizer --tool racecheck python tools/check_bwd_large.py --quick
    compute-sanitizer --tool synccheck python tools/check_bwd_large.py --quick

On compute capability 9.0 the dispatcher runs kernels/sm90/backward_large.py for these head dims
(``--arch sm80`` runs the SM80 kernel instead, for comparison). Each case prints the largest
error of dq, dk, dv against ``reference.attention_backward_reference`` and the largest magnitude
there; exit status 1 when an error exceeds ``--tol`` times that magnitude (or is not finite).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# (head_dim, seqlen_q, seqlen_k, heads, heads_kv, causal, deterministic, options): odd lengths,
# seqlen_q != seqlen_k both ways, GQA and MQA, a padded head dim, and the optional features
CASES = [
    (256, 113, 203, 4, 4, False, False, {}),
    (256, 203, 113, 4, 2, True, False, {}),
    (192, 129, 255, 6, 2, True, False, {}),
    (192, 255, 129, 4, 1, False, True, {}),
    (256, 300, 300, 2, 1, True, True, {}),
    (160, 97, 161, 4, 2, True, False, {}),
    (256, 150, 170, 4, 2, False, False, dict(window_size=(40, 7), softcap=20.0, alibi=True)),
    (192, 170, 150, 4, 4, True, False, dict(window_size=(33, 0), softcap=15.0)),
]
QUICK = [0, 2, 4, 6]


def run_case(torch, cute_attn, reference, case, dtype) -> tuple[str, float]:
    d, sq, sk, h, hkv, causal, det, options = case
    options = dict(options)
    g = torch.Generator(device="cuda").manual_seed(sq * 1000 + sk)
    q = torch.randn(2, sq, h, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(2, sk, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(2, sk, hkv, d, device="cuda", dtype=dtype, generator=g)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(2, h, device="cuda", dtype=torch.float32, generator=g)
    out, lse = cute_attn.forward(q, k, v, causal=causal, return_lse=True, **options)
    dout = torch.randn(out.shape, device="cuda", dtype=dtype, generator=g)
    grads = cute_attn.backward(dout, q, k, v, out, lse, causal=causal, deterministic=det, **options)
    torch.cuda.synchronize()
    ref = reference.attention_backward_reference(q, k, v, dout, causal, **options)
    worst = 0.0
    parts = []
    for name, got, r in zip(("dq", "dk", "dv"), grads, ref):
        err = (got.double() - r).abs().max().item()
        scale = max(r.abs().max().item(), 1e-6)
        rel = err / scale if err == err else float("inf")
        worst = max(worst, rel)
        parts.append(f"{name} {err:.2e}/{scale:.2e}")
    label = (f"d={d} sq={sq} sk={sk} h={h}/{hkv} causal={causal} det={det} "
             f"{','.join(sorted(options)) or '-'}")
    return f"{label:70s} " + "  ".join(parts), worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="four cases, bf16 only (for the sanitizer's tools)")
    p.add_argument("--arch", choices=["sm80", "sm90"], default=None, help="force a kernel family")
    p.add_argument("--tol", type=float, default=2e-2, help="largest error / largest reference magnitude")
    args = p.parse_args(argv)

    import torch

    import cute_attn
    from cute_attn import reference

    cases = [CASES[i] for i in QUICK] if args.quick else CASES
    dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float16]
    failed = 0
    with cute_attn.force_arch(args.arch):
        for dtype in dtypes:
            for case in cases:
                line, worst = run_case(torch, cute_attn, reference, case, dtype)
                bad = not worst <= args.tol
                failed += bad
                print(f"{'FAIL' if bad else 'ok  '} {str(dtype)[6:]:8s} {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
