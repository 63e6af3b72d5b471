"""The tile scheduler's launch order (LaunchOrder, launch_group) and the fixed-size chunk-range
read of the mask policy (id_range_fixed), on the host: a native check built with the host C++
compiler."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "native" / "schedule_check.cc"


def _compiler() -> str | None:
    for name in ("c++", "g++", "clang++"):
        if path := shutil.which(name):
            return path
    return None


@pytest.mark.skipif(_compiler() is None, reason="no host C++ compiler")
def test_launch_order_and_chunk_ranges(tmp_path: Path) -> None:
    exe = tmp_path / "schedule_check"
    subprocess.run(
        [_compiler(), "-std=c++17", "-O2", "-I", str(ROOT / "cpp"), str(CHECK), "-o", str(exe)],
        check=True,
        timeout=120,
    )
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "check out" in run.stdout
