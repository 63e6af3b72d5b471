"""FlashAttention-3 for the benchmarks, imported at run time from a carry folder.

The dew_flash_attn package (shared/ANCHORS.md) exists only on the GPU machine and runs on sm90
alone, so the benchmarks never import it at module level: `load_fa3` unpacks and imports it when
--fa3-dir is given, and a dry run only checks that the folder holds its files.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import lzma
import shutil
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import jax
from _timing import short_error

FA3_LIBRARY = "libdew_flash_attn3.so"
# What dew_flash_attn.flash_mha accepts ([B, S, H, D] in one of these dtypes, D up to 256); a
# cell outside it is left out of FA3's column rather than recorded as an error.
FA3_DTYPES = ("bf16", "fp16")
FA3_MAX_HEAD_DIM = 256
FA3_DIR_HELP = (
    f"carry folder with dew_flash_attn/__init__.py (FA2 import removed) and {FA3_LIBRARY}.xz: "
    "FlashAttention-3 is unpacked and imported from it (sm90 only)"
)


def _fa3_package(path: Path) -> Path:
    return path / "dew_flash_attn" if (path / "dew_flash_attn").is_dir() else path


def fa3_files_missing(path: Path) -> str:
    """'' when path holds the carry folder's files, else what is missing."""
    package = _fa3_package(path)
    library = package / FA3_LIBRARY
    if not (package / "__init__.py").is_file():
        return f"{package}/__init__.py is missing"
    if not (library.is_file() or library.with_name(FA3_LIBRARY + ".xz").is_file()):
        return f"{library}[.xz] is missing"
    return ""


def plan_fa3(path: Path | None) -> tuple[Any | None, str]:
    """What a dry run plans for: a stand-in object when path holds the files (nothing is
    imported, so FA3's columns are planned without a GPU), else None; and the status line."""
    missing = "no --fa3-dir given" if path is None else fa3_files_missing(path)
    if missing:
        return None, f"not measured: {missing}"
    return types.SimpleNamespace(), f"from {path} (not imported)"


def load_fa3(path: Path | None, device: jax.Device | None) -> tuple[Any | None, str]:
    """FlashAttention-3 (the dew_flash_attn package) from a carry folder: path/dew_flash_attn/
    (or path itself) holding __init__.py, without the FA2 library's import, and
    libdew_flash_attn3.so, xz-compressed or not. The library is unpacked into a temporary
    directory that is removed at exit. Returns (module, what it is) or (None, why not)."""
    if path is None:
        return None, "not measured: no --fa3-dir given"
    missing = fa3_files_missing(path)
    if missing:
        return None, f"not measured: {missing}"
    capability = getattr(device, "compute_capability", None)
    if device is None or device.platform != "gpu" or capability != "9.0":
        return None, "not measured: this FlashAttention-3 build runs on sm90 GPUs only"
    package = _fa3_package(path)
    library = package / FA3_LIBRARY
    data = (
        library.read_bytes()
        if library.is_file()
        else lzma.decompress(library.with_name(FA3_LIBRARY + ".xz").read_bytes())
    )
    target = Path(tempfile.mkdtemp(prefix="fa3_"))
    atexit.register(shutil.rmtree, target, ignore_errors=True)
    (target / "dew_flash_attn").mkdir()
    shutil.copy(package / "__init__.py", target / "dew_flash_attn" / "__init__.py")
    (target / "dew_flash_attn" / FA3_LIBRARY).write_bytes(data)
    sys.path.insert(0, str(target))
    try:
        module = importlib.import_module("dew_flash_attn")
    except Exception as exc:
        return None, f"not measured: importing dew_flash_attn failed: {short_error(exc)}"
    finally:
        sys.path.remove(str(target))
    digest = hashlib.sha256(data).hexdigest()[:16]
    return module, f"dew_flash_attn from {path} ({FA3_LIBRARY} sha256 {digest}...)"
