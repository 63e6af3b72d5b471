"""Timing and memory helpers for the benchmarks: warm-up, back-to-back timing, compiled memory,
and the stop signals that end a run early but still let it write what it measured."""

from __future__ import annotations

import contextlib
import gc
import math
import os
import re
import signal
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

# Auto iteration count (CPU default): enough back-to-back calls that one repeat lasts about this
# long, so timer resolution and dispatch jitter stay small next to the measured time.
AUTO_TARGET_SECONDS = 0.3
AUTO_MAX_ITERS = 20
WARMUP_RUNS = 2


class DoesNotFit(Exception):
    """The compiled program needs more memory than the device has free; it is never run."""


def forward_backward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """(q, k, v, dout) -> (out, dq, dk, dv) of forward(q, k, v). out is returned as well: the plain
    softmax backward never reads O, so without it XLA could drop the P·V product and be credited
    with forward FLOPs it did not do."""

    def step(q: Any, k: Any, v: Any, dout: Any) -> Any:
        out, pullback = jax.vjp(forward, q, k, v)
        return (out, *pullback(dout))

    return step


def compile_jit(fn: Callable[..., Any], args: Sequence[Any]) -> jax.stages.Compiled:
    """jit, lower and compile once, so the timed loop never traces or compiles."""
    return jax.jit(fn).lower(*args).compile()


def _memory_field(compiled: jax.stages.Compiled, field: str) -> int | None:
    try:
        stats = compiled.memory_analysis()
    except NotImplementedError:
        return None
    # Its structure is documented as version-dependent: an object, a per-device list, or None.
    if isinstance(stats, (list, tuple)):
        stats = stats[0] if stats else None
    if stats is None:
        return None
    value = stats.get(field) if isinstance(stats, dict) else getattr(stats, field, None)
    return None if value is None else int(value)


def temp_bytes(compiled: jax.stages.Compiled) -> int | None:
    """Scratch memory XLA reserves for one call beyond arguments and outputs (None if unknown)."""
    return _memory_field(compiled, "temp_size_in_bytes")


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_bytes(device: jax.Device) -> int | None:
    """Memory the next program can still allocate on device (None if the backend won't say)."""
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if device.platform == "cpu":
        return _available_host_bytes()
    return None


def check_fits(compiled: jax.stages.Compiled, device: jax.Device) -> None:
    """Raise DoesNotFit before running a program whose temp + output memory exceeds what is free.

    Running it instead could take the process (or, on a CPU host, the machine) down with it.
    """
    temp = temp_bytes(compiled)
    output = _memory_field(compiled, "output_size_in_bytes")
    free = available_bytes(device)
    if temp is None or free is None:
        return
    needed = temp + (output or 0)
    if needed > 0.95 * free:
        raise DoesNotFit(f"out of memory: needs {format_bytes(needed)}, {format_bytes(free)} free")


def time_compiled(
    call: Callable[..., Any], args: Sequence[Any], *, iters: int | None, repeats: int
) -> tuple[list[float], int]:
    """Seconds per call for each of `repeats` timed runs of `iters` back-to-back calls.

    Two blocked warm-up calls first (first-call allocations, cuDNN plan caches). Only the last
    call of a run is waited on: the device executes the queued calls in order, so its end is the
    end of all of them, and dispatching without waiting keeps host overhead out of the figure.
    block_until_ready takes the whole output tree, so every output (e.g. dq, dk and dv) counts.
    iters=None picks a count from the last warm-up call (AUTO_TARGET_SECONDS per run).
    """
    last = 0.0
    for _ in range(WARMUP_RUNS):
        start = time.perf_counter()
        jax.block_until_ready(call(*args))
        last = time.perf_counter() - start
    if iters is None:
        iters = max(1, min(AUTO_MAX_ITERS, math.ceil(AUTO_TARGET_SECONDS / max(last, 1e-9))))
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = call(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / iters)
        del out
    return per_call, iters


def run_timed(
    fn: Callable[..., Any],
    args: Sequence[Any],
    device: jax.Device,
    *,
    iters: int | None,
    repeats: int,
) -> tuple[list[float], int, list[jax.Array]]:
    """Compile fn for args, refuse it if it would not fit, time it (time_compiled), and return
    (seconds per call per repeat, calls per repeat, the leaves of one more call's outputs)."""
    compiled = compile_jit(fn, args)
    check_fits(compiled, device)
    per_call, iters = time_compiled(compiled, args, iters=iters, repeats=repeats)
    return per_call, iters, jax.tree_util.tree_leaves(compiled(*args))


def release(arrays: Sequence[jax.Array]) -> None:
    """Free device memory now rather than whenever Python collects: the next shape may need it."""
    for array in arrays:
        array.delete()
    gc.collect()


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGALRM)


@contextlib.contextmanager
def stop_signals(time_limit: int | None) -> Iterator[None]:
    """Inside the block a SIGTERM (a job's time limit), or the SIGALRM that time_limit seconds
    set, raises KeyboardInterrupt, so that the cells measured so far still get their report. A
    second signal acts as usual."""

    def handler(signum: int, frame: Any) -> None:
        for stop in _STOP_SIGNALS:
            signal.signal(stop, signal.SIG_DFL)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for stop in _STOP_SIGNALS:
        signal.signal(stop, handler)
    if time_limit:
        signal.alarm(time_limit)
    try:
        yield
    finally:
        signal.alarm(0)
        for stop in _STOP_SIGNALS:
            signal.signal(stop, signal.SIG_DFL)


def stop_reason(stop: KeyboardInterrupt) -> str:
    """Which stop a KeyboardInterrupt from stop_signals (or the keyboard) was."""
    return {"SIGALRM": "--time-limit reached", "SIGTERM": "SIGTERM"}.get(str(stop), "Ctrl-C")


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def format_bytes(n: int | None) -> str:
    """Decimal units, as in the ANCHORS tables (1 GB = 1e9 bytes)."""
    if n is None:
        return "n/a"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


_STATUS_PREFIX = re.compile(r"^[A-Z_]+:\s*")
_ASKED_SIZE = re.compile(r"(\d+(?:\.\d+)?\s*[KMGT]i?B)")


def short_error(exc: BaseException, limit: int = 80) -> str:
    """One short line for a results cell: the reason, not the traceback."""
    if isinstance(exc, DoesNotFit):
        return str(exc)
    text = str(exc).strip()
    lowered = text.lower()
    if "resource_exhausted" in lowered or "out of memory" in lowered:
        asked = _ASKED_SIZE.search(text)
        return "out of memory" + (f" (asks {asked.group(1)})" if asked else "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = _STATUS_PREFIX.sub("", lines[0]) if lines else ""
    reason = first or type(exc).__name__
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."
