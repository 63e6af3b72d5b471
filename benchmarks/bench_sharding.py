"""Benchmark jax_flash across devices: batch/head-sharded jit calls and ring attention.

    python benchmarks/bench_sharding.py                  # on every device JAX sees
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_sharding.py
    python benchmarks/bench_sharding.py --shard-len 4096 --heads 16 --head-dim 128 \
        --dtype bfloat16 --out benchmarks/results       # a GPU-sized run

On n devices (whatever JAX sees, of the default backend), for forward and forward+backward:
  one device   jax_flash.attention on the whole problem on device 0 (the work the others split);
  batch/heads  jit of jax_flash.attention with q, k, v sharded over batch (n divides the batch)
               or else over heads: no collective;
  ring         jax_flash.ring_attention inside shard_map, the sequence sharded over the n
               devices (n * shard_len tokens), contiguous and zigzag layouts, causal and not,
               beside jax_flash.attention on the whole sequence on device 0.
Per cell: milliseconds per step (median of repeats), the collectives in the compiled HLO, the bytes
each device sends per step (the sum of the collective-permute results: every device sends one
block per permute), and for the ring the max/min ratio of the (query, key) pairs the devices
compute. Virtual CPU devices share the host's cores, so there the times show what each variant
costs in total, not how it scales.

Prints a table; writes <out>/sharding_<platform>.md, where --out defaults to a fresh scratch
directory (its path is printed), so that only an explicit --out touches the results folder.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _env import busy_host, environment
from _timing import compile_jit, forward_backward, time_compiled
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash.ring import work_per_device

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
_OPS = "|".join(COLLECTIVES)
# `%x = f32[..]{..} all-gather(...)`, or an asynchronous pair's `-start` (counted) and `-done`.
_INSTRUCTION = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + _OPS + r")(-start|-done)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_BYTES.update({"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8})


def communication(compiled) -> tuple[Counter, int]:
    """(collectives by kind, bytes one device receives through collective-permutes, which in a
    ring is also what it sends) of a compiled program: the results of the synchronous permutes
    and of the asynchronous ones' done halves."""
    kinds: Counter = Counter()
    received = 0
    for result, op, phase in _INSTRUCTION.findall(compiled.as_text()):
        if phase != "-done":
            kinds[op] += 1
        if op != "collective-permute" or phase == "-start":
            continue
        for dtype, dims in _ARRAY.findall(result):
            size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            received += size * _BYTES.get(dtype, 4)
    return kinds, received


def _step_fn(attn, backward: bool):
    return forward_backward(attn) if backward else attn


def measure(fn, args, *, iters, repeats):
    compiled = compile_jit(fn, args)
    kinds, sent = communication(compiled)
    per_call, _ = time_compiled(compiled, args, iters=iters, repeats=repeats)
    return statistics.median(per_call) * 1e3, kinds, sent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shard-len", type=int, default=512, help="tokens per device (ring)")
    parser.add_argument("--batch", type=int, default=0, help="default: the number of devices")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--heads-kv", type=int, default=0, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=None, help="calls per repeat (default auto)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="default: a scratch directory")
    args = parser.parse_args(argv)

    busy = busy_host()
    devices = jax.devices()
    n = len(devices)
    dtype = jnp.dtype(args.dtype)
    heads_kv = args.heads_kv or args.heads
    batch = args.batch or n
    rng = np.random.default_rng(0)

    def normal(shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    rows = []
    header = ["cell", "pass", "ms/step", "collectives", "sent/device/step", "work max/min"]

    def record(cell, backward, fn, inputs, ratio=""):
        ms, kinds, sent = measure(
            _step_fn(fn, backward), inputs, iters=args.iters, repeats=args.repeats
        )
        label = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) or "none"
        mb = f"{sent / 1e6:.3g} MB"
        row = [cell, "fwd+bwd" if backward else "fwd", f"{ms:.2f}", label, mb, ratio]
        rows.append(row)
        print(" | ".join(row), flush=True)

    # Batch/heads sharding over all n devices: the problem of one device's ring shard per batch
    # element, batch elements split over the devices.
    seq_bh = args.shard_len
    axis = "batch" if batch % n == 0 else "heads"
    mesh = Mesh(np.array(devices), ("d",))
    spec = P("d", None, None, None) if axis == "batch" else P(None, None, "d", None)
    shard = NamedSharding(mesh, spec)
    q = normal((batch, seq_bh, args.heads, args.head_dim))
    k, v = (normal((batch, seq_bh, heads_kv, args.head_dim)) for _ in range(2))
    for backward in (False, True):
        for causal in (False, True):

            def attn(q, k, v, causal=causal):
                return jax_flash.attention(q, k, v, causal=causal)

            one = [jax.device_put(x, devices[0]) for x in (q, k, v, q)]
            cut = [jax.device_put(x, shard) for x in (q, k, v, q)]
            tag = "causal" if causal else "full"
            record(f"one device, B={batch} S={seq_bh} {tag}", backward, attn, one[: 3 + backward])
            record(f"{axis} over {n}, {tag}", backward, attn, cut[: 3 + backward])

    # Ring attention: one batch element, its sequence split over the n devices.
    seq = n * args.shard_len
    seq_spec = P(None, "d")
    qr = normal((1, seq, args.heads, args.head_dim))
    kr, vr = (normal((1, seq, heads_kv, args.head_dim)) for _ in range(2))
    for backward in (False, True):
        for causal in (False, True):

            def whole(q, k, v, causal=causal):
                return jax_flash.attention(q, k, v, causal=causal)

            one = [jax.device_put(x, devices[0]) for x in (qr, kr, vr, qr)]
            tag = "causal" if causal else "full"
            record(f"one device, B=1 S={seq} {tag}", backward, whole, one[: 3 + backward])
        for layout, causal in (("contiguous", False), ("contiguous", True), ("zigzag", True)):
            if layout == "zigzag" and args.shard_len % 2:
                continue

            def local(q, k, v, layout=layout, causal=causal):
                return jax_flash.ring_attention(
                    q, k, v, axis_name="d", causal=causal, layout=layout
                )

            ring = jax.shard_map(local, mesh=mesh, in_specs=(seq_spec,) * 3, out_specs=seq_spec)
            inputs = [jax.device_put(x, NamedSharding(mesh, seq_spec)) for x in (qr, kr, vr, qr)]
            work = work_per_device(n, args.shard_len, causal=causal, layout=layout)
            tag = "causal" if causal else "full"
            cell = f"ring {layout}, S={seq} ({args.shard_len}/device) {tag}"
            record(cell, backward, ring, inputs[: 3 + backward], f"{max(work) / min(work):.2f}")

    env = environment(devices[0])
    env["devices"] = f"{n} x {devices[0].platform}"
    env["shape"] = (
        f"heads {args.heads} (kv {heads_kv}), head_dim {args.head_dim}, {dtype.name}; "
        f"batch/heads cells B={batch} S={seq_bh}; ring cells B=1 S={seq}"
    )
    lines = ["# jax_flash across devices", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    if busy:
        lines += [f"- warning: {busy}"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="bench_sharding_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"sharding_{devices[0].platform}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
