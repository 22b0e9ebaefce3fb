"""cute_attn's kernels as torch.library custom ops: what torch.compile, the dispatcher and autograd see.

    torch.ops.cute_attn.fwd(q, k, v, causal, softmax_scale, deterministic,
                            window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None) -> (out, lse)
    torch.ops.cute_attn.bwd(dout, q, k, v, out, lse, causal, softmax_scale, deterministic,
                            window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                            arch="") -> (dq, dk, dv)
    torch.ops.cute_attn.fwd_varlen / bwd_varlen: the same with cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k after the tensors (FlashAttention's varlen layout)
    torch.ops.cute_attn.fwd_kvcache: flash_attn_with_kvcache (no autograd; mutates the caches)
    torch.ops.cute_attn.fwd_varlen_paged: flash_attn_varlen_func with a block_table (no autograd)

Each op has a fake (meta) implementation giving its outputs' shapes, dtypes and strides without
running anything, so ``torch.compile(fullgraph=True)`` traces through ``flash_attn_func`` and
``flash_attn_varlen_func`` with no graph break, and the forward ops have an autograd formula
that calls the backward ones. ``deterministic`` rides on the forward (unused there) so that its
backward knows it. The real implementations are the ``interface`` functions: every check and
error message is theirs. The window is two ints (a schema has no tuple of ints). A backward op's
``arch`` is the kernel family ``force_arch`` set where the forward ran ("": none), since autograd
runs a CUDA backward in a thread of its own, where the forward's ``force_arch`` is not in effect.
"""

from __future__ import annotations

import torch

from cute_attn import dispatch, interface


def _options(causal, softmax_scale, window_left, window_right, softcap, alibi_slopes) -> dict:
    return dict(causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right), softcap=softcap,
                alibi_slopes=alibi_slopes)


# ---------------------------------------------------------------------------- dense
@torch.library.custom_op("cute_attn::fwd", mutates_args=())
def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float | None,
        deterministic: bool, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return interface.forward(q, k, v, return_lse=True,
                             **_options(causal, softmax_scale, window_left, window_right, softcap, alibi_slopes))


@fwd.register_fake
def _fwd_fake(q, k, v, causal, softmax_scale, deterministic, window_left=-1, window_right=-1, softcap=0.0,
              alibi_slopes=None):
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("cute_attn::bwd", mutates_args=())
def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, causal: bool, softmax_scale: float | None, deterministic: bool, window_left: int = -1,
        window_right: int = -1, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
        arch: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with dispatch.force_arch(arch or None):
        return interface.backward(interface._grad_ready(dout), q, k, v, out, lse, deterministic=deterministic,
                                  **_options(causal, softmax_scale, window_left, window_right, softcap, alibi_slopes))


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, window_left=-1, window_right=-1,
              softcap=0.0, alibi_slopes=None, arch=""):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)  # never P: memory stays linear in the sequence length
    ctx.options = options  # causal, softmax_scale, deterministic, window_left, window_right, softcap, alibi_slopes
    ctx.arch = dispatch.forced_kernel() or ""
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # (no zero gradient of lse built per backward call)


def _backward(ctx, dout, _dlse):
    if dout is None:  # (grads are not materialised: out took no part in what is differentiated)
        return (None,) * 10
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = bwd(dout, q, k, v, out, lse, *ctx.options, arch=ctx.arch)
    needs = ctx.needs_input_grad
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None) + (None,) * 7


fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------- varlen
@torch.library.custom_op("cute_attn::fwd_varlen", mutates_args=())
def fwd_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
               softmax_scale: float | None, deterministic: bool, window_left: int = -1, window_right: int = -1,
               softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
               seqused_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return interface.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse=True,
                                    seqused_k=seqused_k,
                                    **_options(causal, softmax_scale, window_left, window_right, softcap, alibi_slopes))


@fwd_varlen.register_fake
def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                     deterministic, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, seqused_k=None):
    total_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((heads, total_q), dtype=torch.float32)


@torch.library.custom_op("cute_attn::bwd_varlen", mutates_args=())
def bwd_varlen(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
               max_seqlen_k: int, causal: bool, softmax_scale: float | None, deterministic: bool,
               window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
               alibi_slopes: torch.Tensor | None = None, seqused_k: torch.Tensor | None = None,
               arch: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with dispatch.force_arch(arch or None):
        return interface.varlen_backward(interface._grad_ready(dout), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, deterministic=deterministic, seqused_k=seqused_k,
                                         **_options(causal, softmax_scale, window_left, window_right, softcap,
                                                    alibi_slopes))


@bwd_varlen.register_fake
def _bwd_varlen_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     softmax_scale, deterministic, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                     seqused_k=None, arch=""):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_varlen_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.lengths, ctx.options = (max_seqlen_q, max_seqlen_k), options
    ctx.arch = dispatch.forced_kernel() or ""
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # (no zero gradient of lse built per backward call)


def _backward_varlen(ctx, dout, _dlse):
    if dout is None:
        return (None,) * 15
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = bwd_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.lengths, *ctx.options,
                            arch=ctx.arch)
    needs = ctx.needs_input_grad
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None) + (None,) * 12


fwd_varlen.register_autograd(_backward_varlen, setup_context=_setup_varlen_context)


# ---------------------------------------------------------------------------- KV-cache decode
@torch.library.custom_op("cute_attn::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                v: torch.Tensor | None, rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None,
                cache_seqlens: torch.Tensor | None, cache_seqlens_int: int | None,
                cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None,
                block_table: torch.Tensor | None, softmax_scale: float | None, causal: bool, window_left: int,
                window_right: int, softcap: float, rotary_interleaved: bool, alibi_slopes: torch.Tensor | None,
                num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_with_kvcache`` (it writes k/v into the caches: they are declared mutated).
    cache_seqlens is a tensor or, as ``cache_seqlens_int``, an int (a schema has no union)."""
    seqlens = cache_seqlens if cache_seqlens is not None else cache_seqlens_int
    return interface.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, cache_batch_idx, cache_leftpad, block_table,
        softmax_scale, causal, (window_left, window_right), softcap, rotary_interleaved, alibi_slopes, num_splits,
        return_softmax_lse=True)


@fwd_kvcache.register_fake
def _fwd_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlens_int,
                      cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_left, window_right,
                      softcap, rotary_interleaved, alibi_slopes, num_splits):
    batch, seqlen_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)


# ---------------------------------------------------------------------------- paged varlen
@torch.library.custom_op("cute_attn::fwd_varlen_paged", mutates_args=())
def fwd_varlen_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, block_table: torch.Tensor,
                     seqused_k: torch.Tensor | None, softmax_scale: float | None, causal: bool, window_left: int,
                     window_right: int, softcap: float,
                     alibi_slopes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_varlen_func(..., block_table)``: out (total_q, heads, d) and lse (heads, total_q)."""
    from cute_attn import kvcache

    return kvcache.varlen_paged(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                block_table, seqused_k, softmax_scale=softmax_scale, causal=causal,
                                window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes)


@fwd_varlen_paged.register_fake
def _fwd_varlen_paged_fake(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                           seqused_k, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes):
    total_q, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((heads, total_q), dtype=torch.float32)
