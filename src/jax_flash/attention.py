"""The public attention op: trace-time checks, a custom VJP, and the per-platform FFI calls."""

from __future__ import annotations

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


def _attrs(softmax_scale: float, causal: bool) -> dict:
    # Python float -> double attribute, numpy bool -> bool attribute (types must match exactly).
    return {"softmax_scale": float(softmax_scale), "causal": np.bool_(causal)}


def _fwd_call(target, q, k, v, softmax_scale, causal):
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(_lse_shape(q), _stats_dtype(q.dtype)),
    )
    # The handlers fold every leading axis into the batch, so vmap over any axis is one launch.
    call = jax.ffi.ffi_call(target, out_types, vmap_method="broadcast_all")
    return call(q, k, v, **_attrs(softmax_scale, causal))


def _fwd_cpu(q, k, v, *, softmax_scale, causal):
    return _fwd_call(_ffi.FWD_CPU, q, k, v, softmax_scale, causal)


def _fwd_cuda(q, k, v, *, softmax_scale, causal):
    head_dim = q.shape[-1]
    padded = _cuda_head_dim(q.dtype, head_dim)
    q, k, v = (_pad_head_dim(x, padded) for x in (q, k, v))
    out, lse = _fwd_call(_ffi.FWD_CUDA, q, k, v, softmax_scale, causal)
    return out[..., :head_dim], lse


def _bwd_cpu(q, k, v, dout, lse, delta, *, softmax_scale, causal):
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
    )
    call = jax.ffi.ffi_call(_ffi.BWD_CPU, out_types, vmap_method="broadcast_all")
    return call(q, k, v, dout, lse, delta, **_attrs(softmax_scale, causal))


def _bwd_cuda(q, k, v, dout, lse, delta, *, softmax_scale, causal):
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
    dq, dk, dv, _ = call(q, k, v, dout, lse, delta, **_attrs(softmax_scale, causal))
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim]


def _forward(q, k, v, softmax_scale, causal):
    kw = {"softmax_scale": softmax_scale, "causal": causal}
    return jax.lax.platform_dependent(
        q,
        k,
        v,
        cpu=functools.partial(_fwd_cpu, **kw),
        cuda=functools.partial(_fwd_cuda, **kw),
    )


def _backward(q, k, v, dout, lse, delta, softmax_scale, causal):
    kw = {"softmax_scale": softmax_scale, "causal": causal}
    return jax.lax.platform_dependent(
        q,
        k,
        v,
        dout,
        lse,
        delta,
        cpu=functools.partial(_bwd_cpu, **kw),
        cuda=functools.partial(_bwd_cuda, **kw),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _flash(q, k, v, softmax_scale, causal):
    return _forward(q, k, v, softmax_scale, causal)


def _flash_fwd(q, k, v, softmax_scale, causal):
    out, lse = _forward(q, k, v, softmax_scale, causal)
    return (out, lse), (q, k, v, out, lse)


def _flash_bwd(softmax_scale, causal, residuals, cotangents):
    q, k, v, out, lse = residuals
    dout, dlse = cotangents
    acc = _stats_dtype(q.dtype)
    # delta_i = sum_d dO_id O_id is the softmax backward's row term; a cotangent on lse_i adds
    # dlse_i * P_ij to dS_ij, which is the same as subtracting dlse_i from delta_i.
    delta = jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1)
    delta = jnp.swapaxes(delta, -1, -2) - dlse.astype(acc)
    dq, dk, dv = _backward(q, k, v, dout.astype(q.dtype), lse, delta, softmax_scale, causal)
    return dq, dk, dv


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
    out, lse = _flash(q, k, v, scale, causal)
    return (out, lse) if return_lse else out
