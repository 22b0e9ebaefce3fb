"""transformers' attn_implementation="cute_attn" on the GPU (marker ``gpu``): tiny random models
built from configs in code (no downloads), bf16, against attn_implementation="eager": plain,
padded (left and right) and padding-free packed batches, a training step, greedy generation, a
sliding window (Mistral) and softcap with sliding layers (Gemma 2). Each test also checks that
cute_attn's kernels served every attention call (no fallback)."""

import pytest
import torch

import cute_attn

transformers = pytest.importorskip("transformers")
from cute_attn.integrations import transformers as integration  # noqa: E402  registers "cute_attn"

pytestmark = pytest.mark.gpu

LOGITS_ATOL = 0.05
VOCAB = 257


def _tiny(kind, attn_implementation):
    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    if kind == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif kind == "mistral":  # every layer windowed (the eager mask applies it too)
        config, cls = transformers.MistralConfig(sliding_window=16, **common), transformers.MistralForCausalLM
    elif kind == "gemma2":  # alternating sliding / full layers, a softcap that bites on these small scores
        config = transformers.Gemma2Config(sliding_window=16, attn_logit_softcapping=1.0, query_pre_attn_scalar=64,
                                           **common)
        cls = transformers.Gemma2ForCausalLM
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation=attn_implementation)
    return model.to(device="cuda", dtype=torch.bfloat16)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The calls attention_forward makes to cute_attn (name, window_size, softcap); fails the test
    if any call is declined (sent to the fallback)."""
    calls, reasons = [], []
    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        def spy(*args, _original=getattr(cute_attn, name), _name=name, **kwargs):
            calls.append((_name, kwargs.get("window_size"), kwargs.get("softcap")))
            return _original(*args, **kwargs)
        monkeypatch.setattr(cute_attn, name, spy)

    def declined(*args, _original=integration.declined, **kwargs):
        reason = _original(*args, **kwargs)
        if reason is not None:
            reasons.append(reason)
        return reason

    monkeypatch.setattr(integration, "declined", declined)
    yield calls
    assert not reasons, f"calls declined: {sorted(set(reasons))}"


def _padded_batch(lengths, total, left: bool):
    ids = torch.randint(1, VOCAB, (len(lengths), total), device="cuda")
    mask = torch.zeros(len(lengths), total, dtype=torch.long, device="cuda")
    for row, n in enumerate(lengths):
        if left:
            mask[row, total - n:] = 1
        else:
            mask[row, :n] = 1
    return ids, mask


def _assert_logits_close(model, eager, ids, mask=None):
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask).logits.float(), eager(ids, attention_mask=mask).logits.float()
    if mask is not None:  # the padded positions' outputs are not compared
        got, want = got[mask.bool()], want[mask.bool()]
    err = (got - want).abs().max().item()
    assert err < LOGITS_ATOL, err


def _assert_same_greedy(model, eager, ids, mask, new_tokens=12):
    """Greedy generation token for token; where the two differ, eager's own logits at that step
    must show a near tie (the two tokens within bf16 noise), or the test fails."""
    options = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got, want = model.generate(ids, **options), eager.generate(ids, **options)
        if torch.equal(got, want):
            return
        for row in range(ids.shape[0]):
            differ = (got[row] != want[row]).nonzero()
            if not len(differ):
                continue
            step = int(differ[0])
            prefix = want[row:row + 1, :step]
            prefix_mask = torch.cat([mask[row:row + 1], mask.new_ones(1, step - ids.shape[1])], dim=1)
            logits = eager(prefix, attention_mask=prefix_mask).logits[0, -1].float()
            gap = (logits[want[row, step]] - logits[got[row, step]]).item()
            assert gap < 0.05, f"row {row}, token {step}: cute_attn {got[row, step]}, eager {want[row, step]}, gap {gap}"


def test_llama_matches_eager(kernel_calls):
    model, eager = _tiny("llama", "cute_attn"), _tiny("llama", "eager")
    ids = torch.randint(0, VOCAB, (2, 100), device="cuda")
    _assert_logits_close(model, eager, ids)
    # a training step: the same gradients within bf16 tolerance
    for m in (model, eager):
        m(ids, labels=ids).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert torch.allclose(p.grad.float(), q.grad.float(), atol=2e-2, rtol=5e-2), name
    prompt = ids[:1, :20]
    _assert_same_greedy(model, eager, prompt, torch.ones_like(prompt))
    assert {name for name, *_ in kernel_calls} == {"flash_attn_func"}


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_llama_padded_batch(kernel_calls, left):
    """Sequences of 100, 61 and 83 tokens in one padded batch: logits at the tokens as eager's;
    with left padding, greedy generation as eager's (prefill and decoding through the varlen path)."""
    model, eager = _tiny("llama", "cute_attn"), _tiny("llama", "eager")
    ids, mask = _padded_batch([100, 61, 83], 100, left)
    _assert_logits_close(model, eager, ids, mask)
    if left:
        _assert_same_greedy(model, eager, ids, mask)
    assert {name for name, *_ in kernel_calls} == {"flash_attn_varlen_func"}


def test_llama_packed_batch(kernel_calls):
    """Padding-free packing: 37, 100 and 64 tokens in batch 1, position_ids restarting at 0 (and
    the same with DataCollatorWithFlattening's cu_seq_lens kwargs): logits as each sequence run alone
    through eager; a training step's gradients as eager's summed over the sequences run alone."""
    model, eager = _tiny("llama", "cute_attn"), _tiny("llama", "eager")
    sequences = [torch.randint(0, VOCAB, (n,)) for n in (37, 100, 64)]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v
             for k, v in collate([{"input_ids": s.tolist()} for s in sequences]).items()}
    ids, positions = batch["input_ids"], batch["position_ids"]
    flash_kwargs = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    with torch.no_grad():
        alone = torch.cat([eager(s[None].cuda()).logits for s in sequences], dim=1).float()
        for kwargs in ({}, flash_kwargs):
            packed = model(ids, position_ids=positions, use_cache=False, **kwargs).logits.float()
            err = (packed - alone).abs().max().item()
            assert err < LOGITS_ATOL, (sorted(kwargs), err)
    # the packed loss is the token-weighted mean of the sequences' own (each sequence's first
    # label is -100, so no token predicts across a boundary)
    model(ids, position_ids=positions, labels=batch["labels"], use_cache=False).loss.backward()
    counts = [len(s) - 1 for s in sequences]
    for s, n in zip(sequences, counts):
        s = s[None].cuda()
        (eager(s, labels=s).loss * n / sum(counts)).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert torch.allclose(p.grad.float(), q.grad.float(), atol=2e-2, rtol=5e-2), name
    assert {name for name, *_ in kernel_calls} == {"flash_attn_varlen_func"}


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_sliding_window_and_softcap_models(kernel_calls, kind):
    """A window of 16 over sequences of up to 100 tokens (Mistral: every layer; Gemma 2: every other
    layer, with a softcap of 1.0): logits as eager's without padding and in a left-padded batch, and
    greedy generation past the window."""
    model, eager = _tiny(kind, "cute_attn"), _tiny(kind, "eager")
    _assert_logits_close(model, eager, torch.randint(0, VOCAB, (2, 100), device="cuda"))
    ids, mask = _padded_batch([100, 45], 100, left=True)
    _assert_logits_close(model, eager, ids, mask)
    ids, mask = _padded_batch([40, 25], 40, left=True)
    _assert_same_greedy(model, eager, ids, mask)
    assert (15, 15) in {window for _, window, _ in kernel_calls}
    if kind == "gemma2":
        assert {softcap for *_, softcap in kernel_calls} == {1.0}
