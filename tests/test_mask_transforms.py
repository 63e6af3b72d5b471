"""JAX transformations with the new arguments: window and softcap as static arguments of an outer
jit, segment ids and sinks as traced ones; grad and value_and_grad with respect to the sinks;
vmap over the batch axis (segment ids and sinks batched or shared) and over the heads axis (sinks
per head); vmap of grad, grad of vmap, jax.checkpoint; and attention_varlen under jit, grad and
vmap. vmap of the dense op stays one kernel launch with every feature on."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    BACKEND,
    ON_GPU,
    assert_close,
    custom_call_targets,
    dtype_id,
    f64,
    make_packed,
    make_qkv,
    make_sinks,
    normal,
    reference_feature_vjp,
    segments_from_lengths,
)

import jax_flash
from jax_flash.reference import attention_reference, attention_varlen_reference

# Batched and unbatched launches do the same arithmetic per row; allow last-bit differences only.
SAME = {"rtol": 1e-6, "atol": 1e-6}
MASKS = {"window": (12, 3), "softcap": 4.0, "causal": True}
# As in conftest: LLVM's optimisation level changes how fast the references run, not what they
# compute, and their compile time dominates.
reference_jit = functools.partial(
    jax.jit, compiler_options={"xla_backend_optimization_level": 0} if BACKEND == "cpu" else None
)


def stacked(rng, n, dtype=jnp.float64, seqlen_q=40, heads_q=4, heads_kv=2):
    """n problems [n, 2, S, H, 32] over 40 keys, with segment ids [n, 2, 40] and sinks [n, Hq]."""
    shape = {"seqlen_q": seqlen_q, "seqlen_k": 40, "heads_q": heads_q, "heads_kv": heads_kv}
    problems = [make_qkv(rng, head_dim=32, dtype=dtype, **shape) for _ in range(n)]
    q, k, v = (jnp.stack(xs) for xs in zip(*problems, strict=True))
    ids = jnp.stack([segments_from_lengths([7 + i, 33 - i], [40]) for i in range(n)])
    sinks = jnp.stack([make_sinks(rng, heads_q, dtype, shift=0.0) for _ in range(n)])
    return q, k, v, ids, sinks


def loss_fn(fn, w, w_lse, **kw):
    """A scalar whose gradient feeds random cotangents into both O and lse."""

    def loss(q, k, v, segment_ids, sinks):
        out, lse = fn(q, k, v, segment_ids=segment_ids, sinks=sinks, return_lse=True, **kw)
        return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) * w_lse)

    return loss


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
def test_jit_with_static_mask_options(rng, dtype):
    q, k, v = make_qkv(rng, seqlen_q=37, seqlen_k=53, heads_q=4, heads_kv=2, dtype=dtype)
    ids = segments_from_lengths([10, 27], [37]), segments_from_lengths([20, 33], [53])
    sinks = make_sinks(rng, 4, dtype)
    f = jax.jit(jax_flash.attention, static_argnames=("causal", "window", "softcap", "return_lse"))
    jitted = f(q, k, v, segment_ids=ids, sinks=sinks, return_lse=True, **MASKS)
    eager = jax_flash.attention(q, k, v, segment_ids=ids, sinks=sinks, return_lse=True, **MASKS)
    for a, b in zip(jitted, eager, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ref = reference_feature_vjp(*f64(q, k, v), segment_ids=ids, sinks=sinks, grads=False, **MASKS)
    lowp = reference_feature_vjp(q, k, v, segment_ids=ids, sinks=sinks, grads=False, **MASKS)
    assert_close("out", jitted[0], ref[0], dtype=dtype, kind="fwd", lowp=lowp[0])


def test_value_and_grad_with_respect_to_sinks(rng):
    q, k, v, ids, sinks = (x[0] for x in stacked(rng, 1))
    w = normal(rng, q.shape, q.dtype)
    w_lse = normal(rng, (2, 4, 40), q.dtype)
    argnums = (0, 1, 2, 4)
    loss = jax.value_and_grad(loss_fn(jax_flash.attention, w, w_lse, **MASKS), argnums=argnums)
    ref_loss = jax.value_and_grad(loss_fn(attention_reference, w, w_lse, **MASKS), argnums=argnums)
    value, grads = jax.jit(loss)(q, k, v, ids, sinks)
    ref_value, ref_grads = reference_jit(ref_loss)(q, k, v, ids, sinks)
    np.testing.assert_allclose(value, ref_value, rtol=1e-10)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, strict=True):
        assert_close(name, g, r, dtype=jnp.float64, kind="grad")
    # The sinks alone.
    dsinks = jax.jit(jax.grad(loss_fn(jax_flash.attention, w, w_lse, **MASKS), argnums=4))(
        q, k, v, ids, sinks
    )
    assert_close("dsinks alone", dsinks, ref_grads[3], dtype=jnp.float64, kind="grad")


@pytest.mark.parametrize("shared", [False, True], ids=["batched", "shared"])
def test_vmap_batch_axis(rng, shared):
    # Segment ids and sinks vmapped with the inputs, or shared by every vmapped problem.
    q, k, v, ids, sinks = stacked(rng, 3)
    axes = (0, 0, 0, None, None) if shared else (0, 0, 0, 0, 0)
    if shared:
        ids, sinks = ids[0], sinks[0]

    def f(fn):
        return lambda q, k, v, ids, sinks: fn(
            q, k, v, segment_ids=ids, sinks=sinks, return_lse=True, **MASKS
        )

    out, lse = jax.jit(jax.vmap(f(jax_flash.attention), in_axes=axes))(q, k, v, ids, sinks)
    ref_out, ref_lse = reference_jit(jax.vmap(f(attention_reference), in_axes=axes))(
        q, k, v, ids, sinks
    )
    assert out.shape == q.shape and lse.shape == (3, 2, 4, 40)
    assert_close("out", out, ref_out, dtype=jnp.float64, kind="fwd")
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-10)
    one = jax.jit(f(jax_flash.attention))
    for i in range(3):
        one_ids = ids if shared else ids[i]
        one_sinks = sinks if shared else sinks[i]
        out_i, lse_i = one(q[i], k[i], v[i], one_ids, one_sinks)
        np.testing.assert_allclose(out[i], out_i, **SAME)
        np.testing.assert_allclose(lse[i], lse_i, **SAME)


def test_vmap_heads_axis_with_sinks_per_head(rng):
    q, k, v, ids, sinks = (x[0] for x in stacked(rng, 1, heads_q=3, heads_kv=3))

    def one_head(q, k, v, sink):
        # [B, S, D] -> [B, S, 1, D] -> attention -> [B, S, D]; the head's sink as a [1] array.
        out = jax_flash.attention(
            q[:, :, None], k[:, :, None], v[:, :, None], segment_ids=ids, sinks=sink[None],
            **MASKS,
        )  # fmt: skip
        return out[:, :, 0]

    out = jax.jit(jax.vmap(one_head, in_axes=(2, 2, 2, 0), out_axes=2))(q, k, v, sinks)
    full = jax.jit(functools.partial(jax_flash.attention, **MASKS))(
        q, k, v, segment_ids=ids, sinks=sinks
    )
    np.testing.assert_allclose(out, full, **SAME)
    ref = reference_feature_vjp(q, k, v, segment_ids=ids, sinks=sinks, grads=False, **MASKS)
    assert_close("out", out, ref[0], dtype=jnp.float64, kind="fwd")


def test_vmap_of_grad(rng):
    q, k, v, ids, sinks = stacked(rng, 3, seqlen_q=30)
    ids = (ids[:, :, :30], ids)
    w = normal(rng, q.shape[1:], q.dtype)
    w_lse = normal(rng, (2, 4, 30), q.dtype)
    argnums = (0, 1, 2, 4)
    grad = jax.grad(loss_fn(jax_flash.attention, w, w_lse, **MASKS), argnums=argnums)
    ref_grad = reference_jit(
        jax.grad(loss_fn(attention_reference, w, w_lse, **MASKS), argnums=argnums)
    )
    grads = jax.jit(jax.vmap(grad))(q, k, v, ids, sinks)
    for i in range(3):
        ref = ref_grad(q[i], k[i], v[i], (ids[0][i], ids[1][i]), sinks[i])
        for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref, strict=True):
            assert_close(f"{name}[{i}]", g[i], r, dtype=jnp.float64, kind="grad")


def test_grad_of_vmap_with_shared_sinks(rng):
    # Sinks shared by the vmapped problems: d(sinks) sums over them.
    q, k, v, ids, sinks = stacked(rng, 3)
    sinks = sinks[0]
    w = normal(rng, q.shape, q.dtype)

    def loss(fn):
        batched = jax.vmap(
            lambda q, k, v, ids, sinks: fn(q, k, v, segment_ids=ids, sinks=sinks, **MASKS),
            in_axes=(0, 0, 0, 0, None),
        )
        return lambda *args: jnp.sum(batched(*args) * w)

    argnums = (0, 1, 2, 4)
    grads = jax.jit(jax.grad(loss(jax_flash.attention), argnums=argnums))(q, k, v, ids, sinks)
    ref = reference_jit(jax.grad(loss(attention_reference), argnums=argnums))(q, k, v, ids, sinks)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref, strict=True):
        assert_close(name, g, r, dtype=jnp.float64, kind="grad")


def test_checkpoint(rng):
    q, k, v, ids, sinks = (x[0] for x in stacked(rng, 1))
    w = normal(rng, q.shape, q.dtype)

    def block(fn):
        def loss(q, k, v, sinks):
            out = fn(jnp.tanh(q), k, v, segment_ids=ids, sinks=sinks * 2, **MASKS)
            return jnp.sum(jnp.sin(out) * w)

        return loss

    checkpointed = jax.checkpoint(block(jax_flash.attention))
    grads = jax.jit(jax.grad(checkpointed, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    ref = reference_jit(jax.grad(block(attention_reference), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref, strict=True):
        assert_close(name, g, r, dtype=jnp.float64, kind="grad")


def _assert_single_launches(fn, args, expected):
    stablehlo = jax.jit(fn).lower(*args).as_text()
    targets = custom_call_targets(stablehlo)
    # On the GPU each direction summarises the segment ids with one launch of its own.
    summaries = [t for t in targets if t.startswith("jax_flash_segments")]
    assert len(summaries) == (len(expected) if ON_GPU else 0), targets
    targets = [t for t in targets if t not in summaries]
    for name in expected:
        assert sum(t.startswith(name) for t in targets) == 1, targets
    assert len(targets) == len(expected), targets
    assert "stablehlo.while" not in stablehlo


def test_vmap_with_every_feature_is_one_launch_each_way(rng):
    # The handlers fold vmapped axes into the batch, segment ids and sinks included.
    q, k, v, ids, sinks = stacked(rng, 3, dtype=jnp.float32)
    dout = normal(rng, q.shape, q.dtype)

    def vjp(q, k, v, ids, sinks, dout):
        def f(q, k, v, sinks):
            return jax_flash.attention(q, k, v, segment_ids=ids, sinks=sinks, **MASKS)

        _, pullback = jax.vjp(f, q, k, v, sinks)
        return pullback(dout)

    args = (q, k, v, ids, sinks, dout)
    _assert_single_launches(jax.vmap(vjp), args, ["jax_flash_fwd", "jax_flash_bwd"])
    _assert_single_launches(
        jax.vmap(vjp, in_axes=(0, 0, 0, None, None, 0)),
        (q, k, v, ids[0], sinks[0], dout),
        ["jax_flash_fwd", "jax_flash_bwd"],
    )


# ----------------------------------------------------------------------------------------------
# attention_varlen.


def test_varlen_jit_and_grad(rng):
    lens_q, lens_k = [3, 0, 40, 17], [9, 5, 40, 1]
    q, k, v, cu = make_packed(rng, lens_q, lens_k, pad_q=2, pad_k=1, heads_q=4, heads_kv=2,
                              head_dim=32, dtype=jnp.float64)  # fmt: skip
    sinks = make_sinks(rng, 4, jnp.float64, shift=0.0)
    w = normal(rng, q.shape, q.dtype)
    w_lse = normal(rng, (4, q.shape[0]), q.dtype)

    def loss(fn):
        def f(q, k, v, sinks, cu_q, cu_k):
            out, lse = fn(q, k, v, cu_q, cu_k, sinks=sinks, return_lse=True, **MASKS)
            return jnp.sum(out * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) * w_lse)

        return f

    argnums = (0, 1, 2, 3)
    value, grads = jax.jit(jax.value_and_grad(loss(jax_flash.attention_varlen), argnums))(
        q, k, v, sinks, *cu
    )
    ref_value, ref_grads = reference_jit(
        jax.value_and_grad(loss(attention_varlen_reference), argnums)
    )(q, k, v, sinks, *cu)
    np.testing.assert_allclose(value, ref_value, rtol=1e-10)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, strict=True):
        assert_close(name, g, r, dtype=jnp.float64, kind="grad")
    eager = jax.grad(loss(jax_flash.attention_varlen), argnums)(q, k, v, sinks, *cu)
    for g, e in zip(grads, eager, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("cu_batched", [False, True], ids=["shared_cu", "batched_cu"])
def test_varlen_vmap(rng, cu_batched):
    # vmap runs one packed call per element; each must be the unbatched call's result.
    problems = [
        make_packed(rng, lens, lens, pad_q=1, heads_q=2, head_dim=32, dtype=jnp.float32)
        for lens in ([5, 20, 0, 14], [30, 1, 4, 4], [0, 0, 39, 0])
    ]
    q, k, v = (jnp.stack(xs) for xs in zip(*(p[:3] for p in problems), strict=True))
    cus = [p[3] for p in problems]
    sinks = make_sinks(rng, 2, jnp.float32)
    f = functools.partial(jax_flash.attention_varlen, sinks=sinks, return_lse=True, **MASKS)
    if cu_batched:
        cu_q = jnp.stack([c[0] for c in cus])
        cu_k = jnp.stack([c[1] for c in cus])
        out, lse = jax.jit(jax.vmap(f))(q, k, v, cu_q, cu_k)
    else:
        cu_q, cu_k = cus[0]
        out, lse = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, None, None)))(q, k, v, cu_q, cu_k)
    one = jax.jit(f)
    for i in range(3):
        cu_i = cus[i] if cu_batched else cus[0]
        out_i, lse_i = one(q[i], k[i], v[i], *cu_i)
        np.testing.assert_allclose(out[i], out_i, **SAME)
        np.testing.assert_allclose(lse[i], lse_i, **SAME)
        ref_out = reference_feature_vjp(
            *f64(q[i], k[i], v[i]), cu_seqlens=cu_i, sinks=sinks, grads=False, **MASKS
        )[0]
        assert_close(f"out[{i}]", out[i], ref_out, dtype=jnp.float32, kind="fwd")
