"""The trace-time shared-memory check: a half-precision call that some local GPU cannot hold is
refused while tracing, naming the device and the sizes; calls that fit trace as before."""

import jax
import jax.numpy as jnp
import pytest
from conftest import ON_GPU

import jax_flash
from jax_flash import _device_limits, _ffi
from jax_flash._device_limits import GpuLimit

needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def _fake_requirements(monkeypatch):
    # The kernels' figures (cpp/cuda/*_tc.cuh) for a build without CUDA.
    sizes = {(False, 128): 90_000, (True, 128): 161 * 1024, (True, 256): 209 * 1024}
    monkeypatch.setattr(
        _ffi, "tensor_core_smem_bytes", lambda backward, d, segments: sizes[(backward, d)]
    )


def test_refuses_a_kernel_larger_than_the_device_allows(monkeypatch):
    _fake_requirements(monkeypatch)
    small = [GpuLimit("cuda:0 (NVIDIA RTX A6000)", 99 * 1024)]
    with pytest.raises(NotImplementedError, match=r"head_dim 128 needs 164864 bytes.*RTX A6000"):
        _device_limits.check_half_kernel_fits(
            backward=True, head_dim=128, segments=False, limits=small
        )
    _device_limits.check_half_kernel_fits(
        backward=False, head_dim=128, segments=False, limits=small
    )


def test_every_device_is_checked(monkeypatch):
    _fake_requirements(monkeypatch)
    mixed = [GpuLimit("cuda:0 (H200)", 227 * 1024), GpuLimit("cuda:1 (A100)", 163 * 1024)]
    with pytest.raises(NotImplementedError, match=r"cuda:1 \(A100\) allows 166912"):
        _device_limits.check_half_kernel_fits(
            backward=True, head_dim=256, segments=False, limits=mixed
        )


def test_no_gpu_means_no_check(monkeypatch):
    monkeypatch.setattr(_ffi, "tensor_core_smem_bytes", lambda *a: pytest.fail("not consulted"))
    _device_limits.check_half_kernel_fits(backward=True, head_dim=256, segments=True, limits=[])


@needs_gpu
def test_this_gpu_holds_every_kernel():
    limits = _device_limits.local_gpu_limits()
    assert limits, "a CUDA backend with no device limits read"
    for backward in (False, True):
        for d in (64, 128, 256):
            for segments in (False, True):
                needed = _ffi.tensor_core_smem_bytes(backward, d, segments)
                assert 48 * 1024 < needed <= min(x.smem_optin for x in limits)
    # The figures the message quotes are the kernels' own: d256's backward exceeds A100's 163 KB.
    assert _ffi.tensor_core_smem_bytes(True, 256, False) > 163 * 1024
    assert _ffi.tensor_core_smem_bytes(True, 128, True) <= 163 * 1024


@needs_gpu
def test_refused_at_trace_time_on_a_small_device(monkeypatch):
    monkeypatch.setattr(
        _device_limits, "local_gpu_limits", lambda: (GpuLimit("cuda:0 (small)", 99 * 1024),)
    )
    q = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)

    def loss(q):
        return jax_flash.attention(q, q, q).astype(jnp.float32).sum()

    with pytest.raises(NotImplementedError, match=r"kernel at head_dim 128.*\(small\)"):
        jax.jit(jax.grad(loss)).lower(q)
