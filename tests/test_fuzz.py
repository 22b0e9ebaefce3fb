"""The random case generator of test_fuzz_gpu.py, on the CPU: each seed's draws are what its
configuration compiles (so ``fuzz_keys`` lists every kernel a seed runs), and they stay within
the API's contract and the references' memory."""

import torch

from cute_attn.interface import _score_options
from helpers import grad_floor
from test_fuzz_gpu import MAX_SCORES, fuzz_config, fuzz_instances, fuzz_keys, kvcache_config, kvcache_instances

SEEDS = range(60)


def test_same_seed_same_cases():
    assert [fuzz_instances(s) for s in SEEDS] == [fuzz_instances(s) for s in SEEDS]
    assert len({str(fuzz_config(s)) for s in SEEDS}) > 40  # the configurations differ


def test_instances_keep_their_configuration_kernel():
    """Every draw of a seed maps onto the same kernel features and causal flag: a window never
    degenerates into plain causal (or no) attention, so the seed compiles one kernel set."""
    for seed in SEEDS:
        cfg = fuzz_config(seed)
        kinds = set()
        for inst in fuzz_instances(seed):
            opts = _score_options(cfg.causal, inst["softmax_scale"], cfg.head_dim, inst["window_size"],
                                  inst["softcap"], cfg.alibi, varlen=cfg.varlen, seqused=cfg.seqused)
            assert opts.features.local == cfg.window and opts.features.softcap == cfg.softcap, (seed, inst)
            kinds.add((opts.causal, opts.features))
        assert len(kinds) == 1, (seed, kinds)


def test_instances_within_contract():
    for seed in SEEDS:
        cfg = fuzz_config(seed)
        for inst in fuzz_instances(seed):
            assert inst["heads"] % inst["heads_kv"] == 0
            if cfg.varlen:
                assert len(inst["lengths_q"]) == len(inst["lengths_k"]) >= 1
                assert inst["max_seqlens"][0] >= max(inst["lengths_q"])
                assert inst["max_seqlens"][1] >= max(inst["lengths_k"])
                if inst["seqused_k"] is not None:
                    assert all(0 <= u <= n for u, n in zip(inst["seqused_k"], inst["lengths_k"]))
            else:
                assert inst["batch"] * inst["heads"] * inst["seqlen_q"] * inst["seqlen_k"] <= MAX_SCORES


def test_kvcache_instances_within_contract():
    for seed in SEEDS:
        cfg = kvcache_config(seed)
        for inst in kvcache_instances(seed):
            assert inst["heads"] % inst["heads_kv"] == 0
            room = inst["capacity"] - inst["seqlen_new"]
            assert all(0 <= n <= room for n in inst["cache_seqlens"])
            if cfg.page_size:
                assert inst["capacity"] % cfg.page_size == 0
                assert not inst["batch_idx"] and inst["leftpad"] is None  # not with a block table
            if inst["leftpad"] is not None:
                assert all(0 <= p <= n for p, n in zip(inst["leftpad"], inst["cache_seqlens"]))
            if inst["rotary"] is not None:
                assert inst["seqlen_new"] and inst["rotary"][1] % 16 == 0 and inst["rotary"][1] <= cfg.head_dim


def test_fuzz_keys_list_both_families_without_a_gpu():
    keys = fuzz_keys(seeds=range(4))
    kernels = {getattr(k, "kernel", None) for k in keys}
    assert {"sm80", "sm90"} <= kernels


def test_grad_floor_is_one_unit_at_the_largest_element():
    assert grad_floor(torch.tensor([0.1, -1.5]), torch.bfloat16) == 2**-7
    assert grad_floor(torch.tensor([0.53]), torch.bfloat16) == 2**-8
    assert grad_floor(torch.tensor([3.0]), torch.float16) == 2 * 2**-10
    assert grad_floor(torch.zeros(2), torch.bfloat16) == 0.0 and grad_floor(torch.zeros(0), torch.bfloat16) == 0.0
