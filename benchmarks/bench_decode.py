"""Benchmark decoding: a few query tokens per sequence against a long key/value cache.

    python benchmarks/bench_decode.py                   # GPU cells on a GPU, CPU cells without
    python benchmarks/bench_decode.py --quick           # a few small cells, a smoke run
    python benchmarks/bench_decode.py --time-limit 300  # stop after 300 s, report what it has

Cells (GPU): bfloat16, 32 query heads over 8 key/value heads (GQA), head_dim 128, batch 1, 8 and 32
with 64k keys per sequence and batch 1 with 8k, one and four query tokens per sequence. Per cell:
  attention         jax_flash.attention(q, k, v, causal=True), whose forward runs on the decode
                    kernel;
  cudnn             jax.nn.dot_product_attention(q, k, v, implementation="cudnn"), without a mask
                    (one query at the end of the sequence sees every key either way; with four,
                    jax_flash's bottom-right causal mask hides 6 of the 4 * seqlen_k pairs);
  kvcache           jax_flash.attention_with_kvcache over a contiguous cache, every sequence full;
  paged16/paged256  the same cache as pages of 16 or 256 keys, scattered over the page pool in a
                    random order.
The rate is memory bandwidth: bytes of K and V read plus q read and O written, divided by the time
of one call, measured two ways: inside one jitted program of 16 dependent calls (each step's queries
are the previous step's output, as in a decode loop; the kernel's own rate) and as back-to-back
separately dispatched calls (which adds the host's per-call dispatch, and is what a Python loop of
single calls gets). Inputs smaller than 256 MB are rotated over several copies so that the L2 cache
cannot hold them. Ratios: to cuDNN in the same process on the same inputs, paged to
contiguous and four tokens to one (times). Each output is checked against the `attention` call.
Without a GPU the same kinds of cells run small on the CPU and the cuDNN column says why it is
absent.

Writes <out>/decode_<gpu|cpu>[_quick].md and .csv; <out> is --out, by default a scratch folder
(jax_flash_bench in the system temp directory).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _env import busy_host, environment, resolve_device
from _report import markdown_head, md_table
from _timing import compile_jit, median, release, short_error, stop_reason, stop_signals

import jax_flash

ROTATE_BYTES = 256 * 2**20
REPEATS = 5
STEPS = 16  # dependent calls per program for the in-program rate
IMPLEMENTATIONS = ("attention", "cudnn", "kvcache", "paged16", "paged256")


@dataclasses.dataclass(frozen=True)
class Cell:
    batch: int
    seqlen_k: int
    seqlen_q: int
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"

    @property
    def label(self) -> str:
        keys = f"{self.seqlen_k // 1024}k" if self.seqlen_k % 1024 == 0 else str(self.seqlen_k)
        return f"B={self.batch} Sk={keys} Sq={self.seqlen_q}"

    def bytes_moved(self) -> int:
        item = jnp.dtype(self.dtype).itemsize
        kv = 2 * self.batch * self.seqlen_k * self.heads_kv * self.head_dim
        qo = 2 * self.batch * self.seqlen_q * self.heads_q * self.head_dim
        return (kv + qo) * item


def cells(platform: str, quick: bool) -> list[Cell]:
    if platform == "gpu":
        shapes = [(1, 65536), (8, 65536), (32, 65536), (1, 8192)]
        if quick:
            shapes = [(1, 65536), (1, 8192)]
        return [Cell(b, s, sq) for sq in (1, 4) for b, s in shapes]
    shapes = [(1, 2048), (2, 1024)] if quick else [(1, 8192), (4, 8192)]
    return [Cell(b, s, sq, dtype="float32") for sq in (1, 4) for b, s in shapes]


@dataclasses.dataclass
class Result:
    cell: Cell
    impl: str
    seconds: float | None = None
    error: str = ""
    check: float | None = None  # relative L2 difference to the `attention` output
    # Seconds per call inside one program of STEPS dependent calls (no per-call dispatch).
    step_seconds: float | None = None

    @property
    def gbps(self) -> float | None:
        return None if self.seconds is None else self.cell.bytes_moved() / self.seconds / 1e9

    @property
    def step_gbps(self) -> float | None:
        s = self.step_seconds
        return None if s is None else self.cell.bytes_moved() / s / 1e9


def make_inputs(cell: Cell, copy: int):
    """q, k, v for one copy of a cell's inputs, every sequence full."""
    key = jax.random.key(copy)
    kq, kk, kv = jax.random.split(key, 3)
    dtype = jnp.dtype(cell.dtype)
    q = jax.random.normal(kq, (cell.batch, cell.seqlen_q, cell.heads_q, cell.head_dim), dtype)
    shape = (cell.batch, cell.seqlen_k, cell.heads_kv, cell.head_dim)
    return q, jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype)


def paginate(k, v, block_size: int, seed: int):
    """The contiguous cache as pages scattered at random, and the block table."""
    batch, seqlen = k.shape[:2]
    blocks = seqlen // block_size
    order = np.random.default_rng(seed).permutation(batch * blocks).astype(np.int32)
    table = jnp.asarray(order.reshape(batch, blocks))
    # Page order[i] holds flat block i, so page p holds block argsort(order)[p].
    inverse = jnp.asarray(np.argsort(order))

    def pages(x):
        return x.reshape(batch * blocks, block_size, *x.shape[2:])[inverse]

    return pages(k), pages(v), table


Prepare = Callable[[jax.Array, jax.Array, jax.Array, int], tuple]


def variant(impl: str, cell: Cell) -> tuple[Callable, Prepare]:
    """(fn, prepare): prepare(q, k, v, seed) gives fn's arguments."""
    lens = jnp.full((cell.batch,), cell.seqlen_k, jnp.int32)

    def as_is(q, k, v, seed):
        return q, k, v

    if impl == "attention":
        return (lambda q, k, v: jax_flash.attention(q, k, v, causal=True)), as_is
    if impl == "cudnn":
        return (
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
        ), as_is
    if impl == "kvcache":
        return (
            lambda q, k, v, n: jax_flash.attention_with_kvcache(q, k, v, n),
            lambda q, k, v, seed: (q, k, v, lens),
        )
    block = int(impl.removeprefix("paged"))

    def paged(q, k_pages, v_pages, n, table):
        return jax_flash.attention_with_kvcache(q, k_pages, v_pages, n, block_table=table)

    def prepare(q, k, v, seed):
        k_pages, v_pages, table = paginate(k, v, block, seed)
        return q, k_pages, v_pages, lens, table

    return paged, prepare


def time_cycled(compiled, arg_sets) -> float:
    """Median seconds per call, cycling through the argument sets; only the last call of a run
    is waited on."""
    for args in arg_sets[:2]:
        jax.block_until_ready(compiled(*args))
    start = time.perf_counter()
    jax.block_until_ready(compiled(*arg_sets[0]))
    one = time.perf_counter() - start
    iters = max(len(arg_sets), min(50, math.ceil(0.2 / max(one, 1e-9))))
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for i in range(iters):
            out = compiled(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / iters)
    return median(times)


def chained(fn: Callable, arg_sets: list[tuple]) -> tuple[Callable, tuple]:
    """STEPS dependent calls of fn in one program, as a decode loop makes them: each step's
    queries are the previous step's output (same shape), and step s reads the key/value copy
    s % len(arg_sets), so the steps cannot share the L2. Returns (program, its arguments)."""
    sets = arg_sets[:STEPS]
    width = len(sets[0])

    def program(*flat):
        groups = [flat[i * width : (i + 1) * width] for i in range(len(sets))]
        q = groups[0][0]
        for step in range(STEPS):
            q = fn(q, *groups[step % len(groups)][1:]).astype(q.dtype)
        return q

    return program, tuple(x for args in sets for x in args)


def measure(cell: Cell, platform: str) -> list[Result]:
    copies = max(1, math.ceil(ROTATE_BYTES / cell.bytes_moved())) if platform == "gpu" else 1
    inputs = [make_inputs(cell, c) for c in range(copies)]
    results, reference = [], None
    for impl in IMPLEMENTATIONS:
        result = Result(cell, impl)
        results.append(result)
        if impl == "cudnn" and platform != "gpu":
            result.error = "absent: no cuDNN on the CPU"
            continue
        fn, prepare = variant(impl, cell)
        arg_sets = []
        try:
            arg_sets = [prepare(*x, seed) for seed, x in enumerate(inputs)]
            compiled = compile_jit(fn, arg_sets[0])
            result.seconds = time_cycled(compiled, arg_sets)
            out = np.asarray(compiled(*arg_sets[0]).astype(jnp.float32))
            if reference is None:
                reference = out
            result.check = float(np.linalg.norm(out - reference) / np.linalg.norm(reference))
            program, flat = chained(fn, arg_sets)
            result.step_seconds = time_cycled(compile_jit(program, flat), [flat]) / STEPS
        except Exception as exc:  # a refused shape (cuDNN) or no memory: recorded, not fatal
            result.error = short_error(exc)
        # The pages are this variant's own copies; the shared inputs stay for the next one.
        shared = {id(x) for inp in inputs for x in inp}
        release([a for args in arg_sets for a in args[1:3] if id(a) not in shared])
        rate = "-" if result.gbps is None else f"{result.gbps:.1f} GB/s"
        step = "-" if result.step_gbps is None else f"{result.step_gbps:.1f} GB/s"
        print(f"{cell.label:>20}  {impl:>9}  {rate:>14}  {step:>14}  {result.error}", flush=True)
    for q, k, v in inputs:
        release([q, k, v])
    return results


def _rate(r: Result | None, steps: bool = False) -> str:
    if r is None:
        return "-"
    if r.error:
        return r.error.replace("|", "\\|")
    gbps = r.step_gbps if steps else r.gbps
    if gbps is None:
        return "-"
    return f"{gbps:.0f} ({gbps / 1000:.2f})" if gbps >= 100 else f"{gbps:.2f}"


def _ratio(a: Result | None, b: Result | None, invert: bool = False, steps: bool = False) -> str:
    ta = None if a is None else (a.step_seconds if steps else a.seconds)
    tb = None if b is None else (b.step_seconds if steps else b.seconds)
    if ta is None or tb is None:
        return "-"
    value = tb / ta if invert else ta / tb
    return f"{value:.2f}"


def report(results: list[Result], env: dict, out: Path, name: str, interrupted: bool) -> None:
    by = {(r.cell, r.impl): r for r in results}
    cell_list = list(dict.fromkeys(r.cell for r in results))
    method = [
        "rate: (bytes of K and V read + q read + O written) / median time, GB/s (TB/s in "
        "parentheses from 100 GB/s up)",
        "cuDNN: jax.nn.dot_product_attention(implementation='cudnn'), same process, same inputs",
        "paged: pages of 16 or 256 keys scattered over the page pool in a random order",
        "x cuDNN: jax_flash rate / cuDNN rate; paged/contig and Sq4/Sq1: ratios of times",
        f"inside one program: {STEPS} dependent calls in one jitted program (each step's queries "
        "are the previous output; the steps cycle over the key/value copies), time / {STEPS}: "
        "the rate of a decode loop, without the per-call dispatch of the other table".replace(
            "{STEPS}", str(STEPS)
        ),
    ]
    lines = markdown_head("Decode", env, method, interrupted)
    header = ["cell", *IMPLEMENTATIONS, "attention x cuDNN", "kvcache x cuDNN",
              "paged16/contig", "paged256/contig", "max check"]  # fmt: skip
    for steps, title in (
        (True, f"Bandwidth inside one program ({STEPS} dependent calls)"),
        (False, "Bandwidth per call (back-to-back calls, host dispatch included)"),
    ):
        rows = []
        for cell in cell_list:
            r = {impl: by.get((cell, impl)) for impl in IMPLEMENTATIONS}
            checks = [x.check for x in r.values() if x is not None and x.check is not None]
            rows.append([
                cell.label, *(_rate(r[i], steps) for i in IMPLEMENTATIONS),
                _ratio(r["attention"], r["cudnn"], invert=True, steps=steps),
                _ratio(r["kvcache"], r["cudnn"], invert=True, steps=steps),
                _ratio(r["paged16"], r["kvcache"], steps=steps),
                _ratio(r["paged256"], r["kvcache"], steps=steps),
                f"{max(checks):.1e}" if checks else "-",
            ])  # fmt: skip
        lines += ["", f"## {title}", "", *md_table(header, rows)]
    four = [c for c in cell_list if c.seqlen_q == 4]
    if four:
        rows = []
        for cell in four:
            one = dataclasses.replace(cell, seqlen_q=1)
            rows.append([cell.label.replace(" Sq=4", ""), *(
                _ratio(by.get((cell, i)), by.get((one, i)), steps=True) for i in IMPLEMENTATIONS
            )])  # fmt: skip
        table = md_table(["cell", *IMPLEMENTATIONS], rows)
        lines += ["", "## Time of four query tokens / one (inside one program)", "", *table]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    with open(out / f"{name}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["batch", "seqlen_k", "seqlen_q", "heads_q", "heads_kv", "head_dim",
                         "dtype", "impl", "seconds", "gb_per_s", "step_seconds", "step_gb_per_s",
                         "check", "error"])  # fmt: skip
        for r in results:
            c = r.cell
            writer.writerow([c.batch, c.seqlen_k, c.seqlen_q, c.heads_q, c.heads_kv, c.head_dim,
                             c.dtype, r.impl, r.seconds, r.gbps, r.step_seconds, r.step_gbps,
                             r.check, r.error])  # fmt: skip
    print(f"wrote {out / (name + '.md')} and {out / (name + '.csv')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few small cells (smoke run)")
    parser.add_argument("--time-limit", type=int, help="stop after this many seconds")
    parser.add_argument("--platform", choices=("auto", "gpu", "cpu"), default="auto")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "jax_flash_bench")
    parser.add_argument("--name", help="file name stem (default decode_<gpu|cpu>[_quick])")
    args = parser.parse_args()
    busy = busy_host()
    platform, device = resolve_device(args.platform, dry_run=False)
    env = environment(device)
    if busy:
        env["warning"] = busy
    name = args.name or f"decode_{platform}" + ("_quick" if args.quick else "")
    results: list[Result] = []
    interrupted = False
    with jax.default_device(device):
        try:
            with stop_signals(args.time_limit):
                for cell in cells(platform, args.quick):
                    results += measure(cell, platform)
        except KeyboardInterrupt as stop:
            interrupted = True
            print(f"stopped: {stop_reason(stop)}")
    report(results, env, args.out, name, interrupted)


if __name__ == "__main__":
    main()
