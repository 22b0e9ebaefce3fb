"""SDPA's flash backend on cute_attn (cute_attn/integrations/sdpa.py) without a GPU: the
registration, activation and restore, which calls cute_attn declines, and the fallback (CPU)."""

import pytest
import torch
import torch.nn.functional as F

import cute_attn  # noqa: F401  registers "cute_attn"
from cute_attn.integrations import sdpa

HAS_REGISTRY = hasattr(torch.nn.attention, "register_flash_attention_impl")


@pytest.mark.skipif(not HAS_REGISTRY, reason="this torch has no flash-implementation registry")
def test_registered_and_activation_round_trip():
    attention = torch.nn.attention
    assert sdpa.NAME in attention.list_flash_attention_impls()
    q, k, v = (torch.randn(1, 2, 17, 64) for _ in range(3))
    before = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    attention.activate_flash_attention_impl(sdpa.NAME)
    try:
        assert attention.current_flash_attention_impl() == sdpa.NAME
        # CPU tensors never reach the CUDA kernels cute_attn overrides
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True), before)
    finally:
        attention.restore_flash_attention_impl()
    assert attention.current_flash_attention_impl() is None


def test_unsupported_reasons():
    q, k, v = (torch.randn(1, 17, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    assert sdpa.unsupported_reason(q, k, v, False, dropout_p=0.1) == "dropout"
    assert sdpa.unsupported_reason(q, k, v, False, cum_seq_q=torch.zeros(2, dtype=torch.int32)) == "cum_seq_q given"
    assert sdpa.unsupported_reason(q, k, v, False, window_size_left=128) == "window_size_left given"
    assert sdpa.unsupported_reason(q, k, v, False, return_debug_mask=True) == "return_debug_mask given"
    assert sdpa.unsupported_reason(q, k, v, False, num_splits=4) == "num_splits given"
    assert "top-left" in sdpa.unsupported_reason(q, k[:, :5], v[:, :5], True, top_left_causal=True)
    assert "must be a positive" in sdpa.unsupported_reason(q, k, v, False, scale=-1.0)
    assert "float16 or bfloat16" in sdpa.unsupported_reason(q.float(), k.float(), v.float(), False)
    # neutral options pass; what remains is the device
    reason = sdpa.unsupported_reason(q, k, v, True, window_size_left=-1, window_size_right=-1, num_splits=1,
                                     return_debug_mask=False, seqused_k=None)
    assert reason == "q must be a CUDA tensor, got a tensor on cpu"


def test_declined_calls_run_the_original_kernel():
    calls = []

    class Original:
        def call_boxed(self, keyset, *args, **kwargs):
            calls.append((keyset, args, kwargs))
            return "torch's result"

    def declines(*args, **kwargs):
        raise sdpa._Unsupported("dropout")

    assert sdpa._with_fallback(declines, Original(), "op")("keys", 1, 2, scale=3) == "torch's result"
    assert calls == [("keys", (1, 2), {"scale": 3})]
    assert sdpa._with_fallback(lambda *a, **k: "ours", Original(), "op")("keys", 1) == "ours"
    with pytest.raises(RuntimeError, match="dropout"):
        sdpa._with_fallback(declines, None, "op")("keys", 1)


def tiny_llama(attn_implementation):
    transformers = pytest.importorskip("transformers")
    import cute_attn.integrations.transformers  # noqa: F401  registers "cute_attn"

    config = transformers.LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation)


def test_transformers_registration_and_fallback_on_cpu():
    """On the CPU every call goes to transformers' SDPA path: same logits as "sdpa", and the
    decisions that send a call there."""
    from cute_attn.integrations import transformers as integration

    model, reference = tiny_llama("cute_attn"), tiny_llama("sdpa")
    assert model.config._attn_implementation == "cute_attn"
    ids = torch.randint(0, 97, (2, 17))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits)
    mask = torch.ones(2, 17, dtype=torch.long)
    mask[0, :5] = 0  # left padding: an explicit mask
    with torch.no_grad():
        assert torch.allclose(model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits)
    q = torch.randn(1, 4, 8, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    decide = integration.declined
    assert decide(None, q, k, torch.ones(1, 1, 8, 8, dtype=torch.bool), 0.0, {}) == "an explicit attention mask"
    assert decide(None, q, k, None, 0.1, {}) == "attention dropout"
    assert decide(None, q, k, None, 0.0, {"softcap": 30.0}) == "not a CUDA fp16/bf16 tensor"  # softcap runs
    assert decide(None, q, k, None, 0.0, {"sliding_window": 4096}) == "sliding_window"
    assert decide(None, q, k, None, 0.0, {}) == "not a CUDA fp16/bf16 tensor"
