"""jax_flash inside a jitted Flax (NNX) transformer block: the loss and every parameter gradient
match the same block built on the plain reference attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOL_F32, TOL_F64, dtype_id, normal, rel_l2

import jax_flash
from jax_flash.reference import attention_reference

nnx = pytest.importorskip("flax.nnx")


@pytest.fixture(autouse=True)
def full_precision_matmuls():
    # GPUs may run float32 matmuls (projections, reference attention) in TF32 by default; the
    # comparison needs both blocks in true float32.
    with jax.default_matmul_precision("highest"):
        yield


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: grouped-query causal self-attention, then a GELU MLP."""

    def __init__(self, dim, heads, kv_heads, *, use_flash, dtype, rngs):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.use_flash = use_flash
        kw = {"dtype": dtype, "param_dtype": dtype, "rngs": rngs}
        self.norm1 = nnx.LayerNorm(dim, **kw)
        self.wq = nnx.Linear(dim, heads * self.head_dim, **kw)
        # No key bias: it shifts every score of a query row equally, so its gradient is 0.
        self.wk = nnx.Linear(dim, kv_heads * self.head_dim, use_bias=False, **kw)
        self.wv = nnx.Linear(dim, kv_heads * self.head_dim, **kw)
        self.wo = nnx.Linear(heads * self.head_dim, dim, **kw)
        self.norm2 = nnx.LayerNorm(dim, **kw)
        self.up = nnx.Linear(dim, 4 * dim, **kw)
        self.down = nnx.Linear(4 * dim, dim, **kw)

    def __call__(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.wq(h).reshape(b, s, self.heads, self.head_dim)
        k = self.wk(h).reshape(b, s, self.kv_heads, self.head_dim)
        v = self.wv(h).reshape(b, s, self.kv_heads, self.head_dim)
        attention = jax_flash.attention if self.use_flash else attention_reference
        a = attention(q, k, v, causal=True)
        x = x + self.wo(a.reshape(b, s, -1))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def loss_and_grads(model, x, y):
    return nnx.value_and_grad(loss_fn)(model, x, y)


def grad_leaves(grads):
    return jax.tree.leaves(nnx.state(grads) if isinstance(grads, nnx.Module) else grads)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64], ids=dtype_id)
def test_block_loss_and_gradients(rng, dtype):
    dim, heads, kv_heads, batch, seqlen = 64, 8, 2, 2, 67
    x = normal(rng, (batch, seqlen, dim), dtype)
    y = normal(rng, (batch, seqlen, dim), dtype)
    flash = Block(dim, heads, kv_heads, use_flash=True, dtype=dtype, rngs=nnx.Rngs(0))
    ref = Block(dim, heads, kv_heads, use_flash=False, dtype=dtype, rngs=nnx.Rngs(0))
    for a, b in zip(
        jax.tree.leaves(nnx.state(flash)), jax.tree.leaves(nnx.state(ref)), strict=True
    ):
        np.testing.assert_array_equal(a, b)

    loss, grads = loss_and_grads(flash, x, y)
    ref_loss, ref_grads = loss_and_grads(ref, x, y)
    tol = TOL_F64 if dtype == jnp.float64 else TOL_F32["grad"]
    assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss))
    leaves, ref_leaves = grad_leaves(grads), grad_leaves(ref_grads)
    assert len(leaves) == len(ref_leaves) == 15
    for g, r in zip(leaves, ref_leaves, strict=True):
        assert g.dtype == dtype
        assert rel_l2(g, r) <= tol, rel_l2(g, r)
    # No vacuous comparisons: every parameter has a gradient (those of wq, wk and wv come from
    # the attention backward alone).
    assert all(float(jnp.abs(g).max()) > 0 for g in leaves)


def test_training_steps_track_the_reference(rng):
    # A few SGD steps: small gradient differences must not compound into diverging losses.
    dim, heads, kv_heads, batch, seqlen = 32, 4, 1, 2, 40
    x = normal(rng, (batch, seqlen, dim), jnp.float32)
    y = normal(rng, (batch, seqlen, dim), jnp.float32)
    models = {
        use_flash: Block(
            dim, heads, kv_heads, use_flash=use_flash, dtype=jnp.float32, rngs=nnx.Rngs(1)
        )
        for use_flash in (True, False)
    }

    @nnx.jit
    def step(model, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.05 * g, params, nnx.state(grads)))
        return loss

    losses = {
        use_flash: [float(step(m, x, y)) for _ in range(5)] for use_flash, m in models.items()
    }
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    assert losses[True][-1] < losses[True][0], "the block did not train"
