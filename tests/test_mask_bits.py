"""The closed-form mask bits of the wgmma backward (TileMask::pair_row_bits) against the mask
policy's per-element test, on the host: a native check built with the host C++ compiler."""

from __future__ import annotations


def test_pair_row_bits_match_visible(run_native) -> None:
    assert "bits agree" in run_native("pair_row_bits_check")
