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
