"""Shared test helpers: seeded random inputs, the float64 reference, relative L2 errors and the
tolerance rules every numerical test applies.

Tolerances (relative L2 error against the float64 reference computed from the same inputs):
  float64  1e-10
  float32  1e-5 for forward outputs, 5e-5 for gradients (where float32 arithmetic itself cannot
           do that, e.g. huge logits, the FlashAttention rule below with the float32 reference)
  f16/bf16 the FlashAttention rule: at most 2x (forward) or 3x (gradients) the error of the plain
           reference evaluated in the same low precision, plus a 1e-3 floor, and never above 5e-2.
Gradients whose RMS is below 0.1 (they can vanish by cancellation) are measured against 0.1.

Tests run on whatever backend JAX picks (CPU here, GPU where there is one); float64 is enabled for
the whole session so that the references and the float64 kernels are available.
"""

from __future__ import annotations

import functools
import math
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

jax.config.update("jax_enable_x64", True)
# On GPUs XLA computes float32 matrix products in TF32 by default; the references (and the Flax
# layers around the kernel) must be exact float32 for the 1e-5 tolerances to mean anything.
jax.config.update("jax_default_matmul_precision", "highest")


def _import_installed_jax_flash():
    """The installed jax_flash, never the uncompiled package at the repository root: ``python -m
    pytest`` puts the working directory first on sys.path, so it is taken off before the import,
    and a jax_flash without its native module is refused with instructions."""
    root = Path(__file__).resolve().parent.parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
    try:
        import jax_flash
        from jax_flash import _jax_flash  # noqa: F401
    except ImportError as exc:
        pytest.exit(
            f"the tests need an installed jax_flash build (pip install . from {root}); "
            f"importing it failed: {exc}",
            returncode=4,
        )
    return jax_flash


jax_flash = _import_installed_jax_flash()
from jax_flash.reference import attention_reference, attention_varlen_reference  # noqa: E402

BACKEND = jax.default_backend()

# tests/multidevice needs 8 devices; with fewer, test_multidevice.py runs it in a process of its
# own on 8 virtual CPU devices.
collect_ignore = [] if jax.device_count() >= 8 else ["multidevice"]
ON_GPU = BACKEND == "gpu"

ALL_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
LOW_PRECISION = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))

TOL_F64 = 1e-10
TOL_F32 = {"fwd": 1e-5, "grad": 5e-5}
LOWP_FACTOR = {"fwd": 2.0, "grad": 3.0}
LOWP_FLOOR = 1e-3
# Whatever the low-precision reference does, a kernel this far off is wrong: keeps the
# FlashAttention rule from turning vacuous when the naive low-precision reference is very poor.
LOWP_CAP = 5e-2
# Gradients can vanish by cancellation (a softmax over one key has no gradient at all): below an
# RMS of GRAD_FLOOR per element their error is measured against GRAD_FLOOR, not against ~0.
GRAD_FLOOR = 0.1


def dtype_id(dtype) -> str:
    return jnp.dtype(dtype).name


@pytest.fixture
def run_native(tmp_path: Path):
    """Builds tests/native/<name>.cc (host-side checks of the C++ headers) with the host C++
    compiler and runs it; returns its stdout, after asserting a zero exit. Skips the test where
    there is no compiler."""
    compiler = next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if compiler is None:
        pytest.skip("no host C++ compiler")
    root = Path(__file__).resolve().parent.parent

    def run(name: str) -> str:
        exe = tmp_path / name
        source = root / "tests" / "native" / f"{name}.cc"
        build = [compiler, "-std=c++17", "-O2", "-I", str(root / "cpp"), str(source), "-o"]
        subprocess.run([*build, str(exe)], check=True, timeout=120)
        done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    return run


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's node id: fresh inputs per test, reproducible per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def normal(rng: np.random.Generator, shape, dtype, scale: float = 1.0) -> jax.Array:
    """Standard normal samples (times scale), rounded to dtype."""
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype=dtype)


def make_qkv(
    rng,
    *,
    batch=2,
    seqlen_q,
    seqlen_k,
    heads_q=2,
    heads_kv=None,
    head_dim=64,
    dtype=jnp.float32,
    scale=1.0,
):
    heads_kv = heads_q if heads_kv is None else heads_kv
    q = normal(rng, (batch, seqlen_q, heads_q, head_dim), dtype, scale)
    k = normal(rng, (batch, seqlen_k, heads_kv, head_dim), dtype, scale)
    v = normal(rng, (batch, seqlen_k, heads_kv, head_dim), dtype)
    return q, k, v


def lse_shape(q) -> tuple[int, int, int]:
    """Shape of lse, [batch, heads_q, seqlen_q], for q of layout [batch, seqlen_q, heads_q, dim]."""
    return (q.shape[0], q.shape[2], q.shape[1])


def stats_dtype(dtype) -> jnp.dtype:
    """dtype of lse: float64 for float64 inputs, float32 otherwise."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def f64(*xs):
    out = tuple(jnp.asarray(x, jnp.float64) for x in xs)
    return out if len(out) > 1 else out[0]


# ----------------------------------------------------------------------------------------------
# Jitted forward and VJP of the kernel and of the reference. One compile per shape and flag set.


@functools.partial(jax.jit, static_argnames=("causal", "softmax_scale"))
def flash_forward(q, k, v, *, causal, softmax_scale=None):
    return jax_flash.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)


# The references are compiled once per test shape and their compile time dominates the CPU run
# time; LLVM's optimisation level changes how fast they run, not what they compute.
_REFERENCE_JIT = functools.partial(
    jax.jit,
    static_argnames=("causal", "softmax_scale"),
    compiler_options={"xla_backend_optimization_level": 0} if BACKEND == "cpu" else None,
)


@_REFERENCE_JIT
def reference_forward(q, k, v, *, causal, softmax_scale=None):
    return attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)


def _vjp(fn, q, k, v, dout, dlse, causal, softmax_scale):
    if dlse is None:
        # return_lse=False: the custom VJP must supply a zero lse cotangent itself.
        def f(q, k, v):
            return fn(q, k, v, causal=causal, softmax_scale=softmax_scale)

        out, pullback = jax.vjp(f, q, k, v)
        lse = None
        grads = pullback(dout)
    else:

        def f(q, k, v):
            return fn(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=True)

        (out, lse), pullback = jax.vjp(f, q, k, v)
        grads = pullback((dout, dlse))
    return out, lse, grads


@functools.partial(jax.jit, static_argnames=("causal", "softmax_scale"))
def flash_vjp(q, k, v, dout, dlse=None, *, causal, softmax_scale=None):
    """(out, lse or None, (dq, dk, dv)) of jax_flash.attention with cotangents dout (and dlse)."""
    return _vjp(jax_flash.attention, q, k, v, dout, dlse, causal, softmax_scale)


@_REFERENCE_JIT
def reference_vjp(q, k, v, dout, dlse=None, *, causal, softmax_scale=None):
    return _vjp(attention_reference, q, k, v, dout, dlse, causal, softmax_scale)


# ----------------------------------------------------------------------------------------------
# Errors and tolerances.


def _norm(x) -> float:
    # Not np.linalg.norm: it goes through BLAS, whose threads cost far more CPU time than this
    # sum on a busy machine (40x on a loaded 2-core runner).
    return math.sqrt(float(np.sum(np.square(x))))


def rel_l2(x, ref, floor: float = 0.0) -> float:
    """||x - ref|| / max(||ref||, floor * sqrt(size)) in float64; NaN if x has a NaN.

    floor is a root-mean-square magnitude below which the error counts as absolute; without one,
    a reference of exactly 0 gives 0 (x == 0) or inf."""
    x = np.asarray(x).astype(np.float64)
    ref = np.asarray(ref).astype(np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    num = _norm(x - ref)
    den = max(_norm(ref), floor * math.sqrt(ref.size))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def tolerance(dtype, kind: str, lowp_error: float | None = None) -> float:
    """The allowed relative L2 error for inputs of dtype; lowp_error is the error of the plain
    reference evaluated in that dtype (required for float16 and bfloat16; for float32 it widens
    the tolerance where float32 itself cannot do better, e.g. with huge logits)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float64:
        return TOL_F64
    if dtype == jnp.float32:
        if lowp_error is None or not math.isfinite(lowp_error):
            return TOL_F32[kind]
        return max(TOL_F32[kind], LOWP_FACTOR[kind] * lowp_error)
    assert lowp_error is not None, "low-precision checks need the low-precision reference"
    if not math.isfinite(lowp_error):
        # The naive low-precision reference overflowed (e.g. float16 scores of huge logits).
        return LOWP_CAP
    return min(LOWP_FACTOR[kind] * lowp_error + LOWP_FLOOR, LOWP_CAP)


def assert_close(name, actual, ref64, *, dtype, kind, lowp=None):
    """Relative L2 error of actual against the float64 reference, within the dtype's tolerance.

    dtype is the input dtype (it picks the rule); lowp is the same quantity computed by the
    reference in that dtype, required for float16 and bfloat16.
    """
    actual_np = np.asarray(actual).astype(np.float64)
    assert not np.isnan(actual_np).any(), f"{name}: {int(np.isnan(actual_np).sum())} NaNs"
    floor = GRAD_FLOOR if kind == "grad" else 0.0
    lowp_error = None if lowp is None else rel_l2(lowp, ref64, floor)
    tol = tolerance(dtype, kind, lowp_error)
    err = rel_l2(actual_np, ref64, floor)
    detail = "" if lowp_error is None else f", low-precision reference error {lowp_error:.3e}"
    assert err <= tol, (
        f"{name} ({dtype_id(dtype)}): relative L2 error {err:.3e} > tolerance {tol:.3e}{detail}"
    )


def _finite_part(lse, mask):
    return np.where(mask, 0.0, np.asarray(lse).astype(np.float64))


def assert_lse_close(actual, ref64, *, dtype, lowp=None):
    """lse is -inf exactly where the reference is (fully masked rows), close elsewhere.

    lse is float32 even for float16/bfloat16 inputs, and every product of two such inputs is
    exact in float32, so it is held to the float32 tolerance, not to the FlashAttention rule."""
    actual_np = np.asarray(actual).astype(np.float64)
    ref_np = np.asarray(ref64).astype(np.float64)
    masked = np.isneginf(ref_np)
    assert np.array_equal(np.isneginf(actual_np), masked), "lse: -inf at the wrong rows"
    assert np.isfinite(actual_np[~masked]).all(), "lse: non-finite values in visible rows"
    lse_dtype = stats_dtype(dtype)
    same_precision = lowp is not None and lse_dtype == jnp.dtype(dtype)
    assert_close(
        "lse",
        _finite_part(actual_np, masked),
        _finite_part(ref_np, masked),
        dtype=lse_dtype,
        kind="fwd",
        lowp=_finite_part(lowp, masked) if same_precision else None,
    )


# ----------------------------------------------------------------------------------------------
# Whole checks, shared by several test files. Their **shape (batch, heads_q, heads_kv, head_dim)
# goes to make_qkv, with its defaults.


def _wants_lowp(dtype, same_precision_rule) -> bool:
    """Whether a check also needs the plain reference evaluated in the input dtype: always for
    float16 and bfloat16, for float32 only under same_precision_rule."""
    return jnp.dtype(dtype) in LOW_PRECISION or (same_precision_rule and dtype == jnp.float32)


def check_forward(
    rng,
    *,
    seqlen_q,
    seqlen_k,
    dtype=jnp.float32,
    causal=False,
    softmax_scale=None,
    input_scale=1.0,
    same_precision_rule=False,
    **shape,
):
    """Runs the forward on random inputs and checks O and lse against the float64 reference.

    same_precision_rule: also hold float32 to the FlashAttention rule (for inputs where float32
    arithmetic itself is far from 1e-5, such as huge logits)."""
    q, k, v = make_qkv(
        rng, seqlen_q=seqlen_q, seqlen_k=seqlen_k, dtype=dtype, scale=input_scale, **shape
    )
    out, lse = flash_forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == lse_shape(q) and lse.dtype == stats_dtype(dtype)
    ref_out, ref_lse = reference_forward(*f64(q, k, v), causal=causal, softmax_scale=softmax_scale)
    lowp_out = lowp_lse = None
    if _wants_lowp(dtype, same_precision_rule):
        lowp_out, lowp_lse = reference_forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert_close("out", out, ref_out, dtype=dtype, kind="fwd", lowp=lowp_out)
    assert_lse_close(lse, ref_lse, dtype=dtype, lowp=lowp_lse)
    return (q, k, v), (out, lse), (ref_out, ref_lse)


def check_backward(
    rng,
    *,
    seqlen_q,
    seqlen_k,
    dtype=jnp.float32,
    causal=False,
    softmax_scale=None,
    lse_cotangent=False,
    input_scale=1.0,
    same_precision_rule=False,
    **shape,
):
    """VJP with a random cotangent on O (and on lse) against the VJP of the float64 reference.

    Returns the inputs with the O cotangent, (out, lse) and the kernel's (dq, dk, dv)."""
    q, k, v = make_qkv(
        rng, seqlen_q=seqlen_q, seqlen_k=seqlen_k, dtype=dtype, scale=input_scale, **shape
    )
    dout = normal(rng, q.shape, dtype)
    dlse = normal(rng, lse_shape(q), stats_dtype(dtype)) if lse_cotangent else None
    kw = {"causal": causal, "softmax_scale": softmax_scale}
    out, lse, grads = flash_vjp(q, k, v, dout, dlse, **kw)
    ref_out, ref_lse, ref_grads = reference_vjp(
        *f64(q, k, v, dout), None if dlse is None else f64(dlse), **kw
    )
    lowp_out = lowp_lse = None
    lowp_grads = (None, None, None)
    if _wants_lowp(dtype, same_precision_rule):
        lowp_out, lowp_lse, lowp_grads = reference_vjp(
            q, k, v, dout, None if dlse is None else dlse.astype(dtype), **kw
        )
    assert_close("out", out, ref_out, dtype=dtype, kind="fwd", lowp=lowp_out)
    if lse_cotangent:
        assert_lse_close(lse, ref_lse, dtype=dtype, lowp=lowp_lse)
    for name, g, x, ref_g, lowp_g in zip(
        ("dq", "dk", "dv"), grads, (q, k, v), ref_grads, lowp_grads, strict=True
    ):
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        assert_close(name, g, ref_g, dtype=dtype, kind="grad", lowp=lowp_g)
    return (q, k, v, dout), (out, lse), grads


def poison_allocator(like) -> None:
    """Fills and frees a NaN buffer the size of `like` so that a kernel which leaves part of an
    output unwritten is likely to hand back NaNs instead of lucky zeros."""
    jnp.full(like.shape, jnp.nan, like.dtype).block_until_ready()


def custom_call_targets(hlo_text: str) -> list[str]:
    """Names of the jax_flash FFI targets called in a StableHLO or compiled HLO module's text."""
    return re.findall(r'(?:custom_call @|custom_call_target=")(jax_flash_\w+)', hlo_text)


# ----------------------------------------------------------------------------------------------
# Windows, softcap, segment ids, sinks and packed (varlen) batches: one jitted VJP per
# implementation, the contract's visibility rule written out in numpy, and one whole check.
# A packed call is selected by cu_seqlens = (cu_seqlens_q, cu_seqlens_k).


def _feature_vjp(fn_dense, fn_varlen, q, k, v, dout, dlse, segment_ids, sinks, cu_seqlens, static):
    kwargs = dict(static)
    grads = kwargs.pop("grads", True)
    if cu_seqlens is None:
        fn, cu = fn_dense, ()
        kwargs["segment_ids"] = segment_ids
    else:
        fn, cu = fn_varlen, tuple(cu_seqlens)

    def f(q, k, v, sinks):
        return fn(q, k, v, *cu, sinks=sinks, return_lse=True, **kwargs)

    if not grads:
        return (*f(q, k, v, sinks), None)
    (out, lse), pullback = jax.vjp(f, q, k, v, sinks)
    return out, lse, pullback((dout, dlse))


@functools.partial(jax.jit, static_argnames=("static",))
def _flash_feature_vjp(q, k, v, dout, dlse, segment_ids, sinks, cu_seqlens, static):
    return _feature_vjp(
        jax_flash.attention, jax_flash.attention_varlen,
        q, k, v, dout, dlse, segment_ids, sinks, cu_seqlens, static,
    )  # fmt: skip


# The reference compiles once per shape, dtype and softcap-or-not (XLA's compile time is most of
# the CPU run time of these tests): every other option reaches it as data. Causal is the right
# bound 0, an unbounded (or wider) side 2^30, no segment ids one id everywhere, no sinks sinks of
# -inf (exp(-inf) adds nothing to a denominator), softmax_scale and softcap traced scalars.
UNBOUNDED = 1 << 30


@functools.partial(
    jax.jit,
    static_argnames=("grads",),
    compiler_options={"xla_backend_optimization_level": 0} if BACKEND == "cpu" else None,
)
def _reference_feature_vjp(
    q, k, v, dout, dlse, segment_ids, sinks, cu_seqlens, bounds, softmax_scale, softcap, grads
):
    static = {
        "grads": grads,
        "window": (bounds[0], bounds[1]),
        "softmax_scale": softmax_scale,
        "softcap": softcap,
    }
    return _feature_vjp(
        attention_reference, attention_varlen_reference,
        q, k, v, dout, dlse, segment_ids, sinks, cu_seqlens, static.items(),
    )  # fmt: skip


def flash_feature_vjp(
    q, k, v, dout=None, dlse=None, *, segment_ids=None, sinks=None, cu_seqlens=None, **static
):
    """(out, lse, (dq, dk, dv, dsinks)) of jax_flash.attention, or of attention_varlen when
    cu_seqlens = (cu_seqlens_q, cu_seqlens_k) is given, for the cotangents dout and dlse; jitted,
    one compile per shape and set of static options (causal, softmax_scale, window, softcap,
    max_seqlen_q, max_seqlen_k; grads=False for the forward alone, gradients None)."""
    static = tuple(sorted(static.items()))
    return _flash_feature_vjp(q, k, v, dout, dlse, segment_ids, sinks, cu_seqlens, static=static)


def reference_feature_vjp(
    q,
    k,
    v,
    dout=None,
    dlse=None,
    *,
    segment_ids=None,
    sinks=None,
    cu_seqlens=None,
    causal=False,
    softmax_scale=None,
    window=None,
    softcap=None,
    grads=True,
    max_seqlen_q=None,
    max_seqlen_k=None,
    deterministic=False,
):
    """The same for attention_reference / attention_varlen_reference (max_seqlen_* are only
    kernel hints and deterministic only the kernels' summation order: both are ignored)."""
    del max_seqlen_q, max_seqlen_k, deterministic
    left, right = (None, None) if window is None else window
    left = UNBOUNDED if left is None else min(left, UNBOUNDED)
    right = 0 if causal else (UNBOUNDED if right is None else min(right, UNBOUNDED))
    bounds = jnp.asarray([left, right], jnp.int32)
    scale = jnp.asarray(q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
    cap = None if softcap is None else jnp.asarray(softcap, jnp.float64)
    has_sinks = sinks is not None
    if not has_sinks:
        sinks = jnp.full((q.shape[-2],), -jnp.inf, stats_dtype(q.dtype))
    if cu_seqlens is None:
        if segment_ids is None:
            segment_ids = jnp.zeros(q.shape[:2], jnp.int32), jnp.zeros(k.shape[:2], jnp.int32)
        elif not isinstance(segment_ids, (tuple, list)):
            segment_ids = (segment_ids, segment_ids)
        segment_ids = tuple(jnp.asarray(x, jnp.int32) for x in segment_ids)
    out, lse, grads_ = _reference_feature_vjp(
        q, k, v, dout, dlse, segment_ids, sinks, cu_seqlens, bounds, scale, cap, grads
    )
    if grads_ is not None and not has_sinks:
        grads_ = (*grads_[:3], None)
    return out, lse, grads_


def _band_np(rows, cols, off, causal, window):
    left, right = (None, None) if window is None else window
    if causal:
        right = 0
    visible = np.ones(np.broadcast_shapes(rows.shape, cols.shape), bool)
    if left is not None:
        visible &= cols >= rows + off - left
    if right is not None:
        visible &= cols <= rows + off + right
    return visible


def visibility(q, k, *, causal=False, window=None, segment_ids=None, cu_seqlens=None):
    """Which query sees which key, from the contract alone: [batch, Sq, Sk] for a dense call,
    [total_q, total_k] for a packed one (rows and keys past the last sequence see nothing)."""
    if cu_seqlens is None:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        rows, cols = np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :]
        band = _band_np(rows, cols, seqlen_k - seqlen_q, causal, window)
        visible = np.broadcast_to(band, (q.shape[0], seqlen_q, seqlen_k))
        if segment_ids is not None:
            q_ids, kv_ids = (
                segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids,) * 2
            )
            q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
            visible = visible & (q_ids[:, :, None] == kv_ids[:, None, :])
        return visible
    cu_q, cu_k = (np.asarray(c) for c in cu_seqlens)
    visible = np.zeros((q.shape[0], k.shape[0]), bool)
    for n in range(len(cu_q) - 1):
        len_q, len_k = cu_q[n + 1] - cu_q[n], cu_k[n + 1] - cu_k[n]
        rows, cols = np.arange(len_q)[:, None], np.arange(len_k)[None, :]
        band = _band_np(rows, cols, len_k - len_q, causal, window)
        visible[cu_q[n] : cu_q[n + 1], cu_k[n] : cu_k[n + 1]] = band
    return visible


def make_sinks(rng, heads_q, dtype, shift: float = 2.0) -> jax.Array:
    """Random sinks [heads_q] of a size that matters next to the rows' lse, in the stats dtype."""
    return jnp.asarray(rng.standard_normal(heads_q) * 1.5 + shift, stats_dtype(dtype))


def check_features(
    rng,
    q,
    k,
    v,
    *,
    segment_ids=None,
    sinks=None,
    cu_seqlens=None,
    grads=True,
    same_precision_rule=False,
    **static,
):
    """One call of the kernel (forward and VJP with random cotangents on O and lse) against the
    float64 reference, with the tolerance rules above, plus the contract's exact values:
    rows that see no key give O = 0 and dQ = 0 (lse -inf, or the row's sink with sinks; -inf for
    packed tokens past the last sequence), keys that no row sees get dK = dV = 0, and every output
    is written (the allocator is poisoned first). static: causal, softmax_scale, window, softcap,
    max_seqlen_q, max_seqlen_k. Returns (out, lse, (dq, dk, dv, dsinks)) of the kernel and the
    visibility [.., Sq, Sk]."""
    dtype = q.dtype
    packed = cu_seqlens is not None
    stat_shape = (q.shape[1], q.shape[0]) if packed else lse_shape(q)
    dout = normal(rng, q.shape, dtype)
    dlse = normal(rng, stat_shape, stats_dtype(dtype))
    extra = {"segment_ids": segment_ids, "cu_seqlens": cu_seqlens, "grads": grads, **static}
    for x in (q, k, v):
        poison_allocator(x)
    out, lse, kernel_grads = flash_feature_vjp(q, k, v, dout, dlse, sinks=sinks, **extra)
    assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    assert lse.shape == stat_shape and lse.dtype == stats_dtype(dtype), (lse.shape, lse.dtype)
    ref_sinks = None if sinks is None else f64(sinks)
    ref_out, ref_lse, ref_grads = reference_feature_vjp(
        *f64(q, k, v, dout, dlse), sinks=ref_sinks, **extra
    )
    lowp_out = lowp_lse = None
    lowp_grads = (None,) * 4
    if _wants_lowp(dtype, same_precision_rule):
        lowp_out, lowp_lse, lowp_grads = reference_feature_vjp(
            q, k, v, dout, dlse.astype(dtype), sinks=sinks, **extra
        )
    assert_close("out", out, ref_out, dtype=dtype, kind="fwd", lowp=lowp_out)
    assert_lse_close(lse, ref_lse, dtype=dtype, lowp=lowp_lse)

    visible = visibility(
        q,
        k,
        causal=static.get("causal", False),
        window=static.get("window"),
        segment_ids=segment_ids,
        cu_seqlens=cu_seqlens,
    )
    no_keys = ~visible.any(axis=-1)  # [B, Sq] or [Tq]
    unseen = ~visible.any(axis=-2)  # [B, Sk] or [Tk]
    out_np = np.asarray(out).astype(np.float64)
    assert (out_np[no_keys] == 0).all(), "rows that see no key must give O = 0"
    # [..., Hq, Sq] -> [..., Sq, Hq], to index rows like O.
    rows_lse = np.moveaxis(np.asarray(lse).astype(np.float64), -1, -2)[no_keys]
    ref_rows_lse = np.moveaxis(np.asarray(ref_lse), -1, -2)[no_keys]
    if sinks is None:
        assert np.isneginf(ref_rows_lse).all(), "the reference disagrees with the visibility rule"
        assert np.isneginf(ref_lse).sum() == no_keys.sum() * q.shape[-2]
    np.testing.assert_allclose(rows_lse, ref_rows_lse, rtol=1e-6, err_msg="lse of keyless rows")
    if not grads:
        return (out, lse, None), visible

    names = ("dq", "dk", "dv", "dsinks")
    for name, g, x, ref_g, lowp_g in zip(
        names, kernel_grads, (q, k, v, sinks), ref_grads, lowp_grads, strict=True
    ):
        if x is None:
            assert g is None, name
            continue
        assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape, g.dtype)
        assert_close(name, g, ref_g, dtype=dtype, kind="grad", lowp=lowp_g)
    dq, dk, dv = (np.asarray(g).astype(np.float64) for g in kernel_grads[:3])
    assert (dq[no_keys] == 0).all(), "rows that see no key must get dQ = 0"
    assert (dk[unseen] == 0).all() and (dv[unseen] == 0).all(), "unseen keys must get dK = dV = 0"
    return (out, lse, kernel_grads), visible


def segments_from_lengths(*lengths_per_batch, first_id: int = 0) -> jax.Array:
    """int32 [batch, sum(lengths)] ids of documents of the given lengths, packed back to back:
    segments_from_lengths([3, 2], [5]) = [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]] (+ first_id)."""
    rows = [np.repeat(np.arange(len(ls)) + first_id, ls) for ls in lengths_per_batch]
    assert len({r.size for r in rows}) == 1, "every batch element needs the same length"
    return jnp.asarray(np.stack(rows), jnp.int32)


def make_packed(
    rng,
    lens_q,
    lens_k,
    *,
    pad_q=0,
    pad_k=0,
    heads_q=2,
    heads_kv=None,
    head_dim=64,
    dtype=jnp.float32,
    scale=1.0,
):
    """Packed q [Tq, Hq, D], k, v [Tk, Hkv, D] and cu_seqlens for sequences of the given lengths,
    with pad_q / pad_k tokens past the last sequence."""
    heads_kv = heads_q if heads_kv is None else heads_kv
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    total_q, total_k = int(cu_q[-1]) + pad_q, int(cu_k[-1]) + pad_k
    q = normal(rng, (total_q, heads_q, head_dim), dtype, scale)
    k = normal(rng, (total_k, heads_kv, head_dim), dtype, scale)
    v = normal(rng, (total_k, heads_kv, head_dim), dtype)
    return q, k, v, (jnp.asarray(cu_q), jnp.asarray(cu_k))
