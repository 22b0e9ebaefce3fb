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
    assert sdpa.unsupported_reason(q, k, v, False, cum_seq_q=torch.zeros(2, dtype=torch.int32)) == \
        "cum_seq_q without cum_seq_k"
    assert sdpa.unsupported_reason(q, k, v, False, seqused_k=torch.zeros(1, dtype=torch.int32)) == "seqused_k given"
    assert sdpa.unsupported_reason(q, k, v, False, return_debug_mask=True) == "return_debug_mask given"
    assert sdpa.unsupported_reason(q, k, v, False, num_splits=4) == "num_splits given"
    assert "top-left" in sdpa.unsupported_reason(q, k[:, :5], v[:, :5], True, top_left_causal=True)
    assert "must be a positive" in sdpa.unsupported_reason(q, k, v, False, scale=-1.0)
    assert "float16 or bfloat16" in sdpa.unsupported_reason(q.float(), k.float(), v.float(), False)
    # neutral options pass; what remains is the device
    reason = sdpa.unsupported_reason(q, k, v, True, window_size_left=128, window_size_right=-1, num_splits=1,
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


# ---------------------------------------------------------------- flash ops: varlen and windows, on the CPU
def _cu(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0).to(torch.int32)


def _naive_varlen(q, k, v, lens_q, lens_k, scale, causal, window):
    """Per-sequence attention in float64 written out here (not cute_attn.reference): GQA by
    repetition, the window bottom-right aligned per sequence as FlashAttention-2 aligns it
    (causal sets its right edge to 0), rows that see no key 0."""
    left, right = window
    right = 0 if causal else right
    group = q.shape[1] // k.shape[1]
    outs, q0, k0 = [], 0, 0
    for lq, lk in zip(lens_q, lens_k):
        qs, ks, vs = q[q0:q0 + lq].double(), k[k0:k0 + lk].double(), v[k0:k0 + lk].double()
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        diag = i + lk - lq  # the key on the bottom-right diagonal of query row i
        seen = torch.ones(lq, lk, dtype=torch.bool)
        if right >= 0:
            seen &= j <= diag + right
        if left >= 0:
            seen &= j >= diag - left
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vs))
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs)


def _cpu_fakes(monkeypatch):
    """cute_attn's entry points on the CPU: the checks that need a GPU pass, the kernels are
    cute_attn.reference (float32 forward, float64 backward, per sequence when varlen). Returns the
    calls made."""
    from cute_attn import dispatch, interface
    from cute_attn.reference import attention_backward_reference, attention_reference, attention_varlen_reference

    calls = []

    def forward(q, k, v, *, causal, softmax_scale, window_size, out, return_lse):
        calls.append(("forward", causal, softmax_scale, window_size))
        if out is not None:
            interface._check_out("out", out, q)
        o, lse = attention_reference(q, k, v, causal, softmax_scale, window_size=window_size)
        return (o if out is None else out.copy_(o)), lse

    def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, softmax_scale, window_size, out, return_lse):
        calls.append(("varlen_forward", causal, softmax_scale, window_size, max_q, max_k))
        if out is not None:
            interface._check_out("out", out, q, shape=tuple(q.shape))
        o, lse = attention_varlen_reference(q, k, v, cu_q, cu_k, causal, softmax_scale, window_size=window_size)
        return (o if out is None else out.copy_(o)), lse

    def backward(dout, q, k, v, out, lse, *, causal, softmax_scale, window_size, deterministic):
        calls.append(("backward", causal, softmax_scale, window_size))
        interface._check_lse(lse, q)
        grads = attention_backward_reference(q, k, v, dout, causal, softmax_scale, window_size=window_size)
        return tuple(g.to(q.dtype) for g in grads)

    def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, causal, softmax_scale, window_size,
                        deterministic):
        calls.append(("varlen_backward", causal, softmax_scale, window_size, max_q, max_k))
        interface._check_lse(lse, q.unsqueeze(0), shape=(q.shape[1], q.shape[0]))
        grads = tuple(torch.zeros_like(t) for t in (q, k, v))
        for b in range(len(cu_q) - 1):
            rows_q, rows_k = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            if rows_q.stop > rows_q.start:
                parts = attention_backward_reference(q[None, rows_q], k[None, rows_k], v[None, rows_k],
                                                     dout[None, rows_q], causal, softmax_scale, window_size=window_size)
                for g, part, rows in zip(grads, parts, (rows_q, rows_k, rows_k)):
                    g[rows] = part[0].to(g.dtype)
        return grads

    monkeypatch.setattr(interface, "_check_cuda", lambda name, t: None)
    monkeypatch.setattr(dispatch, "plan_for_device", lambda device: None)
    for fake in (forward, varlen_forward, backward, varlen_backward):
        monkeypatch.setattr(interface, fake.__name__, fake)
    return calls


@pytest.fixture
def flash_ops_on_cpu(monkeypatch):
    """The flash ops' CPU kernels are sdpa's (torch has none): torch's own varlen_attn and the
    aten ops' autograd reach them as they reach the CUDA ones, with no fallback (a decline raises)."""
    calls = _cpu_fakes(monkeypatch)
    library = torch.library.Library("aten", "IMPL", "CPU")
    impls = {"_flash_attention_forward": sdpa._flash_forward, "_flash_attention_backward": sdpa._flash_backward,
             "_flash_attention_forward_no_dropout_inplace": sdpa._flash_forward_inplace}
    for name, impl in impls.items():
        if sdpa._has_op(name):
            library.impl(name, sdpa._with_fallback(impl, None, name), "CPU", with_keyset=True)
    yield calls
    library._destroy()


def test_unsupported_reasons_varlen_and_windows():
    q, k, v = (torch.randn(1, 17, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    on_cpu = "q must be a CUDA tensor, got a tensor on cpu"
    # windows: FlashAttention-2's (-1 or None unbounded), with or without causal; what remains is the device
    for left, right in ((128, 0), (3, 5), (-1, 7), (None, 2), (None, None)):
        for causal in (False, True):
            reason = sdpa.unsupported_reason(q, k, v, causal, window_size_left=left, window_size_right=right)
            assert reason == on_cpu, (left, right, causal)
    assert ">= -1" in sdpa.unsupported_reason(q, k, v, False, window_size_left=-2)
    # varlen: (total, heads, d) with int32 cum_seq_q/k and int max_q/max_k
    lengths = [0, 1, 9, 7]
    q3, k3, v3 = (torch.randn(sum(lengths), 4, 64, dtype=torch.bfloat16) for _ in range(3))
    k3, v3 = k3[:, :2], v3[:, :2]  # GQA
    cu = _cu(lengths)
    varlen = dict(cum_seq_q=cu, cum_seq_k=cu, max_q=9, max_k=9)
    assert sdpa.unsupported_reason(q3, k3, v3, True, **varlen, window_size_left=4, window_size_right=0) == on_cpu
    assert sdpa.unsupported_reason(q3, k3, v3, False, **varlen, seqused_k=cu[1:]) == "seqused_k given"
    assert sdpa.unsupported_reason(q3, k3, v3, False, **varlen, block_table=cu[None]) == "block_table given"
    assert sdpa.unsupported_reason(q3, k3, v3, False, **varlen, alibi_slopes=torch.ones(4)) == "alibi_slopes given"
    assert sdpa.unsupported_reason(q3, k3, v3, False, **varlen, num_splits=2) == "num_splits given"
    assert sdpa.unsupported_reason(q3, k3, v3, False, **varlen, k_cache=q3) == "k_cache given"  # unknown options
    assert sdpa.unsupported_reason(q3, k3, v3, False, **varlen, dropout_p=0.1) == "dropout"
    assert sdpa.unsupported_reason(q3, k3, v3, False, **varlen, num_splits=None, seqused_k=None) == on_cpu
    assert "without" in sdpa.unsupported_reason(q3, k3, v3, False, cum_seq_q=cu, max_q=9, max_k=9)
    assert "int32" in sdpa.unsupported_reason(q3, k3, v3, False, **{**varlen, "cum_seq_k": cu.long()})
    assert "3 dims" in sdpa.unsupported_reason(q, k, v, False, **varlen)
    assert "must be an int" in sdpa.unsupported_reason(q3, k3, v3, False, **{**varlen, "max_k": 9.0})
    assert "multiple of k/v heads" in sdpa.unsupported_reason(q3[:, :3], k3, v3, False, **varlen)


@pytest.mark.parametrize("varlen", [False, True])
def test_flash_forward_outputs_are_the_ones_torch_declares(monkeypatch, varlen):
    """The outputs of the flash forward have the shapes and dtypes of torch's meta function (the
    ones torch.compile and autograd assume): for varlen the LSE is (heads, total_q), which is also
    cute_attn's own varlen layout, so no conversion happens either way."""
    _cpu_fakes(monkeypatch)
    assert sdpa._varlen_lse_matches_torch()
    if varlen:
        lengths_q, lengths_k = [0, 3, 20, 5], [4, 3, 11, 30]
        q = torch.randn(sum(lengths_q), 4, 32, dtype=torch.bfloat16)
        k, v = (torch.randn(sum(lengths_k), 2, 32, dtype=torch.bfloat16) for _ in range(2))
        args = (q, k, v, _cu(lengths_q), _cu(lengths_k), max(lengths_q), max(lengths_k))
    else:
        q = torch.randn(2, 20, 4, 32, dtype=torch.bfloat16)
        k, v = (torch.randn(2, 30, 2, 32, dtype=torch.bfloat16) for _ in range(2))
        args = (q, k, v, None, None, 20, 30)
    options = dict(scale=0.3, window_size_left=5, window_size_right=2)
    ours = sdpa._flash_forward(*args, 0.0, True, False, **options)
    meta = [None if t is None else t.to("meta") for t in args[:5]]
    declared = torch.ops.aten._flash_attention_forward(*meta, *args[5:], 0.0, True, False, **options)
    assert len(ours) == len(declared)
    for got, want in zip(ours, declared):
        assert (tuple(got.shape), got.dtype) == (tuple(want.shape), want.dtype)
    if varlen:
        assert tuple(ours[1].shape) == (4, sum(lengths_q))


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 1)), (True, (6, -1))])
def test_torch_varlen_attn_reaches_cute_attn(flash_ops_on_cpu, causal, window):
    """torch.nn.attention.varlen.varlen_attn, forward and backward, through the aten ops onto
    cute_attn's varlen entry points (the reference standing in for the kernels): its window,
    causal flag, scale and lengths arrive, the result is attention bottom-right aligned per
    sequence (lengths of q and k differ) and the gradients are attention's."""
    from helpers import call_varlen_attn

    lengths_q, lengths_k = [0, 1, 17, 40], [3, 1, 25, 40]
    heads, heads_kv, d, scale = 4, 2, 32, 0.3
    torch.manual_seed(0)
    q = torch.randn(sum(lengths_q), heads, d, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), heads_kv, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    out = call_varlen_attn(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal, window, scale)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    kinds = [call[0] for call in flash_ops_on_cpu]
    assert kinds == ["varlen_forward", "varlen_backward"]
    expected_window = (window[0], 0) if causal else window
    for call in flash_ops_on_cpu:  # causal arrives as the flag or as the window's right edge 0
        assert call[2:] == (scale, expected_window, 40, 40)
        assert call[1] == causal or expected_window[1] == 0

    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = _naive_varlen(qd, kd, vd, lengths_q, lengths_k, scale, causal, window)
    want_grads = torch.autograd.grad(want, (qd, kd, vd), dout.double())
    assert torch.allclose(out.double(), want, atol=2e-2, rtol=2e-2)
    for got, expected in zip(grads, want_grads):
        assert torch.allclose(got.double(), expected, atol=3e-2, rtol=3e-2)
    # the test tells the mask apart: a window or causal mask dropped, or aligned top-left, differs
    if causal or window != (-1, -1):
        assert not torch.allclose(out.double(), _naive_varlen(qd, kd, vd, lengths_q, lengths_k, scale, False,
                                                              (-1, -1)), atol=5e-2)
        top_left = _naive_varlen(qd, kd, vd, lengths_q, [lq for lq in lengths_q], scale, causal, window)
        assert top_left.shape != want.shape or not torch.allclose(out.double(), top_left, atol=5e-2)


@pytest.mark.parametrize("causal, left, right", [(False, 5, 2), (True, None, None), (True, 4, -1)])
def test_windowed_flash_attention_forward_op_reaches_cute_attn(flash_ops_on_cpu, causal, left, right):
    """aten::_flash_attention_forward on dense (batch, seqlen, heads, d) tensors with a window
    and/or causal, and its autograd (aten::_flash_attention_backward): cute_attn's
    forward/backward with causal and window_size=(left, right), bottom-right aligned (seqlen_q <
    seqlen_k)."""
    torch.manual_seed(1)
    q = torch.randn(2, 24, 4, 32, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 30, 2, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, None, None, 24, 30, 0.0, causal, False,
                                                           window_size_left=left, window_size_right=right)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert [c[0] for c in flash_ops_on_cpu] == ["forward", "backward"]
    window = sdpa._window(left, right)
    assert all(c[1:] == (causal, None, window) for c in flash_ops_on_cpu)
    assert lse.shape == (2, 4, 24)

    packed = [t.detach().double().flatten(0, 1).requires_grad_() for t in (q, k, v)]
    want = _naive_varlen(*packed, [24, 24], [30, 30], 32 ** -0.5, causal, window)
    want_grads = torch.autograd.grad(want, packed, dout.double().flatten(0, 1))
    assert torch.allclose(out.double().flatten(0, 1), want, atol=2e-2, rtol=2e-2)
    for got, expected in zip(grads, want_grads):
        assert torch.allclose(got.double().flatten(0, 1), expected, atol=3e-2, rtol=3e-2)
    unwindowed = _naive_varlen(*packed, [24, 24], [30, 30], 32 ** -0.5, False, (-1, -1))
    assert not torch.allclose(out.double().flatten(0, 1), unwindowed, atol=5e-2)


def test_varlen_attn_out_reaches_cute_attn(flash_ops_on_cpu):
    """varlen_attn_out (aten::_flash_attention_forward_no_dropout_inplace, where torch has it)
    writes cute_attn's result into the given buffer."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    if not hasattr(varlen, "varlen_attn_out") or not sdpa._has_op("_flash_attention_forward_no_dropout_inplace"):
        pytest.skip("this torch has no varlen_attn_out")
    lengths = [5, 12]
    q, k, v = (torch.randn(sum(lengths), 2, 32, dtype=torch.bfloat16) for _ in range(3))
    cu = _cu(lengths)
    out = torch.full_like(q, float("nan"))
    result = varlen.varlen_attn_out(out, q, k, v, cu, cu, 12, 12, window_size=(-1, 0))
    assert result is out and [c[0] for c in flash_ops_on_cpu] == ["varlen_forward"]
    want = _naive_varlen(q, k, v, lengths, lengths, 32 ** -0.5, True, (-1, -1))
    assert torch.allclose(out.double(), want, atol=2e-2, rtol=2e-2)


def test_flash_forward_writes_a_given_out(monkeypatch):
    """An ``out=`` option (the schema of some torch versions, for varlen_attn_out) is written and
    returned, not declined."""
    calls = _cpu_fakes(monkeypatch)
    lengths = [5, 12]
    q, k, v = (torch.randn(sum(lengths), 2, 32, dtype=torch.bfloat16) for _ in range(3))
    cu = _cu(lengths)
    out = torch.full_like(q, float("nan"))
    result = sdpa._flash_forward(q, k, v, cu, cu, 12, 12, 0.0, True, False, out=out, window_size_left=-1,
                                 window_size_right=0)
    assert result[0] is out and not torch.isnan(out).any()
    assert calls == [("varlen_forward", True, None, (-1, 0), 12, 12)]


def test_flash_ops_decline_what_cute_attn_lacks(monkeypatch):
    """dropout, seqused_k, a paged cache, an LSE from another kernel's layout: _Unsupported (so
    torch's kernel runs), before anything is computed."""
    calls = _cpu_fakes(monkeypatch)
    lengths = [5, 12]
    q, k, v = (torch.randn(sum(lengths), 2, 32, dtype=torch.bfloat16) for _ in range(3))
    cu = _cu(lengths)
    args = (q, k, v, cu, cu, 12, 12)
    for extra in (dict(dropout_p=0.1), dict(seqused_k=cu[1:]), dict(block_table=cu[None]),
                  dict(return_debug_mask=True), dict(num_splits=4)):
        extra = {"dropout_p": 0.0, "return_debug_mask": False, **extra}
        dropout_p, debug = extra.pop("dropout_p"), extra.pop("return_debug_mask")
        with pytest.raises(sdpa._Unsupported):
            sdpa._flash_forward(*args, dropout_p, False, debug, **extra)
    with pytest.raises(sdpa._Unsupported, match="without"):
        sdpa._flash_forward(q, k, v, cu, None, 12, 12, 0.0, False, False)
    with pytest.raises(sdpa._Unsupported, match="lse must have shape"):  # a padded (batch, heads, max_q) LSE
        sdpa._flash_backward(q, *args[:3], q, torch.zeros(2, 2, 12), cu, cu, 12, 12, 0.0, False, None, None)
    with pytest.raises(sdpa._Unsupported, match="out must have shape"):
        sdpa._flash_forward_inplace(q[:-1], *args, 0.0, False, False)
    assert [c[0] for c in calls] == ["varlen_backward", "varlen_forward"]  # declined by cute_attn's own checks


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
