"""`jax.nn.dot_product_attention`'s signature and results, computed by the jax_flash kernels."""

from __future__ import annotations

import math
import numbers
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash.attention import dense_attention

NAME = "dot_product_attention"
IMPLEMENTATION = "jax_flash"

_ALTERNATIVES = (
    "is_causal, query_seq_lengths / key_value_seq_lengths, local_window_size, or "
    "jax_flash.attention's segment_ids, window and softcap"
)


def _error(text: str) -> str:
    return f"jax_flash.{NAME}: {text}"


def _check_scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, np.ndarray) and scale.ndim == 0:
        scale = scale.item()
    if (
        isinstance(scale, (jax.Array, bool, np.bool_))
        or not isinstance(scale, (numbers.Real, np.floating, np.integer))
        or not math.isfinite(float(scale))
        or float(scale) <= 0
    ):
        raise ValueError(_error(f"scale must be a static finite number > 0 or None, got {scale!r}"))
    return float(scale)


def _check_window(window: Any) -> tuple[int, int] | None:
    if window is None:
        return None
    if isinstance(window, (int, np.integer)) and not isinstance(window, (bool, np.bool_)):
        window = (window, window)
    ok = isinstance(window, (tuple, list)) and len(window) == 2
    ok = ok and all(
        isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_)) for w in window
    )
    if not ok or any(w < 0 for w in window):
        raise ValueError(
            _error(
                "local_window_size must be None, an int >= 0 or a pair (left, right) of ints "
                f">= 0, got {window!r}"
            )
        )
    return int(window[0]), int(window[1])


def _check_lengths(name: str, lengths: Any, batch: int) -> jax.Array | None:
    if lengths is None:
        return None
    lengths = jnp.asarray(lengths)
    if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
        raise ValueError(
            _error(
                f"{name} must be an int32 array of shape [batch] = ({batch},), got "
                f"{lengths.dtype} {tuple(lengths.shape)}"
            )
        )
    return lengths


def _as_rank4(name: str, x: Any, rank: int) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim not in (3, 4) or x.ndim != rank:
        raise ValueError(
            _error(
                f"{name} must have rank {rank} like query ([batch, seq, heads, head_dim] or "
                f"[seq, heads, head_dim]), got shape {tuple(x.shape)}"
            )
        )
    return x if rank == 4 else x[None]


@overload
def dot_product_attention(
    query: jax.typing.ArrayLike,
    key: jax.typing.ArrayLike,
    value: jax.typing.ArrayLike,
    bias: None = None,
    mask: None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.typing.ArrayLike | None = None,
    key_value_seq_lengths: jax.typing.ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["jax_flash"] | None = None,
    return_residual: Literal[False] = False,
    deterministic: bool = False,
) -> jax.Array: ...


@overload
def dot_product_attention(
    query: jax.typing.ArrayLike,
    key: jax.typing.ArrayLike,
    value: jax.typing.ArrayLike,
    bias: None = None,
    mask: None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.typing.ArrayLike | None = None,
    key_value_seq_lengths: jax.typing.ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["jax_flash"] | None = None,
    return_residual: Literal[True],
    deterministic: bool = False,
) -> tuple[jax.Array, jax.Array]: ...


def dot_product_attention(
    query: jax.typing.ArrayLike,
    key: jax.typing.ArrayLike,
    value: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    mask: jax.typing.ArrayLike | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: jax.typing.ArrayLike | None = None,
    key_value_seq_lengths: jax.typing.ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["jax_flash"] | None = None,
    return_residual: bool = False,
    deterministic: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Drop-in replacement of :func:`jax.nn.dot_product_attention` on the jax_flash kernels.

    Same arguments, shapes and results as ``jax.nn.dot_product_attention(...,
    implementation="xla")``: query ``[B, T, N, H]`` or ``[T, N, H]``, key and value ``[B, S, K,
    H]`` or ``[S, K, H]`` with N a multiple of K (GQA, MQA).

    Args:
      query, key, value: one dtype (float16, bfloat16, float32 or float64), head dim <= 256.
      bias, mask: must be None. A dense bias or boolean mask has no fused kernel; the error names
        the supported alternatives (``is_causal``, sequence lengths, ``local_window_size``, and
        :func:`jax_flash.attention`'s ``segment_ids``, ``window`` and ``softcap``).
      scale: static finite number > 0; None means ``1/sqrt(H)``.
      is_causal: top-left aligned as in jax.nn: query i sees key j only if ``j <= i``.
      query_seq_lengths, key_value_seq_lengths: int32 ``[B]``: positions at or past the length
        are padding; padded keys are never seen.
      local_window_size: ``w`` or ``(left, right)``, ints >= 0: query i sees key j only if
        ``i - left <= j <= i + right``.
      implementation: None or ``"jax_flash"``; jax.nn's ``"xla"`` and ``"cudnn"`` are refused
        (call jax.nn for those).
      return_residual: also return the log-sum-exp of each row's logits, ``[B, T, N]`` (``[T,
        N]``) in the input dtype, with no gradient, as jax.nn does.
      deterministic: jax_flash's option (not jax.nn's): bitwise reproducible gradients on the
        GPU, as in :func:`jax_flash.attention`.

    Rows that see no key follow jax.nn's convention, not :func:`jax_flash.attention`'s: a padded
    query row (``query_seq_lengths``) gives output 0; any other row without a visible key (a
    ``key_value_seq_lengths`` of 0, a window past the keys) gives the mean of all ``S`` values of
    its key/value head, as jax.nn's uniform softmax over equally masked logits does, with the
    matching gradient (``1/S`` of the row's cotangent to each value). Their residual is jax.nn's
    masked-logit constant ``-0.7 * finfo(float32).max`` in the input dtype (-inf in float16).

    Differentiable in reverse mode (``jax.grad``, ``jax.vjp``, ``jax.jacrev``; works under
    ``jit`` and ``vmap``). Forward mode (``jax.jvp``, ``jax.jacfwd``) and second derivatives
    cannot pass through the kernels' custom VJP and raise an error saying so.

    Returns:
      The output, shaped like query, in its dtype (and the residual with ``return_residual``).
    """
    if implementation not in (None, IMPLEMENTATION):
        raise ValueError(
            _error(
                f"implementation must be None or {IMPLEMENTATION!r}, got {implementation!r}; "
                "for 'xla' or 'cudnn' call jax.nn.dot_product_attention"
            )
        )
    for name, given in (("bias", bias), ("mask", mask)):
        if given is not None:
            raise ValueError(
                _error(
                    f"a dense {name} has no fused kernel and is not supported; express the "
                    f"pattern with {_ALTERNATIVES}"
                )
            )
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(_error(f"is_causal must be a Python bool, got {is_causal!r}"))
    if not isinstance(return_residual, (bool, np.bool_)):
        raise TypeError(_error(f"return_residual must be a Python bool, got {return_residual!r}"))
    query = jnp.asarray(query)
    rank = query.ndim
    q, k, v = (_as_rank4(n, x, rank) for n, x in (("query", query), ("key", key), ("value", value)))
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    q_lengths = _check_lengths("query_seq_lengths", query_seq_lengths, batch)
    kv_lengths = _check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch)
    softmax_scale = _check_scale(scale, head_dim)
    window = _check_window(local_window_size)

    segment_ids = None
    if q_lengths is not None or kv_lengths is not None:
        # Valid positions share id 0; a padded query (id 1) and a padded key (id 2) match nothing.
        q_ids = jnp.zeros((batch, seqlen_q), jnp.int32)
        kv_ids = jnp.zeros((batch, seqlen_k), jnp.int32)
        if q_lengths is not None:
            q_ids = jnp.where(jnp.arange(seqlen_q) < q_lengths[:, None], 0, 1).astype(jnp.int32)
        if kv_lengths is not None:
            kv_ids = jnp.where(jnp.arange(seqlen_k) < kv_lengths[:, None], 0, 2).astype(jnp.int32)
        segment_ids = (q_ids, kv_ids)

    out, lse = dense_attention(
        NAME, q, k, v, causal=bool(is_causal), softmax_scale=softmax_scale, window=window,
        softcap=None, segment_ids=segment_ids, sinks=None, return_lse=True, bottom_right=False,
        deterministic=deterministic,
    )  # fmt: skip
    # [B, N, T] -> [B, T, N]
    lse = jnp.swapaxes(lse, -1, -2)
    empty = jnp.isneginf(lse)
    real_row = empty
    if q_lengths is not None:
        real_row = empty & (jnp.arange(seqlen_q) < q_lengths[:, None])[:, :, None]
    # jax.nn's uniform softmax over S equal logits: the mean value of the row's key/value head.
    mean_v = jnp.repeat(jnp.mean(v, axis=1), heads_q // heads_kv, axis=1)
    out = jnp.where(real_row[..., None], mean_v[:, None].astype(out.dtype), out)
    out = out if rank == 4 else out[0]
    if not return_residual:
        return out
    masked = jnp.asarray(-0.7 * float(jnp.finfo(jnp.float32).max), jnp.float32)
    residual = jnp.where(empty, masked.astype(lse.dtype), lse).astype(q.dtype)
    residual = jax.lax.stop_gradient(residual)
    return out, (residual if rank == 4 else residual[0])
