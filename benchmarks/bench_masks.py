"""Benchmark jax_flash's masks and packed batches beside cuDNN and FlashAttention-3, in one process,
on the same inputs.

    python benchmarks/bench_masks.py                       # GPU cells on a GPU, CPU cells without
    python benchmarks/bench_masks.py --fa3-dir fa3_carry   # with FlashAttention-3 (sm90 only)
    python benchmarks/bench_masks.py --quick               # fewer cells and calls, a smoke run
    python benchmarks/bench_masks.py --dry-run             # list the cells and exit

On a GPU: bf16, 16 heads of 128, forward and forward+backward, each cell against cuDNN
(jax.nn.dot_product_attention(..., implementation="cudnn")) and FlashAttention-3 where its API has
the feature:
  dense    no mask and causal at 1 x 16k and 4 x 4k tokens: the rates the others are divided by;
  window   a causal sliding window of 1024 keys (each query sees itself and the 1023 keys before
           it: window=(1023, 0), cuDNN's local_window_size=(1023, 0)) over 16k tokens;
  packed   16k tokens in documents of 64..4096 tokens, causal: attention_varlen, attention with
           segment_ids over one [1, 16k] row, cuDNN on the documents padded to one batch with
           query_seq_lengths / key_value_seq_lengths, FlashAttention-3's varlen;
  softcap  softcap=50 on the 4 x 4k cells, against the same cells without it;
  sinks    attention sinks on the 4 x 4k cells, likewise.
The default GPU run is sized for about 3 minutes on an H200; on one, run
    JAX_FLASH_COMMIT=<commit> python3 benchmarks/bench_masks.py --fa3-dir fa3_carry --time-limit 230
(or `bash tools/gpu_run.sh build bench-masks`). Without a GPU it runs small fp32 cells of the
same kinds against XLA and the float32 reference (2-3 minutes on 2 cores).

Rates count visible (query, key) pairs only: FLOPs = 4 * pairs * head_dim * heads forward, 3.5 x
that forward+backward. FlashAttention-3 is imported at run time from a carry folder (--fa3-dir)
holding dew_flash_attn/__init__.py, with the FlashAttention-2 library's import removed, and
libdew_flash_attn3.so.xz, as shared/ANCHORS.md describes; without one its columns are left out
and the report says why.

Writes <out>/masks_<gpu|cpu>[_quick].md (tables) and .csv (one row per implementation and cell),
and prints one line per measured cell. <out> is --out, by default a scratch folder (jax_flash_bench
in the system temp directory); --out benchmarks/results updates the committed results.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from _env import busy_host, commit, environment, resolve_device
from _fa3 import FA3_DIR_HELP, load_fa3, plan_fa3
from _report import (
    CHECK_TOLERANCE,
    DTYPES,
    LABELS,
    CsvSink,
    Result,
    Unit,
    cross_check,
    format_rate,
    markdown_head,
    md_escape,
    md_table,
    md_value,
    progress_line,
    ratio,
    result_fields,
    result_values,
    seqlen_label,
    text_table,
)
from _timing import (
    check_fits,
    compile_jit,
    median,
    release,
    run_timed,
    short_error,
    stop_reason,
    stop_signals,
)

import jax_flash
from jax_flash import reference

# A scratch folder, so that a plain run never overwrites the committed results in
# benchmarks/results (pass --out benchmarks/results to update those).
DEFAULT_OUT = Path(tempfile.gettempdir()) / "jax_flash_bench"
STANDARD_TOKENS = 16384  # the standard grid's tokens per cell; the GPU cells scale with it
# Keys one query of the sliding window sees, itself included: window=(WINDOW_KEYS - 1, 0). This
# is cuDNN's sliding_window_length, which jax.nn derives as local_window_size[0] + 1.
WINDOW_KEYS = 1024
SOFTCAP = 50.0
DOCUMENT_SEED = 0
# The padded batch's length is the longest document rounded up to this, as a bucketing
# pipeline would pad it; a multiple of 64 also keeps cuDNN's backward on its common path.
PAD_MULTIPLE = 64
# Rows the tail reference covers: for a causal mask the last rows' outputs and the last keys'
# gradients depend only on the last rows, so they can be checked without the full problem.
TAIL_ROWS = 512
SECTIONS = {
    "dense": "no mask and causal: the rates the others are divided by",
    "window": "causal sliding window",
    "packed": "packed documents, causal",
    "softcap": f"softcap={SOFTCAP:g}",
    "sinks": "attention sinks",
}
# The implementation whose rate in the `relative` cell a row's rate is divided by.
RELATIVE_IMPL = {"jax_flash_segments": "jax_flash"}


@dataclasses.dataclass(frozen=True)
class Mask:
    """The semantics of one problem, as jax_flash.attention takes them."""

    causal: bool
    window: tuple[int, int] | None = None  # (left, right), both bounded
    softcap: float | None = None
    sinks: bool = False  # one random logit per head, differentiated in forward+backward

    def describe(self) -> str:
        parts = ["causal" if self.causal else "no mask"]
        if self.window:
            parts.append(f"window ({self.window[0]}, {self.window[1]})")
        if self.softcap:
            parts.append(f"softcap {self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Dense q, k, v [batch, seqlen, heads, head_dim], or packed [seqlen, heads, head_dim]
    holding documents of the given lengths back to back (batch 1)."""

    batch: int
    seqlen: int
    heads: int
    head_dim: int
    dtype: str
    documents: tuple[int, ...] = ()

    @property
    def packed(self) -> bool:
        return bool(self.documents)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.packed:
            return (self.seqlen, self.heads, self.head_dim)
        return (self.batch, self.seqlen, self.heads, self.head_dim)

    @property
    def padded_length(self) -> int:
        """Length of the padded batch cuDNN and XLA get for a packed layout."""
        return -(-max(self.documents) // PAD_MULTIPLE) * PAD_MULTIPLE

    def label(self) -> str:
        if self.packed:
            return f"{seqlen_label(self.seqlen)} in {len(self.documents)} docs"
        return f"{self.batch}x{seqlen_label(self.seqlen)}"


def band_pairs(length: int, causal: bool, window: tuple[int, int] | None) -> int:
    """Visible (query, key) pairs of one self-attention sequence: the sum over query rows i of
    the keys j in [i - left, i + right] within [0, length), as jax_flash.reference.band_mask
    (with causal, right = 0)."""
    rows = np.arange(length, dtype=np.int64)
    lo = np.zeros_like(rows)
    hi = np.full_like(rows, length - 1)
    left, right = window if window else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is not None:
        lo = np.maximum(lo, rows - left)
    if right is not None:
        hi = np.minimum(hi, rows + right)
    return int(np.maximum(hi - lo + 1, 0).sum())


class Inputs(NamedTuple):
    """One problem's arrays in its own layout; sinks [heads] float32."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    dout: jax.Array
    sinks: jax.Array


class Prepared(NamedTuple):
    """One implementation's arguments: differentiated, constant, and the output cotangent."""

    diff: tuple[jax.Array, ...]
    consts: tuple[jax.Array, ...]
    dout: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class Variant:
    """One implementation of a problem: attend(*diff, *consts) on the arguments prepare builds
    from the problem's inputs (outside the timed function), and restore, which brings its
    outputs (out, then the gradients of diff) back to the problem's layout for the check."""

    impl: str
    attend: Callable[..., jax.Array]
    prepare: Callable[[Inputs], Prepared]
    restore: Callable[[list[jax.Array]], list[jax.Array]] = list


@dataclasses.dataclass(frozen=True, eq=False)
class Reference:
    """An untimed float32 implementation, run when none of the problem's timed checkers ran.
    view maps a timed implementation's restored outputs to the part the reference computes."""

    variant: Variant
    what: str
    view: Callable[[list[jax.Array]], list[jax.Array]] | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
    """Inputs and semantics measured by several implementations, forward and forward+backward."""

    section: str
    title: str
    layout: Layout
    mask: Mask
    variants: tuple[Variant, ...]
    reference: Reference | None
    # Cross-check order: the first of these that ran is what the others are compared with.
    check_order: tuple[str, ...]
    baseline: str | None  # the 'X / baseline' columns divide by this implementation
    relative: Mapping[bool, Problem]  # backward -> the problem whose rates this one's divide by
    directions: tuple[bool, ...] = (False, True)

    @functools.cached_property
    def pairs(self) -> int:
        """Visible (query, key) pairs over the whole batch, the FLOP count's basis."""
        if self.layout.packed:
            return sum(
                band_pairs(n, self.mask.causal, self.mask.window) for n in self.layout.documents
            )
        return self.layout.batch * band_pairs(
            self.layout.seqlen, self.mask.causal, self.mask.window
        )

    @property
    def impls(self) -> list[str]:
        return [v.impl for v in self.variants]


@dataclasses.dataclass(frozen=True, eq=False)
class Cell:
    """One problem in one direction: what a Result measures."""

    problem: Problem
    backward: bool

    CSV_FIELDS: ClassVar[tuple[str, ...]] = (
        "section",
        "case",
        "direction",
        "dtype",
        "head_dim",
        "heads",
        "batch",
        "seqlen",
        "documents",
        "causal",
        "window_left",
        "window_right",
        "softcap",
        "sinks",
        "visible_pairs",
        "baseline",
    )

    @property
    def dtype(self) -> str:
        return self.problem.layout.dtype

    @property
    def direction(self) -> str:
        return "fwd+bwd" if self.backward else "fwd"

    def flops(self) -> float:
        layout = self.problem.layout
        forward = 4.0 * self.problem.pairs * layout.head_dim * layout.heads
        return 3.5 * forward if self.backward else forward

    def label(self) -> str:
        return f"{self.problem.section:<7} {self.problem.title:<30} {self.direction:<7}"

    def csv_values(self) -> list[object]:
        p, layout, window = self.problem, self.problem.layout, self.problem.mask.window
        return [
            p.section,
            p.title,
            self.direction,
            layout.dtype,
            layout.head_dim,
            layout.heads,
            layout.batch,
            layout.seqlen,
            " ".join(map(str, layout.documents)),
            int(p.mask.causal),
            "" if window is None else window[0],
            "" if window is None else window[1],
            p.mask.softcap or "",
            int(p.mask.sinks),
            p.pairs,
            p.baseline or "",
        ]


# --- implementations -------------------------------------------------------------------------


def _as_is(mask: Mask) -> Callable[[Inputs], Prepared]:
    def prepare(x: Inputs) -> Prepared:
        return Prepared((x.q, x.k, x.v, *((x.sinks,) if mask.sinks else ())), (), x.dout)

    return prepare


def _in_float32(prepare: Callable[[Inputs], Prepared]) -> Callable[[Inputs], Prepared]:
    def prepare32(x: Inputs) -> Prepared:
        p = prepare(x)
        f32 = [a.astype(jnp.float32) for a in (*p.diff, p.dout)]
        return Prepared(tuple(f32[:-1]), p.consts, f32[-1])

    return prepare32


def _with_mask(attention: Callable[..., jax.Array], mask: Mask) -> Callable[..., jax.Array]:
    """attend(q, k, v[, sinks]) through jax_flash.attention or the reference, which share one
    signature."""

    def attend(q, k, v, *sinks):
        return attention(
            q, k, v, causal=mask.causal, window=mask.window, softcap=mask.softcap,
            sinks=sinks[0] if sinks else None,
        )  # fmt: skip

    return attend


def flash_dense(mask: Mask) -> Variant:
    return Variant("jax_flash", _with_mask(jax_flash.attention, mask), _as_is(mask))


def jax_nn_dense(implementation: str, mask: Mask) -> Variant:
    def attend(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=mask.causal, local_window_size=mask.window,
            implementation=implementation,
        )  # fmt: skip

    return Variant(implementation, attend, _as_is(mask))


def fa3_dense(fa3: Any, mask: Mask) -> Variant:
    window = mask.window or (-1, -1)  # FlashAttention's 'unbounded'

    def attend(q, k, v, *sinks):
        return fa3.flash_mha(
            q, k, v, is_causal=mask.causal, window_size=window, sinks=sinks[0] if sinks else None
        )

    return Variant("fa3", attend, _as_is(mask))


def _reference_call(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    def attend(*args):
        # Full float32 products: on GPUs XLA would otherwise take TF32 for float32 matmuls.
        with jax.default_matmul_precision("highest"):
            return fn(*args)

    return attend


def reference_dense(mask: Mask) -> Variant:
    attend = _reference_call(_with_mask(reference.attention_reference, mask))
    return Variant("reference", attend, _in_float32(_as_is(mask)))


def tail_reference(layout: Layout, mask: Mask) -> Reference:
    """The reference on the last TAIL_ROWS rows of a causal problem (without sinks, whose
    gradient sums over every row): their outputs and dq, and dk, dv of the last TAIL_ROWS keys,
    which only those rows see. The bottom-right alignment of the sliced problem keeps every
    visible pair where it was."""
    rows = min(TAIL_ROWS, layout.seqlen)
    left = mask.window[0] if mask.window else layout.seqlen
    first_key = max(0, layout.seqlen - rows - left)

    def prepare(x: Inputs) -> Prepared:
        return Prepared(
            (x.q[:, -rows:], x.k[:, first_key:], x.v[:, first_key:]), (), x.dout[:, -rows:]
        )

    def restore(leaves: list[jax.Array]) -> list[jax.Array]:
        return [leaf[:, -rows:] for leaf in leaves]

    variant = dataclasses.replace(
        reference_dense(mask), prepare=_in_float32(prepare), restore=restore
    )
    return Reference(variant, f"float32 reference on the last {rows} rows", view=restore)


def _document_index(layout: Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cu_seqlens [N + 1], and each token's document and position in it."""
    lengths = np.asarray(layout.documents)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    document = np.repeat(np.arange(len(lengths)), lengths)
    return cu, document, np.arange(layout.seqlen) - cu[document]


def flash_varlen(layout: Layout, mask: Mask) -> Variant:
    cu, _, _ = _document_index(layout)
    longest = max(layout.documents)

    def prepare(x: Inputs) -> Prepared:
        return Prepared((x.q, x.k, x.v), (jnp.asarray(cu),), x.dout)

    def attend(q, k, v, cu_seqlens):
        return jax_flash.attention_varlen(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen_q=longest, max_seqlen_k=longest,
            causal=mask.causal, window=mask.window, softcap=mask.softcap,
        )  # fmt: skip

    return Variant("jax_flash", attend, prepare)


def flash_segments(layout: Layout, mask: Mask) -> Variant:
    _, document, _ = _document_index(layout)
    ids = jnp.asarray(document[None].astype(np.int32))

    def prepare(x: Inputs) -> Prepared:
        return Prepared((x.q[None], x.k[None], x.v[None]), (ids,), x.dout[None])

    def attend(q, k, v, segment_ids):
        return jax_flash.attention(
            q, k, v, causal=mask.causal, window=mask.window, softcap=mask.softcap,
            segment_ids=segment_ids,
        )  # fmt: skip

    return Variant("jax_flash_segments", attend, prepare, lambda leaves: [x[0] for x in leaves])


def jax_nn_padded(implementation: str, layout: Layout, mask: Mask) -> Variant:
    """The documents as a [N, padded_length] batch with their lengths: jax.nn turns lengths and
    is_causal into cuDNN's PADDING_CAUSAL mask, whose top-left diagonal is the bottom-right one
    here, since each document's queries and keys are the same tokens."""
    _, document, position = _document_index(layout)
    lengths = jnp.asarray(np.asarray(layout.documents, np.int32))
    padded = (len(layout.documents), layout.padded_length)

    def pad(x: jax.Array) -> jax.Array:
        return jnp.zeros(padded + x.shape[1:], x.dtype).at[document, position].set(x)

    def prepare(x: Inputs) -> Prepared:
        return Prepared((pad(x.q), pad(x.k), pad(x.v)), (lengths,), pad(x.dout))

    def attend(q, k, v, seq_lengths):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=mask.causal, query_seq_lengths=seq_lengths,
            key_value_seq_lengths=seq_lengths, local_window_size=mask.window,
            implementation=implementation,
        )  # fmt: skip

    def restore(leaves: list[jax.Array]) -> list[jax.Array]:
        return [leaf[document, position] for leaf in leaves]

    return Variant(implementation, attend, prepare, restore)


def fa3_varlen(fa3: Any, layout: Layout, mask: Mask) -> Variant:
    cu, _, _ = _document_index(layout)
    longest = max(layout.documents)
    window = mask.window or (-1, -1)

    def prepare(x: Inputs) -> Prepared:
        return Prepared((x.q, x.k, x.v), (jnp.asarray(cu),), x.dout)

    def attend(q, k, v, cu_seqlens):
        return fa3.flash_mha_varlen(
            q, k, v, cu_seqlens, longest, is_causal=mask.causal, window_size=window
        )

    return Variant("fa3", attend, prepare)


def reference_packed(layout: Layout, mask: Mask) -> Reference:
    """The reference one document at a time: exact, and each piece is small."""
    cu, _, _ = _document_index(layout)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))

    def attend(q, k, v):
        return jnp.concatenate(
            [
                reference.attention_reference(
                    q[None, a:b],
                    k[None, a:b],
                    v[None, a:b],
                    causal=mask.causal,
                    window=mask.window,
                    softcap=mask.softcap,
                )[0]
                for a, b in bounds
            ]
        )

    variant = Variant("reference", _reference_call(attend), _in_float32(_as_is(mask)))
    return Reference(variant, "float32 reference, one document at a time")


# --- the cells -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the problems are built from: platform, sizes, implementations, timing."""

    name: str  # "gpu" or "cpu"
    quick: bool
    dtype: str
    heads: int
    head_dim: int
    tokens: int  # the longest sequence of the dense and window cells
    baseline: str  # "cudnn" on GPUs, "xla" on CPUs
    fa3: Any | None
    # Largest batch * heads * seqlen^2 the float32 reference (and, on a CPU, XLA) runs in full.
    full_scores: int
    repeats: int
    iters: int | None

    def layout(self, batch: int, seqlen: int, documents: tuple[int, ...] = ()) -> Layout:
        return Layout(batch, seqlen, self.heads, self.head_dim, self.dtype, documents)


def document_lengths(tokens: int, shortest: int, longest: int, seed: int) -> tuple[int, ...]:
    """Uniform random lengths in [shortest, longest] until tokens are filled; the last one is cut
    so that they sum to tokens exactly."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(shortest, longest + 1)))
    lengths[-1] -= sum(lengths) - tokens
    return tuple(lengths)


def _both(problem: Problem) -> dict[bool, Problem]:
    return {False: problem, True: problem}


def dense_problem(
    setup: Setup,
    section: str,
    layout: Layout,
    mask: Mask,
    relative: Mapping[bool, Problem] | None = None,
    directions: tuple[bool, ...] = (False, True),
) -> Problem:
    scores = layout.batch * layout.heads * layout.seqlen**2
    variants = [flash_dense(mask)]
    plain = not (mask.softcap or mask.sinks)  # cuDNN and XLA have neither
    if plain and (setup.baseline == "cudnn" or scores <= setup.full_scores):
        variants.append(jax_nn_dense(setup.baseline, mask))
    if setup.fa3 is not None and not mask.softcap:
        variants.append(fa3_dense(setup.fa3, mask))
    if scores <= setup.full_scores:
        check: Reference | None = Reference(reference_dense(mask), "float32 reference")
    elif mask.causal and not mask.sinks:
        check = tail_reference(layout, mask)
    else:
        check = None
    title = f"{mask.describe()}, {layout.label()}"
    order = (setup.baseline, "fa3", "reference") if plain else ("reference", "fa3")
    baseline = setup.baseline if plain and setup.baseline in [v.impl for v in variants] else None
    return Problem(
        section, title, layout, mask, tuple(variants), check, order, baseline, relative or {},
        directions,
    )  # fmt: skip


def packed_problem(
    setup: Setup, layout: Layout, mask: Mask, relative: Mapping[bool, Problem]
) -> Problem:
    variants = [flash_varlen(layout, mask), flash_segments(layout, mask)]
    variants.append(jax_nn_padded(setup.baseline, layout, mask))
    if setup.fa3 is not None:
        variants.append(fa3_varlen(setup.fa3, layout, mask))
    title = f"{mask.describe()}, {layout.label()}"
    order = (setup.baseline, "fa3", "reference")
    return Problem(
        "packed", title, layout, mask, tuple(variants), reference_packed(layout, mask), order,
        setup.baseline, relative,
    )  # fmt: skip


def feature_problems(setup: Setup, batch: int, seqlen: int, causal: bool) -> list[Problem]:
    """The dense cell, then the same cell with softcap and with sinks, measured back to back so
    that their ratios come from one stretch of the run."""
    layout = setup.layout(batch, seqlen)
    base = dense_problem(setup, "dense", layout, Mask(causal))
    return [
        base,
        dense_problem(setup, "softcap", layout, Mask(causal, softcap=SOFTCAP), _both(base)),
        dense_problem(setup, "sinks", layout, Mask(causal, sinks=True), _both(base)),
    ]


def gpu_problems(setup: Setup) -> list[Problem]:
    """The GPU cells; every length scales with setup.tokens (16k by default)."""
    tokens = setup.tokens
    scale = tokens / STANDARD_TOKENS
    window = (max(1, round(WINDOW_KEYS * scale)) - 1, 0)
    causal_flags = (True,) if setup.quick else (False, True)
    long = setup.layout(1, tokens)
    dense = {c: dense_problem(setup, "dense", long, Mask(c)) for c in causal_flags}
    problems = [
        *dense.values(),
        dense_problem(setup, "window", long, Mask(True, window=window), _both(dense[True])),
    ]
    # Causal first, then the packed documents, so that a time limit cuts the non-causal 4k group
    # rather than them.
    short = {c: feature_problems(setup, 4, tokens // 4, c) for c in (True, False)}
    documents = document_lengths(
        tokens, max(1, round(64 * scale)), round(4096 * scale), DOCUMENT_SEED
    )
    packed = setup.layout(1, tokens, documents)
    problems += short[True]
    problems.append(packed_problem(setup, packed, Mask(True), _both(short[True][0])))
    if not setup.quick:
        problems += short[False]
    return problems


def cpu_problems(setup: Setup) -> list[Problem]:
    """fp32 cells a 2-core CPU measures in 2-3 minutes: a window over a long sequence beside the
    dense causal one (forward only there: its backward alone takes half a minute), and beside a
    dense causal forward+backward at a quarter of the length; a small packed batch beside dense
    causal 8 x 1k; softcap and sinks on 2 x 2k (1k with --quick)."""
    long = setup.tokens
    window = (WINDOW_KEYS - 1, 0)
    dense_long = dense_problem(
        setup, "dense", setup.layout(1, long), Mask(True), directions=(False,)
    )
    dense_mid = dense_problem(setup, "dense", setup.layout(1, long // 4), Mask(True))
    dense_short = dense_problem(setup, "dense", setup.layout(8, 1024), Mask(True))
    packed_tokens, longest = (4096, 512) if setup.quick else (8192, 1024)
    documents = document_lengths(packed_tokens, 64, longest, DOCUMENT_SEED)
    problems = [
        dense_long,
        dense_mid,
        dense_problem(
            setup,
            "window",
            setup.layout(1, long),
            Mask(True, window=window),
            {False: dense_long, True: dense_mid},
        ),
        dense_short,
        packed_problem(
            setup, setup.layout(1, packed_tokens, documents), Mask(True), _both(dense_short)
        ),
    ]
    feature_len = 1024 if setup.quick else 2048
    for causal in (False, True):
        problems += feature_problems(setup, 2, feature_len, causal)
    return problems


def cells_of(problems: Sequence[Problem], backward: bool, sections: Sequence[str]) -> list[Cell]:
    """Each problem's forward then forward+backward cell; the cells other sections' ratios need
    stay whatever the section filter says."""
    wanted = {p for p in problems if p.section in sections}
    wanted |= {other for p in wanted for other in p.relative.values()}
    return [
        Cell(p, bwd) for p in problems if p in wanted for bwd in p.directions if backward or not bwd
    ]


# --- measuring -------------------------------------------------------------------------------


def timed_function(attend: Callable[..., jax.Array], n_diff: int, backward: bool) -> Callable:
    """forward(*diff, *consts), or forward+backward(*diff, *consts, dout) returning out and the
    gradients of diff."""
    if not backward:
        return attend

    def forward_backward(*args: jax.Array) -> Any:
        diff, consts, dout = args[:n_diff], args[n_diff:-1], args[-1]
        out, pullback = jax.vjp(lambda *d: attend(*d, *consts), *diff)
        # out is returned as well, so that XLA cannot drop the P.V product of the forward.
        return (out, *pullback(dout))

    return forward_backward


def _arguments(variant: Variant, inputs: Inputs, backward: bool) -> tuple[Prepared, list]:
    prepared = variant.prepare(inputs)
    args = [*prepared.diff, *prepared.consts, *([prepared.dout] if backward else [])]
    return prepared, args


def measure(
    cell: Cell, variant: Variant, inputs: Inputs, setup: Setup, device: jax.Device
) -> tuple[Result, list[jax.Array]]:
    """Times one implementation on one cell; also returns one call's outputs for the check."""
    try:
        prepared, args = _arguments(variant, inputs, cell.backward)
        fn = timed_function(variant.attend, len(prepared.diff), cell.backward)
        per_call, iters, leaves = run_timed(
            fn, args, device, iters=setup.iters, repeats=setup.repeats
        )
        leaves = variant.restore(leaves)
    except Exception as exc:  # any failure becomes this cell's 'error: ...'; the run goes on
        return Result(cell, variant.impl, None, short_error(exc), 0, setup.repeats), []
    result = Result(
        cell, variant.impl, median(per_call), None, iters, setup.repeats, tuple(per_call)
    )
    return result, leaves


def run_reference(
    cell: Cell, check: Reference, inputs: Inputs, device: jax.Device
) -> tuple[list[jax.Array], str]:
    """One untimed call of the reference: (its outputs, '') or ([], why it did not run)."""
    try:
        prepared, args = _arguments(check.variant, inputs, cell.backward)
        fn = timed_function(check.variant.attend, len(prepared.diff), cell.backward)
        compiled = compile_jit(fn, args)
        check_fits(compiled, device)
        return check.variant.restore(jax.tree_util.tree_leaves(compiled(*args))), ""
    except Exception as exc:
        return [], short_error(exc)


def make_inputs(layout: Layout) -> Inputs:
    """Random normal q, k, v, dout (zeros or constants would let the softmax and the hardware
    take shortcuts real data never allows) and sinks, the same for every problem of a layout."""
    seed = layout.seqlen + 7 * layout.head_dim + 13 * layout.batch + len(layout.documents)
    keys = jax.random.split(jax.random.key(seed), 5)
    arrays = [jax.random.normal(key, layout.shape, DTYPES[layout.dtype]) for key in keys[:4]]
    sinks = jax.random.normal(keys[4], (layout.heads,), jnp.float32)
    return jax.block_until_ready(Inputs(*arrays, sinks))


def relative_ratios(
    cell: Cell,
    measured: Mapping[str, Result],
    done: Mapping[tuple[Problem, bool], dict[str, Result]],
) -> dict[str, float]:
    """Each implementation's rate here over its own rate in the cell's relative problem."""
    other = done.get((cell.problem.relative.get(cell.backward), cell.backward), {})
    ratios = {}
    for impl, result in measured.items():
        base = other.get(RELATIVE_IMPL.get(impl, impl))
        mine = result.rate(1.0)
        theirs = base.rate(1.0) if base else None
        if mine is not None and theirs:
            ratios[impl] = mine / theirs
    return ratios


def _relative_title(cell: Cell) -> str:
    other = cell.problem.relative.get(cell.backward)
    return other.title if other else ""


def cell_extra(
    cell: Cell,
    measured: Mapping[str, Result],
    relative: Mapping[str, float],
    check_note: str,
) -> str:
    """The progress line's tail: the other implementations' ratios to the baseline, the rates
    over the relative cell's, and how the outputs were checked."""
    parts = []
    baseline = cell.problem.baseline
    others = [i for i in measured if i not in ("jax_flash", baseline)]
    for impl in others if baseline else ():
        r = ratio(dict(measured), impl, baseline)
        if r is not None:
            parts.append(f"{LABELS[impl]}/{LABELS[baseline]} {r:.2f}")
    if relative:
        ratios = ", ".join(f"{LABELS[i]} {r:.2f}" for i, r in relative.items())
        parts.append(f"/ {_relative_title(cell)}: {ratios}")
    if check_note:
        parts.append(check_note)
    return " | ".join(parts)


def run_cells(
    cells: Sequence[Cell],
    setup: Setup,
    device: jax.Device,
    unit: Unit,
    done: dict[tuple[Problem, bool], dict[str, Result]],
    sink: CsvSink,
) -> None:
    """Measures every cell with every implementation; fills `done` as it goes."""
    inputs: Inputs | None = None
    layout: Layout | None = None
    input_error = ""
    try:
        for index, cell in enumerate(cells, 1):
            start = time.perf_counter()
            problem = cell.problem
            if problem.layout != layout:
                if inputs is not None:
                    release(list(inputs))
                inputs, layout = None, problem.layout
                try:
                    inputs = make_inputs(layout)
                except Exception as exc:  # e.g. out of memory for the inputs themselves
                    input_error = short_error(exc)
            measured, outputs = {}, {}
            for variant in problem.variants:
                if inputs is None:
                    error = input_error
                    measured[variant.impl] = Result(cell, variant.impl, None, error, 0, 0)
                    continue
                measured[variant.impl], outputs[variant.impl] = measure(
                    cell, variant, inputs, setup, device
                )
            note = ""
            order = problem.check_order
            before = order[: order.index("reference")] if "reference" in order else order
            if inputs is None:
                note = "no inputs"
            elif not any(outputs.get(i) for i in before) and problem.reference is not None:
                leaves, why = run_reference(cell, problem.reference, inputs, device)
                if leaves:
                    view = problem.reference.view or list
                    outputs = {i: view(out) if out else out for i, out in outputs.items()}
                    outputs["reference"] = leaves
                    note = f"checked against the {problem.reference.what}"
                else:
                    note = f"unchecked: reference failed ({why})"
            elif not any(outputs.get(i) for i in order):
                note = "unchecked: nothing to compare with at this size"
            measured = cross_check(measured, outputs, problem.check_order)
            release([x for leaves in outputs.values() for x in leaves])
            done[(problem, cell.backward)] = measured
            relative = relative_ratios(cell, measured, done)
            sink.add(csv_rows(cell, measured, relative, unit))
            extra = cell_extra(cell, measured, relative, note)
            elapsed = time.perf_counter() - start
            line = progress_line(
                index, len(cells), cell, measured, problem.baseline, unit, elapsed, extra
            )
            print(line, flush=True)
    finally:
        if inputs is not None:
            release(list(inputs))


# --- reporting -------------------------------------------------------------------------------


def csv_fields(unit: Unit) -> list[str]:
    return [*Cell.CSV_FIELDS, *result_fields(unit, None), "relative_to", "ratio_to_relative"]


def csv_rows(
    cell: Cell,
    measured: Mapping[str, Result],
    relative: Mapping[str, float],
    unit: Unit,
) -> list[list[object]]:
    rows = []
    for impl, result in measured.items():
        r = ratio(dict(measured), impl, cell.problem.baseline)
        rel = relative.get(impl)
        rows.append(
            [
                *cell.csv_values(),
                *result_values(result, unit, r),
                _relative_title(cell) if rel is not None else "",
                "" if rel is None else f"{rel:.4f}",
            ]
        )
    return rows


def method_lines(setup: Setup, problems: Sequence[Problem]) -> list[str]:
    iters = "auto-chosen (>= 0.3 s per repeat, at most 20)" if setup.iters is None else setup.iters
    base = LABELS[setup.baseline]
    lines = [
        "Implementations: jax_flash.attention (window=, softcap=, sinks=, segment_ids=) and "
        f"jax_flash.attention_varlen; {base} = jax.nn.dot_product_attention(..., "
        f'implementation="{setup.baseline}") with is_causal, local_window_size and '
        "query_seq_lengths / key_value_seq_lengths; FA3 = dew_flash_attn.flash_mha / "
        "flash_mha_varlen (is_causal, window_size, sinks; it has no softcap; sm90 GPUs only). "
        "Same process, same inputs.",
        "Timing: each function is jitted and compiled once per cell, warmed up with 2 calls, "
        f"then timed as {setup.repeats} repeats of {iters} back-to-back calls; the median time "
        "per call is reported. forward+backward: one jitted function returning out and the "
        "gradients (dq, dk, dv, and d sinks where there are sinks) for a fixed random dout.",
        "Rates count visible (query, key) pairs, exactly: the sum over query rows of the keys "
        "each sees. FLOPs = 4 * pairs * head_dim * heads forward, 3.5 x that forward+backward "
        "(the standard grid's 2.5 x for the backward). A dense causal row of S tokens has "
        "S(S+1)/2 pairs, 1/S more than the standard grid's S^2/2.",
        f"softcap {SOFTCAP:g}; sinks: one random normal float32 logit per head.",
        f"Inputs: random normal, {setup.dtype}, {setup.heads} heads of {setup.head_dim}.",
    ]
    for left in sorted({p.mask.window[0] for p in problems if p.mask.window}):
        lines.append(
            f"Window: {left + 1} keys per query, itself included: jax_flash window=({left}, 0) "
            f"with causal=True; jax.nn local_window_size=({left}, 0), which it passes to cuDNN "
            f"as sliding_window_length = left + 1 = {left + 1}; FA3 window_size=({left}, 0). "
            "All of them see the same pairs."
        )
    for problem in problems:
        if problem.layout.packed:
            layout = problem.layout
            lines.append(
                f"Packed ({problem.title}): documents of {', '.join(map(str, layout.documents))} "
                f"tokens (seed {DOCUMENT_SEED}, the last cut to fill {layout.seqlen}); jax_flash "
                f"varlen takes them packed [{layout.seqlen}, H, D] with cu_seqlens, segment_ids "
                f"as one causal [1, {layout.seqlen}] row, {base} padded to "
                f"[{len(layout.documents)}, {layout.padded_length}] (the longest document "
                f"rounded up to {PAD_MULTIPLE}) with is_causal and the lengths as "
                "query_seq_lengths and key_value_seq_lengths (for cuDNN jax.nn makes that its "
                "PADDING_CAUSAL mask).",
            )
    tolerances = ", ".join(f"{k} {v:g}" for k, v in CHECK_TOLERANCE.items())
    lines.append(
        f"Check: one call's outputs of each implementation are compared with {base}'s (its "
        "padded rows dropped), else FA3's, else a float32 jax_flash.reference run (in full "
        f"where it fits, else on the last {TAIL_ROWS} rows of a causal cell); for softcap and "
        f"sinks always that reference. A relative L2 error above {tolerances} marks the "
        "figure 'WRONG?'. The check cannot tell a window one key wider from the right one."
    )
    lines.append("A failing implementation records 'error: <reason>' in its cell.")
    return lines


PADDING_NOTE = (
    "Spanned: the pairs of the layout each implementation is given (the padded batch's causal "
    "triangles; segment_ids' one causal row). Work done: the time here times the pairs per "
    "second the same implementation reaches on the dense causal cell. Padding skipped = "
    "(spanned - work) / (spanned - visible): an estimate, which assumes that cell's speed per "
    "pair."
)


def padding_rows(
    problem: Problem,
    done: Mapping[tuple[Problem, bool], dict[str, Result]],
    backward: bool,
) -> tuple[list[str], list[list[str]]]:
    """How much of the padding each packed implementation avoids (PADDING_NOTE)."""
    layout, mask = problem.layout, problem.mask
    visible = problem.pairs
    spanned = {
        "jax_flash": visible,
        "fa3": visible,
        "jax_flash_segments": band_pairs(layout.seqlen, mask.causal, mask.window),
        problem.baseline: len(layout.documents)
        * band_pairs(layout.padded_length, mask.causal, mask.window),
    }
    measured = done.get((problem, backward), {})
    dense = done.get((problem.relative.get(backward), backward), {})
    header = [
        "implementation",
        "pairs its layout spans",
        "visible / spanned",
        "work done, in visible pairs (at its dense causal rate)",
        "padding skipped (estimate)",
    ]
    rows = []
    for impl, result in measured.items():
        base = dense.get(RELATIVE_IMPL.get(impl, impl))
        span = spanned.get(impl, visible)
        work, skipped = "-", "-"
        if result.seconds is not None and base is not None and base.seconds is not None:
            # pairs per second at its dense rate, times the time here
            done_pairs = result.seconds * base.cell.problem.pairs / base.seconds
            work = f"{done_pairs / visible:.2f}"
            if span > visible:
                skipped = f"{(span - done_pairs) / (span - visible):.0%}"
        rows.append([LABELS[impl], f"{span / 1e6:.1f} M", f"{visible / span:.0%}", work, skipped])
    return header, rows


def checked_against(cell: Cell, measured: Mapping[str, Result]) -> str:
    """What the cell's outputs were compared with ('-' when nothing was)."""
    ref = next((r.checked_against for r in measured.values() if r.checked_against), None)
    if ref == "reference" and cell.problem.reference is not None:
        return cell.problem.reference.what
    return LABELS[ref] if ref else "-"


def section_rows(
    section: str,
    cells: Sequence[Cell],
    done: Mapping[tuple[Problem, bool], dict[str, Result]],
    unit: Unit,
    markdown: bool,
) -> tuple[list[str], list[list[str]]]:
    """One section's table: rates, ratios to the baseline and to the relative cell."""
    mine = [c for c in cells if c.problem.section == section]
    impls = list(dict.fromkeys(i for c in mine for i in c.problem.impls))
    baselines = {c.problem.baseline for c in mine} - {None}
    baseline = baselines.pop() if len(baselines) == 1 else None
    others = [i for i in impls if baseline and i != baseline]
    with_relative = any(c.problem.relative for c in mine)
    header = ["case", "dir", "visible pairs", *(LABELS[i] for i in impls)]
    header += [f"{LABELS[i]} / {LABELS[baseline]}" for i in others if baseline]
    if with_relative:
        header += ["relative to (same implementation)"] + [f"{LABELS[i]} ÷" for i in impls]
    header.append("checked against")
    rows = []
    for cell in mine:
        measured = done.get((cell.problem, cell.backward), {})
        row = [cell.problem.title, cell.direction, f"{cell.problem.pairs / 1e6:.1f} M"]
        for impl in impls:
            result = measured.get(impl)
            if markdown:
                row.append(md_value(result, unit))
            elif result is None:
                row.append("-")
            else:
                row.append("err" if result.error else format_rate(result.rate(unit.scale)))
                row[-1] += "!" if result.suspect else ""
        for impl in others:
            r = ratio(dict(measured), impl, baseline)
            row.append("-" if r is None else f"{r:.2f}")
        if with_relative:
            relative = relative_ratios(cell, measured, done)
            row.append(_relative_title(cell) or "-")
            row += [f"{relative[i]:.2f}" if i in relative else "-" for i in impls]
        row.append(checked_against(cell, measured))
        rows.append(row)
    return header, rows


def section_tables(
    cells: Sequence[Cell],
    done: Mapping[tuple[Problem, bool], dict[str, Result]],
    unit: Unit,
    markdown: bool,
) -> list[str]:
    """Every section's table (and the packed cells' padding tables), as markdown or as aligned
    text for the console."""
    lines = []
    for section in dict.fromkeys(c.problem.section for c in cells):
        title = f"{section}: {SECTIONS[section]} ({unit.name} on visible pairs)"
        header, rows = section_rows(section, cells, done, unit, markdown)
        if markdown:
            lines += ["", f"## {title}", ""]
            lines += md_table(header, [[md_escape(v) for v in row] for row in rows])
        else:
            lines += ["", title, *text_table(header, rows)]
        for cell in cells:
            if cell.problem.section != section or not cell.problem.layout.packed:
                continue
            header, rows = padding_rows(cell.problem, done, cell.backward)
            if not rows:
                continue
            if markdown:
                lines += ["", f"Padding, {cell.direction} ({cell.problem.title}):", ""]
                lines += [*md_table(header, rows), "", PADDING_NOTE]
            else:
                lines += [f"padding, {cell.direction}:", *text_table(header, rows)]
    return lines


def gpu_command() -> str:
    """The command for a GPU machine whose copy of the tree has no .git, with this checkout's
    commit filled in."""
    head = commit().split()[0]
    prefix = f"JAX_FLASH_COMMIT={head} " if not head.startswith("unknown") else ""
    return f"{prefix}python3 benchmarks/bench_masks.py --fa3-dir fa3_carry --time-limit 230"


def print_plan(cells: Sequence[Cell], setup: Setup, fa3_status: str, files: Sequence[Path]) -> None:
    iters = "auto" if setup.iters is None else setup.iters
    print(
        f"{setup.name} cells{' (quick)' if setup.quick else ''}: {len(cells)} cells; "
        f"{setup.repeats} repeats x {iters} calls; {setup.dtype}, {setup.heads} heads of "
        f"{setup.head_dim}"
    )
    print(f"FA3: {fa3_status}")
    for index, cell in enumerate(cells, 1):
        impls = ", ".join(LABELS[i] for i in cell.problem.impls)
        check = cell.problem.reference.what if cell.problem.reference else "none"
        print(
            f"  [{index:>2}] {cell.label()} {cell.problem.pairs / 1e6:8.1f} M pairs "
            f"{cell.flops() / 1e9:9.1f} GFLOP | {impls} | reference: {check}"
        )
    print("would write: " + ", ".join(str(f) for f in files))
    print(f"GPU command: {gpu_command()}")


# --- command line ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--platform",
        choices=("auto", "gpu", "cpu"),
        default="auto",
        help="auto: the GPU cells if JAX sees a GPU, else the CPU cells (default: auto)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="causal cells only (GPU), shorter sequences (CPU), fewer repeats",
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=tuple(SECTIONS),
        default=tuple(SECTIONS),
        help="which sections to measure (the dense cells their ratios need are kept)",
    )
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument(
        "--fa3-dir",
        type=Path,
        help=FA3_DIR_HELP,
    )
    parser.add_argument(
        "--repeats", type=int, help="timed repeats, the median is reported (default: 5 GPU, 3 CPU)"
    )
    parser.add_argument(
        "--iters", help="back-to-back calls per repeat, or 'auto' (default: 20 GPU, auto CPU)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"results directory (default: the scratch folder {DEFAULT_OUT})",
    )
    parser.add_argument("--name", help="file name stem (default masks_<gpu|cpu>[_quick])")
    parser.add_argument("--dry-run", action="store_true", help="list the cells and exit")
    parser.add_argument(
        "--time-limit",
        type=int,
        metavar="SECONDS",
        help="stop measuring after this long and write what was measured",
    )
    # Testing aids, left out of --help: the GPU cells' code paths at small sizes on a CPU.
    parser.add_argument("--grid", choices=("gpu", "cpu"), help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--heads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--head-dim", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.iters not in (None, "auto"):
        try:
            args.iters = int(args.iters)
        except ValueError:
            parser.error(f"--iters must be an int or 'auto', got {args.iters!r}")
        if args.iters < 1:
            parser.error("--iters must be >= 1 or 'auto'")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.tokens is not None and (args.tokens < 64 or args.tokens % 64):
        parser.error("--tokens must be a multiple of 64")
    return args


def build_setup(args: argparse.Namespace, name: str, fa3: Any | None) -> Setup:
    if name == "gpu":
        setup = Setup(
            name="gpu", quick=args.quick, dtype="bf16", heads=16, head_dim=128,
            tokens=STANDARD_TOKENS, baseline="cudnn", fa3=fa3, full_scores=2**30,
            repeats=3 if args.quick else 5, iters=10 if args.quick else 20,
        )  # fmt: skip
    else:
        setup = Setup(
            name="cpu", quick=args.quick, dtype="fp32", heads=2, head_dim=64,
            tokens=16384 if args.quick else 32768, baseline="xla", fa3=None, full_scores=2**25,
            repeats=2 if args.quick else 3, iters=None,
        )  # fmt: skip
    changes: dict[str, Any] = {}
    if args.repeats is not None:
        changes["repeats"] = args.repeats
    if args.iters is not None:
        changes["iters"] = None if args.iters == "auto" else args.iters
    for field in ("tokens", "heads", "head_dim"):
        if getattr(args, field) is not None:
            changes[field] = getattr(args, field)
    return dataclasses.replace(setup, **changes)


def output_paths(args: argparse.Namespace, setup: Setup) -> dict[str, Path]:
    stem = args.name or f"masks_{setup.name}{'_quick' if setup.quick else ''}"
    return {suffix: args.out / f"{stem}{suffix}" for suffix in (".md", ".csv")}


def run(
    args: argparse.Namespace,
    setup: Setup,
    cells: Sequence[Cell],
    device: jax.Device,
    fa3_status: str,
) -> int:
    unit = Unit.for_grid("cpu" if device.platform == "cpu" else "gpu")
    env = environment(device)
    env["fa3"] = fa3_status
    problems = list(dict.fromkeys(c.problem for c in cells))
    method = method_lines(setup, problems)
    busy = busy_host() if device.platform == "cpu" else ""
    if busy:
        method.append(f"**Warning: {busy}.**")
    print(f"jax_flash masks benchmark on {env['device']}")
    for key, value in env.items():
        print(f"  {key}: {value}")
    for line in method:
        print(f"  {line}")
    print(f"{len(cells)} cells; one line per cell:", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = output_paths(args, setup)
    done: dict[tuple[Problem, bool], dict[str, Result]] = {}
    sink = CsvSink(paths[".csv"], env, csv_fields(unit), notes=method)
    interrupted = False
    try:
        with stop_signals(args.time_limit):
            run_cells(cells, setup, device, unit, done, sink)
    except KeyboardInterrupt as stop:
        print(f"interrupted ({stop_reason(stop)}): writing what was measured so far", flush=True)
        interrupted = True
    finally:
        sink.close()
    report = markdown_head("jax_flash masks benchmark", env, method, interrupted)
    report += section_tables(cells, done, unit, markdown=True)
    paths[".md"].write_text("\n".join(report) + "\n")
    print(f"\nwrote {paths['.md']}, {paths['.csv']}")
    print("\n".join(section_tables(cells, done, unit, markdown=False)))
    results = [r for measured in done.values() for r in measured.values()]
    failed = sum(1 for r in results if r.error)
    suspect = sum(1 for r in results if r.suspect)
    if failed:
        print(f"\n{failed} measurement(s) failed: see the 'error:' cells in {paths['.md']}")
    if suspect:
        print(f"{suspect} measurement(s) marked WRONG?: outputs disagree with the check's")
    if interrupted:
        print("run interrupted: the tables hold only the cells measured before")
    if setup.name != "gpu":
        print(f"\nOn the H200: {gpu_command()}")
    return 130 if interrupted else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    platform_name, device = resolve_device(args.platform, args.dry_run)
    name = args.grid or platform_name
    if args.dry_run:
        # Nothing is imported or run: FA3's columns are planned when its files are there.
        fa3, status = plan_fa3(args.fa3_dir)
    else:
        fa3, status = load_fa3(args.fa3_dir, device) if name == "gpu" else (None, "")
        status = status or "not measured on a CPU"
    setup = build_setup(args, name, fa3)
    problems = gpu_problems(setup) if name == "gpu" else cpu_problems(setup)
    cells = cells_of(problems, not args.no_backward, args.sections)
    if args.dry_run:
        print_plan(cells, setup, status, list(output_paths(args, setup).values()))
        return 0
    assert device is not None
    with jax.default_device(device):
        return run(args, setup, cells, device, status)


if __name__ == "__main__":
    sys.exit(main())
