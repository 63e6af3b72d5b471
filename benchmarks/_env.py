"""What a results file says about where and from what it was measured."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import jax

import jax_flash


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cudnn_version() -> str | None:
    # jax has no public query for the cuDNN it loaded; this private module is the one its own
    # version checks use, so failure here only drops a line from the report.
    try:
        from jax._src.lib import cuda_versions

        number = int(cuda_versions.cudnn_get_version())
    except Exception:
        return None
    if number >= 90000:  # cuDNN 9 encodes major*10000 + minor*100 + patch
        return f"{number // 10000}.{number // 100 % 100}.{number % 100}"
    return f"{number // 1000}.{number // 100 % 10}.{number % 100}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_label(device: jax.Device, visible: int) -> str:
    if device.platform == "cpu":
        # jax calls every CPU "cpu"; the model and core count are what the numbers depend on.
        return f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs"
    return f"{device.device_kind} ({device.platform} device {device.id}, {visible} visible)"


def commit() -> str:
    """The checkout's commit ('+ uncommitted changes' when tracked files differ from it).

    A device machine gets a copy of the working tree without .git, so there JAX_FLASH_COMMIT
    names it; it also wins wherever it is set.
    """
    given = os.environ.get("JAX_FLASH_COMMIT")
    if given:
        return given
    here = str(Path(__file__).resolve().parent)

    def git(*args: str) -> str:
        run = subprocess.run(
            ["git", "-C", here, *args], capture_output=True, text=True, timeout=20, check=True
        )
        return run.stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git checkout here; set JAX_FLASH_COMMIT)"
    return head + (" + uncommitted changes" if dirty else "")


def busy_host() -> str:
    """A warning when other work keeps the host's cores busy ('' when it does not): CPU figures
    then move by a factor of two from run to run. Call it before the run adds its own load."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load <= cores / 2:
        return ""
    return (
        f"the host was busy (load average {load:.1f} on {cores} logical CPUs): CPU figures and "
        "their ratios are unreliable; rerun on an idle machine before quoting them"
    )


def environment(device: jax.Device) -> dict[str, str]:
    """What a reader needs to reproduce or compare the numbers."""
    command = getattr(sys, "orig_argv", [sys.executable, *sys.argv])
    devices = [d for d in jax.devices() if d.platform == device.platform] or [device]
    env = {
        "command": shlex.join(command),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": commit(),
        "device": device_label(device, len(devices)),
        "host": f"{cpu_model()}, {os.cpu_count()} logical CPUs",
        # Other work on the host slows CPU figures (and the dispatch of GPU ones).
        "load average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": package_version("jaxlib") or "unknown",
        "jax_flash": getattr(jax_flash, "__version__", "unknown"),
    }
    for plugin in ("jax-cuda13-plugin", "jax-cuda12-plugin"):
        version = package_version(plugin)
        if version:
            env[plugin] = version
    if device.platform != "cpu":
        env["cudnn"] = cudnn_version() or "unknown"
    flags = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("XLA_", "JAX_"))]
    if flags:
        env["environment variables"] = " ".join(flags)
    return env


def resolve_device(requested: str, dry_run: bool) -> tuple[str, jax.Device | None]:
    """(platform name, device). Refuses --platform gpu without a GPU unless it is a dry run."""
    has_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    name = ("gpu" if has_gpu else "cpu") if requested == "auto" else requested
    if name == "gpu":
        if not has_gpu:
            if dry_run:
                return name, None
            sys.exit(
                f"error: --platform gpu, but JAX sees no GPU (backend {jax.default_backend()})"
            )
        return name, jax.devices()[0]
    return name, jax.devices("cpu")[0]
