"""The instruction-set build the CPU kernels run: chosen once per process from CPUID, or forced
with JAX_FLASH_CPU_ISA; a forced level the CPU lacks (or an unknown name) is refused cleanly.

Each forced level runs in a subprocess, since the level is read once per process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
from conftest import BACKEND

from jax_flash import _jax_flash

LEVELS = ("generic", "avx2", "avx512")
SUPPORTED = tuple(_jax_flash.cpu_isas_supported())

pytestmark = pytest.mark.skipif(BACKEND != "cpu", reason="the CPU kernels' dispatch")

# Prints the level in use, then runs a small forward and backward against the float64 reference
# (exit status 3 when they disagree), or prints the two errors when the level is refused.
CHILD = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_enable_x64", True)
    import jax_flash
    from jax_flash import _jax_flash
    from jax_flash.reference import attention_reference
    try:
        print("isa", _jax_flash.cpu_isa())
    except ValueError as exc:
        print("isa-error", exc)
    rng = np.random.default_rng(0)
    # head_dim 40 and 70 rows: edge micro-tiles and partial vectors in every build.
    q, k, v = (jnp.asarray(rng.standard_normal((1, 70, 2, 40)), jnp.float32) for _ in range(3))
    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, causal=True)))
    try:
        out = jax.block_until_ready(jax_flash.attention(q, k, v, causal=True))
        grads = jax.grad(loss(jax_flash.attention), argnums=(0, 1, 2))(q, k, v)
    except Exception as exc:
        print("call-error", type(exc).__name__, exc)
        raise SystemExit(0)
    q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
    ref = attention_reference(q64, k64, v64, causal=True)
    ref_grads = jax.grad(loss(attention_reference), argnums=(0, 1, 2))(q64, k64, v64)
    def rel(a, b):
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    worst = max([rel(out, ref)] + [rel(g, r) for g, r in zip(grads, ref_grads)])
    print("worst", worst)
    raise SystemExit(0 if worst < 5e-5 else 3)
    """
)


def run_child(level: str | None) -> tuple[int, str]:
    env = dict(os.environ)
    env.pop("JAX_FLASH_CPU_ISA", None)
    if level is not None:
        env["JAX_FLASH_CPU_ISA"] = level
    # Run outside the repository: from its root, `python -c` would import the source tree's
    # jax_flash/ (no native module) instead of the installed build.
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, done.stdout + done.stderr


def test_generic_always_supported_and_order():
    assert SUPPORTED[0] == "generic"
    assert all(level in LEVELS for level in SUPPORTED)
    assert list(SUPPORTED) == [level for level in LEVELS if level in SUPPORTED]


def test_level_in_use_is_the_forced_or_best_one():
    forced = os.environ.get("JAX_FLASH_CPU_ISA")
    if forced and forced not in SUPPORTED:
        with pytest.raises(ValueError, match="JAX_FLASH_CPU_ISA"):
            _jax_flash.cpu_isa()
    else:
        assert _jax_flash.cpu_isa() == (forced or SUPPORTED[-1])


def test_unset_picks_the_best_supported_level():
    rc, output = run_child(None)
    assert rc == 0, output
    assert f"isa {SUPPORTED[-1]}\n" in output, output


@pytest.mark.parametrize("level", LEVELS)
def test_forced_level(level):
    rc, output = run_child(level)
    if level in SUPPORTED:
        # The forced build is the one that ran, and it computes the right thing.
        assert rc == 0, output
        assert f"isa {level}\n" in output, output
        assert "worst" in output, output
    else:
        # Refused, with the variable named, in the query and in the call; never a crash.
        assert rc == 0, output
        assert "isa-error" in output and "call-error" in output, output
        assert "does not support" in output, output


def test_unknown_level_is_refused():
    rc, output = run_child("sse9")
    assert rc == 0, output
    assert "isa-error JAX_FLASH_CPU_ISA=sse9: unknown level" in output, output
    assert "call-error" in output and "JAX_FLASH_CPU_ISA=sse9" in output, output
