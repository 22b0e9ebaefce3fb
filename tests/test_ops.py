"""The custom ops behind flash_attn_func (cute_attn/integrations/custom_ops.py) without a GPU: their fake
implementations, the autograd formula and a torch.compile(fullgraph=True) capture (CPU)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cute_attn


def fake_qkv(heads=8, heads_kv=2, seqlen_q=100, seqlen_k=90, d=64, requires_grad=True):
    shapes = ((2, seqlen_q, heads, d), (2, seqlen_k, heads_kv, d), (2, seqlen_k, heads_kv, d))
    return [torch.randn(s, dtype=torch.bfloat16, requires_grad=requires_grad) for s in shapes]


def test_fake_forward_and_backward_shapes():
    with FakeTensorMode():
        q, k, v = fake_qkv()
        out, lse = torch.ops.cute_attn.fwd(q, k, v, True, None, False)
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32 and not lse.requires_grad
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        assert dk.dtype == torch.bfloat16
        # the backward op alone
        dq, dk, dv = torch.ops.cute_attn.bwd(out, q, k, v, out, lse, True, None, True)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_only_inputs_that_need_grad_get_one():
    with FakeTensorMode():
        q, k, v = fake_qkv()
        k.requires_grad_(False)
        out, _ = torch.ops.cute_attn.fwd(q, k, v, False, None, False)
        out.sum().backward()
        assert q.grad is not None and v.grad is not None and k.grad is None


@pytest.mark.parametrize("entry", ["flash_attn_func", "forward"])
def test_compile_fullgraph_captures_one_op(entry):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def attention(q, k, v):
        if entry == "forward":
            return cute_attn.forward(q, k, v, causal=True) * 2
        return cute_attn.flash_attn_func(q, k, v, causal=True, softmax_scale=0.1) * 2

    torch._dynamo.reset()
    compiled = torch.compile(attention, backend=backend, fullgraph=True)
    q, k, v = fake_qkv(requires_grad=False)
    # tracing needs no GPU; running the captured graph reaches the real op's device check
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        compiled(q, k, v)
    assert len(graphs) == 1
    assert graphs[0].code.count("torch.ops.cute_attn.fwd.default") == 1


def test_flash_attn_func_checks_arguments_before_the_op():
    q, k, v = fake_qkv(requires_grad=False)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cute_attn.flash_attn_func(q, k, v, causal=1)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cute_attn.flash_attn_func(q, k, v, deterministic="yes")
    with pytest.raises(TypeError, match="softmax_scale must be a float"):
        cute_attn.flash_attn_func(q, k, v, softmax_scale="0.1")
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        cute_attn.flash_attn_func(q, k, v.tolist())


def test_fake_ops_carry_window_softcap_alibi_and_varlen():
    with FakeTensorMode():
        q, k, v = fake_qkv()
        slopes = torch.rand(8)
        out, lse = torch.ops.cute_attn.fwd(q, k, v, False, None, False, 64, 0, 30.0, slopes)
        assert out.shape == q.shape and lse.shape == (2, 8, 100)
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
        qv, kv, vv = (t.detach()[0].clone().requires_grad_(True) for t in (q, k, v))
        cu_q, cu_k = torch.tensor([0, 40, 100], dtype=torch.int32), torch.tensor([0, 30, 90], dtype=torch.int32)
        out, lse = torch.ops.cute_attn.fwd_varlen(qv, kv, vv, cu_q, cu_k, 60, 60, True, None, False)
        assert out.shape == qv.shape and lse.shape == (8, 100)
        dq, dk, dv = torch.autograd.grad(out.sum(), (qv, kv, vv))
        assert (dq.shape, dk.shape, dv.shape) == (qv.shape, kv.shape, vv.shape)


def test_compile_fullgraph_varlen_with_options():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def attention(q, k, v, cu_q, cu_k):
        return cute_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 60, 60, 0.0, None, False, (32, 0), 30.0) * 2

    torch._dynamo.reset()
    compiled = torch.compile(attention, backend=backend, fullgraph=True)
    q, k, v = (t[0] for t in fake_qkv(requires_grad=False))
    cu_q, cu_k = torch.tensor([0, 40, 100], dtype=torch.int32), torch.tensor([0, 30, 90], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        compiled(q, k, v, cu_q, cu_k)
    assert len(graphs) == 1 and graphs[0].code.count("torch.ops.cute_attn.fwd_varlen.default") == 1


@pytest.mark.parametrize("varlen", [False, True])
def test_compile_fullgraph_packed_functions(varlen):
    """The packed FlashAttention-2 entry points trace as the unpacked op on views of the packed
    tensors (one op per call, no graph break), with gradients required."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    cu = torch.tensor([0, 40, 100], dtype=torch.int32)

    def attention(qkv, q, kv):
        if varlen:
            return (cute_attn.flash_attn_varlen_qkvpacked_func(qkv, cu, 60, causal=True)
                    + cute_attn.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 60, 60, 0.0, 0.5))
        return cute_attn.flash_attn_qkvpacked_func(qkv, causal=True) + cute_attn.flash_attn_kvpacked_func(q, kv)

    torch._dynamo.reset()
    compiled = torch.compile(attention, backend=backend, fullgraph=True)
    rows = (100,) if varlen else (2, 100)
    qkv = torch.randn(*rows, 3, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(*rows, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(*rows, 2, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        compiled(qkv, q, kv)
    op = "torch.ops.cute_attn.fwd_varlen.default" if varlen else "torch.ops.cute_attn.fwd.default"
    assert len(graphs) == 1 and graphs[0].code.count(op) == 2


def test_compile_fullgraph_kvcache():
    """flash_attn_with_kvcache traces as one op that mutates the caches (no graph break)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def decode(q, k_cache, v_cache, k, v, seqlens):
        return cute_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True) + 1

    torch._dynamo.reset()
    compiled = torch.compile(decode, backend=backend, fullgraph=True)
    q = torch.randn(2, 1, 8, 64, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.randn(2, 128, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([5, 100], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        compiled(q, k_cache, v_cache, k, v, seqlens)
    assert len(graphs) == 1 and graphs[0].code.count("torch.ops.cute_attn.fwd_kvcache.default") == 1
    with FakeTensorMode():
        fq, fk, fv = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k_cache, v_cache))
        out, lse = torch.ops.cute_attn.fwd_kvcache(fq, fk, fv, None, None, None, None, None, 128, None, None, None,
                                                   None, False, -1, -1, 0.0, True, None, 0)
        assert out.shape == q.shape and lse.shape == (2, 8, 1) and lse.dtype == torch.float32


def test_compile_fullgraph_varlen_paged():
    """flash_attn_varlen_func with a block_table (FlashAttention-2's positional order) traces as one
    op (no graph break); its fake gives the shapes of out and lse."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def prefill(q, k_pages, v_pages, cu_q, cu_k, table):
        return cute_attn.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 60, 70, 0.0, None, True, (-1, -1),
                                                0.0, None, False, False, table) * 2

    torch._dynamo.reset()
    compiled = torch.compile(prefill, backend=backend, fullgraph=True)
    q = torch.randn(100, 8, 64, dtype=torch.bfloat16)
    k_pages, v_pages = (torch.randn(10, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 40, 100], dtype=torch.int32), torch.tensor([0, 30, 100], dtype=torch.int32)
    table = torch.arange(10, dtype=torch.int32).view(2, 5)
    with pytest.raises(ValueError, match="must be a CUDA tensor|must be on"):
        compiled(q, k_pages, v_pages, cu_q, cu_k, table)
    assert len(graphs) == 1 and graphs[0].code.count("torch.ops.cute_attn.fwd_varlen_paged.default") == 1
    with FakeTensorMode():
        fq, fk, fv = (torch.empty(t.shape, dtype=t.dtype) for t in (q, k_pages, v_pages))
        fcq, fck, ft = (torch.empty(t.shape, dtype=t.dtype) for t in (cu_q, cu_k, table))
        out, lse = torch.ops.cute_attn.fwd_varlen_paged(fq, fk, fv, fcq, fck, 60, 70, ft, None, None, True, -1, -1,
                                                        0.0, None)
        assert out.shape == q.shape and lse.shape == (8, 100) and lse.dtype == torch.float32


def test_autograd_builds_no_lse_gradient(monkeypatch):
    """lse is not differentiable, so the autograd functions (eager flash_attn_func, its varlen
    form, and the custom ops' formulas) turn off materialised gradients: autograd builds no zero
    lse gradient (an allocation and a fill kernel per backward call on the GPU), and a backward
    whose out gradient is missing returns no gradients. The kernels are replaced by fakes; the
    ops run in the backward are logged."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cute_attn import interface

    monkeypatch.setattr(interface, "forward", lambda q, k, v, **kw: (q * 2, torch.randn(q.shape[0], q.shape[2],
                                                                                      q.shape[1])))
    monkeypatch.setattr(interface, "varlen_forward", lambda q, k, v, *a, **kw: (q * 2, torch.randn(q.shape[1],
                                                                                                q.shape[0])))
    monkeypatch.setattr(interface, "_prefetch_backward", lambda *a, **kw: None)
    for name in ("backward", "varlen_backward"):
        monkeypatch.setattr(interface, name, lambda dout, q, k, v, *a, **kw: (dout * 2, k * 1, v * 1))

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.shapes.append((str(func), tuple(out.shape)))
            return out

    q, k, v = fake_qkv()
    cu = torch.tensor([0, 90, 180], dtype=torch.int32)
    qv, kv, vv = (t.detach()[:, :90].reshape(180, *t.shape[2:]).requires_grad_() for t in (q, k, v))
    entries = {
        "autograd.Function": lambda: interface.FlashAttnFunc.apply(q, k, v, False, None, False, (-1, -1), 0.0, None),
        "varlen autograd.Function": lambda: interface.VarlenFlashAttnFunc.apply(
            qv, kv, vv, cu, cu, 90, 90, False, None, False, (-1, -1), 0.0, None, None),
        "custom op": lambda: torch.ops.cute_attn.fwd(q, k, v, False, None, False),
        "varlen custom op": lambda: torch.ops.cute_attn.fwd_varlen(qv, kv, vv, cu, cu, 90, 90, False, None, False),
    }
    for name, entry in entries.items():
        out, lse = entry()
        inputs = (qv, kv, vv) if name.startswith("varlen") else (q, k, v)
        with Log() as log:
            grads = torch.autograd.grad(out.sum(), inputs)
        assert all(g is not None for g in grads), name
        assert not [op for op, shape in log.shapes if shape == tuple(lse.shape)], (name, log.shapes)
    assert interface.FlashAttnFunc.backward(None, None, None) == (None,) * 9
    assert interface.VarlenFlashAttnFunc.backward(None, None, None) == (None,) * 14
    assert interface.PackedFlashAttnFunc.backward(None, None, None) == (None,) * 7


def test_backward_keeps_the_forwards_forced_arch(monkeypatch):
    """force_arch is per thread and autograd runs a CUDA backward in a thread of its own: the
    autograd functions (eager flash_attn_func and flash_attn_varlen_func, and the custom ops' autograd
    formula) record the family forced at the forward and force it around the backward. Here the
    backward is run from another thread on purpose (CPU autograd would run it in this one); the
    kernels are replaced by fakes that record the family in effect."""
    import threading

    from cute_attn import dispatch, interface

    seen = []

    def fake_forward(q, k, v, **kw):
        seen.append(("fwd", dispatch.forced_kernel()))
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def fake_backward(dout, q, k, v, out, lse, **kw):
        seen.append(("bwd", dispatch.forced_kernel()))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(interface, "forward", fake_forward)
    monkeypatch.setattr(interface, "backward", fake_backward)
    monkeypatch.setattr(interface, "_prefetch_backward", lambda *a, **kw: None)
    q, k, v = fake_qkv()

    def backward_in_another_thread(out):
        thread = threading.Thread(target=lambda: out.sum().backward())
        thread.start()
        thread.join()

    entries = {"autograd.Function": lambda: interface.FlashAttnFunc.apply(q, k, v, True, None, False, (-1, -1), 0.0,
                                                                          None)[0],
               "custom op": lambda: torch.ops.cute_attn.fwd(q, k, v, True, None, False)[0]}
    for name, entry in entries.items():
        for arch in ("sm80", None):
            seen.clear()
            with cute_attn.force_arch(arch):
                out = entry()
            backward_in_another_thread(out)
            assert seen == [("fwd", arch), ("bwd", arch)], (name, seen)
