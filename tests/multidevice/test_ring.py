"""ring_attention inside shard_map over 8 devices against the float64 reference of the whole
sequence: forward, lse and gradients, for both layouts, causal and not, GQA/MQA, shard lengths
that tile unevenly, windows and segment ids; the compiled HLO holds collective-permutes of
key/value-shaped blocks and nothing else; the zigzag layout balances causal work."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    assert_close,
    assert_lse_close,
    f64,
    make_qkv,
    normal,
    rel_l2,
    segments_from_lengths,
    stats_dtype,
    visibility,
)
from jax.sharding import PartitionSpec as P
from spmd import NUM_DEVICES, collectives, mesh

import jax_flash
from jax_flash.reference import attention_reference
from jax_flash.ring import work_per_device

N = NUM_DEVICES
SEQ = P(None, "sp")  # [batch, seq, ...] sharded along the sequence
LSE = P(None, None, "sp")  # [batch, heads, seq]


def _ring_vjp(layout, causal, window, with_ids, deterministic=False):
    """jit(q, k, v, ids, dout, dlse) -> (out, lse, (dq, dk, dv)) of ring_attention over the
    mesh axis "sp", all arrays in the layout's order."""
    m = mesh((N,), ("sp",))

    def local(q, k, v, ids):
        return jax_flash.ring_attention(
            q, k, v, axis_name="sp", causal=causal, window=window,
            segment_ids=ids, layout=layout, return_lse=True, deterministic=deterministic,
        )  # fmt: skip

    ring = jax.shard_map(
        local, mesh=m, in_specs=(SEQ, SEQ, SEQ, SEQ if with_ids else None), out_specs=(SEQ, LSE)
    )

    def vjp(q, k, v, ids, dout, dlse):
        (out, lse), pullback = jax.vjp(lambda q, k, v: ring(q, k, v, ids), q, k, v)
        return out, lse, pullback((dout, dlse))

    return ring, vjp


def _reference_vjp(q, k, v, dout, dlse, **static):
    def f(q, k, v):
        return attention_reference(q, k, v, return_lse=True, **static)

    (out, lse), pullback = jax.vjp(f, q, k, v)
    return out, lse, pullback((dout, dlse))


CASES = [
    # layout, causal, heads (q, kv), shard length, window, segment ids, dtype
    ("contiguous", False, (2, 2), 5, None, False, jnp.float32),
    ("contiguous", True, (4, 2), 37, None, False, jnp.float32),
    ("zigzag", True, (4, 1), 38, None, False, jnp.float32),
    ("zigzag", False, (2, 2), 6, None, False, jnp.float64),
    ("zigzag", True, (2, 1), 34, None, True, jnp.bfloat16),
    ("contiguous", True, (2, 2), 7, (9, None), False, jnp.float64),
    ("contiguous", False, (4, 2), 7, (3, 12), True, jnp.float32),
]


@pytest.mark.parametrize(
    "layout, causal, heads, shard_len, window, with_ids, dtype",
    CASES,
    ids=[
        f"{c[0]}-{'causal' if c[1] else 'full'}-h{c[2][0]}x{c[2][1]}-s{c[3]}"
        f"{'-w' if c[4] else ''}{'-ids' if c[5] else ''}-{jnp.dtype(c[6]).name}"
        for c in CASES
    ],
)
def test_ring_matches_reference(rng, layout, causal, heads, shard_len, window, with_ids, dtype):
    seq = N * shard_len
    q, k, v = make_qkv(
        rng, batch=2, seqlen_q=seq, seqlen_k=seq, heads_q=heads[0], heads_kv=heads[1],
        head_dim=16, dtype=dtype,
    )  # fmt: skip
    ids = None
    if with_ids:
        # Documents that straddle shard boundaries, and a one-token document.
        ids = segments_from_lengths([seq // 3, 1, seq - seq // 3 - 1], [seq // 2, seq - seq // 2])
    dout = normal(rng, q.shape, dtype)
    dlse = normal(rng, (2, heads[0], seq), stats_dtype(dtype))

    if layout == "zigzag":
        to, back = (lambda x: jax_flash.to_zigzag(x, N)), (lambda x: jax_flash.from_zigzag(x, N))
    else:
        to = back = lambda x: x  # noqa: E731

    def to_lse(x):
        return jnp.swapaxes(to(jnp.swapaxes(x, 1, 2)), 1, 2)

    def back_lse(x):
        return jnp.swapaxes(back(jnp.swapaxes(x, 1, 2)), 1, 2)

    ring, vjp = _ring_vjp(layout, causal, window, with_ids)
    args = (to(q), to(k), to(v), None if ids is None else to(ids), to(dout), to_lse(dlse))
    out, lse, grads = jax.jit(vjp)(*args)
    out, lse, grads = back(out), back_lse(lse), [back(g) for g in grads]

    static = dict(causal=causal, window=window, segment_ids=ids)
    ref = _reference_vjp(*f64(q, k, v, dout, dlse), **static)
    lowp = None
    if dtype == jnp.bfloat16:
        lowp = _reference_vjp(q, k, v, dout, dlse.astype(dtype), **static)
    pick = (lambda i, j=None: None) if lowp is None else (
        lambda i, j=None: lowp[i] if j is None else lowp[i][j]
    )  # fmt: skip
    assert_close("out", out, ref[0], dtype=dtype, kind="fwd", lowp=pick(0))
    assert_lse_close(lse, ref[1], dtype=dtype, lowp=pick(1))
    for j, name in enumerate(("dq", "dk", "dv")):
        assert grads[j].shape == (q, k, v)[j].shape and grads[j].dtype == dtype
        assert_close(name, grads[j], ref[2][j], dtype=dtype, kind="grad", lowp=pick(2, j))
    visible = visibility(q, k, causal=causal, window=window, segment_ids=ids)
    assert (np.asarray(out, np.float64)[~visible.any(-1)] == 0).all()

    # Only collective-permutes, of key/value-shaped blocks (and of the key/value ids): the
    # queries, outputs and dQ never move, and GQA sends heads_kv heads, not heads_q.
    kv_block = (2, shard_len, heads[1], 16)
    for fn, fargs in ((ring, args[:4]), (vjp, args)):
        found = collectives(fn, *fargs)
        assert found, "the ring must move key/value blocks"
        for (op, shape), _ in found.items():
            dims = tuple(int(d) for d in shape.split("[")[1].split("]")[0].split(",") if d)
            assert op == "collective-permute", found
            assert dims in (kv_block, (2, shard_len)), found
    # The forward moves k and v (and kv ids) once per step that has work after the first.
    last = max(s for s in range(N) if _step_has_work(layout, causal, window, shard_len, s))
    assert sum(collectives(ring, *args[:4]).values()) == last * (3 if with_ids else 2)


def _step_has_work(layout, causal, window, shard_len, step):
    from jax_flash._kernel import Spec
    from jax_flash.ring import _plan, _window

    left, right = _window(causal, window)
    near, far = _plan(N, shard_len, layout, Spec(softmax_scale=1.0), left, right).steps[step]
    return bool(near or far)


def test_window_stops_the_ring_early():
    # A causal window of 9 keys over shards of 7 reaches two shards back: steps 0, 1 and 2 only.
    assert [_step_has_work("contiguous", True, (9, None), 7, s) for s in range(N)] == [
        True, True, True, False, False, False, False, False,
    ]  # fmt: skip


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_causal_load_balance(layout):
    shard_len = 64
    work = work_per_device(N, shard_len, causal=True, layout=layout)
    # The schedule computes exactly the visible pairs of each device's rows: no block of it is
    # invisible, so this is the work the causal mask requires.
    seq = N * shard_len
    visible = np.tril(np.ones((seq, seq), bool))
    order = np.arange(seq)
    if layout == "zigzag":
        order = np.asarray(jax_flash.to_zigzag(jnp.arange(seq)[None], N)[0])
    rows = order.reshape(N, shard_len)
    assert work == [int(visible[r].sum()) for r in rows]
    ratio = max(work) / min(work)
    if layout == "zigzag":
        assert ratio <= 1.1, work
    else:
        assert ratio > 2 * N - 2, work  # device 7 does ~15x device 0's work


def test_zigzag_helpers():
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    z = jax_flash.to_zigzag(x, 4)
    # 8 chunks of 2: device i holds chunks i and 7 - i.
    chunks = [0, 7, 1, 6, 2, 5, 3, 4]
    np.testing.assert_array_equal(
        np.asarray(z[0, :, 0]), np.concatenate([np.arange(2 * c, 2 * c + 2) * 3 for c in chunks])
    )
    np.testing.assert_array_equal(np.asarray(jax_flash.from_zigzag(z, 4)), np.asarray(x))
    ids = jnp.arange(24).reshape(2, 12)
    np.testing.assert_array_equal(
        np.asarray(jax_flash.from_zigzag(jax_flash.to_zigzag(ids, 3), 3)), np.asarray(ids)
    )
    with pytest.raises(ValueError, match="multiple of 2 \\* num_shards = 8"):
        jax_flash.to_zigzag(jnp.zeros((1, 12, 2)), 4)
    with pytest.raises(TypeError, match="num_shards must be an int"):
        jax_flash.from_zigzag(x, 2.0)


def _call_in_shard_map(shard_len=8, kv_len=None, **kwargs):
    m = mesh((N,), ("sp",))
    q = jnp.zeros((1, N * shard_len, 2, 8), jnp.float32)
    k = jnp.zeros((1, N * (kv_len or shard_len), 2, 8), jnp.float32)
    kwargs.setdefault("axis_name", "sp")
    fn = jax.shard_map(
        lambda q, k: jax_flash.ring_attention(q, k, k, **kwargs),
        mesh=m, in_specs=(SEQ, SEQ), out_specs=SEQ,
    )  # fmt: skip
    return jax.eval_shape(fn, q, k)


def test_errors():
    with pytest.raises(ValueError, match="layout must be one of \\('contiguous', 'zigzag'\\)"):
        _call_in_shard_map(layout="ring")
    with pytest.raises(ValueError, match="layout='zigzag'.*must be even, got 7"):
        _call_in_shard_map(shard_len=7, layout="zigzag", causal=True)
    with pytest.raises(NotImplementedError, match="window is supported with layout='contiguous'"):
        _call_in_shard_map(layout="zigzag", window=(4, 0))
    with pytest.raises(ValueError, match="axis_name 'seq' is not a bound mesh axis"):
        _call_in_shard_map(axis_name="seq")
    with pytest.raises(ValueError, match="shard lengths 8 \\(q\\) and 4 \\(k, v\\)"):
        _call_in_shard_map(kv_len=4)
    with pytest.raises(ValueError, match="axis_name 'sp' is not a bound mesh axis"):
        x = jnp.zeros((1, 8, 2, 8))
        jax_flash.ring_attention(x, x, x, axis_name="sp")
    with pytest.raises(TypeError, match="causal must be a Python bool"):
        _call_in_shard_map(causal=1)


def test_ring_beside_data_parallelism(rng):
    # A shard_map manual over both mesh axes: batch over "data", the ring over "sp".
    m = mesh((2, 4), ("data", "sp"))
    q, k, v = make_qkv(rng, batch=4, seqlen_q=40, seqlen_k=40, heads_q=2, head_dim=16)
    spec = P("data", "sp")
    ring = jax.shard_map(
        lambda q, k, v: jax_flash.ring_attention(
            q, k, v, axis_name="sp", causal=True, layout="zigzag"
        ),
        mesh=m, in_specs=(spec,) * 3, out_specs=spec,
    )  # fmt: skip
    dout = normal(rng, q.shape, q.dtype)

    def vjp(attn):
        def f(q, k, v, dout):
            out, pullback = jax.vjp(attn, q, k, v)
            return out, pullback(dout)

        return f

    zig = [jax_flash.to_zigzag(x, 4) for x in (q, k, v, dout)]
    found = collectives(vjp(ring), *zig)
    assert {op for op, _ in found} == {"collective-permute"}, found
    out, grads = jax.jit(vjp(ring))(*zig)
    single = vjp(functools.partial(jax_flash.attention, causal=True))
    ref_out, ref_grads = jax.jit(single)(q, k, v, dout)
    for name, got, want in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), strict=True
    ):
        assert rel_l2(jax_flash.from_zigzag(got, 4), want) <= 1e-5, name


def test_deterministic_option_reaches_every_block(rng):
    """deterministic=True changes the order of the GPU kernels' dQ sums only: on these CPU
    devices, whose kernels are deterministic either way, the results are bitwise the same."""
    seq = N * 6
    q, k, v = make_qkv(
        rng, batch=1, seqlen_q=seq, seqlen_k=seq, heads_q=2, heads_kv=1, head_dim=16,
        dtype=jnp.float32,
    )  # fmt: skip
    dout = normal(rng, q.shape, jnp.float32)
    dlse = normal(rng, (1, 2, seq), jnp.float32)
    results = []
    for deterministic in (False, True):
        _, vjp = _ring_vjp("zigzag", True, None, False, deterministic)
        results.append(jax.jit(vjp)(q, k, v, None, dout, dlse))
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
