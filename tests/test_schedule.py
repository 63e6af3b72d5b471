"""The tile scheduler's launch order (LaunchOrder, launch_group) and the fixed-size chunk-range
read of the mask policy (id_range_fixed), on the host: a native check built with the host C++
compiler. And the segment-id chunk records that Python passes to every kernel, against their
definition (common/mask.h kSegmentRecord)."""

from __future__ import annotations

import numpy as np
import pytest

from jax_flash import _kernel


def test_launch_order_and_chunk_ranges(run_native) -> None:
    assert "check out" in run_native("schedule_check")


@pytest.mark.parametrize("length", [1, 16, 17, 200, 1000])
@pytest.mark.parametrize("suffix", [False, True])
def test_segment_records(length: int, suffix: bool) -> None:
    rng = np.random.default_rng(length)
    ids = rng.integers(-3, 6, size=(2, 3, length)).astype(np.int32)
    rec = np.asarray(_kernel._segment_ranges(ids, suffix_reach=suffix))
    chunk = _kernel.SEGMENT_CHUNK
    chunks = -(-length // chunk)
    assert rec.shape == (2, 3, chunks, 4)
    for c in range(chunks):
        own = ids[..., c * chunk : (c + 1) * chunk]
        reach = ids[..., c * chunk :] if suffix else ids[..., : (c + 1) * chunk]
        np.testing.assert_array_equal(rec[..., c, 0], own.min(-1))
        np.testing.assert_array_equal(rec[..., c, 1], own.max(-1))
        np.testing.assert_array_equal(rec[..., c, 2], reach.min(-1))
        np.testing.assert_array_equal(rec[..., c, 3], reach.max(-1))
