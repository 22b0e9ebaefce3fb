"""The compiled-kernel caches without a GPU: the disk cache's location, round trip, corrupt
entries, several processes filling it at once, and the SM90 length tiers built together (CPU)."""

import subprocess
import sys
import textwrap

import pytest

from cute_attn import compile as compile_mod
from cute_attn.compile import KernelCache, build, default_cache_dir, forward_key, forward_tier_siblings
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


def test_disk_round_trip_and_corrupt_entry(tmp_path):
    first = KernelCache(build, str(tmp_path))
    first.get(SMALL)
    assert (first.builds, first.loads) == (1, 0)
    second = KernelCache(build, str(tmp_path))
    assert second.get(SMALL) is not None and (second.builds, second.loads) == (0, 1)
    assert second.chosen(SMALL) == first.chosen(SMALL)
    # a truncated object is a miss: rebuilt and replaced, never an error
    (entry,) = tmp_path.glob("*.o")
    entry.write_bytes(entry.read_bytes()[:100])
    third = KernelCache(build, str(tmp_path))
    third.get(SMALL)
    assert (third.builds, third.loads) == (1, 0)
    fourth = KernelCache(build, str(tmp_path))
    fourth.get(SMALL)
    assert (fourth.builds, fourth.loads) == (0, 1)
    assert not list(tmp_path.glob("*.tmp")), "temporary files left behind"


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
    assert len(counting.keys) == tiers  # every tier on the first use
    for seqlen in (1, 1000, 1025, 2048, 4097, 8192, 8193, 100000):
        cache.get(forward_key("sm_90a", "bf16", head_dim, causal, kernel="sm90", seqlen=seqlen))
    assert len(counting.keys) == tiers  # no length compiles again
    assert len(set(counting.keys)) == tiers


def test_explicit_traits_and_sm80_keys_have_no_siblings():
    traits = parse_traits("m128n128s2", 128)
    key = forward_key("sm_90a", "bf16", 128, False, traits=traits)
    assert forward_tier_siblings(key) == [key]
    assert forward_tier_siblings(SMALL) == [SMALL]
    assert compile_mod.forward_cache._group is forward_tier_siblings


def test_prebuild_fills_the_cache_the_runtime_reads(tmp_path, capsys):
    from cute_attn import prebuild

    keys = prebuild.prebuild_keys(["sm_90a"], [64, 256], ["bf16"], [True], [False], ["bwd"])
    # what an H100 runs: the SM90 backward for d64, the SM80 fallback for d256, with pre/post kernels
    assert {k.kernel for k in keys if isinstance(k, compile_mod.BackwardKey)} == {"sm80", "sm90"}
    _, main = compile_mod.backward_keys("sm_90a", "bf16", 64, True, False, kernel="sm90",
                                        smem_capacity=227 * 1024)
    assert main in keys
    fwd = prebuild.prebuild_keys(["sm_80"], [32], ["bf16"], [False], directions=["fwd"])
    assert fwd == [SMALL]
    assert prebuild.main(["--arch", "sm_80", "--head-dim", "32", "--dtype", "bf16", "--causal", "0",
                          "--direction", "fwd", "--cache-dir", str(tmp_path)]) == 0
    assert "1 kernels in" in capsys.readouterr().out
    cache = KernelCache(build, str(tmp_path))
    cache.get(SMALL)
    assert (cache.builds, cache.loads) == (0, 1)
    with pytest.raises(SystemExit):
        prebuild.main(["--head-dim", "12"])
