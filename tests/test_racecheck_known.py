"""tools/racecheck_known.py: the sanitize stage's racecheck passes only when every reported hazard
is on the backward's dQ hand-off record."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "tools" / "racecheck_known.py"
_spec = importlib.util.spec_from_file_location("racecheck_known", _PATH)
racecheck_known = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(racecheck_known)

_NS = "jax_flash::cuda::sm90::"
_KERNEL = (
    f"void {_NS}bwd_wgmma_kernel<{_NS}BwdWgmmaTraits<__half, (int)128, (bool)0, (bool)0>>(...)"
)
_WRITER = f"void {_NS}bwd_dq_writer<{_NS}BwdWgmmaTraits<__half, (int)128, (bool)0, (bool)0>>(...)"
_TAKE = f"{_NS}dq_record_take(const {_NS}BwdDqHandoff *, int)"


def _race(first: tuple[str, str], *others: tuple[str, str], prefix: str = "") -> str:
    kind, where = first
    lines = [
        f"{prefix}========= Error: Race reported between {kind} access at {where}+0x10 in a.cuh:1"
    ]
    lines += [f"=========     and {k} access at {w}+0x20 in b.cuh:2 [8 hazards]" for k, w in others]
    return "\n".join(lines) + "\n========= \n"


def _log(*races: str, displayed: int | None = None, errors: int | None = None) -> str:
    n = len(races) if displayed is None else displayed
    e = n if errors is None else errors
    body = "".join(races)
    return (
        "========= COMPUTE-SANITIZER\n"
        + body
        + f"========= RACECHECK SUMMARY: {n} hazards displayed ({e} errors, 0 warnings)\n"
    )


def _run(tmp_path: pathlib.Path, text: str) -> int:
    log = tmp_path / "race.txt"
    log.write_text(text)
    return racecheck_known.main(["racecheck_known.py", str(log)])


def test_clean_log_passes(tmp_path: pathlib.Path) -> None:
    assert _run(tmp_path, _log()) == 0


def test_record_races_pass(tmp_path: pathlib.Path) -> None:
    text = _log(
        _race(("Read", _WRITER), ("Write", _KERNEL), ("Write", _KERNEL)),
        _race(("Write", _KERNEL), ("Read", _TAKE), ("Read", _TAKE)),
        # The driver's own output without a newline before the report.
        _race(("Read", _WRITER), ("Write", _KERNEL), prefix="dtype=3 B=1 Sq=71 "),
    )
    assert _run(tmp_path, text) == 0


@pytest.mark.parametrize(
    "race",
    [
        # Another kernel's race.
        _race(("Write", "void foo<int>(int)"), ("Read", "void bar(int)")),
        # The consumers' writes against another consumer read, not the writer warp's.
        _race(("Write", _KERNEL), ("Read", _KERNEL)),
        # Two writes: not a read of the record.
        _race(("Write", _KERNEL), ("Write", _KERNEL)),
    ],
)
def test_other_races_fail(tmp_path: pathlib.Path, race: str) -> None:
    text = _log(_race(("Read", _WRITER), ("Write", _KERNEL)), race)
    assert _run(tmp_path, text) == 3


def test_cut_display_fails(tmp_path: pathlib.Path) -> None:
    races = [_race(("Read", _WRITER), ("Write", _KERNEL))] * 100
    assert _run(tmp_path, _log(*races)) == 3


def test_print_limit_cut_fails(tmp_path: pathlib.Path) -> None:
    # `--print-limit 5` over 656 reports: the first five are on the record, the rest unseen.
    races = [_race(("Read", _WRITER), ("Write", _KERNEL))] * 5
    assert _run(tmp_path, _log(*races, errors=656)) == 3
    assert _run(tmp_path, _log(*races)) == 0


def test_unparsed_report_fails(tmp_path: pathlib.Path) -> None:
    text = _log(_race(("Read", _WRITER), ("Write", _KERNEL)), displayed=2)
    assert _run(tmp_path, text) == 3


def test_unfinished_run_fails(tmp_path: pathlib.Path) -> None:
    assert _run(tmp_path, "========= COMPUTE-SANITIZER\n") == 3
