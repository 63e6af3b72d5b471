"""Every feature drawn jointly at random, with fixed seeds, against the float64 reference.

The hand-written cases (test_mask_features.py, test_varlen.py) put lengths, windows and layouts
on the kernels' tile edges. These draws combine the features freely: window sides (either
unbounded), causal, softcap, sinks, segment ids as one array or a (q, kv) pair with ids that
recur, GQA, Sq != Sk both ways, head dims on and off the fast GPU paths, softmax scales, packed
batches with empty sequences, padding past the last one and max_seqlen bounds. A combination
nobody listed is still checked, under conftest.check_features' rules (forward and VJP with random
cotangents on O and lse, the contract's exact zeros, a poisoned allocator). A failure names its
seed; the draw is reproduced by `draw(seed)`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import check_features, dtype_id, make_packed, make_qkv, make_sinks

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float64, jnp.float16)
HEAD_DIMS = (16, 40, 64, 128)


def _ids(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """Runs of random lengths whose ids grow by 0-2 per run (so ids recur and repeat)."""
    ids = np.zeros((batch, length), np.int32)
    for b in range(batch):
        pos, cur = 0, int(rng.integers(0, 3))
        while pos < length:
            run = int(rng.integers(1, max(2, length // 2) + 1))
            ids[b, pos : pos + run] = cur
            cur += int(rng.integers(0, 3))
            pos += run
    return ids


def _window(rng: np.random.Generator, length: int) -> tuple[int | None, int | None]:
    """Sides up to about half the longer sequence, so that they bind for many rows."""
    side = max(2, length // 2)
    left = None if rng.random() < 0.25 else int(rng.integers(0, side))
    right = None if rng.random() < 0.25 else int(rng.integers(0, side))
    return left, right


def draw(seed: int) -> dict:
    """The case of one seed: the arrays and check_features' keyword arguments."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[seed % len(DTYPES)]
    heads_kv = int(rng.integers(1, 3))
    heads_q = heads_kv * int(rng.integers(1, 4))
    head_dim = int(rng.choice(HEAD_DIMS))
    static = {"causal": bool(rng.random() < 0.5)}
    windowed = rng.random() < 0.5
    if rng.random() < 0.35:
        static["softcap"] = float(rng.uniform(1.0, 30.0))
    if rng.random() < 0.3:
        static["softmax_scale"] = float(rng.uniform(0.05, 0.4))
    sinks = make_sinks(rng, heads_q, dtype) if rng.random() < 0.35 else None
    shape = dict(heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype)
    if rng.random() < 0.3:
        count = int(rng.integers(0, 5))
        lens_q = rng.integers(0, 90, size=count)
        lens_k = lens_q if rng.random() < 0.4 else rng.integers(0, 90, size=count)
        pad_q, pad_k = (int(x) for x in rng.integers(0, 9, size=2))
        # At least one token of each (a batch of only empty sequences still has its padding).
        pad_q = max(pad_q, int(lens_q.sum() == 0))
        pad_k = max(pad_k, int(lens_k.sum() == 0))
        q, k, v, cu = make_packed(rng, lens_q, lens_k, pad_q=pad_q, pad_k=pad_k, **shape)
        if count and rng.random() < 0.5:
            static["max_seqlen_q"] = int(lens_q.max())
            static["max_seqlen_k"] = int(lens_k.max())
        if windowed:
            static["window"] = _window(rng, int(max(lens_q.max(initial=1), lens_k.max(initial=1))))
        return dict(q=q, k=k, v=v, sinks=sinks, cu_seqlens=cu, segment_ids=None, static=static)
    batch = int(rng.integers(1, 3))
    seqlen_q = int(rng.integers(1, 200))
    seqlen_k = seqlen_q if rng.random() < 0.3 else int(rng.integers(1, 200))
    q, k, v = make_qkv(rng, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, **shape)
    if windowed:
        static["window"] = _window(rng, max(seqlen_q, seqlen_k))
    segment_ids = None
    if rng.random() < 0.35:
        q_ids = _ids(rng, batch, seqlen_q)
        if seqlen_q == seqlen_k and rng.random() < 0.5:
            segment_ids = jnp.asarray(q_ids)
        else:
            segment_ids = (jnp.asarray(q_ids), jnp.asarray(_ids(rng, batch, seqlen_k)))
    return dict(q=q, k=k, v=v, sinks=sinks, cu_seqlens=None, segment_ids=segment_ids, static=static)


SEEDS = range(32)


@pytest.mark.parametrize(
    "seed", [pytest.param(s, id=f"seed{s}-{dtype_id(DTYPES[s % len(DTYPES)])}") for s in SEEDS]
)
def test_random_combination(rng, seed):
    case = draw(seed)
    check_features(
        rng,
        case["q"],
        case["k"],
        case["v"],
        segment_ids=case["segment_ids"],
        sinks=case["sinks"],
        cu_seqlens=case["cu_seqlens"],
        **case["static"],
    )
