"""The compiled-kernel caches without a GPU: the disk cache's location, round trip, corrupt
entries, several processes filling it at once, and the SM90 length tiers built together (CPU)."""

import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from cute_attn import compile as compile_mod
from cute_attn.compile import KernelCache, build, default_cache_dir, forward_key, forward_tier_siblings
from cute_attn.kernels.features import NO_FEATURES, Features
from cute_attn.traits import SM90_FORWARD, parse_traits

SMALL = forward_key("sm_80", "bf16", 32, False)  # the quickest kernel to compile


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_ATTN_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == str(tmp_path / "mine")
    monkeypatch.setenv("CUTE_ATTN_CACHE_DIR", "")  # empty: no disk cache
    assert default_cache_dir() is None
    monkeypatch.delenv("CUTE_ATTN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == str(tmp_path / "xdg" / "cute_attn")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "cute_attn")


HAS_CC = bool(shutil.which("cc") or shutil.which("gcc"))


def _fresh_process_get(cache_dir) -> list[str]:
    """[builds, loads, the function's type, whether the DSL was imported] of one get in a new
    process (a shared library, once loaded, stays mapped in its process whatever happens to the file)."""
    script = textwrap.dedent(f"""
        import sys
        from cute_attn.compile import KernelCache, build, forward_key
        cache = KernelCache(build, {str(cache_dir)!r})
        fn = cache.get(forward_key("sm_80", "bf16", 32, False))
        print(cache.builds, cache.loads, type(fn).__name__, any(m.split(".")[0] == "cutlass" for m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def _replace_bytes(path, data: bytes) -> None:
    """Rewrite a cache file as the cache itself does (a new file renamed over it)."""
    tmp = path.with_suffix(".test.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def test_disk_round_trip_and_corrupt_entry(tmp_path):
    first = KernelCache(build, str(tmp_path))
    first.get(SMALL)
    assert (first.builds, first.loads) == (1, 0)
    (obj,) = tmp_path.glob("*.o")
    shared = obj.with_suffix(".so")
    assert shared.exists() == HAS_CC, "the entry's shared library (linked wherever a C compiler is found)"
    second = KernelCache(build, str(tmp_path))
    assert second.get(SMALL) is not None and (second.builds, second.loads) == (0, 1)
    assert second.chosen(SMALL) == first.chosen(SMALL)
    # a truncated shared library falls back to the object file (which imports the DSL); a truncated
    # object file too is a miss: rebuilt and replaced, never an error
    if HAS_CC:
        _replace_bytes(shared, shared.read_bytes()[:100])
        assert _fresh_process_get(tmp_path)[:2] == ["0", "1"]
        shared.unlink()
    _replace_bytes(obj, obj.read_bytes()[:100])
    assert _fresh_process_get(tmp_path)[:2] == ["1", "0"]
    assert _fresh_process_get(tmp_path)[:2] == ["0", "1"]
    assert not list(tmp_path.glob("*.tmp")), "temporary files left behind"


@pytest.mark.skipif(not HAS_CC, reason="no C compiler: entries keep only their object files")
def test_a_cache_hit_imports_no_dsl(tmp_path):
    """A process whose kernels come from the disk cache loads them through TVM-FFI alone: the
    DSL's import stays out of its first call."""
    KernelCache(build, str(tmp_path)).get(SMALL)
    assert _fresh_process_get(tmp_path) == ["0", "1", "Function", "False"]


def _spy_on_dsl_compile(monkeypatch) -> list[dict]:
    """The keyword arguments of every cute.compile from here on."""
    import cutlass.cute as cute

    calls, compile_ = [], cute.compile

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return compile_(*args, **kwargs)

    monkeypatch.setattr(cute, "compile", spy)
    return calls


def test_a_cold_build_is_exported_and_loaded_back(tmp_path, monkeypatch):
    """With a disk directory a kernel is compiled for export only (no in-process JIT engine for its
    host code) and what the caller gets is its cache entry, loaded as a warm process loads it."""
    calls = _spy_on_dsl_compile(monkeypatch)
    cache = KernelCache(build, str(tmp_path))
    fn = cache.get(SMALL)
    assert (cache.builds, cache.loads) == (1, 0) and [c.get("no_jit_engine") for c in calls] == [True]
    if HAS_CC:
        assert type(fn).__name__ == "Function", "the entry's shared library, through TVM-FFI"
    # no disk directory: compiled with the engine, and that compiled function is what get returns
    calls.clear()
    memory = KernelCache(build, None)
    assert memory.get(SMALL) is not None and [c.get("no_jit_engine") for c in calls] == [None]


def test_an_entry_that_cannot_be_written_compiles_with_the_engine(tmp_path, monkeypatch):
    calls = _spy_on_dsl_compile(monkeypatch)
    monkeypatch.setattr(KernelCache, "_store", lambda self, key, fn: False)
    cache = KernelCache(build, str(tmp_path))
    assert cache.get(SMALL) is not None
    assert [c.get("no_jit_engine") for c in calls] == [True, None] and cache.builds == 2


def test_processes_filling_one_cache_compile_once(tmp_path):
    script = textwrap.dedent(f"""
        from cute_attn.compile import KernelCache, build, forward_key
        cache = KernelCache(build, {str(tmp_path)!r})
        cache.get(forward_key("sm_80", "bf16", 32, False))
        print(cache.builds, cache.loads)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    results = [tuple(map(int, p.communicate(timeout=600)[0].split())) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(results) == [(0, 1), (1, 0)], results


class CountingBuild:
    def __init__(self):
        self.keys = []

    def __call__(self, key):
        self.keys.append(key)
        return object()


@pytest.mark.parametrize("head_dim,causal", [(64, True), (128, False), (128, True)])
def test_sm90_length_tiers_build_together(head_dim, causal):
    counting = CountingBuild()
    cache = KernelCache(counting, None, group=forward_tier_siblings)
    tiers = len(SM90_FORWARD[head_dim][causal])
    assert tiers > 1
    cache.get(forward_key("sm_90a", "bf16", head_dim, causal, kernel="sm90", seqlen=300))
    assert len(counting.keys) == tiers + 1  # every tier, and the split-KV kernel, on the first use
    split = compile_mod.forward_split_key("sm_90a", "bf16", head_dim, causal, NO_FEATURES)
    assert counting.keys[-1] == split
    for seqlen in (1, 1000, 1025, 2048, 4097, 8192, 8193, 100000):
        cache.get(forward_key("sm_90a", "bf16", head_dim, causal, kernel="sm90", seqlen=seqlen))
    cache.get(split)
    assert len(counting.keys) == tiers + 1  # no length compiles again
    assert len(set(counting.keys)) == tiers + 1


@pytest.mark.parametrize("head_dim", [128, 120])
def test_sm90_backward_length_tiers_build_together(head_dim):
    """d128 plain causal runs 80-row Q blocks from SM90_BACKWARD_LONG_SEQLEN query rows: the first
    use of either tier builds both main kernels and their postprocesses, so no length compiles
    again; other configurations have one tier."""
    from cute_attn.compile import backward_keys, backward_long_key, backward_post_key, backward_tier_siblings
    from cute_attn.traits import SM90_BACKWARD, SM90_BACKWARD_LONG, parse_backward_traits

    pre, main = backward_keys("sm_90a", "bf16", head_dim, True, False, kernel="sm90")
    long = backward_long_key(main)
    assert long.candidates[0] == SM90_BACKWARD_LONG[128] and long.candidates[0].tile_m == 80
    assert long.candidates[1:] == (SM90_BACKWARD[128][True],)  # where 80 rows would spill
    posts = {backward_post_key(main, main.candidates[0]), backward_post_key(long, long.candidates[0])}
    for first in (main, long):
        counting = CountingBuild()
        cache = KernelCache(counting, None, group=backward_tier_siblings)
        cache.get(first)
        cache.get(backward_post_key(main, main.candidates[0]))  # what a launch asks for beside it
        cache.get(backward_post_key(long, long.candidates[0]))
        cache.get(main), cache.get(long)
        assert set(counting.keys) == {main, long, *posts} and len(counting.keys) == 4
    assert compile_mod.backward_cache._group is backward_tier_siblings
    # one tier: deterministic, a feature, another head dim, other explicit traits, SM80
    # (non-causal d128: the Stream-K tier, test_sm90_backward_stream_k_tier_builds_together)
    for key in (backward_keys("sm_90a", "bf16", 128, True, True, kernel="sm90")[1],
                backward_keys("sm_90a", "bf16", 128, True, False, kernel="sm90", features=Features(softcap=True))[1],
                backward_keys("sm_90a", "bf16", 64, True, False, kernel="sm90")[1],
                backward_keys("sm_90a", "bf16", 128, True, False, traits=parse_backward_traits("m64n128s2", 128))[1],
                backward_keys("sm_90a", "bf16", 128, True, False, kernel="sm80")[1]):
        assert backward_long_key(key) is None and backward_tier_siblings(key) == [key]
    # the variant lists (prebuild, tools/compile_variants.py) carry the tier and its postprocess
    variants = compile_mod.backward_variants(["sm_90a"], [head_dim], ["bf16"], [True], [False], kernels=("sm90",))
    assert {main, long, *posts} <= set(variants)


def test_sm90_backward_stream_k_tier_builds_together():
    """d128 plain non-causal runs the Stream-K tier where traits.stream_k_blocks deals blocks out:
    the first use of either builds both and the (one) postprocess; deterministic, features and
    causal have none."""
    from cute_attn.compile import backward_keys, backward_post_key, backward_stream_k_key, backward_tier_siblings
    from cute_attn.traits import SM90_BACKWARD, SM90_BACKWARD_STREAM_K

    _, main = backward_keys("sm_90a", "bf16", 128, False, False, kernel="sm90")
    tier = backward_stream_k_key(main)
    assert tier.candidates[0] == SM90_BACKWARD_STREAM_K[128] and tier.candidates[0].stream_k
    assert tier.candidates[0].spec == "m80n128s2pk" and not SM90_BACKWARD[128][False].stream_k
    post = backward_post_key(main, main.candidates[0])
    assert backward_post_key(tier, tier.candidates[0]) == post  # Stream-K leaves dQ's layout alone
    for first in (main, tier):
        counting = CountingBuild()
        cache = KernelCache(counting, None, group=backward_tier_siblings)
        cache.get(first)
        cache.get(post)
        cache.get(main), cache.get(tier)
        assert set(counting.keys) == {main, tier, post} and len(counting.keys) == 3
    for key in (backward_keys("sm_90a", "bf16", 128, False, True, kernel="sm90")[1],
                backward_keys("sm_90a", "bf16", 128, False, False, kernel="sm90", features=Features(softcap=True))[1],
                backward_keys("sm_90a", "bf16", 64, False, False, kernel="sm90")[1]):
        assert backward_stream_k_key(key) is None and backward_tier_siblings(key) == [key]
    variants = compile_mod.backward_variants(["sm_90a"], [128], ["bf16"], [False], [False], kernels=("sm90",))
    assert {main, tier, post} <= set(variants)


def test_kv_cache_decode_builds_split_and_unsplit_together():
    """Whether a decode call splits the keys follows the cache length: the first use of either
    kernel builds both, so a growing cache never compiles."""

    counting = CountingBuild()
    cache = KernelCache(counting, None, group=forward_tier_siblings)
    unsplit = forward_key("sm_90a", "bf16", 128, False, features=Features(kvcache=True, pack_gqa=True))
    split = forward_key("sm_90a", "bf16", 128, False, features=Features(kvcache=True, pack_gqa=True, split=True))
    cache.get(unsplit)
    # then the SM90 forward's keys a chunk of queries would take on this target (_paged_route_keys)
    assert counting.keys[:2] == [unsplit, split] and all(k.kernel == "sm90" for k in counting.keys[2:])
    built = len(counting.keys)
    cache.get(split)
    assert len(counting.keys) == built


def test_explicit_traits_have_no_siblings_and_sm80_keys_only_their_split_kernel():
    traits = parse_traits("m128n128s2", 128)
    key = forward_key("sm_90a", "bf16", 128, False, traits=traits)
    assert forward_tier_siblings(key) == [key]
    assert forward_tier_siblings(forward_key("sm_80", "bf16", 32, False, traits=parse_traits("m64n64w4s2", 32))) \
        == [forward_key("sm_80", "bf16", 32, False, traits=parse_traits("m64n64w4s2", 32))]
    assert forward_tier_siblings(SMALL) == [SMALL, compile_mod.forward_split_key("sm_80", "bf16", 32, False, NO_FEATURES)]
    # varlen has no split path
    varlen = forward_key("sm_80", "bf16", 32, False, features=Features(varlen=True))
    assert forward_tier_siblings(varlen) == [varlen]
    assert compile_mod.forward_cache._group is forward_tier_siblings


@pytest.mark.parametrize("smem", [227 * 1024, 99 * 1024])
@pytest.mark.parametrize("head_dim,alibi", [(128, False), (72, True), (256, False)])
def test_split_sibling_is_the_key_the_split_path_asks_for(smem, head_dim, alibi):
    """The sibling built with a dense forward is the split-KV key interface._decode_launcher looks
    up for that forward's options, whatever the GPU's shared memory (the decode traits fit ~100 KB)."""
    from cute_attn.traits import sm80_decode_traits

    features = Features(alibi=alibi, local=True)
    asked = forward_key("sm_90a", "fp16", head_dim, True, smem, traits=sm80_decode_traits(head_dim, smem, 0),
                        features=Features(alibi=alibi, local=True, split=True, pack_gqa=not alibi))
    assert compile_mod.forward_split_key("sm_90a", "fp16", head_dim, True, features) == asked


def test_prebuild_fills_the_cache_the_runtime_reads(tmp_path, capsys):
    from cute_attn import prebuild

    keys = prebuild.prebuild_keys(["sm_90a"], [64, 256], ["bf16"], [True], [False], ["bwd"])
    # what an H100 runs: the SM90 backward for d64 and the large-head-dim one for d256, with pre/post kernels
    mains = [k for k in keys if isinstance(k, compile_mod.BackwardKey)]
    assert {k.kernel for k in mains} == {"sm90"} and {k.traits.swap_dkv for k in mains} == {False, True}
    _, main = compile_mod.backward_keys("sm_90a", "bf16", 64, True, False, kernel="sm90",
                                        smem_capacity=227 * 1024)
    assert main in keys
    fwd = prebuild.prebuild_keys(["sm_80"], [32], ["bf16"], [False], directions=["fwd"])
    assert fwd == forward_tier_siblings(SMALL)  # the kernel and its split-KV sibling
    assert prebuild.main(["--arch", "sm_80", "--head-dim", "32", "--dtype", "bf16", "--causal", "0",
                          "--direction", "fwd", "--cache-dir", str(tmp_path)]) == 0
    assert "2 kernels in" in capsys.readouterr().out
    cache = KernelCache(build, str(tmp_path), group=forward_tier_siblings)
    cache.get(SMALL)
    assert (cache.builds, cache.loads) == (0, 2)
    with pytest.raises(SystemExit):
        prebuild.main(["--head-dim", "12"])


def test_siblings_compile_in_a_background_process(tmp_path, monkeypatch):
    """With a disk cache, a first use compiles only its own kernel; a child process compiles the
    siblings into the directory, from where the first call that needs one loads it."""
    monkeypatch.delenv("CUTE_ATTN_BACKGROUND_BUILD", raising=False)
    split = compile_mod.forward_split_key("sm_80", "bf16", 32, False, NO_FEATURES)
    cache = KernelCache(build, str(tmp_path), group=forward_tier_siblings, background=True)
    assert cache.get(SMALL) is not None
    assert cache.builds == 1 and split not in cache
    assert compile_mod.wait_for_background_builds(600)
    assert cache.get(split) is not None
    assert (cache.builds, cache.loads) == (1, 1), (cache.builds, cache.loads,
                                                   (tmp_path / "background.log").read_text()[-2000:])
    # a later first use whose siblings are already on disk submits nothing
    again = KernelCache(build, str(tmp_path), group=forward_tier_siblings, background=True)
    again.get(SMALL)
    assert split not in again and (again.builds, again.loads) == (0, 1)


def test_background_builds_off_and_without_a_disk_cache(tmp_path, monkeypatch):
    """CUTE_ATTN_BACKGROUND_BUILD=0, or no disk directory: the siblings are built by the caller."""
    split = compile_mod.forward_split_key("sm_80", "bf16", 32, False, NO_FEATURES)
    monkeypatch.setenv("CUTE_ATTN_BACKGROUND_BUILD", "0")
    off = KernelCache(build, str(tmp_path), group=forward_tier_siblings, background=True)
    off.get(SMALL)
    assert split in off and off.builds == 2
    monkeypatch.delenv("CUTE_ATTN_BACKGROUND_BUILD")
    memory = KernelCache(build, None, group=forward_tier_siblings, background=True)
    memory.get(SMALL)
    assert split in memory and memory.builds == 2


def test_builds_pause_the_garbage_collector():
    """A build runs with Python's cyclic GC off (a full collection walks torch's objects too) and
    leaves the collector as it found it: on after a build (or a failed one), off where the caller
    had turned it off, on again after nested and concurrent builds; objects the program froze
    (gc.freeze) stay frozen."""
    import gc
    import threading

    seen = []

    def build(key):
        seen.append(gc.isenabled())
        if key == "outer":  # a build that builds another (as the backward's postprocess is)
            inner.get("inner")
        return object()

    inner = KernelCache(build, None)
    assert gc.isenabled()
    KernelCache(build, None).get("outer")
    assert seen == [False, False] and gc.isenabled()

    threads = [threading.Thread(target=KernelCache(build, None).get, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen[2:] == [False] * 4 and gc.isenabled()

    def failing(key):
        raise RuntimeError("compile failed")

    with pytest.raises(RuntimeError):
        KernelCache(failing, None).get("failing")
    assert gc.isenabled()

    gc.disable()
    try:
        KernelCache(build, None).get("caller-disabled")
        assert not gc.isenabled()
    finally:
        gc.enable()

    # objects the program froze itself stay frozen
    frozen = [object() for _ in range(3)]
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        assert count > 0
        KernelCache(build, None).get("after-freeze")
        # not unfrozen (the count would fall to 0) nor frozen further (it would grow by the young
        # objects); frozen objects another thread drops meanwhile (an earlier test's background
        # build) leave it a little lower: 581207 -> 581190 once in CI
        assert count // 2 < gc.get_freeze_count() <= count
    finally:
        gc.unfreeze()
    del frozen


def test_bootstrap_keys_drop_only_the_intra_warpgroup_overlap():
    """compile.forward_bootstrap_key: an SM90 table key with the overlap -> the same traits without
    it and with every block masked (nothing else changes, so the launch arguments are the same);
    other keys have none."""
    from cute_attn.compile import forward_bootstrap_key

    for head_dim, causal in [(64, False), (128, True), (256, False)]:
        key = forward_key("sm_90a", "bf16", head_dim, causal, kernel="sm90", seqlen=2048)
        boot = forward_bootstrap_key(key)
        assert boot.candidates == (replace(key.candidates[0], intra_wg_overlap=False, mask_every_block=True),)
        assert parse_traits(boot.candidates[0].spec, head_dim) == boot.candidates[0]
        assert replace(boot, candidates=key.candidates) == key and boot.name != key.name
        assert forward_bootstrap_key(boot) is None
    with pytest.raises(ValueError, match="needs 'o0'"):
        parse_traits("m128n128s2mb", 128)  # the masked loop is the serial path's
    assert forward_bootstrap_key(SMALL) is None  # SM80
    two = replace(forward_key("sm_90a", "bf16", 64, False, kernel="sm90"),
                  candidates=(parse_traits("m128n128s2", 64), parse_traits("m64n128s2", 64)))
    assert forward_bootstrap_key(two) is None  # several candidates: the bootstrap could take another


def test_a_cold_start_runs_the_bootstrap_until_its_key_is_built(tmp_path, monkeypatch):
    """KernelCache.slot on a cold disk cache: the bootstrap is compiled here and runs while a
    background process compiles the key; the first use after that loads the key. A warm cache,
    or no background builds, gives the key's own kernel at once."""
    from cute_attn.compile import build_forward, forward_bootstrap_key

    monkeypatch.delenv("CUTE_ATTN_BACKGROUND_BUILD", raising=False)
    key = forward_key("sm_90a", "bf16", 32, True, kernel="sm90", seqlen=1024)
    cache = KernelCache(build_forward, str(tmp_path), background=True, bootstrap=forward_bootstrap_key)
    slot = cache.slot(key)
    assert slot.bootstrapped and key not in cache and forward_bootstrap_key(key) in cache
    assert slot.traits == forward_bootstrap_key(key).candidates[0] and cache.builds == 1
    assert cache.slot(key) is slot
    assert compile_mod.wait_for_background_builds(600)
    assert slot.current() is cache.get(key) and not slot.bootstrapped
    assert slot.traits == key.candidates[0] and (cache.builds, cache.loads) == (1, 1), (
        (tmp_path / "background.log").read_text()[-2000:])
    warm = KernelCache(build_forward, str(tmp_path), background=True, bootstrap=forward_bootstrap_key)
    assert not warm.slot(key).bootstrapped and (warm.builds, warm.loads) == (0, 1)
    monkeypatch.setenv("CUTE_ATTN_BACKGROUND_BUILD", "0")
    off = KernelCache(build_forward, str(tmp_path / "off"), background=True, bootstrap=forward_bootstrap_key)
    assert not off.slot(key).bootstrapped and off.builds == 1
