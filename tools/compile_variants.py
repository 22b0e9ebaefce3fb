"""Compile cute_attn kernel variants ahead of time, with or without a GPU.

    python tools/compile_variants.py --arch sm_80 sm_90a --head-dim 64 128 --dtype bf16 fp16 \\
        --causal both --out DIR [--kernel sm80 sm90] [--direction fwd bwd] [--deterministic both] [--jobs 4]
        [--cache-dir CACHE] [--features none local softcap,alibi varlen]

Writes one .ptx and one .cubin per variant into DIR (when given), shows a progress bar, and ends
with a table per variant: registers, stack frame, spills, static shared memory and the counts of
mma/ldmatrix/cp.async instructions (and for the SM90 forward wgmma, TMA, mbarrier, setmaxnreg). ``--cache-dir`` also exports each compiled kernel into a
cute_attn disk cache (point CUTE_ATTN_CACHE_DIR at it to skip compiling at run time).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _compile_one(key, out_dir, cache_dir):
    from cute_attn import artifacts
    from cute_attn.compile import KernelCache, build

    t0 = time.time()
    fn = build(key, keep_artifacts=True)
    seconds = time.time() - t0
    ptx, cubin = fn.__ptx__, fn.__cubin__
    if out_dir:
        with open(os.path.join(out_dir, key.name + ".ptx"), "w") as f:
            f.write(ptx)
        with open(os.path.join(out_dir, key.name + ".cubin"), "wb") as f:
            f.write(cubin)
    if cache_dir:
        KernelCache(build, cache_dir)._store(key, fn)
    name = key.name
    chosen = getattr(fn, "traits", None)
    if chosen is not None and len(getattr(key, "candidates", ())) > 1:
        name = f"{key.name} -> {chosen.spec}"
    rep = artifacts.report(name, ptx, cubin)
    return rep, seconds


def main(argv=None):
    from cute_attn.compile import DTYPES, TARGETS, backward_variants, forward_key, forward_variants
    from cute_attn.prebuild import show_progress
    from cute_attn.traits import HEAD_DIMS, parse_traits

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", nargs="+", default=list(TARGETS), help="code targets, e.g. sm_80 sm_86 sm_90a")
    p.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS))
    p.add_argument("--dtype", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--causal", choices=["0", "1", "both"], default="both")
    p.add_argument("--out", help="directory for .ptx/.cubin files")
    p.add_argument("--cache-dir", help="also export the kernels into this cute_attn disk cache")
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    p.add_argument("--direction", nargs="+", choices=["fwd", "bwd"], default=["fwd"],
                   help="forward kernels, backward kernels (preprocess, main, postprocess), or both")
    p.add_argument("--deterministic", choices=["0", "1", "both"], default="0", help="backward dQ ordering")
    p.add_argument("--bwd-traits", nargs="*", default=[], help="backward traits instead of the table, e.g. m64n128w8a2b4c2")
    p.add_argument("--kernel", nargs="+", choices=["sm80", "sm90"], default=["sm80", "sm90"],
                   help="kernel families (sm90 compiles only for sm_90a)")
    p.add_argument("--features", nargs="+", default=["none"],
                   help="feature sets, each 'none' or names joined by commas: local,softcap,alibi,varlen")
    p.add_argument("--traits", nargs="*", default=[],
                   help="instead of the traits table, these forward traits: SM80 m128n64w4s2, SM90 m128n128s2")
    args = p.parse_args(argv)

    causal = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    from cute_attn.kernels.features import parse_features

    features = [parse_features(f) for f in args.features]
    keys = []
    if "fwd" in args.direction and args.traits:
        keys += [
            forward_key(t, dt, d, c, traits=parse_traits(spec, d))
            for spec in args.traits for t in args.arch for d in args.head_dim for dt in args.dtype for c in causal
        ]
    elif "fwd" in args.direction:
        keys += forward_variants(args.arch, args.head_dim, args.dtype, causal, kernels=args.kernel, features=features)
    if "bwd" in args.direction:
        det = {"0": [False], "1": [True], "both": [False, True]}[args.deterministic]
        for spec in args.bwd_traits or [None]:
            keys += backward_variants(args.arch, args.head_dim, args.dtype, causal, det, spec=spec, kernels=args.kernel,
                                      features=features)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    reports = []
    t0 = time.time()
    if args.jobs > 1:
        import multiprocessing as mp

        with cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(_compile_one, k, args.out, args.cache_dir) for k in keys]
            for i, fut in enumerate(cf.as_completed(futures), 1):
                rep, seconds = fut.result()
                reports.append(rep)
                show_progress(i, len(keys), rep.name, seconds, t0)
    else:
        for i, key in enumerate(keys, 1):
            rep, seconds = _compile_one(key, args.out, args.cache_dir)
            reports.append(rep)
            show_progress(i, len(keys), rep.name, seconds, t0)
    sys.stderr.write("\n")
    from cute_attn.artifacts import format_table

    reports.sort(key=lambda r: r.name)
    print(format_table(reports))


if __name__ == "__main__":
    main()
