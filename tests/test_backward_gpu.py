"""Backward kernels and autograd against the fp32 reference on the GPU (marker ``gpu``).

Every test runs once per kernel family the GPU can run (``arch``): SM80 everywhere, SM90 on
compute capability 9.0 (kernels/sm90/backward.py for d32-128, kernels/sm90/backward_large.py for
d192/256).
"""

import pytest
import torch

import cute_attn
from cute_attn.reference import attention_reference
from helpers import check_close, flash_baselines, grad_floor, poisoned_like, random_qkv
from helpers import arch  # noqa: F401  (autouse: every test under both kernel families)

pytestmark = pytest.mark.gpu


HEAD_DIMS = [32, 64, 96, 128, 192, 256, 72]  # table entries, then a padded one
SEQLENS = [(1, 1), (17, 17), (113, 203), (127, 128), (129, 255), (255, 129), (1000, 1000), (300, 17), (17, 300)]
HEADS = [(4, 4), (6, 2), (4, 1)]  # MHA, GQA, MQA


def reference_grads(q, k, v, dout, causal, compute_dtype):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, _ = attention_reference(q, k, v, causal, compute_dtype=compute_dtype)
    out.backward(dout)
    return q.grad, k.grad, v.grad


def baseline_grads(q, k, v, dout, causal, out=None):
    """What the error is measured against, per gradient: same-dtype PyTorch autograd, and the
    exact gradients of FlashAttention's formulation, which reads O rounded to the input dtype (or
    ``out``, the kernel's own), with and without P and dS rounded too (helpers.flash_baselines: in
    rows with few keys those roundings alone can cost more than the same-dtype autograd's error)."""
    same = reference_grads(q, k, v, dout, causal, q.dtype)
    return tuple((s, *f) for s, f in zip(same, flash_baselines(q, k, v, dout, causal, {}, out)))


def check_backward(qkv, causal, case):
    """Forward, then backward into poisoned dq/dk/dv, against the fp32 reference (the error at most
    2x the same-dtype baseline's plus 1e-4)."""
    q, k, v = qkv
    out, lse = cute_attn.forward(q, k, v, causal=causal, return_lse=True)
    dout = torch.randn_like(out)
    dq, dk, dv = poisoned_like(q), poisoned_like(k), poisoned_like(v)
    cute_attn.backward(dout, q, k, v, out, lse, causal=causal, dq=dq, dk=dk, dv=dv)
    ref = reference_grads(q, k, v, dout, causal, torch.float32)
    same = baseline_grads(q, k, v, dout, causal, out)
    for name, got, r, s in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, same):
        check_close(name, got, r, s, 1e-4, case, floor=grad_floor(r, got.dtype))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_backward_matches_reference(head_dim, dtype, causal):
    for seqlen_q, seqlen_k in SEQLENS:
        for heads, heads_kv in HEADS:
            case = f"d={head_dim} {dtype} causal={causal} sq={seqlen_q} sk={seqlen_k} h={heads}/{heads_kv}"
            check_backward(random_qkv(2, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype), causal, case)


@pytest.mark.parametrize("seqlen_q,seqlen_k,heads", [(8192, 8192, (2, 2)), (8300, 8200, (2, 1)), (8200, 9001, (2, 2))])
def test_long_causal_backward_tier(arch, seqlen_q, seqlen_k, heads, monkeypatch):
    """d128 plain causal from traits.SM90_BACKWARD_LONG_SEQLEN query rows runs the SM90 backward's
    long-sequence tier (80-row Q blocks; the SM80 family has none): seqlen_q == seqlen_k, rows
    that see no key (seqlen_q > seqlen_k) and K/V blocks past the last query's diagonal."""
    from cute_attn import compile as compile_mod
    from cute_attn.traits import SM90_BACKWARD_LONG_SEQLEN

    assert seqlen_q >= SM90_BACKWARD_LONG_SEQLEN
    asked, get = [], compile_mod.backward_cache.get  # the kernels the launches ask for
    monkeypatch.setattr(compile_mod.backward_cache, "get", lambda key: asked.append(key) or get(key))
    check_backward(random_qkv(1, seqlen_q, seqlen_k, *heads, 128, torch.bfloat16), True,
                   f"long causal sq={seqlen_q} sk={seqlen_k} h={heads}")
    if arch == "sm90":
        _, main = compile_mod.backward_keys("sm_90a", "bf16", 128, True, False, kernel="sm90")
        assert compile_mod.backward_long_key(main) in asked and main not in asked, "the long tier did not run"


@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,blocks", [
    (2, 1000, 1000, (4, 4), 64),  # every block dealt out, in pieces of 3-4 steps (inside one block)
    (1, 2048, 2048, (8, 2), 32),  # GQA: a block's steps run over two query heads
    (2, 300, 1000, (6, 1), 16),  # MQA, seqlen_q < seqlen_k
    (1, 4000, 3000, (6, 2), 20),  # a CTA per block first, then the Stream-K CTAs; seqlen_q > seqlen_k
    (2, 17, 1000, (32, 8), 100),  # one Q block per query head
    (1, 1001, 4097, (4, 4), 40),  # odd lengths: the last K/V block holds one key
    (2, 2048, 2048, (16, 8), 50),  # 206 whole blocks over the 132 SMs' CTAs: 1 or 2 each, then Stream-K
    (4, 4096, 4096, (16, 16), None),  # the rule's own count (traits.stream_k_blocks: 200 of 2048)
])
def test_stream_k_backward(arch, monkeypatch, batch, seqlen_q, seqlen_k, heads, blocks):
    """d128 plain non-causal on the SM90 backward's Stream-K tier (traits.stream_k_items; a
    persistent grid, each CTA's whole blocks before its Stream-K share), with forced block counts
    (interface.STREAM_K_BLOCKS) and the rule's: against the fp32 reference; dk and dv bitwise
    equal between calls (a cut block's partials are added in a fixed order)."""
    from cute_attn import interface, traits

    if arch != "sm90":
        pytest.skip("Stream-K is a tier of the SM90 backward")
    dealt, items = [], traits.stream_k_items
    monkeypatch.setattr(traits, "stream_k_items", lambda *a: dealt.append(a) or items(*a))
    monkeypatch.setattr(interface, "STREAM_K_BLOCKS", blocks)
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, *heads, 128, torch.bfloat16)
    check_backward((q, k, v), False, f"stream-k b={batch} sq={seqlen_q} sk={seqlen_k} h={heads} blocks={blocks}")
    assert dealt and dealt[0][1] == (blocks or 200), "the Stream-K tier did not run"
    out, lse = cute_attn.forward(q, k, v, return_lse=True)
    dout = torch.randn_like(out)
    first = cute_attn.backward(dout, q, k, v, out, lse)
    again = cute_attn.backward(dout, q, k, v, out, lse)
    assert torch.equal(first[1], again[1]) and torch.equal(first[2], again[2])


@pytest.mark.parametrize("head_dim,batch,seqlen,heads", [(128, 3, 4000, (4, 4)), (256, 2, 1500, (8, 4))])
def test_causal_backward_over_several_sections_of_heads(head_dim, batch, seqlen, heads):
    """Sequences long enough that the SM90 backward's causal CTA order (longest first within
    L2-sized sections of (batch, K/V head) pairs: tile_scheduler.section_coords) cuts the pairs
    into several sections, the last one partial: every K/V block is still computed exactly once."""
    from cute_attn.kernels.tile_scheduler import backward_heads_per_section

    section = backward_heads_per_section(seqlen, heads[0] // heads[1], head_dim)
    assert section < batch * heads[1] and (batch * heads[1]) % section, "the case must span a partial section"
    check_backward(random_qkv(batch, seqlen, seqlen, *heads, head_dim, torch.bfloat16), True,
                   f"d={head_dim} b={batch} s={seqlen} h={heads} sections of {section}")


@pytest.mark.parametrize("head_dim", [160, 192, 256])
def test_large_head_dims_take_the_sm90_large_kernel(arch, head_dim):
    """What the tests above run for d > 128: on Hopper the SM90 large-head-dim backward
    (kernels/sm90/backward_large.py: traits with swap_dkv), under ``arch`` sm80 the SM80 one."""
    from cute_attn import dispatch, interface

    q = torch.empty(1, 64, 2, head_dim, device="cuda", dtype=torch.bfloat16)
    for features in ({}, dict(window_size=(16, 0), softcap=5.0, alibi=True, varlen=True)):
        opts = interface._score_options(True, None, head_dim, **features)
        _, main = interface._backward_keys(dispatch.plan_for_device(q.device), q, opts, True)
        assert main.kernel == arch
        assert main.traits.swap_dkv if arch == "sm90" else not hasattr(main.traits, "swap_dkv")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [32, 72, 128, 192, 256])
def test_deterministic_backward_is_bitwise_repeatable(head_dim, causal):
    q, k, v = random_qkv(2, 1000, 1000, 8, 2, head_dim, torch.bfloat16)
    out, lse = cute_attn.forward(q, k, v, causal=causal, return_lse=True)
    dout = torch.randn_like(out)
    first = cute_attn.backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
    for _ in range(3):
        again = cute_attn.backward(dout, q, k, v, out, lse, causal=causal, deterministic=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    ref = reference_grads(q, k, v, dout, causal, torch.float32)
    same = baseline_grads(q, k, v, dout, causal, out)
    for name, got, r, s in zip(("dq", "dk", "dv"), first, ref, same):
        check_close(name, got, r, s, 1e-4, "deterministic", floor=grad_floor(r, got.dtype))


def test_flash_attn_func_autograd():
    q, k, v = random_qkv(2, 333, 333, 4, 2, 64, torch.bfloat16, requires_grad=True)
    k.requires_grad_(False)
    out = cute_attn.flash_attn_func(q, k, v, causal=True)
    out.sum().backward()  # a zero-stride output gradient
    assert k.grad is None and q.grad is not None and v.grad is not None
    dq, _, dv = reference_grads(q, k, v, torch.ones_like(out), True, torch.float32)
    sq, _, sv = baseline_grads(q, k, v, torch.ones_like(out), True)
    check_close("dq", q.grad, dq, sq, 1e-4, "autograd")
    check_close("dv", v.grad, dv, sv, 1e-4, "autograd")


def test_forward_backward_memory_is_linear_in_seqlen():
    """Peak memory of forward + backward at two lengths: linear growth, not quadratic."""
    peaks = []
    for seqlen in (8192, 16384):
        q, k, v = random_qkv(1, seqlen, seqlen, 16, 16, 128, torch.bfloat16, requires_grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = cute_attn.flash_attn_func(q, k, v, causal=True)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del q, k, v, out
    ratio = peaks[1] / peaks[0]
    assert ratio < 2.5, f"peak memory grew {ratio:.2f}x for 2x the sequence (quadratic would be ~4x)"
