"""Runs tests/multidevice (sharded calls and ring attention) on 8 virtual CPU devices.

The rest of the suite runs on whatever devices JAX has; these tests need 8, and XLA fixes the
number of host devices when its CPU backend starts, before any test runs. So when this process
has fewer than 8 devices, the tests run in a fresh process with
``--xla_force_host_platform_device_count=8`` on the CPU backend (tests/conftest.py leaves the
directory out of this process's collection); with 8 or more they are collected here directly.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

HERE = Path(__file__).parent


@pytest.mark.skipif(
    jax.device_count() >= 8, reason="8 devices here: tests/multidevice runs in this process"
)
def test_multidevice_on_8_cpu_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    # Stop an outer pytest-xdist from handing its worker options to the child run.
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    result = subprocess.run(
        [*cmd, str(HERE / "multidevice")],
        env=env,
        cwd=HERE.parent,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"{summary}\n{result.stdout[-20000:]}\n{result.stderr[-5000:]}"
    print(summary)
