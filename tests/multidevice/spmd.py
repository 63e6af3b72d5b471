"""Helpers of the multi-device tests: the 8-device meshes and the collectives of compiled HLO."""

from __future__ import annotations

import re
from collections import Counter

import jax
import numpy as np
from jax.sharding import Mesh

NUM_DEVICES = 8
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
# One HLO instruction per collective: `%name = f32[...] all-gather(...)`, or the `-start` half of
# an asynchronous pair (whose `-done` half is not counted again).
_INSTRUCTION = re.compile(
    r"=\s*(\S+)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(",
)


def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    devices = jax.devices()[: int(np.prod(shape))]
    return Mesh(np.array(devices).reshape(shape), names)


def collectives(fn, *args) -> Counter:
    """Counter of (collective, result shape) over the compiled HLO of jax.jit(fn)(*args)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return Counter((op, shape) for shape, op in _INSTRUCTION.findall(text))


def shardy_flag_available() -> bool:
    """Whether this JAX still offers the GSPMD partitioner beside Shardy."""
    try:
        jax.config.jax_use_shardy_partitioner  # noqa: B018
    except AttributeError:
        return False
    return True
