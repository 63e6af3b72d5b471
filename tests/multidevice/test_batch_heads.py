"""Batch and head sharding under jit: the kernel calls partition with no collective, forward and
backward, the results keep the inputs' sharding and equal the single-device results bit for bit
(each device runs the same kernel on whole (batch, head) rows). A sequence or head_dim sharding
is gathered with a one-time warning naming the mesh axis, and stays exact."""

import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_qkv, normal, rel_l2, segments_from_lengths
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from spmd import collectives, mesh, shardy_flag_available

import jax_flash
from jax_flash import sharding

PARTITIONERS = ["shardy", "gspmd"] if shardy_flag_available() else ["shardy"]


@contextlib.contextmanager
def partitioner(name):
    if name == "shardy" and not shardy_flag_available():
        yield
        return
    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", name == "shardy")
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)


def _vjp_fn(attn):
    def f(q, k, v, dout, dlse):
        (out, lse), pullback = jax.vjp(lambda q, k, v: attn(q, k, v), q, k, v)
        return out, lse, pullback((dout, dlse))

    return f


def _check(attn, q, k, v, spec, kv_spec=None, mesh_=None):
    """Forward and VJP of attn sharded by spec: no collective, outputs sharded like the inputs,
    results equal to the unsharded call. lse and the cotangents dout, dlse are sharded like the
    outputs."""
    kv_spec = spec if kv_spec is None else kv_spec

    def put(x, s):
        return jax.device_put(x, NamedSharding(mesh_, s))

    rng = np.random.default_rng(0)
    out_ref, lse_ref = jax.jit(attn)(q, k, v)
    dout = normal(rng, out_ref.shape, q.dtype)
    dlse = normal(rng, lse_ref.shape, lse_ref.dtype)
    if len(spec) >= 4:  # [..., S, H, D] -> lse [..., H, S]
        lse_spec = P(*spec[:-3], spec[-2], spec[-3])
    else:  # packed [T, H, D] -> lse [H, T]
        lse_spec = P(spec[1], spec[0])
    args = (put(q, spec), put(k, kv_spec), put(v, kv_spec))
    cot = (put(dout, spec), put(dlse, lse_spec))
    assert collectives(lambda q, k, v: attn(q, k, v), *args) == {}
    vjp = _vjp_fn(attn)
    assert collectives(vjp, *args, *cot) == {}
    out, lse, grads = jax.jit(vjp)(*args, *cot)
    ref = jax.jit(_vjp_fn(attn))(q, k, v, dout, dlse)
    for name, got, want, s in zip(
        ("out", "lse", "dq", "dk", "dv"),
        (out, lse, *grads),
        (ref[0], ref[1], *ref[2]),
        (spec, lse_spec, spec, kv_spec, kv_spec),
        strict=True,
    ):
        assert got.sharding.is_equivalent_to(NamedSharding(mesh_, s), got.ndim), name
        # The same kernel on the same rows; only XLA's fusion of the few jnp ops around it
        # (e.g. the backward's row term under vmap) may round differently.
        got, want = np.asarray(got), np.asarray(want)
        finite = np.isfinite(want)
        assert np.array_equal(finite, np.isfinite(got)), name
        assert rel_l2(np.where(finite, got, 0), np.where(finite, want, 0)) <= 1e-6, name


@pytest.mark.parametrize("name", PARTITIONERS)
def test_batch_and_heads_sharded_gqa(rng, name):
    m = mesh((4, 2), ("data", "model"))
    q, k, v = make_qkv(rng, batch=8, seqlen_q=40, seqlen_k=40, heads_q=8, heads_kv=2, head_dim=32)

    def attn(q, k, v):
        return jax_flash.attention(q, k, v, causal=True, return_lse=True)

    with partitioner(name):
        _check(attn, q, k, v, P("data", None, "model", None), mesh_=m)


@pytest.mark.parametrize("name", PARTITIONERS)
def test_decode_path_sharded(rng, name):
    # One and four query tokens over 300 keys run attention's forward on the decode kernel;
    # custom partitioning wraps it as it wraps the dense forward: no collective, exact.
    m = mesh((4, 2), ("data", "model"))
    for seqlen_q in (1, 4):
        q, k, v = make_qkv(
            rng, batch=4, seqlen_q=seqlen_q, seqlen_k=300, heads_q=8, heads_kv=2, head_dim=32
        )

        def attn(q, k, v):
            return jax_flash.attention(q, k, v, causal=True, window=(100, 0), return_lse=True)

        text = jax.jit(attn).lower(q, k, v).as_text()
        assert "jax_flash_decode_cpu" in text
        with partitioner(name):
            _check(attn, q, k, v, P("data", None, "model", None), mesh_=m)


@pytest.mark.parametrize("name", PARTITIONERS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_sharded(rng, name, paged):
    """attention_with_kvcache with q, the cache lengths (and block table) sharded over the batch
    and q and the cache over the heads: no collective, the outputs keep that sharding, and they
    equal the unsharded call bit for bit. A paged pool is split over the heads only (every batch
    shard holds the whole pool of its heads)."""
    m = mesh((4, 2), ("data", "model"))
    batch, capacity, block = 4, 96, 16
    q = normal(rng, (batch, 2, 8, 16), jnp.float32)
    k, v = (normal(rng, (batch, capacity, 2, 16), jnp.float32) for _ in range(2))
    lens = jnp.asarray([0, 1, 57, 96], jnp.int32)
    sinks = normal(rng, (8,), jnp.float32)
    table = None
    if paged:
        blocks = capacity // block
        order = np.random.default_rng(1).permutation(batch * blocks).astype(np.int32)
        table = jnp.asarray(order.reshape(batch, blocks))
        pages = np.empty((batch * blocks, block, 2, 16), np.float32)
        flat = np.asarray(k).reshape(batch * blocks, block, 2, 16)
        pages[order.reshape(-1)] = flat
        k_pages = jnp.asarray(pages)
        pages[order.reshape(-1)] = np.asarray(v).reshape(batch * blocks, block, 2, 16)
        k, v = k_pages, jnp.asarray(pages)

    def call(q, k, v, lens, table):
        return jax_flash.attention_with_kvcache(
            q, k, v, lens, block_table=table, window=(40, None), sinks=sinks, return_lse=True
        )

    out_ref, lse_ref = jax.jit(call)(q, k, v, lens, table)

    def put(x, spec):
        return None if x is None else jax.device_put(x, NamedSharding(m, spec))

    cache_spec = P(None, None, "model", None) if paged else P("data", None, "model", None)
    args = (
        put(q, P("data", None, "model", None)),
        put(k, cache_spec),
        put(v, cache_spec),
        put(lens, P("data")),
        put(table, P("data", None)),
    )
    with partitioner(name):
        assert not collectives(call, *args), collectives(call, *args)
        out, lse = jax.jit(call)(*args)
    assert out.sharding.is_equivalent_to(NamedSharding(m, P("data", None, "model", None)), 4)
    assert lse.sharding.is_equivalent_to(NamedSharding(m, P("data", "model", None)), 3)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_ref))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_ref))


@pytest.mark.parametrize("name", PARTITIONERS)
def test_segment_ids_window_bfloat16(rng, name):
    m = mesh((2, 4), ("data", "model"))
    q, k, v = make_qkv(
        rng, batch=4, seqlen_q=33, seqlen_k=33, heads_q=4, head_dim=16, dtype=jnp.bfloat16
    )
    ids = jax.device_put(
        segments_from_lengths(*[[10, 23], [33], [1, 31, 1], [16, 17]]),
        NamedSharding(m, P("data", None)),
    )

    def attn(q, k, v):
        return jax_flash.attention(
            q, k, v, causal=True, window=(7, None), segment_ids=ids, return_lse=True
        )

    with partitioner(name):
        _check(attn, q, k, v, P("data", None, "model", None), mesh_=m)


def test_varlen_heads_sharded(rng):
    m = mesh((8,), ("model",))
    lens = np.array([5, 0, 17, 9])
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    q = normal(rng, (31, 8, 16), jnp.float32)
    k, v = (normal(rng, (31, 8, 16), jnp.float32) for _ in range(2))

    def attn(q, k, v):
        return jax_flash.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)

    _check(attn, q, k, v, P(None, "model", None), mesh_=m)


def test_vmap_adds_a_batch_axis(rng):
    m = mesh((4, 2), ("data", "model"))
    q, k, v = make_qkv(rng, batch=4, seqlen_q=24, seqlen_k=24, heads_q=2, head_dim=16)
    stack = lambda x: jnp.stack([x, 2 * x])  # noqa: E731
    attn = jax.vmap(lambda q, k, v: jax_flash.attention(q, k, v, causal=True, return_lse=True))
    _check(attn, stack(q), stack(k), stack(v), P(None, "data", None, "model", None), mesh_=m)


@pytest.mark.parametrize(
    "spec, axis, what",
    [
        (P(None, "seq", None, None), "'seq'", "sequence"),
        (P(None, None, None, "seq"), "'seq'", "head_dim"),
    ],
)
def test_sequence_or_head_dim_sharding_is_gathered_with_one_warning(rng, spec, axis, what):
    m = mesh((8,), ("seq",))
    q, k, v = make_qkv(rng, batch=2, seqlen_q=32, seqlen_k=32, heads_q=2, head_dim=16)
    args = [jax.device_put(x, NamedSharding(m, spec)) for x in (q, k, v)]
    sharding._WARNED.clear()

    def attn(q, k, v):
        return jax_flash.attention(q, k, v, causal=True)

    with pytest.warns(UserWarning, match=f"{what} axis is sharded over mesh axis {axis}"):
        out = jax.jit(attn)(*args)
    # Gathered, computed, and returned with the sharding that was asked for.
    assert out.sharding.is_equivalent_to(NamedSharding(m, spec), 4)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(attn)(q, k, v)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(lambda q, k, v: attn(q, k, v) * 2)(*args)  # a new compilation, no new warning


def test_heads_sharding_that_does_not_divide_heads_kv_is_gathered(rng):
    m = mesh((2, 4), ("data", "model"))
    q, k, v = make_qkv(rng, batch=2, seqlen_q=16, seqlen_k=16, heads_q=8, heads_kv=2, head_dim=16)
    sharding._WARNED.clear()
    qs = jax.device_put(q, NamedSharding(m, P("data", None, "model", None)))
    kvs = [jax.device_put(x, NamedSharding(m, P("data"))) for x in (k, v)]
    with pytest.warns(UserWarning, match=r"sharded 4 ways over mesh axis 'model'.*heads_kv=2"):
        out = jax.jit(jax_flash.attention)(qs, *kvs)
    want = jax.jit(jax_flash.attention)(q, k, v)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_sinks_gradient_sums_over_batch_shards(rng):
    # Sinks are per head and shared by the batch: their gradient is the one collective.
    m = mesh((4, 2), ("data", "model"))
    q, k, v = make_qkv(rng, batch=4, seqlen_q=16, seqlen_k=16, heads_q=4, heads_kv=2, head_dim=16)
    sinks = jnp.asarray(rng.standard_normal(4), jnp.float32)
    dout = normal(rng, q.shape, q.dtype)

    def f(q, k, v, sinks):
        out, pullback = jax.vjp(
            lambda q, k, v, s: jax_flash.attention(q, k, v, sinks=s), q, k, v, sinks
        )
        return out, pullback(dout)

    spec = NamedSharding(m, P("data", None, "model", None))
    args = [jax.device_put(x, spec) for x in (q, k, v)]
    found = collectives(f, *args, sinks)
    assert set(found) == {("all-reduce", "f32[2]{0}")}, found
    got, want = jax.jit(f)(*args, sinks), jax.jit(f)(q, k, v, sinks)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert rel_l2(a, b) <= 1e-6


def test_attention_inside_shard_map_with_gradients(rng):
    # Inside shard_map the kernel's results are typed as varying over the mesh axes of their
    # inputs, so the custom VJP's cotangents match the sharded inputs.
    m = mesh((8,), ("data",))
    q, k, v = make_qkv(rng, batch=8, seqlen_q=16, seqlen_k=16, heads_q=2, head_dim=16)
    batch = P("data")
    local = jax.shard_map(
        lambda q, k, v: jax_flash.attention(q, k, v, causal=True),
        mesh=m, in_specs=(batch,) * 3, out_specs=batch,
    )  # fmt: skip

    def loss(attn):
        return lambda q, k, v: jnp.sum(attn(q, k, v) ** 2)

    got = jax.jit(jax.grad(loss(local), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(
        jax.grad(loss(functools.partial(jax_flash.attention, causal=True)), argnums=(0, 1, 2))
    )(q, k, v)
    for a, b in zip(got, want, strict=True):
        assert rel_l2(a, b) <= 1e-6


def test_shard_map_function_exports(rng):
    # jax.export accepts a multi-device function whose attention runs inside shard_map (each
    # device's call is a plain custom call); XLA-partitioned calls carry custom_partitioning's
    # host callback, which jax.export refuses (README, "Exporting with jax.export").
    m = mesh((8,), ("data",))
    q, k, v = make_qkv(rng, batch=8, seqlen_q=16, seqlen_k=16, heads_q=2, head_dim=16)
    batch = P("data")
    step = jax.jit(
        jax.shard_map(
            lambda q, k, v: jax_flash.attention(q, k, v, causal=True),
            mesh=m, in_specs=(batch,) * 3, out_specs=batch,
        )
    )  # fmt: skip
    args = [jax.device_put(x, NamedSharding(m, batch)) for x in (q, k, v)]
    exported = export.export(step, disabled_checks=jax_flash.disabled_export_checks())(*args)
    assert exported.nr_devices == 8
    got = exported.call(*args)
    assert np.array_equal(np.asarray(got), np.asarray(step(*args)))
