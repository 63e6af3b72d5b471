"""A short run of examples/train_decoder.py: the loss falls, and the loss and every parameter
gradient match the same model on the plain reference attention."""

import importlib.util
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import rel_l2

nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("optax")
pytest.importorskip("jax_flash.flax")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_decoder.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_decoder", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def small(example):
    return example.Config(vocab=len(set(example.corpus())), dim=32, layers=1, seqlen=32, batch=8)


def test_loss_and_gradients_match_the_reference(example):
    cfg = small(example)
    tokens = example.Data(example.corpus(), cfg.seqlen, cfg.batch).next()
    results = []
    for fn in (example.jax_flash.flax.attention_fn, example.reference_attention_fn):
        model, _ = example.make(cfg, fn)
        loss, grads = nnx.jit(nnx.value_and_grad(example.loss_fn))(model, tokens)
        results.append((float(loss), jax.tree.leaves(nnx.state(grads))))
    (loss, grads), (ref_loss, ref_grads) = results
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert len(grads) == len(ref_grads) > 10
    for g, r in zip(grads, ref_grads, strict=True):
        # The key bias gradient vanishes (it shifts whole score rows): compared absolutely.
        assert rel_l2(g, r, floor=1e-3) <= 1e-4


def test_short_training_run(example, tmp_path):
    cfg = small(example)
    _, losses = example.train(cfg, 40)
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.75 * np.mean(losses[:5]), losses
    path = tmp_path / "loss.png"
    example.plot_losses(losses, path)
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
