"""The only place that looks at the GPU: compute capability -> kernel family and code target.

- 8.x runs the SM80 kernels (mma.sync, cp.async, ldmatrix), compiled for that exact target.
- 9.0 runs the SM90 forward and backward (wgmma, TMA, warp specialisation), compiled for sm_90a;
  a head dim without an SM90 traits entry that fits falls back to the SM80 kernel of that
  direction (compile.forward_key, compile.backward_keys; the backward: d192 and d256).
- anything else raises.

``CUTE_ATTN_ARCH=sm80|sm90`` (or the ``force_arch("sm80")`` context manager) forces a kernel
family, for tests and comparisons: on Hopper both run; forcing sm90 on a GPU that is not 9.0 raises.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from dataclasses import dataclass

KERNEL_FAMILIES = ("sm80", "sm90")
_forced = threading.local()


@dataclass(frozen=True)
class DevicePlan:
    kernel: str  # kernel family of both directions: "sm80" | "sm90"
    target: str  # "sm_80", "sm_86", "sm_89", "sm_90a", ...
    smem_capacity: int  # opt-in shared memory per block, bytes
    num_sms: int  # streaming multiprocessors (the size of a persistent grid)


@contextlib.contextmanager
def force_arch(kernel: str | None):
    """Run the enclosed calls with kernel family ``kernel`` (None: automatic)."""
    if kernel is not None and kernel not in KERNEL_FAMILIES:
        raise ValueError(f"arch must be one of {KERNEL_FAMILIES} or None, got {kernel!r}")
    previous = getattr(_forced, "kernel", None)
    _forced.kernel = kernel
    try:
        yield
    finally:
        _forced.kernel = previous


def forced_kernel() -> str | None:
    """The family ``force_arch`` set in this thread (None: none). ``force_arch`` is per thread, and
    autograd runs a CUDA backward in a thread of its own: the autograd functions record this with
    the forward and force it again around the backward (interface.FlashAttnFunc)."""
    return getattr(_forced, "kernel", None)


def requested_kernel() -> str | None:
    """The family forced in this thread or by CUTE_ATTN_ARCH (None: the GPU's own)."""
    kernel = forced_kernel() or os.environ.get("CUTE_ATTN_ARCH") or None
    if kernel is not None and kernel not in KERNEL_FAMILIES:
        raise ValueError(f"CUTE_ATTN_ARCH must be one of {KERNEL_FAMILIES}, got {kernel!r}")
    return kernel


def target_for_capability(major: int, minor: int) -> str:
    if major == 9 and minor == 0:
        return "sm_90a"
    if major == 8:
        return f"sm_8{minor}"
    raise ValueError(
        f"cute_attn runs on compute capability 8.x (Ampere/Ada) and 9.0 (Hopper); "
        f"this GPU is {major}.{minor}"
    )


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[int, int, int, int]:
    import torch

    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 99 * 1024
    return props.major, props.minor, smem, props.multi_processor_count


def plan_for_device(device) -> DevicePlan:
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor, smem, num_sms = _device_facts(index)
    target = target_for_capability(major, minor)
    kernel = requested_kernel() or ("sm90" if target == "sm_90a" else "sm80")
    if kernel == "sm90" and target != "sm_90a":
        raise ValueError(f"the sm90 kernels need compute capability 9.0; this GPU is {major}.{minor}")
    return DevicePlan(kernel, target, smem, num_sms)
