"""What the benchmarks write: results and their cross-check, the markdown report, the CSV files,
the plot, console tables."""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar, Protocol, TextIO

import jax
import jax.numpy as jnp
from _timing import format_bytes

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
LABELS = {
    "jax_flash": "jax_flash",
    "jax_flash_segments": "jax_flash segment_ids",
    "cudnn": "cuDNN",
    "xla": "XLA",
    "fa3": "FA3",
    "reference": "reference",
}
COLORS = {"jax_flash": "tab:red", "cudnn": "tab:blue", "xla": "tab:gray", "fa3": "tab:green"}


class MeasuredCell(Protocol):
    """What a Result needs of the problem it measured."""

    @property
    def dtype(self) -> str: ...  # "bf16", "fp16", "fp32": the check tolerance

    @property
    def backward(self) -> bool: ...

    def flops(self) -> float: ...

    def label(self) -> str: ...

    def csv_values(self) -> Sequence[object]: ...  # the columns that name the cell in a CSV row


@dataclasses.dataclass(frozen=True)
class Cell:
    """One point of the grid: q, k, v are [batch, seqlen, heads, head_dim]."""

    dtype: str
    head_dim: int
    seqlen: int
    causal: bool
    backward: bool
    batch: int
    heads: int

    CSV_FIELDS: ClassVar[tuple[str, ...]] = (
        "dtype",
        "direction",
        "head_dim",
        "causal",
        "seqlen",
        "batch",
        "heads",
    )

    def csv_values(self) -> list[object]:
        return [
            self.dtype,
            self.direction,
            self.head_dim,
            int(self.causal),
            self.seqlen,
            self.batch,
            self.heads,
        ]

    @property
    def direction(self) -> str:
        return "fwd+bwd" if self.backward else "fwd"

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seqlen, self.heads, self.head_dim)

    def label(self) -> str:
        """The cell in one fixed-width line, as the progress lines and the dry-run plan show it."""
        return (
            f"{self.dtype:<4} {self.direction:<7} d={self.head_dim:<3} "
            f"{'causal' if self.causal else 'full  '} S={seqlen_label(self.seqlen):<4} "
            f"B={self.batch:<3} H={self.heads:<3}"
        )

    def flops(self) -> float:
        """FlashAttention papers' convention: two matmuls of 2·S·S·D per head; the causal mask
        halves the useful work; the backward does 2.5x the forward (five matmuls, not two)."""
        forward = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim
        if self.causal:
            forward /= 2
        return 3.5 * forward if self.backward else forward


# Relative L2 error between two correct implementations stays well below these (FlashAttention
# kernels land near 3e-3 in bf16; fp32 allows for TF32 matmuls on GPUs); a kernel above them
# computes something else.
CHECK_TOLERANCE = {"bf16": 5e-2, "fp16": 2e-2, "fp32": 1e-2}


@dataclasses.dataclass(frozen=True)
class Result:
    """One implementation on one cell: median seconds per call, or the reason it failed."""

    cell: MeasuredCell
    impl: str
    seconds: float | None
    error: str | None
    iters: int
    repeats: int
    per_repeat: tuple[float, ...] = ()
    rel_err: float | None = None  # relative L2 error of all outputs against checked_against
    checked_against: str | None = None

    def rate(self, scale: float) -> float | None:
        return None if self.seconds is None else self.cell.flops() / self.seconds / scale

    @property
    def suspect(self) -> bool:
        """Outputs disagree with the reference implementation beyond rounding: the speed of a
        kernel that computes the wrong thing means nothing."""
        if self.rel_err is None:
            return False
        return not self.rel_err <= CHECK_TOLERANCE.get(self.cell.dtype, 1e-3)


@dataclasses.dataclass(frozen=True)
class MemoryResult:
    """Compiled temp bytes of one implementation at one long sequence (compiled, never run)."""

    seqlen: int
    impl: str
    backward: bool
    temp_bytes: int | None
    error: str | None


@dataclasses.dataclass(frozen=True)
class Unit:
    name: str  # "TFLOP/s"
    scale: float  # 1e12
    column: str  # CSV column name

    @staticmethod
    def for_grid(grid: str) -> Unit:
        if grid == "gpu":
            return Unit("TFLOP/s", 1e12, "tflop_per_s")
        return Unit("GFLOP/s", 1e9, "gflop_per_s")


FLOP_FORMULA = (
    "FLOPs: forward = 4·B·H·S·S·D, halved when causal; forward+backward = 3.5 × forward "
    "(backward = 2.5 × forward). Rate = FLOPs / median time per call."
)


def seqlen_label(seqlen: int) -> str:
    if seqlen >= 1024 and seqlen % 1024 == 0:
        return f"{seqlen // 1024}k"
    return str(seqlen)


def format_rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def ratio(results: dict[str, Result], impl: str, baseline: str | None) -> float | None:
    if baseline is None or impl not in results or baseline not in results:
        return None
    mine, base = results[impl].seconds, results[baseline].seconds
    if mine is None or base is None:
        return None
    # Same FLOPs on both sides, so the rate ratio is the inverse time ratio.
    return base / mine


def by_cell(results: Iterable[Result]) -> dict[MeasuredCell, dict[str, Result]]:
    table: dict[MeasuredCell, dict[str, Result]] = {}
    for result in results:
        table.setdefault(result.cell, {})[result.impl] = result
    return table


@jax.jit
def _relative_l2(x: jax.Array, ref: jax.Array) -> jax.Array:
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return jnp.linalg.norm(x - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30)


def cross_check(
    measured: dict[str, Result], outputs: Mapping[str, Sequence[jax.Array]], order: Sequence[str]
) -> dict[str, Result]:
    """Adds each implementation's relative L2 error against the first of `order` that ran.

    A kernel that skips work (or returns garbage) can post any speed; comparing its outputs
    (out, and dq, dk, dv for forward+backward) with another implementation's exposes that.
    `outputs` may hold a reference that was run but not timed (it is not in `measured`).
    """
    ref = next((impl for impl in order if outputs.get(impl)), None)
    if ref is None:
        return measured
    checked = dict(measured)
    for impl, leaves in outputs.items():
        if impl == ref or not leaves or impl not in measured:
            continue
        errors = [float(_relative_l2(x, r)) for x, r in zip(leaves, outputs[ref], strict=True)]
        # max() would skip a NaN; any NaN must surface as NaN.
        worst = next((e for e in errors if e != e), max(errors))
        checked[impl] = dataclasses.replace(measured[impl], rel_err=worst, checked_against=ref)
    return checked


def suspect_note(result: Result) -> str:
    if not result.suspect or result.checked_against is None:
        return ""
    return f" (WRONG? rel err {result.rel_err:.2g} vs {LABELS[result.checked_against]})"


def progress_line(
    index: int,
    total: int,
    cell: MeasuredCell,
    results: dict[str, Result],
    baseline: str | None,
    unit: Unit,
    elapsed: float,
    extra: str = "",
) -> str:
    """One line per measured cell, all implementations side by side; `extra` goes before the
    elapsed time."""
    width = len(str(total))
    head = f"[{index:>{width}}/{total}] {cell.label()}"
    parts = []
    for impl, result in results.items():
        value = (
            f"error: {result.error[:40]}"
            if result.error
            else format_rate(result.rate(unit.scale)) + suspect_note(result)
        )
        parts.append(f"{LABELS[impl]} {value}")
    tail = ""
    if "jax_flash" in results and baseline and baseline != "jax_flash":
        r = ratio(results, "jax_flash", baseline)
        tail = f" | jax_flash/{LABELS[baseline]} {'-' if r is None else f'{r:.2f}'}"
    extra = f" | {extra}" if extra else ""
    return f"{head} | {unit.name}: {' | '.join(parts)}{tail}{extra} | {elapsed:.1f} s"


def md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def md_value(result: Result | None, unit: Unit) -> str:
    if result is None:
        return "-"
    if result.error:
        return md_escape(f"error: {result.error}")
    return format_rate(result.rate(unit.scale)) + suspect_note(result)


def md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The same table as aligned text for the console: columns right-aligned, two spaces apart."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in [header, *rows]]


def _sections(cells: Sequence[Cell]) -> list[tuple[str, bool]]:
    return list(dict.fromkeys((cell.dtype, cell.backward) for cell in cells))


def markdown_head(
    title: str, env: Mapping[str, str], method: Sequence[str], interrupted: bool
) -> list[str]:
    """Title, the environment (command line first among the versions), the method bullets."""
    lines = [f"# {title}: {env.get('device', '')}", ""]
    lines += [
        f"- {key}: `{value}`" if key == "command" else f"- {key}: {value}"
        for key, value in env.items()
    ]
    lines += ["", "## Method", ""] + [f"- {line}" for line in method]
    if interrupted:
        lines += ["", "**Interrupted: the tables below hold only the cells measured before.**"]
    return lines


def markdown_report(
    env: dict[str, str],
    method: Sequence[str],
    cells: Sequence[Cell],
    results: Sequence[Result],
    impls: Sequence[str],
    baseline: str | None,
    unit: Unit,
    memory: Sequence[MemoryResult],
    memory_title: str,
    interrupted: bool,
    versus: Sequence[str] = (),
) -> str:
    """The report; `versus` names implementations that jax_flash's time is also divided by,
    each in a 'jax_flash / <impl>' column after the baseline's ratios."""
    table = by_cell(results)
    lines = markdown_head(
        "jax_flash attention benchmark", env, [*method, FLOP_FORMULA], interrupted
    )
    others = [impl for impl in impls if impl != baseline and baseline is not None]
    for dtype, backward in _sections(cells):
        direction = "forward+backward" if backward else "forward"
        ratio_note = (
            f"; ratio = implementation / {LABELS[baseline]}, >1 is faster" if baseline else ""
        )
        if versus:
            named = ", ".join(f"jax_flash / {LABELS[impl]}" for impl in versus)
            ratio_note += f"; {named} likewise, >1 is jax_flash faster"
        lines += ["", f"## {dtype}, {direction} ({unit.name}{ratio_note})", ""]
        header = ["head_dim", "causal", "seqlen", "batch × heads"]
        header += [f"{LABELS[impl]}" for impl in impls]
        header += [f"{LABELS[impl]} / {LABELS[baseline]}" for impl in others]
        header += [f"jax_flash / {LABELS[impl]}" for impl in versus]
        section = [c for c in cells if c.dtype == dtype and c.backward == backward]
        rows = []
        for cell in sorted(section, key=lambda c: (c.head_dim, c.causal, c.seqlen)):
            measured = table.get(cell, {})
            row = [str(cell.head_dim), "yes" if cell.causal else "no", seqlen_label(cell.seqlen)]
            row.append(f"{cell.batch} × {cell.heads}")
            row += [md_value(measured.get(impl), unit) for impl in impls]
            pairs = [(impl, baseline) for impl in others]
            pairs += [("jax_flash", impl) for impl in versus]
            for impl, reference in pairs:
                r = ratio(measured, impl, reference)
                row.append("-" if r is None else f"{r:.2f}")
            rows.append(row)
        lines += md_table(header, rows)
    if memory:
        lines += ["", f"## Memory: {memory_title}", ""]
        lines += memory_lines(memory, markdown=True)
    return "\n".join(lines) + "\n"


def _memory_columns(memory: Sequence[MemoryResult]) -> list[tuple[str, bool]]:
    return list(dict.fromkeys((m.impl, m.backward) for m in memory))


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def memory_lines(memory: Sequence[MemoryResult], *, markdown: bool) -> list[str]:
    """The memory table, as markdown or as aligned text for the console."""
    columns = _memory_columns(memory)
    values = {(m.seqlen, m.impl, m.backward): m for m in memory}
    header = ["seqlen"] + [f"{LABELS[i]} {'fwd+bwd' if b else 'fwd'}" for i, b in columns]
    rows = []
    for seqlen in dict.fromkeys(m.seqlen for m in memory):
        row = [seqlen_label(seqlen)]
        for impl, backward in columns:
            m = values.get((seqlen, impl, backward))
            if m is None:
                row.append("-")
            elif m.error:
                row.append(f"error: {m.error}" if markdown else _clip(f"error: {m.error}", 40))
            else:
                row.append(format_bytes(m.temp_bytes))
        rows.append(row)
    if markdown:
        return md_table(header, [[md_escape(v) for v in row] for row in rows])
    return text_table(header, rows)


def summary_lines(
    cells: Sequence[Cell],
    results: Sequence[Result],
    impls: Sequence[str],
    baseline: str | None,
    unit: Unit,
    versus: Sequence[str] = (),
) -> list[str]:
    """The compact closing table: jax_flash's rate and its ratio to the baseline per cell, then
    its ratio to each of `versus`."""
    table = by_cell(results)
    subject = "jax_flash" if "jax_flash" in impls else impls[0]
    base = LABELS[baseline] if baseline and baseline != subject else None
    base_impl = baseline if base else None
    versus = [impl for impl in versus if impl != subject]
    name = LABELS[subject]
    # Rows are (dtype, direction, head_dim, causal), columns seqlen; batch and heads follow from
    # those, so they are not part of the key.
    keyed = {(c.dtype, c.backward, c.head_dim, c.causal, c.seqlen): c for c in cells}
    seqlens = sorted({c.seqlen for c in cells})
    header = ["dtype", "dir", "d", "causal"] + [seqlen_label(s) for s in seqlens]
    rows = []
    for dtype, backward, head_dim, causal in dict.fromkeys(k[:4] for k in keyed):
        row = [dtype, "fwd+bwd" if backward else "fwd", str(head_dim), "yes" if causal else "no"]
        for seqlen in seqlens:
            cell = keyed.get((dtype, backward, head_dim, causal, seqlen))
            measured = table.get(cell, {}) if cell else None
            row.append(
                ""
                if measured is None
                else _summary_value(measured, subject, (base_impl, *versus), unit)
            )
        rows.append(row)
    text = text_table(header, rows)
    references = [LABELS[impl] for impl in (base_impl, *versus) if impl]
    if references:
        ratios = [f"{name}/{r}" for r in references]
        title = f"{name} {unit.name} and ratio to {' and '.join(references)} "
        title += f"({', '.join(ratios)}; >1 = {name} faster)"
        legend = f"each entry: {name} {unit.name}, then {', then '.join(ratios)} "
        legend += f"('--': no {' or '.join(references)} figure); "
    else:
        title = f"{name} {unit.name}"
        legend = f"each entry: {name} {unit.name}; "
    legend += f"err: {name} failed; '!': its outputs disagree with another implementation's; "
    legend += "'-': not measured; blank: not in the grid"
    return [title, legend, *text]


def _summary_value(
    measured: dict[str, Result], subject: str, references: Sequence[str | None], unit: Unit
) -> str:
    """subject's rate, then its ratio to each of references (None: the baseline is not shown)."""
    if subject not in measured:
        return "-"  # the run was interrupted before this cell
    mine = measured[subject]
    if mine.error:
        return "err"
    parts = [format_rate(mine.rate(unit.scale)) + ("!" if mine.suspect else "")]
    for reference in references:
        if reference is not None:
            r = ratio(measured, subject, reference)
            parts.append("--" if r is None else f"{r:.2f}")
    return " ".join(parts)


RESULT_FIELDS = (
    "impl",
    "flops",
    "median_ms",
    "rate",  # named after the unit, e.g. tflop_per_s
    "ratio_to_baseline",  # named after the baseline, e.g. ratio_to_cudnn
    "iters",
    "repeats",
    "per_repeat_ms",
    "rel_err",
    "checked_against",
    "error",
)


def result_fields(unit: Unit, baseline: str | None, versus: Sequence[str] = ()) -> list[str]:
    """RESULT_FIELDS as CSV column names for this unit and baseline, with a ratio_to_<impl>
    column for each of `versus` after the baseline's."""
    names = {"rate": unit.column}
    if baseline:
        names["ratio_to_baseline"] = f"ratio_to_{baseline}"
    fields = [names.get(field, field) for field in RESULT_FIELDS]
    after = RESULT_FIELDS.index("ratio_to_baseline") + 1
    fields[after:after] = [f"ratio_to_{impl}" for impl in versus]
    return fields


def _ratio_text(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def result_values(
    result: Result,
    unit: Unit,
    ratio_to_baseline: float | None,
    ratios_versus: Sequence[float | None] = (),
) -> list[object]:
    """One result's values, in result_fields' order."""
    rate = result.rate(unit.scale)
    return [
        result.impl,
        f"{result.cell.flops():.6g}",
        "" if result.seconds is None else f"{result.seconds * 1e3:.4f}",
        "" if rate is None else f"{rate:.2f}",
        _ratio_text(ratio_to_baseline),
        *(_ratio_text(value) for value in ratios_versus),
        result.iters,
        result.repeats,
        " ".join(f"{t * 1e3:.4f}" for t in result.per_repeat),
        "" if result.rel_err is None else f"{result.rel_err:.3g}",
        result.checked_against or "",
        result.error or "",
    ]


def csv_rows(
    measured: dict[str, Result], baseline: str | None, unit: Unit, versus: Sequence[str] = ()
) -> list[list[object]]:
    """One row per implementation of one measured cell: the cell's csv_values, then the result,
    whose ratios are its own to the baseline and to each of `versus`."""
    rows = []
    for impl, result in measured.items():
        to_versus = [ratio(measured, impl, other) for other in versus]
        values = result_values(result, unit, ratio(measured, impl, baseline), to_versus)
        rows.append([*result.cell.csv_values(), *values])
    return rows


class CsvSink:
    """Writes rows as soon as a cell is measured, so a run cut short by a time limit still leaves
    its numbers on disk. The environment and notes lead as '#' lines, which
    pandas.read_csv(path, comment="#") skips."""

    def __init__(
        self,
        path: Path,
        env: Mapping[str, str],
        fields: Sequence[str],
        notes: Sequence[str] = (FLOP_FORMULA,),
    ) -> None:
        self._file: TextIO = path.open("w", newline="")
        for key, value in env.items():
            self._file.write(f"# {key}: {value}\n")
        for note in notes:
            self._file.write(f"# {note}\n")
        self._writer = csv.writer(self._file)
        self._writer.writerow(fields)
        self._file.flush()

    def add(self, rows: Iterable[Sequence[object]]) -> None:
        self._writer.writerows(rows)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_memory_csv(path: Path, env: dict[str, str], memory: Sequence[MemoryResult]) -> None:
    with path.open("w", newline="") as f:
        for key, value in env.items():
            f.write(f"# {key}: {value}\n")
        writer = csv.writer(f)
        writer.writerow(["seqlen", "impl", "direction", "temp_bytes", "error"])
        for m in memory:
            temp = "" if m.temp_bytes is None else m.temp_bytes
            direction = "fwd+bwd" if m.backward else "fwd"
            writer.writerow([m.seqlen, m.impl, direction, temp, m.error or ""])


def plot(
    path: Path,
    cells: Sequence[Cell],
    results: Sequence[Result],
    impls: Sequence[str],
    unit: Unit,
    title: str,
) -> bool:
    """Rate vs seqlen: one row of panels per (dtype, direction), one column per head_dim; solid
    lines non-causal, dashed causal. Returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a benchmark host
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        return False
    table = by_cell(results)
    rows = _sections(cells)
    head_dims = sorted({c.head_dim for c in cells})
    width = max(7.0, 4.6 * len(head_dims))  # room for the title and legend with one column
    fig, axes = plt.subplots(
        len(rows),
        len(head_dims),
        figsize=(width, 3.4 * len(rows) + 0.8),
        squeeze=False,
        layout="constrained",
    )
    for (dtype, backward), panel_row in zip(rows, axes, strict=True):
        for head_dim, ax in zip(head_dims, panel_row, strict=True):
            panel = [
                c for c in cells if (c.dtype, c.backward, c.head_dim) == (dtype, backward, head_dim)
            ]
            for impl in impls:
                for causal in (False, True):
                    points = sorted(
                        (c.seqlen, table[c][impl].rate(unit.scale))
                        for c in panel
                        if c.causal == causal and impl in table.get(c, {})
                    )
                    points = [(s, r) for s, r in points if r is not None]
                    if points:
                        xs, ys = zip(*points, strict=True)
                        style = "--" if causal else "-"
                        ax.plot(xs, ys, style, marker="o", ms=3, color=COLORS[impl])
            seqlens = sorted({c.seqlen for c in panel})
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [seqlen_label(s) for s in seqlens])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            direction = "forward+backward" if backward else "forward"
            ax.set_title(f"{dtype} {direction}, head_dim {head_dim}", fontsize=10)
            ax.set_xlabel("seqlen")
            ax.set_ylabel(unit.name)
    handles = [Line2D([], [], color=COLORS[i], marker="o", label=LABELS[i]) for i in impls]
    handles += [
        Line2D([], [], color="black", linestyle="-", label="non-causal"),
        Line2D([], [], color="black", linestyle="--", label="causal"),
    ]
    # "outside" places the legend in its own band, so constrained layout never overlaps it.
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
