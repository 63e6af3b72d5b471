"""Whether the running jaxlib can take the native module's FFI handlers, checked before any is
registered: XLA refuses a handler of another FFI API major version, or of a newer minor version
than its own, and a refused registration leaves the whole backend of the process unusable."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jaxlib

Version = tuple[int, int]


def running_ffi_api_version() -> Version | None:
    """The XLA FFI API version of the running jaxlib, read from the C API header it ships
    (``jax.ffi.include_dir()``); None if the header cannot be read."""
    try:
        header = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
        text = header.read_text()
    except (AttributeError, OSError):
        return None
    major = re.search(r"^#define XLA_FFI_API_MAJOR (\d+)", text, re.MULTILINE)
    minor = re.search(r"^#define XLA_FFI_API_MINOR (\d+)", text, re.MULTILINE)
    if not (major and minor):
        return None
    return int(major.group(1)), int(minor.group(1))


def compatible(built: Version, running: Version) -> bool:
    """Handlers compiled for ``built`` load into a framework of version ``running``."""
    return built[0] == running[0] and built[1] <= running[1]


def check(built: Version, built_with_jax: str, built_with_jaxlib: str) -> None:
    """Raises ImportError, naming what works and how to rebuild, if the running jaxlib cannot take
    handlers compiled for FFI API ``built``."""
    running = running_ffi_api_version()
    if running is None or compatible(built, running):
        return
    raise ImportError(
        f"jax_flash cannot load into this JAX: its kernels were compiled against jax "
        f"{built_with_jax} / jaxlib {built_with_jaxlib} (XLA FFI API {built[0]}.{built[1]}), and "
        f"the running jaxlib {jaxlib.__version__} has XLA FFI API {running[0]}.{running[1]}. "
        f"It works with a jaxlib whose FFI API is {built[0]}.x with x >= {built[1]}, such as "
        f"jaxlib {built_with_jaxlib} or newer. Either upgrade JAX (pip install -U jax jaxlib) or "
        "rebuild jax_flash against the JAX you run: from its source tree, with nanobind and "
        "scikit-build-core installed, python -m pip install --no-build-isolation --no-deps "
        "--force-reinstall . Nothing was registered with XLA, so JAX itself still works."
    )
