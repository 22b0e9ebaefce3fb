"""SDPA's flash backend routed to cute_attn on the GPU (marker ``gpu``): same results as calling
cute_attn directly, forward and backward, and declined calls still served by torch's kernels.
(transformers' attn_implementation="cute_attn" on the GPU: test_transformers_gpu.py, which needs no
flash-implementation registry.)"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cute_attn
from cute_attn.integrations import sdpa
from helpers import random_qkv

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

