"""Loads the native extension and registers its XLA FFI targets, once, at import."""

from __future__ import annotations

import functools
from pathlib import Path

import jax

from jax_flash import _compat

try:
    from jax_flash import _jax_flash
except ImportError as exc:
    raise ImportError(
        f"jax_flash was imported from {Path(__file__).resolve().parent}, which has no compiled "
        "native module (_jax_flash): this is the source tree, not an installed build. Install "
        "it (pip install .) and run from another directory than the repository root."
    ) from exc

FWD_CPU = "jax_flash_fwd_cpu"
BWD_CPU = "jax_flash_bwd_cpu"
FWD_CUDA = "jax_flash_fwd_cuda"
BWD_CUDA = "jax_flash_bwd_cuda"
DECODE_CPU = "jax_flash_decode_cpu"
DECODE_CUDA = "jax_flash_decode_cuda"
SEGMENTS_CUDA = "jax_flash_segments_cuda"
# Every target the package can emit, whichever backends this build has: a function lowered for a
# platform this build lacks (jax.export's `platforms`) still names that platform's targets.
ALL_TARGETS: tuple[str, ...] = (
    FWD_CPU,
    BWD_CPU,
    DECODE_CPU,
    FWD_CUDA,
    BWD_CUDA,
    DECODE_CUDA,
    SEGMENTS_CUDA,
)

HAS_CUDA: bool = bool(_jax_flash.has_cuda)
BUILT_FFI_API: tuple[int, int] = tuple(_jax_flash.xla_ffi_api_version)

# Before anything is registered: a handler XLA refuses would break the backend for the process.
_compat.check(BUILT_FFI_API, _jax_flash.built_with_jax, _jax_flash.built_with_jaxlib)

for _name, (_capsule, _platform) in _jax_flash.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform=_platform)


@functools.cache
def cuda_devices_present() -> bool:
    """Whether this JAX process can see a CUDA GPU."""
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


def tensor_core_smem_bytes(backward: bool, head_dim: int, segments: bool) -> int:
    """Dynamic shared memory of the mma.sync kernel (CUDA builds only)."""
    return int(_jax_flash.cuda_tensor_core_smem_bytes(backward, head_dim, segments))


def smem_optin_bytes(ordinal: int) -> int:
    """The opt-in per-block shared-memory limit of CUDA device `ordinal` (CUDA builds only)."""
    return int(_jax_flash.cuda_device_smem_optin(ordinal))
