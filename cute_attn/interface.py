"""The torch boundary: validate, allocate, pick the compiled kernel, launch on the current stream.

No kernel code here. Every check runs before anything is launched and raises a ValueError or
TypeError naming the argument, what was given and what is expected.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from cute_attn import compile as compile_mod
from cute_attn import dispatch
from cute_attn.kernels.features import Features
from cute_attn.traits import MAX_HEAD_DIM, SPLIT_MERGE_LANES_PER_ROW, sm90_tier_seqlen

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
        if head_dim <= 0:  # the FA2 entry points validate options before the tensors' shapes
            raise ValueError(f"head_dim must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {head_dim}")
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale}")
    return float(softmax_scale)


# ---------------------------------------------------------------------------- score options
# a window side without limit, as the kernels take it (block_info and mask.py add it to row numbers)
_UNBOUNDED = 2**30


@dataclass(frozen=True)
class _Scores:
    """A call's validated score options, as the kernels take them."""

    causal: bool  # the causal kernel (causal with a left window runs the local one, right edge 0)
    features: Features  # local, softcap, alibi, varlen (kernels/features.py)
    window_left: int  # the local kernel's run-time edges (_UNBOUNDED: none on that side)
    window_right: int
    scale: float  # softmax_scale
    scale_log2: float  # the softmax's exp2 factor: scale * log2(e), or softcap * log2(e) with a softcap
    softcap_scale: float  # scale / softcap (softcap only)

    def kernel_scalars(self, max_seqlen: int) -> tuple:
        """The run-time scalars after the tensors (compile._fake_feature_args)."""
        return (max_seqlen, self.window_left, self.window_right, self.softcap_scale)


def _window(window_size) -> tuple[int, int]:
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), -1 for unbounded, got {window_size!r}")
    if min(window_size) < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1: unbounded), got {tuple(window_size)}")
    return int(window_size[0]), int(window_size[1])


def _score_options(causal, softmax_scale, head_dim: int, window_size=(-1, -1), softcap=0.0, alibi: bool = False,
                   varlen: bool = False, seqused: bool = False) -> _Scores:
    """Validate the options and map them onto a kernel, FlashAttention-2's way: causal sets the
    window's right edge to 0; a window of (-1, 0) is causal attention; (-1, -1) none."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale = _softmax_scale(softmax_scale, head_dim)
    left, right = _window(window_size)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0.0: off), got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0.0: off), got {softcap}")
    if causal:
        right = 0
    kernel_causal = left < 0 and right == 0
    local = (left >= 0 or right >= 0) and not kernel_causal
    features = Features(local=local, softcap=softcap > 0, alibi=alibi, varlen=varlen, seqused=seqused)
    if softcap > 0:
        scale_log2, softcap_scale = softcap * math.log2(math.e), scale / softcap
    else:
        scale_log2, softcap_scale = scale * math.log2(math.e), 1.0
    edge = lambda w: _UNBOUNDED if w < 0 else w  # noqa: E731
    return _Scores(kernel_causal, features, edge(left) if local else 0, edge(right) if local else 0, scale,
                   scale_log2, softcap_scale)


def _alibi_slopes(alibi_slopes, batch: int, heads: int, device) -> torch.Tensor | None:
    """Validated slopes as the kernels read them: (batch, heads) fp32, batch stride 0 for (heads,)."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}), "
                         f"got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be on {device}, got {alibi_slopes.device}")
    if alibi_slopes.dim() == 1:
        return alibi_slopes.contiguous().view(1, heads).expand(batch, heads)
    return alibi_slopes if alibi_slopes.stride(-1) == 1 else alibi_slopes.contiguous()


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, paged: bool = False) -> int:
    """Varlen shapes and offsets (no value that needs a host sync); returns the batch size.
    ``paged``: k/v are paged caches (num_pages, page_size, heads_kv, head_dim), with block_table.
    Left to the caller, as FlashAttention does: cu_seqlens nondecreasing from 0 to total, and
    max_seqlen at least the longest sequence (checking them would synchronise with the GPU)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if name != "q" and paged:
            if t.dim() != 4:
                raise ValueError(f"{name} must have 4 dims (num_pages, page_size, heads_kv, head_dim) with a "
                                 f"block_table, got shape {tuple(t.shape)}")
        elif t.dim() != 3:
            raise ValueError(f"{name} must have 3 dims (total_tokens, heads, head_dim) in a varlen call, "
                             f"got shape {tuple(t.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.dim() != 1 or t.numel() < 1:
            raise ValueError(f"{name} must have shape (batch + 1,), got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {t.device}")
        if t.stride(0) != 1 and t.numel() > 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (batch + 1), got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"{name} must be >= 0, got {n}")
    return cu_seqlens_q.numel() - 1


def _check_int32(name: str, t, shape: tuple, device: torch.device, what: str = "", shape_name: str = "") -> None:
    """An int32 index tensor of ``shape`` (``shape_name``: how the message names it, e.g.
    "(batch,)") on ``device``, contiguous in its last dim (1-D: contiguous)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{what}, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if tuple(t.shape) != shape:
        named = f"{shape_name} = {shape}" if shape_name else f"{shape}"
        raise ValueError(f"{name} must have shape {named}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def _check_seqused_k(seqused_k, batch: int, q: torch.Tensor) -> None:
    """FlashAttention-3's seqused_k: int32 (batch,) on q's device. Not checked (a host sync): each
    value between 0 and its sequence's length in cu_seqlens_k."""
    if seqused_k is not None:
        _check_int32("seqused_k", seqused_k, (batch,), q.device, " or None", shape_name="(batch,)")


# ---------------------------------------------------------------------------- forward
def forward(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
            softcap: float = 0.0, alibi_slopes=None, out=None, return_lse: bool = False):
    """Exact attention softmax(q k^T * scale) v, FlashAttention-2 style.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim), fp16 or
    bf16, on one CUDA device, last dim contiguous; heads a multiple of heads_kv (GQA/MQA);
    head_dim a multiple of 8 up to 256. causal is bottom-right aligned. FlashAttention-2's
    options: ``window_size=(left, right)`` (sliding window, -1 unbounded), ``softcap`` (scores =
    softcap * tanh(scores / softcap), 0 off), ``alibi_slopes`` fp32 (heads,) or (batch, heads).
    Returns out (like q, contiguous unless ``out`` is given) and, with ``return_lse``, lse
    (batch, heads, seqlen_q) float32 in natural log (+inf for a query that sees no key; its out
    row is 0). Launches on torch's current CUDA stream; no host synchronisation.
    """
    if torch.compiler.is_compiling() and out is None:  # traced as the custom op (integrations/custom_ops.py)
        from cute_attn.integrations import custom_ops as ops

        out, lse = ops.fwd(q, k, v, causal, softmax_scale, False, *_op_window(window_size), float(softcap),
                           alibi_slopes)
        return (out, lse) if return_lse else out
    # a call like an earlier valid one (same types, dtypes, devices, shapes, strides and options)
    # skips the checks and the kernel lookup; only its pointers' alignment is new
    tensors = (q, k, v) if out is None else (q, k, v, out)
    options = (causal, softmax_scale, window_size, softcap, alibi_slopes is None)
    signature = _signature(tensors + (() if alibi_slopes is None else (alibi_slopes,)), options)
    launch = _FORWARD_LAUNCHES.get(signature)
    if launch is not None and _aligned(tensors):
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
        slopes = None if alibi_slopes is None else _alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device)
        launch(q, k, v, out, lse, None, None, slopes)
        return (out, lse) if return_lse else out

    _check_qkv(q, k, v)
    opts = _score_options(causal, softmax_scale, q.shape[3], window_size, softcap, alibi_slopes is not None)
    slopes = _alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device)
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
        if _underfilled(q, k):  # few query rows, many keys: split-KV (the decode kernel)
            split = _decode_launcher(q, k, opts, k.shape[1], 0, kvcache=False)
            launch = lambda q, k, v, out, lse, cu_q, cu_k, slopes: split(q, k, v, out, lse, slopes, None)  # noqa: E731
        else:
            launch = _forward_launcher(q, k, opts, max_seqlen_q=seqlen_q, max_seqlen_k=k.shape[1])
        launch(q, k, v, out, lse, None, None, slopes)
        _remember(_FORWARD_LAUNCHES, signature, launch)
    return (out, lse) if return_lse else out


# forward's split-KV path: at most this many query rows, at least this many keys
_SPLIT_MAX_SEQLEN_Q = 128
_SPLIT_MIN_SEQLEN_K = 1024


def _underfilled(q, k) -> bool:
    """Whether the dense forward's grid (128-row Q blocks x heads x batch) would leave more than
    half of the GPU's SMs idle on a long key range: then forward runs split-KV instead (the path
    of ``flash_attn_with_kvcache``), which cuts the keys over more CTAs."""
    batch, seqlen_q, heads, _ = q.shape
    if seqlen_q > _SPLIT_MAX_SEQLEN_Q or k.shape[1] < _SPLIT_MIN_SEQLEN_K:
        return False
    ctas = -(-seqlen_q // 128) * heads * batch
    return 2 * ctas <= dispatch.plan_for_device(q.device).num_sms


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                   causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
                   softcap: float = 0.0, alibi_slopes=None, seqused_k=None, out=None, return_lse: bool = False):
    """``forward`` over a batch of sequences of different lengths, packed without padding
    (FlashAttention's varlen layout): q (total_q, heads, head_dim), k/v (total_k, heads_kv,
    head_dim); sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and
    cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k/v (int32 (batch + 1,) on q's device); max_seqlen_q/k:
    the longest sequence (an int; it sizes the grid). Options as ``forward`` (causal, the window
    and ALiBi's distances are per sequence; alibi_slopes (heads,) or (batch, heads)). Returns out
    (total_q, heads, head_dim) and, with ``return_lse``, lse (heads, total_q). A sequence may be
    empty. ``seqused_k`` (FlashAttention-3's; int32 (batch,)): sequence b attends to its first
    seqused_k[b] keys only, and the causal alignment, the window and ALiBi count that many keys
    (as FlashAttention-3 does). Not checked (a host sync): cu_seqlens
    nondecreasing from 0 to the totals, max_seqlen at least the longest sequence, seqused_k
    within each sequence's keys; rows past cu_seqlens_q[-1] are not written.
    """
    if torch.compiler.is_compiling() and out is None:
        from cute_attn.integrations import custom_ops as ops

        out, lse = ops.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  softmax_scale, False, *_op_window(window_size), float(softcap), alibi_slopes,
                                  seqused_k)
        return (out, lse) if return_lse else out
    # a call like an earlier valid one (as ``forward``'s, max_seqlen included) skips the checks
    signature = None
    if not torch.compiler.is_compiling():
        tensors = tuple(t for t in (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, out, alibi_slopes)
                        if t is not None)
        signature = _signature(tensors, (max_seqlen_q, max_seqlen_k, seqused_k is None, out is None,
                                         alibi_slopes is None, causal, softmax_scale, window_size, softcap))
    launch = _VARLEN_LAUNCHES.get(signature)
    if launch is not None and _aligned((q, k, v) if out is None else (q, k, v, out)):
        total_q, heads, _ = q.shape
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
        lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
        slopes = _alibi_slopes(alibi_slopes, cu_seqlens_q.shape[0] - 1, heads, q.device)
        launch(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0), cu_seqlens_q,
               cu_seqlens_k, slopes, seqused_k)
        return (out, lse) if return_lse else out
    batch = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q4, k4, v4 = (t.unsqueeze(0) for t in (q, k, v))
    _check_qkv(q4, k4, v4)
    _check_seqused_k(seqused_k, batch, q)
    total_q, heads, head_dim = q.shape
    opts = _score_options(causal, softmax_scale, head_dim, window_size, softcap, alibi_slopes is not None,
                          varlen=True, seqused=seqused_k is not None)
    slopes = _alibi_slopes(alibi_slopes, batch, heads, q.device)
    if out is not None:
        _check_out("out", out, q, shape=tuple(q.shape))
        _check_layout("out", out.unsqueeze(0))
    _check_cuda("q", q)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0 or max_seqlen_q == 0:
        pass
    elif k.shape[0] == 0 or max_seqlen_k == 0:
        out.zero_()
        lse.fill_(math.inf)
    else:
        launch = _forward_launcher(q4, k4, opts, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        launch(q4, k4, v4, out.unsqueeze(0), lse.unsqueeze(0), cu_seqlens_q, cu_seqlens_k, slopes, seqused_k)
        _remember(_VARLEN_LAUNCHES, signature, launch)
    return (out, lse) if return_lse else out


# launches of validated argument signatures (``forward``'s fast path); cleared when full
_FORWARD_LAUNCHES: dict = {}
_VARLEN_LAUNCHES: dict = {}  # as _FORWARD_LAUNCHES, for ``varlen_forward``
_VARLEN_CALLS: dict = {}  # ``flash_attn_varlen_func``'s checked layouts (``_varlen_layout``)
_MAX_LAUNCHES = 4096


def _signature(tensors, options) -> tuple | None:
    """What validation and the kernel choice depend on, apart from the pointers (None: not tensors
    or options that cannot be a key). Options carry their types: causal=1 must not pass for
    causal=True. The kernel family ``force_arch`` or CUTE_ATTN_ARCH asks for is part of it: a call
    under force_arch("sm80") must not reuse the SM90 launch of an earlier call with the same shapes."""
    try:
        signature = (tuple((t.__class__, t.dtype, t.device, t.shape, t.stride()) for t in tensors)
                     + tuple((o.__class__, o) for o in options) + (dispatch.requested_kernel(),))
        hash(signature)
        return signature
    except (AttributeError, TypeError):
        return None


def _varlen_layout(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table,
                   alibi_slopes, options) -> tuple | None:
    """A varlen call's signature without its lengths: what its checks depend on apart from the
    batch size, the totals and max_seqlen, which a serving loop changes every step (the tensors'
    types, dtypes, devices and ranks, q's, k's and v's other dims and strides, the options). The
    checks that involve those lengths hold for this call (``_varlen_lengths_agree``), else None
    (as for arguments that cannot be a key): the caller then runs every check, which reports."""
    try:
        if not _varlen_lengths_agree(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                     block_table, alibi_slopes):
            return None
        layout = (tuple((t.__class__, t.dtype, t.device, t.shape[1:], t.stride()) for t in (q, k, v))
                  + tuple(None if t is None else (t.__class__, t.dtype, t.device, t.dim())
                          for t in (cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes))
                  + tuple((o.__class__, o) for o in options) + (dispatch.requested_kernel(),))
        hash(layout)
        return layout
    except (AttributeError, TypeError, IndexError):
        return None


def _varlen_lengths_agree(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table,
                          alibi_slopes) -> bool:
    """The checks of a varlen call (paged or not) that involve its batch size, totals or
    max_seqlen, for a call whose layout passed every other check: max_seqlen non-negative ints,
    one batch size for cu_seqlens, seqused_k, the block table and per-sequence ALiBi slopes, k and
    v of one length, the last dims of the int32 tensors contiguous, 16-byte aligned pointers."""
    batch = cu_seqlens_q.shape[0] - 1
    return (type(max_seqlen_q) is int and type(max_seqlen_k) is int and max_seqlen_q >= 0 and max_seqlen_k >= 0
            and batch >= 0 and cu_seqlens_k.shape == cu_seqlens_q.shape and k.shape[0] == v.shape[0]
            and (batch == 0 or cu_seqlens_q.stride(0) == 1 and cu_seqlens_k.stride(0) == 1)
            and (seqused_k is None or seqused_k.shape == (batch,) and (batch <= 1 or seqused_k.stride(0) == 1))
            and (block_table is None
                 or block_table.shape[0] == batch and (block_table.shape[1] <= 1 or block_table.stride(1) == 1))
            and (alibi_slopes is None or tuple(alibi_slopes.shape) in ((q.shape[1],), (batch, q.shape[1])))
            and _aligned((q, k, v)))


def _remember(launches: dict, signature, launch) -> None:
    if signature is not None:
        if len(launches) >= _MAX_LAUNCHES:
            launches.clear()
        launches[signature] = launch


def _aligned(tensors) -> bool:
    return all(t.data_ptr() % _ALIGN_BYTES == 0 for t in tensors)


def _op_window(window_size) -> tuple:
    """window_size as the custom ops' two ints (their schema has no tuple of ints)."""
    if isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        return tuple(window_size)
    return window_size, None  # interface checks reject it with its own message


def _launch_forward(q, k, v, out, lse, causal: bool, scale: float, traits=None) -> None:
    """Launch on validated tensors. ``traits`` overrides the table (tools/bench.py --sweep)."""
    opts = _score_options(causal, scale, q.shape[3])
    _forward_launcher(q, k, opts, traits, q.shape[1], k.shape[1])(q, k, v, out, lse, None, None, None)


def _forward_launcher(q, k, opts: _Scores, traits=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                      page_size: int = 0):
    """The launch for validated tensors shaped like q, k (varlen: batch 1, packed): a function
    of (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes[, seqused_k, block_table]).
    ``page_size``: k is a paged cache (the SM90 kernel's paged varlen: ``sm90_paged_varlen``)."""
    plan = dispatch.plan_for_device(q.device)
    key = compile_mod.forward_key(
        plan.target, _DTYPE_NAMES[q.dtype], q.shape[3], opts.causal, plan.smem_capacity, traits=traits,
        kernel=plan.kernel, seqlen=sm90_tier_seqlen(max_seqlen_q, max_seqlen_k, opts.causal), features=opts.features,
        page_size=page_size,
    )
    assert key.kernel == "sm90" or not opts.features.paged, "a paged cache's SM80 kernel: _decode_launcher"
    # (a cold start runs a kernel that compiles faster until this one is built: KernelCache.slot)
    kernel = compile_mod.forward_cache.slot(key) if traits is None else compile_mod.forward_cache.get(key)
    device, scale_log2 = q.device, opts.scale_log2
    extra, dynamic_tiles = (), False
    if key.kernel == "sm90":
        # causal tile order: a persistent grid goes head by head, one CTA per tile (or a dynamic
        # deal, which runs the same order) in L2-sized sections of heads (kernels/tile_scheduler.py)
        chosen = kernel.traits if traits is None else compile_mod.forward_cache.chosen(key)
        section, dynamic_tiles = 1, chosen.dynamic_tiles
        if opts.causal and (not chosen.persistent or dynamic_tiles):
            from cute_attn.traits import heads_per_section

            section = heads_per_section(max_seqlen_k, key.head_dim, q.element_size())
        extra = (plan.num_sms, section)
    scalars = opts.kernel_scalars(max_seqlen_q)
    # the SM80 kernel's decode arguments (KV cache, pages, split-KV: compiled out here)
    decode = (None, None, None, None, None, 1, None, 0) if key.kernel == "sm80" else ()

    def launch(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, seqused_k=None, block_table=None):
        with torch.cuda.device(device):
            # the SM90 kernel's tile counter (dynamic tiles: zero at every launch; else none) and
            # block table (paged; else none)
            counter = table = ()
            if extra:
                counter = (torch.zeros(1, dtype=torch.int32, device=device) if dynamic_tiles else None,)
                table = (block_table,)
            kernel(q, k, v, out, lse, scale_log2, *extra, *counter, cu_seqlens_q, cu_seqlens_k, seqused_k,
                   alibi_slopes, *scalars, *decode, *table)

    return launch


# ---------------------------------------------------------------------------- KV-cache decode, split-KV
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal: bool = False, window_size=(-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes=None, num_splits: int = 0,
                            return_softmax_lse: bool = False):
    """Attention of q over a KV cache, FlashAttention-2's ``flash_attn_with_kvcache`` (inference:
    no autograd).

    q (batch, seqlen_q, heads, d); k_cache/v_cache (batch_cache, seqlen_cache, heads_kv, d), or
    paged (num_pages, page_size, heads_kv, d) with block_table (batch, max_pages) int32 (any
    page_size; multiples of 64 keys are read a K/V block per page, others a page per row).
    Sequence b attends to cache rows cache_leftpad[b] : cache_seqlens[b] (+ seqlen_new) of cache
    row cache_batch_idx[b]; cache_seqlens None (the whole cache), an int or (batch,) int32. k/v
    (batch, seqlen_new, heads_kv, d), when given, are first written into the caches in place at
    rows cache_seqlens[b]:, rotated with rotary_cos/sin (seqlen_ro, rotary_dim / 2) when given (q
    too: at cache_seqlens[b] + i when causal or windowed, else at cache_seqlens[b];
    ``rotary_interleaved`` pairs columns (0, 1), (2, 3)... or GPT-NeoX's (j, j + rotary_dim / 2)).
    causal / window_size / softcap / alibi_slopes as ``forward``, over each sequence's keys
    (bottom-right aligned). num_splits: split-KV pieces (0: chosen by ``decode_num_splits``, 1:
    none; at most 128 and the number of K/V blocks). Returns out (like q) and, with
    return_softmax_lse, lse (batch, heads, seqlen_q) fp32. No host synchronisation: a decode step
    can be captured in a CUDA graph and replayed with new cache_seqlens values; new lengths never
    compile.
    """
    from cute_attn import kvcache

    if torch.compiler.is_compiling():  # traced as the custom op (integrations/custom_ops.py)
        from cute_attn.integrations import custom_ops as ops

        as_int = cache_seqlens if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool) else None
        out, lse = ops.fwd_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                   None if as_int is not None else cache_seqlens, as_int, cache_batch_idx,
                                   cache_leftpad, block_table, softmax_scale, causal, *_op_window(window_size),
                                   float(softcap), rotary_interleaved, alibi_slopes, num_splits)
        return (out, lse) if return_softmax_lse else out
    # a plain decode step like an earlier valid one (no append; same types, shapes, strides and
    # options) skips the checks and the kernel lookup: the per-token path of a serving loop
    fast = k is None and v is None and rotary_cos is None and rotary_sin is None
    if fast:
        tensors = (q, k_cache, v_cache)
        index = tuple(t for t in (cache_seqlens, cache_batch_idx, cache_leftpad, block_table, alibi_slopes)
                      if isinstance(t, torch.Tensor))
        options = (None if isinstance(cache_seqlens, torch.Tensor) else cache_seqlens, cache_batch_idx is None,
                   cache_leftpad is None, block_table is None, alibi_slopes is None, softmax_scale, causal,
                   window_size, softcap, num_splits, return_softmax_lse)
        signature = _signature(tensors + index, options)
        hit = _DECODE_LAUNCHES.get(signature)
        if hit is not None and _aligned(tensors):
            launch, seqused, leftpad, batch_idx, lse_shape = hit
            seqused = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else seqused
            leftpad = cache_leftpad if cache_leftpad is not None else leftpad
            batch_idx = cache_batch_idx if cache_batch_idx is not None else batch_idx
            slopes = None if alibi_slopes is None else _alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
            launch(q, k_cache, v_cache, out, lse, slopes, (seqused, leftpad, batch_idx, block_table))
            return (out, lse) if return_softmax_lse else out

    plan = kvcache.check_kvcache_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                      cache_batch_idx, cache_leftpad, block_table, rotary_interleaved, num_splits)
    opts = _score_options(causal, softmax_scale, plan.head_dim, window_size, softcap, alibi_slopes is not None)
    slopes = _alibi_slopes(alibi_slopes, plan.batch, plan.heads, q.device)
    if not isinstance(return_softmax_lse, bool):
        raise TypeError(f"return_softmax_lse must be a bool, got {type(return_softmax_lse).__name__}")
    _check_cuda("q", q)
    if plan.seqlen_new:  # the new keys into the caches (q rotated in the same pass)
        q = kvcache.append_kv(plan, k_cache, v_cache, k, v, rotary_cos, rotary_sin, rotary_interleaved=rotary_interleaved,
                              q=q, causal_or_local=_rotary_local(opts, plan.cache_len))
    device, batch = q.device, plan.batch
    seqused = plan.cache_seqlens + plan.seqlen_new if plan.seqlen_new else plan.cache_seqlens
    leftpad = plan.cache_leftpad if plan.cache_leftpad is not None else kvcache._filled(0, batch, device)
    batch_idx = plan.cache_batch_idx
    if batch_idx is None:
        batch_idx = kvcache._constant(("arange32", batch), device,
                                      lambda: torch.arange(batch, dtype=torch.int32, device=device))
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    lse = torch.empty((batch, plan.heads, plan.seqlen_q), dtype=torch.float32, device=device)
    if out.numel():
        # chunks of queries (chunked prefill) on Hopper: the SM90 forward; decode steps: the decode kernel
        launch = kvcache.sm90_kvcache_launcher(q, opts, plan)
        if launch is None:
            launch = _decode_launcher(q, k_cache, opts, plan.max_seqlen_k, plan.num_splits, kvcache=True,
                                      page_size=plan.page_size)
        launch(q, k_cache, v_cache, out, lse, slopes, (seqused, leftpad, batch_idx, plan.block_table))
        if fast and not torch.cuda.is_current_stream_capturing():
            _remember(_DECODE_LAUNCHES, signature, (launch, seqused, leftpad, batch_idx, tuple(lse.shape)))
    return (out, lse) if return_softmax_lse else out


_DECODE_LAUNCHES: dict = {}  # as _FORWARD_LAUNCHES, for ``flash_attn_with_kvcache`` without an append


def _rotary_local(opts: _Scores, cache_len: int) -> bool:
    """Whether a KV-cache call's queries are rotated at their own positions (causal or local) or
    all at cache_seqlens[b]: FlashAttention-2's rule, which first drops a window side that reaches
    the cache length (mha_fwd_kvcache), so a window wider than the cache on both sides is not local
    (its mask hides nothing either way). Found by tests/test_fuzz_gpu.py (windows of (1399, 1142)
    and (1153, 300) over caches of 211 and 256 rows: every query but the first rotated elsewhere)."""
    # a local kernel's edges: _UNBOUNDED for an open side, and 0 on the right when causal
    return opts.causal or (opts.features.local and min(opts.window_left, opts.window_right) < cache_len)


def decode_num_splits(ctas: int, n_blocks: int, slots: int, max_splits: int = 128, min_blocks: int = 4) -> int:
    """Split-KV pieces for a grid of ``ctas`` CTAs (Q blocks x heads x batch) whose longest walk is
    ``n_blocks`` K/V blocks, with ``slots`` CTAs per wave. Decoding is bound by reading K and V, so
    what counts is that every SM reads, each split keeping at least ``min_blocks`` K/V blocks so that
    its prologue and the merge stay small (``decode_min_blocks``): the most splits that still fit one
    wave when that wave is at least 90% as full as the best choice's (an extra wave measured slower
    at equal fullness), else the fewest splits whose last wave is (FlashAttention-2's rule of wave
    efficiency). Caches of fewer than 8 blocks never split (their call is mostly launch)."""
    if ctas >= slots or n_blocks < 8:
        return 1
    limit = max(1, min(max_splits, n_blocks // min_blocks))
    def efficiency(s):
        waves = ctas * s / slots
        return waves / math.ceil(waves)
    best = max(efficiency(s) for s in range(1, limit + 1))
    one_wave = min(limit, slots // ctas)
    if efficiency(one_wave) >= 0.9 * best:
        return one_wave
    return next(s for s in range(1, limit + 1) if efficiency(s) >= 0.9 * best)


def decode_min_blocks(merges_in_cta: bool, ctas: int, n_blocks: int, num_sms: int, slots: int) -> int:
    """The fewest K/V blocks per split (``decode_num_splits``) for ``ctas`` CTAs walking ``n_blocks``
    blocks with ``slots`` per wave: 4 where the combine kernel merges the splits (its launch and each
    split's prologue cost more than a block's read). Where the last split merges them in the kernel:
    1 with one CTA per SM; with two (paged-by-rows caches, one-stage kernels) 2 while those splits
    stay within one CTA per SM, else 4 (short splits that filled both slots lost to fewer, longer
    ones). Measured on H100 (B1 H32/8, TB/s, 4 blocks per split -> this rule; docs/performance.md):
    d128 dense Sk 512 0.18 -> 0.22, 1024 0.34 -> 0.41, 2048 0.66 -> 0.70, 3072 0.94 -> 0.97; d128
    16-key pages Sk 1024 0.29 -> 0.35, 2048 0.55 -> 0.63; d256 Sk 1024 0.50 -> 0.60; but 2 blocks per
    split on both slots: d256 Sk 4096 1.43 against 1.52, d128 16-key pages Sk 4096 0.95 against 0.96."""
    if not merges_in_cta:
        return 4
    if slots <= num_sms:
        return 1
    return 2 if n_blocks // 2 <= num_sms // ctas else 4


# The decode heuristic's wave: one CTA per SM. Two fit (traits.SM80_DECODE), but one streaming CTA
# per SM already reads at the copy rate, and filling both slots measured slower on the H100 (B1 H8
# Sk 131072: 30 splits 2.64 TB/s, 16 splits 2.79; B1 H32 Sk 8192: 8 splits 2.05, 4 splits 2.15;
# B16 Sq4 H32/8 Sk 16384: 2 splits 2.87, none 3.00; docs/performance.md).
_DECODE_CTAS_PER_SM = 1
# Two CTAs per SM where one keeps too few K/V bytes in flight: a cache read a page per row (pages of
# 1, 16, 48... keys: traits.pages_by_rows), whose CTAs wait on their block-table reads, and the
# one-stage kernels (d192, d256: SM80_DECODE). H100, shuffled pages of 16 / 1 keys at d128: B1 H8 Sk
# 131072 32 splits 2.66 / 2.59 TB/s against 16 splits 2.34 / 2.24; B16 Sq4 H32/8 Sk 16384 2 splits
# 2.84 / 2.75 against none 2.47 / 2.38; d64 B1 H8 2.23 / 2.18 against 1.71 / 1.68; d256 dense B1 H8
# 2.94 against 2.84, B16 Sq4 3.02 against 2.95 (d64 and d128 dense: 2.33 / 2.70 against 2.43 / 2.80;
# docs/performance.md).
_DECODE_CTAS_PER_SM_LATENCY_BOUND = 2
_SMEM_RESERVED_PER_CTA = 1024  # shared memory the driver keeps per CTA (ncu: shared_mem_per_block_driver)


def decode_slots(num_sms: int, traits, smem_capacity: int | None = None, page_size: int = 0) -> int:
    """The decode heuristic's CTAs per wave for the decode kernel ``traits`` over a cache of
    ``page_size``-key pages (0: dense): two per SM for paged-by-rows caches and one-stage kernels
    where two fit in ``smem_capacity``, else one."""
    from cute_attn.traits import pages_by_rows

    latency_bound = pages_by_rows(page_size) or traits.num_stages == 1
    two_fit = smem_capacity is None or 2 * (traits.smem_bytes() + _SMEM_RESERVED_PER_CTA) <= smem_capacity
    per_sm = _DECODE_CTAS_PER_SM_LATENCY_BOUND if latency_bound and two_fit else _DECODE_CTAS_PER_SM
    return num_sms * per_sm


def decode_merges_in_cta(tile_rows: int, num_warps: int) -> bool:
    """Whether a split decode launch whose tiles hold at most ``tile_rows`` rows merges its splits
    in the kernel (the SM80 forward's _merge_splits, when its row merge covers the rows in one pass:
    32 / SPLIT_MERGE_LANES_PER_ROW rows per warp) rather than in the combine kernel. The in-kernel
    merge saves the combine's launch and the gap before it (a decode step's 1-16 rows per tile); a
    tile of more rows would merge in serial passes of L2 round trips on one SM, where the combine
    kernel spreads the rows over the GPU."""
    return tile_rows <= 32 // SPLIT_MERGE_LANES_PER_ROW * num_warps


_SPLIT_COUNTERS: dict = {}  # (device index, stream) -> int32 counters, all zero between launches
_SPLIT_COUNTER_STREAMS = 64  # the most streams kept (a loop that makes a stream per step must not grow it)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (a CUDA build's; ~10x cheaper)


def _split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """At least ``tiles`` zeroed int32 counters for a split launch that merges in the kernel. Each
    launch leaves them at zero (a tile's last split resets its own), so the launches of a stream
    share one buffer in stream order and none pays a memset; a graph being captured gets a zeroed
    buffer of its own (the memset a node of the graph), since its replays may run on any stream."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    stream = _RAW_STREAM(device.index) if _RAW_STREAM else torch.cuda.current_stream(device).cuda_stream
    key = (device.index, stream)
    buf = _SPLIT_COUNTERS.get(key)
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        _SPLIT_COUNTERS.pop(key, None)
        while len(_SPLIT_COUNTERS) >= _SPLIT_COUNTER_STREAMS:  # the oldest stream's, freed to its own
            del _SPLIT_COUNTERS[next(iter(_SPLIT_COUNTERS))]  # stream's pool (safe in stream order)
        _SPLIT_COUNTERS[key] = buf
    return buf


def _decode_launcher(q, k, opts: _Scores, max_seqlen_k: int, num_splits: int, kvcache: bool, page_size: int = 0,
                     traits=None, varlen: tuple[int, int] | None = None):
    """The launch of the SM80-family decode kernel (split-KV, packed GQA, KV cache) for validated
    tensors shaped like q, k: a function of (q, k, v, out, lse, alibi_slopes, cache, cu_seqlens)
    with cache = (seqused_k, leftpad_k, kv_batch_idx, block_table) int32 tensors (kvcache) or None.
    ``num_splits`` 0: ``decode_num_splits``. ``traits``: a decode traits spec (tools/bench.py).
    ``varlen``: (batch, max_seqlen_q) of packed queries (q (1, total_q, heads, d), cu_seqlens =
    (cu_seqlens_q, cu_seqlens_k), keys counted by cache's seqused_k: kvcache.varlen_paged)."""
    from cute_attn.traits import sm80_decode_traits

    plan = dispatch.plan_for_device(q.device)
    batch, seqlen_q, heads, head_dim = q.shape
    grid_batch, grid_seqlen_q = varlen if varlen is not None else (batch, seqlen_q)
    heads_kv = k.shape[2]
    group = heads // heads_kv
    # the query heads of a K/V head share its tile rows (one read of each K/V block), unless ALiBi
    # (a slope per head); with one query head per K/V head the packed rows are the plain ones. The
    # choice depends on no length or head count, so a new shape never compiles (the split and
    # unsplit kernels are built together: compile.forward_tier_siblings)
    pack = not opts.features.alibi
    candidates = sm80_decode_traits(head_dim, plan.smem_capacity, page_size, spec=traits)
    tile_m, tile_n = candidates[0].tile_m, candidates[0].tile_n
    rows = grid_seqlen_q * (group if pack else 1)  # tile rows of one (sequence, head or K/V head)
    ctas = -(-rows // tile_m) * (heads_kv if pack else heads) * grid_batch
    n_blocks = -(-max_seqlen_k // tile_n)
    merges = decode_merges_in_cta(min(tile_m, rows), candidates[0].num_warps)  # where it splits
    if num_splits == 0:
        slots = decode_slots(plan.num_sms, candidates[0], plan.smem_capacity, page_size)
        num_splits = decode_num_splits(ctas, n_blocks, slots,
                                       min_blocks=decode_min_blocks(merges, ctas, n_blocks, plan.num_sms, slots))
    num_splits = max(1, min(num_splits, n_blocks, 128))
    split = num_splits > 1
    features = dataclasses.replace(opts.features, kvcache=kvcache, paged=page_size > 0, split=split, pack_gqa=pack,
                                   varlen=varlen is not None, seqused=varlen is not None)
    key = compile_mod.forward_key(plan.target, _DTYPE_NAMES[q.dtype], head_dim, opts.causal, plan.smem_capacity,
                                  traits=candidates, features=features, page_size=page_size)
    kernel = compile_mod.forward_cache.get(key)
    merge_in_cta = split and merges
    combine = None
    if split:  # (fetched even where the kernel merges: another length must not compile it later)
        combine = compile_mod.combine_cache.get(compile_mod.combine_key(plan.target, _DTYPE_NAMES[q.dtype], head_dim))
    device, scale_log2 = q.device, opts.scale_log2
    scalars = opts.kernel_scalars(grid_seqlen_q)
    f32 = dict(dtype=torch.float32, device=device)
    global last_decode_splits
    last_decode_splits = num_splits

    def launch(q, k, v, out, lse, alibi_slopes, cache, cu_seqlens=(None, None)):
        seqused, leftpad, batch_idx, table = cache if cache is not None else (None, None, None, None)
        o_accum = lse_accum = counters = None
        if split:
            o_accum = torch.empty((num_splits, batch, seqlen_q, heads, head_dim), **f32)
            lse_accum = torch.empty((num_splits, batch, heads, seqlen_q), **f32)
            counters = _split_counters(device, ctas)
        with torch.cuda.device(device):
            kernel(q, k, v, out, lse, scale_log2, *cu_seqlens, seqused, alibi_slopes, *scalars, leftpad, batch_idx,
                   table, o_accum, lse_accum, num_splits, counters, int(merge_in_cta))
            if split and not merge_in_cta:
                combine(o_accum, lse_accum, out, lse)

    return launch


last_decode_splits = 0  # the split count of the last decode launcher built (tools/bench.py prints it)


# ---------------------------------------------------------------------------- backward
def _check_like(name: str, t, like: torch.Tensor) -> None:
    """A gradient-sized tensor: same shape, dtype and device as ``like``, valid strides."""
    _check_out(name, t, like)


def _check_lse(lse, q: torch.Tensor, shape=None) -> None:
    batch, seqlen_q, heads, _ = q.shape
    shape = (batch, heads, seqlen_q) if shape is None else shape
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must be float32, got {lse.dtype}")
    if tuple(lse.shape) != shape:
        raise ValueError(f"lse must have shape {shape}, got {tuple(lse.shape)}")
    if lse.device != q.device:
        raise ValueError(f"lse must be on {q.device}, got {lse.device}")
    if shape[-1] > 1 and lse.stride(-1) != 1:
        raise ValueError(f"lse must be contiguous in its last dim, got strides {lse.stride()}")


def backward(dout, q, k, v, out, lse, *, causal: bool = False, softmax_scale: float | None = None,
             window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
             dq=None, dk=None, dv=None):
    """Gradients (dq, dk, dv) of ``forward`` for the output gradient ``dout``.

    ``out`` and ``lse`` are what ``forward(..., return_lse=True)`` returned for these q, k, v and
    options (causal, softmax_scale, window_size, softcap, alibi_slopes: the same as the forward's);
    attention is recomputed from them block by block (no S x S matrix). ``deterministic=True``
    adds each K/V block's share of dq in a fixed order, so repeated calls are bitwise identical.
    dq/dk/dv may be given to write into; otherwise they are allocated like q/k/v. With GQA/MQA,
    dk and dv are summed over the query heads that share each K/V head.
    """
    if torch.compiler.is_compiling() and dq is None and dk is None and dv is None:
        from cute_attn.integrations import custom_ops as ops

        return ops.bwd(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, *_op_window(window_size),
                       float(softcap), alibi_slopes)
    given = tuple(t for t in (dq, dk, dv) if t is not None)
    tensors = (dout, q, k, v, out, lse) + given
    # (dq, dk, dv) given or not, in the signature: which of them a fast call must allocate
    # (and the tests' Stream-K count, STREAM_K_BLOCKS: a launcher is built for each)
    options = (causal, softmax_scale, window_size, softcap, alibi_slopes is None, deterministic,
               dq is None, dk is None, dv is None, STREAM_K_BLOCKS)
    signature = _signature(tensors + (() if alibi_slopes is None else (alibi_slopes,)), options)
    launch = _BACKWARD_LAUNCHES.get(signature)
    if launch is not None and _aligned(tensors):
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if dq is None else dq
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dk is None else dk
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if dv is None else dv
        slopes = None if alibi_slopes is None else _alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device)
        launch(dout, q, k, v, out, lse, dq, dk, dv, None, None, slopes)
        return dq, dk, dv

    _check_qkv(q, k, v)
    _check_like("out", out, q)
    _check_like("dout", dout, q)
    _check_lse(lse, q)
    opts = _score_options(causal, softmax_scale, q.shape[3], window_size, softcap, alibi_slopes is not None)
    slopes = _alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device)
    dq, dk, dv = _gradient_buffers(q, k, v, dq, dk, dv, deterministic)
    if q.numel() == 0 or k.numel() == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv
    launch = _backward_launcher(q, k, opts, deterministic, max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1])
    launch(dout, q, k, v, out, lse, dq, dk, dv, None, None, slopes)
    _remember(_BACKWARD_LAUNCHES, signature, launch)
    return dq, dk, dv


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                    causal: bool = False, softmax_scale: float | None = None, window_size=(-1, -1),
                    softcap: float = 0.0, alibi_slopes=None, seqused_k=None, deterministic: bool = False, dq=None,
                    dk=None, dv=None):
    """``backward`` for ``varlen_forward``: dout/q/out (total_q, heads, head_dim), k/v (total_k,
    heads_kv, head_dim), lse (heads, total_q); returns (dq, dk, dv) shaped like q, k, v (with
    seqused_k, the rows of the keys no sequence uses get zero dk and dv)."""
    batch = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q4, k4, v4 = (t.unsqueeze(0) for t in (q, k, v))
    _check_qkv(q4, k4, v4)
    _check_seqused_k(seqused_k, batch, q)
    _check_like("out", out, q)
    _check_like("dout", dout, q)
    _check_lse(lse, q4, shape=(q.shape[1], q.shape[0]))
    opts = _score_options(causal, softmax_scale, q.shape[2], window_size, softcap, alibi_slopes is not None,
                          varlen=True, seqused=seqused_k is not None)
    slopes = _alibi_slopes(alibi_slopes, batch, q.shape[1], q.device)
    dq, dk, dv = _gradient_buffers(q, k, v, dq, dk, dv, deterministic)
    if seqused_k is not None:  # the kernels write the used keys' rows only
        dk.zero_(), dv.zero_()
    if q.numel() == 0 or k.numel() == 0 or batch == 0 or max_seqlen_q == 0 or max_seqlen_k == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv
    launch = _backward_launcher(q4, k4, opts, deterministic, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                batch=batch)
    launch(dout.unsqueeze(0), q4, k4, v4, out.unsqueeze(0), lse.unsqueeze(0), dq.unsqueeze(0), dk.unsqueeze(0),
           dv.unsqueeze(0), cu_seqlens_q, cu_seqlens_k, slopes, seqused_k)
    return dq, dk, dv


def _gradient_buffers(q, k, v, dq, dk, dv, deterministic):
    """The last checks of a backward call (deterministic, the given gradient buffers, the device)
    and (dq, dk, dv): the given ones, the others allocated like q, k, v."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if t is not None:
            _check_out(name, t, like)
    _check_cuda("q", q)
    return tuple(torch.empty(like.shape, dtype=like.dtype, device=like.device) if t is None else t
                 for t, like in ((dq, q), (dk, k), (dv, v)))


_BACKWARD_LAUNCHES: dict = {}  # as _FORWARD_LAUNCHES, for ``backward``


def _launch_backward(dout, q, k, v, out, lse, dq, dk, dv, causal, scale, deterministic, traits=None) -> None:
    """Launch on validated tensors. ``traits`` overrides the table (tools/bench.py --bwd-sweep)."""
    opts = _score_options(causal, scale, q.shape[3])
    _backward_launcher(q, k, opts, deterministic, traits, q.shape[1], k.shape[1])(
        dout, q, k, v, out, lse, dq, dk, dv, None, None, None)


def _backward_keys(plan, q, opts: _Scores, deterministic: bool, traits=None):
    """(preprocess, main) keys of the backward for q (batch, seqlen, heads, head_dim) and opts."""
    return compile_mod.backward_keys(plan.target, _DTYPE_NAMES[q.dtype], q.shape[3], opts.causal, deterministic,
                                     traits=traits, kernel=plan.kernel, smem_capacity=plan.smem_capacity,
                                     features=opts.features)


_PREFETCHED: set = set()  # configurations whose backward _prefetch_backward has asked for


def _prefetch_backward(q, causal, softmax_scale, deterministic, window_size, softcap, alibi_slopes,
                       varlen: bool = False, seqused: bool = False) -> None:
    """An autograd forward's backward will follow: have its kernels compiled meanwhile, beside the
    forward's own first compile (in a background process when the disk cache is on,
    compile.KernelCache.prefetch), so the first backward loads them. Called before the forward
    (which validates everything): a bad option is left for the forward to report. Once per
    configuration: later calls cost one set lookup."""
    try:
        seen = (q.device, q.dtype, q.shape[-1], causal, bool(deterministic), tuple(window_size), softcap,
                alibi_slopes is None, varlen, seqused, dispatch.requested_kernel())
        if seen in _PREFETCHED:
            return
        _PREFETCHED.add(seen)
    except TypeError:  # unhashable options: the forward reports them
        return
    try:
        opts = _score_options(causal, softmax_scale, q.shape[-1], window_size, softcap, alibi_slopes is not None,
                              varlen=varlen, seqused=seqused)
        if not q.is_cuda or q.dtype not in _DTYPE_NAMES:
            return
        pre, main = _backward_keys(dispatch.plan_for_device(q.device), q.unsqueeze(0) if varlen else q, opts,
                                   bool(deterministic))
    except Exception:  # noqa: BLE001  (a prefetch never fails the call; the forward reports bad input)
        return
    if main not in compile_mod.backward_cache:  # (with its long-sequence tier, if any)
        compile_mod.backward_cache.prefetch([pre, *compile_mod.backward_tier_siblings(main)], now_otherwise=False)


def backward_head_splits(num_seqs: int, heads: int, heads_kv: int, kv_blocks: int, max_kv_blocks: int, causal: bool,
                         num_sms: int, accumulate: bool = False, varlen: bool = False) -> int:
    """In how many CTAs the SM90 backward splits the query heads of one K/V head (GQA): 1 keeps a
    K/V head's query heads in one CTA, which sums their dK and dV in registers; ``s`` > 1 gives
    each of s CTAs group / s query heads, whose dK and dV are added into fp32 accumulators
    (``accumulate``: compile.sm90_split_dkv_fp32, not deterministic) or written per split and
    summed by the host.

    One CTA per K/V block walks the Q blocks of all its query heads, so under causal GQA a
    sequence's K/V block 0 walks group * n_blocks Q-block rows, against an SM's share of the whole
    grid's rows of about group * heads_kv * (kv_blocks + num_seqs) / (2 * SMs), where
    ``kv_blocks`` counts the K/V blocks of every sequence (batch * n_blocks dense; varlen: the
    total keys over the block size, known without reading cu_seqlens) and ``max_kv_blocks`` those
    of the longest. Their ratio for the longest sequence, imbalance = 2 * SMs / (heads_kv *
    (kv_blocks + num_seqs)), taken over the splits is best at about 1/4: s is the power of two
    nearest 4 * imbalance (at least 2 from 64 K/V blocks: long CTAs), the largest divisor of the
    group not above it. Measured on H100 (2026-11-26, docs/performance.md, "GQA backward"),
    causal, 16k tokens, dense and varlen (random lengths 128-4096), splits 1/2/4/8: d128 G8
    (imbalance ~0.95) best at 4 everywhere (varlen +31-37% over 1, dense +6% over 8), d128 G4 and
    d64 G8 (~0.5) at 2 (+2-6%), d64 G4 (~0.25) at 1 (2 lost up to 9% at S 2048, gained 2.5% at
    S 8192). Non-causal CTAs of one sequence are alike: dense batches never split (d128 G8 8 x
    2048: 4 splits -8%, 2 x 8192: 2 splits +1%; G4 and d64 lose 1-8%), and neither did varlen ones
    while the splits' dK, dV were summed by the host (-1% to -10%). With the fp32 accumulators, a
    varlen batch of group >= 8, whose longest sequences' CTAs walk group x their Q blocks, runs
    4 splits (H100, 2026-11-26, random lengths 128-4096: d128 G8 +5%, +5%, -1% on three batches;
    in a first version that added from registers, d64 G8 -2% to +1% and G4 -1% to -6%; with the
    rule, the bench's batch: d128 G8 465 -> 509 TFLOP/s, d64 G8 451 -> 455)."""
    group = heads // heads_kv
    if group == 1:
        return 1
    if not causal:
        return max(s for s in (1, 2, 4) if group % s == 0) if accumulate and varlen and group >= 8 else 1
    imbalance = 2 * num_sms / max(heads_kv * (kv_blocks + num_seqs), 1)
    target = 1 << max(0, round(math.log2(max(4 * imbalance, 1e-9))))
    if max_kv_blocks >= 64:
        target = max(target, 2)
    return max(s for s in range(1, group + 1) if group % s == 0 and s <= target)


def _longest_first(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The sequences of a varlen batch by length, longest first (int32, on the device: no host
    sync). The SM90 backward of a non-causal varlen batch runs its grid's batch index b on sequence
    order[b]: its CTAs walk all of their sequence's Q blocks, so the hardware, which starts CTAs in
    grid order, then starts the longest first and ends on short ones (H100, 2026-11-26: +1-8%;
    causal batches, whose CTAs of one sequence differ, measured -3..+3% and keep their order)."""
    return torch.argsort(cu_seqlens.diff(), descending=True, stable=True).to(torch.int32)


# tests set this to fill the backward's scratch buffers with NaN (where the kernels must write
# before they read, an unwritten row shows up as NaN in the gradients)
POISON_SCRATCH = False
# tests: the blocks the SM90 backward's Stream-K CTAs share where its kernel has them (None: the
# rule, traits.stream_k_blocks; the count is capped at the grid's and needs a unit per CTA)
STREAM_K_BLOCKS: int | None = None


def _scratch(shape, **kwargs) -> torch.Tensor:
    """An uninitialised buffer, or one of NaN under ``POISON_SCRATCH``."""
    return torch.full(shape, float("nan"), **kwargs) if POISON_SCRATCH else torch.empty(shape, **kwargs)


def _stream_k_deal(traits, q, k, num_sms: int) -> tuple[int, int]:
    """(the blocks its Stream-K CTAs share, the (query head, Q block) steps per block) of an SM90
    backward with Stream-K ``traits`` over dense q, k: traits.stream_k_blocks' rule, or the tests'
    STREAM_K_BLOCKS, capped at the grid's blocks and only where every Stream-K CTA gets a step."""
    from cute_attn.traits import stream_k_blocks

    blocks = -(-k.shape[1] // traits.tile_n) * k.shape[2] * q.shape[0]
    per_block = q.shape[2] // k.shape[2] * -(-q.shape[1] // traits.tile_m)
    if STREAM_K_BLOCKS is None:
        return stream_k_blocks(blocks, per_block, num_sms), per_block
    return (min(STREAM_K_BLOCKS, blocks) if STREAM_K_BLOCKS * per_block >= num_sms else 0), per_block


def _backward_launcher(q, k, opts: _Scores, deterministic: bool, traits=None, max_seqlen_q: int = 0,
                       max_seqlen_k: int = 0, batch: int | None = None):
    """The pre/main/post launches for validated tensors shaped like q, k (varlen: batch 1, packed,
    and ``batch`` sequences): a function of (dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q,
    cu_seqlens_k, alibi_slopes[, seqused_k])."""
    from cute_attn.traits import (SM90_BACKWARD_LONG_SEQLEN, STREAM_K_ROW, backward_padded_rows, stream_k_items,
                                  varlen_padded_rows)

    plan = dispatch.plan_for_device(q.device)
    pre, main = _backward_keys(plan, q, opts, deterministic, traits)
    if traits is None and max_seqlen_q >= SM90_BACKWARD_LONG_SEQLEN:  # the long-sequence tier, if any
        main = compile_mod.backward_long_key(main) or main
    cache = compile_mod.backward_cache
    chosen = cache.chosen(main)
    if chosen.smem_bytes() > plan.smem_capacity:
        # the backward traits are sized for H100/A100; smaller GPUs (sm_86/89) get a clear error
        raise NotImplementedError(
            f"the backward for head_dim {q.shape[3]} needs {chosen.smem_bytes() // 1024} KB of shared memory per "
            f"block; this GPU offers {plan.smem_capacity // 1024} KB"
        )
    post = compile_mod.backward_post_key(main, chosen)
    _, rows_q, heads, _ = q.shape
    varlen = opts.features.varlen
    if varlen:  # each sequence's rows start at a multiple of 128 (kernels/seqlen_info.py)
        rows_pad, num_seqs = varlen_padded_rows(rows_q, batch), batch
    else:
        rows_pad, num_seqs = backward_padded_rows(rows_q, chosen.tile_m), q.shape[0]
    sem_blocks = -(-max_seqlen_q // chosen.tile_m)
    device, head_dim = q.device, main.head_dim
    f32 = dict(dtype=torch.float32, device=device)
    scale, scale_log2 = opts.scale, opts.scale_log2
    scalars = opts.kernel_scalars(max_seqlen_k)
    sm90 = main.kernel == "sm90"
    splits, fp32_splits = 1, False
    if sm90:
        # the SM90 kernels also take the number of SMs (a persistent grid's size) and the query-head
        # splits of a K/V head, which follow the shapes alone (varlen: the keys of all sequences and
        # the longest one's stand for the batch's; a window is a local kernel with causal off, its
        # K/V blocks see alike numbers of Q blocks, so it never splits)
        total_keys = k.shape[1] * (1 if varlen else k.shape[0])
        fp32_splits = compile_mod.sm90_split_dkv_fp32(chosen)
        splits = backward_head_splits(num_seqs, heads, k.shape[2], -(-total_keys // chosen.tile_n),
                                      -(-max_seqlen_k // chosen.tile_n), opts.causal, plan.num_sms,
                                      fp32_splits and not deterministic, varlen)
        scalars = (*scalars, plan.num_sms, splits)
    # the Stream-K tier (traits.SM90_BACKWARD_STREAM_K) where the grid's last round leaves SMs idle
    # long enough (traits.stream_k_blocks; the tier is built with the main kernel); explicit
    # Stream-K traits follow the same rule
    sk_blocks = 0
    tier = compile_mod.backward_stream_k_key(main) if sm90 and traits is None and splits == 1 else None
    candidate = cache.chosen(tier) if tier is not None else chosen
    if sm90 and splits == 1 and getattr(candidate, "stream_k", False) and candidate.tile_m == chosen.tile_m:
        sk_blocks, per_block = _stream_k_deal(candidate, q, k, plan.num_sms)
        if sk_blocks and tier is not None:  # (the same dQ layout: the postprocess stays)
            main, chosen = tier, candidate
    # each Stream-K CTA's items, dealt here once per launcher (traits.stream_k_items) and copied from
    # pinned memory without a sync, which a CUDA graph capture can hold (the pinned rows live as
    # long as the launcher)
    sk_rows = sk_items = None
    if sm90 and chosen.stream_k:
        sk_rows = torch.tensor(stream_k_items(per_block, sk_blocks, plan.num_sms) if sk_blocks else [[0] * STREAM_K_ROW],
                               dtype=torch.int32).pin_memory()
        sk_items = sk_rows.to(q.device, non_blocking=True)
    kernels = cache.get(pre), cache.get(main), cache.get(post)
    # split heads' dK, dV: in fp32 where the kernel takes them (added into accumulators, or,
    # deterministic, per split), else per split in the input dtype; summed (per split) and rounded
    # below. Unsplit, such a kernel gets a placeholder it never touches
    split_fp32, split_in_dtype = fp32_splits and splits > 1, not fp32_splits and splits > 1
    split_heads = k.shape[2] * (splits if deterministic else 1)
    no_split = torch.empty((2, 1, 1, 1, head_dim), **f32) if fp32_splits and splits == 1 else None
    ordered = sm90 and varlen and not opts.causal  # the sequences' order, longest first, per call
    sem_elems = num_seqs * heads * sem_blocks
    # a Stream-K kernel with no block to deal out gets placeholders it never touches (as no_split)
    sk_idle = (0, None, None, None)
    if sm90 and chosen.stream_k and not sk_blocks:
        sk_idle = (0, torch.empty((1, 2, chosen.tile_n * head_dim), **f32),
                   torch.zeros(1, dtype=torch.int32, device=device), sk_items)

    def launch(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes, seqused_k=None):
        dk_out, dv_out, dkv_split = dk, dv, no_split
        if split_fp32:  # (zeroed: accumulators; per split, the rows of unused keys stay 0)
            alloc = torch.zeros if not deterministic or seqused_k is not None else torch.empty
            dkv_split = alloc((2, *k.shape[:-2], split_heads, head_dim), **f32)
        elif split_in_dtype:  # per-split dK, dV (each K/V head's query heads in ``splits`` CTAs), summed below
            # (zeroed with seqused_k: the kernel leaves the rows of unused keys unwritten)
            alloc = torch.empty if seqused_k is None else torch.zeros
            dk_out, dv_out = (alloc((*t.shape[:-2], t.shape[-2] * splits, t.shape[-1]), dtype=t.dtype, device=device)
                              for t in (dk, dv))
        lse_log2 = torch.empty((q.shape[0], heads, rows_pad), **f32)
        delta = torch.empty((q.shape[0], heads, rows_pad), **f32)
        # SM80: zeroed by the preprocess; SM90: each Q block's first share is stored, not added
        dq_accum = _scratch((q.shape[0], heads, rows_pad, head_dim), **f32)
        sk_args = sk_idle
        if deterministic or sm90:  # a semaphore per Q block (SM90: its first share's ticket)
            # Stream-K: then a flag per Stream-K CTA, zeroed with them, and the workspace of their dK, dV
            flags = torch.zeros(sem_elems + (plan.num_sms if sk_blocks else 0), dtype=torch.int32, device=device)
            sem = flags[:sem_elems].view(num_seqs, heads, sem_blocks)
            if sk_blocks:
                work = torch.empty((plan.num_sms, 2, chosen.tile_n * head_dim), **f32)
                sk_args = (sk_blocks, work, flags[sem_elems:], sk_items)
        else:
            sem = torch.empty((1, 1, 1), dtype=torch.int32, device=device)
        with torch.cuda.device(device):
            kernels[0](out, dout, lse, lse_log2, delta, dq_accum, cu_seqlens_q, max_seqlen_q)
            kernels[1](q, k, v, dout, lse_log2, delta, dq_accum, dk_out, dv_out, sem, scale, scale_log2,
                       cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, *scalars,
                       *((_longest_first(cu_seqlens_q) if ordered else None, dkv_split, *sk_args) if sm90 else ()))
            kernels[2](dq_accum, dq, *((sem,) if sm90 else ()), scale, cu_seqlens_q, max_seqlen_q)
            if split_fp32:
                if deterministic:  # the splits' tiles, summed in a fixed order
                    dkv_split = dkv_split.unflatten(-2, (k.shape[2], splits)).sum(-2)
                for i, grad in enumerate((dk, dv)):
                    grad.copy_(dkv_split[i, ..., :grad.shape[-1]])
            elif split_in_dtype:
                for full, parts in ((dk, dk_out), (dv, dv_out)):
                    torch.sum(parts.unflatten(-2, (full.shape[-2], splits)), dim=-2, out=full)

    launch.stream_k_rows = sk_rows  # (held with the launcher: a captured graph copies from them)
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
    def forward(ctx, q, k, v, causal, softmax_scale, deterministic, window_size, softcap, alibi_slopes):
        _prefetch_backward(q, causal, softmax_scale, deterministic, window_size, softcap, alibi_slopes)
        out, lse = forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                           softcap=softcap, alibi_slopes=alibi_slopes, return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                           alibi_slopes=alibi_slopes, deterministic=deterministic)
        ctx.arch = dispatch.forced_kernel()  # the backward runs in autograd's thread: force it there too
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # (no zero gradient of lse built per backward call)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:  # (grads are not materialised: out took no part in what is differentiated)
            return (None,) * 9
        q, k, v, out, lse = ctx.saved_tensors
        with dispatch.force_arch(ctx.arch):
            dq, dk, dv = backward(_grad_ready(dout), q, k, v, out, lse, **ctx.options)
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None) + (None,) * 6


class VarlenFlashAttnFunc(torch.autograd.Function):
    """``FlashAttnFunc`` for packed variable-length batches (``flash_attn_varlen_func``)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                deterministic, window_size, softcap, alibi_slopes, seqused_k):
        _prefetch_backward(q, causal, softmax_scale, deterministic, window_size, softcap, alibi_slopes, varlen=True,
                           seqused=seqused_k is not None)
        out, lse = varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                  softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                  alibi_slopes=alibi_slopes, seqused_k=seqused_k, return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.lengths = (max_seqlen_q, max_seqlen_k)
        ctx.options = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                           alibi_slopes=alibi_slopes, seqused_k=seqused_k, deterministic=deterministic)
        ctx.arch = dispatch.forced_kernel()
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # (no zero gradient of lse built per backward call)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 14
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        with dispatch.force_arch(ctx.arch):
            dq, dk, dv = varlen_backward(_grad_ready(dout), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                         *ctx.lengths, **ctx.options)
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None) + (None,) * 11


def _check_fa2_options(dropout_p, return_attn_probs, deterministic) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout is not implemented in cute_attn: dropout_p must be 0.0, got {dropout_p}")
    for name, flag in (("deterministic", deterministic), ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def _returned(out, lse, return_attn_probs: bool, return_lse: bool):
    """FlashAttention-2's return convention: (out, lse, None) with return_attn_probs (no dropout, so
    no probabilities are kept); cute_attn's own ``return_lse`` gives (out, lse)."""
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if return_lse else out


def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                    window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                    return_attn_probs: bool = False, *, return_lse: bool = False):
    """``forward`` with autograd, with FlashAttention-2's signature and positional order, so that
    ``flash_attn_func(q, k, v, 0.0, scale, True)`` works as there:
    ``out = flash_attn_func(q, k, v, causal=True); out.sum().backward()``.

    dropout_p must be 0.0 (no dropout: NotImplementedError otherwise). ``return_attn_probs=True``
    returns (out, lse, None) as FlashAttention-2 does without dropout; ``return_lse=True`` returns
    (out, lse). Memory stays linear in the sequence length: only q, k, v, out and lse are saved.
    Under torch.compile it is the custom ops ``torch.ops.cute_attn.fwd`` / ``bwd``
    (integrations/custom_ops.py), which trace without graph breaks; eager calls take the
    autograd.Function above, skipping the dispatcher hop and the op's registered autograd.
    """
    # the arguments the op schema would otherwise reject with its own messages
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_kind(name, t)
    _check_fa2_options(dropout_p, return_attn_probs, deterministic)
    _score_options(causal, softmax_scale, q.shape[3], window_size, softcap)
    if torch.compiler.is_compiling():
        from cute_attn.integrations import custom_ops as ops

        scale = None if softmax_scale is None else float(softmax_scale)
        out, lse = ops.fwd(q, k, v, causal, scale, deterministic, *window_size, float(softcap), alibi_slopes)
    else:
        out, lse = FlashAttnFunc.apply(q, k, v, causal, softmax_scale, deterministic, tuple(window_size), softcap,
                                       alibi_slopes)
    return _returned(out, lse, return_attn_probs, return_lse)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                           dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                           window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                           deterministic: bool = False, return_attn_probs: bool = False, block_table=None, *,
                           seqused_k=None, return_lse: bool = False):
    """``varlen_forward`` with autograd, with FlashAttention-2's signature and positional order:
    q (total_q, heads, head_dim), k/v (total_k, heads_kv, head_dim), cu_seqlens_q/k int32
    (batch + 1,) on the device, max_seqlen_q/k ints; keyword ``seqused_k`` as FlashAttention-3's
    (int32 (batch,): the keys each sequence attends to). Returns out (total_q, heads, head_dim);
    the lse (heads, total_q) with ``return_attn_probs`` ((out, lse, None)) or ``return_lse``.

    ``block_table`` (FlashAttention-2's paged varlen call, as vLLM's chunked prefill makes it): k/v
    are paged caches (num_pages, page_size, heads_kv, head_dim), sequence b's keys the first
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] (or seqused_k[b]) positions of the pages
    block_table[b] (int32 (batch, max_pages)) lists. Inference only: no autograd (q, k or v that
    require grad raise NotImplementedError); runs the KV-cache decode kernel with packed queries
    (``kvcache.varlen_paged``)."""
    # a call of a layout an earlier valid one had skips these checks but for its lengths' (a
    # serving loop's steps differ in batch, totals and max_seqlen only; not while torch.compile
    # traces the call, which runs them once)
    layout = None
    if not torch.compiler.is_compiling():
        layout = _varlen_layout(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, block_table,
                                alibi_slopes, (dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                                               return_attn_probs))
    if layout is None or layout not in _VARLEN_CALLS:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        _check_fa2_options(dropout_p, return_attn_probs, deterministic)
        batch = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              paged=block_table is not None)
        _check_seqused_k(seqused_k, batch, q)
        _score_options(causal, softmax_scale, q.shape[2], window_size, softcap)
        _remember(_VARLEN_CALLS, layout, True)
    if block_table is not None and torch.compiler.is_compiling():  # the custom op (integrations/custom_ops.py)
        from cute_attn.integrations import custom_ops as ops

        scale = None if softmax_scale is None else float(softmax_scale)
        out, lse = ops.fwd_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                                        seqused_k, scale, causal, *window_size, float(softcap), alibi_slopes)
        return _returned(out, lse, return_attn_probs, return_lse)
    if block_table is not None:
        from cute_attn import kvcache

        out, lse = kvcache.varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                                        seqused_k, softmax_scale=softmax_scale, causal=causal,
                                        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                        call_layout=layout)
        return _returned(out, lse, return_attn_probs, return_lse)
    if torch.compiler.is_compiling():
        from cute_attn.integrations import custom_ops as ops

        scale = None if softmax_scale is None else float(softmax_scale)
        out, lse = ops.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                                  deterministic, *window_size, float(softcap), alibi_slopes, seqused_k)
    else:
        out, lse = VarlenFlashAttnFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                             softmax_scale, deterministic, tuple(window_size), softcap, alibi_slopes,
                                             seqused_k)
    return _returned(out, lse, return_attn_probs, return_lse)


# ---------------------------------------------------------------------------- packed q/k/v
def _unpack(name: str, packed, parts: int, varlen: bool) -> tuple:
    """The views of FlashAttention-2's packed ``qkv`` (parts 3) or ``kv`` (parts 2): (batch,
    seqlen, parts, heads, head_dim), varlen (total, parts, heads, head_dim)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    rows = "total" if varlen else "batch, seqlen"
    if packed.dim() != (4 if varlen else 5) or packed.shape[-3] != parts:
        raise ValueError(f"{name} must have shape ({rows}, {parts}, heads, head_dim), got {tuple(packed.shape)}")
    return packed.unbind(-3)


def _packed_autograd(q, packed: torch.Tensor) -> bool:
    """Whether a packed call runs ``PackedFlashAttnFunc``: eager, with gradients to compute.
    Otherwise it is the unpacked call on views (under torch.compile the custom ops, whose
    gradients the compiled graph gathers into the packed tensor itself)."""
    return (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and (packed.requires_grad or (q is not None and q.requires_grad)))


def _packed_gradient(packed: torch.Tensor) -> torch.Tensor:
    """The packed tensor's gradient buffer, which the backward fills through views (a hook for
    the GPU tests, which poison it)."""
    return torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)


class PackedFlashAttnFunc(torch.autograd.Function):
    """Autograd for FlashAttention-2's packed entry points: q, k, v are views of ``qkv`` (``q``
    None) or of ``q`` and ``kv``, and the backward writes dq, dk, dv straight into views of one
    gradient buffer per packed tensor, so no gradient is copied or summed into place (autograd of
    the views would allocate a zero buffer per view and add them)."""

    @staticmethod
    def forward(ctx, q, packed, cu_seqlens_q, cu_seqlens_k, lengths, options, deterministic):
        q_, k, v = (q, *packed.unbind(-3)) if q is not None else packed.unbind(-3)
        varlen = cu_seqlens_q is not None
        _prefetch_backward(q_, options["causal"], options["softmax_scale"], deterministic, options["window_size"],
                           options["softcap"], options["alibi_slopes"], varlen=varlen)
        if varlen:
            out, lse = varlen_forward(q_, k, v, cu_seqlens_q, cu_seqlens_k, *lengths, return_lse=True, **options)
        else:
            out, lse = forward(q_, k, v, return_lse=True, **options)
        ctx.save_for_backward(q, packed, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.lengths, ctx.options, ctx.deterministic = lengths, options, deterministic
        ctx.arch = dispatch.forced_kernel()
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # (no zero gradient of lse built per backward call)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return (None,) * 7
        q, packed, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        dpacked = _packed_gradient(packed)
        if q is None:
            (q, k, v), (dq, dk, dv) = packed.unbind(-3), dpacked.unbind(-3)
        else:
            (k, v), (dk, dv) = packed.unbind(-3), dpacked.unbind(-3)
            dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        grads = dict(dq=dq, dk=dk, dv=dv, deterministic=ctx.deterministic, **ctx.options)
        with dispatch.force_arch(ctx.arch):
            if cu_seqlens_q is not None:
                varlen_backward(_grad_ready(dout), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.lengths,
                                **grads)
            else:
                backward(_grad_ready(dout), q, k, v, out, lse, **grads)
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dpacked if needs[1] else None) + (None,) * 5


def _packed_call(q, packed, views, cu_seqlens_q, cu_seqlens_k, lengths, dropout_p, softmax_scale, causal,
                 window_size, softcap, alibi_slopes, deterministic, return_attn_probs, return_lse):
    """The packed functions' autograd call, after the checks ``flash_attn_func`` /
    ``flash_attn_varlen_func`` would run on the views."""
    if cu_seqlens_q is None:
        for name, t in zip(("q", "k", "v"), views):
            _check_kind(name, t)
    else:
        _check_varlen(*views, cu_seqlens_q, cu_seqlens_k, *lengths)
    _check_fa2_options(dropout_p, return_attn_probs, deterministic)
    _score_options(causal, softmax_scale, views[0].shape[-1], window_size, softcap)
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=tuple(window_size), softcap=softcap,
                   alibi_slopes=alibi_slopes)
    out, lse = PackedFlashAttnFunc.apply(q, packed, cu_seqlens_q, cu_seqlens_k, lengths, options, deterministic)
    return _returned(out, lse, return_attn_probs, return_lse)


def flash_attn_qkvpacked_func(qkv, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                              window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                              deterministic: bool = False, return_attn_probs: bool = False, *,
                              return_lse: bool = False):
    """``flash_attn_func`` on q, k, v stacked in one tensor, FlashAttention-2's signature: qkv
    (batch, seqlen, 3, heads, head_dim). The backward writes dq, dk, dv into one gradient of qkv
    (no concatenation). Returns out (batch, seqlen, heads, head_dim), as ``flash_attn_func``."""
    views = _unpack("qkv", qkv, 3, varlen=False)
    args = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    if not _packed_autograd(None, qkv):
        return flash_attn_func(*views, *args, return_lse=return_lse)
    return _packed_call(None, qkv, views, None, None, None, *args, return_lse)


def flash_attn_kvpacked_func(q, kv, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                             window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                             return_attn_probs: bool = False, *, return_lse: bool = False):
    """``flash_attn_func`` with k, v stacked in one tensor, FlashAttention-2's signature: q (batch,
    seqlen_q, heads, head_dim), kv (batch, seqlen_k, 2, heads_kv, head_dim) (GQA/MQA as there).
    The backward writes dk, dv into one gradient of kv."""
    views = (q, *_unpack("kv", kv, 2, varlen=False))
    args = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    if not isinstance(q, torch.Tensor) or not _packed_autograd(q, kv):
        return flash_attn_func(*views, *args, return_lse=return_lse)
    return _packed_call(q, kv, views, None, None, None, *args, return_lse)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
                                     softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                                     return_attn_probs: bool = False, *, return_lse: bool = False):
    """``flash_attn_varlen_func`` on q, k, v stacked in one tensor, FlashAttention-2's signature:
    qkv (total, 3, heads, head_dim), one cu_seqlens and max_seqlen for queries and keys. The
    backward writes dq, dk, dv into one gradient of qkv."""
    views = _unpack("qkv", qkv, 3, varlen=True)
    lengths = (max_seqlen, max_seqlen)
    args = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    if not _packed_autograd(None, qkv):
        return flash_attn_varlen_func(*views, cu_seqlens, cu_seqlens, *lengths, *args, return_lse=return_lse)
    return _packed_call(None, qkv, views, cu_seqlens, cu_seqlens, lengths, *args, return_lse)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                                    window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                                    deterministic: bool = False, return_attn_probs: bool = False, *,
                                    return_lse: bool = False):
    """``flash_attn_varlen_func`` with k, v stacked in one tensor, FlashAttention-2's signature: q
    (total_q, heads, head_dim), kv (total_k, 2, heads_kv, head_dim). The backward writes dk, dv
    into one gradient of kv."""
    views = (q, *_unpack("kv", kv, 2, varlen=True))
    lengths = (max_seqlen_q, max_seqlen_k)
    args = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    if not isinstance(q, torch.Tensor) or not _packed_autograd(q, kv):
        return flash_attn_varlen_func(*views, cu_seqlens_q, cu_seqlens_k, *lengths, *args, return_lse=return_lse)
    return _packed_call(q, kv, views, cu_seqlens_q, cu_seqlens_k, lengths, *args, return_lse)
