"""jax_flash attention as the ``attention_fn`` of Flax's attention layers (linen and nnx).

``flax.linen.MultiHeadDotProductAttention`` passes only the keyword arguments that its
``attention_fn`` names, and ``flax.nnx.MultiHeadAttention`` passes them all, so
:func:`attention_fn` names every one of them and refuses what the kernels cannot honour (a dense
mask or bias, active dropout, custom einsums, returning the attention weights) instead of
dropping it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

try:
    import flax  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "jax_flash.flax needs Flax (pip install flax); jax_flash itself works without it"
    ) from exc

import jax
import jax.numpy as jnp

from jax_flash.attention import dense_attention
from jax_flash.reference import Window

NAME = "flax.attention_fn"

_ALTERNATIVES = (
    "is_causal (bind it with functools.partial for linen), or the keyword-only options window, "
    "segment_ids and softcap"
)


def _refuse(text: str) -> ValueError:
    return ValueError(f"jax_flash.{NAME}: {text}")


def attention_fn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool | None = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    promote_dtype: Callable | None = None,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum: Callable | None = None,
    attn_weights_value_einsum: Callable | None = None,
    *,
    window: Window = None,
    softcap: float | None = None,
    softmax_scale: float | None = None,
    segment_ids: jax.Array | Sequence[jax.Array] | None = None,
    sinks: jax.Array | None = None,
    deterministic_backward: bool = False,
) -> jax.Array:
    """Flax's attention-function signature, computed by the jax_flash kernels.

    Use it as ``attention_fn=`` of ``flax.nnx.MultiHeadAttention`` (its ``num_kv_heads`` and its
    ``is_causal`` call argument work) or of ``flax.linen.MultiHeadDotProductAttention`` (which
    never passes ``is_causal``: bind it, ``functools.partial(attention_fn, is_causal=True)``).
    The keyword-only jax_flash options are bound the same way.

    Args:
      query: ``[batch..., q_length, num_heads, head_dim]``; any number of batch axes, or none.
      key, value: ``[batch..., kv_length, num_kv_heads, head_dim]``; num_heads a multiple of
        num_kv_heads.
      bias, mask: must be None: a dense bias or mask has no fused kernel. Causal masks, padding
        and packed documents are expressed with ``is_causal``, ``segment_ids`` and ``window``.
      broadcast_dropout, dropout_rng: accepted; unused, since dropout is refused.
      dropout_rate, deterministic: dropout of the attention weights is not implemented, so a
        ``dropout_rate`` > 0 is refused unless ``deterministic`` is True.
      dtype: compute dtype; q, k and v are cast to it (default: their promoted dtype).
      precision: accepted and not needed: the kernels' float32 is exact float32 (no TF32), and
        float16/bfloat16 accumulate in float32.
      module: must be None; Flax sets it for ``sow_weights=True``, and the kernels never form
        the attention weights.
      promote_dtype: Flax's dtype promotion function; when given it replaces the default cast.
      is_causal: top-left aligned causal mask, as in Flax and jax.nn: query i sees key j only if
        ``j <= i``.
      force_fp32_for_softmax: accepted; the softmax is always computed in float32 or wider.
      qk_attn_weights_einsum, attn_weights_value_einsum: must be None (custom einsums cannot
        reach the kernels).
      window: ``(left, right)``, query i sees key j only if ``i - left <= j <= i + right``.
      softcap, softmax_scale, segment_ids, sinks: as in :func:`jax_flash.attention`
        (``segment_ids`` and ``sinks`` shaped for one batch axis, the flattened batch).
      deterministic_backward: :func:`jax_flash.attention`'s ``deterministic`` (bitwise
        reproducible gradients on the GPU), under another name because Flax's
        ``deterministic`` means "no dropout".

    Rows that see no key (only possible through ``window`` or ``segment_ids``) give output 0.
    Differentiable in reverse mode under ``jit`` and ``vmap``.

    Returns:
      ``[batch..., q_length, num_heads, head_dim]``.
    """
    if bias is not None:
        raise _refuse(f"a dense bias has no fused kernel and is not supported; use {_ALTERNATIVES}")
    if mask is not None:
        raise _refuse(
            f"a dense mask has no fused kernel and is not supported; use {_ALTERNATIVES} "
            "(an autoregressive decode cache passes a mask too)"
        )
    if module is not None:
        raise _refuse(
            "returning the attention weights (sow_weights=True, module=...) is not supported: the "
            "kernels never form the attention matrix; call the layer with sow_weights=False"
        )
    if dropout_rate != 0.0 and not deterministic:
        raise _refuse(
            f"attention dropout is not implemented (dropout_rate={dropout_rate!r} with "
            "deterministic=False); use dropout_rate=0.0 or deterministic=True"
        )
    for name, given in (
        ("qk_attn_weights_einsum", qk_attn_weights_einsum),
        ("attn_weights_value_einsum", attn_weights_value_einsum),
    ):
        if given is not None:
            raise _refuse(f"{name} must be None: a custom einsum cannot run inside the kernels")
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax

    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
        common = jnp.dtype(dtype) if dtype is not None else jnp.result_type(query, key, value)
        query, key, value = (jnp.asarray(x).astype(common) for x in (query, key, value))
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim < 3:
            raise _refuse(
                f"{name} must be [batch..., length, heads, head_dim], got {tuple(x.shape)}"
            )
    batch_shape = query.shape[:-3]
    batch = math.prod(batch_shape)

    def flat(x):
        return x.reshape(batch, *x.shape[-3:])

    out = dense_attention(
        NAME, flat(query), flat(key), flat(value), causal=is_causal,
        softmax_scale=softmax_scale, window=window, softcap=softcap, segment_ids=segment_ids,
        sinks=sinks, return_lse=False, bottom_right=False, deterministic=deterministic_backward,
    )  # fmt: skip
    return out.reshape(*batch_shape, *out.shape[1:])
