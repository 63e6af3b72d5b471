"""Checks that only make sense on a CUDA GPU: tensors past 2^31 elements (64-bit index
arithmetic), accuracy next to cuDNN's fused attention, and the CUDA kernels being the ones used.

Every other test file runs on the GPU as well when JAX's backend is one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    BACKEND,
    ON_GPU,
    custom_call_targets,
    dtype_id,
    f64,
    flash_vjp,
    lse_shape,
    make_qkv,
    normal,
    reference_vjp,
    rel_l2,
)

import jax_flash
from jax_flash.reference import attention_reference

pytestmark = pytest.mark.skipif(
    not ON_GPU, reason=f"needs a CUDA GPU; the JAX backend here is {BACKEND!r}"
)

INT32_LIMIT = 2**31
HEADS, HEAD_DIM = 128, 128
# First sequence position whose elements lie past 2^31 in a [1, S, 128, 128] tensor, and a length
# that puts the last 128 positions there: 131200 * 128 * 128 = 2.15e9 elements (4.3 GB in bf16).
FIRST_FAR = INT32_LIMIT // (HEADS * HEAD_DIM)
LONG = FIRST_FAR + 128
CHECKED_HEADS = (0, 61, HEADS - 1)
# bf16 kernel against the exact attention of the same bf16 inputs: ~3e-3 is typical.
BF16_TOL = 2e-2


def jax_key(rng):
    return jax.random.key(int(rng.integers(2**31)))


def per_head_reference(q, k, v, dout, head, causal):
    """float64 (out, lse, (dq, dk, dv)) of one head, sliced out of the big tensors."""
    group = q.shape[2] // k.shape[2]
    qh, douth = (x[:, :, head : head + 1] for x in (q, dout))
    kh, vh = (x[:, :, head // group : head // group + 1] for x in (k, v))
    zero_dlse = jnp.zeros(lse_shape(qh), jnp.float64)
    return reference_vjp(*f64(qh, kh, vh, douth), zero_dlse, causal=causal)


def check_head(name, head, actual, expected):
    err = rel_l2(actual, expected)
    assert err <= BF16_TOL, f"{name}, head {head}: relative L2 error {err:.3e}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_keys_and_values_past_2_31_elements(rng, causal):
    kq, kk, kv, kd = jax.random.split(jax_key(rng), 4)
    seqlen_q = 4
    k = jax.random.normal(kk, (1, LONG, HEADS, HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(kv, (1, LONG, HEADS, HEAD_DIM), jnp.bfloat16)
    assert k.size > INT32_LIMIT
    # Each query row is a copy of one key placed past the 2^31-element mark (visible under the
    # causal mask too), plus noise: that key carries a large share of the row's softmax mass, so
    # reading it from the wrong address changes O, and its dK/dV rows are far from zero.
    rows = jnp.arange(seqlen_q)[:, None]
    heads = jnp.arange(HEADS)[None, :]
    targets = FIRST_FAR + (rows * 37 + heads * 5) % (LONG - FIRST_FAR - seqlen_q)
    noise = jax.random.normal(kq, (seqlen_q, HEADS, HEAD_DIM), jnp.float32)
    q = (k[0, targets, heads].astype(jnp.float32) + 0.3 * noise).astype(jnp.bfloat16)[None]
    dout = jax.random.normal(kd, q.shape, jnp.bfloat16)

    zero_dlse = jnp.zeros(lse_shape(q), jnp.float32)
    out, lse, (dq, dk, dv) = flash_vjp(q, k, v, dout, zero_dlse, causal=causal)
    for head in CHECKED_HEADS:
        r_out, r_lse, (r_dq, r_dk, r_dv) = per_head_reference(q, k, v, dout, head, causal)
        check_head("out", head, out[:, :, head : head + 1], r_out)
        np.testing.assert_allclose(lse[:, head : head + 1], r_lse, rtol=1e-4)
        check_head("dq", head, dq[:, :, head : head + 1], r_dq)
        for name, g, r in (("dk", dk, r_dk), ("dv", dv, r_dv)):
            far = slice(FIRST_FAR, None)
            check_head(name, head, g[:, :, head : head + 1], r)
            check_head(f"{name} past 2^31", head, g[:, far, head : head + 1], r[:, far])


def test_queries_past_2_31_elements(rng):
    kq, kk, kv, kd = jax.random.split(jax_key(rng), 4)
    seqlen_k = 64
    q = jax.random.normal(kq, (1, LONG, HEADS, HEAD_DIM), jnp.bfloat16)
    k = jax.random.normal(kk, (1, seqlen_k, HEADS, HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(kv, (1, seqlen_k, HEADS, HEAD_DIM), jnp.bfloat16)
    dout = jax.random.normal(kd, q.shape, jnp.bfloat16)
    assert q.size > INT32_LIMIT

    zero_dlse = jnp.zeros(lse_shape(q), jnp.float32)
    out, lse, (dq, dk, dv) = flash_vjp(q, k, v, dout, zero_dlse, causal=False)
    far = slice(FIRST_FAR, None)
    for head in CHECKED_HEADS:
        r_out, r_lse, (r_dq, r_dk, r_dv) = per_head_reference(q, k, v, dout, head, False)
        for name, x, r in (("out", out, r_out), ("dq", dq, r_dq)):
            check_head(name, head, x[:, :, head : head + 1], r)
            check_head(f"{name} past 2^31", head, x[:, far, head : head + 1], r[:, far])
        np.testing.assert_allclose(lse[:, head : head + 1, far], r_lse[:, :, far], rtol=1e-4)
        check_head("dk", head, dk[:, :, head : head + 1], r_dk)
        check_head("dv", head, dv[:, :, head : head + 1], r_dv)


def cudnn_vjp(q, k, v, dout, causal):
    attention = functools.partial(
        jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn"
    )
    out, pullback = jax.vjp(attention, q, k, v)
    return out, pullback(dout)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=dtype_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_as_accurate_as_cudnn(rng, head_dim, causal, dtype):
    # Sq == Sk: cuDNN aligns the causal mask top-left, jax_flash bottom-right; they agree here.
    q, k, v = make_qkv(
        rng, batch=2, seqlen_q=512, seqlen_k=512, heads_q=8, head_dim=head_dim, dtype=dtype
    )
    dout = normal(rng, q.shape, dtype)
    try:
        c_out, c_grads = jax.jit(cudnn_vjp, static_argnums=4)(q, k, v, dout, causal)
    except Exception as e:  # cuDNN attention is unavailable for this GPU, library or shape
        pytest.skip(f"cuDNN attention unavailable: {type(e).__name__}: {e}")
    out, _, grads = flash_vjp(q, k, v, dout, causal=causal)
    r_out, _, r_grads = reference_vjp(*f64(q, k, v, dout), causal=causal)
    for name, factor, x, c, r in (
        ("out", 2, out, c_out, r_out),
        *(
            (f"d{n}", 3, g, cg, rg)
            for n, g, cg, rg in zip("qkv", grads, c_grads, r_grads, strict=True)
        ),
    ):
        ours, theirs = rel_l2(x, r), rel_l2(c, r)
        assert ours <= factor * theirs + 1e-3, (
            f"{name}: jax_flash error {ours:.3e}, cuDNN error {theirs:.3e}"
        )


# Calls with more query tiles than the GPU has SMs, where rows see at most 2048 keys: unless
# JAX_FLASH_FWD_PERSISTENT=0, the forward runs its persistent grid (one CTA per SM claiming tiles;
# cpp/cuda/fwd_wgmma.cu), so CTAs run several tiles each, from both Q buffers, with the K/V ring
# and the warpgroups' turns carried from tile to tile (gpu_run.sh test-persistent runs the whole
# suite that way on 3 CTAs); without it, one CTA per tile.
@pytest.mark.parametrize(
    "head_dim, causal, window",
    [
        (64, False, None),
        (64, True, None),
        (128, False, None),
        (128, True, None),
        (64, True, (300, 0)),
        (128, False, (200, 90)),
    ],
    ids=["d64-full", "d64-causal", "d128-full", "d128-causal", "d64-window", "d128-window"],
)
def test_persistent_forward_many_tiles(rng, head_dim, causal, window):
    q, k, v = make_qkv(
        rng,
        batch=2,
        seqlen_q=1000,
        seqlen_k=1024,
        heads_q=16,
        heads_kv=4,
        head_dim=head_dim,
        dtype=jnp.bfloat16,
    )
    call = jax.jit(
        functools.partial(jax_flash.attention, causal=causal, window=window, return_lse=True)
    )
    out, lse = call(q, k, v)
    r_out, r_lse = attention_reference(*f64(q, k, v), causal=causal, window=window, return_lse=True)
    assert rel_l2(out, r_out) <= BF16_TOL
    np.testing.assert_allclose(lse, r_lse, rtol=2e-3, atol=2e-3)
    # Which CTA runs a tile changes from run to run; what it computes must not.
    again, again_lse = call(q, k, v)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(again_lse), np.asarray(lse))


def test_backward_uses_cuda_kernels(rng):
    q, k, v = make_qkv(rng, seqlen_q=8, seqlen_k=8, dtype=jnp.bfloat16)
    dout = normal(rng, q.shape, q.dtype)

    def vjp(q, k, v, dout):
        return jax.vjp(jax_flash.attention, q, k, v)[1](dout)

    text = jax.jit(vjp).lower(q, k, v, dout).as_text()
    assert sorted(custom_call_targets(text)) == ["jax_flash_bwd_cuda", "jax_flash_fwd_cuda"]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("head_dim", [1, 33, 72, 130])
def test_padded_head_dims_keep_the_output_shape(rng, head_dim, dtype):
    # f16/bf16 head dims are zero-padded to 64/128/256 for the tensor-core kernels.
    q, k, v = make_qkv(rng, seqlen_q=70, seqlen_k=90, head_dim=head_dim, dtype=dtype)
    dout = normal(rng, q.shape, dtype)
    out, _, grads = flash_vjp(q, k, v, dout, causal=True)
    assert out.shape == q.shape and all(
        g.shape == x.shape for g, x in zip(grads, (q, k, v), strict=True)
    )
    r_out, _, r_grads = reference_vjp(*f64(q, k, v, dout), causal=True)
    assert rel_l2(out, r_out) <= BF16_TOL
    for g, r in zip(grads, r_grads, strict=True):
        assert rel_l2(g, r, 0.1) <= BF16_TOL
