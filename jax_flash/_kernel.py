"""The attention op as the kernels see it: static options, the per-platform FFI calls and the
custom VJP. The public entry points (attention.py) validate arguments and call `flash`."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _decode, _device_limits, _ffi, sharding
from jax_flash._autodiff import not_differentiable
from jax_flash._dtypes import is_half, pad_head_dim, stats_dtype

# Head dims the CUDA tensor-core kernels are compiled for (cpp/cuda/kernels.h). Other head dims
# are zero-padded up to the next one: zero columns change neither Q K^T nor the kept columns of O.
CUDA_TENSOR_CORE_HEAD_DIMS = (64, 128, 256)

# Segment ids reach the kernels with a (min, max) summary per this many positions
# (kSegmentChunk in cpp/common/mask.h).
SEGMENT_CHUNK = 16

# The CUDA wgmma kernels schedule a row of segment ids by its documents when its runs are
# documents (cpp/common/schedule.h, SeqLayout::runs): rows of at least SEGMENT_RUNS_MIN_LEN
# tokens, up to one document per SEGMENT_RUNS_TOKENS tokens and MAX_SEGMENT_RUNS in all. Every
# possible document costs each row an empty grid slot, hence the bound.
SEGMENT_RUNS_MIN_LEN = 2048
SEGMENT_RUNS_TOKENS = 512
MAX_SEGMENT_RUNS = 32  # kMaxRunsPerRow


def _lse_shape(q: jax.Array) -> tuple[int, ...]:
    # [..., Sq, Hq, D] -> [..., Hq, Sq]; leading axes include any that vmap added. A packed
    # q [Tq, Hq, D] gives [Hq, Tq].
    return (*q.shape[:-3], q.shape[-2], q.shape[-3])


def _cuda_head_dim(dtype: jnp.dtype, head_dim: int) -> int:
    if not is_half(dtype):
        return head_dim
    return next(d for d in CUDA_TENSOR_CORE_HEAD_DIMS if d >= head_dim)


@dataclasses.dataclass(frozen=True)
class Spec:
    """The static options of one call, as the FFI handlers take them (cpp/ffi/shapes.h)."""

    softmax_scale: float
    window_left: int = -1  # -1: unbounded
    window_right: int = -1  # -1: unbounded; causal arrives as 0
    # The band's diagonal: offset = (seqlen_k - seqlen_q if band_bottom_right else 0) + band_shift.
    band_shift: int = 0
    band_bottom_right: bool = True
    softcap: float = 0.0  # 0: none
    varlen: bool = False
    max_seqlen_q: int = -1  # -1: not given
    max_seqlen_k: int = -1
    # Backward on CUDA: dQ tiles add their key tiles' contributions in a fixed order.
    deterministic: bool = False

    # Attribute types must match the C++ side exactly: Python float -> double, int -> int64,
    # numpy bool -> bool.
    def score_attrs(self) -> dict:
        """The attributes of the scores and the band, which the attention and the decode calls
        share."""
        return {
            "softmax_scale": float(self.softmax_scale),
            "window_left": int(self.window_left),
            "window_right": int(self.window_right),
            "band_shift": int(self.band_shift),
            "band_bottom_right": np.bool_(self.band_bottom_right),
            "softcap": float(self.softcap),
        }

    def attrs(self, aux: Aux, segment_runs: int = 0) -> dict:
        return {
            **self.score_attrs(),
            "has_segments": np.bool_(aux.q_segment_ids is not None),
            "segment_runs": int(segment_runs),
            "has_sinks": np.bool_(aux.sinks is not None),
            "varlen": np.bool_(self.varlen),
            "max_seqlen_q": int(self.max_seqlen_q),
            "max_seqlen_k": int(self.max_seqlen_k),
            "deterministic": np.bool_(self.deterministic),
        }


class Aux(NamedTuple):
    """The optional inputs of a call; None where unused. sinks is the only differentiable one:
    [..., Hq] (the batch axes of q, or [1, Hq] for a packed call) in the stats dtype."""

    q_segment_ids: jax.Array | None = None  # int32 [..., Sq]
    kv_segment_ids: jax.Array | None = None  # int32 [..., Sk]
    sinks: jax.Array | None = None
    cu_seqlens_q: jax.Array | None = None  # int32 [N + 1]
    cu_seqlens_k: jax.Array | None = None


def _segment_ranges(ids: jax.Array, *, suffix_reach: bool) -> jax.Array:
    """[..., S] int32 -> [..., ceil(S / SEGMENT_CHUNK), 4], one record per chunk of positions
    (common/mask.h kSegmentRecord): the chunk's (min, max) id, then its reach, the (min, max)
    over every chunk at or after it (suffix_reach: query ids) or at or before it (key ids). The
    last chunk is padded with its last id, which widens no range."""
    pad = -ids.shape[-1] % SEGMENT_CHUNK
    if pad:
        ids = jnp.concatenate([ids, jnp.repeat(ids[..., -1:], pad, axis=-1)], axis=-1)
    chunks = ids.reshape(*ids.shape[:-1], -1, SEGMENT_CHUNK)
    lo, hi = chunks.min(axis=-1), chunks.max(axis=-1)
    axis = lo.ndim - 1
    reach_lo = jax.lax.cummin(lo, axis=axis, reverse=suffix_reach)
    reach_hi = jax.lax.cummax(hi, axis=axis, reverse=suffix_reach)
    return jnp.stack([lo, hi, reach_lo, reach_hi], axis=-1)


def segment_runs_per_row(q: jax.Array, k: jax.Array, aux: Aux) -> int:
    """Documents per row the CUDA kernels may schedule a segment-id call's rows by (0: none):
    half-precision inputs (the wgmma kernels), one sequence length for queries and keys, rows of
    at least SEGMENT_RUNS_MIN_LEN tokens."""
    seqlen = q.shape[-3]
    if aux.q_segment_ids is None or not is_half(q.dtype) or k.shape[-3] != seqlen:
        return 0
    if seqlen < SEGMENT_RUNS_MIN_LEN:
        return 0
    return min(MAX_SEGMENT_RUNS, seqlen // SEGMENT_RUNS_TOKENS)


def _segment_runs(q_ids: jax.Array, kv_ids: jax.Array, runs: int) -> jax.Array:
    """[..., S] int32 ids -> [..., runs] int32, each row's documents (common/schedule.h
    SeqLayout::runs): entry 0 is 1 when the row's runs are documents (no id forms two runs, at
    most `runs` runs, the query ids equal the key ids), entry j >= 1 the first position of run j
    (S past the last run). The definition in jnp (tests/test_schedule.py); calls get the record
    from the GPU's summary kernel, the only one that reads it."""
    i32 = jnp.int32
    seqlen = q_ids.shape[-1]
    # run[p - 1] = index of the run that position p (>= 1) belongs to.
    run = jnp.cumsum(q_ids[..., 1:] != q_ids[..., :-1], axis=-1, dtype=i32)
    count = run[..., -1] + 1
    # Run j starts after the positions of runs below j: 1 + #{p >= 1: run(p) < j} (S for j >=
    # count).
    j = jnp.arange(1, runs, dtype=i32)
    starts = 1 + jnp.sum(run[..., None, :] < j[:, None], axis=-1, dtype=i32)
    first = jnp.take_along_axis(q_ids, jnp.minimum(starts, seqlen - 1), axis=-1)
    ids = jnp.concatenate([q_ids[..., :1], first], axis=-1)
    index = jnp.arange(runs)
    later = (index[None, :] > index[:, None]) & (index[None, :] < count[..., None, None])
    repeated = jnp.any((ids[..., :, None] == ids[..., None, :]) & later, axis=(-2, -1))
    documents = (count <= runs) & ~repeated & jnp.all(q_ids == kv_ids, axis=-1)
    return jnp.concatenate([documents.astype(i32)[..., None], starts], axis=-1)


def _segment_summaries_cuda(
    q_ids: jax.Array, kv_ids: jax.Array, runs: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """_segment_ranges of both id arrays and (runs > 0) _segment_runs, computed on the GPU in one
    launch (cpp/cuda/segment_summaries.cu) instead of a dozen small XLA kernels. Without runs the
    third output is a placeholder of one element per row."""
    i32 = jnp.int32
    chunks = [-(-ids.shape[-1] // SEGMENT_CHUNK) for ids in (q_ids, kv_ids)]
    lead = q_ids.shape[:-1]
    out_types = (
        jax.ShapeDtypeStruct((*lead, chunks[0], 4), i32),
        jax.ShapeDtypeStruct((*kv_ids.shape[:-1], chunks[1], 4), i32),
        jax.ShapeDtypeStruct((*lead, max(runs, 1)), i32),
    )
    call = jax.ffi.ffi_call(_ffi.SEGMENTS_CUDA, out_types, vmap_method="broadcast_all")
    return call(q_ids, kv_ids, runs_per_row=int(runs))


def _extras(aux: Aux, dtype, segment_runs: int = 0, cuda: bool = False) -> tuple[jax.Array, ...]:
    """The eight optional FFI inputs in the order of ffi/shapes.h Extra, with one-element
    placeholders for the unused ones. cuda: the id summaries come from the GPU's own kernel, with
    the rows' documents where segment_runs > 0."""

    def given(x, placeholder_dtype):
        return jnp.zeros((1,), placeholder_dtype) if x is None else x

    i32 = jnp.int32
    runs = jnp.zeros((1,), i32)
    if aux.q_segment_ids is None:
        segments = (jnp.zeros((1,), i32),) * 4
    elif cuda:
        q_ranges, kv_ranges, runs = _segment_summaries_cuda(
            aux.q_segment_ids, aux.kv_segment_ids, segment_runs
        )
        segments = (aux.q_segment_ids, aux.kv_segment_ids, q_ranges, kv_ranges)
    else:
        # Only the CUDA kernels schedule rows by their documents (segment_runs_per_row).
        segments = (
            aux.q_segment_ids,
            aux.kv_segment_ids,
            _segment_ranges(aux.q_segment_ids, suffix_reach=True),
            _segment_ranges(aux.kv_segment_ids, suffix_reach=False),
        )
    return (
        *segments,
        given(aux.sinks, stats_dtype(dtype)),
        given(aux.cu_seqlens_q, i32),
        given(aux.cu_seqlens_k, i32),
        runs,
    )


def _vmap_method(spec: Spec) -> str:
    # Dense handlers fold every leading axis into the batch, so vmap over any axis is one launch.
    # A packed call has no batch axis to fold into: a vmapped one runs per element.
    return "sequential" if spec.varlen else "broadcast_all"


def _fwd_call(target, q, k, v, aux, spec, segment_runs=0, cuda=False):
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(_lse_shape(q), stats_dtype(q.dtype)),
    )
    if cuda:
        # The persistent forward's tile counter: XLA owns it, the launcher zeroes it on the stream.
        out_types += (jax.ShapeDtypeStruct((1,), jnp.int32),)
    call = jax.ffi.ffi_call(target, out_types, vmap_method=_vmap_method(spec))
    extras = _extras(aux, q.dtype, segment_runs, cuda)
    out, lse, *_ = call(q, k, v, *extras, **spec.attrs(aux, segment_runs))
    return out, lse


def _as_decode(q, k, aux, spec) -> tuple[jax.Array, ...] | None:
    """The decode kernel's operands for a forward that _decode.decode_applies to: every sequence
    holds all seqlen_k keys of its contiguous cache, with the same band, softcap and sinks."""
    if not _decode.decode_applies(
        q.shape[-3], k.shape[-3], varlen=spec.varlen, segments=aux.q_segment_ids is not None
    ):
        return None
    return jnp.full(q.shape[:-3], k.shape[-3], jnp.int32), None, aux.sinks


def _fwd_cpu(q, k, v, aux, *, spec):
    if (decode := _as_decode(q, k, aux, spec)) is not None:
        return _decode.decode_cpu(q, k, v, *decode, spec=spec)
    return _fwd_call(_ffi.FWD_CPU, q, k, v, aux, spec)


def _check_fits(q, aux, *, backward):
    if is_half(q.dtype):
        _device_limits.check_half_kernel_fits(
            backward=backward,
            head_dim=_cuda_head_dim(q.dtype, q.shape[-1]),
            segments=aux.q_segment_ids is not None,
        )


def _fwd_cuda(q, k, v, aux, *, spec):
    if (decode := _as_decode(q, k, aux, spec)) is not None:
        return _decode.decode_cuda(q, k, v, *decode, spec=spec)
    _check_fits(q, aux, backward=False)
    head_dim = q.shape[-1]
    padded = _cuda_head_dim(q.dtype, head_dim)
    q, k, v = (pad_head_dim(x, padded) for x in (q, k, v))
    runs = segment_runs_per_row(q, k, aux)
    out, lse = _fwd_call(_ffi.FWD_CUDA, q, k, v, aux, spec, runs, cuda=True)
    return out[..., :head_dim], lse


def _bwd_cpu(q, k, v, dout, lse, delta, aux, *, spec):
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
    )
    call = jax.ffi.ffi_call(_ffi.BWD_CPU, out_types, vmap_method=_vmap_method(spec))
    return call(q, k, v, dout, lse, delta, *_extras(aux, q.dtype), **spec.attrs(aux))


def _bwd_cuda(q, k, v, dout, lse, delta, aux, *, spec):
    _check_fits(q, aux, backward=True)
    head_dim = q.shape[-1]
    padded = _cuda_head_dim(q.dtype, head_dim)
    q, k, v, dout = (pad_head_dim(x, padded) for x in (q, k, v, dout))
    # The tensor-core backward accumulates dQ in fp32 with atomics; XLA owns that scratch so the
    # handler never allocates. The scalar path needs none and gets a placeholder.
    half = is_half(q.dtype)
    scratch_shape = q.shape if half else (1,)
    # The deterministic order's counters: two per dQ row and head (the scalar path needs none).
    semaphore_shape = (*q.shape[:-1], 2) if half and spec.deterministic else (1,)
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct(scratch_shape, jnp.float32),
        jax.ShapeDtypeStruct(semaphore_shape, jnp.int32),
    )
    call = jax.ffi.ffi_call(_ffi.BWD_CUDA, out_types, vmap_method=_vmap_method(spec))
    runs = segment_runs_per_row(q, k, aux)
    extras = _extras(aux, q.dtype, runs, cuda=True)
    dq, dk, dv, *_ = call(q, k, v, dout, lse, delta, *extras, **spec.attrs(aux, runs))
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]


def _forward_local(q, k, v, aux, spec):
    return jax.lax.platform_dependent(
        q,
        k,
        v,
        aux,
        cpu=functools.partial(_fwd_cpu, spec=spec),
        cuda=functools.partial(_fwd_cuda, spec=spec),
    )


def _backward_local(q, k, v, dout, lse, delta, aux, spec):
    return jax.lax.platform_dependent(
        q,
        k,
        v,
        dout,
        lse,
        delta,
        aux,
        cpu=functools.partial(_bwd_cpu, spec=spec),
        cuda=functools.partial(_bwd_cuda, spec=spec),
    )


# The kernel calls as the partitioner sees them: under jit they shard over batch and heads with
# no collective (sharding.py).
_forward_sharded = sharding.partitioned("forward", _forward_local)
_backward_sharded = sharding.partitioned("backward", _backward_local)


# Differentiating a kernel call itself (a derivative of the custom VJP) raises jax_flash's error
# before the partitioner's own.
@not_differentiable
def _forward(q, k, v, aux, spec):
    return _forward_sharded(q, k, v, aux, spec)


@not_differentiable
def _backward(q, k, v, dout, lse, delta, aux, spec):
    return _backward_sharded(q, k, v, dout, lse, delta, aux, spec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def flash(q: jax.Array, k: jax.Array, v: jax.Array, aux: Aux, spec: Spec):
    """(out, lse) of attention; differentiable in q, k, v, aux.sinks and through lse."""
    return _forward(q, k, v, aux, spec)


def _flash_fwd(q, k, v, aux, spec):
    out, lse = _forward(q, k, v, aux, spec)
    return (out, lse), (q, k, v, aux, out, lse)


def _flash_bwd(spec, residuals, cotangents):
    q, k, v, aux, out, lse = residuals
    dout, dlse = cotangents
    acc = stats_dtype(q.dtype)
    # delta_i = sum_d dO_id O_id is the softmax backward's row term; a cotangent on lse_i adds
    # dlse_i * P_ij to dS_ij, which is the same as subtracting dlse_i from delta_i.
    delta = jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1)
    delta = jnp.swapaxes(delta, -1, -2) - dlse.astype(acc)
    dq, dk, dv = _backward(q, k, v, dout.astype(q.dtype), lse, delta, aux, spec)
    dsinks = None
    if aux.sinks is not None:
        # The sink enters row i's softmax with probability P_sink_i = exp(sink - lse_i) and no
        # value, so d(sink) = sum_i P_sink_i * (dlse_i - dO_i . O_i) = -sum_i P_sink_i delta_i.
        # A sink of -inf is no sink: its probability is 0 even in rows whose lse is -inf too.
        sink = aux.sinks.astype(acc)[..., None]
        p_sink = jnp.where(jnp.isneginf(sink), 0, jnp.exp(sink - lse))
        dsinks = -jnp.sum(p_sink * delta, axis=-1).astype(aux.sinks.dtype)
    d_aux = Aux(sinks=dsinks)
    return dq, dk, dv, d_aux


flash.defvjp(_flash_fwd, _flash_bwd)
