"""jax_flash.flax.attention_fn inside Flax's own attention layers (linen and nnx): outputs and
parameter gradients equal the layers' default attention, and whatever the kernels cannot honour
(mask, bias, dropout, sow_weights) raises instead of being dropped."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import normal, rel_l2

linen = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
jf_flax = pytest.importorskip("jax_flash.flax")

TOL = {"fwd": 2e-5, "grad": 1e-4}
HAS_KV_HEADS = "num_kv_heads" in inspect.signature(nnx.MultiHeadAttention.__init__).parameters


def _linen_pair(causal):
    fn = functools.partial(jf_flax.attention_fn, is_causal=True) if causal else jf_flax.attention_fn
    ours = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=32, attention_fn=fn)
    theirs = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=32)
    return ours, theirs


@pytest.mark.parametrize("causal", [False, True])
def test_linen_matches_its_default(rng, causal):
    x = normal(rng, (2, 11, 16), jnp.float32)
    ours, theirs = _linen_pair(causal)
    params = theirs.init(jax.random.key(0), x)
    mask = linen.make_causal_mask(x[..., 0]) if causal else None

    def loss(module, mask, params):
        return jnp.sum(jnp.sin(module.apply(params, x, mask=mask)))

    a, ga = jax.jit(jax.value_and_grad(functools.partial(loss, ours, None)))(params)
    b, gb = jax.jit(jax.value_and_grad(functools.partial(loss, theirs, mask)))(params)
    assert abs(float(a) - float(b)) <= TOL["fwd"] * abs(float(b))
    leaves_a, leaves_b = jax.tree.leaves(ga), jax.tree.leaves(gb)
    assert len(leaves_a) == len(leaves_b) == 8
    for g, r in zip(leaves_a, leaves_b, strict=True):
        # The key bias gradient vanishes (it shifts whole score rows): compared absolutely.
        assert rel_l2(g, r, floor=1e-2) <= TOL["grad"]
    if causal:
        # The masked and unmasked layers differ a lot: matching proves the mask took effect.
        free = theirs.apply(params, x)
        assert rel_l2(ours.apply(params, x), free) > 0.05


@pytest.mark.parametrize(
    ("call", "match"),
    [
        ({"mask": "causal"}, "dense mask has no fused kernel"),
        ({"sow_weights": True}, "sow_weights"),
        ({"dropout": True}, "dropout is not implemented"),
    ],
)
def test_linen_refuses_what_it_cannot_honour(rng, call, match):
    x = normal(rng, (1, 6, 16), jnp.float32)
    rate = 0.1 if call.get("dropout") else 0.0
    layer = linen.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=16, attention_fn=jf_flax.attention_fn, dropout_rate=rate
    )
    params = layer.init(jax.random.key(0), x, deterministic=True)
    kwargs = {"rngs": {"dropout": jax.random.key(1)}, "deterministic": not call.get("dropout")}
    if call.get("mask"):
        kwargs["mask"] = linen.make_causal_mask(x[..., 0])
    if call.get("sow_weights"):
        kwargs["sow_weights"] = True
    with pytest.raises(ValueError, match=match):
        layer.apply(params, x, **kwargs)
    if call.get("dropout"):
        layer.apply(params, x, deterministic=True)  # no dropout, no error


def _nnx_pair(kv_heads):
    extra = {"num_kv_heads": kv_heads} if HAS_KV_HEADS else {}
    make = functools.partial(
        nnx.MultiHeadAttention, num_heads=4, in_features=16, qkv_features=32, decode=False, **extra
    )
    return (
        make(attention_fn=jf_flax.attention_fn, rngs=nnx.Rngs(0)),
        make(rngs=nnx.Rngs(0)),
    )


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=lambda h: f"kv{h}")
def test_nnx_matches_its_default(rng, kv_heads):
    if kv_heads != 4 and not HAS_KV_HEADS:
        pytest.skip("this nnx.MultiHeadAttention has no num_kv_heads")
    x = normal(rng, (2, 9, 16), jnp.float32)
    ours, theirs = _nnx_pair(kv_heads)

    @nnx.jit
    def loss_and_grads(model, x):
        return nnx.value_and_grad(lambda m: jnp.sum(jnp.sin(m(x, is_causal=True))))(model)

    a, ga = loss_and_grads(ours, x)
    b, gb = loss_and_grads(theirs, x)
    assert abs(float(a) - float(b)) <= TOL["fwd"] * abs(float(b))
    leaves_a, leaves_b = jax.tree.leaves(nnx.state(ga)), jax.tree.leaves(nnx.state(gb))
    assert len(leaves_a) == len(leaves_b) == 8
    for g, r in zip(leaves_a, leaves_b, strict=True):
        # The key bias gradient vanishes (it shifts whole score rows): compared absolutely.
        assert rel_l2(g, r, floor=1e-2) <= TOL["grad"]
    if HAS_KV_HEADS:
        assert jnp.shape(ours.key.kernel[...])[-2] == kv_heads
    assert rel_l2(ours(x, is_causal=True), ours(x)) > 0.05


def test_nnx_refuses_what_it_cannot_honour(rng):
    x = normal(rng, (1, 6, 16), jnp.float32)
    layer = nnx.MultiHeadAttention(
        num_heads=2,
        in_features=16,
        decode=False,
        dropout_rate=0.1,
        attention_fn=jf_flax.attention_fn,
        rngs=nnx.Rngs(0),
    )
    with pytest.raises(ValueError, match="dense mask has no fused kernel"):
        layer(x, mask=nnx.make_causal_mask(x[..., 0]), deterministic=True)
    with pytest.raises(ValueError, match="sow_weights"):
        layer(x, sow_weights=True, deterministic=True)
    with pytest.raises(ValueError, match="dropout is not implemented"):
        layer(x, deterministic=False, rngs=nnx.Rngs(dropout=1))
    assert layer(x, deterministic=True).shape == x.shape


def test_adapter_arguments(rng):
    q = normal(rng, (2, 3, 5, 4, 8), jnp.float32)  # two batch axes
    k = normal(rng, (2, 3, 7, 2, 8), jnp.float32)
    out = jf_flax.attention_fn(q, k, k, is_causal=True, window=(2, 0), dtype=jnp.float64)
    assert out.shape == q.shape and out.dtype == jnp.float64
    flat = jax.nn.dot_product_attention(
        q.reshape(6, 5, 4, 8).astype(jnp.float64),
        k.reshape(6, 7, 2, 8).astype(jnp.float64),
        k.reshape(6, 7, 2, 8).astype(jnp.float64),
        is_causal=True,
        local_window_size=(2, 0),
        implementation="xla",
    )
    assert rel_l2(out.reshape(flat.shape), flat) <= TOL["fwd"]
    with pytest.raises(ValueError, match="bias has no fused kernel"):
        jf_flax.attention_fn(q, k, k, bias=jnp.zeros((1, 1, 5, 7)))
    with pytest.raises(ValueError, match="qk_attn_weights_einsum must be None"):
        jf_flax.attention_fn(q, k, k, qk_attn_weights_einsum=jnp.einsum)
    # Every keyword Flax passes is named, so linen's signature filter drops none of them.
    names = inspect.signature(jf_flax.attention_fn).parameters
    for name in inspect.signature(nnx.dot_product_attention).parameters:
        assert name in names, name
    np.testing.assert_array_equal(
        jf_flax.attention_fn(q, k, k, dropout_rate=0.5, deterministic=True),
        jf_flax.attention_fn(q, k, k),
    )


def test_deterministic_backward_reaches_the_kernels(rng):
    # Flax's own `deterministic` is about dropout; the kernels' option has its own name. On the CPU
    # the backward is deterministic either way, so the gradients are equal; a wrong type raises
    # with the kernel option's name, which shows that it reached the kernel call.
    q = normal(rng, (2, 9, 4, 8), jnp.float32)

    def loss(q, flag):
        return jnp.sum(jf_flax.attention_fn(q, q, q, is_causal=True, deterministic_backward=flag))

    g0, g1 = jax.grad(loss)(q, False), jax.grad(loss)(q, True)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError, match="deterministic must be a Python bool"):
        jf_flax.attention_fn(q, q, q, deterministic_backward="yes")
