"""Reads a compute-sanitizer racecheck log and fails unless every hazard it reports is on the
backward's dQ hand-off record (BwdDqHandoff).

The record is written by one consumer thread before its warpgroup's `bar.arrive` on a named
barrier and read by the writer warp after its `bar.sync` on that barrier (and the reverse through
the "free" barrier). PTX orders that pattern; racecheck does not follow `bar.arrive`, so it reports
the record's fields in every kernel whose dQ goes through the writer warps. Built with
JAX_FLASH_BWD_DQ_RECORD_MBAR=1 the record is ordered by mbarriers as well and racecheck reports
nothing in any kernel (docs/PERF_LOG.md). A hazard anywhere else, or a display cut at racecheck's
limit or a smaller --print-limit (either could hide one), fails.

Usage: python3 tools/racecheck_known.py LOG    (exit 0: only the record; 3: anything else)
"""

from __future__ import annotations

import re
import sys

# racecheck shows at most this many errors, whatever --print-limit says.
_DISPLAY_LIMIT = 100
_ACCESS = re.compile(r"(?:between|and) (Read|Write) access at (.*?) in \S+?:\d+")
_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards displayed \((\d+) errors")


def _on_record(accesses: list[tuple[str, str]]) -> bool:
    """Whether a reported race is the hand-off record: the writer warp's reads of it against the
    consumer thread's writes in the backward kernel."""
    reads = [where for kind, where in accesses if kind == "Read"]
    writes = [where for kind, where in accesses if kind == "Write"]
    if not reads or not writes:
        return False
    readers_ok = all("dq_record_take(" in w or "::bwd_dq_writer<" in w for w in reads)
    writers_ok = all("::bwd_wgmma_kernel<" in w for w in writes)
    return readers_ok and writers_ok


def check(text: str) -> tuple[int, int, list[str]]:
    """Returns (races on the record, other races, the other races' first lines)."""
    known, other, shown = 0, 0, []
    block: list[str] = []

    def close() -> None:
        nonlocal known, other
        if not block:
            return
        accesses = [m.groups() for line in block for m in [_ACCESS.search(line)] if m]
        if _on_record(accesses):
            known += 1
        else:
            other += 1
            shown.append(block[0].strip())
        block.clear()

    for line in text.splitlines():
        # The program's own output may share a line with the report (no newline between them).
        at = line.find("=========")
        body = line[at + len("=========") :].strip() if at >= 0 else line.strip()
        if body.startswith("Error: Race reported") or body.startswith("Warning:"):
            close()
            block.append(body)
        elif block and body.startswith("and "):
            block.append(body)
        else:
            close()
    close()
    return known, other, shown


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    text = open(argv[1], encoding="utf-8", errors="replace").read()
    summary = _SUMMARY.search(text)
    if summary is None:
        print("racecheck_known: no RACECHECK SUMMARY in the log (the run did not finish)")
        return 3
    displayed, errors = int(summary.group(1)), int(summary.group(2))
    known, other, shown = check(text)
    print(
        f"racecheck_known: {displayed} hazards displayed, {known} on the dQ hand-off record, "
        f"{other} elsewhere"
    )
    for line in shown[:20]:
        print("  " + line[:300])
    if known + other != displayed:
        print(f"racecheck_known: parsed {known + other} reports of the {displayed} displayed")
        return 3
    if errors > displayed:
        # A smaller --print-limit shows only the first reports of a longer count.
        print(f"racecheck_known: {errors} errors, {displayed} displayed; the rest are not shown")
        return 3
    if displayed >= _DISPLAY_LIMIT:
        print(f"racecheck_known: the display stopped at {_DISPLAY_LIMIT}; a hazard may be hidden")
        return 3
    return 0 if other == 0 else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv))
