"""Bad input raises a ValueError/TypeError naming the argument, before anything is launched (CPU).

The CUDA-device check comes last, so every other error can be exercised with CPU tensors here."""

import pytest
import torch

import cute_attn


def qkv(batch=2, seqlen_q=16, seqlen_k=16, heads=4, heads_kv=4, d=64, dtype=torch.bfloat16, device="cpu"):
    q = torch.randn(batch, seqlen_q, heads, d, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, heads_kv, d, dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, heads_kv, d, dtype=dtype, device=device)
    return q, k, v


def raises(exc, match, *args, **kwargs):
    with pytest.raises(exc, match=match):
        cute_attn.forward(*args, **kwargs)


def test_valid_cpu_input_reaches_only_the_device_check():
    raises(ValueError, "q must be a CUDA tensor", *qkv())


def test_not_a_tensor():
    q, k, v = qkv()
    raises(TypeError, "k must be a torch.Tensor", q, k.tolist(), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_unsupported_dtype(dtype):
    q, k, v = qkv()
    raises(TypeError, "q must be float16 or bfloat16", q.to(dtype), k, v)


def test_mixed_dtypes():
    q, k, v = qkv()
    raises(TypeError, "one dtype", q, k.half(), v)


def test_wrong_rank():
    q, k, v = qkv()
    raises(ValueError, "v must have 4 dims", q, k, v[0])


def test_mismatched_batch():
    q, k, v = qkv()
    raises(ValueError, "batch", q, k[:1], v[:1])


def test_mismatched_head_dim():
    q, _, _ = qkv()
    _, k, v = qkv(d=32)
    raises(ValueError, "head_dim", q, k, v)


def test_k_v_shapes_differ():
    q, k, v = qkv()
    raises(ValueError, "k and v must have the same shape", q, k, v[:, :8])


def test_heads_not_a_multiple():
    q, k, v = qkv(heads=6, heads_kv=4)
    raises(ValueError, "multiple of k/v heads", q, k, v)


@pytest.mark.parametrize("d", [264, 12, 100, 0])
def test_bad_head_dim(d):
    q, k, v = qkv(d=d)
    raises(ValueError, "head_dim must be a multiple of 8", q, k, v)
    # the FA2 entry points validate their options first: a zero head dim was a ZeroDivisionError
    # there (found by random malformed calls on the CPU machine)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        cute_attn.flash_attn_func(q, k, v)
    cu = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8"):
        cute_attn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 16, 16)


def test_last_dim_not_contiguous():
    q, k, v = qkv()
    raises(ValueError, "q must be contiguous in its last dim", q.transpose(1, 3).contiguous().transpose(1, 3), k, v)


def test_misaligned_pointer():
    q, k, v = qkv()
    flat = torch.empty(q.numel() + 1, dtype=q.dtype)[1:]
    raises(ValueError, "k's data pointer must be 16-byte aligned", q, flat.view(q.shape), v)


def test_misaligned_stride():
    q, k, v = qkv(d=64)
    wide = torch.randn(2, 16, 4, 68, dtype=q.dtype)[..., :64]
    raises(ValueError, "v's strides", q, k, wide)


def test_different_devices():
    q, k, v = qkv()
    raises(ValueError, "one device", q, k.to("meta"), v)


def test_bad_softmax_scale():
    q, k, v = qkv()
    raises(TypeError, "softmax_scale", q, k, v, softmax_scale="0.1")
    raises(ValueError, "softmax_scale", q, k, v, softmax_scale=float("nan"))


def test_bad_causal():
    q, k, v = qkv()
    raises(TypeError, "causal must be a bool", q, k, v, causal=1)


def test_bad_out():
    q, k, v = qkv()
    raises(ValueError, "out must have shape", q, k, v, out=torch.empty(2, 16, 4, 32, dtype=q.dtype))
    raises(TypeError, "out must have dtype", q, k, v, out=torch.empty(q.shape, dtype=torch.float16))
    raises(ValueError, "out must be on", q, k, v, out=torch.empty(q.shape, dtype=q.dtype, device="meta"))
    raises(TypeError, "out must be a torch.Tensor", q, k, v, out=[1])


def bwd_args(**overrides):
    q, k, v = qkv()
    args = dict(dout=torch.randn_like(q), q=q, k=k, v=v, out=torch.randn_like(q),
                lse=torch.randn(q.shape[0], q.shape[2], q.shape[1]))
    args.update(overrides)
    return args


def bwd_raises(exc, match, **overrides):
    a = bwd_args(**overrides)
    with pytest.raises(exc, match=match):
        cute_attn.backward(a.pop("dout"), a.pop("q"), a.pop("k"), a.pop("v"), a.pop("out"), a.pop("lse"), **a)


def test_backward_valid_cpu_input_reaches_only_the_device_check():
    bwd_raises(ValueError, "q must be a CUDA tensor")


def test_backward_bad_dout_out_lse():
    q, _, _ = qkv()
    bwd_raises(ValueError, "dout must have shape", dout=torch.randn(2, 16, 4, 32, dtype=q.dtype))
    bwd_raises(TypeError, "dout must have dtype", dout=torch.randn(q.shape, dtype=torch.float16))
    bwd_raises(ValueError, "dout's strides", dout=torch.randn(2, 16, 4, 68, dtype=q.dtype)[..., :64])
    bwd_raises(ValueError, "out must have shape", out=torch.randn(2, 15, 4, 64, dtype=q.dtype))
    bwd_raises(TypeError, "lse must be float32", lse=torch.randn(2, 4, 16, dtype=torch.float16))
    bwd_raises(ValueError, "lse must have shape", lse=torch.randn(2, 16, 4))
    bwd_raises(TypeError, "deterministic must be a bool", deterministic="yes")
    bwd_raises(ValueError, "dk must have shape", dk=torch.empty(2, 16, 2, 64, dtype=q.dtype))


def test_flash_attn_func_validates():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        cute_attn.flash_attn_func(q, k[:, :, :3], v[:, :, :3])


def test_repeated_calls_skip_only_what_cannot_change(monkeypatch):
    """forward's fast path: a call like an earlier valid one reuses its launch, but a misaligned
    pointer, another option type or other strides still meet the checks."""
    from cute_attn import interface

    launched = []
    monkeypatch.setattr(interface, "_check_cuda", lambda name, t: None)
    monkeypatch.setattr(interface, "_forward_launcher", lambda *a, **kw: lambda *args: launched.append(args))
    monkeypatch.setattr(interface, "_FORWARD_LAUNCHES", {})
    q, k, v = qkv()
    cute_attn.forward(q, k, v, causal=True)
    cute_attn.forward(*qkv(), causal=True)  # new tensors, same signature: the stored launch
    assert len(launched) == 2 and len(interface._FORWARD_LAUNCHES) == 1
    raises(TypeError, "causal must be a bool", q, k, v, causal=1)
    storage = torch.randn(2 * 16 * 4 * 64 + 1, dtype=q.dtype)
    shifted = storage[1:].view(q.shape)  # same shape and strides, pointer off by 2 bytes
    raises(ValueError, "q's data pointer must be 16-byte aligned", shifted, k, v, causal=True)
    raises(ValueError, "strides", torch.randn(2, 16, 4, 68, dtype=q.dtype)[..., :64], k, v, causal=True)
    assert len(launched) == 2
    # the kernel family asked for is part of the signature: force_arch picks its own launch
    builds = []
    monkeypatch.setattr(interface, "_forward_launcher",
                        lambda *a, **kw: builds.append(interface.dispatch.requested_kernel()) or (lambda *args: None))
    for arch in ("sm80", "sm90", "sm80", None):
        with cute_attn.force_arch(arch):
            cute_attn.forward(q, k, v, causal=True)
    assert builds == ["sm80", "sm90"] and len(interface._FORWARD_LAUNCHES) == 3


def test_repeated_backward_calls_skip_only_what_cannot_change(monkeypatch):
    from cute_attn import interface

    launched = []
    monkeypatch.setattr(interface, "_check_cuda", lambda name, t: None)
    monkeypatch.setattr(interface, "_backward_launcher", lambda *a, **kw: lambda *args: launched.append(args))
    monkeypatch.setattr(interface, "_BACKWARD_LAUNCHES", {})

    def call(**overrides):
        a = bwd_args(**overrides)
        return cute_attn.backward(a.pop("dout"), a.pop("q"), a.pop("k"), a.pop("v"), a.pop("out"), a.pop("lse"), **a)

    dq, dk, dv = call(causal=True)
    call(causal=True)  # the stored launch, fresh gradient buffers
    assert len(launched) == 2 and len(interface._BACKWARD_LAUNCHES) == 1
    assert launched[1][6] is not dq and launched[1][6].shape == dq.shape
    bwd_raises(TypeError, "deterministic must be a bool", causal=True, deterministic=0)
    bwd_raises(TypeError, "lse must be float32", causal=True, lse=torch.randn(2, 4, 16, dtype=torch.float16))
    q = bwd_args()["q"]
    call(causal=True, dk=torch.empty(2, 16, 4, 64, dtype=q.dtype))  # dk given: another signature
    assert len(interface._BACKWARD_LAUNCHES) == 2
    bwd_raises(ValueError, "dk must have shape", causal=True, dk=torch.empty(2, 16, 2, 64, dtype=q.dtype))
    assert len(launched) == 3


# ---------------------------------------------------------------------------- window, softcap, ALiBi
def test_bad_window_size():
    q, k, v = qkv()
    raises(TypeError, "window_size must be a pair of ints", q, k, v, window_size=5)
    raises(TypeError, "window_size must be a pair of ints", q, k, v, window_size=(1, 2, 3))
    raises(TypeError, "window_size must be a pair of ints", q, k, v, window_size=(1.0, 2))
    raises(TypeError, "window_size must be a pair of ints", q, k, v, window_size=(True, 2))
    raises(ValueError, "window_size entries must be >= -1", q, k, v, window_size=(-2, 0))
    raises(ValueError, "q must be a CUDA tensor", q, k, v, window_size=[4, -1])  # a list is a pair too


def test_bad_softcap():
    q, k, v = qkv()
    raises(TypeError, "softcap must be a float", q, k, v, softcap="30")
    raises(TypeError, "softcap must be a float", q, k, v, softcap=True)
    raises(ValueError, "softcap must be a finite number >= 0", q, k, v, softcap=-1.0)
    raises(ValueError, "softcap must be a finite number >= 0", q, k, v, softcap=float("inf"))


def test_bad_alibi_slopes():
    q, k, v = qkv(batch=2, heads=4)
    raises(TypeError, "alibi_slopes must be a torch.Tensor", q, k, v, alibi_slopes=[0.1] * 4)
    raises(TypeError, "alibi_slopes must be float32", q, k, v, alibi_slopes=torch.ones(4, dtype=torch.float16))
    raises(ValueError, r"alibi_slopes must have shape \(4,\) or \(2, 4\)", q, k, v, alibi_slopes=torch.ones(3))
    raises(ValueError, r"alibi_slopes must have shape", q, k, v, alibi_slopes=torch.ones(3, 4))
    raises(ValueError, "alibi_slopes must be on", q, k, v, alibi_slopes=torch.ones(4, device="meta"))
    raises(ValueError, "q must be a CUDA tensor", q, k, v, alibi_slopes=torch.ones(2, 4))


def test_backward_checks_the_new_options():
    bwd_raises(ValueError, "window_size entries", window_size=(3, -5))
    bwd_raises(ValueError, "softcap must be", softcap=-2.0)
    bwd_raises(ValueError, "alibi_slopes must have shape", alibi_slopes=torch.ones(5))


@pytest.mark.parametrize("causal,window,kernel_causal,local,edges", [
    (False, (-1, -1), False, False, (0, 0)),
    (True, (-1, -1), True, False, (0, 0)),
    (False, (-1, 0), True, False, (0, 0)),  # FlashAttention-2: a window (-1, 0) is causal attention
    (True, (-1, 7), True, False, (0, 0)),  # causal sets the right edge to 0
    (True, (128, -1), False, True, (128, 0)),  # causal with a left window: the local kernel
    (False, (5, -1), False, True, (5, 2**30)),
    (False, (-1, 3), False, True, (2**30, 3)),
    (False, (0, 0), False, True, (0, 0)),
])
def test_window_maps_onto_kernels(causal, window, kernel_causal, local, edges):
    from cute_attn.interface import _score_options

    opts = _score_options(causal, None, 64, window)
    assert (opts.causal, opts.features.local, (opts.window_left, opts.window_right)) == (kernel_causal, local, edges)


def test_softcap_moves_the_softmax_scale_into_the_cap():
    import math

    from cute_attn.interface import _score_options

    opts = _score_options(False, 0.125, 64, softcap=30.0)
    assert opts.features.softcap and math.isclose(opts.scale_log2, 30.0 * math.log2(math.e))
    assert math.isclose(opts.softcap_scale, 0.125 / 30.0) and opts.scale == 0.125
    assert not _score_options(False, 0.125, 64, softcap=0.0).features.softcap


def test_flash_attn_func_fa2_positional_order_and_dropout():
    q, k, v = qkv()
    # (q, k, v, dropout_p, softmax_scale, causal) as FlashAttention-2 takes them
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        cute_attn.flash_attn_func(q, k, v, 0.0, 0.1, True)
    with pytest.raises(NotImplementedError, match="dropout"):
        cute_attn.flash_attn_func(q, k, v, 0.1)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cute_attn.flash_attn_func(q, k, v, 0.0, None, 1)
    with pytest.raises(TypeError, match="return_attn_probs must be a bool"):
        cute_attn.flash_attn_func(q, k, v, return_attn_probs=1)
    with pytest.raises(ValueError, match="window_size entries"):
        cute_attn.flash_attn_func(q, k, v, window_size=(-3, 0))


# ---------------------------------------------------------------------------- varlen
def varlen_args(lengths_q=(5, 0, 11), lengths_k=(7, 3, 11), heads=4, heads_kv=2, d=64, **overrides):
    cu_q = torch.tensor([0, *lengths_q]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lengths_k]).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lengths_q), heads, d, dtype=torch.bfloat16)
    k = torch.randn(sum(lengths_k), heads_kv, d, dtype=torch.bfloat16)
    args = dict(q=q, k=k, v=torch.randn_like(k), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    args.update(overrides)
    return args


def varlen_raises(exc, match, **overrides):
    a = varlen_args(**{k: overrides.pop(k) for k in ("lengths_q", "lengths_k") if k in overrides})
    a.update(overrides)
    positional = [a.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    with pytest.raises(exc, match=match):
        cute_attn.varlen_forward(*positional, **a)


def test_varlen_valid_cpu_input_reaches_only_the_device_check():
    varlen_raises(ValueError, "q must be a CUDA tensor")


def test_varlen_bad_inputs():
    a = varlen_args()
    varlen_raises(ValueError, "q must have 3 dims", q=a["q"][None])
    varlen_raises(TypeError, "k must be a torch.Tensor", k=None)  # was an AttributeError (random malformed calls)
    varlen_raises(TypeError, "cu_seqlens_q must be int32", cu_seqlens_q=a["cu_seqlens_q"].long())
    varlen_raises(TypeError, "cu_seqlens_k must be a torch.Tensor", cu_seqlens_k=[0, 7, 10, 21])
    varlen_raises(ValueError, r"cu_seqlens_k must have shape \(batch \+ 1,\)", cu_seqlens_k=a["cu_seqlens_k"][None])
    varlen_raises(ValueError, "one length", cu_seqlens_k=a["cu_seqlens_k"][:3])
    varlen_raises(ValueError, "cu_seqlens_q must be on", cu_seqlens_q=a["cu_seqlens_q"].to("meta"))
    varlen_raises(ValueError, "cu_seqlens_q must be contiguous", cu_seqlens_q=torch.zeros(8, dtype=torch.int32)[::2])
    varlen_raises(TypeError, "max_seqlen_q must be an int", max_seqlen_q=11.0)
    varlen_raises(TypeError, "max_seqlen_k must be an int", max_seqlen_k=True)
    varlen_raises(ValueError, "max_seqlen_k must be >= 0", max_seqlen_k=-1)
    three_heads = torch.randn(21, 3, 64, dtype=torch.bfloat16)
    varlen_raises(ValueError, "multiple of k/v heads", k=three_heads, v=three_heads)
    varlen_raises(ValueError, "window_size entries", window_size=(-4, 0))
    # ALiBi per sequence: (batch, heads) with batch = len(cu_seqlens) - 1
    varlen_raises(ValueError, r"alibi_slopes must have shape \(4,\) or \(3, 4\)", alibi_slopes=torch.ones(2, 4))
    varlen_raises(ValueError, "q must be a CUDA tensor", alibi_slopes=torch.ones(3, 4))
    # FlashAttention-3's seqused_k: int32 (batch,) on q's device
    used = torch.tensor([7, 0, 5], dtype=torch.int32)
    varlen_raises(TypeError, "seqused_k must be a torch.Tensor", seqused_k=[7, 0, 5])
    varlen_raises(TypeError, "seqused_k must be int32", seqused_k=used.long())
    varlen_raises(ValueError, r"seqused_k must have shape \(batch,\) = \(3,\)", seqused_k=used[:2])
    varlen_raises(ValueError, "seqused_k must be on", seqused_k=used.to("meta"))
    varlen_raises(ValueError, "seqused_k must be contiguous", seqused_k=torch.zeros(6, dtype=torch.int32)[::2])
    varlen_raises(ValueError, "q must be a CUDA tensor", seqused_k=used)
    with pytest.raises(TypeError, match="seqused_k must be int32"):
        cute_attn.flash_attn_varlen_func(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 11, 11,
                                         seqused_k=used.float())


def test_repeated_varlen_calls_skip_only_what_cannot_change(monkeypatch):
    """varlen_forward's and flash_attn_varlen_func's fast paths (forward's rules, max_seqlen in the
    signature): a repeated call reuses the launch; another max_seqlen, a misaligned pointer or a
    bad option still meets the checks."""
    from cute_attn import interface

    launched = []
    monkeypatch.setattr(interface, "_check_cuda", lambda name, t: None)
    monkeypatch.setattr(interface, "_forward_launcher", lambda *a, **kw: lambda *args: launched.append(args))
    monkeypatch.setattr(interface, "_VARLEN_LAUNCHES", {})
    monkeypatch.setattr(interface, "_VARLEN_CALLS", {})
    names = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")

    def call(fn=cute_attn.varlen_forward, **overrides):
        a = {**varlen_args(), **overrides}
        return fn(*[a.pop(n) for n in names], causal=True, **a)

    call()
    out = call()  # new tensors, same signature: the stored launch
    assert len(launched) == 2 and len(interface._VARLEN_LAUNCHES) == 1 and out.shape == (16, 4, 64)
    call(max_seqlen_q=12)  # another max_seqlen (the grid's size): a launch of its own
    assert len(launched) == 3 and len(interface._VARLEN_LAUNCHES) == 2
    q = varlen_args()["q"]
    shifted = torch.randn(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    with pytest.raises(ValueError, match="16-byte aligned"):
        call(q=shifted)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cute_attn.varlen_forward(*[varlen_args()[n] for n in names], causal=1)
    assert len(launched) == 3
    # flash_attn_varlen_func: its own checks run once per signature, a bad option still raises
    with torch.no_grad():
        call(cute_attn.flash_attn_varlen_func)
        call(cute_attn.flash_attn_varlen_func)
    assert len(interface._VARLEN_CALLS) == 1 and len(launched) == 5
    with pytest.raises(NotImplementedError, match="dropout"):
        call(cute_attn.flash_attn_varlen_func, dropout_p=0.1)


def test_repeated_paged_varlen_calls_skip_only_what_cannot_change(monkeypatch):
    """kvcache.varlen_paged's fast path: a repeated call reuses its run (the decode route here);
    tensors that require grad under autograd still raise."""
    from cute_attn import interface, kvcache

    launched = []
    monkeypatch.setattr(interface, "_check_cuda", lambda name, t: None)
    monkeypatch.setattr(kvcache, "_check_cuda", lambda name, t: None)
    monkeypatch.setattr(kvcache, "sm90_paged_varlen", lambda *a: None)
    monkeypatch.setattr(interface, "_decode_launcher",
                        lambda *a, **kw: lambda *args, **kws: launched.append((args, kws)))
    monkeypatch.setattr(kvcache, "_PAGED_VARLEN_RUNS", {})
    monkeypatch.setattr(kvcache, "_PAGED_VARLEN_LAYOUTS", {})
    a = varlen_args()
    pages = torch.randn(6, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.arange(6, dtype=torch.int32).view(3, 2)

    def call(**overrides):
        b = {**a, "k": pages, "v": pages, "block_table": table, **overrides}
        return cute_attn.flash_attn_varlen_func(b.pop("q"), b.pop("k"), b.pop("v"), b.pop("cu_seqlens_q"),
                                                b.pop("cu_seqlens_k"), b.pop("max_seqlen_q"), b.pop("max_seqlen_k"),
                                                causal=True, **b)

    with torch.no_grad():
        out = call()
        call(q=torch.randn_like(a["q"]))
    assert out.shape == a["q"].shape and len(launched) == 2 and len(kvcache._PAGED_VARLEN_RUNS) == 1
    (args, kws), _ = launched
    assert args[6][3] is table and kws["cu_seqlens"] == (a["cu_seqlens_q"], a["cu_seqlens_k"])
    with pytest.raises(NotImplementedError, match="no backward"):
        call(q=a["q"].clone().requires_grad_())
    with torch.no_grad(), pytest.raises(ValueError, match="block_table must have 2 dims"):
        call(block_table=table.view(-1))
    assert len(launched) == 2


def test_paged_varlen_calls_of_one_layout_check_only_their_lengths(monkeypatch):
    """A serving loop's paged calls differ in batch size, totals and max_seqlen every step: the
    checks run once per layout (interface._varlen_layout) and the kernel choice once per layout
    and lengths; what involves the lengths (one batch size across cu_seqlens, block_table and
    seqused_k, max_seqlen ints, aligned pointers) is still checked on every call."""
    from cute_attn import interface, kvcache

    launched, checks = [], []
    full_check = kvcache.check_kvcache_args
    monkeypatch.setattr(interface, "_check_cuda", lambda name, t: None)
    monkeypatch.setattr(kvcache, "_check_cuda", lambda name, t: None)
    monkeypatch.setattr(kvcache, "sm90_paged_varlen", lambda *a: None)
    monkeypatch.setattr(kvcache, "check_kvcache_args", lambda *a, **kw: checks.append(1) or full_check(*a, **kw))
    monkeypatch.setattr(interface, "_decode_launcher",
                        lambda *a, **kw: lambda *args, **kws: launched.append((args, kws)))
    for store in ("_PAGED_VARLEN_RUNS", "_PAGED_VARLEN_LAYOUTS"):
        monkeypatch.setattr(kvcache, store, {})
    monkeypatch.setattr(interface, "_VARLEN_CALLS", {})
    pages = torch.randn(12, 16, 2, 64, dtype=torch.bfloat16)

    def step(lengths_q, lengths_k, max_pages=2, **overrides):
        batch = len(lengths_q)
        a = {**varlen_args(lengths_q, lengths_k), "k": pages, "v": pages,
             "block_table": torch.randperm(12, dtype=torch.int32)[:batch * max_pages].view(batch, max_pages)}
        a.update(overrides)
        with torch.no_grad():
            return cute_attn.flash_attn_varlen_func(*[a.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                                                                         "max_seqlen_q", "max_seqlen_k")],
                                                    causal=True, **a)

    out = step((5, 0, 11), (7, 3, 11))
    assert out.shape == (16, 4, 64) and len(checks) == 1
    step((1, 1), (20, 9), max_pages=3)  # another batch, totals, max_seqlen and block table: no check
    step((1, 1, 1, 2), (3, 1, 17, 30))
    assert len(checks) == 1 and len(launched) == 3 and len(kvcache._PAGED_VARLEN_RUNS) == 3
    assert len(kvcache._PAGED_VARLEN_LAYOUTS) == 1 and len(interface._VARLEN_CALLS) == 1
    step((1, 1, 1, 2), (3, 1, 17, 30))  # the same lengths again: the stored kernel choice
    assert len(launched) == 4 and len(kvcache._PAGED_VARLEN_RUNS) == 3
    # what involves the lengths is checked on every call, as the full checks report it
    table = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table must have shape \(2, 2\)"):
        step((1, 1), (20, 9), block_table=table)
    with pytest.raises(ValueError, match=r"seqused_k must have shape \(batch,\)"):
        step((1, 1), (20, 9), seqused_k=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        step((1, 1), (20, 9), max_seqlen_k=20.0)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must have one length"):
        step((1, 1), (20, 9), cu_seqlens_k=torch.tensor([0, 20, 29, 30], dtype=torch.int32))
    shifted = torch.randn(2 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 4, 64)
    with pytest.raises(ValueError, match="16-byte aligned"):
        step((1, 1), (20, 9), q=shifted)
    strided_table = torch.zeros(2, 4, dtype=torch.int32)[:, ::2]
    with pytest.raises(ValueError, match="block_table must be contiguous in its last dim"):
        step((1, 1), (20, 9), block_table=strided_table)
    assert len(launched) == 4


def test_varlen_backward_rejects_non_tensors():
    a = varlen_args()
    out, lse = torch.zeros_like(a["q"]), torch.zeros(4, a["q"].shape[0])
    for name in ("q", "k", "v"):
        args = {**a, name: a[name].tolist()}
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
            cute_attn.varlen_backward(torch.zeros_like(a["q"]), args["q"], args["k"], args["v"], out, lse,
                                      a["cu_seqlens_q"], a["cu_seqlens_k"], a["max_seqlen_q"], a["max_seqlen_k"])


def test_varlen_backward_checks_lse_shape():
    a = varlen_args()
    out = torch.randn_like(a["q"])
    positional = [a.pop(n) for n in ("q", "k", "v")]
    rest = [a.pop(n) for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    with pytest.raises(ValueError, match=r"lse must have shape \(4, 16\)"):
        cute_attn.varlen_backward(out, *positional, out, torch.randn(1, 4, 16), *rest)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        cute_attn.varlen_backward(out, *positional, out, torch.randn(4, 16), *rest)


# ---------------------------------------------------------------------------- one bad argument at a time
def _valid_calls(rng):
    """(name, function of a dict of arguments, the arguments) of a valid call of each entry point,
    on CPU tensors (so it reaches the device check at most)."""
    B, Sq, Sk, H, Hk, D = rng.choice([1, 2]), rng.choice([1, 5]), rng.choice([3, 16]), 4, rng.choice([1, 2, 4]), 64

    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)

    scores = dict(softmax_scale=0.1, causal=True, window_size=(3, 0), softcap=2.0)
    dense = dict(q=t(B, Sq, H, D), k=t(B, Sk, Hk, D), v=t(B, Sk, Hk, D), alibi_slopes=t(H, dtype=torch.float32))
    cu_q, cu_k = (torch.tensor([0, n, 2 * n], dtype=torch.int32) for n in (Sq, Sk))
    varlen = dict(q=t(2 * Sq, H, D), k=t(2 * Sk, Hk, D), v=t(2 * Sk, Hk, D), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                  max_seqlen_q=Sq, max_seqlen_k=Sk, alibi_slopes=t(2, H, dtype=torch.float32),
                  seqused_k=torch.tensor([1, 2], dtype=torch.int32))
    grads = dict(dout=t(B, Sq, H, D), out=t(B, Sq, H, D), lse=t(B, H, Sq, dtype=torch.float32), deterministic=False)
    vgrads = dict(dout=t(2 * Sq, H, D), out=t(2 * Sq, H, D), lse=t(H, 2 * Sq, dtype=torch.float32), deterministic=True)
    cache = dict(q=t(B, Sq, H, D), k_cache=t(B, 32, Hk, D), v_cache=t(B, 32, Hk, D), k=t(B, 1, Hk, D), v=t(B, 1, Hk, D),
                 rotary_cos=t(64, 16), rotary_sin=t(64, 16), cache_seqlens=torch.full((B,), 3, dtype=torch.int32),
                 cache_batch_idx=torch.arange(B, dtype=torch.int32), cache_leftpad=torch.zeros(B, dtype=torch.int32),
                 alibi_slopes=t(H, dtype=torch.float32), num_splits=2, **scores)
    positional = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    pop = lambda a, names: [a.pop(n) for n in names]  # noqa: E731
    return [
        ("forward", lambda a: cute_attn.forward(*pop(a, "qkv"), **a), {**dense, **scores, "out": t(B, Sq, H, D)}),
        ("backward", lambda a: cute_attn.backward(*pop(a, ("dout", "q", "k", "v", "out", "lse")), **a),
         {**dense, **scores, **grads}),
        ("flash_attn_func", lambda a: cute_attn.flash_attn_func(**a), {**dense, **scores, "dropout_p": 0.0}),
        ("varlen_forward", lambda a: cute_attn.varlen_forward(*pop(a, positional), **a), {**varlen, **scores}),
        ("varlen_backward", lambda a: cute_attn.varlen_backward(*pop(a, ("dout", "q", "k", "v", "out", "lse")),
                                                                *pop(a, positional[3:]), **a),
         {**varlen, **scores, **vgrads}),
        ("flash_attn_varlen_func", lambda a: cute_attn.flash_attn_varlen_func(*pop(a, positional), **a),
         {**varlen, **scores}),
        ("flash_attn_with_kvcache", lambda a: cute_attn.flash_attn_with_kvcache(**a), cache),
    ]


def _perturbed(rng, value):
    """``value`` made wrong one way: another shape, dtype, layout or type, None, out of range."""
    if isinstance(value, torch.Tensor):
        kind = rng.choice(["shape", "dtype", "strided", "none", "list", "rank"])
        if kind == "shape" and value.dim():
            shape = list(value.shape)
            i = rng.randrange(len(shape))
            shape[i] = max(0, shape[i] + rng.choice([-1, 1, 3]))
            return torch.zeros(shape, dtype=value.dtype)
        if kind == "dtype":
            return value.to(rng.choice([torch.float32, torch.int64, torch.float16]))
        if kind == "strided" and value.numel() > 1:
            return torch.stack([value, value], -1)[..., 0]
        return {"none": None, "list": value.tolist()}.get(kind, value.unsqueeze(0))
    if isinstance(value, bool):
        return rng.choice([None, 1, "yes"])
    if isinstance(value, (int, float)):
        return rng.choice([-1, -5.0, float("nan"), float("inf"), None, "3", True])
    return rng.choice([(1,), (1, 2, 3), (-3, 0), (1.5, 2), None, (True, False), "x"])


@pytest.mark.parametrize("seed", range(4))
def test_one_bad_argument_raises_value_or_type_error(seed):
    """A valid call of every entry point with one argument made wrong (random, seeded) raises
    ValueError, TypeError or NotImplementedError: never another exception from deeper inside
    (random malformed calls found a ZeroDivisionError at head_dim 0 in the FA2 entry points and an
    AttributeError for a non-tensor q/k/v in varlen_backward)."""
    import random

    rng = random.Random(seed)
    for _ in range(300):
        name, call, args = rng.choice(_valid_calls(rng))
        arg = rng.choice(sorted(args))
        args[arg] = _perturbed(rng, args[arg])
        try:
            call(dict(args))
        except (ValueError, TypeError, NotImplementedError):
            continue
        raise AssertionError(f"{name}({arg}={args[arg]!r}) did not raise ValueError/TypeError")


# ---------------------------------------------------------------------------- packed q/k/v (FA2)
FA2_OPTIONS = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
               "return_attn_probs"]


@pytest.mark.parametrize("name,leading", [
    ("flash_attn_qkvpacked_func", ["qkv"]),
    ("flash_attn_kvpacked_func", ["q", "kv"]),
    ("flash_attn_varlen_qkvpacked_func", ["qkv", "cu_seqlens", "max_seqlen"]),
    ("flash_attn_varlen_kvpacked_func", ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]),
])
def test_packed_functions_take_fa2s_positional_order(name, leading):
    """FlashAttention-2's packed entry points, its parameters in its order with its defaults, so
    code calling them positionally switches by import."""
    import inspect

    params = inspect.signature(getattr(cute_attn, name)).parameters
    positional = [p for p, v in params.items() if v.kind == v.POSITIONAL_OR_KEYWORD]
    assert positional == leading + FA2_OPTIONS
    defaults = {p: params[p].default for p in FA2_OPTIONS}
    assert defaults == dict(dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            alibi_slopes=None, deterministic=False, return_attn_probs=False)


def test_packed_functions_bad_input():
    q, k, v = qkv()
    packed = torch.stack((q, k, v), dim=2)
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor"):
        cute_attn.flash_attn_qkvpacked_func([q, k, v])
    with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seqlen, 3, heads, head_dim\)"):
        cute_attn.flash_attn_qkvpacked_func(packed[:, :, :2])
    with pytest.raises(ValueError, match=r"kv must have shape \(batch, seqlen, 2, heads, head_dim\)"):
        cute_attn.flash_attn_kvpacked_func(q, packed)
    with pytest.raises(ValueError, match=r"qkv must have shape \(total, 3, heads, head_dim\)"):
        cute_attn.flash_attn_varlen_qkvpacked_func(packed, torch.zeros(3, dtype=torch.int32), 16)
    with pytest.raises(NotImplementedError, match="dropout_p must be 0.0"):
        cute_attn.flash_attn_qkvpacked_func(packed.requires_grad_(), 0.1)
    a = varlen_args(heads_kv=4)
    kv = torch.stack((a["k"], a["v"]), dim=1).requires_grad_()
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32"):
        cute_attn.flash_attn_varlen_kvpacked_func(a["q"], kv, a["cu_seqlens_q"], a["cu_seqlens_k"].long(), 11, 11)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):  # valid: only the device check is left
        cute_attn.flash_attn_varlen_kvpacked_func(a["q"], kv, a["cu_seqlens_q"], a["cu_seqlens_k"], 11, 11, causal=True)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("kv_only", [False, True])
def test_packed_backward_writes_one_gradient_buffer(varlen, kv_only, monkeypatch):
    """The packed functions' autograd hands the kernels q, k, v as views of the packed tensors and
    dq, dk, dv as views of one packed gradient (the kernels stubbed: the backward's launch writes
    1, 2, 3 into dq, dk, dv), and arguments reach the kernels as the unpacked call's do."""
    from cute_attn import interface

    forwards, backwards = [], []

    def fake_backward(dout, q, k, v, out, lse, dq, dk, dv, *rest):
        # pointers only: a gradient view kept alive would make autograd copy the packed gradient
        backwards.append(tuple(t.data_ptr() for t in (q, k, v, dq, dk, dv)) + rest)
        dq.fill_(1), dk.fill_(2), dv.fill_(3)

    monkeypatch.setattr(interface, "_check_cuda", lambda name, t: None)
    monkeypatch.setattr(interface, "_forward_launcher", lambda *a, **kw: lambda *args: forwards.append(args))
    monkeypatch.setattr(interface, "_backward_launcher", lambda *a, **kw: fake_backward)
    for store in ("_FORWARD_LAUNCHES", "_VARLEN_LAUNCHES", "_VARLEN_CALLS", "_BACKWARD_LAUNCHES"):
        monkeypatch.setattr(interface, store, {})
    if varlen:
        a = varlen_args(heads_kv=4)
        q, k, v, cu = a["q"], a["k"], a["v"], (a["cu_seqlens_q"], a["cu_seqlens_k"])
        if not kv_only:
            cu = (a["cu_seqlens_k"],) * 2
            q = torch.randn_like(k)
    else:
        q, k, v = qkv(seqlen_k=16)
    dim = 1 if varlen else 2
    packed = torch.stack((k, v) if kv_only else (q, k, v), dim=dim).requires_grad_()
    q = q.requires_grad_() if kv_only else None
    if varlen and kv_only:
        out = cute_attn.flash_attn_varlen_kvpacked_func(q, packed, *cu, 11, 11, causal=True)
    elif varlen:
        out = cute_attn.flash_attn_varlen_qkvpacked_func(packed, cu[0], 11, 0.0, 0.5, True)
    elif kv_only:
        out = cute_attn.flash_attn_kvpacked_func(q, packed, causal=True)
    else:
        out = cute_attn.flash_attn_qkvpacked_func(packed, 0.0, 0.5, True)
    out.sum().backward()
    (fq, fk, fv, *_), (bq, bk, bv, dq, dk, dv, *rest) = forwards[0], backwards[0]
    views = packed.detach().unbind(dim)
    for got, want in zip((fk, fv), views[-2:]):  # k, v: views of the packed tensor (varlen: unsqueezed)
        assert got.data_ptr() == want.data_ptr() and got.stride()[-3:] == want.stride()[-3:]
    assert (bk, bv) == (fk.data_ptr(), fv.data_ptr())
    grads = packed.grad.unbind(dim)  # the buffer the kernels wrote, not a copy of it
    assert (dk, dv) == (grads[-2].data_ptr(), grads[-1].data_ptr())
    assert (grads[-2] == 2).all() and (grads[-1] == 3).all()
    if kv_only:
        assert (q.grad == 1).all() and dq == q.grad.data_ptr()
    else:
        assert dq == grads[0].data_ptr() and (grads[0] == 1).all()
        assert fq.data_ptr() == views[0].data_ptr() == bq
    if varlen:
        assert rest[0] is cu[0] and rest[1] is cu[1]
