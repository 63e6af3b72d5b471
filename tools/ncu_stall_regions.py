"""Where a kernel's warps stall, by code region, from Nsight Compute's per-instruction samples.

Input: the source page of an ncu report as CSV, with SASS (`ncu -i REPORT.ncu-rep --page source
--csv --print-source sass > kernel.csv`, optionally gzipped), from a run that collected the
SourceCounters section (e.g. `--set full`). The SASS is cut into regions at its synchronisation
points (warpgroup and async-proxy waits, named barriers, mbarrier waits and arrivals, TMA
reductions, register reallocation), since those are where one phase of a pipelined kernel hands
over to the next. For each region with at least --min percent of the samples it prints the share
of all warp-stall samples and the instruction that ends it. Code after the first
`USETMAXREG.TRY_ALLOC` and before `USETMAXREG.DEALLOC` is taken as the consumers' (the kernels
here raise the consumers' registers first and lower the producer's after); it prints the top stall
reasons of each role.

Usage: python tools/ncu_stall_regions.py benchmarks/results/ncu_bwd64_sass_h200.csv.gz
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
from pathlib import Path

SYNC_MARKS = (
    "WARPGROUP.DEPBAR",
    "BAR.SYNC",
    "SYNCS.PHASECHK",
    "SYNCS.ARRIVE",
    "UTMAREDG",
    "USETMAXREG",
)


def read_rows(path: Path) -> tuple[list[str], list[list[str]]]:
    raw = path.read_bytes()
    text = gzip.decompress(raw).decode() if path.suffix == ".gz" else raw.decode()
    rows = list(csv.reader(io.StringIO(text)))
    # Row 0 names the kernel; row 1 is the header.
    return rows[1], rows[2:]


def number(cell: str) -> float:
    return float(cell) if cell else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", type=Path)
    parser.add_argument("--min", type=float, default=0.5, help="smallest region share shown (%%)")
    args = parser.parse_args()

    header, rows = read_rows(args.csv)
    col = {name: i for i, name in enumerate(header)}
    samples = col["Warp Stall Sampling (All Samples)"]
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(number(r[samples]) for r in rows)
    if total == 0:
        raise SystemExit("no stall samples in the file (was SourceCounters collected?)")

    print(f"{args.csv.name}: {len(rows)} instructions, {total:.0f} samples")
    source = [r[col["Source"]].strip() for r in rows]
    ends = [k for k, text in enumerate(source) if any(mark in text for mark in SYNC_MARKS)]
    start = 0
    for k in ends + [len(rows) - 1]:
        share = sum(number(r[samples]) for r in rows[start : k + 1]) / total * 100
        if share >= args.min:
            print(f"  [{start:5d}-{k:5d}] {share:5.1f}%  ends at {source[k][:64]}")
        start = k + 1

    alloc = next((k for k, text in enumerate(source) if "USETMAXREG.TRY_ALLOC" in text), 0)
    dealloc = next((k for k, text in enumerate(source) if "USETMAXREG.DEALLOC" in text), len(rows))

    for role, part in (
        ("before the split", rows[:alloc]),
        ("consumers", rows[alloc:dealloc]),
        ("producer", rows[dealloc:]),
    ):
        by_reason = {h: sum(number(r[col[h]]) for r in part) / total * 100 for h in reasons}
        share = sum(by_reason.values())
        top = sorted(by_reason.items(), key=lambda item: -item[1])[:6]
        listed = "  ".join(f"{name[6:]} {value:.1f}" for name, value in top)
        print(f"  {role:16s} {share:5.1f}%  {listed}")


if __name__ == "__main__":
    main()
