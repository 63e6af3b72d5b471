"""What this jax_flash build can do in this process: versions, backends built, devices, the
kernel family each dtype and head_dim would use, and a short self-check against the reference.
``python -m jax_flash`` prints it."""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jax_flash import _compat, _ffi, _jax_flash

HEAD_DIMS = (32, 64, 96, 128, 192, 256)
DTYPES = ("float16", "bfloat16", "float32", "float64")
_PADDED = (64, 128, 256)


def _cuda_archs(gencode: str) -> list[str]:
    return [flag.split("code=")[-1] for flag in gencode.split() if "code=" in flag]


def _cuda_family(dtype: str, head_dim: int, capability: str, archs: list[str]) -> dict[str, str]:
    if dtype in ("float32", "float64"):
        return {"forward": "simt (exact scalar)", "backward": "simt (exact scalar)"}
    padded = next(d for d in _PADDED if d >= head_dim)
    pad = "" if padded == head_dim else f", padded to {padded}"
    hopper = capability == "9.0" and "sm_90a" in archs
    forced = os.environ.get("JAX_FLASH_CUDA_FAMILY", "auto")
    family = "wgmma" if hopper and forced != "mma" else "mma.sync"
    return {"forward": family + pad, "backward": family + pad}


def kernel_families(device: jax.Device) -> dict[str, dict[int, dict[str, str]]]:
    """dtype -> head_dim -> {"forward": family, "backward": family} on ``device``, as the dispatch
    chooses them for 16-byte-aligned inputs (the CUDA wgmma kernels also need that alignment)."""
    table: dict[str, dict[int, dict[str, str]]] = {}
    if device.platform == "cpu":
        simd = _jax_flash.cpu_simd_level()
        for dtype in DTYPES:
            math = "float32 math" if dtype in ("float16", "bfloat16") else f"{dtype} math"
            family = f"cpu {simd} ({math})"
            table[dtype] = {d: {"forward": family, "backward": family} for d in HEAD_DIMS}
        return table
    if device.platform == "gpu" and _ffi.HAS_CUDA:
        capability = str(getattr(device, "compute_capability", ""))
        archs = _cuda_archs(_jax_flash.cuda_gencode)
        for dtype in DTYPES:
            table[dtype] = {d: _cuda_family(dtype, d, capability, archs) for d in HEAD_DIMS}
        return table
    none = {"forward": "none (not built)", "backward": "none (not built)"}
    return {dtype: dict.fromkeys(HEAD_DIMS, none) for dtype in DTYPES}


def _self_check(device: jax.Device, budget_s: float) -> dict[str, Any]:
    """Forward and gradients of a few small causal GQA problems on ``device`` against the
    reference in float32; runs until ``budget_s`` is spent (at least one case)."""
    from jax_flash.attention import attention
    from jax_flash.reference import attention_reference

    start = time.perf_counter()
    rng = np.random.default_rng(0)
    worst, cases = 0.0, 0
    shapes = [(1, 37, 4, 2, 64), (2, 64, 2, 1, 32), (1, 100, 4, 4, 128)]
    with jax.default_device(device), jax.default_matmul_precision("highest"):
        for batch, seqlen, heads, kv_heads, head_dim in shapes:
            q, k, v = (
                jnp.asarray(rng.standard_normal((batch, seqlen, h, head_dim)), jnp.float32)
                for h in (heads, kv_heads, kv_heads)
            )
            results = []
            for fn in (attention, attention_reference):

                def loss(q, k, v, fn=fn):
                    out = fn(q, k, v, causal=True)
                    return jnp.sum(jnp.sin(out)), out

                (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(
                    q, k, v
                )
                results.append((out, *grads))
            for a, b in zip(*results, strict=True):
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                worst = max(worst, float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)))
            cases += 1
            if time.perf_counter() - start > budget_s:
                break
    return {
        "cases": cases,
        "max_rel_error": worst,
        "passed": worst <= 1e-4,
        "seconds": round(time.perf_counter() - start, 2),
    }


def capabilities(self_check: bool = True, budget_s: float = 2.0) -> dict[str, Any]:
    """The capability report as a dict.

    Keys: ``version``; ``jax`` and ``jaxlib`` (running) and ``built_with`` (the jax and jaxlib
    whose headers the module was compiled against); ``xla_ffi_api`` (built and running);
    ``cpu_simd`` (the CPU kernel build in use); ``cuda_built`` and ``cuda_architectures``;
    ``devices``, one entry per device JAX sees with its ``kernels`` (see
    :func:`kernel_families`) and, with ``self_check``, the result of checking forward and
    gradients against the reference within about ``budget_s`` seconds per device.
    """
    from jax_flash import __version__

    running = _compat.running_ffi_api_version()
    report: dict[str, Any] = {
        "version": __version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "built_with": {"jax": _jax_flash.built_with_jax, "jaxlib": _jax_flash.built_with_jaxlib},
        "xla_ffi_api": {
            "built": list(_ffi.BUILT_FFI_API),
            "running": list(running) if running else None,
        },
        "cpu_simd": _jax_flash.cpu_simd_level(),
        "cuda_built": _ffi.HAS_CUDA,
        "cuda_architectures": _cuda_archs(_jax_flash.cuda_gencode),
        "devices": [],
    }
    for device in jax.devices():
        entry: dict[str, Any] = {
            "id": device.id,
            "platform": device.platform,
            "kind": device.device_kind,
            "kernels": kernel_families(device),
        }
        if device.platform == "gpu":
            entry["compute_capability"] = str(getattr(device, "compute_capability", "?"))
        if self_check:
            runnable = device.platform == "cpu" or (device.platform == "gpu" and _ffi.HAS_CUDA)
            entry["self_check"] = _self_check(device, budget_s) if runnable else None
        report["devices"].append(entry)
    return report


def format_report(report: dict[str, Any]) -> str:
    """The report as the text ``python -m jax_flash`` prints."""
    ffi = report["xla_ffi_api"]
    running = ".".join(map(str, ffi["running"])) if ffi["running"] else "unknown"
    lines = [
        f"jax_flash {report['version']}",
        f"  running with:   jax {report['jax']}, jaxlib {report['jaxlib']} (XLA FFI API {running})",
        f"  built against:  jax {report['built_with']['jax']}, jaxlib "
        f"{report['built_with']['jaxlib']} (XLA FFI API {'.'.join(map(str, ffi['built']))})",
        f"  CPU kernels:    built, SIMD level in use: {report['cpu_simd']}",
        "  CUDA kernels:   "
        + (
            "built for " + ", ".join(report["cuda_architectures"])
            if report["cuda_built"]
            else "not built"
        ),
    ]
    for dev in report["devices"]:
        cap = (
            f", compute capability {dev['compute_capability']}"
            if "compute_capability" in dev
            else ""
        )
        lines.append(f"device {dev['id']}: {dev['platform']} ({dev['kind']}{cap})")
        for dtype, by_dim in dev["kernels"].items():
            groups: dict[tuple[str, str], list[int]] = {}
            for dim, fam in by_dim.items():
                groups.setdefault((fam["forward"], fam["backward"]), []).append(dim)
            for (fwd, bwd), dims in groups.items():
                dims_text = "/".join(map(str, dims))
                family = fwd if fwd == bwd else f"forward {fwd}; backward {bwd}"
                lines.append(f"  {dtype:<9} head_dim {dims_text}: {family}")
        check = dev.get("self_check")
        if check:
            verdict = "passed" if check["passed"] else "FAILED"
            lines.append(
                f"  self-check: {verdict}: {check['cases']} causal GQA cases, forward and "
                f"gradients, max relative error {check['max_rel_error']:.1e} against the "
                f"reference ({check['seconds']} s)"
            )
        elif "self_check" in dev:
            lines.append("  self-check: skipped, no kernels for this device in this build")
    return "\n".join(lines)
