"""Trace-time check that every local GPU can run the kernel a call will launch.

The half-precision kernels take their tiles from shared memory. The Hopper (wgmma) kernels fit the
227 KB of every sm_90 device; the mma.sync kernels, which every other device runs, need up to
~210 KB (head_dim 256 backward), more than the 99 KB opt-in limit of sm_86/sm_89/sm_120 devices
or the 163 KB of A100. Such a call would fail at launch with an opaque CUDA error, so it is
refused while tracing, naming the device and both sizes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax

from jax_flash import _ffi


class GpuLimit(NamedTuple):
    name: str  # the device as JAX describes it, e.g. "cuda:0 (NVIDIA H200)"
    smem_optin: int  # bytes of dynamic shared memory one block may opt in to


@functools.cache
def local_gpu_limits() -> tuple[GpuLimit, ...]:
    """The opt-in shared-memory limit of every CUDA device this process sees (read once)."""
    if not (_ffi.HAS_CUDA and _ffi.cuda_devices_present()):
        return ()
    limits = []
    for device in jax.devices("cuda"):
        ordinal = device.local_hardware_id
        if ordinal is None:
            continue
        kind = getattr(device, "device_kind", "GPU")
        limits.append(GpuLimit(f"cuda:{ordinal} ({kind})", int(_ffi.smem_optin_bytes(ordinal))))
    return tuple(limits)


def check_half_kernel_fits(
    *,
    backward: bool,
    head_dim: int,
    segments: bool,
    limits: Sequence[GpuLimit] | None = None,
) -> None:
    """Raises NotImplementedError when the mma.sync kernel of a half-precision call (head_dim as
    the kernel takes it: 64, 128 or 256) needs more shared memory than some local GPU allows."""
    if limits is None:
        # The CUDA branch of a kernel call is traced even when the computation runs elsewhere;
        # only a process whose default backend is the GPU launches it.
        if jax.default_backend() != "gpu":
            return
        limits = local_gpu_limits()
    if not limits:
        return
    needed = _ffi.tensor_core_smem_bytes(backward, head_dim, segments)
    for limit in limits:
        if needed > limit.smem_optin:
            direction = "backward" if backward else "forward"
            extra = " with segment ids" if segments else ""
            raise NotImplementedError(
                f"jax_flash: the float16/bfloat16 {direction} kernel at head_dim {head_dim}"
                f"{extra} needs {needed} bytes of shared memory per block, but {limit.name} "
                f"allows {limit.smem_optin}; use a smaller head_dim or float32 on this device"
            )
