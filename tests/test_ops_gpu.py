"""The custom ops on the GPU (marker ``gpu``): torch.library.opcheck on the real kernels,
torch.compile(fullgraph=True) of a model's forward and backward against eager, and CUDA graphs."""

import pytest
import torch

import cute_attn
from helpers import random_qkv

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_forward_and_backward(causal):
    q, k, v = random_qkv(2, 113, 203, 6, 2, 64, torch.bfloat16)
    torch.library.opcheck(torch.ops.cute_attn.fwd.default, (q, k, v, causal, None, False))
    out, lse = torch.ops.cute_attn.fwd(q, k, v, causal, None, False)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.cute_attn.bwd.default, (dout, q, k, v, out, lse, causal, 0.2, True))
    # and the autograd formula, through fwd with inputs that need grad
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    torch.library.opcheck(torch.ops.cute_attn.fwd.default, (qg, kg, vg, causal, None, True))


class TinyAttention(torch.nn.Module):
    def __init__(self, dim=256, heads=4, heads_kv=2):
        super().__init__()
        self.heads, self.heads_kv, self.head_dim = heads, heads_kv, dim // heads
        self.qkv = torch.nn.Linear(dim, (heads + 2 * heads_kv) * self.head_dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.heads * self.head_dim, self.heads_kv * self.head_dim,
                                     self.heads_kv * self.head_dim], dim=-1)
        q = q.reshape(b, s, self.heads, self.head_dim)
        k = k.reshape(b, s, self.heads_kv, self.head_dim)
        v = v.reshape(b, s, self.heads_kv, self.head_dim)
        out = cute_attn.flash_attn_func(q, k, v, causal=True)
        return self.proj(out.reshape(b, s, -1))


def test_compile_fullgraph_forward_and_backward_match_eager():
    torch.manual_seed(0)
    model = TinyAttention().cuda().to(torch.bfloat16)
    x = torch.randn(2, 333, 256, device="cuda", dtype=torch.bfloat16)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    grads = []
    for fn in (model, compiled):
        model.zero_grad()
        out = fn(x)
        out.float().square().mean().backward()
        grads.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    (eager_out, eager_grads), (comp_out, comp_grads) = grads
    assert torch.allclose(comp_out.float(), eager_out.float(), atol=2e-2, rtol=2e-2)
    for g_eager, g_comp in zip(eager_grads, comp_grads):
        assert torch.allclose(g_comp.float(), g_eager.float(), atol=2e-2, rtol=5e-2)
    # a new length runs the same compiled graph (dynamic shapes), no error
    compiled(torch.randn(1, 1000, 256, device="cuda", dtype=torch.bfloat16)).sum().backward()


def test_cuda_graph_replays_forward_and_backward():
    q, k, v = random_qkv(2, 255, 255, 4, 2, 128, torch.bfloat16, requires_grad=True)
    dout = torch.randn_like(q)

    def step():
        out = cute_attn.flash_attn_func(q, k, v, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for _ in range(2):  # new inputs, same buffers
        with torch.no_grad():
            for t in (q, k, v, dout):
                t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        expected = step()
        for name, got, want in zip(("out", "dq", "dk", "dv"), static, expected):
            assert torch.equal(got, want) or torch.allclose(got, want, atol=1e-2), name
