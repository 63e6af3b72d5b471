"""JAX transformations: jit, grad, value_and_grad, vmap over batch and heads, vmap with only q
batched, vmap of grad, grad of vmap, jax.checkpoint; and vmap must stay one kernel launch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ALL_DTYPES,
    assert_close,
    custom_call_targets,
    dtype_id,
    f64,
    flash_vjp,
    make_qkv,
    normal,
    reference_forward,
)

import jax_flash
from jax_flash.reference import attention_reference

# Batched and unbatched launches do the same arithmetic per row; allow last-bit differences only.
SAME = {"rtol": 1e-6, "atol": 1e-6}


def stacked_qkv(rng, n, *, dtype=jnp.float32, **shape):
    """n independent [B, S, H, D] problems stacked on a new leading axis."""
    problems = [make_qkv(rng, dtype=dtype, **shape) for _ in range(n)]
    return tuple(jnp.stack(xs) for xs in zip(*problems, strict=True))


def weighted_loss(fn, w, **kw):
    """A scalar loss whose gradient feeds a random cotangent w into the attention output."""

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, **kw) * w)

    return loss


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grad_and_value_and_grad(rng, causal):
    q, k, v = make_qkv(rng, seqlen_q=37, seqlen_k=29, heads_q=4, heads_kv=2, dtype=jnp.float64)
    w = normal(rng, q.shape, q.dtype)
    loss = weighted_loss(jax_flash.attention, w, causal=causal)
    ref_loss = weighted_loss(attention_reference, w, causal=causal)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    value, grads_vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(value, ref_value, rtol=1e-10)
    for name, g, g_vg, ref in zip("qkv", grads, grads_vg, ref_grads, strict=True):
        assert_close(f"d{name}", g, ref, dtype=jnp.float64, kind="grad")
        assert_close(f"d{name} (value_and_grad)", g_vg, ref, dtype=jnp.float64, kind="grad")


def test_grad_with_respect_to_one_argument(rng):
    q, k, v = make_qkv(rng, seqlen_q=11, seqlen_k=13, dtype=jnp.float64)
    w = normal(rng, q.shape, q.dtype)
    loss = weighted_loss(jax_flash.attention, w)
    ref_loss = weighted_loss(attention_reference, w)
    ref_grads = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2)))(q, k, v)
    for argnum, ref in enumerate(ref_grads):
        g = jax.jit(jax.grad(loss, argnums=argnum))(q, k, v)
        assert_close(f"grad argnum {argnum}", g, ref, dtype=jnp.float64, kind="grad")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_vmap_batch_axis(rng, causal, dtype):
    shape = {"batch": 2, "seqlen_q": 23, "seqlen_k": 41, "heads_q": 4, "heads_kv": 2}
    q, k, v = stacked_qkv(rng, 3, dtype=dtype, **shape)
    f = functools.partial(jax_flash.attention, causal=causal, return_lse=True)
    out, lse = jax.jit(jax.vmap(f))(q, k, v)
    assert out.shape == q.shape and lse.shape == (3, 2, 4, 23)
    for i in range(3):
        out_i, lse_i = f(q[i], k[i], v[i])
        np.testing.assert_allclose(
            np.asarray(out[i], np.float32), np.asarray(out_i, np.float32), **SAME
        )
        np.testing.assert_allclose(lse[i], lse_i, **SAME)


def test_vmap_matches_reference(rng):
    q, k, v = stacked_qkv(rng, 2, dtype=jnp.float64, batch=1, seqlen_q=17, seqlen_k=9)
    out = jax.vmap(functools.partial(jax_flash.attention, causal=True))(q, k, v)
    ref = jax.jit(jax.vmap(functools.partial(attention_reference, causal=True)))(q, k, v)
    assert_close("out", out, ref, dtype=jnp.float64, kind="fwd")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_vmap_heads_axis(rng, causal):
    q, k, v = make_qkv(rng, seqlen_q=19, seqlen_k=31, heads_q=5, dtype=jnp.float32)

    def one_head(q, k, v):
        # [B, S, D] -> [B, S, 1, D] -> attention -> [B, S, D]
        out = jax_flash.attention(q[:, :, None], k[:, :, None], v[:, :, None], causal=causal)
        return out[:, :, 0]

    out = jax.jit(jax.vmap(one_head, in_axes=2, out_axes=2))(q, k, v)
    full = jax_flash.attention(q, k, v, causal=causal)
    np.testing.assert_allclose(out, full, **SAME)


def test_vmap_over_kv_groups(rng):
    # GQA as vmap over the KV heads: each group of 4 query heads against one KV head.
    q, k, v = make_qkv(rng, seqlen_q=15, seqlen_k=26, heads_q=8, heads_kv=2, dtype=jnp.float32)
    b, s, _, d = q.shape
    q_groups = q.reshape(b, s, 2, 4, d)

    def one_group(q, k, v):
        # q [B, S, 4, D] against k, v [B, S, D] as a single KV head.
        return jax_flash.attention(q, k[:, :, None], v[:, :, None])

    out = jax.vmap(one_group, in_axes=(2, 2, 2), out_axes=2)(q_groups, k, v)
    np.testing.assert_allclose(out.reshape(q.shape), jax_flash.attention(q, k, v), **SAME)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_vmap_only_q_batched(rng, causal):
    shape = {"batch": 2, "seqlen_q": 13, "seqlen_k": 27, "heads_q": 4, "heads_kv": 2}
    q, k, v = make_qkv(rng, **shape)
    qs = jnp.stack([q, normal(rng, q.shape, q.dtype), normal(rng, q.shape, q.dtype)])
    f = functools.partial(jax_flash.attention, causal=causal)
    out = jax.jit(jax.vmap(f, in_axes=(0, None, None)))(qs, k, v)
    for i in range(3):
        np.testing.assert_allclose(out[i], f(qs[i], k, v), **SAME)


def test_vmap_only_kv_batched(rng):
    q, k, v = make_qkv(rng, seqlen_q=13, seqlen_k=27)
    ks = jnp.stack([k, normal(rng, k.shape, k.dtype)])
    vs = jnp.stack([v, normal(rng, v.shape, v.dtype)])
    out = jax.vmap(jax_flash.attention, in_axes=(None, 0, 0))(q, ks, vs)
    for i in range(2):
        np.testing.assert_allclose(out[i], jax_flash.attention(q, ks[i], vs[i]), **SAME)


def test_nested_vmap(rng):
    q, k, v = stacked_qkv(rng, 6, batch=1, seqlen_q=9, seqlen_k=14, heads_q=2)
    q, k, v = (x.reshape(2, 3, *x.shape[1:]) for x in (q, k, v))
    out = jax.jit(jax.vmap(jax.vmap(jax_flash.attention)))(q, k, v)
    for i in range(2):
        for j in range(3):
            np.testing.assert_allclose(
                out[i, j], jax_flash.attention(q[i, j], k[i, j], v[i, j]), **SAME
            )


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_vmap_of_grad(rng, causal):
    q, k, v = stacked_qkv(
        rng, 3, dtype=jnp.float64, batch=1, seqlen_q=21, seqlen_k=17, heads_q=4, heads_kv=1
    )
    w = normal(rng, q.shape[1:], q.dtype)
    grad = jax.grad(weighted_loss(jax_flash.attention, w, causal=causal), argnums=(0, 1, 2))
    ref_grad = jax.jit(
        jax.grad(weighted_loss(attention_reference, w, causal=causal), argnums=(0, 1, 2))
    )
    grads = jax.jit(jax.vmap(grad))(q, k, v)
    for i in range(3):
        ref = ref_grad(q[i], k[i], v[i])
        for name, g, r in zip("qkv", grads, ref, strict=True):
            assert_close(f"d{name}[{i}]", g[i], r, dtype=jnp.float64, kind="grad")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_grad_of_vmap(rng, causal):
    q, k, v = stacked_qkv(
        rng, 3, dtype=jnp.float64, batch=2, seqlen_q=12, seqlen_k=19, heads_q=2, heads_kv=1
    )
    w = normal(rng, q.shape, q.dtype)
    batched = jax.vmap(functools.partial(jax_flash.attention, causal=causal))
    ref_batched = jax.vmap(functools.partial(attention_reference, causal=causal))
    grads = jax.jit(jax.grad(weighted_loss(batched, w), argnums=(0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.grad(weighted_loss(ref_batched, w), argnums=(0, 1, 2)))(q, k, v)
    for name, g, r in zip("qkv", grads, ref, strict=True):
        assert_close(f"d{name}", g, r, dtype=jnp.float64, kind="grad")


def test_grad_of_vmap_only_q_batched(rng):
    # k and v are shared by the vmapped problems, so their gradients sum over the vmapped axis.
    q, k, v = make_qkv(rng, batch=1, seqlen_q=10, seqlen_k=16, heads_q=2, dtype=jnp.float64)
    qs = jnp.stack([q, normal(rng, q.shape, q.dtype)])
    w = normal(rng, qs.shape, qs.dtype)

    def loss(fn):
        return lambda qs, k, v: jnp.sum(jax.vmap(fn, in_axes=(0, None, None))(qs, k, v) * w)

    grads = jax.jit(jax.grad(loss(jax_flash.attention), argnums=(0, 1, 2)))(qs, k, v)
    ref = jax.jit(jax.grad(loss(attention_reference), argnums=(0, 1, 2)))(qs, k, v)
    for name, g, r in zip("qkv", grads, ref, strict=True):
        assert_close(f"d{name}", g, r, dtype=jnp.float64, kind="grad")


@pytest.mark.parametrize(
    "policy",
    [None, jax.checkpoint_policies.nothing_saveable, jax.checkpoint_policies.everything_saveable],
    ids=["default", "nothing_saveable", "everything_saveable"],
)
def test_checkpoint(rng, policy):
    q, k, v = make_qkv(rng, seqlen_q=18, seqlen_k=22, heads_q=4, heads_kv=2, dtype=jnp.float64)
    w = normal(rng, q.shape, q.dtype)

    def block(attention_fn):
        def loss(q, k, v):
            # Something around the attention so that rematerialisation has work to redo.
            out = attention_fn(jnp.tanh(q), k, v, causal=True)
            return jnp.sum(jnp.sin(out) * w)

        return loss

    checkpointed = jax.checkpoint(block(jax_flash.attention), policy=policy)
    grads = jax.jit(jax.grad(checkpointed, argnums=(0, 1, 2)))(q, k, v)
    ref = jax.jit(jax.grad(block(attention_reference), argnums=(0, 1, 2)))(q, k, v)
    for name, g, r in zip("qkv", grads, ref, strict=True):
        assert_close(f"d{name}", g, r, dtype=jnp.float64, kind="grad")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_id)
def test_jit_with_static_flags(rng, dtype):
    # causal / softmax_scale / return_lse as static arguments of an outer jit.
    q, k, v = make_qkv(rng, seqlen_q=16, seqlen_k=24, dtype=dtype)
    f = jax.jit(jax_flash.attention, static_argnames=("causal", "softmax_scale", "return_lse"))
    out, lse = f(q, k, v, causal=True, softmax_scale=0.2, return_lse=True)
    eager_out, eager_lse = jax_flash.attention(
        q, k, v, causal=True, softmax_scale=0.2, return_lse=True
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(eager_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(eager_lse))
    ref_out = reference_forward(*f64(q, k, v), causal=True, softmax_scale=0.2)[0]
    assert not np.allclose(ref_out, reference_forward(*f64(q, k, v), causal=False)[0])


# ----------------------------------------------------------------------------------------------
# vmap is one launch: the handlers fold every leading axis into the batch.


def _hlo(fn, *args):
    lowered = jax.jit(fn).lower(*args)
    return lowered.as_text(), lowered.compile().as_text()


def _assert_single_launches(fn, args, expected):
    jaxpr = str(jax.make_jaxpr(fn)(*args))
    assert "while[" not in jaxpr and "scan[" not in jaxpr, "vmap became a loop"
    stablehlo, compiled = _hlo(fn, *args)
    for text in (stablehlo, compiled):
        targets = custom_call_targets(text)
        assert sorted({t.rsplit("_", 1)[0] for t in targets}) == sorted(expected), targets
        for name in expected:
            assert sum(t.startswith(name) for t in targets) == 1, targets
    assert "stablehlo.while" not in stablehlo
    assert " while(" not in compiled and "while_loop" not in compiled.lower()


def test_vmap_is_one_forward_launch(rng):
    q, k, v = stacked_qkv(rng, 4, batch=2, seqlen_q=9, seqlen_k=9, heads_q=2)
    _assert_single_launches(jax.vmap(jax_flash.attention), (q, k, v), ["jax_flash_fwd"])


def test_vmap_only_q_is_one_forward_launch(rng):
    q, k, v = make_qkv(rng, seqlen_q=9, seqlen_k=9)
    qs = jnp.stack([q] * 3)
    fn = jax.vmap(jax_flash.attention, in_axes=(0, None, None))
    _assert_single_launches(fn, (qs, k, v), ["jax_flash_fwd"])


def test_vmap_heads_is_one_forward_launch(rng):
    q, k, v = make_qkv(rng, seqlen_q=9, seqlen_k=9, heads_q=3)

    def one_head(q, k, v):
        return jax_flash.attention(q[:, :, None], k[:, :, None], v[:, :, None])[:, :, 0]

    _assert_single_launches(jax.vmap(one_head, in_axes=2, out_axes=2), (q, k, v), ["jax_flash_fwd"])


def test_vmap_of_vjp_is_one_launch_each_way(rng):
    q, k, v = stacked_qkv(rng, 3, batch=1, seqlen_q=9, seqlen_k=11, heads_q=2)
    dout = normal(rng, q.shape, q.dtype)

    def vjp(q, k, v, dout):
        out, pullback = jax.vjp(jax_flash.attention, q, k, v)
        return pullback(dout)

    _assert_single_launches(jax.vmap(vjp), (q, k, v, dout), ["jax_flash_fwd", "jax_flash_bwd"])


def test_zero_lse_cotangent_equals_no_lse(rng):
    # return_lse=False hands the custom VJP a zero lse cotangent; an explicit zero must agree.
    q, k, v = make_qkv(rng, seqlen_q=8, seqlen_k=12, dtype=jnp.float64)
    dout = normal(rng, q.shape, q.dtype)
    zero = jnp.zeros((2, 2, 8), jnp.float64)
    a = flash_vjp(q, k, v, dout, causal=True)[2]
    b = flash_vjp(q, k, v, dout, zero, causal=True)[2]
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-12)
