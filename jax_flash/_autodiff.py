"""What differentiation the kernels support, and the error for what they do not.

The kernels' derivative is a ``jax.custom_vjp``: reverse mode of first order only. Forward mode
and second-order derivatives are refused with :class:`ForwardModeError` instead of JAX's generic
message, at trace time wherever jax_flash can see them:

* a forward-mode tracer reaching an entry point (``jax.jvp``, ``jax.jacfwd`` and
  ``jax.hessian`` of a function that calls jax_flash, jitted inside or not);
* any derivative of the raw kernels, which is what a second derivative (grad of grad,
  forward over reverse) asks for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

try:  # The tracer class of forward mode, re-exported by jax.interpreters.ad.
    from jax.interpreters.ad import JVPTracer as _JVPTracer
except ImportError:  # pragma: no cover - depends on the JAX release
    try:
        from jax._src.interpreters.ad import JVPTracer as _JVPTracer
    except ImportError:  # a JAX without it just gets JAX's own error
        _JVPTracer = None

SUPPORTED = (
    "reverse mode of first order works: jax.grad, jax.value_and_grad, jax.vjp, jax.jacrev and "
    "jax.test_util.check_grads(..., order=1, modes=('rev',))"
)


class ForwardModeError(TypeError):
    """Raised for forward-mode or second-order differentiation of jax_flash attention, and for
    any differentiation of a forward-only entry point (attention_with_kvcache)."""


def _error(fn: str, what: str) -> ForwardModeError:
    return ForwardModeError(
        f"jax_flash.{fn}: {what} is not supported: the kernels' derivative is a custom VJP "
        f"(reverse mode only); {SUPPORTED}"
    )


def reject_forward_mode(fn: str, *arrays: Any) -> None:
    """Raises if any argument is being differentiated in forward mode.

    With direct linearization (JAX's default), reverse mode never hands out forward-mode tracers,
    so this refuses exactly ``jax.jvp``/``jax.jacfwd``. With the older JVP-then-partial-eval
    linearization, reverse mode uses them too, and the check stands aside.
    """
    # Releases that dropped the flag linearize directly, always.
    direct = getattr(jax.config, "jax_use_direct_linearize", True)
    if _JVPTracer is None or not direct:
        return
    for x in arrays:
        if isinstance(x, _JVPTracer):
            raise _error(fn, "forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian)")


def not_differentiable(kernel: Callable) -> Callable:
    """Wraps a kernel call ``kernel(*args, spec)`` (spec static, last) so that differentiating it
    raises :class:`ForwardModeError`. The custom VJP calls kernels outside any differentiation,
    so only a derivative of a derivative reaches this."""
    n_args = kernel.__code__.co_argcount

    @functools.partial(jax.custom_jvp, nondiff_argnums=(n_args - 1,))
    @functools.wraps(kernel)
    def wrapped(*args):
        return kernel(*args)

    @wrapped.defjvp
    def _refuse(spec, primals, tangents):
        del spec, primals, tangents
        raise _error(
            "attention",
            "a derivative of the attention derivative (grad of grad, jax.hessian, forward over "
            "reverse)",
        )

    return wrapped


def forward_only(fn: str, n_static: int) -> Callable[[Callable], Callable]:
    """Wraps ``kernel(*arrays, *static)`` (its last ``n_static`` arguments static) so that any
    derivative of it, reverse or forward mode, raises :class:`ForwardModeError` while tracing,
    naming the entry point ``fn``."""

    def wrap(kernel: Callable) -> Callable:
        n_args = kernel.__code__.co_argcount
        static = tuple(range(n_args - n_static, n_args))

        @functools.partial(jax.custom_jvp, nondiff_argnums=static)
        @functools.wraps(kernel)
        def wrapped(*args):
            return kernel(*args)

        @wrapped.defjvp
        def _refuse(*args):
            del args
            raise ForwardModeError(
                f"jax_flash.{fn} has no derivative: it is the forward pass only (inference with a "
                "key/value cache); for training differentiate jax_flash.attention, whose "
                "reverse mode (jax.grad, jax.vjp) works"
            )

        return wrapped

    return wrap
