"""Serializing functions that call jax_flash with ``jax.export``.

``jax.export`` refuses custom calls that carry no compatibility guarantee, and jax_flash's
kernels are such custom calls: their targets and attributes belong to this package and may change
between its versions. The refusal is lifted per target, which is what
:func:`disabled_export_checks` lists. An exported module then runs where the same jax_flash
version is installed: importing jax_flash registers the targets, and the attributes are read as
this version writes them, so serialize and run under one version.
"""

from __future__ import annotations

from jax import export as _jax_export

from jax_flash import _ffi


def disabled_export_checks() -> list[_jax_export.DisabledSafetyCheck]:
    """The safety checks ``jax.export.export`` must skip for jax_flash's custom calls.

    One ``DisabledSafetyCheck.custom_call`` per target the package can emit (forward, backward and
    decode kernels, CPU and CUDA, whether or not this build has CUDA), so that a function can be
    exported for platforms this machine lacks::

        from jax import export
        import jax_flash

        exported = export.export(
            jax.jit(step),
            disabled_checks=jax_flash.disabled_export_checks(),
            platforms=("cpu", "cuda"),
        )(*args)
        blob = exported.serialize(vjp_order=1)  # with the backward, for jax.grad of .call
        # later, in a process with the same jax_flash version imported:
        out = export.deserialize(blob).call(*args)
    """
    return [_jax_export.DisabledSafetyCheck.custom_call(name) for name in _ffi.ALL_TARGETS]
