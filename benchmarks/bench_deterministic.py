"""What deterministic=True costs: forward+backward of jax_flash.attention with the default
(atomic, unordered) dQ accumulation and with the fixed key-tile order, in one process, and whether
each gives the same gradients twice (bitwise).

  python benchmarks/bench_deterministic.py --out results/deterministic_gpu

Cells: head_dim 64/128/256, causal and not, 4k and 16k tokens (batch x seqlen = 16k, 2048 hidden:
16 heads of 128, 32 of 64, 8 of 256), bfloat16. Times are medians of 5 runs.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _env  # noqa: E402
import _timing  # noqa: E402
from _report import Cell  # noqa: E402

import jax_flash  # noqa: E402

HIDDEN = 2048
TOKENS = 16384


def _cell(head_dim, seqlen, causal, repeats):
    heads = HIDDEN // head_dim
    batch = TOKENS // seqlen
    key = jax.random.key(seqlen * 1000 + head_dim + causal)
    kq, kk, kv, kd = jax.random.split(key, 4)
    shape = (batch, seqlen, heads, head_dim)
    q, k, v, dout = (jax.random.normal(x, shape, jnp.bfloat16) for x in (kq, kk, kv, kd))
    row = {"head_dim": head_dim, "seqlen": seqlen, "causal": causal}
    # The grid's FLOP convention (forward+backward = 3.5 x forward, halved when causal).
    flops = Cell("bf16", head_dim, seqlen, causal, True, batch, heads).flops()
    grads = {}
    for deterministic in (False, True):
        fn = _timing.forward_backward(
            functools.partial(jax_flash.attention, causal=causal, deterministic=deterministic)
        )
        compiled = _timing.compile_jit(fn, (q, k, v, dout))
        per_call, _ = _timing.time_compiled(compiled, (q, k, v, dout), iters=None, repeats=repeats)
        seconds = _timing.median(per_call)
        name = "deterministic" if deterministic else "default"
        row[f"{name}_ms"] = seconds * 1e3
        row[f"{name}_tflops"] = flops / seconds / 1e12
        first = [np.asarray(g) for g in compiled(q, k, v, dout)[1:]]
        second = [np.asarray(g) for g in compiled(q, k, v, dout)[1:]]
        row[f"{name}_repeatable"] = all(
            np.array_equal(a, b) for a, b in zip(first, second, strict=True)
        )
        grads[name] = first
    # The two orders sum the same terms: they agree to rounding.
    row["max_rel_diff_dq"] = float(
        np.max(np.abs(grads["default"][0].astype(np.float32) - grads["deterministic"][0]))
        / (np.max(np.abs(grads["default"][0].astype(np.float32))) + 1e-30)
    )
    row["cost"] = row["deterministic_ms"] / row["default_ms"] - 1.0
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="write <out>.md, or <out>/<name>.md with --name"
    )
    parser.add_argument("--name", help="file name stem; --out is then the directory")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    args = parser.parse_args()
    device = jax.devices()[0]
    env = _env.environment(device)
    rows = []
    header = (
        "| head_dim | seqlen | causal | default ms (TFLOP/s) | deterministic ms (TFLOP/s) | cost "
        "| repeatable (default / det.) | max rel. diff of dQ |"
    )
    lines = [header, "|" + "---|" * 8]
    for head_dim in args.head_dims:
        for seqlen in args.seqlens:
            for causal in (False, True):
                r = _cell(head_dim, seqlen, causal, args.repeats)
                rows.append(r)
                line = (
                    f"| {head_dim} | {seqlen} | {causal} | {r['default_ms']:.3f} "
                    f"({r['default_tflops']:.0f}) | {r['deterministic_ms']:.3f} "
                    f"({r['deterministic_tflops']:.0f}) | {100 * r['cost']:+.1f}% | "
                    f"{r['default_repeatable']} / {r['deterministic_repeatable']} | "
                    f"{r['max_rel_diff_dq']:.1e} |"
                )
                lines.append(line)
                print(line, flush=True)
    text = ["# deterministic=True: forward+backward cost", ""]
    text += [f"- {k}: {v}" for k, v in env.items()]
    text += ["", *lines, ""]
    if args.out is not None:
        path = args.out / f"{args.name}.md" if args.name else args.out.with_suffix(".md")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(text))


if __name__ == "__main__":
    main()
