"""The FFI handlers' own checks (cpp/ffi/shapes.h, decode_shapes.h): a custom call built past the
Python checks, with a missing, mistyped or out-of-range attribute, is refused by the handler with
an error that names the attribute, before any kernel runs. The public entry points never build
such a call (test_errors.py rejects the same values at trace time); these tests call the FFI
targets directly through the package's call builders, on the CPU handlers, which share the
attribute decoding with the CUDA ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash import _decode, _ffi, _kernel

# The handlers' error reaches Python as a runtime error at execution.
HANDLER_ERROR = jax.errors.JaxRuntimeError


@pytest.fixture(autouse=True)
def on_cpu():
    # The CPU targets, wherever the default device is (a GPU machine's is CUDA).
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def qkv(seed=0, shape=(1, 16, 2, 64)):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(jax.random.normal(key, shape, jnp.float32) for key in keys)


# One out-of-range score option each, and the message that names it.
BAD_SCORE_OPTIONS = [
    ({"softmax_scale": -1.0}, "softmax_scale must be finite and positive"),
    ({"softmax_scale": float("nan")}, "softmax_scale must be finite and positive"),
    ({"softmax_scale": 0.0}, "softmax_scale must be finite and positive"),
    ({"window_left": -2}, "window bounds must be -1"),
    ({"window_right": -5}, "window bounds must be -1"),
    ({"band_shift": 2**31 + 1}, "band_shift must be within"),
    ({"softcap": -1.0}, "softcap must be finite and >= 0"),
    ({"softcap": float("inf")}, "softcap must be finite and >= 0"),
]


def spec_with(**bad):
    """A valid spec with some options replaced."""
    return _kernel.Spec(**{"softmax_scale": 0.125, **bad})


def run_forward(spec, **replace):
    """The CPU forward's custom call with spec's attributes, some replaced (value None: left
    out)."""
    q, k, v = qkv()
    aux = _kernel.Aux()
    attrs = {**spec.attrs(aux), **replace}
    attrs = {name: value for name, value in attrs.items() if value is not None}
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((1, 2, 16), jnp.float32),
    )
    call = jax.ffi.ffi_call(_ffi.FWD_CPU, out_types, vmap_method="broadcast_all")
    out, _ = call(q, k, v, *_kernel._extras(aux, q.dtype), **attrs)
    return np.asarray(out)


def test_forward_call_builder_runs():
    # The baseline every failing case below differs from in one attribute.
    out = run_forward(spec_with())
    assert out.shape == (1, 16, 2, 64) and np.isfinite(out).all()


@pytest.mark.parametrize("bad,message", BAD_SCORE_OPTIONS)
def test_forward_refuses_score_option(bad, message):
    with pytest.raises(HANDLER_ERROR, match=message):
        run_forward(spec_with(**bad))


@pytest.mark.parametrize("name", ["softmax_scale", "softcap", "varlen", "deterministic"])
def test_forward_refuses_missing_attribute(name):
    with pytest.raises(HANDLER_ERROR, match=f"missing or mistyped attribute {name}"):
        run_forward(spec_with(), **{name: None})


def test_forward_refuses_mistyped_attribute():
    # softcap is a double on the C++ side; an int64 attribute is another type.
    with pytest.raises(HANDLER_ERROR, match="missing or mistyped attribute softcap"):
        run_forward(spec_with(), softcap=1)


def test_forward_refuses_bad_option_combination():
    with pytest.raises(HANDLER_ERROR, match="max_seqlen_q/k must be -1"):
        run_forward(spec_with(), max_seqlen_q=-3)
    with pytest.raises(HANDLER_ERROR, match="segment_runs must be 0"):
        run_forward(spec_with(), segment_runs=2)


@pytest.mark.parametrize("bad,message", BAD_SCORE_OPTIONS[::3])
def test_backward_refuses_score_option(bad, message):
    q, k, v = qkv()
    good = spec_with()
    out, lse = _kernel._fwd_call(_ffi.FWD_CPU, q, k, v, _kernel.Aux(), good)
    delta = jnp.zeros_like(lse)
    with pytest.raises(HANDLER_ERROR, match=message):
        bad_spec = spec_with(**bad)
        dq, _, _ = _kernel._bwd_cpu(q, k, v, out, lse, delta, _kernel.Aux(), spec=bad_spec)
        np.asarray(dq)


def run_decode(spec, num_splits=1):
    q, k, v = qkv(shape=(2, 1, 4, 64))
    k, v = (jnp.tile(x, (1, 32, 1, 1))[:, :, :2] for x in (k, v))  # [2, 32, 2, 64]
    seqlens = jnp.array([32, 17], jnp.int32)
    out, _ = _decode._call(_ffi.DECODE_CPU, q, k, v, seqlens, None, None, spec, num_splits)
    return np.asarray(out)


def test_decode_call_builder_runs():
    for splits in (1, 3):
        out = run_decode(spec_with(), splits)
        assert out.shape == (2, 1, 4, 64) and np.isfinite(out).all()


@pytest.mark.parametrize("bad,message", BAD_SCORE_OPTIONS)
def test_decode_refuses_score_option(bad, message):
    with pytest.raises(HANDLER_ERROR, match=message):
        run_decode(spec_with(**bad))


@pytest.mark.parametrize("splits", [0, 1025])
def test_decode_refuses_split_count(splits):
    with pytest.raises(HANDLER_ERROR, match="num_splits must be between 1 and 1024"):
        run_decode(spec_with(), splits)
