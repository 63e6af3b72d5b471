"""A small decoder-only transformer in Flax NNX, trained with jax_flash attention.

    python examples/train_decoder.py                  # 300 steps, CPU or GPU
    python examples/train_decoder.py --steps 50 --reference   # the same model on plain attention

The corpus ships with Python: the Zen of Python (the standard library's ``this`` module), a few
hundred characters, modelled character by character. Every layer is a pre-LayerNorm block whose
attention is ``flax.nnx.MultiHeadAttention`` with ``attention_fn=jax_flash.flax.attention_fn``,
grouped-query (4 query heads sharing 2 key/value heads) and causal through the layer's
``is_causal`` call argument. The whole training step is one ``nnx.jit``.

Prints the loss every few steps and writes a loss curve, ``loss.png`` in ``--out`` (default: a
scratch folder, ``jax_flash_example`` in the system temp directory), with matplotlib when it is
installed and with a built-in PNG writer otherwise. About a minute on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import dataclasses
import io
import struct
import tempfile
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_flash.flax
from jax_flash.reference import attention_reference


def corpus() -> str:
    """The Zen of Python, decoded from the ``this`` module without printing it."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing ``this`` prints the text
        import this
    return codecs.decode(this.s, "rot13")


def reference_attention_fn(query, key, value, *, is_causal=False, mask=None, **_):
    """Flax's attention-function signature on jax_flash's plain-jnp reference attention, for
    comparison (self-attention: the causal diagonal is the same from either corner)."""
    assert mask is None
    return attention_reference(query, key, value, causal=is_causal)


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    seqlen: int = 64
    batch: int = 16
    learning_rate: float = 3e-3
    dtype: str = "float32"


class Block(nnx.Module):
    def __init__(self, cfg: Config, attention_fn, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        kw = {"dtype": dtype, "param_dtype": dtype, "rngs": rngs}
        self.norm1 = nnx.LayerNorm(cfg.dim, **kw)
        self.attention = nnx.MultiHeadAttention(
            num_heads=cfg.heads,
            num_kv_heads=cfg.kv_heads,
            in_features=cfg.dim,
            decode=False,
            attention_fn=attention_fn,
            **kw,
        )
        self.norm2 = nnx.LayerNorm(cfg.dim, **kw)
        self.up = nnx.Linear(cfg.dim, 4 * cfg.dim, **kw)
        self.down = nnx.Linear(4 * cfg.dim, cfg.dim, **kw)

    def __call__(self, x):
        x = x + self.attention(self.norm1(x), is_causal=True, deterministic=True)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class Decoder(nnx.Module):
    """Token and position embeddings, ``layers`` blocks, a final LayerNorm and the output head."""

    def __init__(self, cfg: Config, attention_fn=jax_flash.flax.attention_fn, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        kw = {"dtype": dtype, "param_dtype": dtype, "rngs": rngs}
        self.embed = nnx.Embed(cfg.vocab, cfg.dim, **kw)
        self.position = nnx.Embed(cfg.seqlen, cfg.dim, **kw)
        self.blocks = nnx.List([Block(cfg, attention_fn, rngs=rngs) for _ in range(cfg.layers)])
        self.norm = nnx.LayerNorm(cfg.dim, **kw)
        self.head = nnx.Linear(cfg.dim, cfg.vocab, **kw)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.position(jnp.arange(tokens.shape[-1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(model: Decoder, tokens: jax.Array) -> jax.Array:
    """Mean next-character cross-entropy (nats)."""
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model: Decoder, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss


class Data:
    """Random windows of seqlen + 1 characters of the corpus, from a seeded generator."""

    def __init__(self, text: str, seqlen: int, batch: int, seed: int = 0):
        self.chars = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.chars)}
        self.ids = np.array([lookup[c] for c in text], np.int32)
        self.seqlen, self.batch = seqlen, batch
        self.rng = np.random.default_rng(seed)

    def next(self) -> jax.Array:
        starts = self.rng.integers(0, len(self.ids) - self.seqlen - 1, self.batch)
        return jnp.asarray(np.stack([self.ids[s : s + self.seqlen + 1] for s in starts]))


def make(cfg: Config, attention_fn=jax_flash.flax.attention_fn, seed: int = 0):
    model = Decoder(cfg, attention_fn, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(cfg.learning_rate), wrt=nnx.Param)
    return model, optimizer


def train(cfg: Config, steps: int, attention_fn=jax_flash.flax.attention_fn, log_every=0):
    """Trains a fresh model for ``steps`` steps; returns (model, per-step losses)."""
    data = Data(corpus(), cfg.seqlen, cfg.batch)
    model, optimizer = make(cfg, attention_fn)
    losses = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        losses.append(float(train_step(model, optimizer, data.next())))
        if log_every and (step % log_every == 0 or step in (1, steps)):
            rate = step / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {losses[-1]:.3f}  ({rate:.1f} steps/s)", flush=True)
    return model, losses


def _png(path: Path, width: int, height: int, pixels: np.ndarray) -> None:
    """An RGB uint8 [height, width, 3] image as a PNG file."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    rows = b"".join(b"\x00" + pixels[y].tobytes() for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows, 9))
        + chunk(b"IEND", b"")
    )


def plot_losses(losses: list[float], path: Path) -> str:
    """Writes the loss curve to ``path``; returns how ("matplotlib" or "built-in")."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        # Axes and the curve, no text: 480 x 320, one column of pixels per step bucket.
        w, h, pad = 480, 320, 24
        img = np.full((h, w, 3), 255, np.uint8)
        img[h - pad, pad : w - pad] = img[pad : h - pad, pad] = 0
        lo, hi = min(losses), max(losses)
        xs = np.linspace(pad, w - pad - 1, len(losses))
        ys = (h - pad) - (np.asarray(losses) - lo) / max(hi - lo, 1e-9) * (h - 2 * pad)
        for x0, y0, x1, y1 in zip(xs[:-1], ys[:-1], xs[1:], ys[1:], strict=True):
            for t in np.linspace(0, 1, 2 + int(abs(x1 - x0) + abs(y1 - y0))):
                x, y = int(round(x0 + t * (x1 - x0))), int(round(y0 + t * (y1 - y0)))
                img[max(y - 1, 0) : y + 1, x : x + 1] = (31, 119, 180)
        _png(path, w, h, img)
        return "built-in"
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(np.arange(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / character)")
    ax.set_title("decoder with jax_flash attention")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


def sample(model: Decoder, data: Data, prompt: str, length: int) -> str:
    """Greedy continuation of ``prompt`` (characters of the corpus)."""
    ids = [data.chars.index(c) for c in prompt]
    seqlen = model.position.num_embeddings
    forward = nnx.jit(lambda m, t: m(t))
    for _ in range(length):
        window = ids[-seqlen:]
        logits = forward(model, jnp.asarray([window]))
        ids.append(int(jnp.argmax(logits[0, -1])))
    return "".join(data.chars[i] for i in ids)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    scratch = Path(tempfile.gettempdir()) / "jax_flash_example"
    parser.add_argument("--out", type=Path, default=scratch, help=f"default {scratch}")
    parser.add_argument("--reference", action="store_true", help="plain-jnp attention instead")
    args = parser.parse_args(argv)
    text = corpus()
    cfg = Config(vocab=len(set(text)))
    fn = reference_attention_fn if args.reference else jax_flash.flax.attention_fn
    print(
        f"{len(text)} characters, vocabulary {cfg.vocab}; {cfg.layers} layers of width {cfg.dim}, "
        f"{cfg.heads} query / {cfg.kv_heads} key-value heads; on {jax.devices()[0]}",
        flush=True,
    )
    model, losses = train(cfg, args.steps, fn, log_every=max(args.steps // 10, 1))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "loss.png"
    how = plot_losses(losses, path)
    note = "" if how == "matplotlib" else " (matplotlib is not installed: built-in writer, no text)"
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; wrote {path}{note}")
    data = Data(text, cfg.seqlen, cfg.batch)
    print("sample:", repr(sample(model, data, "Beautiful is", 40)))


if __name__ == "__main__":
    main()
