"""Numerical robustness: huge logits, NaN isolation between batch elements, bitwise determinism."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ALL_DTYPES,
    ON_GPU,
    check_backward,
    check_forward,
    dtype_id,
    flash_forward,
    flash_vjp,
    make_qkv,
    normal,
)

import jax_flash

# ----------------------------------------------------------------------------------------------
# Large logits: the online softmax must rescale, never overflow.


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("input_scale", [10.0, 100.0], ids=["x10", "x100"])
def test_large_inputs_forward(rng, input_scale, causal, dtype):
    # q and k scaled by input_scale: the scores grow by input_scale**2 (std ~1e2 and ~1e4).
    _, (out, lse), _ = check_forward(
        rng,
        seqlen_q=77,
        seqlen_k=203,
        heads_q=4,
        heads_kv=2,
        dtype=dtype,
        causal=causal,
        input_scale=input_scale,
        same_precision_rule=True,
    )
    assert np.isfinite(np.asarray(out).astype(np.float64)).all()
    assert np.isfinite(np.asarray(lse)).all()
    assert np.abs(np.asarray(lse)).max() > 10 * input_scale, "the logits were not large"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_inputs_backward(rng, causal, dtype):
    _, _, grads = check_backward(
        rng,
        seqlen_q=61,
        seqlen_k=130,
        heads_q=2,
        heads_kv=1,
        dtype=dtype,
        causal=causal,
        input_scale=10.0,
        lse_cotangent=True,
        same_precision_rule=True,
    )
    for g in grads:
        assert np.isfinite(np.asarray(g).astype(np.float64)).all()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("softmax_scale", [20.0, 500.0])
def test_large_softmax_scale(rng, softmax_scale, dtype):
    check_forward(
        rng,
        seqlen_q=50,
        seqlen_k=150,
        dtype=dtype,
        causal=True,
        softmax_scale=softmax_scale,
        same_precision_rule=True,
    )
    check_backward(
        rng,
        seqlen_q=50,
        seqlen_k=150,
        dtype=dtype,
        causal=False,
        softmax_scale=softmax_scale,
        lse_cotangent=True,
        same_precision_rule=True,
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_one_dominant_key(rng, dtype):
    # Each query row is a large multiple of one key, placed at a different position per row,
    # so the output row must be (almost exactly) that key's value row. Catches softmax
    # rescaling bugs across key blocks: the max arrives late for some rows and early for others.
    seqlen = 300
    q, k, v = make_qkv(rng, batch=1, seqlen_q=seqlen, seqlen_k=seqlen, heads_q=1, dtype=dtype)
    targets = rng.permutation(seqlen)
    q = (k[:, targets] * 8).astype(dtype)
    out = np.asarray(jax_flash.attention(q, k, v)).astype(np.float64)
    expected = np.asarray(v).astype(np.float64)[:, targets]
    low = jnp.dtype(dtype).itemsize <= 2
    np.testing.assert_allclose(
        out, expected, rtol=1e-2 if low else 1e-5, atol=1e-2 if low else 1e-5
    )


# ----------------------------------------------------------------------------------------------
# A NaN in one batch element stays there.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64], ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_isolation(rng, where, causal, dtype):
    q, k, v = make_qkv(rng, batch=3, seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, dtype=dtype)
    dout = normal(rng, q.shape, dtype)
    poisoned = {"q": q, "k": k, "v": v}
    poisoned[where] = poisoned[where].at[1, 5, 1, 3].set(jnp.nan)
    q_nan, k_nan, v_nan = poisoned["q"], poisoned["k"], poisoned["v"]

    out, _, grads = flash_vjp(q_nan, k_nan, v_nan, dout, causal=causal)
    clean_out, _, clean_grads = flash_vjp(q, k, v, dout, causal=causal)
    out = np.asarray(out).astype(np.float64)
    assert np.isnan(out[1]).any(), "the NaN did not reach its own batch element"
    # The other batch elements are untouched (up to accumulation order where atomics are used).
    same = {"rtol": 1e-2, "atol": 1e-2} if jnp.dtype(dtype).itemsize == 2 else {"rtol": 1e-6}
    for b in (0, 2):
        assert np.isfinite(out[b]).all(), f"out: NaN leaked into batch element {b}"
        np.testing.assert_allclose(out[b], np.asarray(clean_out).astype(np.float64)[b], **same)
        for name, g, clean in zip(("dq", "dk", "dv"), grads, clean_grads, strict=True):
            g = np.asarray(g).astype(np.float64)[b]
            assert np.isfinite(g).all(), f"{name}: NaN leaked into batch element {b}"
            np.testing.assert_allclose(g, np.asarray(clean).astype(np.float64)[b], **same)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_nan_isolation_between_heads(rng, dtype):
    # Heads that share no KV head share nothing; a NaN in KV head 0 stays in its query heads.
    q, k, v = make_qkv(rng, batch=1, seqlen_q=40, seqlen_k=40, heads_q=4, heads_kv=2, dtype=dtype)
    out = np.asarray(jax_flash.attention(q, k.at[0, 7, 0, 0].set(jnp.nan), v)).astype(np.float64)
    assert np.isnan(out[:, :, :2]).any()
    assert np.isfinite(out[:, :, 2:]).all()


# ----------------------------------------------------------------------------------------------
# Determinism.


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_is_bitwise_deterministic(rng, causal, dtype):
    q, k, v = make_qkv(
        rng, batch=2, seqlen_q=300, seqlen_k=513, heads_q=4, heads_kv=2, head_dim=80, dtype=dtype
    )
    first_out, first_lse = (np.asarray(x) for x in flash_forward(q, k, v, causal=causal))
    # Same executable again, a fresh compilation, and the eager path.
    runs = {
        "cached": lambda: flash_forward(q, k, v, causal=causal),
        "recompiled": lambda: jax.jit(
            lambda q, k, v: jax_flash.attention(q, k, v, causal=causal, return_lse=True)
        )(q, k, v),
        "eager": lambda: jax_flash.attention(q, k, v, causal=causal, return_lse=True),
    }
    for name, run in runs.items():
        out, lse = run()
        np.testing.assert_array_equal(np.asarray(out), first_out, err_msg=name)
        np.testing.assert_array_equal(np.asarray(lse), first_lse, err_msg=name)


@pytest.mark.skipif(
    ON_GPU,
    reason="the default GPU backward adds dQ with atomics in any order; "
    "test_deterministic.py covers deterministic=True there",
)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_backward_is_bitwise_deterministic_on_cpu(rng, dtype):
    q, k, v = make_qkv(
        rng, batch=2, seqlen_q=257, seqlen_k=301, heads_q=4, heads_kv=1, head_dim=64, dtype=dtype
    )
    dout = normal(rng, q.shape, dtype)
    first = [np.asarray(g) for g in flash_vjp(q, k, v, dout, causal=True)[2]]
    for run in range(2):
        grads = flash_vjp(q, k, v, dout, causal=True)[2]
        for name, g, f in zip(("dq", "dk", "dv"), grads, first, strict=True):
            np.testing.assert_array_equal(np.asarray(g), f, err_msg=f"{name}, run {run}")
