"""The tile scheduler's launch order (LaunchOrder, launch_group) and the fixed-size chunk-range
read of the mask policy (id_range_fixed), on the host: a native check built with the host C++
compiler."""

from __future__ import annotations


def test_launch_order_and_chunk_ranges(run_native) -> None:
    assert "check out" in run_native("schedule_check")
