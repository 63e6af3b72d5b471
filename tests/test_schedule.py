"""The tile scheduler's launch order (LaunchOrder, launch_group) and the fixed-size chunk-range
read of the mask policy (id_range_fixed), on the host: a native check built with the host C++
compiler. And the segment-id summaries that every kernel reads (the chunk records, common/mask.h
kSegmentRecord, and the rows' documents, common/schedule.h SeqLayout::runs), against their
definitions, and the GPU's summary kernel against them."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from conftest import ON_GPU

from jax_flash import _kernel


def test_launch_order_and_chunk_ranges(run_native) -> None:
    assert "check out" in run_native("schedule_check")


def test_deterministic_launch_group(run_native) -> None:
    # Built with JAX_FLASH_DET_LAUNCH_GROUP set to 6 (the library's is 4).
    assert "check out" in run_native("det_launch_group_check")


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


def _runs_reference(q_ids: np.ndarray, kv_ids: np.ndarray, runs: int) -> np.ndarray:
    """SeqLayout::runs of each row, from its definition."""
    out = np.zeros((*q_ids.shape[:-1], runs), np.int32)
    for index in np.ndindex(q_ids.shape[:-1]):
        row = q_ids[index]
        starts = [0] + [p for p in range(1, row.size) if row[p] != row[p - 1]]
        ids = [row[p] for p in starts]
        documents = (
            len(starts) <= runs and len(set(ids)) == len(ids) and np.array_equal(row, kv_ids[index])
        )
        out[index][0] = documents
        out[index][1:] = (starts[1:] + [row.size] * runs)[: runs - 1]
    return out


@pytest.mark.parametrize("runs", [1, 4, 32])
@pytest.mark.parametrize("kind", ["documents", "recurring", "many", "one", "kv_differs", "random"])
def test_segment_runs(kind: str, runs: int) -> None:
    rng = np.random.default_rng(runs)
    length = 300
    rows = []
    for _ in range(6):
        if kind == "one":
            row = np.full(length, 7)
        elif kind == "random":
            row = rng.integers(0, 3, size=length)
        else:
            count = {
                "documents": min(runs, 4),
                "recurring": 4,
                "many": runs + 3,
                "kv_differs": min(runs, 3),
            }
            cuts = np.sort(rng.choice(np.arange(1, length), count[kind] - 1, replace=False))
            ids = np.arange(count[kind]) + 5
            if kind == "recurring":
                ids = ids % 2  # an id forms two runs
            row = np.repeat(ids, np.diff(np.concatenate([[0], cuts, [length]])))
        rows.append(row)
    q_ids = np.stack(rows).reshape(2, 3, length).astype(np.int32)
    kv_ids = q_ids.copy()
    if kind == "kv_differs":
        kv_ids[1, 2, 100] += 1
    table = np.asarray(_kernel._segment_runs(q_ids, kv_ids, runs))
    expected = _runs_reference(q_ids, kv_ids, runs)
    np.testing.assert_array_equal(table, expected)
    if kind in ("recurring", "many", "random"):
        assert not table[..., 0].any()
    if kind in ("documents", "one"):
        assert table[..., 0].all()
    if kind == "kv_differs":
        assert table[..., 0].sum() == 5 and table[1, 2, 0] == 0


@pytest.mark.skipif(not ON_GPU, reason="the GPU's summary kernel")
@pytest.mark.parametrize("runs", [0, 1, 4, 32])
@pytest.mark.parametrize("length", [1, 17, 1000, 16384, 20000, 40001])
def test_gpu_segment_summaries(length: int, runs: int) -> None:
    # The device kernel's chunk records and documents equal their jnp definitions, for rows of one
    # and of several passes of its 512 chunks, ids of long runs, ids of short recurring runs and
    # random ids, and key ids that differ from the query ids in one row.
    rng = np.random.default_rng(length + runs)
    cuts = np.sort(rng.choice(np.arange(1, max(length, 2)), min(3, length - 1), replace=False))
    documents = np.repeat(np.arange(cuts.size + 1) + 3, np.diff([0, *cuts, length]))
    rows = [documents, documents % 2, rng.integers(-5, 5, size=length), documents]
    q_ids = np.stack(rows * 2)[:6].reshape(2, 3, length).astype(np.int32)
    kv_ids = q_ids.copy()
    kv_ids[1, 0, length // 2] += 1
    fn = jax.jit(functools.partial(_kernel._segment_summaries_cuda, runs=runs))
    q_rec, kv_rec, table = (np.asarray(x) for x in fn(q_ids, kv_ids))
    np.testing.assert_array_equal(
        q_rec, np.asarray(_kernel._segment_ranges(q_ids, suffix_reach=True))
    )
    np.testing.assert_array_equal(
        kv_rec, np.asarray(_kernel._segment_ranges(kv_ids, suffix_reach=False))
    )
    if runs:
        np.testing.assert_array_equal(table, _runs_reference(q_ids, kv_ids, runs))
