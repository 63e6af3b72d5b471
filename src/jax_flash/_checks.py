"""Trace-time validation of attention() arguments. Every message names the argument and what is
allowed, so a bad call fails before any kernel is compiled or run."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
MAX_HEAD_DIM = 256


def _dtype_names() -> str:
    return ", ".join(jnp.dtype(d).name for d in SUPPORTED_DTYPES)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"jax_flash.attention: {name} must be a Python bool, got {value!r}")
    return bool(value)


def check_inputs(q: Any, k: Any, v: Any) -> None:
    """Shapes [B, Sq, Hq, D] and [B, Sk, Hkv, D], one supported dtype, Hq a multiple of Hkv."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"jax_flash.attention: {name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(
                f"jax_flash.attention: {name} must have rank 4, [batch, seq, heads, head_dim], "
                f"got shape {tuple(x.shape)}"
            )
        if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
            raise TypeError(
                f"jax_flash.attention: {name} has dtype {jnp.dtype(x.dtype).name}; "
                f"supported dtypes are {_dtype_names()}"
            )
        if any(d == 0 for d in x.shape):
            raise ValueError(
                f"jax_flash.attention: {name} has an empty axis, shape {tuple(x.shape)}; "
                "every axis must have length >= 1"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            "jax_flash.attention: q, k and v must share one dtype, got "
            f"{jnp.dtype(q.dtype).name}, {jnp.dtype(k.dtype).name}, {jnp.dtype(v.dtype).name}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"jax_flash.attention: k and v must have the same shape, got {tuple(k.shape)} "
            f"and {tuple(v.shape)}"
        )
    batch, _, heads_q, head_dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(
            f"jax_flash.attention: k and v batch size {k.shape[0]} must equal q's batch size "
            f"{batch}"
        )
    if k.shape[3] != head_dim:
        raise ValueError(
            f"jax_flash.attention: k and v head_dim {k.shape[3]} must equal q's head_dim {head_dim}"
        )
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"jax_flash.attention: head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}"
        )
    heads_kv = k.shape[2]
    if heads_q % heads_kv != 0:
        raise ValueError(
            f"jax_flash.attention: the number of query heads ({heads_q}) must be a multiple of "
            f"the number of key/value heads ({heads_kv})"
        )


def check_softmax_scale(softmax_scale: Any, head_dim: int) -> float:
    """None means 1/sqrt(head_dim); otherwise a finite positive Python or NumPy real number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, jax.Array):
        raise TypeError(
            "jax_flash.attention: softmax_scale must be a static Python or NumPy number, "
            "not a JAX array"
        )
    if isinstance(softmax_scale, np.ndarray) and softmax_scale.ndim == 0:
        softmax_scale = softmax_scale.item()
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(
        softmax_scale, (numbers.Real, np.floating, np.integer)
    ):
        raise TypeError(
            "jax_flash.attention: softmax_scale must be a finite positive real number or None, "
            f"got {softmax_scale!r}"
        )
    value = float(softmax_scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            "jax_flash.attention: softmax_scale must be a finite positive real number or None, "
            f"got {softmax_scale!r}"
        )
    return value
