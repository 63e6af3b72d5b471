"""Backward pass: dQ, dK, dV with random cotangents against jax.vjp of the float64 reference, and
finite-difference checks of the float64 kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ALL_DTYPES,
    assert_close,
    check_backward,
    dtype_id,
    flash_vjp,
    make_qkv,
    normal,
)
from jax.test_util import check_grads

import jax_flash
from jax_flash.reference import attention_reference

LENGTHS = [
    (1, 1),
    (2, 7),
    (7, 2),
    (17, 113),
    (113, 17),
    (203, 257),
    (257, 203),
    (257, 257),
]

HEAD_DIMS = [1, 8, 33, 64, 80, 96, 128, 160, 256]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", LENGTHS)
def test_lengths(rng, seqlen_q, seqlen_k, causal, dtype):
    check_backward(
        rng, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim=64, dtype=dtype, causal=causal
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_head_dims(rng, head_dim, dtype):
    causal = HEAD_DIMS.index(head_dim) % 2 == 0
    check_backward(
        rng, batch=1, seqlen_q=65, seqlen_k=97, head_dim=head_dim, dtype=dtype, causal=causal
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (4, 1)], ids=["gqa4", "mqa4"])
def test_gqa(rng, heads_q, heads_kv, causal, dtype):
    # dK and dV of a shared head sum over its query heads; a kernel that keeps only the last
    # query head's contribution, or races between them, fails here.
    check_backward(
        rng,
        seqlen_q=113,
        seqlen_k=203,
        heads_q=heads_q,
        heads_kv=heads_kv,
        head_dim=64,
        dtype=dtype,
        causal=causal,
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,causal", [(77, 77, True), (96, 61, True), (61, 96, False)]
)
def test_lse_cotangent(rng, seqlen_q, seqlen_k, causal, dtype):
    # (96, 61, causal) has fully masked rows, whose lse cotangent must have no effect.
    check_backward(
        rng,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        heads_q=4,
        heads_kv=2,
        head_dim=32,
        dtype=dtype,
        causal=causal,
        lse_cotangent=True,
    )


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,causal,dtype",
    [
        (1023, 1023, True, jnp.float32),
        (1023, 1023, False, jnp.bfloat16),
        (1023, 129, True, jnp.float64),
        (129, 1023, True, jnp.float16),
    ],
    ids=lambda x: dtype_id(x) if not isinstance(x, (int, bool)) else str(x),
)
def test_long(rng, seqlen_q, seqlen_k, causal, dtype):
    check_backward(
        rng,
        batch=1,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        heads_q=2,
        heads_kv=1,
        head_dim=64,
        dtype=dtype,
        causal=causal,
    )


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("softmax_scale", [0.05, 1.5])
def test_softmax_scale(rng, softmax_scale, dtype):
    check_backward(
        rng,
        seqlen_q=45,
        seqlen_k=70,
        head_dim=24,
        dtype=dtype,
        causal=softmax_scale > 1,
        softmax_scale=softmax_scale,
        lse_cotangent=True,
    )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradient_of_lse_alone(rng, causal):
    # O unused: the custom VJP gets a zero O cotangent and the lse cotangent does all the work.
    q, k, v = make_qkv(rng, seqlen_q=30, seqlen_k=21, heads_q=4, heads_kv=2, dtype=jnp.float64)
    w = normal(rng, (2, 4, 30), jnp.float64)

    def loss(fn):
        def f(q, k, v):
            lse = fn(q, k, v, causal=causal, return_lse=True)[1]
            return jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w)

        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

    grads = loss(jax_flash.attention)(q, k, v)
    ref = loss(attention_reference)(q, k, v)
    for name, g, r in zip("qkv", grads, ref, strict=True):
        assert_close(f"d{name}", g, r, dtype=jnp.float64, kind="grad")


def test_gradients_depend_on_the_cotangent(rng):
    # Two different cotangents must give different gradients: rules out a backward that ignores
    # dO (e.g. one that differentiates out.sum()).
    q, k, v = make_qkv(rng, seqlen_q=13, seqlen_k=21, dtype=jnp.float64)
    g1 = flash_vjp(q, k, v, normal(rng, q.shape, q.dtype), causal=False)[2]
    g2 = flash_vjp(q, k, v, normal(rng, q.shape, q.dtype), causal=False)[2]
    for a, b in zip(g1, g2, strict=True):
        assert not np.allclose(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,heads_q,heads_kv,head_dim",
    [(5, 7, 2, 2, 4), (7, 5, 4, 2, 3), (9, 9, 3, 1, 8)],
    ids=["mha", "gqa", "mqa"],
)
def test_check_grads(rng, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal):
    q, k, v = make_qkv(
        rng,
        batch=2,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        heads_q=heads_q,
        heads_kv=heads_kv,
        head_dim=head_dim,
        dtype=jnp.float64,
    )
    f = functools.partial(jax_flash.attention, causal=causal)
    check_grads(f, (q, k, v), order=1, modes=("rev",))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_check_grads_with_lse(rng, causal):
    q, k, v = make_qkv(
        rng, batch=1, seqlen_q=6, seqlen_k=5, heads_q=2, heads_kv=1, head_dim=5, dtype=jnp.float64
    )

    def f(q, k, v):
        out, lse = jax_flash.attention(q, k, v, causal=causal, return_lse=True, softmax_scale=0.7)
        # The masked rows' lse is -inf, which finite differences cannot handle; the visible rows
        # carry the whole gradient.
        return out, jnp.where(jnp.isfinite(lse), lse, 0.0)

    check_grads(f, (q, k, v), order=1, modes=("rev",))


def test_check_grads_jitted(rng):
    q, k, v = make_qkv(
        rng, batch=1, seqlen_q=4, seqlen_k=6, heads_q=2, head_dim=3, dtype=jnp.float64
    )
    f = jax.jit(functools.partial(jax_flash.attention, causal=True))
    check_grads(f, (q, k, v), order=1, modes=("rev",))
