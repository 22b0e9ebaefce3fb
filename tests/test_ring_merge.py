"""Ring attention's merge kernel (kernels/ring_merge.py): compiles without a GPU (CPU), and folds
random step results into accumulators like the torch merge it replaces (GPU, marker ``gpu``)."""

import math
import re

import pytest
import torch

from cute_attn import artifacts
from cute_attn.compile import RingMergeKey, build, ring_merge_key

# (target, dtype, head_dim, indexed): both targets and dtypes, a padded head dim (72 -> 96), d256
COMPILE_KEYS = [
    ("sm_80", "bf16", 128, False),
    ("sm_90a", "fp16", 64, True),
    ("sm_90a", "bf16", 72, True),
    ("sm_80", "fp16", 256, False),
]


def test_ring_merge_key():
    key = ring_merge_key("sm_90a", "bf16", 128, False)
    assert key == RingMergeKey("sm_90a", "bf16", 128, False, False)
    assert key.name == "ring_merge_sm_90a_bf16_d128"
    padded = ring_merge_key("sm_80", "fp16", 72, True)
    assert (padded.head_dim, padded.check_hdim, padded.indexed) == (96, True, True)
    assert padded.name == "ring_merge_sm_80_fp16_d96_padded_indexed"


@pytest.mark.parametrize("target,dtype,head_dim,indexed", COMPILE_KEYS,
                         ids=[f"{t}_{dt}_d{d}{'_idx' if i else ''}" for t, dt, d, i in COMPILE_KEYS])
def test_ring_merge_compiles_without_local_memory(target, dtype, head_dim, indexed):
    key = ring_merge_key(target, dtype, head_dim, indexed)
    fn = build(key, keep_artifacts=True)
    ptx = fn.__ptx__
    assert artifacts.ptx_target(ptx) == target
    assert artifacts.count_ptx(ptx)["ld.local/st.local"] == 0, "local memory in the PTX"
    assert artifacts.cubin_resources(fn.__cubin__)["stack_frame"] == 0
    body = "\n".join(line.split("//", 1)[0] for line in ptx.splitlines())
    # the accumulator in 128-bit loads and stores, the step's output in 64-bit loads
    assert re.search(r"\bld\.global(\.\w+)*\.v4\.(b|f)32\b", body), "no 128-bit loads of the accumulator"
    assert re.search(r"\bst\.global(\.\w+)*\.v4\.(b|f)32\b", body), "no 128-bit stores of the accumulator"
    assert re.search(r"\bld\.global(\.\w+)*\.(v2\.b32|v4\.b16)\b", body), "no 64-bit loads of the step's output"
    assert "ex2.approx" in body and "lg2.approx" in body


# ---------------------------------------------------------------------------- GPU
def _step(batch, rows, heads, head_dim, dtype):
    """A step's (out, lse) like cute_attn's forward returns them: rows that saw no key have out 0
    and lse +inf (every fifth row here)."""
    out = torch.randn(batch, rows, heads, head_dim, device="cuda").to(dtype)
    lse = torch.randn(batch, heads, rows, device="cuda") * 3
    empty = (torch.arange(rows, device="cuda") % 5 == 0).expand(batch, heads, rows)
    out.masked_fill_(empty.transpose(1, 2)[..., None], 0.0)
    return out, lse.masked_fill(empty, math.inf)


def _accumulators(batch, rows, heads, head_dim):
    """Accumulators part-way through a ring: rows with no key yet (out 0, lse -inf) among others."""
    acc = torch.randn(batch, rows, heads, head_dim, device="cuda")
    lse = torch.randn(batch, heads, rows, device="cuda") * 3
    fresh = (torch.arange(rows, device="cuda") % 3 == 1).expand(batch, heads, rows)
    acc.masked_fill_(fresh.transpose(1, 2)[..., None], 0.0)
    return acc, lse.masked_fill(fresh, -math.inf)


def _torch_merge(acc, acc_lse, part, part_lse):
    from cute_attn.distributed import _combined

    return _combined(acc, acc_lse, part, part_lse, lse_to_out=lambda t: t.transpose(1, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 72, 128, 256])
def test_ring_merge_matches_torch_merge(head_dim, dtype):
    from cute_attn.distributed import _fused_merge

    batch, total, heads = 2, 1000, 3
    for start, rows in ((0, total), (17, 113), (999, 1)):  # the whole slice, and views into it
        acc, acc_lse = _accumulators(batch, total, heads, head_dim)
        part, part_lse = _step(batch, rows, heads, head_dim, dtype)
        want, want_lse = _torch_merge(acc[:, start:start + rows], acc_lse[..., start:start + rows], part, part_lse)
        before, before_lse = acc.clone(), acc_lse.clone()
        assert _fused_merge(acc[:, start:start + rows], acc_lse[..., start:start + rows], part, part_lse)
        torch.cuda.synchronize()
        got, got_lse = acc[:, start:start + rows], acc_lse[..., start:start + rows]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-5)  # -inf where no key yet
        outside = torch.ones(total, dtype=torch.bool, device="cuda")
        outside[start:start + rows] = False
        assert torch.equal(acc[:, outside], before[:, outside]) and torch.equal(acc_lse[..., outside],
                                                                               before_lse[..., outside])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ring_merge_through_a_row_index(dtype):
    """Varlen steps on half of every sequence: step row i folds into accumulator row index[i]."""
    from cute_attn.distributed import _fused_merge

    total, heads, head_dim = 701, 4, 128
    acc, acc_lse = _accumulators(1, total, heads, head_dim)
    index = torch.randperm(total, device="cuda")[:300].to(torch.int32)
    part, part_lse = _step(1, 300, heads, head_dim, dtype)
    want, want_lse = _torch_merge(acc[:, index.long()], acc_lse[..., index.long()], part, part_lse)
    before, before_lse = acc.clone(), acc_lse.clone()
    assert _fused_merge(acc, acc_lse, part, part_lse, index)
    torch.cuda.synchronize()
    torch.testing.assert_close(acc[:, index.long()], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc_lse[..., index.long()], want_lse, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(total, dtype=torch.bool, device="cuda")
    untouched[index.long()] = False
    assert torch.equal(acc[:, untouched], before[:, untouched])
    assert torch.equal(acc_lse[..., untouched], before_lse[..., untouched])


def test_merge_off_the_gpu_is_torch_merge():
    """CPU tensors (the CPU ring tests' reference steps) are not the kernel's: ``_fused_merge``
    leaves them to ``_combined``."""
    from cute_attn.distributed import _fused_merge

    acc, lse = torch.zeros(1, 4, 2, 8), torch.full((1, 2, 4), -math.inf)
    assert not _fused_merge(acc, lse, torch.ones(1, 4, 2, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 4))
    assert torch.equal(acc, torch.zeros(1, 4, 2, 8))
