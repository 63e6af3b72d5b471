"""attention_with_kvcache: decoding against a key/value cache, contiguous or paged."""

from __future__ import annotations

from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _checks, _decode, sharding
from jax_flash._autodiff import forward_only
from jax_flash._kernel import Spec, stats_dtype
from jax_flash.attention import _require_kernels, _spec
from jax_flash.reference import Window

_NAME = "attention_with_kvcache"
_LAYOUT = (
    "[batch, seq, heads, head_dim] (a paged cache: [num_blocks, block_size, heads_kv, head_dim])"
)


# Under jit the call partitions over batch and heads (sharding.py), like attention's.
_decode_sharded = sharding.partitioned_decode(_decode.decode_local)


@forward_only(_NAME, n_static=2)
def _forward(q, k_cache, v_cache, cache_seqlens, block_table, sinks, spec, num_splits):
    return _decode_sharded(q, k_cache, v_cache, cache_seqlens, block_table, sinks, spec,
                           num_splits)  # fmt: skip


def _check_block_table(block_table: Any, batch: int) -> jax.Array | None:
    if block_table is None:
        return None
    if not hasattr(block_table, "shape") or not hasattr(block_table, "dtype"):
        raise TypeError(
            f"jax_flash.{_NAME}: block_table must be an int32 array [batch, max_blocks] or None, "
            f"got {type(block_table).__name__}"
        )
    if block_table.ndim != 2 or block_table.shape[1] < 1:
        raise ValueError(
            f"jax_flash.{_NAME}: block_table must have shape [batch, max_blocks] with "
            f"max_blocks >= 1, got {tuple(block_table.shape)}"
        )
    shape = (batch, block_table.shape[1])
    return _checks._int32_array(_NAME, "block_table", block_table, shape, "[batch, max_blocks]")


def _check_seqlens(cache_seqlens: Any, batch: int, capacity: int) -> jax.Array:
    """int32 [batch]; concrete values are also checked to lie in [0, capacity]. Traced ones
    cannot be; the kernels clamp them into the cache."""
    seqlens = _checks._int32_array(_NAME, "cache_seqlens", cache_seqlens, (batch,), "[batch]")
    try:
        values = np.asarray(cache_seqlens).astype(np.int64)
    except jax.errors.TracerArrayConversionError:
        return seqlens
    if (values < 0).any() or (values > capacity).any():
        raise ValueError(
            f"jax_flash.{_NAME}: cache_seqlens must lie in [0, {capacity}] (the keys the cache "
            f"holds per sequence), got {values}"
        )
    return seqlens


def kvcache_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_seqlens: jax.Array,
    *,
    block_table: jax.Array | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: Window = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`attention_with_kvcache` with the split count as a parameter (None: the host's
    choice, _decode.choose_num_splits), so that tests can compare split and unsplit calls."""
    _checks._check_tensors(_NAME, q, k_cache, v_cache, 4, _LAYOUT)
    batch, _, heads_q, head_dim = q.shape
    _checks._check_heads(_NAME, heads_q, k_cache.shape[2], head_dim, k_cache.shape[3])
    return_lse = _checks.check_bool(_NAME, "return_lse", return_lse)
    spec: Spec = _spec(
        _NAME, head_dim, causal=causal, softmax_scale=softmax_scale, window=window,
        softcap=softcap,
    )  # fmt: skip
    table = _check_block_table(block_table, batch)
    if table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(
                f"jax_flash.{_NAME}: k_cache and v_cache batch size {k_cache.shape[0]} must equal "
                f"q's batch size {batch} (or pass block_table for a paged cache)"
            )
        capacity = k_cache.shape[1]
    else:
        capacity = table.shape[1] * k_cache.shape[1]
    seqlens = _check_seqlens(cache_seqlens, batch, capacity)
    sinks = _checks.check_sinks(_NAME, sinks, heads_q)
    if num_splits is not None and (
        not _checks._static_int(num_splits) or not 1 <= num_splits <= 1024
    ):
        raise ValueError(f"jax_flash.{_NAME}: num_splits must be an int in [1, 1024] or None")
    _require_kernels(_NAME)
    q, k_cache, v_cache = (jnp.asarray(x) for x in (q, k_cache, v_cache))
    if sinks is not None:
        sinks = jnp.broadcast_to(sinks.astype(stats_dtype(q.dtype)), (batch, heads_q))
    out, lse = _forward(q, k_cache, v_cache, seqlens, table, sinks, spec, num_splits)
    return (out, lse) if return_lse else out


@overload
def attention_with_kvcache(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_seqlens: jax.Array,
    *,
    block_table: jax.Array | None = ...,
    causal: bool = ...,
    softmax_scale: float | None = ...,
    window: Window = ...,
    softcap: float | None = ...,
    sinks: jax.Array | None = ...,
    return_lse: Literal[False] = ...,
) -> jax.Array: ...


@overload
def attention_with_kvcache(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_seqlens: jax.Array,
    *,
    block_table: jax.Array | None = ...,
    causal: bool = ...,
    softmax_scale: float | None = ...,
    window: Window = ...,
    softcap: float | None = ...,
    sinks: jax.Array | None = ...,
    return_lse: Literal[True],
) -> tuple[jax.Array, jax.Array]: ...


def attention_with_kvcache(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_seqlens: jax.Array,
    *,
    block_table: jax.Array | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: Window = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of a few new query tokens per sequence over a key/value cache (decoding).

    Args:
      q: [batch, seqlen_q, heads_q, head_dim], the newest seqlen_q tokens of each sequence.
      k_cache, v_cache: without ``block_table``, [batch, max_seqlen, heads_kv, head_dim];
        with it, pages [num_blocks, block_size, heads_kv, head_dim] shared by the batch. heads_q
        is a multiple of heads_kv; both caches have q's dtype and head_dim.
      cache_seqlens: int32 [batch] (narrower integer types are widened, as for segment ids):
        sequence b holds keys 0 .. cache_seqlens[b] - 1, and its seqlen_q queries are its last
        seqlen_q positions. Cache entries past a sequence's length are never read. Concrete
        values must lie in [0, capacity]; traced ones are clamped into it.
      block_table: int32 [batch, max_blocks]: logical block j of sequence b (keys
        ``j * block_size ..``) lives in page ``block_table[b, j]``. Entries the sequence's length
        does not reach are never read. Valid page indices are the caller's responsibility: the
        kernels clamp them into [0, num_blocks), so a bad table gives wrong results, never an
        out-of-bounds read.
      causal: bottom-right aligned to the sequence's length: query i (of seqlen_q) sees key j
        only if ``j <= cache_seqlens[b] - seqlen_q + i``. On by default, as decoding needs.
      softmax_scale, window, softcap, sinks: as in :func:`jax_flash.attention`, with
        ``seqlen_k = cache_seqlens[b]`` per sequence.
      return_lse: also return lse [batch, heads_q, seqlen_q] (float32; float64 for float64).

    Returns out [batch, seqlen_q, heads_q, head_dim] in q's dtype (and lse). A query that sees
    no key (e.g. ``cache_seqlens[b] == 0``) gives 0 and lse -inf (its sink with sinks).

    Forward only: differentiating it raises :class:`jax_flash.ForwardModeError`. Works under
    ``jit`` and ``vmap`` (a vmapped paged call runs once per element).

    Example, one decoding step that appends the new token's key and value first::

        # Contiguous cache [B, S_max, Hkv, D]; pos [B] int32 is each sequence's length so far.
        def step(q, k_new, v_new, k_cache, v_cache, pos):  # q [B, 1, Hq, D], k_new [B, 1, Hkv, D]
            put = jax.vmap(lambda c, x, p: jax.lax.dynamic_update_slice(c, x, (p, 0, 0)))
            k_cache, v_cache = put(k_cache, k_new, pos), put(v_cache, v_new, pos)
            out = jax_flash.attention_with_kvcache(q, k_cache, v_cache, pos + 1)
            return out, k_cache, v_cache

        # Paged cache [num_blocks, block_size, Hkv, D]: scatter into the page of the new slot.
        page = block_table[jnp.arange(B), pos // block_size]
        k_pages = k_pages.at[page, pos % block_size].set(k_new[:, 0])
        v_pages = v_pages.at[page, pos % block_size].set(v_new[:, 0])
        out = jax_flash.attention_with_kvcache(q, k_pages, v_pages, pos + 1,
                                               block_table=block_table)
    """
    return kvcache_attention(
        q, k_cache, v_cache, cache_seqlens, block_table=block_table, causal=causal,
        softmax_scale=softmax_scale, window=window, softcap=softcap, sinks=sinks,
        return_lse=return_lse,
    )  # fmt: skip
