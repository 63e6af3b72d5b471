"""The capability report (jax_flash.capabilities, python -m jax_flash) and the import-time
refusal of a jaxlib whose XLA FFI API cannot take the kernels."""

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jaxlib
import pytest

import jax_flash
from jax_flash import _compat, _jax_flash

# The module (jax_flash.capabilities is also the name of its main function).
caps_module = importlib.import_module("jax_flash.capabilities")
# The directory the installed jax_flash is imported from, for the subprocesses.
SITE = str(Path(jax_flash.__file__).resolve().parent.parent)


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SITE, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=Path(SITE).anchor,
    )


def test_report_contents():
    report = jax_flash.capabilities(self_check=True, budget_s=0.0)
    assert report["version"] == jax_flash.__version__
    assert report["jax"] == jax.__version__ and report["jaxlib"] == jaxlib.__version__
    assert report["built_with"] == {
        "jax": _jax_flash.built_with_jax,
        "jaxlib": _jax_flash.built_with_jaxlib,
    }
    assert report["xla_ffi_api"]["built"] == list(_jax_flash.xla_ffi_api_version)
    assert _compat.compatible(
        tuple(report["xla_ffi_api"]["built"]), tuple(report["xla_ffi_api"]["running"])
    )
    assert report["cpu_simd"] in ("avx512", "avx2", "generic")
    assert report["cuda_built"] == bool(_jax_flash.has_cuda)
    if report["cuda_built"]:
        assert report["cuda_architectures"], "a CUDA build names its architectures"
    assert len(report["devices"]) == len(jax.devices())
    for device in report["devices"]:
        assert set(device["kernels"]) == {"float16", "bfloat16", "float32", "float64"}
        if device["platform"] == "cpu" or report["cuda_built"]:
            check = device["self_check"]
            assert check["cases"] >= 1 and check["passed"], check
            assert 0 <= check["max_rel_error"] <= 1e-4
            assert "none" not in device["kernels"]["bfloat16"][128]["forward"]
    if any(d["platform"] == "gpu" for d in report["devices"]) and report["cuda_built"]:
        gpu = next(d for d in report["devices"] if d["platform"] == "gpu")
        assert gpu["kernels"]["float32"][64]["forward"].startswith("simt")
        hopper = gpu["compute_capability"] == "9.0"
        if (
            hopper
            and "sm_90a" in report["cuda_architectures"]
            and (os.environ.get("JAX_FLASH_CUDA_FAMILY") != "mma")
        ):
            assert gpu["kernels"]["bfloat16"][128]["backward"] == "wgmma"
            assert gpu["kernels"]["bfloat16"][256]["backward"] == "wgmma"
        elif hopper:
            # Built without sm_90a (or the mma.sync family forced): the dispatch runs mma.sync.
            assert gpu["kernels"]["bfloat16"][128]["backward"] == "mma.sync"


def test_module_command(tmp_path):
    # From a directory without the source tree, as an installed package is used.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SITE, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(
        [sys.executable, "-m", "jax_flash", "--budget", "0"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    text = run.stdout
    assert f"jax_flash {jax_flash.__version__}" in text
    assert f"running with:   jax {jax.__version__}" in text
    assert "built against:  jax" in text and "SIMD level in use" in text
    assert "self-check: passed" in text
    assert "float64   head_dim" in text
    as_json = subprocess.run(
        [sys.executable, "-m", "jax_flash", "--json", "--no-self-check"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["version"] == jax_flash.__version__


@pytest.mark.parametrize(
    ("built", "running", "ok"),
    [
        ((0, 3), (0, 3), True),
        ((0, 1), (0, 3), True),
        ((0, 3), (0, 1), False),
        ((0, 3), (1, 3), False),
    ],
)
def test_compatibility_rule(built, running, ok):
    assert _compat.compatible(built, running) is ok


@pytest.mark.parametrize("fake", ["older_minor", "newer_major"])
def test_incompatible_jaxlib_is_refused_at_import(fake):
    # A fresh process whose jax.ffi.include_dir() points at headers of another FFI API version,
    # as an older (or much newer) jaxlib would ship: importing jax_flash must raise ImportError
    # before registering anything, and JAX must keep working.
    major, minor = _jax_flash.xla_ffi_api_version
    version = (major, minor - 1) if fake == "older_minor" else (major + 1, 0)
    if version[1] < 0:
        pytest.skip("the build's FFI API has minor version 0: no older minor to fake")
    code = textwrap.dedent(
        f"""
        import pathlib, tempfile
        import jax, jax.ffi, jax.numpy as jnp
        root = pathlib.Path(tempfile.mkdtemp())
        header = root / "xla" / "ffi" / "api" / "c_api.h"
        header.parent.mkdir(parents=True)
        header.write_text(
            "#define XLA_FFI_API_MAJOR {version[0]}\\n#define XLA_FFI_API_MINOR {version[1]}\\n"
        )
        jax.ffi.include_dir = lambda: str(root)
        try:
            import jax_flash
        except ImportError as exc:
            print("IMPORT_ERROR:", exc)
        else:
            print("IMPORTED")
        print("JAX_WORKS:", float((jnp.ones(3) + 1).sum()))
        """
    )
    run = _python(code)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "IMPORTED" not in out, out
    assert f"XLA FFI API {version[0]}.{version[1]}" in out
    assert f"XLA FFI API {major}.{minor})" in out
    assert "--no-build-isolation" in out and "pip install -U jax jaxlib" in out
    assert "JAX_WORKS: 6.0" in out


@pytest.mark.parametrize(
    ("capability", "archs", "family"),
    [
        ("9.0", ["sm_80", "sm_90a"], "wgmma"),
        # Built without sm_90a: the wgmma kernels are traps, so the mma.sync family runs.
        ("9.0", ["sm_90"], "mma.sync"),
        ("8.0", ["sm_80", "sm_90a"], "mma.sync"),
        ("8.9", ["sm_80"], "mma.sync"),
    ],
)
def test_reported_family_follows_the_build_and_the_device(monkeypatch, capability, archs, family):
    """The report's rule is the dispatch's (cuda/sm90_host.cu, sm90a_kernels_usable): wgmma only
    on a 9.0 device with the sm_90a code built."""
    monkeypatch.delenv("JAX_FLASH_CUDA_FAMILY", raising=False)
    assert caps_module._cuda_family("bfloat16", 128, capability, archs) == {
        "forward": family,
        "backward": family,
    }
    assert caps_module._cuda_family("float16", 256, capability, archs)["backward"] == family
