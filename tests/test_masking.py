"""Causal attention with seqlen_q > seqlen_k: with bottom-right alignment the first
seqlen_q - seqlen_k query rows see no key. They must give O = 0, lse = -inf, dQ = 0 and add
nothing to dK and dV; nothing may be NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ALL_DTYPES,
    check_backward,
    check_forward,
    dtype_id,
    flash_forward,
    flash_vjp,
    make_qkv,
    normal,
    poison_allocator,
    stats_dtype,
)

SHAPES = [(17, 7, 2, 2), (257, 1, 2, 1), (203, 113, 4, 1), (130, 64, 2, 2)]
SHAPE_IDS = ["17x7", "257x1", "203x113_mqa", "130x64"]


def masked_rows(seqlen_q, seqlen_k):
    return max(seqlen_q - seqlen_k, 0)


def assert_all_finite(name, x):
    x = np.asarray(x).astype(np.float64)
    assert np.isfinite(x).all(), f"{name}: {int((~np.isfinite(x)).sum())} non-finite values"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads_q,heads_kv", SHAPES, ids=SHAPE_IDS)
def test_forward(rng, seqlen_q, seqlen_k, heads_q, heads_kv, dtype):
    poison_allocator(jax.ShapeDtypeStruct((2, seqlen_q, heads_q, 64), dtype))
    _, (out, lse), _ = check_forward(
        rng,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        heads_q=heads_q,
        heads_kv=heads_kv,
        dtype=dtype,
        causal=True,
    )
    n = masked_rows(seqlen_q, seqlen_k)
    out, lse = np.asarray(out).astype(np.float64), np.asarray(lse)
    assert (out[:, :n] == 0).all(), "fully masked rows must give O = 0"
    assert np.isneginf(lse[:, :, :n]).all(), "fully masked rows must give lse = -inf"
    assert_all_finite("out", out)
    assert_all_finite("lse (visible rows)", lse[:, :, n:])


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads_q,heads_kv", SHAPES, ids=SHAPE_IDS)
def test_backward(rng, seqlen_q, seqlen_k, heads_q, heads_kv, dtype):
    poison_allocator(jax.ShapeDtypeStruct((2, seqlen_q, heads_q, 64), dtype))
    (q, k, v, dout), (out, lse), (dq, dk, dv) = check_backward(
        rng,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        heads_q=heads_q,
        heads_kv=heads_kv,
        dtype=dtype,
        causal=True,
        lse_cotangent=True,
    )
    n = masked_rows(seqlen_q, seqlen_k)
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert_all_finite(name, x)
    assert (np.asarray(out)[:, :n] == 0).all()
    assert np.isneginf(np.asarray(lse)[:, :, :n]).all()
    assert (np.asarray(dq).astype(np.float64)[:, :n] == 0).all(), "dQ of masked rows must be 0"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=dtype_id)
def test_masked_rows_contribute_nothing(rng, dtype):
    # Dropping the masked rows keeps the alignment (query i - n sees keys <= i - n), so dK, dV
    # and the visible rows' O and dQ must not change, whatever the masked rows' q, dO and dlse.
    seqlen_q, seqlen_k = 90, 40
    n = seqlen_q - seqlen_k
    q, k, v = make_qkv(
        rng, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=4, heads_kv=2, dtype=dtype
    )
    dout = normal(rng, q.shape, dtype)
    dlse = normal(rng, (2, 4, seqlen_q), stats_dtype(dtype))
    out, lse, (dq, dk, dv) = flash_vjp(q, k, v, dout, dlse, causal=True)
    out_t, lse_t, (dq_t, dk_t, dv_t) = flash_vjp(
        q[:, n:], k, v, dout[:, n:], dlse[:, :, n:], causal=True
    )
    tight = {"rtol": 1e-5 if dtype == jnp.float32 else 1e-12, "atol": 1e-6}
    np.testing.assert_allclose(out[:, n:], out_t, **tight)
    np.testing.assert_allclose(lse[:, :, n:], lse_t, **tight)
    np.testing.assert_allclose(dq[:, n:], dq_t, **tight)
    np.testing.assert_allclose(dk, dk_t, **tight)
    np.testing.assert_allclose(dv, dv_t, **tight)


def test_single_key_many_queries(rng):
    # Sk = 1, causal: only the last query row sees the key, and it gets exactly v.
    q, k, v = make_qkv(rng, batch=1, seqlen_q=33, seqlen_k=1, heads_q=3, dtype=jnp.float64)
    out, lse = flash_forward(q, k, v, causal=True)
    np.testing.assert_array_equal(np.asarray(out)[:, :-1], 0)
    np.testing.assert_allclose(np.asarray(out)[:, -1], np.asarray(v)[:, 0], rtol=1e-14)
    scores = np.einsum("bhd,bhd->bh", np.asarray(q)[:, -1], np.asarray(k)[:, 0]) / np.sqrt(64)
    np.testing.assert_allclose(np.asarray(lse)[:, :, -1], scores, rtol=1e-12)
