"""The closed-form mask bits of the wgmma backward (TileMask::pair_row_bits) against the mask
policy's per-element test, on the host: a native check built with the host C++ compiler."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "native" / "pair_row_bits_check.cc"


def _compiler() -> str | None:
    for name in ("c++", "g++", "clang++"):
        if path := shutil.which(name):
            return path
    return None


@pytest.mark.skipif(_compiler() is None, reason="no host C++ compiler")
def test_pair_row_bits_match_visible(tmp_path: Path) -> None:
    exe = tmp_path / "pair_row_bits_check"
    subprocess.run(
        [_compiler(), "-std=c++17", "-O2", "-I", str(ROOT / "cpp"), str(CHECK), "-o", str(exe)],
        check=True,
        timeout=120,
    )
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "bits agree" in run.stdout
