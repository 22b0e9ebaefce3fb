"""The split-KV combine kernel (kernels/combine.py): compiles without a GPU (CPU), and merges random
partials like the fp32 torch reference (GPU, marker ``gpu``)."""

import math
import re

import pytest
import torch

from cute_attn import artifacts
from cute_attn.compile import CombineKey, build, combine_cache, combine_key
from helpers import check_close, check_lse, poisoned_like

# (target, dtype, head_dim): both targets and dtypes, d64/d128 and a padded head dim (72 -> 96)
COMPILE_KEYS = [
    ("sm_80", "bf16", 128),
    ("sm_90a", "fp16", 64),
    ("sm_80", "fp16", 72),
    ("sm_90a", "bf16", 72),
]


def test_combine_key():
    key = combine_key("sm_90a", "bf16", 128)
    assert key == CombineKey("sm_90a", "bf16", 128, False)
    assert key.name == "combine_sm_90a_bf16_d128"
    padded = combine_key("sm_80", "fp16", 72)
    assert (padded.head_dim, padded.check_hdim) == (96, True)
    assert padded.name == "combine_sm_80_fp16_d96_padded"
    assert hash(padded) == hash(combine_key("sm_80", "fp16", 96 - 8))


@pytest.mark.parametrize("target,dtype,head_dim", COMPILE_KEYS, ids=[f"{t}_{dt}_d{d}" for t, dt, d in COMPILE_KEYS])
def test_combine_compiles_without_local_memory(target, dtype, head_dim):
    key = combine_key(target, dtype, head_dim)
    fn = build(key, keep_artifacts=True)  # the generic dispatcher knows CombineKey
    ptx = fn.__ptx__
    assert artifacts.ptx_target(ptx) == target
    counts = artifacts.count_ptx(ptx)
    assert counts["ld.local/st.local"] == 0, "local memory in the PTX"
    assert counts["mma.sync"] == counts["wgmma"] == 0
    res = artifacts.cubin_resources(fn.__cubin__)
    assert res["stack_frame"] == 0, f"{key.name}: {res['stack_frame']} bytes of local memory"
    assert res["registers"] and res["registers"] <= 255
    body = "\n".join(line.split("//", 1)[0] for line in ptx.splitlines())
    # the partial outputs in 128-bit loads, the output in 4-element (64-bit) stores
    assert re.search(r"\bld\.global(\.\w+)*\.v4\.(b|f)32\b", body), "no 128-bit loads of the partial outputs"
    assert re.search(r"\bst\.global(\.\w+)*\.(v2\.b32|v4\.b16)\b", body), "no 64-bit stores of the output"
    assert "ex2.approx" in body and "lg2.approx" in body


# ---------------------------------------------------------------------------- GPU
def _reference(o_accum: torch.Tensor, lse_accum: torch.Tensor):
    """fp32 (out (batch, seqlen_q, heads, d), lse (batch, heads, seqlen_q)); +inf partial LSEs are
    empty splits (weight 0); a row with every split empty gets out 0 and lse +inf."""
    valid = torch.isfinite(lse_accum)
    lse = torch.logsumexp(lse_accum.masked_fill(~valid, -math.inf), dim=0)  # (batch, heads, seqlen_q)
    empty = torch.isinf(lse)
    safe = lse.masked_fill(empty, 0.0)
    w = torch.where(valid, torch.exp(lse_accum.masked_fill(~valid, 0.0) - safe), 0.0)  # (splits, b, h, q)
    out = torch.einsum("sbhq,sbqhd->bqhd", w.double(), o_accum.double()).float()
    return out, lse.masked_fill(empty, math.inf)


def _partials(num_splits, batch, seqlen_q, heads, head_dim, empty_fraction, generator):
    dev = "cuda"
    o_accum = torch.randn(num_splits, batch, seqlen_q, heads, head_dim, device=dev, generator=generator)
    lse_accum = torch.randn(num_splits, batch, heads, seqlen_q, device=dev, generator=generator) * 4 + 3
    empty = torch.rand(num_splits, batch, heads, seqlen_q, device=dev, generator=generator) < empty_fraction
    empty[:, 0, 0, 0] = True  # one row with every split empty
    if empty_fraction < 1 and seqlen_q * heads * batch > 1:
        empty[:, -1, -1, -1] = False  # and one with none
    lse_accum[empty] = math.inf
    # an empty split's partial output is 0 (the forward's contract)
    o_accum.masked_fill_(empty.permute(0, 1, 3, 2).unsqueeze(-1), 0.0)
    return o_accum, lse_accum


CASES = [  # (num_splits, batch, seqlen_q, heads, head_dim, empty fraction)
    (1, 2, 3, 5, 128, 0.3),
    (2, 3, 1, 7, 64, 0.3),
    (7, 2, 5, 3, 72, 0.25),
    (128, 1, 1, 9, 128, 0.5),
    (128, 2, 3, 5, 72, 0.1),
    (3, 4, 301, 6, 256, 0.2),  # many rows: many CTAs, a partial last one
    (13, 1, 17, 2, 32, 0.0),
    (5, 2, 2, 3, 40, 1.0),  # every split of every row empty
    (9, 3, 2, 5, 192, 0.3),
    (8, 1, 1, 1, 8, 0.3),  # the smallest head dim (padded to 32)
    (4, 2, 129, 33, 128, 0.2),  # enough rows for one warp per row
    (3, 2, 257, 33, 64, 0.2),  # the same with two rows per warp
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=[f"s{c[0]}_b{c[1]}_q{c[2]}_h{c[3]}_d{c[4]}" for c in CASES])
def test_combine_matches_reference(case, dtype):
    from cute_attn import dispatch

    num_splits, batch, seqlen_q, heads, head_dim, empty_fraction = case
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=device)
    g.manual_seed(hash(case) % 2**31)
    o_accum, lse_accum = _partials(num_splits, batch, seqlen_q, heads, head_dim, empty_fraction, g)
    inputs = (o_accum.clone(), lse_accum.clone())
    ref, ref_lse = _reference(o_accum, lse_accum)
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    fn = combine_cache.get(combine_key(dispatch.plan_for_device(device).target, name, head_dim))
    info = f"splits={num_splits} b={batch} sq={seqlen_q} h={heads} d={head_dim} {dtype}"
    # out like q: a (batch, seqlen_q, heads, d) view with padded strides; lse with a padded batch stride
    out_big = poisoned_like(o_accum, (batch, seqlen_q + 1, heads, head_dim + 8), dtype)
    lse_big = poisoned_like(lse_accum, (batch + 1, heads, seqlen_q), torch.float32)
    for out, lse in [
        (poisoned_like(o_accum, (batch, seqlen_q, heads, head_dim), dtype),
         poisoned_like(lse_accum, (batch, heads, seqlen_q), torch.float32)),
        (out_big[:, 1:, :, :head_dim], lse_big[1:]),
    ]:
        with torch.cuda.device(device):
            fn(o_accum, lse_accum, out, lse)
        torch.cuda.synchronize()
        check_lse(lse, ref_lse, info)
        assert torch.equal(torch.isposinf(lse), torch.isinf(ref_lse)), f"lse of empty rows must be +inf ({info})"
        finite = torch.isfinite(ref_lse)
        if finite.any():
            lse_err = ((lse - ref_lse).abs() / ref_lse.abs().clamp_min(1.0))[finite].max().item()
            assert lse_err <= 1e-5, f"lse: relative error {lse_err:.3g} ({info})"
        check_close("out", out, ref, (), 1e-3, info)
        empty_rows = torch.isinf(ref_lse).permute(0, 2, 1)  # (batch, seqlen_q, heads)
        assert (out[empty_rows] == 0).all(), f"rows with every split empty must be 0 ({info})"
    # the padded columns and rows around the strided output stay untouched
    assert torch.isnan(out_big[:, :1]).all() and torch.isnan(out_big[..., head_dim:]).all()
    assert torch.isnan(lse_big[:1]).all()
    assert torch.equal(o_accum, inputs[0]) and torch.equal(lse_accum, inputs[1]), "inputs changed"
