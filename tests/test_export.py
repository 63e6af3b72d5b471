"""jax.export of functions that call jax_flash: exported for CPU and CUDA, called, differentiated
and, where flatbuffers is installed, serialized and read back. Results must equal the direct
call's: the exported module runs the same kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import custom_call_targets, make_qkv, make_sinks, normal
from jax import export

import jax_flash
from jax_flash import _ffi

PLATFORMS = ("cpu", "cuda")
SAME = {"rtol": 1e-6, "atol": 1e-6}


def export_and_reload(fn, *args, vjp_order=0):
    """fn exported for PLATFORMS with jax_flash's checks disabled; round-tripped through bytes when
    flatbuffers (jax.export's serializer) is installed."""
    exported = export.export(
        jax.jit(fn), disabled_checks=jax_flash.disabled_export_checks(), platforms=PLATFORMS
    )(*args)
    try:
        import flatbuffers  # noqa: F401
    except ImportError:
        return exported
    return export.deserialize(exported.serialize(vjp_order=vjp_order))


def test_every_registered_target_is_listed():
    registered = set(_ffi._jax_flash.registrations())
    assert registered <= set(_ffi.ALL_TARGETS), registered - set(_ffi.ALL_TARGETS)
    listed = {str(check) for check in jax_flash.disabled_export_checks()}
    assert {f"custom_call:{name}" for name in _ffi.ALL_TARGETS} == listed


def test_attention_forward_and_gradient(rng):
    q, k, v = make_qkv(rng, seqlen_q=70, seqlen_k=70, heads_q=4, heads_kv=2, head_dim=32)
    sinks = make_sinks(rng, 4, jnp.float32)
    ids = jnp.asarray(np.repeat(np.arange(3), [20, 31, 19])[None].repeat(2, 0), jnp.int32)
    dout = normal(rng, q.shape, q.dtype)

    def fn(q, k, v, sinks):
        return jax_flash.attention(
            q, k, v, causal=True, window=(24, None), softcap=20.0, segment_ids=ids, sinks=sinks
        )

    def loss(call):
        return lambda q, k, v, sinks: jnp.sum(call(q, k, v, sinks) * dout)

    reloaded = export_and_reload(fn, q, k, v, sinks, vjp_order=1)
    assert reloaded.platforms == PLATFORMS
    text = reloaded.mlir_module()
    # Both platforms' kernels are in the module, the segment-id pass of the CUDA path included.
    for target in (_ffi.FWD_CPU, _ffi.FWD_CUDA, _ffi.SEGMENTS_CUDA):
        assert target in custom_call_targets(text), target
    np.testing.assert_allclose(reloaded.call(q, k, v, sinks), fn(q, k, v, sinks), **SAME)
    grads = jax.grad(loss(reloaded.call), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    expected = jax.grad(loss(fn), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for name, g, ref in zip(("dq", "dk", "dv", "dsinks"), grads, expected, strict=True):
        np.testing.assert_allclose(g, ref, err_msg=name, **SAME)


def test_varlen_and_kvcache(rng):
    cu = jnp.asarray([0, 5, 5, 40], jnp.int32)
    q, k, v = (x[0] for x in make_qkv(rng, batch=1, seqlen_q=44, seqlen_k=44, head_dim=64))

    def packed(q, k, v):
        return jax_flash.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)

    reloaded = export_and_reload(packed, q, k, v)
    for got, want in zip(reloaded.call(q, k, v), packed(q, k, v), strict=True):
        np.testing.assert_allclose(got, want, **SAME)

    qd, kc, vc = make_qkv(rng, batch=3, seqlen_q=1, seqlen_k=96, heads_q=4, heads_kv=1)
    lengths = jnp.asarray([0, 1, 96], jnp.int32)

    def decode(q, k_cache, v_cache, lengths):
        return jax_flash.attention_with_kvcache(q, k_cache, v_cache, lengths)

    reloaded = export_and_reload(decode, qd, kc, vc, lengths)
    assert _ffi.DECODE_CUDA in custom_call_targets(reloaded.mlir_module())
    np.testing.assert_allclose(
        reloaded.call(qd, kc, vc, lengths), decode(qd, kc, vc, lengths), **SAME
    )


def test_export_without_the_checks_is_refused(rng):
    q, k, v = make_qkv(rng, seqlen_q=8, seqlen_k=8, head_dim=32)
    with pytest.raises(ValueError, match="custom call"):
        export.export(jax.jit(jax_flash.attention), platforms=PLATFORMS)(q, k, v)
