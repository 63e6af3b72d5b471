"""deterministic=True: the backward adds each dQ tile's contributions in a fixed order, so the
gradients are bitwise the same from run to run (on the GPU; the CPU kernels are deterministic
either way), and they are as accurate as the default's. Cases cover head_dim 64/128/256 (the
wgmma backward on Hopper, the mma.sync one under JAX_FLASH_CUDA_FAMILY=mma), grouped heads, the
band, segment ids (every pair of the band is then visited), rows of documents and packed
sequences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ON_GPU,
    check_features,
    dtype_id,
    flash_feature_vjp,
    make_packed,
    make_qkv,
    normal,
    segments_from_lengths,
    stats_dtype,
)

import jax_flash

CASES = [
    # dtype, head_dim, causal, window, heads (q, kv), layout
    (jnp.bfloat16, 64, False, None, (4, 2), "dense"),
    (jnp.float16, 128, True, None, (4, 1), "dense"),
    (jnp.bfloat16, 128, False, (300, 40), (2, 2), "dense"),
    (jnp.bfloat16, 256, True, None, (2, 1), "dense"),
    (jnp.float16, 64, True, None, (2, 2), "segments"),
    (jnp.bfloat16, 128, True, None, (4, 2), "documents"),
    (jnp.bfloat16, 128, True, (200, None), (4, 2), "packed"),
    (jnp.float32, 64, True, None, (2, 1), "dense"),
]


def _ids(case):
    dtype, d, causal, window, heads, layout = case
    w = "" if window is None else f"-w{window[0]}_{window[1]}"
    mask = "causal" if causal else "full"
    return f"{dtype_id(dtype)}-d{d}-{mask}{w}-h{heads[0]}x{heads[1]}-{layout}"


def _inputs(rng, dtype, head_dim, heads, layout):
    if layout == "packed":
        q, k, v, cu = make_packed(
            rng, [300, 0, 517, 130], [420, 5, 517, 260], pad_q=9, heads_q=heads[0],
            heads_kv=heads[1], head_dim=head_dim, dtype=dtype,
        )  # fmt: skip
        return q, k, v, {"cu_seqlens": cu}
    if layout == "documents":
        # Row 0 is four documents, which the GPU schedules document by document; row 1's ids
        # recur, so its tiles keep the element masks (tests/test_mask_features.py).
        q, k, v = make_qkv(
            rng, batch=2, seqlen_q=2304, seqlen_k=2304, heads_q=heads[0], heads_kv=heads[1],
            head_dim=head_dim, dtype=dtype,
        )  # fmt: skip
        ids = segments_from_lengths([700, 1, 900, 703], [600, 1000, 704])
        return q, k, v, {"segment_ids": ids.at[1].set(ids[1] % 2)}
    q, k, v = make_qkv(
        rng, batch=2, seqlen_q=700, seqlen_k=900, heads_q=heads[0], heads_kv=heads[1],
        head_dim=head_dim, dtype=dtype,
    )  # fmt: skip
    extra = {}
    if layout == "segments":
        extra["segment_ids"] = (
            segments_from_lengths([250, 1, 449], [700]),
            segments_from_lengths([100, 500, 300], [900]),
        )
    return q, k, v, extra


def _params():
    # Rows of documents take their GPU schedule only there (tests/test_mask_features.py).
    gpu = pytest.mark.skipif(not ON_GPU, reason="the GPU kernels' document schedule")
    return [pytest.param(c, id=_ids(c), marks=gpu if c[-1] == "documents" else ()) for c in CASES]


@pytest.mark.parametrize("case", _params())
def test_deterministic_backward_is_accurate_and_bitwise_repeatable(rng, case):
    dtype, head_dim, causal, window, heads, layout = case
    q, k, v, extra = _inputs(rng, dtype, head_dim, heads, layout)
    static = dict(causal=causal, window=window, deterministic=True)
    (out, lse, grads), _ = check_features(rng, q, k, v, **extra, **static)
    stat_shape = lse.shape
    dout = normal(rng, q.shape, dtype)
    dlse = normal(rng, stat_shape, stats_dtype(dtype))
    first = jax.tree.leaves(flash_feature_vjp(q, k, v, dout, dlse, **extra, **static))
    for run in range(3):
        again = jax.tree.leaves(flash_feature_vjp(q, k, v, dout, dlse, **extra, **static))
        for i, (a, b) in enumerate(zip(first, again, strict=True)):
            np.testing.assert_array_equal(
                np.asarray(a), np.asarray(b), err_msg=f"leaf {i}, run {run}"
            )


def test_the_option_is_a_static_bool():
    q = jnp.zeros((1, 8, 1, 16), jnp.float32)
    with pytest.raises(TypeError, match=r"attention: deterministic must be a Python bool"):
        jax_flash.attention(q, q, q, deterministic="yes")
    with pytest.raises(TypeError, match=r"attention_varlen: deterministic must be a Python bool"):
        cu = jnp.asarray([0, 8], jnp.int32)
        jax_flash.attention_varlen(q[0], q[0], q[0], cu, cu, deterministic=1)


def test_dot_product_attention_takes_the_option(rng):
    q, k, v = make_qkv(rng, batch=1, seqlen_q=40, seqlen_k=40, heads_q=2, heads_kv=2,
                       head_dim=16, dtype=jnp.float32)  # fmt: skip

    def loss(q, deterministic):
        out = jax_flash.dot_product_attention(q, k, v, is_causal=True, deterministic=deterministic)
        return jnp.sum(out * out)

    g0 = jax.grad(loss)(q, False)
    g1 = jax.grad(loss)(q, True)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), rtol=1e-5, atol=1e-6)
