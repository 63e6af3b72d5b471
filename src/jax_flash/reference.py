"""Plain attention in jax.numpy: the ground truth the kernels are tested and benchmarked against.

It materialises the full [B, H, Sq, Sk] score matrix, so it is only for small problems. Call it
on float64 inputs (with ``jax_enable_x64``) to get a float64 reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_mask(seqlen_q: int, seqlen_k: int) -> jax.Array:
    """[Sq, Sk] boolean mask, bottom-right aligned: query i sees key j iff j <= i + Sk - Sq."""
    rows = jnp.arange(seqlen_q)[:, None]
    cols = jnp.arange(seqlen_k)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of q [B, Sq, Hq, D] over k, v [B, Sk, Hkv, D], computed in the inputs' dtype.

    Same contract as :func:`jax_flash.attention`: fully masked rows give output 0 and lse -inf,
    and their gradients are zero.
    """
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    group = heads_q // heads_kv
    k = jnp.repeat(k, group, axis=-2)
    v = jnp.repeat(v, group, axis=-2)
    s = jnp.einsum("...qhd,...khd->...hqk", q, k) * jnp.asarray(scale, q.dtype)
    if causal:
        s = jnp.where(causal_mask(q.shape[-3], k.shape[-3]), s, -jnp.inf)
    # The max only shifts the exponent; it carries no gradient of its own (lse and softmax are
    # invariant to it), and a fully masked row uses 0 so that exp(-inf - m) stays 0, not NaN.
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    empty = denom == 0
    safe_denom = jnp.where(empty, 1, denom)
    out = jnp.einsum("...hqk,...khd->...qhd", p / safe_denom, v)
    if not return_lse:
        return out
    lse = jnp.where(empty, -jnp.inf, jnp.log(safe_denom) + m)[..., 0]
    return out, lse
