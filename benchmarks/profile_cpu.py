"""Runs one jax_flash CPU cell in a loop, for a sampling profiler to attach to.

    perf record -F 999 -g -o perf.data -- python benchmarks/profile_cpu.py --seconds 10
    perf report -i perf.data --no-children --sort symbol

Compiles first, then calls the jitted function back to back for --seconds; prints the rate and
the SIMD level the kernels use, so a profile can be matched to a benchmark cell.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from _timing import forward_backward

import jax_flash
from jax_flash import _jax_flash


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backward", action="store_true", help="forward + backward")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()

    shape = (1, args.seqlen, args.heads, args.head_dim)
    q, k, v, dout = (
        jax.random.normal(key, shape, jnp.float32) for key in jax.random.split(jax.random.key(0), 4)
    )

    def forward(q, k, v):
        return jax_flash.attention(q, k, v, causal=args.causal)

    fn, fn_args = (
        (forward_backward(forward), (q, k, v, dout)) if args.backward else (forward, (q, k, v))
    )
    call = jax.jit(fn).lower(*fn_args).compile()
    jax.block_until_ready(call(*fn_args))
    flops = 4.0 * args.heads * args.seqlen**2 * args.head_dim / (2 if args.causal else 1)
    flops *= 3.5 if args.backward else 1.0
    calls, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < args.seconds:
        jax.block_until_ready(call(*fn_args))
        calls += 1
    elapsed = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    # Per core-second of this process's CPU time: a figure that other load on the host changes
    # far less than the wall-clock rate, for comparing kernel changes on a busy machine.
    # Builds older than the instruction-set report have no cpu_isa(); they can be profiled too.
    isa = getattr(_jax_flash, "cpu_isa", lambda: "isa unreported")()
    print(
        f"{isa}: {calls} calls, {elapsed / calls * 1e3:.1f} ms each, "
        f"{flops * calls / elapsed / 1e9:.1f} GFLOP/s wall, "
        f"{flops * calls / cpu_seconds / 1e9:.1f} GFLOP per CPU-second"
    )


if __name__ == "__main__":
    main()
