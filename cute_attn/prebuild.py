"""Fill the disk cache ahead of time, without a GPU: ``python -m cute_attn.prebuild``.

    python -m cute_attn.prebuild --arch sm_90a --head-dim 64 128 --dtype bf16   # what an H100 job uses
    python -m cute_attn.prebuild --arch sm_80 sm_90a --jobs 8 --cache-dir /opt/cute_attn_cache

Compiles, for each target, the kernels a GPU of that target runs (sm_90a: the SM90 family with its
SM80 fallbacks; others: SM80), forward and backward, every SM90 length tier and each forward's
split-KV kernel (what the runtime builds together: compile.forward_tier_siblings), into the cache
directory (default: ``compile.default_cache_dir()``; point ``CUTE_ATTN_CACHE_DIR`` at the same
directory where it runs). Kernels already in the cache are loaded, not rebuilt, so a rerun is quick.
Head dims are the ones the model uses (72 and 96 are different kernels: padded vs not).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
import time


def prebuild_keys(targets, head_dims, dtypes, causal=(False, True), deterministic=(False,),
                  directions=("fwd", "bwd"), features=None) -> list:
    """The kernel keys a GPU of each target would compile at run time for these parameters
    (``features``: kernels/features.py sets; default none)."""
    from cute_attn.compile import backward_variants, forward_tier_siblings, forward_variants
    from cute_attn.kernels.features import NO_FEATURES

    features = tuple(features or (NO_FEATURES,))

    keys: dict = {}
    for target in targets:
        kernels = ["sm90" if target == "sm_90a" else "sm80"]
        if "fwd" in directions:
            # with what the runtime builds beside each (its split-KV kernel, the other tiers)
            keys.update(dict.fromkeys(sibling for key in forward_variants([target], head_dims, dtypes, causal,
                                                                           kernels=kernels, features=features)
                                      for sibling in forward_tier_siblings(key)))
        if "bwd" in directions:
            keys.update(dict.fromkeys(backward_variants([target], head_dims, dtypes, causal, deterministic,
                                                        kernels=kernels, features=features)))
    return list(keys)


def _fill_one(key, cache_dir: str) -> tuple[str, float, bool]:
    """Compile (or find) one kernel in ``cache_dir``: (name, seconds, whether it was compiled)."""
    from cute_attn.compile import KernelCache, build

    t0 = time.time()
    cache = KernelCache(build, cache_dir)
    cache.get(key)
    return key.name, time.time() - t0, cache.builds > 0


def prebuild(keys, cache_dir: str, jobs: int = 1, progress=sys.stderr) -> list[tuple[str, float, bool]]:
    """Fill ``cache_dir`` with ``keys`` in ``jobs`` processes, showing a progress bar on ``progress``."""
    results, t0 = [], time.time()
    if jobs > 1:
        import multiprocessing as mp

        with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(_fill_one, key, cache_dir) for key in keys]
            for fut in cf.as_completed(futures):
                results.append(fut.result())
                show_progress(len(results), len(keys), *results[-1][:2], t0, progress)
    else:
        for key in keys:
            results.append(_fill_one(key, cache_dir))
            show_progress(len(results), len(keys), *results[-1][:2], t0, progress)
    if progress is not None:
        progress.write("\n")
    return results


def show_progress(done: int, total: int, name: str, seconds: float, t0: float, out=sys.stderr) -> None:
    if out is None:
        return
    width = 30
    bar = "#" * (width * done // total) + "." * (width - width * done // total)
    out.write(f"\r[{bar}] {done}/{total} {time.time() - t0:6.1f}s  {name} ({seconds:.1f}s)\x1b[K")
    out.flush()


def main(argv=None) -> int:
    from cute_attn.compile import DTYPES, TARGETS, default_cache_dir
    from cute_attn.traits import HEAD_DIMS

    p = argparse.ArgumentParser(prog="python -m cute_attn.prebuild", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", nargs="+", default=list(TARGETS), help="GPU targets, e.g. sm_80 sm_86 sm_90a")
    p.add_argument("--head-dim", type=int, nargs="+", default=list(HEAD_DIMS))
    p.add_argument("--dtype", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--causal", choices=["0", "1", "both"], default="both")
    p.add_argument("--direction", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    p.add_argument("--deterministic", choices=["0", "1", "both"], default="0", help="backward dQ ordering")
    p.add_argument("--features", nargs="+", default=["none"],
                   help="feature sets, each 'none' or names joined by commas: local,softcap,alibi,varlen")
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    p.add_argument("--cache-dir", default=None, help="default: $CUTE_ATTN_CACHE_DIR or ~/.cache/cute_attn")
    args = p.parse_args(argv)
    cache_dir = args.cache_dir or default_cache_dir()
    if not cache_dir:
        p.error("no cache directory: CUTE_ATTN_CACHE_DIR is set empty; pass --cache-dir")
    for d in args.head_dim:
        if d % 8 or not 8 <= d <= 256:
            p.error(f"--head-dim must be multiples of 8 in [8, 256], got {d}")
    causal = {"0": [False], "1": [True], "both": [False, True]}[args.causal]
    det = {"0": [False], "1": [True], "both": [False, True]}[args.deterministic]
    from cute_attn.kernels.features import parse_features

    try:
        features = [parse_features(f) for f in args.features]
    except ValueError as e:
        p.error(str(e))
    keys = prebuild_keys(args.arch, args.head_dim, args.dtype, causal, det, args.direction, features)
    results = prebuild(keys, cache_dir, args.jobs)
    built = sum(1 for *_, b in results if b)
    print(f"{len(results)} kernels in {cache_dir}: {built} compiled, {len(results) - built} already there")
    return 0


if __name__ == "__main__":
    sys.exit(main())
