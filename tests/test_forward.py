"""Forward pass: O and lse against the float64 reference over lengths, head dims, GQA and dtypes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ALL_DTYPES,
    BACKEND,
    check_forward,
    custom_call_targets,
    dtype_id,
    f64,
    flash_forward,
    make_qkv,
    reference_forward,
)

import jax_flash

# (seqlen_q, seqlen_k): tiny, equal, and unequal both ways, none of them tile multiples.
LENGTHS = [
    (1, 1),
    (1, 2),
    (2, 1),
    (2, 7),
    (7, 7),
    (1, 257),
    (257, 1),
    (7, 17),
    (17, 7),
    (17, 113),
    (113, 17),
    (113, 203),
    (203, 113),
    (203, 203),
    (257, 257),
    (257, 113),
]

HEAD_DIMS = [1, 8, 33, 64, 80, 96, 128, 160, 256]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", LENGTHS)
def test_lengths(rng, seqlen_q, seqlen_k, causal, dtype):
    check_forward(
        rng, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=64, dtype=dtype, causal=causal
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_head_dims(rng, head_dim, dtype):
    # Alternate the mask across head dims so both paths see every head dim over the grid.
    causal = HEAD_DIMS.index(head_dim) % 2 == 1
    check_forward(
        rng, batch=1, seqlen_q=113, seqlen_k=203, head_dim=head_dim, dtype=dtype, causal=causal
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("head_dim", [33, 256])
def test_head_dims_causal_square(rng, head_dim, dtype):
    check_forward(
        rng, batch=1, seqlen_q=257, seqlen_k=257, head_dim=head_dim, dtype=dtype, causal=True
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "heads_q,heads_kv", [(8, 2), (4, 1), (8, 1), (6, 3)], ids=["gqa4", "mqa4", "mqa8", "gqa2"]
)
def test_gqa(rng, heads_q, heads_kv, causal, dtype):
    check_forward(
        rng,
        seqlen_q=113,
        seqlen_k=257,
        heads_q=heads_q,
        heads_kv=heads_kv,
        head_dim=64,
        dtype=dtype,
        causal=causal,
    )


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,causal,dtype",
    [
        (1023, 1023, False, jnp.float32),
        (1023, 1023, True, jnp.float32),
        (1023, 1023, True, jnp.bfloat16),
        (1023, 1023, False, jnp.float16),
        (1023, 257, True, jnp.float64),
        (257, 1023, True, jnp.bfloat16),
        (17, 1023, False, jnp.float64),
    ],
    ids=lambda x: dtype_id(x) if not isinstance(x, (int, bool)) else str(x),
)
def test_long(rng, seqlen_q, seqlen_k, causal, dtype):
    check_forward(
        rng, batch=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=64, dtype=dtype, causal=causal
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_odd_batch_and_heads(rng, dtype):
    check_forward(
        rng, batch=3, seqlen_q=33, seqlen_k=65, heads_q=5, head_dim=40, dtype=dtype, causal=True
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("softmax_scale", [0.01, 0.3, 1.0, 2.5])
def test_softmax_scale(rng, softmax_scale, dtype):
    check_forward(
        rng,
        seqlen_q=65,
        seqlen_k=97,
        head_dim=48,
        dtype=dtype,
        causal=softmax_scale > 0.5,
        softmax_scale=softmax_scale,
    )


def test_softmax_scale_changes_the_result(rng):
    # Guards against a kernel that ignores the attribute and always uses 1/sqrt(head_dim).
    q, k, v = make_qkv(rng, seqlen_q=17, seqlen_k=33, dtype=jnp.float32)
    default = jax_flash.attention(q, k, v)
    scaled = jax_flash.attention(q, k, v, softmax_scale=0.5)
    ref = reference_forward(*f64(q, k, v), causal=False, softmax_scale=0.5)[0]
    assert not np.allclose(default, scaled, atol=1e-3)
    np.testing.assert_allclose(scaled, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_default_scale_is_inverse_sqrt_head_dim(rng, dtype):
    head_dim = 40
    q, k, v = make_qkv(rng, seqlen_q=31, seqlen_k=47, head_dim=head_dim, dtype=dtype)
    default = jax_flash.attention(q, k, v, causal=True)
    explicit = jax_flash.attention(q, k, v, causal=True, softmax_scale=1 / math.sqrt(head_dim))
    np.testing.assert_array_equal(np.asarray(default), np.asarray(explicit))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_return_lse_false_gives_the_same_output(rng, causal):
    q, k, v = make_qkv(rng, seqlen_q=40, seqlen_k=29, dtype=jnp.float32)
    out = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, causal=causal))(q, k, v)
    assert isinstance(out, jax.Array)
    out_lse, lse = flash_forward(q, k, v, causal=causal)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_lse))
    assert lse.shape == (2, 2, 40)


def test_causal_differs_from_full(rng):
    # With Sq == Sk the last query row sees every key either way; the first row only sees key 0.
    q, k, v = make_qkv(rng, batch=1, seqlen_q=9, seqlen_k=9, dtype=jnp.float64)
    full = np.asarray(jax_flash.attention(q, k, v))
    causal = np.asarray(jax_flash.attention(q, k, v, causal=True))
    np.testing.assert_allclose(causal[:, -1], full[:, -1], rtol=1e-12)
    np.testing.assert_allclose(causal[:, 0], np.asarray(v)[:, 0], rtol=1e-12)
    assert not np.allclose(causal[:, 0], full[:, 0])


def test_causal_bottom_right_alignment(rng):
    # Sq < Sk: query i sees keys 0 .. i + Sk - Sq. Query 0 of 3 over 8 keys sees keys 0..5.
    q, k, v = make_qkv(rng, batch=1, seqlen_q=3, seqlen_k=8, heads_q=1, dtype=jnp.float64)
    out = jax_flash.attention(q, k, v, causal=True)
    expected = reference_forward(q[:, :1], k[:, :6], v[:, :6], causal=False)[0]
    np.testing.assert_allclose(np.asarray(out[:, :1]), np.asarray(expected), rtol=1e-12)


def test_numpy_inputs(rng):
    q, k, v = make_qkv(rng, seqlen_q=7, seqlen_k=9, dtype=jnp.float32)
    out = jax_flash.attention(np.asarray(q), np.asarray(k), np.asarray(v))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax_flash.attention(q, k, v)))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_eager_matches_jit(rng, dtype):
    q, k, v = make_qkv(rng, seqlen_q=19, seqlen_k=23, dtype=dtype)
    eager = jax_flash.attention(q, k, v, causal=True)
    jitted = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, causal=True))(q, k, v)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


def test_uses_the_kernel_for_this_backend(rng):
    # No silent switch to another implementation: the jitted module calls this platform's kernel.
    q, k, v = make_qkv(rng, seqlen_q=8, seqlen_k=8, dtype=jnp.float32)
    text = jax.jit(jax_flash.attention).lower(q, k, v).as_text()
    platform = "cuda" if BACKEND == "gpu" else BACKEND
    assert custom_call_targets(text) == [f"jax_flash_fwd_{platform}"]
