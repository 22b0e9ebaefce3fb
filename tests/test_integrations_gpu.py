"""SDPA's flash backend routed to cute_attn on the GPU (marker ``gpu``): same results as calling
cute_attn directly, forward and backward, and declined calls still served by torch's kernels.
(transformers' attn_implementation="cute_attn" on the GPU: test_transformers_gpu.py, which needs no
flash-implementation registry.)"""

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cute_attn
from cute_attn.integrations import sdpa
from helpers import call_varlen_attn, random_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hasattr(torch.nn.attention, "register_flash_attention_impl"),
                       reason="this torch has no flash-implementation registry"),
]


@pytest.fixture
def activated():
    torch.nn.attention.activate_flash_attention_impl(sdpa.NAME)
    yield
    torch.nn.attention.restore_flash_attention_impl()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sdpa_flash_backend_runs_cute_attn(activated, head_dim, causal):
    q, k, v = random_qkv(2, 300, 300, 8, 8, head_dim, torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(q)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal).transpose(1, 2)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    ours, lse = cute_attn.forward(q, k, v, causal=causal, return_lse=True)
    assert torch.equal(out, ours)
    expected = cute_attn.backward(dout, q, k, v, ours, lse, causal=causal)
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=2e-2, rtol=0)  # dQ's fp32 sums may land in another order


def test_declined_calls_fall_back_to_torch(activated):
    q, k, v = (t.transpose(1, 2) for t in random_qkv(2, 128, 128, 4, 4, 64, torch.bfloat16))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)  # dropout: torch's own kernel
    assert out.shape == q.shape and not torch.isnan(out).any()


# ---------------------------------------------------------------- flash ops: varlen (torch's varlen_attn) and windows
def _packed(lengths_q, lengths_k, heads, heads_kv, head_dim, dtype=torch.bfloat16):
    """Fresh random packed q (total_q, heads, d), k/v (total_k, heads_kv, d) needing grads, and
    cu_seq_q/k int32 on the GPU."""
    g = torch.Generator(device="cuda")
    g.seed()
    q = torch.randn(sum(lengths_q), heads, head_dim, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(sum(lengths_k), heads_kv, head_dim, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0] + list(n), device="cuda").cumsum(0).to(torch.int32) for n in (lengths_q, lengths_k))
    return [t.requires_grad_() for t in (q, k, v)], cu_q, cu_k


def _varlen_attn_both_ways(lengths_q, lengths_k, heads, heads_kv, head_dim, causal, window=(-1, -1)):
    """varlen_attn forward + backward with cute_attn activated, and again with torch's own kernel;
    the same inputs through cute_attn.flash_attn_varlen_func. Returns (routed, torch's, cute_attn's),
    each (out, dq, dk, dv); torch's is None where its build has no window kernels."""
    (q, k, v), cu_q, cu_k = _packed(lengths_q, lengths_k, heads, heads_kv, head_dim)
    max_q, max_k = max(lengths_q), max(lengths_k)
    dout = torch.randn_like(q)

    def run(attend):
        out = attend()
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    varlen_attn = lambda: call_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, causal, window)  # noqa: E731
    torch.nn.attention.activate_flash_attention_impl(sdpa.NAME)
    try:
        routed = run(varlen_attn)
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    try:
        theirs = run(varlen_attn)
    except RuntimeError as e:  # a torch built without FlashAttention-2's local (window) kernels
        if tuple(window) == (-1, -1) or "local" not in str(e):
            raise
        theirs = None
    ours = run(lambda: cute_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                                         window_size=window))
    return routed, theirs, ours


def _check_routed(routed, theirs, ours):
    assert torch.equal(routed[0], ours[0])  # the same kernel on the same inputs
    for got, want in zip(routed[1:], ours[1:]):
        # fp32 sums (dQ, GQA's dK/dV) may land in another order: a bf16 unit in the last place
        assert torch.allclose(got, want, atol=2e-2, rtol=1e-2)
    if theirs is None:
        return
    for name, got, want in zip(("out", "dq", "dk", "dv"), routed, theirs):  # torch's FlashAttention-2
        assert not torch.isnan(got).any(), name
        assert torch.allclose(got.float(), want.float(), atol=3e-2, rtol=3e-2), \
            f"{name}: max difference {(got.float() - want.float()).abs().max().item():.3g} from torch's kernel"


@pytest.mark.parametrize("cross", [False, True], ids=["same_lengths", "k_lengths_differ"])
@pytest.mark.parametrize("heads_kv", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_torch_varlen_attn_runs_cute_attn(head_dim, causal, heads_kv, cross):
    """torch.nn.attention.varlen.varlen_attn with cute_attn activated: cute_attn's varlen kernels
    (the output bitwise that of flash_attn_varlen_func), close to torch's own FlashAttention-2;
    sequences of length 0, 1, 17, 129, 300, and key lengths other than the query lengths (causal
    bottom-right per sequence, as FlashAttention-2 aligns it)."""
    lengths_q = [0, 1, 17, 129, 300]
    lengths_k = [3, 1, 40, 129, 280] if cross else lengths_q
    _check_routed(*_varlen_attn_both_ways(lengths_q, lengths_k, 8, heads_kv, head_dim, causal))


@pytest.mark.parametrize("causal, window", [(False, (64, 0)), (False, (32, 16)), (True, (100, -1))])
def test_torch_varlen_attn_with_window_runs_cute_attn(causal, window):
    lengths = [1, 17, 129, 300]
    _check_routed(*_varlen_attn_both_ways(lengths, lengths, 8, 2, 128, causal, window))


def _op_has(name: str, argument: str) -> bool:
    return any(a.name == argument for a in getattr(torch.ops.aten, name).default._schema.arguments)


@pytest.mark.parametrize("window", [(64, 0), (32, 16), (-1, 8), (100, -1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_attention_forward_op_with_window_runs_cute_attn(activated, head_dim, window):
    """aten::_flash_attention_forward (dense, seqlen_q < seqlen_k) with window_size_left/right,
    and its autograd: cute_attn.forward/backward(window_size=...)."""
    if not _op_has("_flash_attention_forward", "window_size_left"):
        pytest.skip("this torch's _flash_attention_forward has no window")
    q, k, v = random_qkv(2, 200, 300, 8, 2, head_dim, torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(q)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, None, None, 200, 300, 0.0, False, False,
                                                           window_size_left=window[0], window_size_right=window[1])
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ours, our_lse = cute_attn.forward(q, k, v, window_size=window, return_lse=True)
    assert torch.equal(out, ours)
    assert torch.equal(lse, our_lse)
    expected = cute_attn.backward(dout, q, k, v, ours, our_lse, window_size=window)
    for got, want in zip(grads, expected):
        assert torch.allclose(got, want, atol=2e-2, rtol=1e-2)  # GQA: dK/dV summed over 4 heads


def test_varlen_attn_out_runs_cute_attn(activated):
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    if not hasattr(varlen, "varlen_attn_out"):
        pytest.skip("this torch has no varlen_attn_out")
    lengths = [1, 17, 129, 300]
    (q, k, v), cu, _ = _packed(lengths, lengths, 8, 2, 128)
    q, k, v = (t.detach() for t in (q, k, v))
    out = torch.full_like(q, float("nan"))
    kwargs = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen.varlen_attn_out).parameters else {}
    varlen.varlen_attn_out(out, q, k, v, cu, cu, 300, 300, window_size=(-1, 0), **kwargs)
    assert torch.equal(out, cute_attn.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, causal=True))


def test_declined_flash_op_calls_fall_back_to_torch(activated):
    """A varlen call with dropout (declined) runs torch's kernel: no error, dropout applied."""
    lengths = [17, 129]
    (q, k, v), cu, _ = _packed(lengths, lengths, 4, 4, 64)
    q, k, v = (t.detach() for t in (q, k, v))
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 129, 129, 0.5, True, False)[0]
    assert out.shape == q.shape and not torch.isnan(out).any()
    assert not torch.allclose(out, cute_attn.flash_attn_varlen_func(q, k, v, cu, cu, 129, 129, causal=True))

