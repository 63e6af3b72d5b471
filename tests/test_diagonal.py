"""The band's diagonal as a parameter (the private entry point the jax.nn-compatible and the
sequence-sharded callers build on): top-left alignment and shifted diagonals, forward and VJP
against the float64 reference with the same offset, in every kernel family that serves the dtype.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_close,
    assert_lse_close,
    dtype_id,
    f64,
    lse_shape,
    make_qkv,
    normal,
    stats_dtype,
)

from jax_flash.attention import dense_attention
from jax_flash.reference import attention_reference, band_mask

# (seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)
SHAPES = {
    "tall": (257, 130, 4, 2, 64),
    "wide": (130, 257, 2, 1, 128),
    "odd": (200, 200, 2, 2, 40),
}

# (causal, window, bottom_right, shift)
CASES = [
    (True, None, False, 0),  # jax.nn's causal: top-left
    (False, (7, 30), False, 0),
    (True, (100, None), False, 5),
    (True, None, True, -64),  # a sharded block below the diagonal's block
    (True, None, False, 150),  # a block far above: most rows see every key
    (False, (0, 0), False, 3),
    (True, None, False, -400),  # nothing visible at all
]


def _offset(seqlen_q, seqlen_k, bottom_right, shift):
    return (seqlen_k - seqlen_q if bottom_right else 0) + shift


@functools.partial(jax.jit, static_argnames=("static",))
def _flash_vjp(q, k, v, dout, dlse, static):
    kw = dict(static)

    def f(q, k, v):
        return dense_attention(
            "attention", q, k, v, softmax_scale=None, softcap=None, segment_ids=None,
            sinks=None, return_lse=True, **kw,
        )  # fmt: skip

    (out, lse), pullback = jax.vjp(f, q, k, v)
    return out, lse, pullback((dout, dlse))


@functools.partial(jax.jit, static_argnames=("causal", "window", "offset"))
def _reference_vjp(q, k, v, dout, dlse, causal, window, offset):
    def f(q, k, v):
        return attention_reference(
            q, k, v, causal=causal, window=window, diagonal_offset=offset, return_lse=True
        )

    (out, lse), pullback = jax.vjp(f, q, k, v)
    return out, lse, pullback((dout, dlse))


def _params():
    params = []
    for shape_name in SHAPES:
        for i, case in enumerate(CASES):
            for dtype in (jnp.float32, jnp.bfloat16):
                params.append(
                    pytest.param(
                        shape_name, *case, dtype, id=f"{shape_name}-c{i}-{dtype_id(dtype)}"
                    )
                )
    return params


@pytest.mark.parametrize("shape_name, causal, window, bottom_right, shift, dtype", _params())
def test_diagonal_matches_reference(rng, shape_name, causal, window, bottom_right, shift, dtype):
    seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = SHAPES[shape_name]
    q, k, v = make_qkv(
        rng, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads_q=heads_q, heads_kv=heads_kv,
        head_dim=head_dim, dtype=dtype,
    )  # fmt: skip
    dout = normal(rng, q.shape, dtype)
    dlse = normal(rng, lse_shape(q), stats_dtype(dtype))
    static = (
        ("bottom_right", bottom_right),
        ("causal", causal),
        ("diagonal_shift", shift),
        ("window", window),
    )
    out, lse, grads = _flash_vjp(q, k, v, dout, dlse, static)
    offset = _offset(seqlen_q, seqlen_k, bottom_right, shift)
    ref_out, ref_lse, ref_grads = _reference_vjp(
        *f64(q, k, v, dout, dlse), causal=causal, window=window, offset=offset
    )
    lowp_out = lowp_lse = None
    lowp_grads = (None,) * 3
    if dtype != jnp.float32:
        # The tolerance of a half-precision result is set by the same computation in its dtype.
        lowp_out, lowp_lse, lowp_grads = _reference_vjp(
            q, k, v, dout, dlse.astype(dtype), causal=causal, window=window, offset=offset
        )
    assert_close("out", out, ref_out, dtype=dtype, kind="fwd", lowp=lowp_out)
    assert_lse_close(lse, ref_lse, dtype=dtype, lowp=lowp_lse)
    for name, g, ref_g, lowp_g in zip(
        ("dq", "dk", "dv"), grads, ref_grads, lowp_grads, strict=True
    ):
        assert_close(name, g, ref_g, dtype=dtype, kind="grad", lowp=lowp_g)

    visible = np.asarray(band_mask(seqlen_q, seqlen_k, causal=causal, window=window, offset=offset))
    no_keys = ~visible.any(axis=-1)
    unseen = ~visible.any(axis=-2)
    assert (np.asarray(out, np.float64)[:, no_keys] == 0).all()
    assert np.isneginf(np.asarray(lse)[:, :, no_keys]).all()
    assert (np.asarray(grads[1], np.float64)[:, unseen] == 0).all()
    assert (np.asarray(grads[2], np.float64)[:, unseen] == 0).all()


def test_top_left_differs_from_bottom_right(rng):
    """With Sq != Sk the two alignments are different masks: the parameter reaches the kernel."""
    q, k, v = make_qkv(rng, batch=1, seqlen_q=64, seqlen_k=192)
    kw = dict(softmax_scale=None, window=None, softcap=None, segment_ids=None, sinks=None)
    top = dense_attention(
        "attention", q, k, v, causal=True, return_lse=False, bottom_right=False, **kw
    )
    bottom = dense_attention("attention", q, k, v, causal=True, return_lse=False, **kw)
    ref_top = attention_reference(*f64(q, k, v), causal=True, diagonal_offset=0)
    assert_close("out", top, ref_top, dtype=jnp.float32, kind="fwd")
    assert float(jnp.max(jnp.abs(top - bottom))) > 0.1


@pytest.mark.parametrize("shift", [2**31 + 1, -(2**31) - 1])
def test_shift_out_of_range(rng, shift):
    q, k, v = make_qkv(rng, batch=1, seqlen_q=8, seqlen_k=8, head_dim=16)
    kw = dict(softmax_scale=None, window=None, softcap=None, segment_ids=None, sinks=None)
    with pytest.raises(ValueError, match="diagonal_shift"):
        dense_attention(
            "attention", q, k, v, causal=True, return_lse=False, diagonal_shift=shift, **kw
        )


def test_shift_must_be_int(rng):
    q, k, v = make_qkv(rng, batch=1, seqlen_q=8, seqlen_k=8, head_dim=16)
    kw = dict(softmax_scale=None, window=None, softcap=None, segment_ids=None, sinks=None)
    with pytest.raises(TypeError, match="diagonal_shift"):
        dense_attention(
            "attention", q, k, v, causal=True, return_lse=False, diagonal_shift=1.5, **kw
        )
