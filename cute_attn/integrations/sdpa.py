"""``F.scaled_dot_product_attention``'s flash backend and ``torch.nn.attention.varlen`` on
cute_attn's kernels.

    import cute_attn, torch.nn.attention as attention
    attention.activate_flash_attention_impl("cute_attn")   # SDPA's flash backend now runs cute_attn
    attention.restore_flash_attention_impl()                # back to torch's own

``import cute_attn`` registers the name with torch's flash-implementation registry
(``torch.nn.attention.register_flash_attention_impl``; torch 2.13 checked on the CPU; on older
torch, ``register()`` returns False and nothing changes). Activation overrides the CUDA kernels of
``aten::_scaled_dot_product_flash_attention`` and ``aten::_flash_attention_forward`` and their
backwards, and of ``aten::_flash_attention_forward_no_dropout_inplace`` where torch has it:

- SDPA's flash backend (``_scaled_dot_product_flash_attention``): cute_attn's dense kernels.
- ``_flash_attention_forward`` / ``_backward``, which ``torch.nn.attention.varlen.varlen_attn``
  (and ``varlen_attn_out``, through the in-place op) call: dense (batch, seqlen, heads, d) or
  variable-length packed (total, heads, d) batches with ``cum_seq_q``/``cum_seq_k`` (cute_attn's
  ``varlen_forward`` / ``varlen_backward``; the LSE is (heads, total_q), the layout torch's meta
  function declares), GQA/MQA, and sliding windows ``window_size_left``/``right`` with
  FlashAttention-2's semantics (-1 unbounded; causal sets the right edge to 0). Causal is
  bottom-right aligned, as in torch's FlashAttention-2 kernel (per sequence when varlen).

A call cute_attn cannot serve (dropout, a debug mask, ``seqused_k``, ALiBi, a paged KV cache
(``block_table``), ``num_splits`` above 1, any other option torch adds that is not None, causal
with seqlen_q != seqlen_k through SDPA (SDPA aligns that mask top-left, cute_attn bottom-right),
inputs cute_attn's checks reject, an unsupported GPU) runs torch's own kernel, looked up with
``torch.library.get_kernel`` before the override: no error, same results as before. The backward
is deterministic when ``torch.use_deterministic_algorithms(True)`` is on.
"""

from __future__ import annotations

import functools

import torch

NAME = "cute_attn"
_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_flash_attention_forward",
    "_flash_attention_backward",
    "_flash_attention_forward_no_dropout_inplace",  # varlen_attn_out; not in every torch
)


def register() -> bool:
    """Register ``"cute_attn"`` with torch's flash-implementation registry (not activated)."""
    attention = torch.nn.attention
    if not hasattr(attention, "register_flash_attention_impl"):
        return False
    attention.register_flash_attention_impl(NAME, register_fn=activate)
    return True


class _Handle:
    """What the registry keeps while cute_attn is active; ``remove`` restores torch's kernels."""

    def __init__(self, library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def _has_op(name: str) -> bool:
    try:
        return hasattr(torch.ops.aten, name)
    except Exception:  # noqa: BLE001  (an op namespace that cannot be asked counts as absent)
        return False


def activate() -> _Handle:
    """Override the flash ops' CUDA kernels (the registry calls this; use
    ``torch.nn.attention.activate_flash_attention_impl("cute_attn")``)."""
    impls = {
        "_scaled_dot_product_flash_attention": _sdpa_forward,
        "_scaled_dot_product_flash_attention_backward": _sdpa_backward,
        "_flash_attention_forward": _flash_forward,
        "_flash_attention_backward": _flash_backward,
        "_flash_attention_forward_no_dropout_inplace": _flash_forward_inplace,
    }
    names = [name for name in _OPS if _has_op(name)]
    originals = {name: _original_kernel(name) for name in names}
    _varlen_lse_matches_torch()  # asked once here, outside any kernel
    library = torch.library.Library("aten", "IMPL", "CUDA")
    for name in names:
        library.impl(name, _with_fallback(impls[name], originals[name], name), "CUDA", with_keyset=True)
    return _Handle(library)


def _original_kernel(name: str):
    try:
        return torch.library.get_kernel(f"aten::{name}", "CUDA")
    except (AttributeError, RuntimeError):  # older torch, or a build without CUDA kernels
        return None


class _Unsupported(Exception):
    """A call cute_attn does not serve; the message says why."""


def _with_fallback(impl, original, name: str):
    def kernel(keyset, *args, **kwargs):
        try:
            return impl(*args, **kwargs)
        except _Unsupported as why:
            if original is None:
                raise RuntimeError(f"cute_attn cannot run aten::{name} here ({why}) and torch's own "
                                   f"kernel could not be found") from None
            return original.call_boxed(keyset, *args, **kwargs)

    return kernel


@functools.cache
def _varlen_lse_matches_torch() -> bool:
    """Whether torch declares a varlen call's LSE (heads, total_q), the layout cute_attn's
    ``varlen_forward`` returns and ``varlen_backward`` takes (torch's meta function; torch 2.13
    does, a ROCm build declares (batch, heads, max_q)). Where it does not, varlen calls run
    torch's kernel, so that torch.compile's shapes and autograd's stay those of the kernel."""
    try:
        q = torch.empty((5, 2, 8), dtype=torch.float16, device="meta")
        cu = torch.empty((3,), dtype=torch.int32, device="meta")
        lse = torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 4, 4, 0.0, False, False)[1]
        return tuple(lse.shape) == (2, 5)
    except Exception:  # noqa: BLE001  (no meta function: nothing to agree with, so decline)
        return False


# option values that ask for nothing cute_attn lacks (None always qualifies)
_NEUTRAL = {"return_debug_mask": (False,), "num_splits": (0, 1)}


def unsupported_reason(q, k, v, causal: bool, dropout_p: float = 0.0, top_left_causal: bool = False,
                       scale: float | None = None, cum_seq_q=None, cum_seq_k=None, max_q=None, max_k=None,
                       window_size_left=None, window_size_right=None, **options) -> str | None:
    """Why cute_attn cannot run attention with these SDPA/flash options (None: it can).

    q, k, v: (batch, seqlen, heads, head_dim) views; or, with cum_seq_q and cum_seq_k (int32
    (batch + 1,) on q's device), a packed variable-length batch (total, heads, head_dim) whose
    sequences are at most max_q / max_k (ints) long. window_size_left/right: FlashAttention-2's
    sliding window (None or -1: unbounded; causal sets the right edge to 0). causal is bottom-right
    aligned; ``top_left_causal``: the caller aligns it top-left (SDPA), which cute_attn serves only
    where seqlen_q == seqlen_k. Every other option must be None or neutral (return_debug_mask
    False, num_splits 0 or 1): a tensor (seqused_k, alibi_slopes, block_table, a KV cache) or any
    other value asks for what cute_attn does not do here."""
    from cute_attn import dispatch, interface

    if dropout_p:
        return "dropout"
    for name, value in options.items():
        if value is not None and (isinstance(value, torch.Tensor) or value not in _NEUTRAL.get(name, ())):
            return f"{name} given"
    varlen = cum_seq_q is not None or cum_seq_k is not None
    if varlen and (cum_seq_q is None or cum_seq_k is None):
        return "cum_seq_q without cum_seq_k" if cum_seq_k is None else "cum_seq_k without cum_seq_q"
    if varlen and not _varlen_lse_matches_torch():
        return "torch declares a varlen LSE layout other than (heads, total_q)"
    if causal and top_left_causal and not varlen and q.shape[1] != k.shape[1]:
        return "causal with seqlen_q != seqlen_k (SDPA aligns that mask top-left, cute_attn bottom-right)"
    try:
        if varlen:
            interface._check_varlen(q, k, v, cum_seq_q, cum_seq_k, max_q, max_k)
            q, k, v = (t.unsqueeze(0) if isinstance(t, torch.Tensor) else t for t in (q, k, v))
        interface._check_qkv(q, k, v)
        interface._score_options(causal, scale, q.shape[3], _window(window_size_left, window_size_right))
        interface._check_cuda("q", q)
        dispatch.plan_for_device(q.device)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def _window(left, right) -> tuple:
    """The aten ops' window edges (None: unbounded) as cute_attn's ``window_size``."""
    return (-1 if left is None else left, -1 if right is None else right)


def _bshd(*tensors):
    return tuple(t.transpose(1, 2) for t in tensors)


def _require(reason):
    if reason is not None:
        raise _Unsupported(reason)


def _checked(fn, *args, **kwargs):
    """``fn`` (a cute_attn entry point), where a check of its own that unsupported_reason does not
    make (a given ``out``, an LSE from torch's kernel) declines the call: it validates before it
    launches anything."""
    try:
        return fn(*args, **kwargs)
    except (TypeError, ValueError) as e:
        raise _Unsupported(str(e)) from None


def _forward(q, k, v, causal, scale, out=None):
    from cute_attn import interface

    return interface.forward(q, k, v, causal=causal, softmax_scale=scale, out=out, return_lse=True)


def _backward(grad_out, q, k, v, out, lse, causal, scale):
    from cute_attn import interface

    try:
        interface._check_lse(lse, q)
    except (TypeError, ValueError) as e:  # an LSE from another kernel's forward
        raise _Unsupported(str(e)) from None
    return interface.backward(interface._grad_ready(grad_out), q, k, v, out, lse, causal=causal,
                              softmax_scale=scale, deterministic=torch.are_deterministic_algorithms_enabled())


def _rng_placeholders(device):
    # no dropout: the RNG state outputs only have to exist
    return torch.zeros((2,), dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device)


# ---------------------------------------------------------------- SDPA: (batch, heads, seqlen, head_dim)
def _sdpa_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    q, k, v = _bshd(query, key, value)
    _require(unsupported_reason(q, k, v, is_causal, dropout_p, True, scale, return_debug_mask=return_debug_mask))
    # torch's flash kernel returns the output as a (batch, heads, seqlen, d) view of (b, s, h, d) memory
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    out, lse = _forward(q, k, v, is_causal, scale, out)
    rng_state, unused = _rng_placeholders(q.device)
    debug = torch.empty(0, dtype=q.dtype, device=q.device)
    return out.transpose(1, 2), lse, None, None, q.shape[1], k.shape[1], rng_state, unused, debug


def _sdpa_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                   dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    if cum_seq_q is not None or cum_seq_k is not None:  # SDPA's flash forward returns none
        raise _Unsupported("cum_seq_q given")
    q, k, v, o, go = _bshd(query, key, value, out, grad_out)
    _require(unsupported_reason(q, k, v, is_causal, dropout_p, True, scale))
    dq, dk, dv = _backward(go, q, k, v, o, logsumexp, is_causal, scale)
    return _bshd(dq, dk, dv)


# ---------------------------------------------------------------- flash API: (batch, seqlen, heads, head_dim),
# or varlen (total, heads, head_dim) with cum_seq_q/k
def _flash_attention(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                     options, out=None):
    """(out, lse) of the flash forward ops, or _Unsupported: interface.forward, or varlen_forward
    (lse (heads, total_q), as torch declares it) with cum_seq_q/k."""
    from cute_attn import interface

    scale = options.pop("scale", None)
    left, right = options.pop("window_size_left", None), options.pop("window_size_right", None)
    _require(unsupported_reason(query, key, value, is_causal, dropout_p, False, scale, cum_seq_q, cum_seq_k, max_q,
                                max_k, left, right, return_debug_mask=return_debug_mask, **options))
    kwargs = dict(causal=is_causal, softmax_scale=scale, window_size=_window(left, right), out=out, return_lse=True)
    if cum_seq_q is None:
        return _checked(interface.forward, query, key, value, **kwargs)
    return _checked(interface.varlen_forward, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, **kwargs)


def _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                   return_debug_mask, **options):
    given = options.pop("out", None)  # where the schema has one (varlen_attn_out in some torch versions)
    out, lse = _flash_attention(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                return_debug_mask, options, out=given)
    rng_state, unused = _rng_placeholders(query.device)
    return out, lse, rng_state, unused, torch.empty(0, dtype=query.dtype, device=query.device)


def _flash_forward_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                           return_debug_mask, **options):
    """``_flash_attention_forward_no_dropout_inplace`` (``varlen_attn_out``): writes ``out``,
    returns the LSE."""
    return _flash_attention(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask, options, out=out)[1]


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                    dropout_p, is_causal, rng_state, unused, **options):
    from cute_attn import interface

    scale = options.pop("scale", None)
    left, right = options.pop("window_size_left", None), options.pop("window_size_right", None)
    _require(unsupported_reason(query, key, value, is_causal, dropout_p, False, scale, cum_seq_q, cum_seq_k, max_q,
                                max_k, left, right, **options))
    kwargs = dict(causal=is_causal, softmax_scale=scale, window_size=_window(left, right),
                  deterministic=torch.are_deterministic_algorithms_enabled())
    grad_out = interface._grad_ready(grad_out)
    if cum_seq_q is None:
        return _checked(interface.backward, grad_out, query, key, value, out, logsumexp, **kwargs)
    return _checked(interface.varlen_backward, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                    max_q, max_k, **kwargs)
