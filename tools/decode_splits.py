"""Step time of one-token decoding by split count, inside one program of 16 dependent calls.

    python3 tools/decode_splits.py [--seqlens 8192 65536] [--splits 4 8 12 16 24 32 48] [--rounds 2]

Batch 1, bf16, 32 query / 8 KV heads, head_dim 128 (benchmarks/bench_decode.py's cells, chained
programs and rotated inputs). Per sequence length: jax_flash.attention (the host's split choice),
cuDNN, and kvcache_attention with each given num_splits, the whole list repeated --rounds times
in one process. Needs a GPU with cuDNN; run from the repository root with jax_flash installed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_decode as bd  # noqa: E402

from jax_flash.kvcache import kvcache_attention  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--splits", type=int, nargs="+", default=[4, 8, 12, 16, 24, 32, 48])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for seqlen in args.seqlens:
        cell = bd.Cell(1, seqlen, 1)
        copies = max(2, min(bd.STEPS, -(-bd.ROTATE_BYTES // cell.bytes_moved())))
        base = [bd.make_inputs(cell, c) for c in range(copies)]
        lens = jnp.full((1,), seqlen, jnp.int32)
        variants = [("attention", None), ("cudnn", None)]
        variants += [("kvcache", s) for s in args.splits]
        for _ in range(args.rounds):
            for impl, splits in variants:
                if impl == "kvcache":

                    def fn(q, k, v, n, s=splits):
                        return kvcache_attention(q, k, v, n, num_splits=s)

                    sets = [(q, k, v, lens) for q, k, v in base]
                else:
                    fn, prepare = bd.variant(impl, cell)
                    sets = [prepare(q, k, v, c) for c, (q, k, v) in enumerate(base)]
                program, program_args = bd.chained(fn, sets)
                try:
                    compiled = jax.jit(program).lower(*program_args).compile()
                except Exception as err:  # e.g. cuDNN without a GPU
                    print(f"Sk={seqlen} {impl:9s} splits={splits} {bd.short_error(err)}")
                    continue
                step = bd.time_cycled(compiled, [program_args]) / bd.STEPS
                rate = cell.bytes_moved() / step / 1e9
                print(
                    f"Sk={seqlen} {impl:9s} splits={splits} step {step * 1e6:7.2f} us "
                    f"{rate:7.0f} GB/s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
