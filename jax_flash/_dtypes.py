"""dtype facts every kernel call shares: which inputs run on the tensor cores, the dtype of the
statistics (lse, delta, sinks), and zero-padding of the head dimension."""

from __future__ import annotations

import jax
import jax.numpy as jnp

HALF_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def is_half(dtype) -> bool:
    return jnp.dtype(dtype) in HALF_DTYPES


def stats_dtype(dtype) -> jnp.dtype:
    """dtype of lse, delta and sinks: float64 for float64 inputs, float32 otherwise."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def pad_head_dim(x: jax.Array, head_dim: int) -> jax.Array:
    """x with its last axis zero-padded to head_dim. Zero columns change neither q.k nor the kept
    columns of O."""
    extra = head_dim - x.shape[-1]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])
