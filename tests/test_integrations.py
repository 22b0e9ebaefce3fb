"""The integrations without a GPU. SDPA's flash backend (cute_attn/integrations/sdpa.py): the
registration, activation and restore, which calls cute_attn declines, and the fallback (CPU).
transformers (cute_attn/integrations/transformers.py): the mask function, the unpadding and packing
helpers, and attention_forward end to end in fp32 on the CPU, both through its kernel path (cute_attn's
functions replaced by the float32 reference) and through its fallback, against each sequence's
attention alone and against tiny models' "eager" attention."""

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


# ---------------------------------------------------------------------------- transformers
def tiny_llama(attn_implementation):
    transformers = pytest.importorskip("transformers")
    import cute_attn.integrations.transformers  # noqa: F401  registers "cute_attn"

    config = transformers.LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation)


def test_transformers_registration_and_fallback_on_cpu():
    """On the CPU every call goes to the fallback: same logits as "sdpa", and the decisions that
    send a call there."""
    from cute_attn.integrations import transformers as integration

    model, reference = tiny_llama("cute_attn"), tiny_llama("sdpa")
    assert model.config._attn_implementation == "cute_attn"
    ids = torch.randint(0, 97, (2, 17))
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-5)
    mask = torch.ones(2, 17, dtype=torch.long)
    mask[0, :5] = 0  # left padding
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits
    assert torch.allclose(got[mask.bool()], want[mask.bool()], atol=1e-5)
    q = torch.randn(1, 4, 8, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    decide = integration.declined
    assert decide(None, q, k, torch.ones(1, 1, 8, 8, dtype=torch.bool), 0.0, {}) == "a 4D attention mask"
    assert decide(None, q, k, None, 0.1, {}) == "attention dropout"
    assert decide(None, q, k, None, 0.0, {"s_aux": torch.zeros(4)}) == "attention sinks (s_aux)"
    assert decide(None, q, k, None, 0.0, {"position_bias": torch.zeros(1)}) == "position_bias"
    assert decide(None, q, k, None, 0.0, {"cache": object()}) == "cache"
    assert decide(None, q, k, None, 0.0, {"output_attentions": True}) == "output_attentions"
    # padding masks, softcap, sliding windows and packing run; only the device declines here
    for kwargs in ({"softcap": 30.0}, {"sliding_window": 4096}, {"position_ids": torch.arange(8)[None]}):
        assert decide(None, q, k, torch.ones(1, 8, dtype=torch.bool), 0.0, kwargs) == "not a CUDA fp16/bf16 tensor"
    assert decide(None, q.float(), k.float(), None, 0.0, {}) == "not a CUDA fp16/bf16 tensor"


@pytest.fixture
def integration():
    pytest.importorskip("transformers")
    from cute_attn.integrations import transformers as integration

    return integration


@pytest.fixture
def kernels_on_cpu(integration, monkeypatch):
    """attention_forward's kernel path on the CPU: fp32 CPU tensors accepted, and cute_attn's
    flash_attn_func / flash_attn_varlen_func replaced by the float32 reference (after the argument
    checks the kernels make). Yields the list of calls made."""
    from cute_attn.reference import attention_reference, attention_varlen_reference

    calls = []

    def dense(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
        assert q.dim() == k.dim() == 4 and k.shape == v.shape and q.shape[3] == k.shape[3] and dropout_p == 0.0
        calls.append(dict(kind="dense", causal=causal, window_size=window_size, softcap=softcap))
        return attention_reference(q, k, v, causal, softmax_scale, window_size=window_size, softcap=softcap)[0]

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
               causal=False, window_size=(-1, -1), softcap=0.0):
        assert q.dim() == k.dim() == 3 and k.shape == v.shape and q.shape[2] == k.shape[2] and dropout_p == 0.0
        for cu, total, longest in ((cu_seqlens_q, q.shape[0], max_seqlen_q), (cu_seqlens_k, k.shape[0], max_seqlen_k)):
            assert cu.dtype == torch.int32 and cu.device == q.device and cu.is_contiguous()
            assert type(longest) is int and cu[0] == 0 and cu[-1] == total and (cu.diff() >= 0).all()
            assert longest == int(cu.diff().max())
        calls.append(dict(kind="varlen", causal=causal, window_size=window_size, softcap=softcap,
                          cu_seqlens_q=cu_seqlens_q.tolist(), cu_seqlens_k=cu_seqlens_k.tolist()))
        return attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale,
                                          window_size=window_size, softcap=softcap)[0]

    monkeypatch.setattr(cute_attn, "flash_attn_func", dense)
    monkeypatch.setattr(cute_attn, "flash_attn_varlen_func", varlen)
    monkeypatch.setattr(integration, "_DTYPES", (torch.float32,))
    monkeypatch.setattr(integration, "_DEVICES", ("cpu",))
    return calls


def test_unpad_and_pad_back(integration):
    mask = torch.rand(4, 11) > 0.4
    mask[0] = True
    mask[1, :4], mask[1, 4:] = False, True  # left padding
    mask[2, :7], mask[2, 7:] = True, False  # right padding
    mask[3] = False  # nothing kept
    indices, cu_seqlens, longest = integration.unpad_indices(mask.long())
    assert torch.equal(indices, torch.arange(44)[mask.reshape(-1)])
    lengths = mask.sum(1)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0] + lengths.cumsum(0).tolist()
    assert longest == int(lengths.max()) and type(longest) is int
    x = torch.randn(4, 11, 3, 8)
    rows = integration.gather_rows(x, indices)
    assert torch.equal(rows, x[mask])
    assert torch.equal(integration.pad_rows(rows, indices, 4, 11), x * mask[:, :, None, None])


@pytest.mark.parametrize("q_len", [11, 1, 4])
def test_varlen_from_mask_query_lengths(integration, q_len):
    """q_len == kv_len: the mask's rows; 1 (decoding): one query per sequence; otherwise the mask's
    last q_len columns (chunked prefill, left padding). Keys past the mask (a static cache's
    unwritten slots) are dropped."""
    batch, kv_len = 3, 11
    mask = torch.ones(batch, kv_len, dtype=torch.bool)
    mask[1, :5] = False
    mask[2, :9] = False
    q = torch.randn(batch, q_len, 4, 8)
    k, v = torch.randn(batch, kv_len + 5, 2, 8), torch.randn(batch, kv_len + 5, 2, 8)
    q2, k2, v2, indices_q, cu_q, cu_k, max_q, max_k = integration.varlen_from_mask(q, k, v, mask)
    assert torch.equal(k2, k[:, :kv_len][mask]) and torch.equal(v2, v[:, :kv_len][mask])
    assert cu_k.tolist() == [0, 11, 17, 19] and max_k == 11
    q_rows = torch.ones(batch, 1, dtype=torch.bool) if q_len == 1 else mask[:, -q_len:]
    assert torch.equal(q2, q[q_rows])
    assert cu_q.tolist() == [0] + q_rows.sum(1).cumsum(0).tolist() and max_q == int(q_rows.sum(1).max())
    assert torch.equal(integration.pad_rows(q2, indices_q, batch, q_len), q * q_rows[:, :, None, None])
    everything = integration.varlen_from_mask(q, k, v, mask, keep_all_queries=True)
    assert torch.equal(everything[0], q.reshape(-1, 4, 8)) and everything[4].tolist() == [0, q_len, 2 * q_len, 3 * q_len]


def test_packed_positions(integration):
    lengths = [5, 1, 9, 3]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    assert integration.is_packed(positions, 1, 18)
    cu_seqlens, longest = integration.varlen_from_positions(positions)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 5, 6, 15, 18] and longest == 9
    assert not integration.is_packed(torch.arange(7, 25)[None], 1, 18)  # one sequence after a cache
    assert not integration.is_packed(positions.expand(2, -1), 2, 18)  # padded batches are not packed
    assert not integration.is_packed(torch.zeros(1, 1, dtype=torch.long), 1, 1)  # decoding
    continued = torch.cat([torch.arange(3, 7), torch.arange(5)])[None]  # the first one continues a sequence
    assert integration.varlen_from_positions(continued)[0].tolist() == [0, 4, 9]
    assert integration.window_for(None, 100) == (-1, -1)
    assert integration.window_for(8, 8) == (-1, -1) and integration.window_for(8, 9) == (7, 7)


def _per_sequence_reference(q, k, v, q_rows, k_rows, causal, scale, window=(-1, -1), softcap=0.0):
    """(batch, q_len, heads, d) out: each sequence's kept queries against its kept keys through
    the float32 reference (zeros at the queries not kept)."""
    from cute_attn.reference import attention_reference

    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        if q_rows[b].any():
            out[b, q_rows[b]] = attention_reference(q[b:b + 1, q_rows[b]], k[b:b + 1, k_rows[b]], v[b:b + 1, k_rows[b]],
                                                    causal, scale, window_size=window, softcap=softcap)[0][0]
    return out


@pytest.mark.parametrize("path", ["kernel", "fallback"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_len,sliding_window,softcap", [(13, None, None), (13, 4, None), (13, 4, 3.0), (1, 4, None),
                                                          (5, 3, None), (5, None, 3.0)])
def test_attention_forward_padding_mask(integration, request, path, causal, q_len, sliding_window, softcap):
    """attention_forward with a 2D padding mask (left padding, right padding, none) against each
    sequence's attention run alone; both the kernel path and the SDPA / masked-softmax fallback."""
    if path == "kernel":
        calls = request.getfixturevalue("kernels_on_cpu")
    batch, kv_len, heads, heads_kv, d = 3, 13, 4, 2, 16
    mask = torch.ones(batch, kv_len, dtype=torch.bool)
    mask[0, :4] = False  # left padding
    if q_len == kv_len:
        mask[2, 9:] = False  # right padding (only where every query is in the mask)
    query = torch.randn(batch, heads, q_len, d)
    key, value = torch.randn(batch, heads_kv, kv_len, d), torch.randn(batch, heads_kv, kv_len, d)
    scale = 0.3
    module = torch.nn.Module()
    module.is_causal = causal
    kwargs = dict(sliding_window=sliding_window, softcap=softcap)
    out, _ = integration.attention_forward(module, query, key, value, mask, scaling=scale, **kwargs)
    window = integration.window_for(sliding_window, kv_len)
    if causal or window != (-1, -1):
        q_rows = mask[:, -q_len:] if q_len > 1 else torch.ones(batch, 1, dtype=torch.bool)
    else:
        q_rows = torch.ones(batch, q_len, dtype=torch.bool)  # non-causal: only the keys are padding
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    want = _per_sequence_reference(q, k, v, q_rows, mask, causal and q_len > 1, scale, window, softcap or 0.0)
    assert out.shape == (batch, q_len, heads, d)
    assert torch.allclose(out, want, atol=2e-5), (out - want).abs().max()
    if path == "kernel":
        assert [c["kind"] for c in calls] == ["varlen"] and calls[0]["window_size"] == window


@pytest.mark.parametrize("path", ["kernel", "fallback"])
@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens", "dense"])
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_attention_forward_packed_and_dense(integration, request, path, how, sliding_window):
    """Batch 1 packed by restarting position_ids or by cu_seq_lens kwargs: each sequence alone;
    no mask and no packing: one causal attention."""
    from cute_attn.reference import attention_reference

    if path == "kernel":
        calls = request.getfixturevalue("kernels_on_cpu")
    lengths = [6, 1, 9, 4] if how != "dense" else [20]
    total, heads, heads_kv, d = sum(lengths), 4, 1, 8
    query = torch.randn(1, heads, total, d)
    key, value = torch.randn(1, heads_kv, total, d), torch.randn(1, heads_kv, total, d)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    kwargs = dict(position_ids=positions, sliding_window=sliding_window)
    if how == "cu_seq_lens":
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
        kwargs["position_ids"] = torch.arange(total)[None]  # the kwargs alone tell the sequences apart
    out, _ = integration.attention_forward(torch.nn.Module(), query, key, value, None, **kwargs)
    window = integration.window_for(sliding_window, total)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    want = torch.cat([attention_reference(q[:, s:e], k[:, s:e], v[:, s:e], True, window_size=window)[0]
                      for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    assert torch.allclose(out, want, atol=2e-5), (out - want).abs().max()
    if path == "kernel":
        assert [c["kind"] for c in calls] == (["dense"] if how == "dense" else ["varlen"])
        if how != "dense":
            assert calls[0]["cu_seqlens_q"] == cu.tolist() == calls[0]["cu_seqlens_k"]


@pytest.mark.parametrize("path", ["kernel", "fallback"])
def test_attention_forward_decoding_without_mask(integration, request, path):
    """No mask, more keys than queries (a cache): queries at the last positions (bottom-right),
    one query: every key; a window counts back from the query's own position."""
    from cute_attn.reference import attention_reference

    if path == "kernel":
        request.getfixturevalue("kernels_on_cpu")
    for q_len, sliding_window in ((1, None), (1, 5), (4, None), (4, 5)):
        query, key, value = torch.randn(2, 4, q_len, 8), torch.randn(2, 4, 12, 8), torch.randn(2, 4, 12, 8)
        out, _ = integration.attention_forward(torch.nn.Module(), query, key, value, None, sliding_window=sliding_window)
        window = integration.window_for(sliding_window, 12)
        want = attention_reference(*(t.transpose(1, 2) for t in (query, key, value)), q_len > 1, window_size=window)[0]
        assert torch.allclose(out, want, atol=2e-5), (q_len, sliding_window)


def test_fallback_mask_against_sdpa_math(integration):
    """The 4D mask the fallback builds, by hand: causal + padding + window, queries at the last
    q_len of kv_len; SDPA over it against a hand-written masked softmax."""
    batch, q_len, kv_len = 2, 3, 7
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    q, k = torch.randn(batch, 4, q_len, 8), torch.randn(batch, 4, kv_len, 8)
    built, used = integration.fallback_mask(q, k, mask, True, (2, 2), {})
    assert used == kv_len and built.shape == (batch, 1, q_len, kv_len)
    want = torch.zeros(batch, q_len, kv_len, dtype=torch.bool)
    for b in range(batch):
        for i in range(q_len):
            position = kv_len - q_len + i
            for j in range(kv_len):
                want[b, i, j] = bool(mask[b, j]) and position - 2 <= j <= position and bool(mask[b, position])
    assert torch.equal(built[:, 0], want)
    v = torch.randn(batch, 4, kv_len, 8)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=built)
    scores = (q @ k.transpose(2, 3) / 8 ** 0.5).masked_fill(~built, float("-inf"))
    assert torch.allclose(got, scores.softmax(-1) @ v, atol=1e-5)
    # no mask: SDPA's is_causal where it agrees, an explicit bottom-right mask where it would not
    assert integration.fallback_mask(q, torch.randn(batch, 4, q_len, 8), None, True, (-1, -1), {})[0] is None
    bottom_right = integration.fallback_mask(q, k, None, True, (-1, -1), {})[0]
    assert torch.equal(bottom_right[0, 0], torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len))
    # a static cache's unwritten slots: the mask is shorter than the keys, which are cut to it
    assert integration.fallback_mask(q, torch.randn(batch, 4, 20, 8), mask, True, (-1, -1), {})[1] == kv_len


def test_masked_softmax_with_sinks_and_softcap(integration):
    query, key, value = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    sinks = torch.randn(4)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    out, probs = integration.masked_softmax_attention(None, query, key, value, causal[None, None], 0.0, 0.5, 2.0,
                                                      sinks)
    k, v = key.repeat_interleave(2, 1), value.repeat_interleave(2, 1)
    scores = (2.0 * torch.tanh(query @ k.transpose(2, 3) * 0.5 / 2.0)).masked_fill(~causal, float("-inf"))
    exp = (scores - scores.amax(-1, keepdim=True)).exp()
    sink = (sinks[None, :, None] - scores.amax(-1)).exp()
    want = exp / (exp.sum(-1) + sink)[..., None]
    assert torch.allclose(probs, want, atol=1e-6)
    assert torch.allclose(out, (want @ v).transpose(1, 2), atol=1e-6)


def test_mask_function(integration):
    """padding_mask: None without padding, the 2D mask with, all ones over a static cache's written
    slots, SDPA's 4D mask for patterns the flash path cannot express."""
    from transformers import masking_utils as mu

    ones = torch.ones(2, 9, dtype=torch.bool)
    assert integration.padding_mask(2, 9, 9, attention_mask=ones) is None
    assert integration.padding_mask(2, 9, 9, attention_mask=None) is None
    padded = ones.clone()
    padded[0, :3] = False
    assert torch.equal(integration.padding_mask(2, 9, 9, attention_mask=padded), padded)
    # a sliding-window cache's keys: the mask's last kv_length columns
    assert integration.padding_mask(2, 1, 5, attention_mask=padded) is None  # the padding fell out of them
    padded[1, 6] = False
    assert torch.equal(integration.padding_mask(2, 1, 5, attention_mask=padded), padded[:, -5:])
    static = integration.padding_mask(2, 1, 32, q_offset=torch.tensor(8), attention_mask=None)
    assert static.shape == (2, 9) and static.all()
    assert integration.padding_mask(2, 3, 32, mask_function=mu.bidirectional_mask_function) is None  # cross attn
    positions, sequences = torch.zeros(1, 9, dtype=int), torch.zeros(1, 9, dtype=int)
    if hasattr(mu, "packed_sequence_compatibility_function"):
        packed = mu.packed_sequence_compatibility_function(mu.causal_mask_function, positions, sequences)
    else:  # transformers releases whose create_causal_mask composes the packing parts itself
        packed = mu.and_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, positions),
                              mu.packed_sequence_mask_function(sequences))
    for pattern in (mu.causal_mask_function, mu.sliding_window_causal_mask_function(4), packed):
        assert integration.pattern_parts(pattern) is not None
    chunked = mu.chunked_causal_mask_function(4, torch.zeros(2, dtype=int))
    overlay = mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function)
    for pattern in (chunked, overlay, mu.sliding_window_bidirectional_mask_function(3)):
        assert integration.pattern_parts(pattern) is None
        four_d = integration.padding_mask(2, 9, 9, mask_function=pattern, attention_mask=padded)
        want = mu.sdpa_mask(2, 9, 9, mask_function=pattern, attention_mask=padded, allow_is_causal_skip=False)
        assert four_d.shape == (2, 1, 9, 9) and torch.equal(four_d, want)


def _tiny(kind, attn_implementation):
    transformers = pytest.importorskip("transformers")
    import cute_attn.integrations.transformers  # noqa: F401  registers "cute_attn"

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    if kind == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif kind == "mistral":
        config, cls = transformers.MistralConfig(sliding_window=5, **common), transformers.MistralForCausalLM
    else:
        config = transformers.Gemma2Config(sliding_window=5, attn_logit_softcapping=3.0, query_pre_attn_scalar=16,
                                           **common)
        cls = transformers.Gemma2ForCausalLM
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation=attn_implementation).eval()


@pytest.mark.parametrize("path", ["kernel", "fallback"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_models_match_eager_on_cpu(request, path, kind):
    """Tiny Llama, Mistral (sliding window) and Gemma 2 (softcap, sliding layers) in fp32 on the
    CPU, "cute_attn" against "eager": a left- and right-padded batch at its tokens, no padding,
    greedy generation from a left-padded batch (dynamic and static cache)."""
    if path == "kernel":
        calls = request.getfixturevalue("kernels_on_cpu")
    model, eager = _tiny(kind, "cute_attn"), _tiny(kind, "eager")
    ids = torch.randint(0, 97, (3, 14))
    mask = torch.ones(3, 14, dtype=torch.long)
    mask[0, :6] = 0
    mask[2, 9:] = 0
    with torch.no_grad():
        got, want = model(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
        assert torch.allclose(got[mask.bool()], want[mask.bool()], atol=1e-4), (got - want)[mask.bool()].abs().max()
        assert torch.allclose(model(ids).logits, eager(ids).logits, atol=1e-4)
        left = torch.ones(2, 14, dtype=torch.long)
        left[0, :6] = 0
        for cache in (None, "static"):  # a static cache without padding: generate drops the mask
            for attention_mask in (left, torch.ones_like(left)):
                options = dict(attention_mask=attention_mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                               cache_implementation=cache)
                assert torch.equal(model.generate(ids[:2], **options), eager.generate(ids[:2], **options)), cache
    if path == "kernel":
        assert {c["kind"] for c in calls} == {"dense", "varlen"}
        if kind != "llama":
            assert any(c["window_size"] == (4, 4) for c in calls)
        if kind == "gemma2":
            assert {c["softcap"] for c in calls} == {3.0}


@pytest.mark.parametrize("path", ["kernel", "fallback"])
def test_packed_llama_on_cpu(request, path):
    """Padding-free packing: 3 sequences in batch 1 with restarting position_ids, and the same from
    DataCollatorWithFlattening's cu_seq_lens kwargs: logits equal each sequence alone, gradients
    equal eager's on the same packed batch (which masks it block-diagonally)."""
    from transformers import DataCollatorWithFlattening

    if path == "kernel":
        calls = request.getfixturevalue("kernels_on_cpu")
    model, eager = tiny_llama("cute_attn"), tiny_llama("eager")
    sequences = [torch.randint(0, 97, (n,)) for n in (7, 12, 5)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s.tolist()} for s in sequences])
    with torch.no_grad():
        alone = torch.cat([eager(s[None]).logits for s in sequences], dim=1)
        by_positions = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        assert torch.allclose(by_positions, alone, atol=1e-4)
        flash_kwargs = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
        by_kwargs = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, **flash_kwargs).logits
        assert torch.allclose(by_kwargs, alone, atol=1e-4)
    for m in (model, eager):
        m(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"], use_cache=False).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    if path == "kernel":
        assert {c["kind"] for c in calls} == {"varlen"} and calls[0]["cu_seqlens_q"] == [0, 7, 19, 24]


@pytest.mark.parametrize("path", ["kernel", "fallback"])
def test_value_head_dim_below_query_head_dim(integration, request, path):
    """MLA-style V narrower than Q/K: V padded up for the kernels (which take one head dim), the
    output cropped back."""
    from cute_attn.reference import attention_reference

    if path == "kernel":
        request.getfixturevalue("kernels_on_cpu")
    query, key, value = torch.randn(2, 4, 9, 16), torch.randn(2, 4, 9, 16), torch.randn(2, 4, 9, 8)
    out, _ = integration.attention_forward(torch.nn.Module(), query, key, value, None, scaling=0.2)
    want = attention_reference(*(t.transpose(1, 2) for t in (query, key, value)), True, 0.2)[0]
    assert out.shape == (2, 9, 4, 8) and torch.allclose(out, want, atol=2e-5)


def test_declined_calls_keep_their_semantics(integration, kernels_on_cpu):
    """Even where the kernels would run: a model's own 4D mask goes to SDPA as it is, sinks and
    output_attentions through the masked softmax (probabilities returned), dropout to SDPA's."""
    query, key, value = torch.randn(2, 4, 9, 16), torch.randn(2, 4, 9, 16), torch.randn(2, 4, 9, 16)
    four_d = torch.rand(2, 1, 9, 9) > 0.5
    four_d |= torch.eye(9, dtype=torch.bool)
    module = torch.nn.Module()
    out, _ = integration.attention_forward(module, query, key, value, four_d, scaling=0.3)
    want = F.scaled_dot_product_attention(query, key, value, attn_mask=four_d, scale=0.3).transpose(1, 2)
    assert torch.allclose(out, want, atol=1e-5)
    out, probs = integration.attention_forward(module, query, key, value, None, scaling=0.3, output_attentions=True)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=0.3).transpose(1, 2)
    assert probs.shape == (2, 4, 9, 9) and torch.allclose(out, want, atol=1e-5)
    sinks = torch.full((4,), -1e4)  # sinks that take nothing: plain causal attention
    out, _ = integration.attention_forward(module, query, key, value, None, scaling=0.3, s_aux=sinks)
    assert torch.allclose(out, want, atol=1e-5)
    module.train()
    out, _ = integration.attention_forward(module, query, key, value, None, dropout=0.5, scaling=0.3)
    assert out.shape == (2, 9, 4, 16) and not torch.allclose(out, want, atol=1e-3)
    assert kernels_on_cpu == []
