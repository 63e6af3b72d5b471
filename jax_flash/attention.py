"""The public attention entry points: argument checks at trace time, then the kernel op."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, overload

import jax
import jax.numpy as jnp

from jax_flash import _checks, _ffi
from jax_flash._autodiff import reject_forward_mode
from jax_flash._kernel import Aux, Spec, flash, stats_dtype
from jax_flash.reference import Window

_NO_BOUND = 2**31


def _require_kernels(name: str) -> None:
    if not _ffi.HAS_CUDA and _ffi.cuda_devices_present():
        raise RuntimeError(
            f"jax_flash.{name}: JAX sees a CUDA GPU but this jax_flash build has no CUDA "
            "kernels; reinstall it on a machine with nvcc (see README, 'Building for GPUs')"
        )


def _spec(
    name, head_dim, *, causal, softmax_scale, window, softcap, deterministic=False, **extra
) -> Spec:
    causal = _checks.check_bool(name, "causal", causal)
    left, right = _checks.check_window(name, window)
    # Positions are below 2^31, so a bound that large excludes nothing: it is no bound, and the
    # kernels' position arithmetic never sees it.
    left, right = (None if b is not None and b >= _NO_BOUND else b for b in (left, right))
    if causal:
        # With causal, a right bound above 0 changes nothing.
        right = 0
    return Spec(
        softmax_scale=_checks.check_softmax_scale(softmax_scale, head_dim, name),
        window_left=-1 if left is None else left,
        window_right=-1 if right is None else right,
        softcap=_checks.check_softcap(name, softcap),
        deterministic=_checks.check_bool(name, "deterministic", deterministic),
        **extra,
    )


@overload
def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = ...,
    softmax_scale: float | None = ...,
    window: Window = ...,
    softcap: float | None = ...,
    segment_ids: jax.Array | Sequence[jax.Array] | None = ...,
    sinks: jax.Array | None = ...,
    return_lse: Literal[False] = ...,
    deterministic: bool = ...,
) -> jax.Array: ...


@overload
def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = ...,
    softmax_scale: float | None = ...,
    window: Window = ...,
    softcap: float | None = ...,
    segment_ids: jax.Array | Sequence[jax.Array] | None = ...,
    sinks: jax.Array | None = ...,
    return_lse: Literal[True],
    deterministic: bool = ...,
) -> tuple[jax.Array, jax.Array]: ...


def attention(
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
    deterministic: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Exact softmax attention without materialising the score matrix.

    Args:
      q: queries, [batch, seqlen_q, heads_q, head_dim].
      k: keys, [batch, seqlen_k, heads_kv, head_dim]; heads_q must be a multiple of heads_kv
        (grouped-query and multi-query attention).
      v: values, same shape as k.
      causal: aligned to the bottom-right corner: query i sees key j only if
        j <= i + seqlen_k - seqlen_q.
      softmax_scale: multiplies q k^T; defaults to 1/sqrt(head_dim). A static finite positive
        number.
      window: ``(left, right)`` sliding window, each a static int >= 0 or None (unbounded): query
        i sees key j only if ``i + off - left <= j <= i + off + right``, off = seqlen_k - seqlen_q.
        With ``causal=True`` the right bound is 0 whatever is given.
      softcap: logit soft-capping (Gemma 2): scores become ``softcap * tanh(s / softcap)``. A
        static finite number > 0, or None.
      segment_ids: ``(q_ids [batch, seqlen_q], kv_ids [batch, seqlen_k])`` int32, or one
        ``[batch, seq]`` array when seqlen_q == seqlen_k: query i sees key j only if their ids
        are equal (with ``causal``, document masking of packed rows). On the GPU (float16 and
        bfloat16) a row whose runs of ids are documents (each id one run; rows of at least 2048
        tokens with at most one document per 512, 32 in all) is scheduled document by document,
        like :func:`attention_varlen`; other rows are masked element by element (equal up to
        rounding).
      sinks: ``[heads_q]`` floating, differentiable: one extra logit per query head in every
        row's softmax denominator, with no value (computed in float32, float64 for float64
        inputs); lse includes it.
      return_lse: also return the natural-log log-sum-exp of each row, [batch, heads_q,
        seqlen_q], which is differentiable too.
      deterministic: a static bool. True makes the GPU backward add the contributions to each
        dQ tile in a fixed order (key tiles ascending), so gradients are bitwise reproducible
        from run to run. The default adds them with fp32 atomics in whatever order the key
        tiles get there: faster, and equal to the last bits only. With segment ids the
        deterministic backward computes every tile pair of the band (disjoint ones add zeros)
        instead of skipping them, except in rows scheduled by their documents. The forward
        and the CPU backward are deterministic either way.

    q, k, v share one dtype: float16, bfloat16, float32 or float64; head_dim is 1..256. A row that
    sees no key gives output 0, lse -inf (the row's sink with sinks) and zero gradients.

    Short query blocks (1 <= seqlen_q <= 16, seqlen_k >= 256, no segment_ids) run the forward on
    the split-KV decode kernel of :func:`attention_with_kvcache`, which returns the same out and
    lse; the backward is the same either way.

    Returns:
      out [batch, seqlen_q, heads_q, head_dim] in the input dtype, and with ``return_lse`` also
      lse (float32, or float64 for float64 inputs).
    """
    return dense_attention(
        "attention", q, k, v, causal=causal, softmax_scale=softmax_scale, window=window,
        softcap=softcap, segment_ids=segment_ids, sinks=sinks, return_lse=return_lse,
        deterministic=deterministic,
    )  # fmt: skip


def dense_attention(
    name: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool,
    softmax_scale: float | None,
    window: Window,
    softcap: float | None,
    segment_ids: jax.Array | Sequence[jax.Array] | None,
    sinks: jax.Array | None,
    return_lse: bool,
    bottom_right: bool = True,
    diagonal_shift: int = 0,
    deterministic: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """:func:`attention` with the band's diagonal as a parameter, for the package's other entry
    points: offset = (seqlen_k - seqlen_q if bottom_right else 0) + diagonal_shift, a static int
    with |diagonal_shift| <= 2^31. ``name`` is the entry point the error messages name."""
    _checks.check_inputs(q, k, v, name)
    reject_forward_mode(name, q, k, v, sinks)
    return_lse = _checks.check_bool(name, "return_lse", return_lse)
    bottom_right = _checks.check_bool(name, "bottom_right", bottom_right)
    diagonal_shift = _checks.check_diagonal_shift(name, diagonal_shift)
    spec = _spec(
        name, q.shape[-1], causal=causal, softmax_scale=softmax_scale, window=window,
        softcap=softcap, band_shift=diagonal_shift, band_bottom_right=bottom_right,
        deterministic=deterministic,
    )  # fmt: skip
    batch, seqlen_q, heads_q = q.shape[0], q.shape[1], q.shape[2]
    q_ids, kv_ids = _checks.check_segment_ids(segment_ids, batch, seqlen_q, k.shape[1])
    sinks = _checks.check_sinks(name, sinks, heads_q)
    _require_kernels(name)
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    if sinks is not None:
        # One row per batch element, so that vmap folding leading axes into the batch keeps each
        # row's sinks beside it.
        sinks = jnp.broadcast_to(sinks.astype(stats_dtype(q.dtype)), (batch, heads_q))
    aux = Aux(q_segment_ids=q_ids, kv_segment_ids=kv_ids, sinks=sinks)
    out, lse = flash(q, k, v, aux, spec)
    return (out, lse) if return_lse else out


@overload
def attention_varlen(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    max_seqlen_q: int | None = ...,
    max_seqlen_k: int | None = ...,
    causal: bool = ...,
    softmax_scale: float | None = ...,
    window: Window = ...,
    softcap: float | None = ...,
    sinks: jax.Array | None = ...,
    return_lse: Literal[False] = ...,
    deterministic: bool = ...,
) -> jax.Array: ...


@overload
def attention_varlen(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    max_seqlen_q: int | None = ...,
    max_seqlen_k: int | None = ...,
    causal: bool = ...,
    softmax_scale: float | None = ...,
    window: Window = ...,
    softcap: float | None = ...,
    sinks: jax.Array | None = ...,
    return_lse: Literal[True],
    deterministic: bool = ...,
) -> tuple[jax.Array, jax.Array]: ...


def attention_varlen(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window: Window = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention over a packed batch of variable-length sequences (no padding).

    Args:
      q: [total_q, heads_q, head_dim], the queries of all sequences back to back.
      k, v: [total_k, heads_kv, head_dim].
      cu_seqlens_q, cu_seqlens_k: int32 [num_seqs + 1], non-decreasing from 0: sequence n is
        queries ``cu_seqlens_q[n]:cu_seqlens_q[n+1]`` attending keys
        ``cu_seqlens_k[n]:cu_seqlens_k[n+1]``. Empty sequences are allowed. Tokens past
        ``cu_seqlens_q[-1]`` get output 0, lse -inf and zero gradients.
      max_seqlen_q, max_seqlen_k: optional static upper bounds of the sequence lengths; they can
        only help choose a kernel configuration, never change a result.
      causal, softmax_scale, window, softcap, sinks: as in :func:`attention`, per sequence (the
        diagonal of sequence n is its own bottom-right corner).
      deterministic: as in :func:`attention`.
      return_lse: also return lse, [heads_q, total_q].

    Returns out [total_q, heads_q, head_dim] (and lse). Works under jit and grad; vmap runs one
    call per element.
    """
    name = "attention_varlen"
    _checks.check_varlen_inputs(q, k, v)
    reject_forward_mode(name, q, k, v, sinks)
    return_lse = _checks.check_bool(name, "return_lse", return_lse)
    max_q = _checks.check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _checks.check_max_seqlen("max_seqlen_k", max_seqlen_k)
    cu_q, cu_k = _checks.check_cu_seqlens(
        cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_q, max_k
    )
    spec = _spec(
        name, q.shape[-1], causal=causal, softmax_scale=softmax_scale, window=window,
        softcap=softcap, varlen=True, max_seqlen_q=max_q, max_seqlen_k=max_k,
        deterministic=deterministic,
    )  # fmt: skip
    heads_q = q.shape[1]
    sinks = _checks.check_sinks(name, sinks, heads_q)
    _require_kernels(name)
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    if sinks is not None:
        sinks = sinks.astype(stats_dtype(q.dtype))[None, :]
    aux = Aux(sinks=sinks, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = flash(q, k, v, aux, spec)
    if not return_lse:
        return out
    # Tokens past the last sequence belong to none: their lse is -inf (with sinks the kernel
    # leaves the sink there, as for any row without keys).
    padding = jnp.arange(q.shape[0]) >= cu_q[-1]
    return out, jnp.where(padding[None, :], -jnp.inf, lse)
