"""Benchmark jax_flash.attention beside cuDNN and XLA, in one process, on the same inputs.

    python benchmarks/bench_attention.py            # the full grid on a GPU; a small grid on CPU
    python benchmarks/bench_attention.py --quick    # a few cells, for a smoke run
    python benchmarks/bench_attention.py --dry-run  # list the cells and exit
    python benchmarks/bench_attention.py --fa3-dir fa3_carry  # with FlashAttention-3 (sm90 only)

On a GPU it measures the standard grid of the FlashAttention papers (16k tokens per cell,
hidden 2048, head_dim 64/128/256, seqlen 512..16k, causal and not, forward and
forward+backward, bf16 and fp16) against jax.nn.dot_product_attention with
implementation="cudnn" and "xla", plus the compiled temp memory of one long sequence. Without a
GPU it runs a small fp32 grid against XLA on the CPU (about 2-3 minutes on 2 cores).

With --fa3-dir, FlashAttention-3 (dew_flash_attn.flash_mha) is measured too in every GPU cell it
takes (bf16 and fp16, head_dim up to 256: the whole standard grid), checked against the others,
and divided by in "jax_flash / FA3" columns beside "jax_flash / cuDNN". It is imported at run
time from that carry folder (dew_flash_attn/__init__.py, with the FlashAttention-2 library's
import removed, and libdew_flash_attn3.so.xz, as shared/ANCHORS.md describes); without one, or
off an sm90 GPU, its columns are left out and the report's "fa3" line says why. The whole grid
(seqlen 512-16k, with XLA) and FA3 take longer than one 10-minute job; on an H200 the 1k / 4k /
16k cells of bf16 and fp16 against cuDNN and FA3 take about 2.5 minutes:
    JAX_FLASH_COMMIT=<commit> python3 benchmarks/bench_attention.py --fa3-dir fa3_carry \\
        --dtypes bf16 fp16 --impls jax_flash cudnn fa3 --seqlens 1k 4k 16k --no-memory \\
        --time-limit 180

Writes <out>/attention_<gpu|cpu>[_quick].md (tables), .csv (one row per implementation and
cell), _memory.csv and .png (rate vs seqlen), and prints one line per measured cell. <out> is
--out, by default a scratch folder (jax_flash_bench in the system temp directory); --out
benchmarks/results updates the committed results.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
from _env import environment, resolve_device
from _fa3 import FA3_DIR_HELP, FA3_DTYPES, FA3_MAX_HEAD_DIM, load_fa3, plan_fa3
from _report import (
    CHECK_TOLERANCE,
    DTYPES,
    FLOP_FORMULA,
    LABELS,
    Cell,
    CsvSink,
    MemoryResult,
    Result,
    Unit,
    cross_check,
    csv_rows,
    markdown_report,
    memory_lines,
    plot,
    progress_line,
    ratio,
    result_fields,
    seqlen_label,
    summary_lines,
    write_memory_csv,
)
from _timing import (
    compile_jit,
    format_bytes,
    forward_backward,
    median,
    release,
    run_timed,
    short_error,
    stop_reason,
    stop_signals,
    temp_bytes,
)

import jax_flash

DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}
IMPL_NAMES = ("jax_flash", "cudnn", "xla", "fa3")
# A scratch folder, so that a plain run never overwrites the committed results in
# benchmarks/results (pass --out benchmarks/results to update those).
DEFAULT_OUT = Path(tempfile.gettempdir()) / "jax_flash_bench"

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, bool], jax.Array]


@dataclasses.dataclass(frozen=True)
class Grid:
    """Which cells to measure, how, and the long-sequence memory table."""

    name: str  # "gpu" or "cpu"
    dtypes: tuple[str, ...]
    head_dims: tuple[int, ...]
    seqlens: tuple[int, ...]
    backward_seqlens: tuple[int, ...] | None  # None: forward+backward at every seqlen
    tokens: int | None  # fixed tokens per cell (batch = tokens / seqlen); None: fixed batch
    hidden: int | None  # fixed hidden size (heads = hidden / head_dim); None: fixed heads
    batch: int
    heads: int
    impls: tuple[str, ...]
    baseline: str | None  # ratios are to this one; None when it is not measured
    versus: tuple[str, ...]  # jax_flash's ratio is also shown to these (FA3 when it is measured)
    repeats: int
    iters: int | None  # None: chosen per cell from a warm-up call
    memory_seqlens: tuple[int, ...]
    memory_shape: tuple[int, int, int]  # batch, heads, head_dim; causal
    memory_dtype: str
    memory_columns: tuple[tuple[str, bool], ...]  # (impl, with backward)

    def batch_heads(self, seqlen: int, head_dim: int) -> tuple[int, int]:
        batch = self.tokens // seqlen if self.tokens else self.batch
        heads = self.hidden // head_dim if self.hidden else self.heads
        return batch, heads

    def cells(self, backward: bool) -> list[Cell]:
        """Ordered so that consecutive cells share one input shape (inputs are drawn once)."""
        cells = []
        for dtype, head_dim, seqlen in itertools.product(self.dtypes, self.head_dims, self.seqlens):
            batch, heads = self.batch_heads(seqlen, head_dim)
            with_bwd = backward and (
                self.backward_seqlens is None or seqlen in self.backward_seqlens
            )
            for bwd, causal in itertools.product(
                (False, True) if with_bwd else (False,), (False, True)
            ):
                cells.append(Cell(dtype, head_dim, seqlen, causal, bwd, batch, heads))
        return cells


# The FlashAttention-2/3 papers' grid: 16k tokens and hidden 2048 keep every tensor at 64 MB in
# 16-bit (larger than the H200's 60 MB L2), so no cell is flattered by cache hits.
GPU_GRID = Grid(
    name="gpu",
    dtypes=("bf16", "fp16"),
    head_dims=(64, 128, 256),
    seqlens=(512, 1024, 2048, 4096, 8192, 16384),
    backward_seqlens=None,
    tokens=16384,
    hidden=2048,
    batch=0,
    heads=0,
    impls=("jax_flash", "cudnn", "xla"),
    baseline="cudnn",
    versus=(),
    repeats=5,
    iters=20,
    memory_seqlens=(8192, 32768, 131072),
    memory_shape=(1, 16, 128),
    memory_dtype="bf16",
    # XLA's backward at these lengths needs hundreds of GB; its forward already makes the point.
    memory_columns=(
        ("jax_flash", False),
        ("cudnn", False),
        ("xla", False),
        ("jax_flash", True),
        ("cudnn", True),
    ),
)
GPU_QUICK = dataclasses.replace(
    GPU_GRID,
    dtypes=("bf16",),
    head_dims=(128,),
    seqlens=(1024, 4096),
    repeats=3,
    iters=10,
    memory_seqlens=(8192, 32768),
)
# Small enough for a 2-core laptop-class CPU in a few minutes; the backward skips 4k, where one
# XLA call alone takes seconds.
CPU_GRID = Grid(
    name="cpu",
    dtypes=("fp32",),
    head_dims=(64,),
    seqlens=(1024, 2048, 4096),
    backward_seqlens=(1024, 2048),
    tokens=None,
    hidden=None,
    batch=1,
    heads=8,
    impls=("jax_flash", "xla"),
    baseline="xla",
    versus=(),
    repeats=3,
    iters=None,
    memory_seqlens=(8192, 16384, 32768),
    memory_shape=(1, 8, 64),
    memory_dtype="fp32",
    memory_columns=(("jax_flash", False), ("xla", False), ("jax_flash", True), ("xla", True)),
)
CPU_QUICK = dataclasses.replace(
    CPU_GRID, seqlens=(1024, 2048), backward_seqlens=(1024,), repeats=2, memory_seqlens=(8192,)
)


def _flash(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    return jax_flash.attention(q, k, v, causal=causal)


def _jax_nn(implementation: str) -> AttentionFn:
    params = inspect.signature(jax.nn.dot_product_attention).parameters

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
        # Checked per call rather than at import so that one missing keyword in some jax
        # version turns into an error cell, not a crash of the whole run.
        if "implementation" not in params or "is_causal" not in params:
            raise NotImplementedError(
                f"jax {jax.__version__}: dot_product_attention lacks implementation=/is_causal="
            )
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=implementation
        )

    return attend


def _fa3(fa3: Any) -> AttentionFn:
    def attend(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
        # flash_mha aligns a causal mask to the last key and the others to the first; every
        # cell here has as many keys as queries, where the two masks are the same.
        return fa3.flash_mha(q, k, v, is_causal=causal)

    return attend


def implementations(fa3: Any | None) -> dict[str, AttentionFn]:
    """The functions under each implementation's name; FA3's only when its module was loaded."""
    impls = {
        "jax_flash": _flash,
        "cudnn": _jax_nn("cudnn"),
        # Explicit: implementation=None would pick cuDNN on a GPU.
        "xla": _jax_nn("xla"),
    }
    if fa3 is not None:
        impls["fa3"] = _fa3(fa3)
    return impls


def takes(impl: str, cell: Cell) -> bool:
    """Whether impl is measured on cell: FA3's API has no float32 and no head_dim above 256, and
    a cell it cannot take is left out of its column rather than recorded as its error."""
    if impl == "fa3":
        return cell.dtype in FA3_DTYPES and cell.head_dim <= FA3_MAX_HEAD_DIM
    return True


def check_order(grid: Grid) -> list[str]:
    """Whose outputs the others are checked against: the first of these that ran."""
    # jax_flash is what is under test, so it is the reference only as a last resort. XLA comes
    # before FA3: its unfused softmax is the formula itself, so when the baseline fails a wrong
    # FA3 figure is caught rather than made the yardstick.
    others = [i for i in grid.impls if i not in ("jax_flash", grid.baseline)]
    return [i for i in (grid.baseline, *others, "jax_flash") if i]


def benchmark_fn(attend: AttentionFn, causal: bool, backward: bool) -> Callable[..., Any]:
    """The function that is jitted and timed: forward, or forward + backward for a given dout."""

    def forward(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return attend(q, k, v, causal)

    if not backward:
        return forward

    return forward_backward(forward)


def make_inputs(cell: Cell, with_dout: bool) -> list[jax.Array]:
    """q, k, v (and dout) drawn from a normal distribution: zeros or constants would let the
    softmax and the hardware take shortcuts real data never allows."""
    keys = jax.random.split(jax.random.key(cell.seqlen + 7 * cell.head_dim), 4)
    count = 4 if with_dout else 3
    arrays = [jax.random.normal(key, cell.shape, DTYPES[cell.dtype]) for key in keys[:count]]
    return jax.block_until_ready(arrays)


def measure(
    cell: Cell,
    impl: str,
    attend: AttentionFn,
    inputs: Sequence[jax.Array],
    grid: Grid,
    device: jax.Device,
) -> tuple[Result, list[jax.Array]]:
    """Times one implementation on one cell; also returns one call's outputs for the check."""
    fn = benchmark_fn(attend, cell.causal, cell.backward)
    args = list(inputs[:4] if cell.backward else inputs[:3])
    try:
        per_call, iters, outputs = run_timed(
            fn, args, device, iters=grid.iters, repeats=grid.repeats
        )
    except Exception as exc:  # any failure becomes this cell's 'error: ...'; the run goes on
        return Result(cell, impl, None, short_error(exc), 0, grid.repeats), []
    result = Result(cell, impl, median(per_call), None, iters, grid.repeats, tuple(per_call))
    return result, outputs


def run_grid(
    grid: Grid,
    cells: Sequence[Cell],
    fns: dict[str, AttentionFn],
    device: jax.Device,
    unit: Unit,
    results: list[Result],
    sink: CsvSink,
) -> None:
    """Measures every cell with every implementation that takes it; appends to results as it
    goes."""
    order = check_order(grid)
    index = 0
    for _, group in itertools.groupby(cells, key=lambda c: (c.dtype, c.shape)):
        group = list(group)
        inputs: list[jax.Array] = []
        reason = ""
        try:
            inputs = make_inputs(group[0], with_dout=any(c.backward for c in group))
        except Exception as exc:  # e.g. out of memory for the inputs themselves
            reason = short_error(exc)
        try:
            for cell in group:
                index += 1
                start = time.perf_counter()
                impls = [i for i in grid.impls if takes(i, cell)]
                if reason:
                    measured = {i: Result(cell, i, None, reason, 0, grid.repeats) for i in impls}
                else:
                    measured, outputs = {}, {}
                    for impl in impls:
                        measured[impl], outputs[impl] = measure(
                            cell, impl, fns[impl], inputs, grid, device
                        )
                    measured = cross_check(measured, outputs, order)
                    release([x for leaves in outputs.values() for x in leaves])
                results.extend(measured.values())
                sink.add(csv_rows(measured, grid.baseline, unit, grid.versus))
                elapsed = time.perf_counter() - start
                extra = " | ".join(_versus_text(measured, impl) for impl in grid.versus)
                line = progress_line(
                    index, len(cells), cell, measured, grid.baseline, unit, elapsed, extra
                )
                print(line, flush=True)
        finally:
            release(inputs)


def _versus_text(measured: dict[str, Result], impl: str) -> str:
    r = ratio(measured, "jax_flash", impl)
    return f"jax_flash/{LABELS[impl]} {'-' if r is None else f'{r:.2f}'}"


def run_memory(
    grid: Grid, fns: dict[str, AttentionFn], device: jax.Device, results: list[MemoryResult]
) -> None:
    """Compiled temp bytes at long sequences. Shapes only: nothing is allocated or run, so XLA's
    quadratic score matrix can be reported at lengths where it would never fit."""
    batch, heads, head_dim = grid.memory_shape
    sharding = jax.sharding.SingleDeviceSharding(device)
    for seqlen in grid.memory_seqlens:
        shape = (batch, seqlen, heads, head_dim)
        spec = jax.ShapeDtypeStruct(shape, DTYPES[grid.memory_dtype], sharding=sharding)
        row = []
        for impl, backward in grid.memory_columns:
            fn = benchmark_fn(fns[impl], causal=True, backward=backward)
            try:
                temp = temp_bytes(compile_jit(fn, [spec] * (4 if backward else 3)))
                entry = MemoryResult(seqlen, impl, backward, temp, None)
            except Exception as exc:  # a compile-time rejection is a result, not a crash
                entry = MemoryResult(seqlen, impl, backward, None, short_error(exc))
            results.append(entry)
            value = f"error: {entry.error[:40]}" if entry.error else format_bytes(entry.temp_bytes)
            row.append(f"{LABELS[impl]} {'fwd+bwd' if backward else 'fwd'} {value}")
        print(f"[memory] S={seqlen_label(seqlen):<4} " + " | ".join(row), flush=True)


def method_lines(grid: Grid) -> list[str]:
    iters = "auto-chosen (>= 0.3 s per repeat, at most 20)" if grid.iters is None else grid.iters
    lines = [
        "Implementations: jax_flash.attention; cuDNN = jax.nn.dot_product_attention(..., "
        'implementation="cudnn"); XLA = the same with implementation="xla"'
        + (
            "; FA3 = FlashAttention-3, dew_flash_attn.flash_mha(q, k, v, is_causal=...) "
            f"(its {'/'.join(FA3_DTYPES)} cells, head_dim up to {FA3_MAX_HEAD_DIM})"
            if "fa3" in grid.impls
            else ""
        )
        + ". Same process, same inputs, layout [B, S, H, D].",
        "Timing: each function is jitted and compiled once per cell, warmed up with 2 calls, "
        f"then timed as {grid.repeats} repeats of {iters} back-to-back calls "
        "(block_until_ready on the whole output tree after the last call); the median time per "
        "call is reported.",
        "forward+backward: one jitted function returning out and jax.vjp's (dq, dk, dv) for a "
        "fixed random dout.",
    ]
    if grid.tokens and grid.hidden:
        tensor_mib = grid.tokens * grid.hidden * 2 / 2**20
        cache = ", more than a GPU's L2 (60 MB on an H200)" if tensor_mib >= 60 else ""
        lines.append(
            f"Inputs: random normal; {grid.tokens} tokens per cell (B = {grid.tokens} / S), "
            f"hidden {grid.hidden} (H = {grid.hidden} / D), so each tensor is {tensor_mib:.3g} MiB "
            f"in 16-bit{cache}."
        )
    else:
        lines.append(f"Inputs: random normal, B = {grid.batch}, H = {grid.heads}.")
    tolerances = ", ".join(f"{k} {v:g}" for k, v in CHECK_TOLERANCE.items())
    order = check_order(grid)
    if grid.baseline and "fa3" in grid.impls:
        reference = "the first that ran of " + ", ".join(f"{LABELS[i]}'s" for i in order)
    elif grid.baseline:
        reference = f"{LABELS[grid.baseline]}'s (or the next that ran)"
    else:
        reference = "another's"
    lines.append(
        "Check: one call's outputs (out; with the backward also dq, dk, dv) of each "
        f"implementation are compared with {reference}; a relative L2 error above {tolerances} "
        "marks the figure 'WRONG?'."
    )
    lines.append(
        "A failing implementation records 'error: <reason>' in its cell. A program whose "
        "compiled temp + output memory exceeds the free memory is not run."
    )
    return lines


def memory_title(grid: Grid) -> str:
    batch, heads, head_dim = grid.memory_shape
    return (
        f"compiled temp bytes, B={batch}, H={heads}, D={head_dim}, causal, {grid.memory_dtype} "
        "(jax.jit(f).lower(...).compile().memory_analysis(); compiled only, never run)"
    )


def _split(values: Sequence[str] | None) -> list[str]:
    return [v for value in values or () for v in value.split(",") if v]


def _parse_seqlen(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--platform",
        choices=("auto", "gpu", "cpu"),
        default="auto",
        help="auto: the GPU grid if JAX sees a GPU, else the CPU grid (default: auto)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="reduced grid for a smoke run (GPU: bf16, head_dim 128, seqlen 1k/4k, 3 repeats of "
        "10 calls; CPU: seqlen 1k/2k)",
    )
    parser.add_argument(
        "--dtypes", nargs="+", help="from bf16 fp16 fp32 (default: bf16 fp16 on GPU, fp32 on CPU)"
    )
    parser.add_argument("--head-dims", nargs="+", help="default: 64 128 256 on GPU, 64 on CPU")
    parser.add_argument(
        "--seqlens",
        nargs="+",
        help="e.g. 512 1k 4k (default: 512 1k 2k 4k 8k 16k on GPU, 1k 2k 4k on CPU, where "
        "forward+backward runs at all but the longest)",
    )
    parser.add_argument(
        "--impls",
        nargs="+",
        choices=IMPL_NAMES,
        help="default: jax_flash cudnn xla on GPU (and fa3 with --fa3-dir), jax_flash xla on CPU",
    )
    parser.add_argument("--fa3-dir", type=Path, help=FA3_DIR_HELP)
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory table")
    parser.add_argument(
        "--memory-seqlens", nargs="+", help="default: 8k 32k 128k on GPU, 8k 16k 32k on CPU"
    )
    parser.add_argument(
        "--repeats", type=int, help="timed repeats, the median is reported (default: 5 GPU, 3 CPU)"
    )
    parser.add_argument(
        "--iters", help="back-to-back calls per repeat, or 'auto' (default: 20 GPU, auto CPU)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"results directory (default: the scratch folder {DEFAULT_OUT})",
    )
    parser.add_argument("--name", help="file name stem (default attention_<grid>[_quick])")
    parser.add_argument("--dry-run", action="store_true", help="list the cells and exit")
    parser.add_argument(
        "--time-limit",
        type=int,
        metavar="SECONDS",
        help="stop measuring after this long and write what was measured (the full GPU grid "
        "can take longer than a 10-minute job slot)",
    )
    # Testing aids, left out of --help: run the GPU grid's code paths at tiny sizes on a CPU.
    parser.add_argument("--grid", choices=("gpu", "cpu"), help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.dtypes = [DTYPE_ALIASES.get(d.lower(), d.lower()) for d in _split(args.dtypes)]
        args.head_dims = [int(d) for d in _split(args.head_dims)]
        args.seqlens = [_parse_seqlen(s) for s in _split(args.seqlens)]
        args.memory_seqlens = [_parse_seqlen(s) for s in _split(args.memory_seqlens)]
        if args.iters not in (None, "auto"):
            args.iters = int(args.iters)
    except ValueError as exc:
        parser.error(str(exc))
    if args.impls and "fa3" in args.impls and args.fa3_dir is None:
        parser.error("--impls fa3 needs --fa3-dir")
    args.error = parser.error
    return args


def build_grid(args: argparse.Namespace, name: str, fa3: Any | None) -> Grid:
    """The default grid for name, with the command line's overrides applied and checked; FA3 is
    among the implementations when fa3 (its module, or a dry run's stand-in) is given."""
    if name == "gpu":
        grid = GPU_QUICK if args.quick else GPU_GRID
    else:
        grid = CPU_QUICK if args.quick else CPU_GRID
    changes: dict[str, Any] = {}
    if args.dtypes:
        unknown = sorted(set(args.dtypes) - set(DTYPES))
        if unknown:
            args.error(f"unknown dtype(s) {unknown}; choose from {sorted(DTYPES)}")
        changes["dtypes"] = tuple(args.dtypes)
    if args.head_dims:
        changes["head_dims"] = tuple(args.head_dims)
    if args.seqlens:
        seqlens = tuple(sorted(set(args.seqlens)))
        changes["seqlens"] = seqlens
        if grid.backward_seqlens is not None:
            changes["backward_seqlens"] = seqlens[:-1] if len(seqlens) > 1 else seqlens
    wanted = args.impls or (*grid.impls, "fa3")
    impls = tuple(i for i in IMPL_NAMES if i in wanted and (i != "fa3" or fa3 is not None))
    if impls != grid.impls:
        changes["impls"] = impls
    if "fa3" in impls and "jax_flash" in impls:
        changes["versus"] = ("fa3",)
    if args.memory_seqlens:
        changes["memory_seqlens"] = tuple(args.memory_seqlens)
    if args.tokens:
        changes["tokens"] = args.tokens
    if args.hidden:
        changes["hidden"] = args.hidden
    if args.repeats is not None:
        if args.repeats < 1:
            args.error("--repeats must be >= 1")
        changes["repeats"] = args.repeats
    if args.iters == "auto":
        changes["iters"] = None
    elif args.iters is not None:
        if args.iters < 1:
            args.error("--iters must be >= 1 or 'auto'")
        changes["iters"] = args.iters
    grid = dataclasses.replace(grid, **changes)
    impls = set(grid.impls)
    columns = tuple(
        (impl, bwd)
        for impl, bwd in grid.memory_columns
        if impl in impls and not (bwd and args.no_backward)
    )
    baseline = grid.baseline if grid.baseline in impls else None
    grid = dataclasses.replace(grid, memory_columns=columns, baseline=baseline)
    _check_grid(grid, args.error)
    return grid


def _check_grid(grid: Grid, error: Callable[[str], Any]) -> None:
    for seqlen in grid.seqlens:
        if seqlen < 1 or (grid.tokens and grid.tokens % seqlen):
            error(f"seqlen {seqlen} must divide the {grid.tokens} tokens per cell")
    for head_dim in grid.head_dims:
        if head_dim < 1 or (grid.hidden and grid.hidden % head_dim):
            error(f"head_dim {head_dim} must divide the hidden size {grid.hidden}")


def output_paths(args: argparse.Namespace, grid: Grid) -> dict[str, Path]:
    stem = args.name or f"attention_{grid.name}{'_quick' if args.quick else ''}"
    return {
        suffix: args.out / f"{stem}{suffix}" for suffix in (".md", ".csv", "_memory.csv", ".png")
    }


def print_plan(grid: Grid, cells: Sequence[Cell], fa3_status: str, files: Sequence[Path]) -> None:
    iters = "auto" if grid.iters is None else grid.iters
    print(
        f"grid {grid.name}: {len(cells)} cells x {len(grid.impls)} implementations "
        f"({', '.join(LABELS[i] for i in grid.impls)}); "
        f"baseline {LABELS[grid.baseline] if grid.baseline else 'none'}; "
        f"{grid.repeats} repeats x {iters} calls"
    )
    print(f"FA3: {fa3_status}")
    print(FLOP_FORMULA)
    for index, cell in enumerate(cells, 1):
        flops = cell.flops()
        left_out = ", ".join(LABELS[i] for i in grid.impls if not takes(i, cell))
        note = f" (without {left_out})" if left_out else ""
        print(f"  [{index:>3}] {cell.label()} {flops / 1e9:9.1f} GFLOP{note}")
    if grid.memory_columns and grid.memory_seqlens:
        columns = ", ".join(
            f"{LABELS[i]} {'fwd+bwd' if b else 'fwd'}" for i, b in grid.memory_columns
        )
        seqlens = ", ".join(seqlen_label(s) for s in grid.memory_seqlens)
        print(f"memory table ({memory_title(grid)}): seqlen {seqlens}; {columns}")
    print("would write: " + ", ".join(str(f) for f in files))


def print_header(
    args: argparse.Namespace, grid: Grid, cells: Sequence[Cell], env: dict[str, str]
) -> None:
    print(f"jax_flash attention benchmark on {env['device']}")
    if grid.name == "cpu" and args.platform == "auto":
        print(
            "No GPU visible to JAX: running the small CPU grid against XLA. On a GPU machine "
            "the same command measures the standard grid against cuDNN and XLA."
        )
    for key, value in env.items():
        print(f"  {key}: {value}")
    for line in [*method_lines(grid), FLOP_FORMULA]:
        print(f"  {line}")
    print(f"{len(cells)} cells x {len(grid.impls)} implementations; one line per cell:", flush=True)


def measure_everything(
    args: argparse.Namespace,
    grid: Grid,
    cells: Sequence[Cell],
    fns: dict[str, AttentionFn],
    device: jax.Device,
    unit: Unit,
    sink: CsvSink,
) -> tuple[list[Result], list[MemoryResult], bool]:
    """The grid, then the memory table; (results, memory, whether a stop signal cut it short)."""
    results: list[Result] = []
    memory: list[MemoryResult] = []
    try:
        with stop_signals(args.time_limit):
            run_grid(grid, cells, fns, device, unit, results, sink)
            if not args.no_memory and grid.memory_columns:
                run_memory(grid, fns, device, memory)
    except KeyboardInterrupt as stop:
        print(f"interrupted ({stop_reason(stop)}): writing what was measured so far", flush=True)
        return results, memory, True
    return results, memory, False


def write_outputs(
    paths: dict[str, Path],
    env: dict[str, str],
    grid: Grid,
    cells: Sequence[Cell],
    results: Sequence[Result],
    memory: Sequence[MemoryResult],
    unit: Unit,
    interrupted: bool,
) -> list[Path]:
    """The markdown report, the memory CSV and the plot (the main CSV is written as it goes)."""
    report = markdown_report(
        env,
        method_lines(grid),
        cells,
        results,
        grid.impls,
        grid.baseline,
        unit,
        memory,
        memory_title(grid),
        interrupted,
        grid.versus,
    )
    paths[".md"].write_text(report)
    written = [paths[".md"], paths[".csv"]]
    if memory:
        write_memory_csv(paths["_memory.csv"], env, memory)
        written.append(paths["_memory.csv"])
    others = ", ".join(LABELS[i] for i in grid.impls if i != "jax_flash")
    title = (
        f"jax_flash vs {others}, {env['device']}\n"
        f"jax {env['jax']}, jax_flash {env['jax_flash']}, {env['date']}"
    )
    if plot(paths[".png"], cells, results, grid.impls, unit, title):
        written.append(paths[".png"])
    else:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
    return written


def print_closing(
    grid: Grid,
    cells: Sequence[Cell],
    results: Sequence[Result],
    memory: Sequence[MemoryResult],
    unit: Unit,
    written: Sequence[Path],
    interrupted: bool,
) -> None:
    """Last in stdout on purpose: a caller that keeps only the tail still gets the verdict."""
    print("\nwrote " + ", ".join(str(p) for p in written))
    print(FLOP_FORMULA)
    if memory:
        print(f"\nMemory: {memory_title(grid)}")
        print("\n".join(memory_lines(memory, markdown=False)))
    print()
    summary = summary_lines(cells, results, grid.impls, grid.baseline, unit, grid.versus)
    print("\n".join(summary))
    failed = sum(1 for r in results if r.error)
    suspect = sum(1 for r in results if r.suspect)
    if failed:
        print(f"{failed} measurement(s) failed: see the 'error:' cells in {written[0]}")
    if suspect:
        print(f"{suspect} measurement(s) marked WRONG?: outputs disagree with another one's")
    if interrupted:
        print("run interrupted: the tables hold only the cells measured before")


def run(
    args: argparse.Namespace,
    grid: Grid,
    cells: Sequence[Cell],
    device: jax.Device,
    fa3: Any | None,
    fa3_status: str,
) -> int:
    unit = Unit.for_grid("cpu" if device.platform == "cpu" else "gpu")
    env = environment(device)
    env["fa3"] = fa3_status
    print_header(args, grid, cells, env)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = output_paths(args, grid)
    fields = [*Cell.CSV_FIELDS, *result_fields(unit, grid.baseline, grid.versus)]
    sink = CsvSink(paths[".csv"], env, fields)
    fns = implementations(fa3)
    try:
        results, memory, interrupted = measure_everything(
            args, grid, cells, fns, device, unit, sink
        )
    finally:
        sink.close()
    written = write_outputs(paths, env, grid, cells, results, memory, unit, interrupted)
    print_closing(grid, cells, results, memory, unit, written, interrupted)
    return 130 if interrupted else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    platform_name, device = resolve_device(args.platform, args.dry_run)
    name = args.grid or platform_name
    if args.fa3_dir is not None and args.impls and "fa3" not in args.impls:
        fa3, status = None, "not measured: fa3 is not in --impls"
    elif name != "gpu":
        fa3, status = None, "not measured on a CPU"
    elif args.dry_run:
        # Nothing is imported or run: FA3's columns are planned when its files are there.
        fa3, status = plan_fa3(args.fa3_dir)
    else:
        fa3, status = load_fa3(args.fa3_dir, device)
    grid = build_grid(args, name, fa3)
    cells = grid.cells(backward=not args.no_backward)
    if args.dry_run:
        print_plan(grid, cells, status, list(output_paths(args, grid).values()))
        return 0
    assert device is not None
    with jax.default_device(device):
        return run(args, grid, cells, device, fa3, status)


if __name__ == "__main__":
    sys.exit(main())
