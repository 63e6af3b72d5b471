"""Sliding windows, logit soft-capping, segment ids and attention sinks, alone and combined, against
the float64 reference.

Every case goes through conftest.check_features: forward and VJP with random cotangents on O and
lse (dQ, dK, dV and d(sinks)) under the tolerance rules, the exact values the contract fixes (rows
that see no key give O = 0, dQ = 0 and lse -inf or the sink; keys no row sees get dK = dV = 0) and
a poisoned allocator. Lengths cross the GPU kernels' 64-192-row tiles and 16-position segment
chunks; head dims 64 and 128 take the fast GPU paths, 40 and 256 the others.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ON_GPU,
    check_features,
    dtype_id,
    flash_feature_vjp,
    make_qkv,
    make_sinks,
    normal,
    rel_l2,
    segments_from_lengths,
    stats_dtype,
)
from jax.test_util import check_grads

import jax_flash

F32_BF16 = (jnp.float32, jnp.bfloat16)


def case_id(value):
    if isinstance(value, (tuple, list)):
        return "w" + "_".join("inf" if x is None else str(x) for x in value)
    if value is None:
        return "none"
    return str(value)


def grid(cases, float64=(), float16=()):
    """pytest params: every case in float32 and bfloat16, the cases at the indices `float64` in
    float64 (cheap: its reference is the float32 case's) and those at `float16` in float16."""
    params = []
    for i, case in enumerate(cases):
        dtypes = F32_BF16 + ((jnp.float64,) if i in float64 else ())
        dtypes += (jnp.float16,) if i in float16 else ()
        name = "-".join(case_id(x) for x in case)
        params += [pytest.param(*case, d, id=f"{name}-{dtype_id(d)}") for d in dtypes]
    return params


# The shapes the cases share (batch 2): the reference compiles once per shape and dtype (and
# softcap or not), whatever the masks. (seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)
SHAPES = {
    "tall": (257, 130, 4, 2, 256),  # Sq > Sk, GQA
    "wide": (130, 257, 2, 1, 128),  # Sq < Sk, MQA
    "square": (300, 300, 4, 1, 64),  # several tiles both ways
    "odd": (257, 257, 2, 2, 40),  # a head_dim off the fast paths
    "row": (1, 257, 2, 2, 64),  # one query row
    "key": (257, 1, 2, 2, 64),  # one key
}


def qkv(rng, shape, dtype, scale=1.0):
    seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = SHAPES[shape]
    return make_qkv(
        rng,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        heads_q=heads_q,
        heads_kv=heads_kv,
        head_dim=head_dim,
        dtype=dtype,
        scale=scale,
    )


# ----------------------------------------------------------------------------------------------
# Sliding windows.

# (shape, window, causal)
WINDOWS = [
    # the diagonal only
    ("square", (0, 0), True),
    # Sq > Sk: the first rows see no key; Sq < Sk
    ("tall", (3, 7), False),
    ("wide", (3, 7), False),
    # a band sliding over several tiles; with causal the right bound becomes 0
    ("square", (64, 5), True),
    # one side bounded
    ("odd", (None, 5), False),
    ("odd", (16, None), False),
    # left 0 with causal: exactly the diagonal key, none for the first Sq - Sk rows
    ("tall", (0, None), True),
    # wider than both sequences
    ("wide", (1000, 1000), False),
    # one query row (keys 251..256); one key (seen by rows 254..256)
    ("row", (5, 0), False),
    ("key", (0, 2), False),
]


@pytest.mark.parametrize(
    "shape,window,causal,dtype", grid(WINDOWS, float64=(0, 1, 2, 5, 7, 9), float16=(1,))
)
def test_window(rng, shape, window, causal, dtype):
    q, k, v = qkv(rng, shape, dtype)
    check_features(rng, q, k, v, window=window, causal=causal)


def test_window_rows_see_exactly_the_band(rng):
    # A window of (2, 1) over one-hot values: output row i holds the softmax weights of keys
    # i-2..i+1 and nothing else.
    seqlen = 40
    q, k, _ = make_qkv(
        rng, batch=1, seqlen_q=seqlen, seqlen_k=seqlen, heads_q=1, head_dim=64, dtype=jnp.float64
    )
    v = jnp.eye(seqlen, 64, dtype=jnp.float64)[None, :, None, :]
    out = np.asarray(jax_flash.attention(q, k, v, window=(2, 1)))[0, :, 0, :seqlen]
    i, j = np.indices((seqlen, seqlen))
    band = (j >= i - 2) & (j <= i + 1)
    assert (out[~band] == 0).all()
    assert (out[band] > 0).all()
    np.testing.assert_allclose(out.sum(axis=1), 1.0, rtol=1e-12)


# ----------------------------------------------------------------------------------------------
# Soft-capping.

# (shape, softcap, input_scale, causal)
SOFTCAPS = [
    # logits of std 1 against a cap of 2: far from linear
    ("wide", 2.0, 1.0, False),
    # std 9 against 5, Sq > Sk with causal: saturated, and rows without keys
    ("tall", 5.0, 3.0, True),
    # std 100 capped at 20: the huge-logit regime becomes harmless
    ("square", 20.0, 10.0, False),
    # Gemma 2's 50: nearly linear
    ("odd", 50.0, 1.0, True),
]


@pytest.mark.parametrize(
    "shape,softcap,input_scale,causal,dtype", grid(SOFTCAPS, float64=(0, 2), float16=(1,))
)
def test_softcap(rng, shape, softcap, input_scale, causal, dtype):
    q, k, v = qkv(rng, shape, dtype, scale=input_scale)
    check_features(
        rng, q, k, v, softcap=softcap, causal=causal, same_precision_rule=input_scale > 1
    )


def test_softcap_bounds_the_logits(rng):
    # With a cap of 1, every logit lies in (-1, 1): lse <= 1 + log(Sk), whatever the inputs.
    q, k, v = make_qkv(rng, batch=1, seqlen_q=33, seqlen_k=65, dtype=jnp.float64, scale=30.0)
    _, lse = jax_flash.attention(q, k, v, softcap=1.0, return_lse=True)
    assert np.asarray(lse).max() < 1 + np.log(65)
    _, lse_uncapped = jax_flash.attention(q, k, v, return_lse=True)
    assert np.asarray(lse_uncapped).max() > 100


def _softcap_reference_point_qkv(rng, dtype):
    """Scores q_i . k_j * scale ~ c_i * b_j, steered by one head-dim axis (plus small noise), for
    the soft-capped GPU forward whose warps stop tracking their row max once it is near the cap:
    rows 0-63 (c = 1) see scores of 4-7 and freeze far above their max, then meet key 600, whose
    score of 200 is capped to ~50, the largest value a frozen reference allows for; rows 64-127
    (c = -1) see scores of -4 to -7, too far below the cap to freeze; rows 128-135 and 136-143
    (c = 1 and -1) share a warp, which must then never freeze; rows 144-299 have c from -1 to 1.
    Head 1 negates c, so each kind of row meets the other kind of warp."""
    seqlen_q, seqlen_k, head_dim = 300, 700, 128
    root = np.sqrt(head_dim)
    c = np.ones(seqlen_q)
    c[64:128] = -1.0
    c[136:144] = -1.0
    c[144:] = np.linspace(-1.0, 1.0, seqlen_q - 144)
    b = (4.0 + 3.0 * rng.random(seqlen_k)) * root
    b[600] = 200.0 * root
    q = 0.05 * rng.standard_normal((1, seqlen_q, 2, head_dim))
    k = 0.05 * rng.standard_normal((1, seqlen_k, 1, head_dim))
    q[0, :, 0, 0] = c
    q[0, :, 1, 0] = -c
    k[0, :, 0, 0] = b
    v = rng.standard_normal((1, seqlen_k, 1, head_dim))
    return (jnp.asarray(x, dtype) for x in (q, k, v))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", F32_BF16 + (jnp.float16,), ids=dtype_id)
def test_softcap_reference_point(rng, causal, dtype):
    q, k, v = _softcap_reference_point_qkv(rng, dtype)
    check_features(rng, q, k, v, softcap=50.0, causal=causal, same_precision_rule=True)


# ----------------------------------------------------------------------------------------------
# Sinks.

# (shape, causal, window)
SINKS = [
    ("tall", False, None),
    # rows 0..126 see no key: O = 0 and lse = sink
    ("tall", True, None),
    # 17 keys per row: the sink holds much of the mass
    ("square", False, (8, 8)),
    ("key", False, None),
]


@pytest.mark.parametrize("shape,causal,window,dtype", grid(SINKS, float64=(1, 2), float16=(1,)))
def test_sinks(rng, shape, causal, window, dtype):
    q, k, v = qkv(rng, shape, dtype)
    sinks = make_sinks(rng, q.shape[2], dtype)
    check_features(rng, q, k, v, sinks=sinks, causal=causal, window=window)


@pytest.mark.parametrize("dtype", F32_BF16, ids=dtype_id)
def test_dominant_sinks(rng, dtype):
    # A sink far above every logit takes all the mass: O ~ 0, lse ~ sink, d(sinks) ~ sum(dlse).
    q, k, v = qkv(rng, "wide", dtype)
    sinks = jnp.asarray([40.0, 45.0], stats_dtype(dtype))
    (out, lse, _), _ = check_features(rng, q, k, v, sinks=sinks)
    assert np.abs(np.asarray(out).astype(np.float64)).max() < 1e-10
    np.testing.assert_allclose(
        np.asarray(lse), np.broadcast_to(sinks[None, :, None], lse.shape), rtol=1e-6
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=dtype_id)
def test_minus_infinity_sinks_are_no_sinks(rng, dtype):
    # A sink of -inf adds exp(-inf) = 0 to the denominator: the heads that have one behave as
    # without sinks, also in the rows that see no key (lse -inf), and their d(sink) is 0.
    q, k, v = qkv(rng, "tall", dtype)
    dout = normal(rng, q.shape, dtype)
    dlse = normal(rng, (2, 4, 257), stats_dtype(dtype))
    sinks = jnp.asarray([-jnp.inf, 1.5, -jnp.inf, 0.0], stats_dtype(dtype))
    out, lse, grads = flash_feature_vjp(q, k, v, dout, dlse, sinks=sinks, causal=True)
    plain_out, plain_lse, _ = flash_feature_vjp(q, k, v, dout, dlse, causal=True)
    tight = {"rtol": 1e-5 if dtype == jnp.float32 else 1e-12, "atol": 1e-6}
    for h in (0, 2):
        np.testing.assert_allclose(out[:, :, h], plain_out[:, :, h], **tight)
        np.testing.assert_allclose(lse[:, h], plain_lse[:, h], **tight)
    assert np.isfinite(np.asarray(grads[3])).all(), f"d(sinks) must be finite, got {grads[3]}"
    assert grads[3][0] == 0 and grads[3][2] == 0
    check_features(rng, q, k, v, sinks=sinks, causal=True)


def test_sinks_in_a_narrower_dtype(rng):
    # bfloat16 sinks with float32 inputs are computed in float32 (the same O, lse, dQ, dK, dV as
    # the same values in float32), and d(sinks) comes back as bfloat16.
    q, k, v = qkv(rng, "wide", jnp.float32)
    dout = normal(rng, q.shape, q.dtype)
    dlse = normal(rng, (2, 2, 130), jnp.float32)
    sinks = jnp.asarray([0.5, 2.0], jnp.bfloat16)
    out, lse, grads = flash_feature_vjp(q, k, v, dout, dlse, sinks=sinks)
    wide = flash_feature_vjp(q, k, v, dout, dlse, sinks=sinks.astype(jnp.float32))
    for x, y in zip((out, lse, *grads[:3]), (wide[0], wide[1], *wide[2][:3]), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert grads[3].dtype == jnp.bfloat16 and grads[3].shape == (2,)
    np.testing.assert_allclose(np.asarray(grads[3], np.float32), wide[2][3], rtol=1e-2)
    check_features(rng, q, k, v, sinks=sinks.astype(jnp.float32))


def test_sinks_heads_are_independent(rng):
    # Changing head 1's sink changes nothing in head 0 (sinks are per query head).
    q, k, v = make_qkv(rng, batch=1, seqlen_q=50, seqlen_k=60, heads_q=2, dtype=jnp.float32)
    a = jax_flash.attention(q, k, v, sinks=jnp.asarray([1.0, 2.0], jnp.float32), return_lse=True)
    b = jax_flash.attention(q, k, v, sinks=jnp.asarray([1.0, -3.0], jnp.float32), return_lse=True)
    np.testing.assert_array_equal(np.asarray(a[0][:, :, 0]), np.asarray(b[0][:, :, 0]))
    np.testing.assert_array_equal(np.asarray(a[1][:, 0]), np.asarray(b[1][:, 0]))
    assert not np.allclose(a[0][:, :, 1], b[0][:, :, 1])


# ----------------------------------------------------------------------------------------------
# Segment ids.


def _ids(*rows):
    """int32 [batch, S] from one (ids, run lengths) pair per batch element."""
    return jnp.asarray(np.stack([np.repeat(ids, runs) for ids, runs in rows]), jnp.int32)


def segment_layout(kind, rng):
    """(shape, segment_ids) of one named layout, batch 2."""
    if kind == "docs":
        # Boundaries off and on the 16-position chunks and the 64/128-row tiles, one-token
        # documents, and a second batch element laid out differently.
        return "square", segments_from_lengths([1, 17, 130, 100, 52], [64, 64, 128, 1, 43])
    if kind == "pair":
        # Sq != Sk, different document lengths on each side; batch 1 has one query document.
        q_ids = segments_from_lengths([50, 80], [130])
        kv_ids = segments_from_lengths([200, 57], [100, 157])
        return "wide", (q_ids, kv_ids)
    if kind == "pair_reversed":
        q_ids = segments_from_lengths([200, 57], [1, 256])
        kv_ids = segments_from_lengths([50, 80], [129, 1])
        return "tall", (q_ids, kv_ids)
    if kind == "keyless":
        # Query document 7 has no keys; the padding ids (-1 on q, -2 on kv) match nothing.
        q_ids = _ids(([0, 7, 1, -1], [40, 50, 30, 10]), ([-1, 0, 1], [16, 64, 50]))
        kv_ids = _ids(([0, 1, -2], [100, 140, 17]), ([-2, 1, 0], [1, 128, 128]))
        return "wide", (q_ids, kv_ids)
    if kind == "interleaved":
        # Ids that change at random positions: every tile pair needs the element mask.
        return "odd", jnp.asarray(rng.integers(0, 3, size=(2, 257)), jnp.int32)
    if kind == "singletons":
        # Every token its own document, or every pair of tokens.
        return "odd", jnp.asarray(np.stack([np.arange(257), np.arange(257) // 2]), jnp.int32)
    raise ValueError(kind)


# (layout, causal)
SEGMENT_CASES = [
    ("docs", True),
    ("docs", False),
    ("pair", False),
    ("keyless", True),
    ("interleaved", False),
    ("singletons", True),
]


@pytest.mark.parametrize("kind,causal,dtype", grid(SEGMENT_CASES, float64=(0, 3, 5), float16=(3,)))
def test_segment_ids(rng, kind, causal, dtype):
    shape, segment_ids = segment_layout(kind, rng)
    q, k, v = qkv(rng, shape, dtype)
    check_features(rng, q, k, v, segment_ids=segment_ids, causal=causal)


def test_narrow_integer_segment_ids(rng):
    # int8 / uint16 ids are widened to int32 and mean the same.
    q, k, v = make_qkv(rng, seqlen_q=40, seqlen_k=40, dtype=jnp.float32)
    ids = segments_from_lengths([10, 30], [25, 15])
    out = jax_flash.attention(q, k, v, segment_ids=ids)
    for dtype in (jnp.int8, jnp.uint16):
        narrow = jax_flash.attention(q, k, v, segment_ids=ids.astype(dtype))
        np.testing.assert_array_equal(np.asarray(narrow), np.asarray(out))


# ----------------------------------------------------------------------------------------------
# Everything at once: window, causal, GQA, segment ids, softcap and sinks.

# (layout, window, causal, softcap)
COMBINED = [
    ("docs", (64, 0), True, 10.0),
    ("pair", (50, 20), False, 5.0),
    ("pair_reversed", (20, 3), True, 30.0),
    ("keyless", (None, 9), False, 20.0),
    ("interleaved", (30, 30), True, 2.0),
]


@pytest.mark.parametrize(
    "kind,window,causal,softcap,dtype", grid(COMBINED, float64=(0, 1, 3), float16=(0, 3))
)
def test_combined(rng, kind, window, causal, softcap, dtype):
    shape, segment_ids = segment_layout(kind, rng)
    q, k, v = qkv(rng, shape, dtype)
    sinks = make_sinks(rng, q.shape[2], dtype)
    check_features(
        rng,
        q,
        k,
        v,
        window=window,
        causal=causal,
        softcap=softcap,
        segment_ids=segment_ids,
        sinks=sinks,
        softmax_scale=0.2 if shape == "odd" else None,
    )


@pytest.mark.parametrize("dtype", F32_BF16, ids=dtype_id)
def test_combined_long(rng, dtype):
    # Many tiles of which most are skipped: 1100 tokens of 5 documents under a 100-wide window.
    ids = segments_from_lengths([300, 17, 500, 1, 282])
    q, k, v = make_qkv(
        rng, batch=1, seqlen_q=1100, seqlen_k=1100, heads_q=2, heads_kv=1, dtype=dtype
    )
    sinks = make_sinks(rng, 2, dtype)
    check_features(
        rng, q, k, v, window=(100, 0), softcap=15.0, segment_ids=ids, sinks=sinks, causal=True
    )


@pytest.mark.parametrize(
    "head_dim, dtype",
    [(64, jnp.bfloat16), (128, jnp.bfloat16), (128, jnp.float16)],
    ids=["64-bfloat16", "128-bfloat16", "128-float16"],
)
def test_segment_ids_long_row(rng, head_dim, dtype):
    # A packed causal row longer than 32 query tiles of 64 rows per key tile, with GQA: the GPU
    # backward decides the query tiles of each key tile 32 at a time, and restarts per query head.
    ids = segments_from_lengths([900, 3, 1400, 64, 330])
    q, k, v = make_qkv(
        rng, batch=1, seqlen_q=2697, seqlen_k=2697, heads_q=4, heads_kv=2, head_dim=head_dim,
        dtype=dtype,
    )  # fmt: skip
    check_features(rng, q, k, v, segment_ids=ids, causal=True)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("recurring", [False, True], ids=["growing", "recurring"])
def test_segment_ids_walks_past_32_tiles(rng, causal, recurring):
    # 4500 tokens: a forward query tile walks up to 36 key blocks of 128 and a backward key tile
    # up to 71 query tiles of 64, 32 per round. With growing ids the GPU walks stop at the
    # document's edge (the chunk records' reaches); with ids that recur after other documents
    # (0, 1, 0, 1) every document's keys are spread over the row and no walk may stop early.
    ids = segments_from_lengths([1500, 700, 2000, 300])
    if recurring:
        ids = ids % 2
    q, k, v = make_qkv(
        rng, batch=1, seqlen_q=4500, seqlen_k=4500, heads_q=2, heads_kv=1, head_dim=64,
        dtype=jnp.bfloat16,
    )  # fmt: skip
    check_features(rng, q, k, v, segment_ids=ids, causal=causal)


# ----------------------------------------------------------------------------------------------
# Rows of documents. The GPU's half-precision kernels schedule a row (of at least 2048 tokens) whose
# ids are documents, each id one run and at most one run per 512 tokens, document by document, and
# every other row tile by tile with element masks; rows of both kinds can share a call. The CPU
# kernels mask element by element whatever the ids (the tests above), so these run on the GPU only.

DOCUMENT_ROWS = {
    # 2304 tokens: up to four documents a row. Both rows documents, boundaries off the tiles.
    "documents": ([700, 1, 900, 703], [129, 1000, 1175]),
    # Row 1's ids recur (0, 1, 0): it keeps the element masks beside row 0's documents.
    "recurring": ([700, 1, 900, 703], [600, 1000, 704]),
    # Row 0 has five documents, one more than its row may: element masks.
    "many": ([300, 300, 300, 700, 704], [2304]),
}


def document_ids(kind):
    ids = segments_from_lengths(*DOCUMENT_ROWS[kind])
    return ids.at[1].set(ids[1] % 2) if kind == "recurring" else ids


# (kind, head_dim, causal, window, softcap, sinks, (heads_q, heads_kv), ids: one array, a pair
# of equal arrays, or a pair whose key ids differ in one position of row 0)
DOCUMENT_CASES = [
    ("documents", 128, True, None, None, False, (4, 2), "one"),
    ("documents", 64, False, None, None, False, (2, 2), "one"),
    ("documents", 256, True, None, None, False, (2, 1), "one"),
    ("documents", 128, True, (500, 0), 30.0, True, (2, 1), "equal"),
    ("documents", 128, False, None, None, False, (2, 2), "differs"),
    ("recurring", 128, True, (300, 0), 20.0, True, (4, 1), "one"),
    ("recurring", 64, False, None, None, False, (2, 2), "equal"),
    ("many", 128, True, None, None, True, (2, 2), "equal"),
]


@pytest.mark.parametrize(
    "kind,head_dim,causal,window,softcap,sinks,heads,pair,dtype",
    [
        pytest.param(
            *case,
            d,
            id="-".join(case_id(x) for x in case) + f"-{dtype_id(d)}",
            marks=pytest.mark.skipif(not ON_GPU, reason="the GPU kernels' document schedule"),
        )
        for case in DOCUMENT_CASES
        for d in (jnp.bfloat16, jnp.float16)
    ],
)
def test_segment_ids_documents(
    rng, kind, head_dim, causal, window, softcap, sinks, heads, pair, dtype
):
    ids = document_ids(kind)
    if pair != "one":
        kv_ids = jnp.array(ids)
        ids = (ids, kv_ids.at[0, 800].add(7) if pair == "differs" else kv_ids)
    q, k, v = make_qkv(
        rng, batch=2, seqlen_q=2304, seqlen_k=2304, heads_q=heads[0], heads_kv=heads[1],
        head_dim=head_dim, dtype=dtype,
    )  # fmt: skip
    check_features(
        rng,
        q,
        k,
        v,
        segment_ids=ids,
        sinks=make_sinks(rng, heads[0], dtype) if sinks else None,
        causal=causal,
        window=window,
        softcap=softcap,
    )


# ----------------------------------------------------------------------------------------------
# Skipped and unmasked tiles give what the masked path gives.


def _agree(name, a, b, dtype):
    tol = 1e-12 if dtype == jnp.float64 else 2e-6
    for label, x, y in zip(
        ("out", "lse", "dq", "dk", "dv"),
        (a[0], a[1], *a[2][:3]),
        (b[0], b[1], *b[2][:3]),
        strict=True,
    ):
        x, y = np.asarray(x), np.asarray(y)
        finite = np.isfinite(y)
        assert np.array_equal(finite, np.isfinite(x)), f"{name}: {label} non-finite elsewhere"
        err = rel_l2(np.where(finite, x, 0), np.where(finite, y, 0))
        assert err <= tol, f"{name}: {label} differs by {err:.3e}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=dtype_id)
def test_documents_match_separate_calls(rng, dtype):
    # Tiles between different documents are skipped; each document's O, lse and gradients must
    # equal a plain causal call on that document alone.
    lengths = [130, 1, 257, 132]
    ids = segments_from_lengths(lengths)
    q, k, v = make_qkv(rng, batch=1, seqlen_q=520, seqlen_k=520, heads_q=4, heads_kv=2, dtype=dtype)
    dout = normal(rng, q.shape, dtype)
    dlse = normal(rng, (1, 4, 520), stats_dtype(dtype))
    packed = flash_feature_vjp(q, k, v, dout, dlse, segment_ids=ids, causal=True)
    start = 0
    for n in lengths:
        piece = slice(start, start + n)
        alone = flash_feature_vjp(
            q[:, piece], k[:, piece], v[:, piece], dout[:, piece], dlse[:, :, piece], causal=True
        )
        mine = (
            packed[0][:, piece],
            packed[1][:, :, piece],
            tuple(g[:, piece] for g in packed[2][:3]),
        )
        _agree(f"document at {start}", mine, alone, dtype)
        start += n


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=dtype_id)
@pytest.mark.parametrize(
    "same,other",
    [
        ({"window": (1000, 2000)}, {}),
        ({"window": (None, 0)}, {"causal": True}),
        ({"window": (599, 599)}, {}),
        ({"window": (700, 5), "causal": True}, {"causal": True}),
        ({"segment_ids": "one"}, {}),
        ({"segment_ids": "one", "causal": True}, {"causal": True}),
        ({"softcap": 1e9}, {}),
        # bounds past int32 and int64 / 2: i + off + right must not overflow
        ({"window": (2**31 - 1, 2**62)}, {}),
        ({"window": (2**40, 0)}, {"causal": True}),
    ],
    ids=[
        "wide_window",
        "causal_window",
        "exact_window",
        "wide_causal",
        "one_id",
        "one_id_causal",
        "huge_softcap",
        "int64_window",
        "int64_causal_window",
    ],
)
def test_equivalent_masks(rng, same, other, dtype):
    # Masks that hide nothing beyond `other` must give what `other` gives, whether the kernel
    # takes the unmasked fast path for them or not.
    q, k, v = make_qkv(rng, batch=1, seqlen_q=600, seqlen_k=600, heads_q=2, dtype=dtype)
    dout = normal(rng, q.shape, dtype)
    dlse = normal(rng, (1, 2, 600), stats_dtype(dtype))
    if same.get("segment_ids") == "one":
        same = {**same, "segment_ids": jnp.full((1, 600), 3, jnp.int32)}
    _agree(
        str(same),
        flash_feature_vjp(q, k, v, dout, dlse, **same),
        flash_feature_vjp(q, k, v, dout, dlse, **other),
        dtype,
    )


# ----------------------------------------------------------------------------------------------
# A NaN in one batch element stays there, with segment ids and a window.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_nan_isolation_with_segments(rng, where, dtype):
    q, k, v = make_qkv(rng, batch=3, seqlen_q=130, seqlen_k=130, heads_q=4, heads_kv=2, dtype=dtype)
    ids = segments_from_lengths([20, 110], [65, 65], [130])
    dout = normal(rng, q.shape, dtype)
    dlse = normal(rng, (3, 4, 130), stats_dtype(dtype))
    inputs = {"q": q, "k": k, "v": v}
    inputs[where] = inputs[where].at[1, 70, 1, 3].set(jnp.nan)
    kw = {"segment_ids": ids, "window": (40, 40), "causal": True, "softcap": 20.0}
    out, lse, grads = flash_feature_vjp(inputs["q"], inputs["k"], inputs["v"], dout, dlse, **kw)
    clean_out, clean_lse, clean_grads = flash_feature_vjp(q, k, v, dout, dlse, **kw)
    assert np.isnan(np.asarray(out[1]).astype(np.float64)).any(), "the NaN went nowhere"
    same = {"rtol": 1e-2, "atol": 1e-2} if dtype == jnp.bfloat16 else {"rtol": 1e-6, "atol": 1e-7}
    pairs = [("out", out, clean_out), ("lse", lse, clean_lse)]
    pairs += list(zip(("dq", "dk", "dv"), grads[:3], clean_grads[:3], strict=True))
    for b in (0, 2):
        for name, x, clean in pairs:
            x = np.asarray(x[b]).astype(np.float64)
            assert not np.isnan(x).any(), f"{name}: the NaN leaked into batch element {b}"
            np.testing.assert_allclose(x, np.asarray(clean[b]).astype(np.float64), **same)


def test_gradients_by_finite_differences(rng):
    # float64 kernel against central differences, through every feature including the sinks.
    q, k, v = make_qkv(
        rng, batch=1, seqlen_q=19, seqlen_k=23, heads_q=2, heads_kv=1, head_dim=8, dtype=jnp.float64
    )
    ids = segments_from_lengths([5, 14]), segments_from_lengths([9, 14])
    sinks = make_sinks(rng, 2, jnp.float64, shift=0.0)

    def f(q, k, v, sinks):
        return jax_flash.attention(
            q,
            k,
            v,
            window=(6, 2),
            softcap=3.0,
            segment_ids=ids,
            sinks=sinks,
            causal=True,
            return_lse=True,
        )

    check_grads(f, (q, k, v, sinks), order=1, modes=("rev",), atol=1e-5, rtol=1e-5)
