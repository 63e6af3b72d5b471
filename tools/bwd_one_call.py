"""One forward+backward call per implementation and cell, three times each: a small target for a
kernel profiler, to see which kernels a training step's attention launches and how long each takes.

    XLA_FLAGS=--xla_gpu_autotune_level=0 ncu --clock-control none --csv \\
        --metrics gpu__time_duration.sum python3 tools/bwd_one_call.py --fa3-dir fa3_carry

Cells (bf16, hidden 2048: 16 heads of 128, or `--head-dim` 64 / 256; `--cells` picks some): causal
16 x 1k and 4 x 4k, a causal 1k window over one 16k row, and the unmasked 4 x 4k and 1 x 16k, where
the forward+backward trails cuDNN's (what the backward's custom call spends besides its main
kernel: zeroing dq_accum, converting dQ, and XLA's delta = rowsum(dO * O) before it). The inputs
are made on the host, so the profiled kernels are the calls' own; each call prints a line before it
runs, so the profiler's kernels can be attributed to it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _fa3 import load_fa3  # noqa: E402
from _timing import compile_jit, forward_backward  # noqa: E402

CELLS = {
    "causal 16x1k": dict(batch=16, seqlen=1024, window=None, causal=True),
    "causal 4x4k": dict(batch=4, seqlen=4096, window=None, causal=True),
    "window 1k over 16k": dict(batch=1, seqlen=16384, window=(1023, 0), causal=True),
    "unmasked 4x4k": dict(batch=4, seqlen=4096, window=None, causal=False),
    "unmasked 1x16k": dict(batch=1, seqlen=16384, window=None, causal=False),
}


def implementations(fa3, window, causal):
    impls = {
        "jax_flash": lambda q, k, v: jax_flash.attention(q, k, v, causal=causal, window=window),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, local_window_size=window, implementation="cudnn"
        ),
    }
    if fa3 is not None:
        impls["fa3"] = lambda q, k, v: fa3.flash_mha(
            q, k, v, is_causal=causal, window_size=window or (-1, -1)
        )
    return impls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fa3-dir", type=Path, default=None)
    parser.add_argument(
        "--cells",
        nargs="+",
        choices=list(CELLS),
        default=["causal 16x1k", "window 1k over 16k"],
        help="default: causal 16x1k and the window",
    )
    parser.add_argument(
        "--head-dim", type=int, choices=(64, 128, 256), default=128, help="heads = 2048 / this"
    )
    args = parser.parse_args()
    fa3, status = load_fa3(args.fa3_dir, jax.devices()[0])
    print("fa3:", status, flush=True)
    rng = np.random.default_rng(0)
    for cell in args.cells:
        shape = CELLS[cell]
        dims = (shape["batch"], shape["seqlen"], 2048 // args.head_dim, args.head_dim)
        q, k, v, dout = (
            jax.device_put(rng.standard_normal(dims).astype(jnp.bfloat16)) for _ in range(4)
        )
        for name, attend in implementations(fa3, shape["window"], shape["causal"]).items():
            compiled = compile_jit(forward_backward(attend), (q, k, v, dout))
            for _ in range(3):
                print(f"call {cell} {name}", flush=True)
                jax.block_until_ready(compiled(q, k, v, dout))


if __name__ == "__main__":
    main()
