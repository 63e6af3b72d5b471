"""jax_flash on the CPU against XLA and against the machine's float32 matrix-multiply ceiling.

    python benchmarks/bench_cpu.py                       # fp32, B=1, H=8, D 64/128, S 2k/4k
    python benchmarks/bench_cpu.py --quick               # D=64, S=2k only
    python benchmarks/bench_cpu.py --out benchmarks/results

Every cell times three compiled functions in the same process, interleaved repeat by repeat so
that other load on the host slows all three alike:
  * jax_flash.attention (forward, or forward + backward through jax.vjp),
  * jax.nn.dot_product_attention(implementation="xla"), the user's alternative,
  * a float32 square matrix product (XLA's dot, jnp.matmul) of --gemm-size, the yardstick: the
    rate this machine's best dense kernel reaches with the same cores and thread pool.
It prints GFLOP/s of each and the ratios jax_flash / XLA and jax_flash / GEMM (and XLA / GEMM).
FLOPs follow the FlashAttention papers: forward 4·B·H·S·S·D, halved when causal;
forward+backward 3.5 × forward. The SIMD level the CPU kernels use (JAX_FLASH_CPU_ISA may force
one) is part of the header.

With --out DIR it writes DIR/<name>.md (environment and table) and DIR/<name>.csv.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from _env import busy_host, environment
from _timing import forward_backward

import jax_flash
from jax_flash import _jax_flash

TARGET_SECONDS = 0.25  # per timed run of back-to-back calls
MAX_ITERS = 50


def cell_flops(
    batch: int, heads: int, seqlen: int, head_dim: int, causal: bool, bwd: bool
) -> float:
    forward = 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    return forward * (3.5 if bwd else 1.0)


def attention_fn(impl: str, causal: bool, bwd: bool) -> Callable[..., Any]:
    if impl == "jax_flash":

        def attend(q, k, v):
            return jax_flash.attention(q, k, v, causal=causal)
    else:

        def attend(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    return forward_backward(attend) if bwd else attend


def timed(call: Callable[..., Any], args: Sequence[Any], iters: int) -> float:
    """Seconds per call over `iters` back-to-back calls (only the last one is waited on)."""
    start = time.perf_counter()
    for _ in range(iters):
        out = call(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def calibrate(call: Callable[..., Any], args: Sequence[Any]) -> int:
    """Two warm-up calls; the iteration count that makes one run last about TARGET_SECONDS."""
    timed(call, args, 1)
    last = timed(call, args, 1)
    return max(1, min(MAX_ITERS, round(TARGET_SECONDS / max(last, 1e-9))))


def measure_cell(
    batch: int,
    heads: int,
    seqlen: int,
    head_dim: int,
    causal: bool,
    bwd: bool,
    gemm: Any,
    reps: int,
) -> dict[str, float]:
    key = jax.random.split(jax.random.key(seqlen + 7 * head_dim), 4)
    shape = (batch, seqlen, heads, head_dim)
    arrays = [jax.random.normal(k, shape, jnp.float32) for k in key]
    args = arrays if bwd else arrays[:3]
    calls = {
        impl: jax.jit(attention_fn(impl, causal, bwd)).lower(*args).compile()
        for impl in ("jax_flash", "xla")
    }
    calls["gemm"], gemm_args, gemm_flops = gemm
    all_args = {"jax_flash": args, "xla": args, "gemm": gemm_args}
    iters = {impl: calibrate(call, all_args[impl]) for impl, call in calls.items()}
    times: dict[str, list[float]] = {impl: [] for impl in calls}
    for _ in range(reps):
        for impl, call in calls.items():
            times[impl].append(timed(call, all_args[impl], iters[impl]))
    flops = cell_flops(batch, heads, seqlen, head_dim, causal, bwd)
    rate = {
        impl: (gemm_flops if impl == "gemm" else flops) / statistics.median(ts) / 1e9
        for impl, ts in times.items()
    }
    spread = {impl: (max(ts) - min(ts)) / statistics.median(ts) for impl, ts in times.items()}
    return {**rate, **{f"{impl}_spread": s for impl, s in spread.items()}}


def make_gemm(n: int) -> tuple[Any, list[jax.Array], float]:
    a, b = (jax.random.normal(k, (n, n), jnp.float32) for k in jax.random.split(jax.random.key(1)))
    call = jax.jit(jnp.matmul).lower(a, b).compile()
    return call, [a, b], 2.0 * n**3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--direction", choices=("fwd", "fwdbwd", "both"), default="both")
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gemm-size", type=int, default=2048, help="n of the n×n×n float32 GEMM")
    parser.add_argument("--quick", action="store_true", help="D=64, S=2k only")
    parser.add_argument("--out", type=Path, help="write <name>.md and <name>.csv here")
    parser.add_argument("--name", default="cpu_ceiling")
    args = parser.parse_args(argv)
    if args.quick:
        args.head_dims, args.seqlens = [64], [2048]

    device = jax.devices("cpu")[0]
    env = environment(device)
    env["jax_flash CPU kernels"] = _jax_flash.cpu_isa()
    env["CPU SIMD levels supported"] = ", ".join(_jax_flash.cpu_isas_supported())
    warning = busy_host()
    header = [f"- {k}: {v}" for k, v in env.items()]
    if warning:
        header.append(f"- WARNING: {warning}")
    print("\n".join(header), flush=True)

    gemm = make_gemm(args.gemm_size)
    directions = {"fwd": [False], "fwdbwd": [True], "both": [False, True]}[args.direction]
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    columns = ["dir", "D", "S", "causal", "jax_flash", "XLA", "GEMM", "flash/XLA", "flash/GEMM"]
    columns += ["XLA/GEMM", "spread"]
    rows = []
    print(" | ".join(columns), flush=True)
    for bwd, head_dim, seqlen, causal in itertools.product(
        directions, args.head_dims, args.seqlens, causals
    ):
        r = measure_cell(args.batch, args.heads, seqlen, head_dim, causal, bwd, gemm, args.repeats)
        row = [
            "fwd+bwd" if bwd else "fwd",
            str(head_dim),
            f"{seqlen // 1024}k" if seqlen % 1024 == 0 else str(seqlen),
            "yes" if causal else "no",
            f"{r['jax_flash']:.1f}",
            f"{r['xla']:.1f}",
            f"{r['gemm']:.1f}",
            f"{r['jax_flash'] / r['xla']:.2f}",
            f"{r['jax_flash'] / r['gemm']:.2f}",
            f"{r['xla'] / r['gemm']:.2f}",
            # The largest (max - min) / median of the three implementations' repeats.
            f"{max(r['jax_flash_spread'], r['xla_spread'], r['gemm_spread']):.0%}",
        ]
        rows.append(row)
        print(" | ".join(row), flush=True)
    load_after = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"- load average after: {load_after}", flush=True)

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        lines = [
            "# jax_flash CPU rate against XLA and the float32 GEMM ceiling",
            "",
            *header,
            f"- load average after: {load_after}",
            f"- shape: B={args.batch}, H={args.heads}, float32, layout [B, S, H, D]; GEMM: "
            f"{args.gemm_size}×{args.gemm_size}×{args.gemm_size} float32 (jnp.matmul), "
            "same process",
            f"- timing: {args.repeats} interleaved repeats of back-to-back calls (about "
            f"{TARGET_SECONDS} s each) per implementation; medians; spread = the largest of the "
            "three implementations' (max - min) / median over the repeats",
            "- FLOPs: forward 4·B·H·S·S·D, halved when causal; forward+backward 3.5 × forward; "
            "all rates in GFLOP/s",
            "",
            "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns),
            *("| " + " | ".join(row) + " |" for row in rows),
            "",
        ]
        (args.out / f"{args.name}.md").write_text("\n".join(lines))
        with open(args.out / f"{args.name}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(columns)
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
