"""cute_attn's kernels as torch.library custom ops: what torch.compile, the dispatcher and autograd see.

    torch.ops.cute_attn.fwd(q, k, v, causal, softmax_scale, deterministic) -> (out, lse)
    torch.ops.cute_attn.bwd(dout, q, k, v, out, lse, causal, softmax_scale, deterministic) -> (dq, dk, dv)

Each op has a fake (meta) implementation giving its outputs' shapes, dtypes and strides without
running anything, so ``torch.compile(fullgraph=True)`` traces through ``flash_attn_func`` with no
graph break, and ``fwd`` has an autograd formula that calls ``bwd``. ``deterministic`` rides on
``fwd`` (unused there) so that its backward knows it. The real implementations are
``interface.forward`` / ``interface.backward``: every check and error message is theirs.
"""

from __future__ import annotations

import torch

from cute_attn import interface


@torch.library.custom_op("cute_attn::fwd", mutates_args=())
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float | None,
        deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return interface.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)


@fwd.register_fake
def _fwd_fake(q, k, v, causal, softmax_scale, deterministic):
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("cute_attn::bwd", mutates_args=())
def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, causal: bool, softmax_scale: float | None,
        deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return interface.backward(interface._grad_ready(dout), q, k, v, out, lse, causal=causal,
                              softmax_scale=softmax_scale, deterministic=deterministic)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)  # never P: memory stays linear in the sequence length
    ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = bwd(dout, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, ctx.deterministic)
    needs = ctx.needs_input_grad
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, None, None, None)


fwd.register_autograd(_backward, setup_context=_setup_context)
