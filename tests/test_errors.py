"""Bad input is rejected at trace time with a ValueError or TypeError that names the argument.

Every case goes through jax.eval_shape on abstract ShapeDtypeStructs (or jax.jit(...).lower), so
no kernel can run: an error raised by a kernel or an FFI handler would not be seen here.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash


def sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


Q = (2, 16, 4, 64)
KV = (2, 24, 2, 64)


def trace(q=Q, k=KV, v=KV, dtypes=(jnp.float32,) * 3, **kwargs):
    """Abstract evaluation only: shapes and dtypes, no data, no kernel launch."""
    args = [sds(s, d) for s, d in zip((q, k, v), dtypes, strict=True)]
    return jax.eval_shape(lambda q, k, v: jax_flash.attention(q, k, v, **kwargs), *args)


def test_valid_call_traces():
    # The baseline every failing case below differs from in one argument.
    out = trace()
    assert out.shape == Q and out.dtype == jnp.float32
    out, lse = trace(return_lse=True, causal=True, softmax_scale=0.1)
    assert lse.shape == (2, 4, 16) and lse.dtype == jnp.float32


@pytest.mark.parametrize(
    "q,k,v,name",
    [
        ((16, 4, 64), KV, KV, "q"),
        ((1, 2, 16, 4, 64), KV, KV, "q"),
        (Q, (24, 2, 64), KV, "k"),
        (Q, KV, (2, 24, 2, 64, 1), "v"),
        ((64,), KV, KV, "q"),
    ],
)
def test_wrong_rank(q, k, v, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b.*rank 4"):
        trace(q, k, v)


def test_scalar_input():
    with pytest.raises(ValueError, match=r"\bq\b.*rank"):
        jax.eval_shape(lambda k, v: jax_flash.attention(jnp.float32(1), k, v), sds(KV), sds(KV))


@pytest.mark.parametrize(
    "q,k,v,pattern",
    [
        # batch of k/v differs from q's
        (Q, (3, 24, 2, 64), (3, 24, 2, 64), r"batch"),
        # head_dim of k/v differs from q's
        (Q, (2, 24, 2, 32), (2, 24, 2, 32), r"head_dim"),
        # k and v disagree on seqlen, heads, head_dim or batch
        (Q, KV, (2, 25, 2, 64), r"\bk\b.*\bv\b"),
        (Q, KV, (2, 24, 4, 64), r"\bk\b.*\bv\b"),
        (Q, KV, (2, 24, 2, 32), r"\bk\b.*\bv\b"),
        (Q, KV, (1, 24, 2, 64), r"\bk\b.*\bv\b"),
    ],
    ids=["batch", "head_dim", "v_seqlen", "v_heads", "v_head_dim", "v_batch"],
)
def test_mismatched_shapes(q, k, v, pattern):
    with pytest.raises(ValueError, match=pattern):
        trace(q, k, v)


@pytest.mark.parametrize("heads_q,heads_kv", [(4, 3), (3, 2), (2, 4), (5, 10)])
def test_heads_not_a_multiple(heads_q, heads_kv):
    with pytest.raises(ValueError, match=r"heads"):
        trace((2, 16, heads_q, 64), (2, 24, heads_kv, 64), (2, 24, heads_kv, 64))


@pytest.mark.parametrize(
    "dtype", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_, jnp.complex64, jnp.float8_e4m3fn]
)
def test_unsupported_dtype(dtype):
    with pytest.raises(TypeError, match=r"\bq\b.*dtype.*float16.*bfloat16.*float32.*float64"):
        trace(dtypes=(dtype,) * 3)


@pytest.mark.parametrize(
    "dtypes",
    [
        (jnp.float32, jnp.float16, jnp.float32),
        (jnp.bfloat16, jnp.bfloat16, jnp.float16),
        (jnp.float64, jnp.float32, jnp.float32),
    ],
    ids=["k", "v", "q"],
)
def test_mixed_dtypes(dtypes):
    with pytest.raises(TypeError, match=r"dtype"):
        trace(dtypes=dtypes)


def test_unsupported_dtype_in_k_only():
    with pytest.raises(TypeError, match=r"\bk\b.*dtype"):
        trace(dtypes=(jnp.float32, jnp.int32, jnp.float32))


@pytest.mark.parametrize("head_dim", [0, 257, 512])
def test_head_dim_out_of_range(head_dim):
    shape_q = (2, 16, 4, head_dim)
    shape_kv = (2, 24, 2, head_dim)
    error = r"head_dim.*256" if head_dim else r"\bq\b.*empty"
    with pytest.raises(ValueError, match=error):
        trace(shape_q, shape_kv, shape_kv)


@pytest.mark.parametrize("head_dim", [1, 256])
def test_head_dim_limits_are_accepted(head_dim):
    out = trace((1, 4, 2, head_dim), (1, 5, 2, head_dim), (1, 5, 2, head_dim))
    assert out.shape == (1, 4, 2, head_dim)


@pytest.mark.parametrize(
    "q,k,v,name",
    [
        ((0, 16, 4, 64), (0, 24, 2, 64), (0, 24, 2, 64), "q"),
        ((2, 0, 4, 64), KV, KV, "q"),
        (Q, (2, 0, 2, 64), (2, 0, 2, 64), "k"),
        ((2, 16, 0, 64), (2, 24, 0, 64), (2, 24, 0, 64), "q"),
    ],
    ids=["batch", "seqlen_q", "seqlen_k", "heads"],
)
def test_empty_axes(q, k, v, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b.*empty"):
        trace(q, k, v)


@pytest.mark.parametrize(
    "softmax_scale", [0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, np.float32(np.nan)]
)
def test_bad_softmax_scale_value(softmax_scale):
    with pytest.raises(ValueError, match=r"softmax_scale.*finite positive"):
        trace(softmax_scale=softmax_scale)


@pytest.mark.parametrize(
    "softmax_scale",
    [jnp.float32(0.5), jnp.array(0.5), "0.5", [0.5], 1 + 2j, True, np.array([0.5])],
    ids=["jax_scalar", "jax_array", "str", "list", "complex", "bool", "np_1d"],
)
def test_bad_softmax_scale_type(softmax_scale):
    with pytest.raises(TypeError, match=r"softmax_scale"):
        trace(softmax_scale=softmax_scale)


def test_traced_softmax_scale():
    # A scale computed inside jit is a tracer: it cannot become a kernel attribute.
    q, kv = jnp.ones(Q, jnp.float32), jnp.ones(KV, jnp.float32)
    with pytest.raises(TypeError, match=r"softmax_scale"):
        jax.jit(lambda q, k, v, s: jax_flash.attention(q, k, v, softmax_scale=s)).lower(
            q, kv, kv, 0.5
        )


@pytest.mark.parametrize("softmax_scale", [1, 0.125, np.float32(0.3), np.float64(2.0), np.int64(2)])
def test_good_softmax_scale(softmax_scale):
    assert trace(softmax_scale=softmax_scale).shape == Q


@pytest.mark.parametrize("flag", ["causal", "return_lse"])
@pytest.mark.parametrize(
    "value", [1, 0, "True", None, 1.0, jnp.array(True)], ids=["1", "0", "str", "None", "1.0", "jax"]
)
def test_flags_must_be_bool(flag, value):
    with pytest.raises(TypeError, match=flag):
        trace(**{flag: value})


@pytest.mark.parametrize("flag", ["causal", "return_lse"])
def test_numpy_bool_flags_are_accepted(flag):
    trace(**{flag: np.bool_(True)})


def test_non_array_input():
    with pytest.raises(TypeError, match=r"\bq\b.*array"):
        jax_flash.attention([[[[1.0]]]], jnp.ones((1, 1, 1, 1)), jnp.ones((1, 1, 1, 1)))


def test_flags_are_keyword_only():
    q = jnp.ones((1, 2, 1, 4), jnp.float32)
    with pytest.raises(TypeError):
        jax_flash.attention(q, q, q, True)


def test_errors_under_jit_lower():
    # The same checks fire while jit traces, before anything is compiled.
    q = jnp.ones((2, 16, 3, 64), jnp.float32)
    kv = jnp.ones((2, 24, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"heads"):
        jax.jit(jax_flash.attention).lower(q, kv, kv)


def test_errors_under_vmap():
    # vmap strips the mapped axis before the checks see the shapes.
    q = sds((3, 2, 16, 4, 64))
    kv = sds((3, 2, 24, 3, 64))
    with pytest.raises(ValueError, match=r"heads"):
        jax.eval_shape(jax.vmap(jax_flash.attention), q, kv, kv)
    # Only q batched: inside the vmap q is [16, 4, 64], rank 3.
    with pytest.raises(ValueError, match=r"\bq\b.*rank 4"):
        unbatched_kv = jax.vmap(jax_flash.attention, in_axes=(0, None, None))
        jax.eval_shape(unbatched_kv, sds((3, 16, 4, 64)), sds(KV), sds(KV))
