"""SDPA's flash backend routed to cute_attn on the GPU (marker ``gpu``): same results as calling
cute_attn directly, forward and backward, and declined calls still served by torch's kernels."""

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


def _tiny_llama(attn_implementation):
    transformers = pytest.importorskip("transformers")
    import cute_attn.integrations.transformers  # noqa: F401  registers "cute_attn"

    config = transformers.LlamaConfig(vocab_size=257, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation)
    return model.to(device="cuda", dtype=torch.bfloat16)


def test_transformers_llama_matches_eager():
    model, eager = _tiny_llama("cute_attn"), _tiny_llama("eager")
    ids = torch.randint(0, 257, (2, 100), device="cuda")
    logits, ref = model(ids).logits, eager(ids).logits
    assert (logits.float() - ref.float()).abs().max() < 0.05
    # a training step: the same gradients within bf16 tolerance
    for m in (model, eager):
        m(ids, labels=ids).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert torch.allclose(p.grad.float(), q.grad.float(), atol=2e-2, rtol=5e-2), name
    # greedy generation, token for token
    prompt = ids[:1, :20]
    kwargs = dict(max_new_tokens=16, do_sample=False)
    assert torch.equal(model.generate(prompt, **kwargs), eager.generate(prompt, **kwargs))
