"""Decoding against a key/value cache: jax_flash.attention_with_kvcache (contiguous and paged) and
the decode path of jax_flash.attention, against the float64 reference.

The reference runs per sequence on the keys the sequence holds (paged caches gathered back into
order), so it knows nothing of pages, splits or clamping. Cache entries past a sequence's length
and pages no sequence uses hold NaN, so a kernel that reads them fails the NaN check.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    BACKEND,
    assert_close,
    assert_lse_close,
    custom_call_targets,
    dtype_id,
    f64,
    make_qkv,
    make_sinks,
    normal,
    rel_l2,
    stats_dtype,
)

import jax_flash
from jax_flash import _decode
from jax_flash.kvcache import kvcache_attention
from jax_flash.reference import attention_reference

LOW_PRECISION = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


# ----------------------------------------------------------------------------------------------
# Inputs and the reference.


def make_cache(rng, lens, *, capacity, seqlen_q, heads_q, heads_kv, head_dim, dtype):
    """q [B, Sq, Hq, D] and a contiguous cache [B, capacity, Hkv, D] whose entries past each
    sequence's length are NaN."""
    batch = len(lens)
    q = normal(rng, (batch, seqlen_q, heads_q, head_dim), dtype)
    k = np.asarray(rng.standard_normal((batch, capacity, heads_kv, head_dim)))
    v = np.asarray(rng.standard_normal((batch, capacity, heads_kv, head_dim)))
    for b, n in enumerate(lens):
        k[b, n:] = np.nan
        v[b, n:] = np.nan
    return q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(lens, jnp.int32)


def to_pages(rng, k, v, block_size, spare=3):
    """The contiguous cache [B, S, Hkv, D] (S a multiple of block_size) as pages scattered at
    random over [B * S / block_size + spare] pages (the spare ones NaN), and its block table."""
    batch, capacity = k.shape[:2]
    blocks = capacity // block_size
    num_pages = batch * blocks + spare
    order = rng.permutation(num_pages)[: batch * blocks]
    table = order.reshape(batch, blocks).astype(np.int32)

    def scatter(x):
        x = np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x)
        pages = np.full((num_pages, block_size, *x.shape[2:]), np.nan, x.dtype)
        pages[table.reshape(-1)] = x.reshape(batch * blocks, block_size, *x.shape[2:])
        return jnp.asarray(pages, k.dtype)

    return scatter(k), scatter(v), jnp.asarray(table)


@functools.partial(
    jax.jit,
    static_argnames=("causal", "window", "softcap"),
    compiler_options={"xla_backend_optimization_level": 0} if BACKEND == "cpu" else None,
)
def _shifted_reference(q, k, v, kv_ids, sinks, *, causal, window, softcap):
    q_ids = jnp.zeros(q.shape[:2], jnp.int32)
    return attention_reference(
        q, k, v, causal=causal, window=window, softcap=softcap, sinks=sinks,
        segment_ids=(q_ids, kv_ids), return_lse=True,
    )  # fmt: skip


def reference(q, k, v, lens, *, causal, window=None, softcap=None, sinks=None):
    """(out, lse) of attention_reference for sequence b holding keys [0, lens[b]) of the
    contiguous cache k, v, in q's dtype (float64 inputs give the float64 reference).

    Each sequence's keys are moved to the end of the key axis, behind zero keys that a segment
    id hides, so that bottom-right alignment to the key axis is alignment to the sequence's
    length, and one compiled reference serves every length (0 included: no key is visible)."""
    capacity = k.shape[1]
    lens = np.asarray(lens)
    index = np.arange(capacity)[None, :] - (capacity - lens[:, None])  # [B, capacity]
    real = index >= 0
    gather = np.where(real, index, 0)
    take = jax.vmap(lambda x, i: x[i])
    mask = jnp.asarray(real)[:, :, None, None]
    k_shift = jnp.where(mask, take(k, jnp.asarray(gather)), 0).astype(k.dtype)
    v_shift = jnp.where(mask, take(v, jnp.asarray(gather)), 0).astype(v.dtype)
    kv_ids = jnp.asarray(~real, jnp.int32)
    return _shifted_reference(
        q, k_shift, v_shift, kv_ids, sinks, causal=causal, window=window, softcap=softcap
    )


def check(out, lse, q, k, v, lens, *, sinks=None, **opts):
    """out and lse (from a contiguous cache k, v, or its gathered pages) against the float64
    reference, under conftest's tolerance rules."""
    dtype = q.dtype
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == stats_dtype(dtype)
    ref_sinks = None if sinks is None else f64(sinks)
    ref_out, ref_lse = reference(*f64(q, k, v), lens, sinks=ref_sinks, **opts)
    lowp_out = lowp_lse = None
    if jnp.dtype(dtype) in LOW_PRECISION:
        lowp_out, lowp_lse = reference(q, k, v, lens, sinks=sinks, **opts)
    assert_close("out", out, ref_out, dtype=dtype, kind="fwd", lowp=lowp_out)
    assert_lse_close(lse, ref_lse, dtype=dtype, lowp=lowp_lse)


def test_reference_helper(rng):
    # The shifted reference against attention_reference on each sequence's own keys.
    q, k, v, lens = make_cache(
        rng, [3, 40, 64], capacity=64, seqlen_q=4, heads_q=2, heads_kv=1, head_dim=16,
        dtype=jnp.float64,
    )  # fmt: skip
    out, lse = reference(q, k, v, lens, causal=True, window=(9, None))
    for b, n in enumerate(np.asarray(lens)):
        o, l_ = attention_reference(
            q[b : b + 1], k[b : b + 1, :n], v[b : b + 1, :n], causal=True, window=(9, None),
            return_lse=True,
        )  # fmt: skip
        np.testing.assert_allclose(np.asarray(out[b : b + 1]), np.asarray(o), rtol=1e-12)
        np.testing.assert_allclose(np.asarray(lse[b : b + 1]), np.asarray(l_), rtol=1e-12)


@jax.jit
def _gather(pages, table):
    # [num_pages, bs, H, D] by [B, blocks] -> [B, blocks * bs, H, D]
    x = pages[table]
    return x.reshape(table.shape[0], -1, *pages.shape[2:])


def assert_same_as_contiguous(out, lse, out_c, lse_c):
    """A paged call against the contiguous call on the same keys. Pages change where keys live,
    not the keys of a split, and the CPU kernel runs one code path for both layouts: the same
    bits. The CUDA kernel compiles each layout separately, so there the results are only close
    (each is held to the reference as well)."""
    if BACKEND == "cpu":
        np.testing.assert_array_equal(np.asarray(out, np.float64), np.asarray(out_c, np.float64))
        if lse is not None:
            np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_c))
        return
    assert rel_l2(out, out_c) <= (1e-5 if out.dtype == jnp.float32 else 1e-2)
    if lse is not None:
        finite = np.isfinite(np.asarray(lse_c))
        assert np.array_equal(finite, np.isfinite(np.asarray(lse)))
        assert rel_l2(np.where(finite, lse, 0), np.where(finite, lse_c, 0)) <= 1e-5


_STATIC = ("causal", "window", "softcap", "num_splits", "return_lse")
kvcache = jax.jit(kvcache_attention, static_argnames=_STATIC)


def random_lens(rng, batch, capacity, seqlen_q):
    """Lengths that include 0, 1, fewer than seqlen_q, and the full capacity."""
    fixed = [0, 1, max(seqlen_q - 1, 0), capacity]
    rest = rng.integers(seqlen_q, capacity + 1, max(batch - len(fixed), 0)).tolist()
    return (fixed + rest)[:batch]


# ----------------------------------------------------------------------------------------------
# attention_with_kvcache.

# (seqlen_q, heads_q, heads_kv, head_dim): MHA, GQA, MQA; head dims on and off the vector width.
# 36: a half-precision head_dim the CUDA decode kernel takes padded to a multiple of 8.
SHAPES = [(1, 4, 4, 64), (4, 8, 2, 36), (16, 4, 1, 128)]


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16], ids=dtype_id
)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_contiguous(rng, shape, causal, dtype):
    seqlen_q, heads_q, heads_kv, head_dim = shape
    lens = random_lens(rng, 5, 320, seqlen_q)
    q, k, v, lens = make_cache(
        rng, lens, capacity=320, seqlen_q=seqlen_q, heads_q=heads_q, heads_kv=heads_kv,
        head_dim=head_dim, dtype=dtype,
    )  # fmt: skip
    out, lse = kvcache(q, k, v, lens, causal=causal, return_lse=True)
    check(out, lse, q, k, v, lens, causal=causal)


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_paged(rng, block_size, dtype):
    capacity = 512
    lens = random_lens(rng, 4, capacity, 4)
    q, k, v, lens = make_cache(
        rng, lens, capacity=capacity, seqlen_q=4, heads_q=8, heads_kv=2, head_dim=64, dtype=dtype
    )
    k_pages, v_pages, table = to_pages(rng, k, v, block_size)
    out, lse = kvcache(q, k_pages, v_pages, lens, block_table=table, return_lse=True)
    check(out, lse, q, _gather(k_pages, table), _gather(v_pages, table), lens, causal=True)
    out_c, lse_c = kvcache(q, k, v, lens, return_lse=True)
    assert_same_as_contiguous(out, lse, out_c, lse_c)


def test_paged_table_past_length_is_not_read(rng):
    # Entries of the block table past a sequence's blocks may hold anything (here out of range):
    # they are never read, so the result is that of the valid table.
    q, k, v, lens = make_cache(
        rng, [37, 0, 64], capacity=64, seqlen_q=1, heads_q=2, heads_kv=1, head_dim=32,
        dtype=jnp.float32,
    )  # fmt: skip
    k_pages, v_pages, table = to_pages(rng, k, v, 16)
    garbage = np.asarray(table).copy()
    garbage[0, 3] = -7
    garbage[1, :] = 10**6
    out = kvcache(q, k_pages, v_pages, lens, block_table=jnp.asarray(garbage))
    expected = kvcache(q, k_pages, v_pages, lens, block_table=table)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


FEATURES = [
    {"window": (40, None)},
    {"window": (None, 3), "causal": False},
    {"window": (17, 2), "causal": False},
    {"softcap": 5.0},
    {"sinks": True},
    {"sinks": True, "window": (30, 0), "softcap": 8.0},
]


def feature_id(case):
    return "-".join(f"{k}{v}".replace(" ", "") for k, v in case.items())


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", FEATURES, ids=feature_id)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_features(rng, case, paged, dtype):
    opts = {"causal": True, **case}
    heads_q = 4
    sinks = make_sinks(rng, heads_q, dtype) if opts.pop("sinks", False) else None
    lens = random_lens(rng, 5, 256, 4)
    q, k, v, lens = make_cache(
        rng, lens, capacity=256, seqlen_q=4, heads_q=heads_q, heads_kv=2, head_dim=64, dtype=dtype
    )
    if paged:
        k_in, v_in, table = to_pages(rng, k, v, 16)
        k, v = _gather(k_in, table), _gather(v_in, table)
    else:
        k_in, v_in, table = k, v, None
    out, lse = kvcache(q, k_in, v_in, lens, block_table=table, sinks=sinks, return_lse=True, **opts)
    check(out, lse, q, k, v, lens, sinks=sinks, **opts)
    if sinks is not None:
        # A sequence without keys: O = 0 and lse = the sink of each head.
        empty = int(np.flatnonzero(np.asarray(lens) == 0)[0])
        assert (np.asarray(out[empty]) == 0).all()
        np.testing.assert_allclose(np.asarray(lse[empty]), np.broadcast_to(sinks[:, None], (4, 4)))


@pytest.mark.parametrize("num_splits", [1, 3, 8, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=dtype_id)
def test_forced_splits(rng, num_splits, dtype):
    # More splits than the keys have tiles leave trailing splits empty; the sinks enter once.
    lens = [700, 5, 0, 129, 1000]
    q, k, v, lens = make_cache(
        rng, lens, capacity=1000, seqlen_q=4, heads_q=6, heads_kv=2, head_dim=48, dtype=dtype
    )
    sinks = make_sinks(rng, 6, dtype)
    out, lse = kvcache(q, k, v, lens, sinks=sinks, return_lse=True, num_splits=num_splits)
    check(out, lse, q, k, v, lens, sinks=sinks, causal=True)
    one, one_lse = kvcache(q, k, v, lens, sinks=sinks, return_lse=True, num_splits=1)
    limit = 1e-12 if dtype == jnp.float64 else 1e-5
    assert rel_l2(out, one) <= limit
    assert rel_l2(np.where(np.isinf(lse), 0, lse), np.where(np.isinf(one_lse), 0, one_lse)) <= limit


def test_forced_splits_paged_low_precision(rng):
    lens = [300, 1, 1024]
    q, k, v, lens = make_cache(
        rng, lens, capacity=1024, seqlen_q=1, heads_q=8, heads_kv=1, head_dim=128,
        dtype=jnp.bfloat16,
    )  # fmt: skip
    k_pages, v_pages, table = to_pages(rng, k, v, 16)
    for num_splits in (1, 8):
        out, lse = kvcache(q, k_pages, v_pages, lens, block_table=table, return_lse=True,
                           num_splits=num_splits)  # fmt: skip
        check(out, lse, q, k, v, lens, causal=True)


def test_vmap_contiguous(rng):
    # vmap over a leading axis: one folded call; each element as its own call.
    q, k, v, lens = make_cache(
        rng, [20, 0, 300], capacity=300, seqlen_q=2, heads_q=4, heads_kv=2, head_dim=32,
        dtype=jnp.float32,
    )  # fmt: skip
    qs = jnp.stack([q, q[::-1]])
    ks, vs = jnp.stack([k, k[::-1]]), jnp.stack([v, v[::-1]])
    lens2 = jnp.stack([lens, lens[::-1]])
    mapped = jax.jit(jax.vmap(lambda q, k, v, n: kvcache_attention(q, k, v, n, return_lse=True)))
    text = mapped.lower(qs, ks, vs, lens2).as_text()
    assert len(custom_call_targets(text)) == 1 and "stablehlo.while" not in text
    out, lse = mapped(qs, ks, vs, lens2)
    for i in range(2):
        o, l_ = kvcache(qs[i], ks[i], vs[i], lens2[i], return_lse=True)
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(o))
        np.testing.assert_array_equal(np.asarray(lse[i]), np.asarray(l_))
    # Only q batched: the cache is shared.
    out = jax.vmap(lambda q: kvcache_attention(q, k, v, lens))(qs)
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(kvcache(qs[1], k, v, lens)))


def test_vmap_paged(rng):
    q, k, v, lens = make_cache(
        rng, [50, 64, 3], capacity=64, seqlen_q=1, heads_q=2, heads_kv=2, head_dim=16,
        dtype=jnp.float32,
    )  # fmt: skip
    pages = [to_pages(rng, k, v, 16) for _ in range(2)]
    kp = jnp.stack([p[0] for p in pages])
    vp = jnp.stack([p[1] for p in pages])
    tables = jnp.stack([p[2] for p in pages])
    qs = jnp.stack([q, -q])
    out = jax.jit(jax.vmap(lambda q, kp, vp, t: kvcache_attention(q, kp, vp, lens, block_table=t)))(
        qs, kp, vp, tables
    )
    for i in range(2):
        expected = kvcache(qs[i], kp[i], vp[i], lens, block_table=tables[i])
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(expected))
        check(*kvcache(qs[i], kp[i], vp[i], lens, block_table=tables[i], return_lse=True),
              qs[i], k, v, lens, causal=True)  # fmt: skip


def test_decode_step_example(rng):
    # The docstring's step: append the new token with dynamic_update_slice (contiguous) or a
    # scatter into its page (paged), then attend; both agree with the reference.
    batch, block_size, heads_kv, dim = 3, 16, 2, 32
    pos = jnp.asarray([0, 17, 40], jnp.int32)
    q, k, v, _ = make_cache(
        rng, [0, 17, 40], capacity=64, seqlen_q=1, heads_q=4, heads_kv=heads_kv, head_dim=dim,
        dtype=jnp.float32,
    )  # fmt: skip
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
    k_new, v_new = (normal(rng, (batch, 1, heads_kv, dim), jnp.float32) for _ in range(2))
    zero = jnp.int32(0)  # one index dtype, also under jax_enable_x64
    put = jax.vmap(lambda c, x, p: jax.lax.dynamic_update_slice(c, x, (p, zero, zero)))
    k2, v2 = put(k, k_new, pos), put(v, v_new, pos)
    out = jax_flash.attention_with_kvcache(q, k2, v2, pos + 1)
    k_pages, v_pages, table = to_pages(rng, k, v, block_size)
    page = table[jnp.arange(batch), pos // block_size]
    k_pages = k_pages.at[page, pos % block_size].set(k_new[:, 0])
    v_pages = v_pages.at[page, pos % block_size].set(v_new[:, 0])
    out_paged = jax_flash.attention_with_kvcache(q, k_pages, v_pages, pos + 1, block_table=table)
    ref, _ = reference(*f64(q, k2, v2), pos + 1, causal=True)
    assert_close("out", out, ref, dtype=jnp.float32, kind="fwd")
    assert_same_as_contiguous(out_paged, None, out, None)


def test_not_differentiable(rng):
    q, k, v, lens = make_cache(
        rng, [5, 9], capacity=16, seqlen_q=1, heads_q=2, heads_kv=1, head_dim=8, dtype=jnp.float32
    )
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)

    def f(q):
        return jax_flash.attention_with_kvcache(q, k, v, lens).sum()

    with pytest.raises(jax_flash.ForwardModeError, match="attention_with_kvcache has no deriv"):
        jax.grad(f)(q)
    with pytest.raises(jax_flash.ForwardModeError, match="attention_with_kvcache has no deriv"):
        jax.jvp(f, (q,), (q,))
    with pytest.raises(jax_flash.ForwardModeError, match="attention_with_kvcache"):
        jax.grad(lambda k: jax_flash.attention_with_kvcache(q, k, v, lens).sum())(k)


# ----------------------------------------------------------------------------------------------
# Bad input, at trace time.


def sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def trace(q=(2, 1, 4, 64), k=(2, 128, 2, 64), v=None, lens=((2,), jnp.int32), **kwargs):
    v = k if v is None else v
    arrays = {"q": q, "k": k, "v": v, "lens": lens}
    specs = {n: sds(*s) if isinstance(s[0], tuple) else sds(s) for n, s in arrays.items()}
    table = kwargs.pop("block_table", None)
    if isinstance(table, tuple):
        table = sds(*table) if isinstance(table[0], tuple) else sds(table, jnp.int32)

    def f(q, k, v, lens, table):
        return jax_flash.attention_with_kvcache(q, k, v, lens, block_table=table, **kwargs)

    return jax.eval_shape(f, specs["q"], specs["k"], specs["v"], specs["lens"], table)


def test_valid_traces():
    assert trace().shape == (2, 1, 4, 64)
    out, lse = trace(k=(10, 16, 2, 64), block_table=(2, 4), return_lse=True)
    assert out.shape == (2, 1, 4, 64) and lse.shape == (2, 4, 1) and lse.dtype == jnp.float32
    # Narrow integer lengths are widened, as segment ids are.
    assert trace(lens=((2,), jnp.int16)).shape == (2, 1, 4, 64)


@pytest.mark.parametrize(
    "kwargs,error,pattern",
    [
        ({"q": (2, 4, 64)}, ValueError, r"\bq\b.*rank 4"),
        ({"k": (2, 128, 64)}, ValueError, r"\bk\b.*rank 4"),
        ({"k": (3, 128, 2, 64)}, ValueError, r"k_cache and v_cache batch size 3"),
        ({"v": (2, 64, 2, 64)}, ValueError, r"k and v must have the same shape"),
        ({"k": (2, 128, 3, 64)}, ValueError, r"multiple of the number of key/value heads"),
        ({"k": (2, 128, 2, 32)}, ValueError, r"head_dim 32 must equal q's head_dim 64"),
        ({"q": (2, 1, 4, 300), "k": (2, 128, 2, 300)}, ValueError, r"head_dim must be between"),
        ({"lens": ((3,), jnp.int32)}, ValueError, r"cache_seqlens must have shape \[batch\]"),
        ({"lens": ((2,), jnp.int64)}, TypeError, r"cache_seqlens must have dtype int32"),
        ({"lens": ((2,), jnp.float32)}, TypeError, r"cache_seqlens must have dtype int32"),
        ({"block_table": (2,)}, ValueError, r"block_table must have shape \[batch, max_blocks\]"),
        ({"block_table": (3, 4)}, ValueError, r"block_table must have shape \[batch, max_blocks"),
        ({"block_table": ((2, 4), jnp.float32)}, TypeError, r"block_table must have dtype int32"),
        ({"sinks": jnp.zeros(3)}, ValueError, r"sinks must have shape \[heads_q\]"),
        ({"causal": 1}, TypeError, r"causal must be a Python bool"),
        ({"window": (-1, 0)}, ValueError, r"window left bound must be >= 0"),
        ({"softcap": -1.0}, ValueError, r"softcap must be finite and > 0"),
        ({"softmax_scale": 0.0}, ValueError, r"softmax_scale must be a finite positive"),
        ({"return_lse": None}, TypeError, r"return_lse must be a Python bool"),
    ],
)
def test_bad_input(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        trace(**kwargs)


def test_bad_dtypes():
    with pytest.raises(TypeError, match=r"q, k and v must share one dtype"):
        trace(k=((2, 128, 2, 64), jnp.bfloat16))
    with pytest.raises(TypeError, match=r"q has dtype int32"):
        trace(q=((2, 1, 4, 64), jnp.int32))


def test_concrete_lengths_checked():
    q = jnp.zeros((2, 1, 2, 8))
    k = jnp.zeros((2, 16, 1, 8))
    for bad in ([17, 0], [-1, 3]):
        with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 16\]"):
            jax_flash.attention_with_kvcache(q, k, k, jnp.asarray(bad, jnp.int32))


# ----------------------------------------------------------------------------------------------
# The host's split choice.


def test_choose_num_splits():
    choose = _decode.choose_num_splits
    # CUDA, half precision: 2 blocks per SM (1 from head_dim 129), rows in blocks of 16 / 32.
    assert choose(1, 8, 65536, platform="cuda", workers=132, rows=4) == 33
    assert choose(8, 8, 65536, platform="cuda", workers=132, rows=4) == 4
    assert choose(32, 8, 65536, platform="cuda", workers=132, rows=4) == 1
    assert choose(1, 8, 65536, platform="cuda", workers=132, rows=64) == 16
    assert choose(1, 8, 65536, platform="cuda", workers=132, rows=64, head_dim=256) == 4
    assert choose(1, 1, 1 << 20, platform="cuda", workers=132) == 64
    assert choose(1, 8, 8192, platform="cuda", workers=132) == 16  # >= 512 keys per split
    assert choose(1, 8, 600, platform="cuda", workers=132) == 2
    assert choose(1, 8, 300, platform="cuda", workers=132) == 1
    assert choose(1, 8, 1, platform="cuda", workers=132) == 1
    # CUDA, float32/float64: one warp per row, 32 per SM, >= 128 keys per split.
    assert choose(1, 8, 65536, platform="cuda", workers=132, rows=4, half=False) == 64
    assert choose(4, 8, 65536, platform="cuda", workers=132, rows=4, half=False) == 33
    assert choose(1, 8, 300, platform="cuda", workers=132, rows=4, half=False) == 3
    # CPU: B * Hkv * splits >= 2 * threads, each split >= 512 keys.
    assert choose(1, 1, 8192, platform="cpu", workers=2) == 4
    assert choose(1, 2, 8192, platform="cpu", workers=8) == 8
    assert choose(1, 1, 1000, platform="cpu", workers=2) == 1
    assert choose(4, 2, 1 << 16, platform="cpu", workers=2) == 1
    assert choose(0, 2, 10, platform="cpu", workers=2) == 1
    with pytest.raises(ValueError, match="platform"):
        choose(1, 1, 1, platform="tpu", workers=1)


def test_host_split_choice_is_used(rng):
    # Under the host's choice (several splits here: one sequence, one kv head, 4k keys) the
    # result matches the reference.
    n = 4096
    q, k, v, lens = make_cache(
        rng, [n - 5], capacity=n, seqlen_q=1, heads_q=4, heads_kv=1, head_dim=64,
        dtype=jnp.float32,
    )  # fmt: skip
    platform = "cuda" if jax.default_backend() == "gpu" else "cpu"
    workers = _decode.cuda_sm_count() if platform == "cuda" else _decode.cpu_threads()
    assert _decode.choose_num_splits(1, 1, n, platform=platform, workers=workers, rows=4) > 1
    hlo = jax.jit(lambda *a: kvcache_attention(*a)).lower(q, k, v, lens).as_text()
    assert "num_splits = 1 :" not in hlo
    out, lse = kvcache(q, k, v, lens, return_lse=True)
    check(out, lse, q, k, v, lens, causal=True)


# ----------------------------------------------------------------------------------------------
# jax_flash.attention's decode path.


def test_decode_rule():
    applies = _decode.decode_applies
    assert applies(1, 256, varlen=False, segments=False)
    assert applies(16, 10**6, varlen=False, segments=False)
    assert not applies(17, 4096, varlen=False, segments=False)
    assert not applies(1, 255, varlen=False, segments=False)
    assert not applies(1, 4096, varlen=True, segments=False)
    assert not applies(1, 4096, varlen=False, segments=True)


def _targets(fn, *args):
    return set(custom_call_targets(jax.jit(fn).lower(*args).as_text()))


@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize(
    "opts",
    [{"causal": True}, {"causal": False}, {"causal": True, "window": (50, 0), "softcap": 20.0}],
    ids=["causal", "full", "window-softcap"],
)
def test_attention_decode_path(rng, seqlen_q, opts):
    """Sq = 1 and 4 over 300 keys run on the decode kernel; forward and gradients (which come
    from the unchanged backward) match the dense kernel, which one segment id everywhere
    selects, and the reference."""
    q, k, v = make_qkv(rng, seqlen_q=seqlen_q, seqlen_k=300, heads_q=4, heads_kv=2, head_dim=32)
    sinks = make_sinks(rng, 4, jnp.float32)
    ids = (jnp.zeros(q.shape[:2], jnp.int32), jnp.zeros(k.shape[:2], jnp.int32))

    def loss(q, k, v, sinks, segment_ids, dout, dlse):
        out, lse = jax_flash.attention(
            q, k, v, sinks=sinks, segment_ids=segment_ids, return_lse=True, **opts
        )
        return jnp.sum(out * dout) + jnp.sum(lse * dlse), (out, lse)

    dout = normal(rng, q.shape, jnp.float32)
    dlse = normal(rng, (2, 4, seqlen_q), jnp.float32)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    decoded = _targets(lambda *a: loss(*a, None, dout, dlse), q, k, v, sinks)
    assert "jax_flash_decode_cpu" in decoded or "jax_flash_decode_cuda" in decoded
    dense = _targets(lambda *a: loss(*a, dout, dlse), q, k, v, sinks, ids)
    assert not any("decode" in t for t in dense)

    g_dec, (out, lse) = grad(q, k, v, sinks, None, dout, dlse)
    g_dense, (out_d, lse_d) = grad(q, k, v, sinks, ids, dout, dlse)
    assert rel_l2(out, out_d) < 2e-6 and rel_l2(lse, lse_d) < 2e-6
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), g_dec, g_dense, strict=True):
        assert rel_l2(a, b, floor=0.1) < 1e-5, name
    ref_out, ref_lse = attention_reference(*f64(q, k, v), sinks=f64(sinks), return_lse=True, **opts)
    assert_close("out", out, ref_out, dtype=jnp.float32, kind="fwd")
    assert_lse_close(lse, ref_lse, dtype=jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.bfloat16], ids=dtype_id)
def test_attention_decode_path_dtypes(rng, dtype):
    q, k, v = make_qkv(rng, seqlen_q=2, seqlen_k=600, heads_q=8, heads_kv=1, head_dim=64,
                       dtype=dtype)  # fmt: skip
    out, lse = jax.jit(lambda *a: jax_flash.attention(*a, causal=True, return_lse=True))(q, k, v)
    ref_out, ref_lse = attention_reference(*f64(q, k, v), causal=True, return_lse=True)
    lowp = attention_reference(q, k, v, causal=True) if dtype == jnp.bfloat16 else None
    assert_close("out", out, ref_out, dtype=dtype, kind="fwd", lowp=lowp)
    assert_lse_close(lse, ref_lse, dtype=dtype)


def test_attention_decode_path_top_left(rng):
    # dot_product_attention's is_causal is top-left aligned: the band's alignment carries over
    # to the decode call (query i sees keys 0..i of 300).
    q, k, v = make_qkv(rng, seqlen_q=4, seqlen_k=300, heads_q=4, heads_kv=2, head_dim=32)
    fn = jax.jit(lambda *a: jax_flash.dot_product_attention(*a, is_causal=True))
    assert any("decode" in t for t in _targets(fn, q, k, v))
    out = fn(q, k, v)
    ref = attention_reference(*f64(q, k, v), causal=True, diagonal_offset=0)
    assert_close("out", out, ref, dtype=jnp.float32, kind="fwd")


def test_attention_decode_path_vmap(rng):
    q, k, v = make_qkv(rng, seqlen_q=1, seqlen_k=257, heads_q=2, heads_kv=1, head_dim=16)
    qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))
    fn = jax.jit(jax.vmap(lambda q, k, v: jax_flash.attention(q, k, v, causal=True)))
    # The vmapped axis folds into the decode call's batch: one launch, no loop.
    text = fn.lower(qs, ks, vs).as_text()
    targets = custom_call_targets(text)
    assert len(targets) == 1 and "decode" in targets[0] and "stablehlo.while" not in text
    out = fn(qs, ks, vs)
    for i in range(2):
        ref = attention_reference(*f64(qs[i], ks[i], vs[i]), causal=True)
        assert_close("out", out[i], ref, dtype=jnp.float32, kind="fwd")
    assert math.isfinite(float(jnp.sum(out)))
