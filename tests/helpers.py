"""Shared pieces of the GPU tests: fresh random inputs, NaN poisoning, error criteria."""

import pytest
import torch

import cute_attn
from cute_attn.reference import attention_reference


@pytest.fixture(params=["sm80", "sm90"], autouse=True)
def arch(request):
    """Every GPU test runs under each kernel family (import this into a test module to apply it)."""
    if request.param == "sm90" and torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the SM90 kernels need compute capability 9.0")
    with cute_attn.force_arch(request.param):
        yield request.param


def random_qkv(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, dtype, device="cuda", requires_grad=False):
    g = torch.Generator(device=device)
    g.seed()  # fresh inputs for every case
    q = torch.randn(batch, seqlen_q, heads, head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim, device=device, dtype=dtype, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def poisoned_like(t: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    """An output buffer full of NaN, so that any element the kernel fails to write fails the test."""
    return torch.full(shape if shape is not None else t.shape, float("nan"), dtype=dtype or t.dtype, device=t.device)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def check_close(name: str, got: torch.Tensor, ref: torch.Tensor, baseline, atol: float, case: str):
    """got must be within 2x the error of a same-dtype PyTorch computation (``baseline``) + atol.
    ``baseline`` may be a tuple of such computations: the largest of their errors counts. The
    reference itself rounded to got's dtype always counts as one: no output in that dtype can be
    closer, and a same-dtype baseline that happens to round its largest elements well would
    otherwise fail a kernel for one half-ulp rounding in the binade above (measured: both backward
    kernels reach exactly 2.0x at d32/d64 causal, the SM90 one once 2.1x: 0.0625 vs 0.0296)."""
    assert not torch.isnan(got).any(), f"{name}: NaN in output ({case})"
    baselines = baseline if isinstance(baseline, (tuple, list)) else (baseline,)
    baselines = (*baselines, ref.to(got.dtype))
    err, base = max_err(got, ref), max(max_err(b, ref) for b in baselines)
    assert err <= 2 * base + atol, f"{name}: max error {err:.3g} > 2 x {base:.3g} + {atol} ({case})"


def check_lse(lse: torch.Tensor, ref_lse: torch.Tensor, case: str):
    assert not torch.isnan(lse).any(), f"lse: NaN ({case})"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), f"lse: +inf rows differ from the reference ({case})"
    if (~empty).any():
        err = ((lse - ref_lse).abs() / ref_lse.abs().clamp_min(1.0))[~empty].max().item()
        assert err <= 1e-3, f"lse: relative error {err:.3g} > 1e-3 ({case})"


def reference_pair(q, k, v, causal, softmax_scale=None):
    """(fp32 reference, same-dtype PyTorch attention) outputs and the reference LSE."""
    ref, ref_lse = attention_reference(q, k, v, causal, softmax_scale)
    same, _ = attention_reference(q, k, v, causal, softmax_scale, compute_dtype=q.dtype)
    return ref, same, ref_lse


def call_varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, causal=False, window_size=(-1, -1), scale=None):
    """``torch.nn.attention.varlen.varlen_attn`` in whichever signature this torch has: torch 2.10
    takes ``is_causal`` (no window), later ones ``window_size`` ((left, 0) when causal: (-1, 0) is
    plain causal) and, from some version on, ``enable_gqa`` for fewer K/V heads (older ones pass
    them to the kernel unchecked). Skips the test where this torch cannot express the call."""
    import inspect

    varlen = pytest.importorskip("torch.nn.attention.varlen")
    params = inspect.signature(varlen.varlen_attn).parameters
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (window_size[0], 0) if causal else tuple(window_size)
    elif tuple(window_size) != (-1, -1):
        pytest.skip("this torch's varlen_attn has no window_size")
    else:
        kwargs["is_causal"] = causal
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    if scale is not None:
        kwargs["scale"] = scale
    return varlen.varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)
