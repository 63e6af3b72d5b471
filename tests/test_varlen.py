"""attention_varlen: packed batches of variable-length sequences (cu_seqlens), alone and with
causal, windows, softcap, sinks and GQA, against the float64 reference.

conftest.check_features also holds the packed contract's exact values: tokens past the last
sequence and rows of sequences without keys give O = 0 and dQ = 0 (lse -inf past the last
sequence, the sink inside one), keys no row sees get dK = dV = 0, and every output row is written
(the allocator is poisoned first). Empty sequences, one-token sequences and sequences that
straddle the kernels' tiles appear throughout.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_close,
    check_features,
    dtype_id,
    flash_feature_vjp,
    make_packed,
    make_sinks,
    normal,
    reference_feature_vjp,
    rel_l2,
    segments_from_lengths,
    stats_dtype,
)

import jax_flash

# Head configurations: (heads_q, heads_kv, head_dim, total_q, total_k, num_seqs). Every layout of
# one configuration is brought to its totals by tokens past the last sequence and by empty
# sequences at the end, so that the reference compiles once per configuration and dtype.
CONFIGS = {
    "gqa64": (4, 2, 64, 760, 660, 5),
    "mqa128": (4, 1, 128, 202, 322, 5),
    "deep": (2, 1, 256, 150, 170, 2),
}

# The packed layouts the cases share: (configuration, lens_q, lens_k).
LAYOUTS = {
    # equal lengths, an empty sequence, one token, tile-crossing lengths; much padding
    "mixed": ("gqa64", [1, 17, 0, 130, 257], [1, 17, 0, 130, 257]),
    # Sq < Sk and Sq > Sk per sequence, empty q, empty k
    "unequal": ("mqa128", [5, 0, 130, 1, 64], [17, 3, 100, 0, 200]),
    # long sequences under a window, no padding at all
    "windowed": ("gqa64", [300, 10, 450], [130, 64, 466]),
    "odd": ("gqa64", [257, 64, 0, 129], [257, 64, 0, 129]),
    "deep": ("deep", [17, 130], [33, 130]),
    # one-token documents: one query over many keys, many queries over one key
    "ones": ("gqa64", [1, 1, 300], [1, 300, 1]),
    # nothing but padding
    "empty": ("gqa64", [], []),
}


def packed(rng, layout, dtype):
    config, lens_q, lens_k = LAYOUTS[layout]
    heads_q, heads_kv, head_dim, total_q, total_k, num_seqs = CONFIGS[config]
    empty = [0] * (num_seqs - len(lens_q))
    return make_packed(
        rng,
        lens_q + empty,
        lens_k + empty,
        pad_q=total_q - sum(lens_q),
        pad_k=total_k - sum(lens_k),
        heads_q=heads_q,
        heads_kv=heads_kv,
        head_dim=head_dim,
        dtype=dtype,
    )


# (layout, causal, window, softcap, sinks)
CASES = [
    ("mixed", True, None, None, False),
    ("unequal", False, None, None, True),
    ("unequal", True, (16, None), None, False),
    ("windowed", False, (32, 8), 20.0, True),
    # a left bound past int32: unbounded in effect, and no overflow in i + off - left
    ("odd", False, (2**40, 3), 5.0, True),
    ("deep", True, (16, 16), None, True),
    ("ones", True, None, None, False),
    ("ones", False, (0, 0), None, True),
    ("empty", True, (4, 4), None, True),
]
FLOAT64 = (0, 2, 3, 6, 8)
FLOAT16 = (3,)


def grid():
    params = []
    for i, case in enumerate(CASES):
        dtypes = [jnp.float32, jnp.bfloat16]
        dtypes += [jnp.float64] * (i in FLOAT64) + [jnp.float16] * (i in FLOAT16)
        name = "-".join(str(x).replace(" ", "") for x in case)
        params += [pytest.param(*case, d, id=f"{name}-{dtype_id(d)}") for d in dtypes]
    return params


@pytest.mark.parametrize("layout,causal,window,softcap,with_sinks,dtype", grid())
def test_varlen(rng, layout, causal, window, softcap, with_sinks, dtype):
    q, k, v, cu = packed(rng, layout, dtype)
    sinks = make_sinks(rng, q.shape[1], dtype) if with_sinks else None
    check_features(
        rng, q, k, v, cu_seqlens=cu, causal=causal, window=window, softcap=softcap, sinks=sinks
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_varlen_long(rng, dtype):
    # 1500 tokens in three sequences under a sliding window: most tiles are skipped.
    q, k, v, cu = make_packed(
        rng, [600, 900, 3], [600, 900, 3], heads_q=2, heads_kv=1, head_dim=64, dtype=dtype
    )
    sinks = make_sinks(rng, 2, dtype)
    check_features(rng, q, k, v, cu_seqlens=cu, causal=True, window=(128, 0), sinks=sinks)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_varlen_many_sequences(rng, dtype):
    # 80 short sequences (empty ones included), more than a warp's 32 lanes: the GPU kernels'
    # span search takes two rounds to find a tile's sequence.
    lens = [(i * 37) % 97 for i in range(80)]
    q, k, v, cu = make_packed(rng, lens, lens, heads_q=2, heads_kv=1, head_dim=64, dtype=dtype)
    check_features(rng, q, k, v, cu_seqlens=cu, causal=True)


def test_only_padding(rng):
    # No sequence has a token: O = 0, lse = -inf (also with sinks), and every gradient is 0.
    q, k, v, cu = packed(rng, "empty", jnp.float32)
    dout = normal(rng, q.shape, q.dtype)
    dlse = normal(rng, (q.shape[1], q.shape[0]), jnp.float32)
    sinks = make_sinks(rng, q.shape[1], jnp.float32)
    out, lse, grads = flash_feature_vjp(q, k, v, dout, dlse, cu_seqlens=cu, sinks=sinks)
    assert (np.asarray(out) == 0).all()
    assert np.isneginf(np.asarray(lse)).all()
    for name, g in zip(("dq", "dk", "dv", "dsinks"), grads, strict=True):
        assert (np.asarray(g) == 0).all(), name


# ----------------------------------------------------------------------------------------------
# The packed call against the dense kernel on each sequence, and against segment ids.


def _close(name, x, y, dtype):
    x, y = np.asarray(x), np.asarray(y)
    finite = np.isfinite(y)
    assert np.array_equal(finite, np.isfinite(x)), f"{name}: non-finite at other places"
    err = rel_l2(np.where(finite, x, 0), np.where(finite, y, 0))
    assert err <= (1e-12 if dtype == jnp.float64 else 2e-6), f"{name}: differs by {err:.3e}"


@pytest.mark.parametrize("dtype", [jnp.float32], ids=dtype_id)
def test_matches_dense_calls(rng, dtype):
    # Each sequence of a packed call gives what a dense call on that sequence alone gives, with
    # every feature on; empty sequences are left out of the dense side (they have nothing).
    q, k, v, (cu_q, cu_k) = packed(rng, "unequal", dtype)
    sinks = make_sinks(rng, q.shape[1], dtype)
    dout = normal(rng, q.shape, dtype)
    dlse = normal(rng, (q.shape[1], q.shape[0]), stats_dtype(dtype))
    kw = {"causal": True, "window": (16, None), "softcap": 5.0}
    out, lse, (dq, dk, dv, dsinks) = flash_feature_vjp(
        q, k, v, dout, dlse, cu_seqlens=(cu_q, cu_k), sinks=sinks, **kw
    )
    dsinks_dense = 0
    for n in range(len(cu_q) - 1):
        rq = slice(int(cu_q[n]), int(cu_q[n + 1]))
        rk = slice(int(cu_k[n]), int(cu_k[n + 1]))
        if rq.start == rq.stop or rk.start == rk.stop:
            continue
        one = flash_feature_vjp(
            q[None, rq], k[None, rk], v[None, rk], dout[None, rq], dlse[None, :, rq],
            sinks=sinks, **kw,
        )  # fmt: skip
        _close(f"out[{n}]", out[rq], one[0][0], dtype)
        _close(f"lse[{n}]", lse[:, rq], one[1][0], dtype)
        _close(f"dq[{n}]", dq[rq], one[2][0][0], dtype)
        _close(f"dk[{n}]", dk[rk], one[2][1][0], dtype)
        _close(f"dv[{n}]", dv[rk], one[2][2][0], dtype)
        dsinks_dense = dsinks_dense + one[2][3]
    # The sequence with no keys (3) adds exp(sink - sink) * dlse = dlse to d(sinks) per row.
    rq = slice(int(cu_q[3]), int(cu_q[4]))
    dsinks_dense = dsinks_dense + dlse[:, rq].sum(axis=1)
    _close("dsinks", dsinks, dsinks_dense, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=dtype_id)
def test_matches_segment_ids(rng, dtype):
    # Packed documents with causal masks are document masking of one dense row.
    lengths = [130, 1, 257, 64, 48]
    q, k, v, cu = make_packed(rng, lengths, lengths, heads_q=4, heads_kv=2, dtype=dtype)
    sinks = make_sinks(rng, 4, dtype)
    dout = normal(rng, q.shape, dtype)
    dlse = normal(rng, (4, q.shape[0]), stats_dtype(dtype))
    kw = {"causal": True, "window": (50, None), "sinks": sinks}
    varlen = flash_feature_vjp(q, k, v, dout, dlse, cu_seqlens=cu, **kw)
    ids = segments_from_lengths(lengths)
    dense = flash_feature_vjp(
        q[None], k[None], v[None], dout[None], dlse[None], segment_ids=ids, **kw
    )
    _close("out", varlen[0], dense[0][0], dtype)
    _close("lse", varlen[1], dense[1][0], dtype)
    for name, g, g_dense in zip(("dq", "dk", "dv"), varlen[2][:3], dense[2][:3], strict=True):
        _close(name, g, g_dense[0], dtype)
    _close("dsinks", varlen[2][3], dense[2][3], dtype)


def test_max_seqlen_hints_change_nothing(rng):
    q, k, v, cu = packed(rng, "unequal", jnp.float32)
    dout = normal(rng, q.shape, q.dtype)
    dlse = normal(rng, (4, q.shape[0]), jnp.float32)
    kw = {"cu_seqlens": cu, "causal": True, "window": (20, None)}
    plain = flash_feature_vjp(q, k, v, dout, dlse, **kw)
    for hints in ({"max_seqlen_q": 130, "max_seqlen_k": 200}, {"max_seqlen_q": 4096}):
        hinted = flash_feature_vjp(q, k, v, dout, dlse, **kw, **hints)
        for name, x, y in zip(
            ("out", "lse", "dq", "dk", "dv"),
            (hinted[0], hinted[1], *hinted[2][:3]),
            (plain[0], plain[1], *plain[2][:3]),
            strict=True,
        ):
            _close(f"{name} with {hints}", x, y, jnp.float32)


def test_concrete_and_traced_cu_seqlens_agree(rng):
    # Eager (concrete cu_seqlens, checked at trace time) and jitted (traced) calls are one
    # kernel call with the same data.
    q, k, v, (cu_q, cu_k) = packed(rng, "mixed", jnp.float32)
    f = functools.partial(jax_flash.attention_varlen, causal=True, return_lse=True)
    eager = f(q, k, v, cu_q, cu_k)
    jitted = jax.jit(f)(q, k, v, cu_q, cu_k)
    numpy_cu = f(q, k, v, np.asarray(cu_q), np.asarray(cu_k))
    for a, b, c in zip(eager, jitted, numpy_cu, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_one_compile_serves_every_layout(rng):
    # cu_seqlens are data: one executable serves other lengths with the same totals, and gives
    # the right answer for each.
    q, k, v, cu = packed(rng, "mixed", jnp.float64)
    other = (jnp.asarray([0, 200, 200, 300, 400, 405], jnp.int32),) * 2
    f = jax.jit(functools.partial(jax_flash.attention_varlen, causal=True))
    for layout in (cu, other):
        out = f(q, k, v, *layout)
        ref = reference_feature_vjp(q, k, v, cu_seqlens=layout, causal=True, grads=False)[0]
        assert_close("out", out, ref, dtype=jnp.float64, kind="fwd")
    assert f._cache_size() == 1


# ----------------------------------------------------------------------------------------------
# Isolation: a NaN in one sequence, or in the padding, reaches nothing else.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_isolation(rng, where, dtype):
    q, k, v, (cu_q, cu_k) = packed(rng, "windowed", dtype)
    dout = normal(rng, q.shape, dtype)
    dlse = normal(rng, (4, q.shape[0]), stats_dtype(dtype))
    inputs = {"q": q, "k": k, "v": v}
    # Sequence 1: query tokens 300..309, key tokens 130..193; the neighbours start right beside.
    row = 300 if where == "q" else 150
    inputs[where] = inputs[where].at[row, 0, 5].set(jnp.nan)
    kw = {"cu_seqlens": (cu_q, cu_k), "causal": True, "window": (48, 0)}
    out, lse, grads = flash_feature_vjp(inputs["q"], inputs["k"], inputs["v"], dout, dlse, **kw)
    clean = flash_feature_vjp(q, k, v, dout, dlse, **kw)
    assert np.isnan(np.asarray(out[300]).astype(np.float64)).any(), "the NaN went nowhere"
    others_q = np.r_[0:300, 310 : q.shape[0]]
    others_k = np.r_[0:130, 194 : k.shape[0]]
    same = {"rtol": 1e-2, "atol": 1e-2} if dtype == jnp.bfloat16 else {"rtol": 1e-6, "atol": 1e-7}
    checks = [
        ("out", out[others_q], clean[0][others_q]),
        ("lse", lse[:, others_q], clean[1][:, others_q]),
        ("dq", grads[0][others_q], clean[2][0][others_q]),
        ("dk", grads[1][others_k], clean[2][1][others_k]),
        ("dv", grads[2][others_k], clean[2][2][others_k]),
    ]
    for name, x, y in checks:
        x, y = np.asarray(x).astype(np.float64), np.asarray(y).astype(np.float64)
        assert not np.isnan(x).any(), f"{name}: the NaN leaked into another sequence"
        np.testing.assert_allclose(x, y, **same, err_msg=name)


def test_nan_in_padding_reaches_nothing(rng):
    # Tokens past the last sequence belong to none: NaNs there change no output, their own rows
    # give O = 0 and lse = -inf, and their gradients are 0.
    q, k, v, cu = packed(rng, "mixed", jnp.float32)
    dout = normal(rng, q.shape, q.dtype)
    dlse = normal(rng, (4, q.shape[0]), jnp.float32)
    tq, tk = int(cu[0][-1]), int(cu[1][-1])
    sinks = make_sinks(rng, 4, jnp.float32)
    kw = {"cu_seqlens": cu, "causal": True, "sinks": sinks}
    clean = flash_feature_vjp(q, k, v, dout, dlse, **kw)
    q_nan = q.at[tq:].set(jnp.nan)
    k_nan, v_nan = k.at[tk:].set(jnp.nan), v.at[tk:].set(jnp.nan)
    out, lse, grads = flash_feature_vjp(q_nan, k_nan, v_nan, dout, dlse, **kw)
    np.testing.assert_array_equal(np.asarray(out[:tq]), np.asarray(clean[0][:tq]))
    np.testing.assert_array_equal(np.asarray(lse[:, :tq]), np.asarray(clean[1][:, :tq]))
    assert (np.asarray(out[tq:]) == 0).all() and np.isneginf(np.asarray(lse[:, tq:])).all()
    for name, g, c in zip(("dq", "dk", "dv", "dsinks"), grads, clean[2], strict=True):
        g = np.asarray(g)
        assert not np.isnan(g).any(), f"{name}: NaN from the padding"
        np.testing.assert_array_equal(g, np.asarray(c), err_msg=name)
    assert (np.asarray(grads[0][tq:]) == 0).all() and (np.asarray(grads[1][tk:]) == 0).all()


# ----------------------------------------------------------------------------------------------
# Malformed traced cu_seqlens cannot be checked; the kernels clamp them (wrong results allowed,
# out-of-bounds accesses not: a crash here takes the test process down).


@pytest.mark.parametrize(
    "cu_q,cu_k",
    [
        ([0, 50, 10, 60], [0, 20, 40, 60]),  # decreasing
        ([0, 30, 60, 1000], [0, 20, 40, 60]),  # past the tokens
        ([5, 30, 60, 70], [-7, 20, 40, 2**31 - 1]),  # not from 0, negative, huge
        ([0, 2**31 - 1, 0, 70], [0, 0, -(2**31), 64]),
    ],
    ids=["decreasing", "past_the_end", "offset_negative_huge", "extremes"],
)
def test_malformed_traced_cu_seqlens_stay_in_bounds(rng, cu_q, cu_k):
    q, k, v, _ = make_packed(rng, [70], [64], heads_q=2, head_dim=64, dtype=jnp.float32)
    dout = normal(rng, q.shape, q.dtype)
    dlse = normal(rng, (2, 70), jnp.float32)
    cu = (jnp.asarray(cu_q, jnp.int32), jnp.asarray(cu_k, jnp.int32))
    for kw in ({}, {"causal": True, "window": (8, 8), "sinks": make_sinks(rng, 2, q.dtype)}):
        out, lse, grads = flash_feature_vjp(q, k, v, dout, dlse, cu_seqlens=cu, **kw)
        jax.block_until_ready((out, lse, grads))
        assert out.shape == q.shape and lse.shape == (2, 70)
