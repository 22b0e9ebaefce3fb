"""The torch boundary: validate, allocate, pick the compiled kernel, launch on the current stream.

No kernel code here. Every check runs before anything is launched and raises a ValueError or
TypeError naming the argument, what was given and what is expected.
"""

from __future__ import annotations

import math

import torch

from cute_attn import compile as compile_mod
from cute_attn import dispatch
from cute_attn.traits import MAX_HEAD_DIM, sm90_tier_seqlen

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_ALIGN_BYTES = 16


# ---------------------------------------------------------------------------- validation
def _check_kind(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPE_NAMES:
        raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dims (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}")


def _check_layout(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides {t.stride()}")
    elems = _ALIGN_BYTES // t.element_size()
    if any(s % elems for s in t.stride()[:-1]):
        raise ValueError(
            f"{name}'s strides {t.stride()} must be multiples of {elems} elements (16 bytes) "
            f"except the last dim's"
        )
    if t.data_ptr() % _ALIGN_BYTES:
        raise ValueError(f"{name}'s data pointer must be 16-byte aligned, got address {t.data_ptr():#x}")


def _check_cuda(name: str, t: torch.Tensor) -> None:
    # checked last, so that every other error can be tested on a machine without a GPU
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got a tensor on {t.device}")


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_kind(name, t)
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, _, heads, head_dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"k/v batch {k.shape[0]} does not match q batch {batch}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k/v head_dim {k.shape[3]} does not match q head_dim {head_dim}")
    heads_kv = k.shape[2]
    if heads_kv == 0 or heads % heads_kv:
        raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({heads_kv})")
    if head_dim > MAX_HEAD_DIM or head_dim % 8 or head_dim == 0:
        raise ValueError(f"head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {head_dim}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_layout(name, t)


def _check_out(name: str, out, like: torch.Tensor, shape=None, dtype=None) -> None:
    shape = tuple(like.shape) if shape is None else shape
    dtype = like.dtype if dtype is None else dtype
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(out).__name__}")
    if out.device != like.device:
        raise ValueError(f"{name} must be on {like.device}, got {out.device}")
    if out.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {out.dtype}")
    if tuple(out.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(out.shape)}")
    if len(shape) == 4:
        _check_layout(name, out)


def _softmax_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    return float(softmax_scale)


# ---------------------------------------------------------------------------- forward
def forward(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, out=None,
            return_lse: bool = False):
    """Exact attention softmax(q k^T * scale) v, FlashAttention-2 style.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim), fp16 or
    bf16, on one CUDA device, last dim contiguous; heads a multiple of heads_kv (GQA/MQA);
    head_dim a multiple of 8 up to 256. causal is bottom-right aligned. Returns out (like q,
    contiguous unless ``out`` is given) and, with ``return_lse``, lse (batch, heads, seqlen_q)
    float32 in natural log (+inf for a query that sees no key; its out row is 0).
    Launches on torch's current CUDA stream; no host synchronisation.
    """
    if torch.compiler.is_compiling() and out is None:  # traced as the custom op (integrations/custom_ops.py)
        from cute_attn.integrations import custom_ops as ops

        out, lse = ops.fwd(q, k, v, causal, softmax_scale, False)
        return (out, lse) if return_lse else out
    # a call like an earlier valid one (same types, dtypes, devices, shapes, strides and options)
    # skips the checks and the kernel lookup; only its pointers' alignment is new
    tensors = (q, k, v) if out is None else (q, k, v, out)
    signature = _signature(tensors, (causal, softmax_scale))
    launch = _FORWARD_LAUNCHES.get(signature)
    if launch is not None and _aligned(tensors):
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
        launch(q, k, v, out, lse)
        return (out, lse) if return_lse else out

    _check_qkv(q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale = _softmax_scale(softmax_scale, q.shape[3])
    if out is not None:
        _check_out("out", out, q)
    _check_cuda("q", q)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch, seqlen_q, heads, head_dim = q.shape
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        pass
    elif k.shape[1] == 0:
        out.zero_()
        lse.fill_(math.inf)
    else:
        launch = _forward_launcher(q, k, causal, scale)
        launch(q, k, v, out, lse)
        _remember(_FORWARD_LAUNCHES, signature, launch)
    return (out, lse) if return_lse else out


# launches of validated argument signatures (``forward``'s fast path); cleared when full
_FORWARD_LAUNCHES: dict = {}
_MAX_LAUNCHES = 4096


def _signature(tensors, options) -> tuple | None:
    """What validation and the kernel choice depend on, apart from the pointers (None: not tensors).
    Options carry their types: causal=1 must not pass for causal=True."""
    try:
        return (tuple((t.__class__, t.dtype, t.device, t.shape, t.stride()) for t in tensors)
                + tuple((o.__class__, o) for o in options))
    except AttributeError:
        return None


def _remember(launches: dict, signature, launch) -> None:
    if signature is not None:
        if len(launches) >= _MAX_LAUNCHES:
            launches.clear()
        launches[signature] = launch


def _aligned(tensors) -> bool:
    return all(t.data_ptr() % _ALIGN_BYTES == 0 for t in tensors)


def _launch_forward(q, k, v, out, lse, causal: bool, scale: float, traits=None) -> None:
    """Launch on validated tensors. ``traits`` overrides the table (tools/bench.py --sweep)."""
    _forward_launcher(q, k, causal, scale, traits)(q, k, v, out, lse)


def _forward_launcher(q, k, causal: bool, scale: float, traits=None):
    """The launch for validated tensors shaped like q, k: a function of (q, k, v, out, lse)."""
    plan = dispatch.plan_for_device(q.device)
    key = compile_mod.forward_key(
        plan.target, _DTYPE_NAMES[q.dtype], q.shape[3], causal, plan.smem_capacity, traits=traits,
        kernel=plan.kernel, seqlen=sm90_tier_seqlen(q.shape[1], k.shape[1], causal),
    )
    kernel = compile_mod.forward_cache.get(key)
    device, scale_log2 = q.device, scale * math.log2(math.e)
    extra = ()
    if key.kernel == "sm90":
        # causal tile order: a persistent grid goes head by head, one CTA per tile in L2-sized
        # sections of heads (kernels/tile_scheduler.py)
        section = 1
        if causal and not compile_mod.forward_cache.chosen(key).persistent:
            from cute_attn.kernels.tile_scheduler import heads_per_section

            section = heads_per_section(k.shape[1], key.head_dim, q.element_size())
        extra = (plan.num_sms, section)

    def launch(q, k, v, out, lse):
        with torch.cuda.device(device):
            kernel(q, k, v, out, lse, scale_log2, *extra)

    return launch


# ---------------------------------------------------------------------------- backward
def _check_like(name: str, t, like: torch.Tensor) -> None:
    """A gradient-sized tensor: same shape, dtype and device as ``like``, valid strides."""
    _check_out(name, t, like)


def _check_lse(lse, q: torch.Tensor) -> None:
    batch, seqlen_q, heads, _ = q.shape
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must be float32, got {lse.dtype}")
    if tuple(lse.shape) != (batch, heads, seqlen_q):
        raise ValueError(f"lse must have shape {(batch, heads, seqlen_q)}, got {tuple(lse.shape)}")
    if lse.device != q.device:
        raise ValueError(f"lse must be on {q.device}, got {lse.device}")
    if seqlen_q > 1 and lse.stride(-1) != 1:
        raise ValueError(f"lse must be contiguous in its last dim, got strides {lse.stride()}")


def backward(dout, q, k, v, out, lse, *, causal: bool = False, softmax_scale: float | None = None,
             deterministic: bool = False, dq=None, dk=None, dv=None):
    """Gradients (dq, dk, dv) of ``forward`` for the output gradient ``dout``.

    ``out`` and ``lse`` are what ``forward(..., return_lse=True)`` returned for these q, k, v;
    attention is recomputed from them block by block (no S x S matrix). ``deterministic=True``
    adds each K/V block's share of dq in a fixed order, so repeated calls are bitwise identical.
    dq/dk/dv may be given to write into; otherwise they are allocated like q/k/v. With GQA/MQA,
    dk and dv are summed over the query heads that share each K/V head.
    """
    if torch.compiler.is_compiling() and dq is None and dk is None and dv is None:
        from cute_attn.integrations import custom_ops as ops

        return ops.bwd(dout, q, k, v, out, lse, causal, softmax_scale, deterministic)
    given = tuple(t for t in (dq, dk, dv) if t is not None)
    tensors = (dout, q, k, v, out, lse) + given
    # (dq, dk, dv) given or not, in the signature: which of them a fast call must allocate
    signature = _signature(tensors, (causal, softmax_scale, deterministic, dq is None, dk is None, dv is None))
    launch = _BACKWARD_LAUNCHES.get(signature)
    if launch is not None and _aligned(tensors):
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if dq is None else dq
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dk is None else dk
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if dv is None else dv
        launch(dout, q, k, v, out, lse, dq, dk, dv)
        return dq, dk, dv

    _check_qkv(q, k, v)
    _check_like("out", out, q)
    _check_like("dout", dout, q)
    _check_lse(lse, q)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    scale = _softmax_scale(softmax_scale, q.shape[3])
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if t is not None:
            _check_out(name, t, like)
    _check_cuda("q", q)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if dq is None else dq
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dk is None else dk
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if dv is None else dv
    if q.numel() == 0 or k.numel() == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv
    launch = _backward_launcher(q, k, causal, scale, deterministic)
    launch(dout, q, k, v, out, lse, dq, dk, dv)
    _remember(_BACKWARD_LAUNCHES, signature, launch)
    return dq, dk, dv


_BACKWARD_LAUNCHES: dict = {}  # as _FORWARD_LAUNCHES, for ``backward``


def _launch_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, deterministic, traits=None) -> None:
    """Launch on validated tensors. ``traits`` overrides the table (tools/bench.py --bwd-sweep)."""
    _backward_launcher(q, k, causal, scale, deterministic, traits)(dout, q, k, v, out, lse, dq, dk, dv)


def _backward_launcher(q, k, causal, scale, deterministic, traits=None):
    """The pre/main/post launches for validated tensors shaped like q, k: a function of
    (dout, q, k, v, out, lse, dq, dk, dv)."""
    from cute_attn.kernels.sm80.backward import ROW_PAD

    plan = dispatch.plan_for_device(q.device)
    pre, main = compile_mod.backward_keys(plan.target, _DTYPE_NAMES[q.dtype], q.shape[3], causal, deterministic,
                                          traits=traits, kernel=plan.kernel, smem_capacity=plan.smem_capacity)
    cache = compile_mod.backward_cache
    chosen = cache.chosen(main)
    if chosen.smem_bytes() > plan.smem_capacity:
        # the backward traits are sized for H100/A100; smaller GPUs (sm_86/89) get a clear error
        raise NotImplementedError(
            f"the backward for head_dim {q.shape[3]} needs {chosen.smem_bytes() // 1024} KB of shared memory per "
            f"block; this GPU offers {plan.smem_capacity // 1024} KB"
        )
    post = compile_mod.backward_post_key(main, chosen)
    batch, seqlen_q, heads, _ = q.shape
    pad = math.lcm(ROW_PAD, chosen.tile_m)  # whole Q blocks of the main kernel and of the preprocess
    seqlen_q_pad = -(-seqlen_q // pad) * pad
    device, head_dim, tile_m = q.device, main.head_dim, chosen.tile_m
    f32 = dict(dtype=torch.float32, device=device)
    kernels = cache.get(pre), cache.get(main), cache.get(post)
    scale_log2 = scale * math.log2(math.e)

    def launch(dout, q, k, v, out, lse, dq, dk, dv):
        lse_log2 = torch.empty((batch, heads, seqlen_q_pad), **f32)
        delta = torch.empty((batch, heads, seqlen_q_pad), **f32)
        dq_accum = torch.empty((batch, heads, seqlen_q_pad, head_dim), **f32)  # zeroed by the preprocess
        if deterministic:
            sem = torch.zeros((batch, heads, seqlen_q_pad // tile_m), dtype=torch.int32, device=device)
        else:
            sem = torch.empty((1, 1, 1), dtype=torch.int32, device=device)
        with torch.cuda.device(device):
            kernels[0](out, dout, lse, lse_log2, delta, dq_accum)
            kernels[1](q, k, v, dout, lse_log2, delta, dq_accum, dk, dv, sem, scale, scale_log2)
            kernels[2](dq_accum, dq, scale)

    return launch


# ---------------------------------------------------------------------------- autograd
def _grad_ready(t: torch.Tensor) -> torch.Tensor:
    """Autograd hands over gradients with any strides (``out.sum()`` gives zero strides)."""
    elems = _ALIGN_BYTES // t.element_size()
    if t.stride(-1) != 1 or any(s % elems for s in t.stride()[:-1]) or t.data_ptr() % _ALIGN_BYTES:
        return t.contiguous()
    return t


class FlashAttnFunc(torch.autograd.Function):
    """Eager autograd for ``flash_attn_func``: saves q, k, v, out and lse (never P); the backward
    recomputes attention block by block."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, deterministic):
        out, lse = forward(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(_grad_ready(dout), q, k, v, out, lse, causal=ctx.causal,
                              softmax_scale=ctx.softmax_scale, deterministic=ctx.deterministic)
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, None, None, None)


def flash_attn_func(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                    deterministic: bool = False, return_lse: bool = False):
    """``forward`` with autograd: ``out = flash_attn_func(q, k, v, causal=True); out.sum().backward()``.

    Memory stays linear in the sequence length: only q, k, v, out and lse are saved.
    ``return_lse=True`` also returns the (non-differentiable) LSE. Under torch.compile it is the
    custom ops ``torch.ops.cute_attn.fwd`` / ``bwd`` (integrations/custom_ops.py), which trace
    without graph breaks; eager calls take the autograd.Function above, skipping the dispatcher
    hop and the op's registered autograd.
    """
    # the arguments the op schema would otherwise reject with its own messages
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_kind(name, t)
    for name, flag in (("causal", causal), ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    _softmax_scale(softmax_scale, q.shape[3])
    if torch.compiler.is_compiling():
        from cute_attn.integrations import custom_ops as ops

        scale = None if softmax_scale is None else float(softmax_scale)
        out, lse = ops.fwd(q, k, v, causal, scale, deterministic)
    else:
        out, lse = FlashAttnFunc.apply(q, k, v, causal, softmax_scale, deterministic)
    return (out, lse) if return_lse else out
