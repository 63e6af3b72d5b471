"""The decode kernel call (cpp/ffi/decode_shapes.h): a few query rows per sequence against a
key/value cache, split over the keys. Shared by :func:`jax_flash.attention_with_kvcache` and by
the forward of :func:`jax_flash.attention`, which uses it for short query blocks
(:func:`decode_applies`)."""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _ffi
from jax_flash._dtypes import is_half, pad_head_dim, stats_dtype

# attention() sends a forward to the decode kernel when every query block is this short ...
DECODE_MAX_SEQLEN_Q = 16
# ... and the keys are this many or more: below it the dense kernel's one pass is as fast.
DECODE_MIN_SEQLEN_K = 256

# The host's split choice (choose_num_splits).
MAX_SPLITS = 64
# The fewest keys a split gets: half precision 512 (eight 64-key tiles; on the H200 one sequence of
# 8k keys ran 7% faster as 16 splits than as 32), float32/float64 128.
CUDA_KEYS_PER_SPLIT = 512
CUDA_EXACT_KEYS_PER_SPLIT = 128
CPU_KEYS_PER_SPLIT = 512
DEFAULT_SM_COUNT = 132  # an H100/H200, when no GPU can be asked


def decode_applies(seqlen_q: int, seqlen_k: int, *, varlen: bool, segments: bool) -> bool:
    """The one rule for when :func:`jax_flash.attention`'s forward runs on the decode kernel: a
    dense batch (not packed), no segment ids, 1 <= seqlen_q <= 16 and seqlen_k >= 256. The result
    (out and lse) is the dense forward's, so the backward is unchanged."""
    return (
        not varlen
        and not segments
        and 1 <= seqlen_q <= DECODE_MAX_SEQLEN_Q
        and seqlen_k >= DECODE_MIN_SEQLEN_K
    )


def choose_num_splits(
    batch: int,
    heads_kv: int,
    max_keys: int,
    *,
    platform: str,
    workers: int,
    rows: int = 1,
    head_dim: int = 128,
    half: bool = True,
) -> int:
    """How many pieces the keys of each (sequence, kv head) are cut into: enough independent
    pieces of work to fill the device in one wave, none too short to pay for its merge. Between 1
    and 64.

    rows is heads_q / heads_kv * seqlen_q, the query rows of one (sequence, kv head).
    platform "cuda" (workers: the SM count), as the CUDA decode kernel is laid out: half-precision
    inputs run one block of up to 16 rows, or of 32 (16 from head_dim 129 up), per (sequence, kv
    head) and split, two resident blocks per SM (one from head_dim 129 up), so
    ``splits = floor(slots / (batch * heads_kv * row_blocks))``, at most ``ceil(max_keys / 512)``
    (floor: one more split would start a second wave); float32/float64 run one warp per row,
    ``splits = ceil(32 * workers / (batch * heads_kv * rows))``, at most ``ceil(max_keys / 128)``.
    platform "cpu" (workers: the thread count): ``batch * heads_kv * splits >= 2 * workers``
    with at least 512 keys per piece."""
    tasks = max(1, batch * heads_kv)
    if platform == "cuda":
        if half:
            wide = head_dim > 128
            row_blocks = 1 if rows <= 16 else math.ceil(rows / (16 if wide else 32))
            slots = workers * (1 if wide else 2)
            splits = min(slots // (tasks * row_blocks), math.ceil(max_keys / CUDA_KEYS_PER_SPLIT))
        else:
            splits = min(
                math.ceil(32 * workers / (tasks * max(1, rows))),
                math.ceil(max_keys / CUDA_EXACT_KEYS_PER_SPLIT),
            )
    elif platform == "cpu":
        splits = min(math.ceil(2 * workers / tasks), max_keys // CPU_KEYS_PER_SPLIT)
    else:
        raise ValueError(f"choose_num_splits: platform must be 'cpu' or 'cuda', got {platform!r}")
    return max(1, min(int(splits), MAX_SPLITS))


@functools.cache
def cuda_sm_count() -> int:
    """SMs of the first CUDA device JAX sees; DEFAULT_SM_COUNT when it cannot say (no GPU)."""
    try:
        count = getattr(jax.devices("cuda")[0], "core_count", None)
    except RuntimeError:
        count = None
    return int(count) if count else DEFAULT_SM_COUNT


def cpu_threads() -> int:
    # XLA's CPU thread pool has one thread per core the process may use.
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without sched_getaffinity
        return os.cpu_count() or 1


def _call(target, q, k, v, cache_seqlens, block_table, sinks, spec, num_splits):
    """out [..., Sq, Hq, D] and lse [..., Hq, Sq] of one decode kernel call. spec is a
    _kernel.Spec (softmax_scale, window, band, softcap); block_table None for a contiguous cache,
    sinks None or [..., Hq] in the stats dtype."""
    stats = stats_dtype(q.dtype)
    lead, (seqlen_q, heads_q, head_dim) = q.shape[:-3], q.shape[-3:]
    paged = block_table is not None
    if num_splits > 1:
        partial_o = (*lead, num_splits, heads_q, seqlen_q, head_dim)
        partial_lse = (*lead, num_splits, heads_q, seqlen_q)
    else:
        partial_o = partial_lse = (1,)
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((*lead, heads_q, seqlen_q), stats),
        # Workspace of the split pass, owned by XLA so that the handler never allocates.
        jax.ShapeDtypeStruct(partial_o, stats),
        jax.ShapeDtypeStruct(partial_lse, stats),
    )
    # A contiguous call folds every leading axis into its batch, so vmap is one launch. Pages are
    # shared by the whole batch: a vmapped paged call runs once per element.
    call = jax.ffi.ffi_call(
        target, out_types, vmap_method="sequential" if paged else "broadcast_all"
    )
    out, lse, _, _ = call(
        q,
        k,
        v,
        cache_seqlens,
        jnp.zeros((1,), jnp.int32) if block_table is None else block_table,
        jnp.zeros((1,), stats) if sinks is None else sinks,
        **spec.score_attrs(),
        has_sinks=np.bool_(sinks is not None),
        paged=np.bool_(paged),
        num_splits=int(num_splits),
    )
    return out, lse


def _max_keys(k, block_table) -> int:
    if block_table is None:
        return k.shape[-3]
    return block_table.shape[-1] * k.shape[-3]


def _batch(q) -> int:
    return math.prod(q.shape[:-3])


def _splits(q, k, block_table, platform: str, workers: int) -> int:
    return choose_num_splits(
        _batch(q), k.shape[-2], _max_keys(k, block_table), platform=platform, workers=workers,
        rows=q.shape[-2] // k.shape[-2] * q.shape[-3], head_dim=q.shape[-1],
        half=is_half(q.dtype),
    )  # fmt: skip


def decode_cpu(q, k, v, cache_seqlens, block_table, sinks, *, spec, num_splits=None):
    if num_splits is None:
        num_splits = _splits(q, k, block_table, "cpu", cpu_threads())
    return _call(_ffi.DECODE_CPU, q, k, v, cache_seqlens, block_table, sinks, spec, num_splits)


def decode_cuda(q, k, v, cache_seqlens, block_table, sinks, *, spec, num_splits=None):
    head_dim = q.shape[-1]
    if num_splits is None:
        num_splits = _splits(q, k, block_table, "cuda", cuda_sm_count())
    # The CUDA decode kernel takes half-precision head dims in multiples of 8.
    if is_half(q.dtype):
        q, k, v = (pad_head_dim(x, head_dim + -head_dim % 8) for x in (q, k, v))
    out, lse = _call(_ffi.DECODE_CUDA, q, k, v, cache_seqlens, block_table, sinks, spec, num_splits)
    return out[..., :head_dim], lse


def decode_local(q, k, v, cache_seqlens, block_table, sinks, spec, num_splits=None):
    """(out, lse) of the decode kernel of whichever platform the computation is lowered for."""
    return jax.lax.platform_dependent(
        q,
        k,
        v,
        cache_seqlens,
        block_table,
        sinks,
        cpu=functools.partial(decode_cpu, spec=spec, num_splits=num_splits),
        cuda=functools.partial(decode_cuda, spec=spec, num_splits=num_splits),
    )
