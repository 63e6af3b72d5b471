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


def check_bool(fn: str, name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"jax_flash.{fn}: {name} must be a Python bool, got {value!r}")
    return bool(value)


def check_diagonal_shift(fn: str, shift: Any) -> int:
    """A static int within +-2^31 (a difference of positions)."""
    if isinstance(shift, (bool, np.bool_)) or not isinstance(shift, (int, np.integer)):
        raise TypeError(f"jax_flash.{fn}: diagonal_shift must be a static int, got {shift!r}")
    if abs(int(shift)) > 2**31:
        raise ValueError(f"jax_flash.{fn}: diagonal_shift must be within +-2^31, got {shift}")
    return int(shift)


def _check_tensors(fn: str, q: Any, k: Any, v: Any, rank: int, layout: str) -> None:
    """One supported dtype, the given rank, no empty axis; k and v of one shape."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"jax_flash.{fn}: {name} must be an array, got {type(x).__name__}")
        if x.ndim != rank:
            raise ValueError(
                f"jax_flash.{fn}: {name} must have rank {rank}, {layout}, "
                f"got shape {tuple(x.shape)}"
            )
        if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
            raise TypeError(
                f"jax_flash.{fn}: {name} has dtype {jnp.dtype(x.dtype).name}; "
                f"supported dtypes are {_dtype_names()}"
            )
        if any(d == 0 for d in x.shape):
            raise ValueError(
                f"jax_flash.{fn}: {name} has an empty axis, shape {tuple(x.shape)}; "
                "every axis must have length >= 1"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"jax_flash.{fn}: q, k and v must share one dtype, got "
            f"{jnp.dtype(q.dtype).name}, {jnp.dtype(k.dtype).name}, {jnp.dtype(v.dtype).name}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"jax_flash.{fn}: k and v must have the same shape, got {tuple(k.shape)} "
            f"and {tuple(v.shape)}"
        )


def _check_heads(fn: str, heads_q: int, heads_kv: int, head_dim: int, k_head_dim: int) -> None:
    if k_head_dim != head_dim:
        raise ValueError(
            f"jax_flash.{fn}: k and v head_dim {k_head_dim} must equal q's head_dim {head_dim}"
        )
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"jax_flash.{fn}: head_dim must be between 1 and {MAX_HEAD_DIM}, got {head_dim}"
        )
    if heads_q % heads_kv != 0:
        raise ValueError(
            f"jax_flash.{fn}: the number of query heads ({heads_q}) must be a multiple of "
            f"the number of key/value heads ({heads_kv})"
        )


def check_inputs(q: Any, k: Any, v: Any, fn: str = "attention") -> None:
    """Shapes [B, Sq, Hq, D] and [B, Sk, Hkv, D], one supported dtype, Hq a multiple of Hkv."""
    _check_tensors(fn, q, k, v, 4, "[batch, seq, heads, head_dim]")
    batch, _, heads_q, head_dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(
            f"jax_flash.{fn}: k and v batch size {k.shape[0]} must equal q's batch size {batch}"
        )
    _check_heads(fn, heads_q, k.shape[2], head_dim, k.shape[3])


def check_varlen_inputs(q: Any, k: Any, v: Any) -> None:
    """Packed shapes [Tq, Hq, D] and [Tk, Hkv, D]."""
    fn = "attention_varlen"
    _check_tensors(fn, q, k, v, 3, "[total_tokens, heads, head_dim]")
    _check_heads(fn, q.shape[1], k.shape[1], q.shape[2], k.shape[2])


def check_softmax_scale(softmax_scale: Any, head_dim: int, fn: str = "attention") -> float:
    """None means 1/sqrt(head_dim); otherwise a finite positive Python or NumPy real number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, jax.Array):
        raise TypeError(
            f"jax_flash.{fn}: softmax_scale must be a static Python or NumPy number, "
            "not a JAX array"
        )
    if isinstance(softmax_scale, np.ndarray) and softmax_scale.ndim == 0:
        softmax_scale = softmax_scale.item()
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(
        softmax_scale, (numbers.Real, np.floating, np.integer)
    ):
        raise TypeError(
            f"jax_flash.{fn}: softmax_scale must be a finite positive real number or None, "
            f"got {softmax_scale!r}"
        )
    value = float(softmax_scale)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"jax_flash.{fn}: softmax_scale must be a finite positive real number or None, "
            f"got {softmax_scale!r}"
        )
    return value


def _static_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_window(fn: str, window: Any) -> tuple[int | None, int | None]:
    """None, or (left, right) with each a static int >= 0 or None."""
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(
            f"jax_flash.{fn}: window must be None or a pair (left, right) of ints >= 0 or None, "
            f"got {window!r}"
        )
    bounds = []
    for side, bound in zip(("left", "right"), window, strict=True):
        if bound is None:
            bounds.append(None)
            continue
        if not _static_int(bound):
            raise TypeError(
                f"jax_flash.{fn}: window {side} bound must be a static int >= 0 or None, "
                f"got {bound!r}"
            )
        if bound < 0:
            raise ValueError(
                f"jax_flash.{fn}: window {side} bound must be >= 0 or None, got {int(bound)}"
            )
        bounds.append(int(bound))
    return bounds[0], bounds[1]


def check_softcap(fn: str, softcap: Any) -> float:
    """None (0.0: off) or a finite static number > 0."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, jax.Array) or isinstance(softcap, (bool, np.bool_)):
        raise TypeError(
            f"jax_flash.{fn}: softcap must be a static finite number > 0 or None, got {softcap!r}"
        )
    if isinstance(softcap, np.ndarray) and softcap.ndim == 0:
        softcap = softcap.item()
    if not isinstance(softcap, (numbers.Real, np.floating, np.integer)):
        raise TypeError(
            f"jax_flash.{fn}: softcap must be a static finite number > 0 or None, got {softcap!r}"
        )
    value = float(softcap)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"jax_flash.{fn}: softcap must be finite and > 0, got {softcap!r}")
    return value


# Integer dtypes whose every value is an int32: taken and widened. Wider ones are refused, since
# narrowing could merge distinct ids or sequence offsets.
_SMALL_INTS = tuple(jnp.dtype(d) for d in (jnp.int8, jnp.int16, jnp.int32, jnp.uint8, jnp.uint16))


def _int32_array(fn: str, name: str, x: Any, shape: tuple[int, ...], shape_text: str) -> jax.Array:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"jax_flash.{fn}: {name} must be an int32 array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) not in _SMALL_INTS:
        raise TypeError(
            f"jax_flash.{fn}: {name} must have dtype int32 (or a narrower integer type), got "
            f"{jnp.dtype(x.dtype).name}"
        )
    if tuple(x.shape) != shape:
        raise ValueError(
            f"jax_flash.{fn}: {name} must have shape {shape_text} = {shape}, got {tuple(x.shape)}"
        )
    return jnp.asarray(x).astype(jnp.int32)


def check_segment_ids(
    segment_ids: Any, batch: int, seqlen_q: int, seqlen_k: int
) -> tuple[jax.Array | None, jax.Array | None]:
    """None, one [batch, seq] array (seqlen_q == seqlen_k), or (q_ids, kv_ids)."""
    fn = "attention"
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise TypeError(
                f"jax_flash.{fn}: segment_ids must be one [batch, seq] array or a pair "
                f"(q_segment_ids, kv_segment_ids), got a sequence of {len(segment_ids)}"
            )
        q_ids, kv_ids = segment_ids
    else:
        if seqlen_q != seqlen_k:
            raise ValueError(
                f"jax_flash.{fn}: a single segment_ids array needs seqlen_q == seqlen_k (got "
                f"{seqlen_q} and {seqlen_k}); pass (q_segment_ids, kv_segment_ids) instead"
            )
        q_ids = kv_ids = segment_ids
    q_ids = _int32_array(fn, "q segment_ids", q_ids, (batch, seqlen_q), "[batch, seqlen_q]")
    kv_ids = _int32_array(fn, "kv segment_ids", kv_ids, (batch, seqlen_k), "[batch, seqlen_k]")
    return q_ids, kv_ids


def check_sinks(fn: str, sinks: Any, heads_q: int) -> jax.Array | None:
    """None or a floating [heads_q] array."""
    if sinks is None:
        return None
    if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
        raise TypeError(f"jax_flash.{fn}: sinks must be an array, got {type(sinks).__name__}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(
            f"jax_flash.{fn}: sinks must have a floating dtype, got {jnp.dtype(sinks.dtype).name}"
        )
    if tuple(sinks.shape) != (heads_q,):
        raise ValueError(
            f"jax_flash.{fn}: sinks must have shape [heads_q] = ({heads_q},), got "
            f"{tuple(sinks.shape)}"
        )
    return jnp.asarray(sinks)


def check_max_seqlen(name: str, value: Any) -> int:
    """None (-1) or a static int >= 0."""
    if value is None:
        return -1
    if not _static_int(value):
        raise TypeError(
            f"jax_flash.attention_varlen: {name} must be a static int >= 0 or None, got {value!r}"
        )
    if value < 0:
        raise ValueError(f"jax_flash.attention_varlen: {name} must be >= 0, got {int(value)}")
    return int(value)


def check_cu_seqlens(
    cu_q: Any, cu_k: Any, total_q: int, total_k: int, max_q: int, max_k: int
) -> tuple[jax.Array, jax.Array]:
    """int32 [num_seqs + 1] each, of one length. Concrete values are checked as well:
    non-decreasing from 0, last entry within the tokens, lengths within max_seqlen_*. Traced values
    cannot be checked here; the kernels clamp them, so bad ones can give wrong results but never
    an out-of-bounds access."""
    fn = "attention_varlen"
    arrays = []
    for name, x in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"jax_flash.{fn}: {name} must be an int32 array")
        if x.ndim != 1 or x.shape[0] < 1:
            raise ValueError(
                f"jax_flash.{fn}: {name} must have shape [num_seqs + 1], got {tuple(x.shape)}"
            )
        arrays.append(_int32_array(fn, name, x, tuple(x.shape), "[num_seqs + 1]"))
    if cu_q.shape != cu_k.shape:
        raise ValueError(
            f"jax_flash.{fn}: cu_seqlens_q and cu_seqlens_k must have the same length "
            f"(num_seqs + 1), got {cu_q.shape[0]} and {cu_k.shape[0]}"
        )
    for name, x, total, bound in (
        ("cu_seqlens_q", cu_q, total_q, max_q),
        ("cu_seqlens_k", cu_k, total_k, max_k),
    ):
        try:
            values = np.asarray(x).astype(np.int64)
        except jax.errors.TracerArrayConversionError:
            continue
        lengths = np.diff(values)
        tokens = "q" if name.endswith("q") else "k"
        if values[0] != 0 or (lengths < 0).any():
            raise ValueError(
                f"jax_flash.{fn}: {name} must start at 0 and be non-decreasing, got {values}"
            )
        if values[-1] > total:
            raise ValueError(
                f"jax_flash.{fn}: {name}[-1] = {values[-1]} exceeds the {total} tokens of {tokens}"
            )
        if bound >= 0 and lengths.size and lengths.max() > bound:
            raise ValueError(
                f"jax_flash.{fn}: a sequence of {int(lengths.max())} tokens exceeds "
                f"max_seqlen_{tokens} = {int(bound)}"
            )
    return arrays[0], arrays[1]
