"""The public attention op: trace-time checks, a custom VJP, and the per-platform FFI calls."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _checks, _ffi

# Head dims the CUDA tensor-core kernels are compiled for (cpp/cuda/kernels.h). Other head dims
# are zero-padded up to the next one: zero columns change neither Q K^T nor the kept columns of O.
CUDA_TENSOR_CORE_HEAD_DIMS = (64, 128, 256)

_HALF_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def _stats_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """dtype of lse and delta: float64 for float64 inputs, float32 otherwise."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def _lse_shape(q: jax.Array) -> tuple[int, ...]:
    # [..., Sq, Hq, D] -> [..., Hq, Sq]; leading axes include any that vmap added.
    return (*q.shape[:-3], q.shape[-2], q.shape[-3])


def _cuda_head_dim(dtype: jnp.dtype, head_dim: int) -> int:
    if jnp.dtype(dtype) not in _HALF_DTYPES:
        return head_dim
    return next(d for d in CUDA_TENSOR_CORE_HEAD_DIMS if d >= head_dim)


def _pad_head_dim(x: jax.Array, head_dim: int) -> jax.Array:
    extra = head_dim - x.shape[-1]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The static options of one call, as the FFI handlers take them (cpp/ffi/shapes.h)."""

    softmax_scale: float
    window_left: int = -1  # -1: unbounded
    window_right: int = -1  # -1: unbounded; causal is 0
    softcap: float = 0.0  # 0: none
    has_segments: bool = False
    has_sinks: bool = False
    varlen: bool = False
    max_seqlen_q: int = -1  # -1: not given
    max_seqlen_k: int = -1

    def attrs(self) -> dict:
        # Attribute types must match the C++ side exactly: Python float -> double, int -> int64,
        # numpy bool -> bool.
        return {
            "softmax_scale": float(self.softmax_scale),
            "window_left": int(self.window_left),
            "window_right": int(self.window_right),
            "softcap": float(self.softcap),
            "has_segments": np.bool_(self.has_segments),
            "has_sinks": np.bool_(self.has_sinks),
            "varlen": np.bool_(self.varlen),
            "max_seqlen_q": int(self.max_seqlen_q),
            "max_seqlen_k": int(self.max_seqlen_k),
        }


def _placeholder(dtype) -> jax.Array:
    return jnp.zeros((1,), dtype)


def _no_extras(dtype) -> tuple[jax.Array, ...]:
    """The seven optional FFI inputs (ffi/shapes.h Extra), all unused."""
    i32 = jnp.int32
    return (*(_placeholder(i32) for _ in range(4)), _placeholder(dtype), *(_placeholder(i32),) * 2)


def _fwd_call(target, q, k, v, extras, spec):
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(_lse_shape(q), _stats_dtype(q.dtype)),
    )
    # The handlers fold every leading axis into the batch, so vmap over any axis is one launch.
    call = jax.ffi.ffi_call(target, out_types, vmap_method="broadcast_all")
    return call(q, k, v, *extras, **spec.attrs())


def _fwd_cpu(q, k, v, extras, *, spec):
    return _fwd_call(_ffi.FWD_CPU, q, k, v, extras, spec)


def _fwd_cuda(q, k, v, extras, *, spec):
    head_dim = q.shape[-1]
    padded = _cuda_head_dim(q.dtype, head_dim)
    q, k, v = (_pad_head_dim(x, padded) for x in (q, k, v))
    out, lse = _fwd_call(_ffi.FWD_CUDA, q, k, v, extras, spec)
    return out[..., :head_dim], lse


def _bwd_cpu(q, k, v, dout, lse, delta, extras, *, spec):
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
    )
    call = jax.ffi.ffi_call(_ffi.BWD_CPU, out_types, vmap_method="broadcast_all")
    return call(q, k, v, dout, lse, delta, *extras, **spec.attrs())


def _bwd_cuda(q, k, v, dout, lse, delta, extras, *, spec):
    head_dim = q.shape[-1]
    padded = _cuda_head_dim(q.dtype, head_dim)
    q, k, v, dout = (_pad_head_dim(x, padded) for x in (q, k, v, dout))
    # The tensor-core backward accumulates dQ in fp32 with atomics; XLA owns that scratch so the
    # handler never allocates. The scalar path needs none and gets a placeholder.
    scratch_shape = q.shape if jnp.dtype(q.dtype) in _HALF_DTYPES else (1,)
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct(scratch_shape, jnp.float32),
    )
    call = jax.ffi.ffi_call(_ffi.BWD_CUDA, out_types, vmap_method="broadcast_all")
    dq, dk, dv, _ = call(q, k, v, dout, lse, delta, *extras, **spec.attrs())
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]


def _forward(q, k, v, extras, spec):
    return jax.lax.platform_dependent(
        q,
        k,
        v,
        extras,
        cpu=functools.partial(_fwd_cpu, spec=spec),
        cuda=functools.partial(_fwd_cuda, spec=spec),
    )


def _backward(q, k, v, dout, lse, delta, extras, spec):
    return jax.lax.platform_dependent(
        q,
        k,
        v,
        dout,
        lse,
        delta,
        extras,
        cpu=functools.partial(_bwd_cpu, spec=spec),
        cuda=functools.partial(_bwd_cuda, spec=spec),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, extras, spec):
    return _forward(q, k, v, extras, spec)


def _flash_fwd(q, k, v, extras, spec):
    out, lse = _forward(q, k, v, extras, spec)
    return (out, lse), (q, k, v, extras, out, lse)


def _flash_bwd(spec, residuals, cotangents):
    q, k, v, extras, out, lse = residuals
    dout, dlse = cotangents
    acc = _stats_dtype(q.dtype)
    # delta_i = sum_d dO_id O_id is the softmax backward's row term; a cotangent on lse_i adds
    # dlse_i * P_ij to dS_ij, which is the same as subtracting dlse_i from delta_i.
    delta = jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1)
    delta = jnp.swapaxes(delta, -1, -2) - dlse.astype(acc)
    dq, dk, dv = _backward(q, k, v, dout.astype(q.dtype), lse, delta, extras, spec)
    d_extras = tuple(
        jnp.zeros_like(x) if jnp.issubdtype(x.dtype, jnp.floating) else None for x in extras
    )
    return dq, dk, dv, d_extras


_flash.defvjp(_flash_fwd, _flash_bwd)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Exact softmax attention without materialising the score matrix.

    Args:
      q: queries, [batch, seqlen_q, heads_q, head_dim].
      k: keys, [batch, seqlen_k, heads_kv, head_dim]; heads_q must be a multiple of heads_kv
        (grouped-query and multi-query attention).
      v: values, same shape as k.
      causal: mask aligned to the bottom-right corner: query i sees key j iff
        j <= i + seqlen_k - seqlen_q. Rows that see no key give output 0 and lse -inf.
      softmax_scale: multiplies q k^T; defaults to 1/sqrt(head_dim). A static finite positive
        number.
      return_lse: also return the natural-log log-sum-exp of each row, [batch, heads_q,
        seqlen_q], which is differentiable too.

    q, k, v share one dtype: float16, bfloat16, float32 or float64; head_dim is 1..256.

    Returns:
      out [batch, seqlen_q, heads_q, head_dim] in the input dtype, and with ``return_lse`` also
      lse (float32, or float64 for float64 inputs).
    """
    _checks.check_inputs(q, k, v)
    causal = _checks.check_bool("causal", causal)
    return_lse = _checks.check_bool("return_lse", return_lse)
    scale = _checks.check_softmax_scale(softmax_scale, q.shape[-1])
    if not _ffi.HAS_CUDA and _ffi.cuda_devices_present():
        raise RuntimeError(
            "jax_flash.attention: JAX sees a CUDA GPU but this jax_flash build has no CUDA "
            "kernels; reinstall it on a machine with nvcc (see README, 'Building for GPUs')"
        )
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    spec = _Spec(softmax_scale=scale, window_right=0 if causal else -1)
    out, lse = _flash(q, k, v, _no_extras(_stats_dtype(q.dtype)), spec)
    return (out, lse) if return_lse else out
