"""What the installed package ships for type checkers: py.typed, and overloads that type
``return_lse=True`` / ``return_residual=True`` as a pair."""

import sys
import typing
from pathlib import Path

import pytest

import jax_flash


def test_py_typed_is_installed():
    assert (Path(jax_flash.__file__).parent / "py.typed").is_file()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="typing.get_overloads needs Python 3.11")
@pytest.mark.parametrize(
    ("fn", "flag"),
    [
        (jax_flash.attention, "return_lse"),
        (jax_flash.attention_varlen, "return_lse"),
        (jax_flash.dot_product_attention, "return_residual"),
    ],
)
def test_return_flag_overloads(fn, flag):
    overloads = typing.get_overloads(fn)
    assert len(overloads) == 2
    returns = {}
    for overload in overloads:
        hints = typing.get_type_hints(overload)
        returns[hints[flag]] = hints["return"]
    assert set(returns) == {typing.Literal[False], typing.Literal[True]}
    assert typing.get_origin(returns[typing.Literal[True]]) is tuple
    assert typing.get_origin(returns[typing.Literal[False]]) is not tuple
