"""The instruction mix of the loops of a kernel that issue wgmma, from its SASS.

Input, one or more kernels, each either
- cuobjdump's SASS of one function (`cuobjdump -sass -fun NAME FILE > k.sass`; FILE a cubin from
  `nvcc -cubin`, or any library with sm_90a code), or
- an Nsight Compute source page as CSV, optionally gzipped (tools/ncu_stall_regions.py says how
  to write one), which adds how often each instruction ran.
A loop is a backward branch with the code from its target to itself. Only loops with at least one
HGMMA are kept. The main loop (the pair loop of a backward, the key-block loop of a forward, here
and in FlashAttention-3) is taken to be the one with the most HGMMA per instruction: the loops
around it (a CTA's tiles, a persistent kernel's work) also hold the prologue's and epilogue's
code, and the compiler's loop rotation can give one source loop two back branches with
overlapping ranges, the denser being the body.

For one kernel every such loop is listed with its opcode counts (the mnemonic up to its first
dot); from a CSV the counts are executions per pass of the loop (instructions executed /
back-branch executions). For several kernels, one table of the main loops side by side, so that
two kernels' loop bodies can be compared without a GPU: a static count includes both sides of
every branch in the loop, so it bounds what a pass issues from above.

--outline prints each kernel's main loop in order as its synchronisation points (wgmma waits and
arrivals, barriers, mbarrier operations, stmatrix, fences, branches) and runs of HGMMA, with the
count and the commonest opcodes of the instructions between them: where in a pass the math sits
relative to the GEMMs it waits for.

Usage: python tools/sass_loop_mix.py ours.sass fa3.sass
       python tools/sass_loop_mix.py --outline ours.sass
       python tools/sass_loop_mix.py benchmarks/results/ncu_bwd128_sass_h200.csv.gz
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ncu_stall_regions import read_rows  # noqa: E402

SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH_TARGET = re.compile(r"\bBRA\b\s+(?:`\()?(0x[0-9a-f]+)")
GUARD = re.compile(r"^@!?U?P[T0-9]+\s+")


@dataclass
class Instruction:
    address: int
    text: str
    executed: int | None  # warp-level executions (ncu CSV only)

    @property
    def opcode(self) -> str:
        body = GUARD.sub("", self.text)
        return body.split()[0].split(".")[0] if body else ""


@dataclass
class Loop:
    start: int  # index of the branch target
    end: int  # index of the backward branch
    hgmma: int


def read_kernel(path: Path) -> list[Instruction]:
    if path.suffix in (".csv", ".gz"):
        header, rows = read_rows(path)
        col = {name: i for i, name in enumerate(header)}
        return [
            Instruction(
                int(r[col["Address"]], 16),
                r[col["Source"]].strip(),
                int(r[col["Instructions Executed"]] or 0),
            )
            for r in rows
            if r[col["Address"]].startswith("0x")
        ]
    out = []
    for line in path.read_text().splitlines():
        m = SASS_LINE.match(line)
        if m:
            out.append(Instruction(int(m.group(1), 16), m.group(2), None))
    if not out:
        raise SystemExit(f"{path}: no SASS instructions found")
    return out


def hgmma_loops(code: list[Instruction]) -> list[Loop]:
    index = {ins.address: i for i, ins in enumerate(code)}
    loops = []
    for i, ins in enumerate(code):
        m = BRANCH_TARGET.search(ins.text)
        if not m:
            continue
        target = index.get(int(m.group(1), 16))
        if target is None or target > i:
            continue
        n = sum(1 for x in code[target : i + 1] if x.opcode == "HGMMA")
        if n:
            loops.append(Loop(target, i, n))
    return sorted(loops, key=lambda lp: lp.end - lp.start)


def main_loop(loops: list[Loop]) -> Loop:
    return max(loops, key=lambda lp: (lp.hgmma / (lp.end - lp.start + 1), -lp.start))


def mix(code: list[Instruction], loop: Loop) -> tuple[Counter, float]:
    """Opcode counts of a loop: static, or per pass when execution counts are known."""
    body = code[loop.start : loop.end + 1]
    passes = code[loop.end].executed
    counts: Counter = Counter()
    for ins in body:
        counts[ins.opcode] += 1 if passes is None else ins.executed
    if passes:
        return Counter({k: v / passes for k, v in counts.items()}), passes
    return counts, 0


def describe(path: Path, code: list[Instruction], loop: Loop, is_main: bool) -> str:
    counts, passes = mix(code, loop)
    base = code[0].address
    where = f"[{code[loop.start].address - base:#x}, {code[loop.end].address - base:#x}]"
    kind = "main loop" if is_main else "loop"
    total = sum(counts.values())
    per = f", per pass ({passes} passes)" if passes else ", static"
    top = " ".join(f"{k}:{v:.4g}" for k, v in counts.most_common())
    return f"{path.name} {where} {kind}, {loop.hgmma} HGMMA, {total:.0f} instructions{per}\n  {top}"


OUTLINE_MARKS = ("WARPGROUP", "BAR", "SYNCS", "STSM", "FENCE", "MEMBAR", "BRA", "UTMA", "UBLK")


def outline(code: list[Instruction], loop: Loop) -> list[str]:
    """The loop as synchronisation points and HGMMA runs, with what lies between them."""
    lines: list[str] = []
    between: Counter = Counter()
    hgmma_run = 0

    def flush() -> None:
        nonlocal hgmma_run
        if hgmma_run:
            lines.append(f"  {hgmma_run} HGMMA")
            hgmma_run = 0
        if between:
            top = " ".join(f"{k}:{v}" for k, v in between.most_common(6))
            lines.append(f"    ... {sum(between.values())} others ({top})")
            between.clear()

    base = code[0].address
    for ins in code[loop.start : loop.end + 1]:
        if ins.opcode == "HGMMA":
            if between:
                if between.total() <= 4:
                    between.clear()  # descriptor updates between the wgmmas of one GEMM
                else:
                    flush()
            hgmma_run += 1
        elif ins.opcode.startswith(OUTLINE_MARKS):
            flush()
            lines.append(f"  {ins.address - base:#07x} {ins.text}")
        else:
            between[ins.opcode] += 1
    flush()
    return lines


def load(path: Path) -> tuple[list[Instruction], list[Loop], Loop]:
    """A kernel's code, its HGMMA loops and the main one among them."""
    code = read_kernel(path)
    loops = hgmma_loops(code)
    if not loops:
        raise SystemExit(f"{path}: no loop issues HGMMA")
    return code, loops, main_loop(loops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", type=Path, nargs="+", help="SASS text or ncu source CSV")
    parser.add_argument("--rows", type=int, default=30, help="opcodes in the side-by-side table")
    parser.add_argument("--outline", action="store_true", help="the main loops in order")
    args = parser.parse_args()

    if args.outline:
        for path in args.kernels:
            code, _, best = load(path)
            print(describe(path, code, best, True).split("\n")[0])
            print("\n".join(outline(code, best)))
        return

    chosen = []
    for path in args.kernels:
        code, loops, best = load(path)
        if len(args.kernels) == 1:
            for lp in loops:
                print(describe(path, code, lp, lp is best))
            return
        print(describe(path, code, best, True))
        chosen.append(mix(code, best)[0])

    names = [p.name for p in args.kernels]
    total = Counter()
    for c in chosen:
        total.update({k: v for k, v in c.items()})
    rows = [k for k, _ in total.most_common(args.rows)]
    print()
    print("| opcode | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for k in rows:
        print(f"| {k} | " + " | ".join(f"{c.get(k, 0):.4g}" for c in chosen) + " |")
    sums = " | ".join(f"{sum(c.values()):.0f}" for c in chosen)
    print(f"| all | {sums} |")


if __name__ == "__main__":
    main()
