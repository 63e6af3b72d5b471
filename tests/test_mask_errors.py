"""Bad window, softcap, segment_ids, sinks and attention_varlen arguments are rejected at trace
time with a ValueError or TypeError that names the argument.

Every case goes through jax.eval_shape (or jax.jit(...).lower), so no kernel can run: an error
raised by a kernel or an FFI handler would not be seen here. Concrete cu_seqlens are closed over,
so that their values can be checked; traced ones cannot be.
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


def trace(q=Q, k=KV, **kwargs):
    """Abstract evaluation of attention; array-valued keyword arguments stay concrete."""
    return jax.eval_shape(
        lambda q, k, v: jax_flash.attention(q, k, v, **kwargs), sds(q), sds(k), sds(k)
    )


def ids(*shape, dtype=jnp.int32):
    return jnp.zeros(shape, dtype)


def test_valid_calls_trace():
    # The baseline every failing case below differs from in one argument.
    out, lse = trace(
        window=(3, None),
        softcap=30.0,
        segment_ids=(ids(2, 16), ids(2, 24)),
        sinks=jnp.zeros(4),
        causal=True,
        return_lse=True,
    )
    assert out.shape == Q and lse.shape == (2, 4, 16)
    square = trace(k=(2, 16, 2, 64), segment_ids=ids(2, 16), window=[0, 0], softcap=np.float32(2))
    assert square.shape == Q
    out, lse = trace(window=(None, None), sinks=jnp.zeros(4, jnp.bfloat16), return_lse=True)
    assert lse.dtype == jnp.float32


def test_abstract_mask_arrays_trace():
    # segment ids and sinks may be abstract (traced) too.
    out = jax.eval_shape(
        lambda q, k, v, qi, ki, s: jax_flash.attention(q, k, v, segment_ids=(qi, ki), sinks=s),
        sds(Q), sds(KV), sds(KV), sds((2, 16), jnp.int32), sds((2, 24), jnp.int16), sds((4,)),
    )  # fmt: skip
    assert out.shape == Q


# ----------------------------------------------------------------------------------------------
# window


@pytest.mark.parametrize(
    "window",
    [5, "3", (1,), (1, 2, 3), [], {"left": 1}, 2.0],
    ids=["int", "str", "one", "three", "empty", "dict", "float"],
)
def test_window_not_a_pair(window):
    with pytest.raises(TypeError, match=r"window.*pair"):
        trace(window=window)


@pytest.mark.parametrize(
    "window,side",
    [
        ((1.5, 0), "left"),
        ((0, 2.0), "right"),
        ((True, 0), "left"),
        ((0, np.bool_(False)), "right"),
        ((jnp.int32(3), 0), "left"),
        ((0, "4"), "right"),
        ((np.float32(2), None), "left"),
        ((None, jnp.array([1])), "right"),
    ],
    ids=["float", "float_right", "bool", "np_bool", "jax_int", "str", "np_float", "jax_array"],
)
def test_window_bound_not_a_static_int(window, side):
    with pytest.raises(TypeError, match=rf"window {side} bound.*static int"):
        trace(window=window)


@pytest.mark.parametrize(
    "window,side",
    [((-1, 0), "left"), ((0, -1), "right"), ((None, -5), "right"), ((np.int64(-2), 3), "left")],
)
def test_window_bound_negative(window, side):
    with pytest.raises(ValueError, match=rf"window {side} bound.*>= 0"):
        trace(window=window)


def test_window_accepts_numpy_ints():
    assert trace(window=(np.int32(2), np.int64(0))).shape == Q


def test_traced_window_bound():
    # A bound computed under jit is a tracer: it cannot become a kernel attribute.
    q, kv = jnp.ones(Q), jnp.ones(KV)
    with pytest.raises(TypeError, match=r"window left bound"):
        jax.jit(lambda q, k, v, n: jax_flash.attention(q, k, v, window=(n, 0))).lower(q, kv, kv, 3)


# ----------------------------------------------------------------------------------------------
# softcap


@pytest.mark.parametrize(
    "softcap", [0, 0.0, -1.0, math.inf, -math.inf, math.nan, np.float32(np.nan), np.float64(0)]
)
def test_softcap_out_of_range(softcap):
    with pytest.raises(ValueError, match=r"softcap.*finite and > 0"):
        trace(softcap=softcap)


@pytest.mark.parametrize(
    "softcap",
    [jnp.float32(5), jnp.array(5.0), "5", [5.0], True, 1 + 2j, np.array([5.0])],
    ids=["jax_scalar", "jax_array", "str", "list", "bool", "complex", "np_1d"],
)
def test_softcap_wrong_type(softcap):
    with pytest.raises(TypeError, match=r"softcap"):
        trace(softcap=softcap)


@pytest.mark.parametrize("softcap", [1, 50, np.float32(2.5), np.array(3.0), 1e-3])
def test_softcap_accepts_finite_positive_numbers(softcap):
    assert trace(softcap=softcap).shape == Q


# ----------------------------------------------------------------------------------------------
# segment_ids


def test_single_segment_ids_need_equal_lengths():
    with pytest.raises(ValueError, match=r"single segment_ids.*seqlen_q == seqlen_k.*16 and 24"):
        trace(segment_ids=ids(2, 16))


@pytest.mark.parametrize(
    "segment_ids,which",
    [
        ((ids(2, 24), ids(2, 24)), "q segment_ids"),
        ((ids(2, 16), ids(2, 16)), "kv segment_ids"),
        ((ids(1, 16), ids(2, 24)), "q segment_ids"),
        ((ids(2, 16), ids(3, 24)), "kv segment_ids"),
        ((ids(16), ids(2, 24)), "q segment_ids"),
        ((ids(2, 16), ids(2, 24, 1)), "kv segment_ids"),
        ((ids(2, 16, 4), ids(2, 24, 2)), "q segment_ids"),
    ],
    ids=["q_len", "kv_len", "q_batch", "kv_batch", "q_rank1", "kv_rank3", "per_head"],
)
def test_segment_ids_wrong_shape(segment_ids, which):
    with pytest.raises(ValueError, match=rf"{which} must have shape"):
        trace(segment_ids=segment_ids)


def test_single_segment_ids_wrong_shape():
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[batch, seqlen_q\]"):
        trace(k=(2, 16, 2, 64), segment_ids=ids(2, 17))


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.int64, jnp.uint32, jnp.uint64, jnp.bool_, jnp.bfloat16]
)
def test_segment_ids_wrong_dtype(dtype):
    with pytest.raises(TypeError, match=r"segment_ids must have dtype int32"):
        trace(segment_ids=(ids(2, 16, dtype=dtype), ids(2, 24)))
    with pytest.raises(TypeError, match=r"kv segment_ids must have dtype int32"):
        trace(segment_ids=(ids(2, 16), ids(2, 24, dtype=dtype)))


@pytest.mark.parametrize(
    "segment_ids,error,pattern",
    [
        ((ids(2, 16),), TypeError, r"segment_ids.*pair.*sequence of 1"),
        ((ids(2, 16), ids(2, 24), ids(2, 24)), TypeError, r"segment_ids.*pair.*sequence of 3"),
        ([[0] * 16, [0] * 24], TypeError, r"q segment_ids must be an int32 array"),
        ((ids(2, 16), None), TypeError, r"kv segment_ids must be an int32 array"),
        ("abc", TypeError, r"segment_ids must be an int32 array"),
    ],
    ids=["one", "three", "lists", "none_kv", "str"],
)
def test_segment_ids_malformed(segment_ids, error, pattern):
    k = (2, 16, 2, 64) if isinstance(segment_ids, str) else KV
    with pytest.raises(error, match=pattern):
        trace(k=k, segment_ids=segment_ids)


def test_segment_ids_under_vmap():
    # vmap strips the mapped axis from the ids too; a per-head axis left over is refused.
    q, kv = sds((3, *Q)), sds((3, *KV))
    ok = jax.eval_shape(
        jax.vmap(lambda q, k, v, a, b: jax_flash.attention(q, k, v, segment_ids=(a, b))),
        q, kv, kv, sds((3, 2, 16), jnp.int32), sds((3, 2, 24), jnp.int32),
    )  # fmt: skip
    assert ok.shape == (3, *Q)
    with pytest.raises(ValueError, match=r"q segment_ids must have shape"):
        jax.eval_shape(
            jax.vmap(
                lambda q, k, v, a, b: jax_flash.attention(q, k, v, segment_ids=(a, b)),
                in_axes=(0, 0, 0, None, 0),
            ),
            q, kv, kv, sds((3, 2, 16), jnp.int32), sds((3, 2, 24), jnp.int32),
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# sinks


@pytest.mark.parametrize(
    "shape",
    [(2,), (8,), (), (1, 4), (2, 4), (4, 1)],
    ids=["kv_heads", "8", "scalar", "1x4", "2x4", "4x1"],
)
def test_sinks_wrong_shape(shape):
    with pytest.raises(ValueError, match=r"sinks must have shape \[heads_q\] = \(4,\)"):
        trace(sinks=jnp.zeros(shape))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.bool_, jnp.uint8])
def test_sinks_not_floating(dtype):
    with pytest.raises(TypeError, match=r"sinks must have a floating dtype"):
        trace(sinks=jnp.zeros(4, dtype))


@pytest.mark.parametrize(
    "sinks", [[0.0] * 4, 0.5, (1.0, 2.0, 3.0, 4.0)], ids=["list", "float", "tuple"]
)
def test_sinks_not_an_array(sinks):
    with pytest.raises(TypeError, match=r"sinks must be an array"):
        trace(sinks=sinks)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64])
def test_sinks_any_floating_dtype(dtype):
    assert trace(sinks=np.zeros(4, dtype)).shape == Q


# ----------------------------------------------------------------------------------------------
# attention_varlen

TQ, TK = (40, 4, 64), (50, 2, 64)
CU = np.asarray([0, 10, 40], np.int32)
CU_K = np.asarray([0, 20, 50], np.int32)


def trace_varlen(q=TQ, k=TK, cu_q=CU, cu_k=CU_K, **kwargs):
    """Abstract q, k, v; cu_seqlens as given (concrete arrays stay concrete)."""
    return jax.eval_shape(
        lambda q, k, v: jax_flash.attention_varlen(q, k, v, cu_q, cu_k, **kwargs),
        sds(q), sds(k), sds(k),
    )  # fmt: skip


def test_valid_varlen_calls_trace():
    out, lse = trace_varlen(
        max_seqlen_q=30, max_seqlen_k=30, causal=True, window=(4, 0), softcap=5.0,
        sinks=jnp.zeros(4), return_lse=True,
    )  # fmt: skip
    assert out.shape == TQ and lse.shape == (4, 40) and lse.dtype == jnp.float32
    # Exact maxima, empty sequences, tokens past the last sequence, narrow integer dtypes.
    cu = np.asarray([0, 0, 10, 10, 30], np.int16)
    assert trace_varlen(cu_q=cu, cu_k=cu, max_seqlen_q=20, max_seqlen_k=20).shape == TQ
    assert trace_varlen(cu_q=np.zeros(1, np.int32), cu_k=np.zeros(1, np.int32)).shape == TQ


def test_traced_cu_seqlens_are_not_value_checked():
    # Under jit the values are unknown at trace time: lowering succeeds whatever they will be.
    f = jax.jit(lambda q, k, v, a, b: jax_flash.attention_varlen(q, k, v, a, b, max_seqlen_q=1))
    f.lower(sds(TQ), sds(TK), sds(TK), sds((3,), jnp.int32), sds((3,), jnp.int32))


@pytest.mark.parametrize(
    "q,k,pattern",
    [
        ((2, 40, 4, 64), TK, r"\bq\b.*rank 3"),
        (TQ, (1, 50, 2, 64), r"\bk\b.*rank 3"),
        (TQ, (50, 3, 64), r"heads"),
        (TQ, (50, 2, 32), r"head_dim"),
        ((40, 4, 300), (50, 2, 300), r"head_dim.*256"),
        ((0, 4, 64), TK, r"\bq\b.*empty"),
    ],
    ids=["q_rank4", "k_rank4", "heads", "head_dim", "head_dim_300", "empty"],
)
def test_varlen_bad_tensors(q, k, pattern):
    with pytest.raises(ValueError, match=pattern):
        trace_varlen(q, k)


def test_varlen_v_shape():
    with pytest.raises(ValueError, match=r"\bk\b and \bv\b must have the same shape"):
        jax.eval_shape(
            lambda q, k, v: jax_flash.attention_varlen(q, k, v, CU, CU_K),
            sds(TQ), sds(TK), sds((51, 2, 64)),
        )  # fmt: skip


@pytest.mark.parametrize(
    "cu_q,cu_k,error,pattern",
    [
        # dtype, shape, length
        (CU.astype(np.float32), CU_K, TypeError, r"cu_seqlens_q must have dtype int32"),
        (CU, CU_K.astype(np.int64), TypeError, r"cu_seqlens_k must have dtype int32"),
        (CU, CU_K.astype(np.uint32), TypeError, r"cu_seqlens_k must have dtype int32"),
        (CU.reshape(1, 3), CU_K, ValueError, r"cu_seqlens_q must have shape \[num_seqs \+ 1\]"),
        (CU, np.zeros((0,), np.int32), ValueError, r"cu_seqlens_k must have shape"),
        (np.int32(0), CU_K, ValueError, r"cu_seqlens_q must have shape"),
        (CU, CU_K[:2], ValueError, r"cu_seqlens_q and cu_seqlens_k must have the same length"),
        ([0, 10, 40], CU_K, TypeError, r"cu_seqlens_q must be an int32 array"),
        (CU, None, TypeError, r"cu_seqlens_k must be an int32 array"),
        # concrete values
        (np.asarray([1, 10, 40], np.int32), CU_K, ValueError, r"cu_seqlens_q must start at 0"),
        (CU, np.asarray([0, 30, 20], np.int32), ValueError, r"cu_seqlens_k.*non-decreasing"),
        (np.asarray([0, -1, 40], np.int32), CU_K, ValueError, r"cu_seqlens_q.*non-decreasing"),
        (np.asarray([0, 10, 41], np.int32), CU_K, ValueError, r"cu_seqlens_q\[-1\] = 41 exceeds"),
        (CU, np.asarray([0, 20, 51], np.int32), ValueError, r"cu_seqlens_k\[-1\] = 51 exceeds"),
        (jnp.asarray([0, 10, 41], jnp.int32), CU_K, ValueError, r"cu_seqlens_q\[-1\]"),
    ],
    ids=[
        "float", "int64", "uint32", "2d", "empty", "scalar", "lengths", "list", "none",
        "start", "decreasing", "negative", "past_q", "past_k", "jax_array_past_q",
    ],
)  # fmt: skip
def test_bad_cu_seqlens(cu_q, cu_k, error, pattern):
    with pytest.raises(error, match=pattern):
        trace_varlen(cu_q=cu_q, cu_k=cu_k)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"max_seqlen_q": 29}, r"30 tokens exceeds max_seqlen_q = 29"),
        ({"max_seqlen_k": 0}, r"30 tokens exceeds max_seqlen_k = 0"),
    ],
)
def test_max_seqlen_below_a_concrete_sequence(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        trace_varlen(**kwargs)


@pytest.mark.parametrize(
    "value,error",
    [
        (-1, ValueError),
        (1.5, TypeError),
        (True, TypeError),
        ("8", TypeError),
        (jnp.int32(8), TypeError),
        (np.float64(8), TypeError),
    ],
    ids=["negative", "float", "bool", "str", "jax", "np_float"],
)
@pytest.mark.parametrize("name", ["max_seqlen_q", "max_seqlen_k"])
def test_bad_max_seqlen(name, value, error):
    with pytest.raises(error, match=name):
        trace_varlen(**{name: value})


@pytest.mark.parametrize(
    "kwargs,error,pattern",
    [
        ({"window": (-1, 0)}, ValueError, r"attention_varlen: window left bound"),
        ({"window": 3}, TypeError, r"attention_varlen: window"),
        ({"softcap": 0.0}, ValueError, r"attention_varlen: softcap"),
        ({"softcap": math.inf}, ValueError, r"attention_varlen: softcap"),
        ({"sinks": jnp.zeros(2)}, ValueError, r"attention_varlen: sinks must have shape"),
        ({"sinks": jnp.zeros(4, jnp.int32)}, TypeError, r"attention_varlen: sinks"),
        ({"causal": 1}, TypeError, r"attention_varlen: causal"),
        ({"return_lse": None}, TypeError, r"attention_varlen: return_lse"),
        ({"softmax_scale": -1.0}, ValueError, r"attention_varlen: softmax_scale"),
    ],
    ids=[
        "window_negative", "window_int", "softcap_zero", "softcap_inf", "sinks_shape",
        "sinks_dtype", "causal", "return_lse", "softmax_scale",
    ],
)  # fmt: skip
def test_varlen_bad_options(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        trace_varlen(**kwargs)


def test_varlen_takes_no_segment_ids():
    # Packed sequences are their own segments; the argument does not exist.
    with pytest.raises(TypeError, match=r"segment_ids"):
        trace_varlen(segment_ids=ids(40))


def test_varlen_errors_under_jit_lower():
    f = jax.jit(lambda q, k, v: jax_flash.attention_varlen(q, k, v, CU, CU_K, softcap=-2.0))
    with pytest.raises(ValueError, match=r"softcap"):
        f.lower(sds(TQ), sds(TK), sds(TK))
    g = jax.jit(lambda q, k, v, a: jax_flash.attention_varlen(q, k, v, a, CU_K))
    with pytest.raises(TypeError, match=r"cu_seqlens_q must have dtype int32"):
        g.lower(sds(TQ), sds(TK), sds(TK), sds((3,), jnp.float32))
