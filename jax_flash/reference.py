"""Plain attention in jax.numpy: the ground truth the kernels are tested and benchmarked against.

It materialises the full score matrix, so it is only for small problems. Call it on float64
inputs (with ``jax_enable_x64``) to get a float64 reference. It implements exactly the semantics
of :func:`jax_flash.attention` and :func:`jax_flash.attention_varlen`, written out directly
rather than through the kernels' tile policy.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

Window = tuple[int | None, int | None] | None


def band_mask(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool = False,
    window: Window = None,
    offset: int | None = None,
) -> jax.Array:
    """[Sq, Sk] boolean: query i sees key j iff ``i + off - left <= j <= i + off + right``.

    off = ``offset`` (default ``Sk - Sq``: bottom-right alignment); causal sets right = 0; a side
    of ``window`` that is None is unbounded.
    """
    off = seqlen_k - seqlen_q if offset is None else offset
    rows = jnp.arange(seqlen_q)[:, None]
    cols = jnp.arange(seqlen_k)[None, :]
    return _band(rows, cols, off, causal, window)


def causal_mask(seqlen_q: int, seqlen_k: int) -> jax.Array:
    """[Sq, Sk] boolean mask, bottom-right aligned: query i sees key j iff j <= i + Sk - Sq."""
    return band_mask(seqlen_q, seqlen_k, causal=True)


def _band(rows, cols, off, causal, window):
    left, right = (None, None) if window is None else window
    if causal:
        right = 0 if right is None else min(right, 0)
    visible = jnp.ones(jnp.broadcast_shapes(jnp.shape(rows), jnp.shape(cols)), bool)
    if left is not None:
        visible &= cols >= rows + off - left
    if right is not None:
        visible &= cols <= rows + off + right
    return visible


def _attend(q, k, v, visible, scale, softcap, sinks):
    """q [..., Sq, Hq, D], k/v [..., Sk, Hkv, D], visible broadcastable to [..., Hq, Sq, Sk];
    sinks broadcastable to [..., Hq] or None. Returns out and lse [..., Hq, Sq]."""
    group = q.shape[-2] // k.shape[-2]
    k = jnp.repeat(k, group, axis=-2)
    v = jnp.repeat(v, group, axis=-2)
    s = jnp.einsum("...qhd,...khd->...hqk", q, k) * jnp.asarray(scale, q.dtype)
    if softcap is not None:
        cap = jnp.asarray(softcap, q.dtype)
        s = cap * jnp.tanh(s / cap)
    s = jnp.where(visible, s, -jnp.inf)
    # The max only shifts the exponent; it carries no gradient of its own (lse and softmax are
    # invariant to it), and a fully masked row uses 0 so that exp(-inf - m) stays 0, not NaN.
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(s.dtype), s.shape[:-2])[..., None, None]
        m = jnp.maximum(m, sink)
    m = jax.lax.stop_gradient(m)
    m = jnp.where(jnp.isfinite(m), m, 0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    empty = denom == 0
    safe_denom = jnp.where(empty, 1, denom)
    out = jnp.einsum("...hqk,...khd->...qhd", p / safe_denom, v)
    lse = jnp.where(empty, -jnp.inf, jnp.log(safe_denom) + m)[..., 0]
    return out, lse


def _scale(q, softmax_scale):
    return q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: Window = None,
    softcap: float | None = None,
    segment_ids: jax.Array | Sequence[jax.Array] | None = None,
    sinks: jax.Array | None = None,
    return_lse: bool = False,
    diagonal_offset: int | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of q [B, Sq, Hq, D] over k, v [B, Sk, Hkv, D], computed in the inputs' dtype.

    Same contract as :func:`jax_flash.attention`: rows that see no key give output 0 and lse
    -inf (the sink with sinks), and their gradients are zero. ``diagonal_offset`` moves the
    diagonal that ``causal`` and ``window`` are measured from (default ``Sk - Sq``, bottom-right;
    0 is top-left).
    """
    seqlen_q, seqlen_k = q.shape[-3], k.shape[-3]
    visible = band_mask(seqlen_q, seqlen_k, causal=causal, window=window, offset=diagonal_offset)
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            q_ids, kv_ids = segment_ids
        else:
            q_ids = kv_ids = segment_ids
        # [B, Sq, Sk] -> [B, 1 (heads), Sq, Sk]
        visible = visible & (q_ids[..., :, None] == kv_ids[..., None, :])[..., None, :, :]
    out, lse = _attend(q, k, v, visible, _scale(q, softmax_scale), softcap, sinks)
    return (out, lse) if return_lse else out


def _token_positions(cu_seqlens, total):
    """Sequence index and position inside it of each of `total` packed tokens; index N (the
    number of sequences) for tokens past cu_seqlens[-1]."""
    tokens = jnp.arange(total)
    seq = jnp.searchsorted(cu_seqlens, tokens, side="right") - 1
    n = cu_seqlens.shape[0] - 1
    seq = jnp.where(tokens >= cu_seqlens[-1], n, seq)
    start = cu_seqlens[jnp.minimum(seq, n)]
    return seq, tokens - start


def attention_varlen_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: Window = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Packed attention: q [Tq, Hq, D], k/v [Tk, Hkv, D], sequence n is queries
    cu_seqlens_q[n]:cu_seqlens_q[n+1] over keys cu_seqlens_k[n]:cu_seqlens_k[n+1], each with its
    own bottom-right diagonal. Tokens past cu_seqlens_q[-1] give output 0 and lse -inf. lse is
    [Hq, Tq]."""
    n = cu_seqlens_q.shape[0] - 1
    q_seq, q_pos = _token_positions(cu_seqlens_q, q.shape[0])
    k_seq, k_pos = _token_positions(cu_seqlens_k, k.shape[0])
    len_q = jnp.diff(cu_seqlens_q)
    len_k = jnp.diff(cu_seqlens_k)
    off = (len_k - len_q)[jnp.minimum(q_seq, n - 1)] if n > 0 else jnp.zeros_like(q_seq)
    visible = (q_seq[:, None] == k_seq[None, :]) & (q_seq[:, None] < n)
    visible &= _band(q_pos[:, None], k_pos[None, :], off[:, None], causal, window)
    out, lse = _attend(q, k, v, visible, _scale(q, softmax_scale), softcap, sinks)
    lse = jnp.where(q_seq[None, :] < n, lse, -jnp.inf)
    return (out, lse) if return_lse else out
