"""How the kernel calls partition under ``jit``: batch and head axes shard with no collective.

XLA cannot see inside a custom call, so without a rule it gathers every operand onto every device
and computes the whole global batch everywhere. Each forward and backward kernel call is wrapped in
``custom_partitioning``: the Shardy sharding rule (and, for the GSPMD partitioner, the inference
callback) says that the batch axes and the head axes pass through, and the partition callback runs
the unmodified kernel on each device's block of batch elements and heads.

Grouped-query attention shards the key/value heads with the query heads: a device holding query
heads ``[j * Hq / n, (j + 1) * Hq / n)`` holds key/value heads ``[j * Hkv / n, (j + 1) * Hkv / n)``,
exactly the ones those query heads read, so no head is copied. This needs n to divide Hkv.

The kernels need whole sequences and whole head vectors, so a sequence, head_dim or packed-token
axis that arrives sharded is gathered explicitly (the partitioner inserts the all-gather), with a
one-time warning naming the mesh axis; the result keeps the requested sharding and is exact.
:func:`jax_flash.ring_attention` keeps the sequence sharded instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

# What each operand and result of a kernel call is, for the rule and the shardings. With L leading
# (batch) axes: q-like [L, S, Hq, D], kv-like [L, Sk, Hkv, D], lse-like [L, Hq, S], q_ids [L, S],
# kv_ids [L, Sk], sinks [L, Hq] (packed calls: [1, Hq]), cu_seqlens [N + 1].
_AUX_ROLES = {
    "q_segment_ids": "q_ids",
    "kv_segment_ids": "kv_ids",
    "sinks": "sinks",
    "cu_seqlens_q": "cu",
    "cu_seqlens_k": "cu",
}
_ROLES = {
    "forward": (("q", "kv", "kv"), ("q", "lse")),
    "backward": (("q", "kv", "kv", "q", "lse", "lse"), ("q", "kv", "kv")),
}

# Each message is given once per process: a training step is compiled more than once (forward,
# gradient, evaluation), and the warning is about the layout, not about one compilation.
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=2)


@dataclasses.dataclass(frozen=True)
class _Call:
    """The static description of one kernel call: which op, its options and its operands."""

    kind: str  # "forward" or "backward"
    spec: object  # _kernel.Spec, passed through to the local kernel call
    aux_fields: tuple[str, ...]  # the Aux fields given, in Aux order
    lead: int  # number of leading (batch) axes; 0 for packed calls
    heads_kv: int

    @property
    def packed(self) -> bool:
        return self.lead == 0

    @property
    def name(self) -> str:
        return "attention_varlen" if self.packed else "attention"

    def roles(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        operands, results = _ROLES[self.kind]
        aux = []
        for field in self.aux_fields:
            role = _AUX_ROLES[field]
            aux.append("sinks_packed" if role == "sinks" and self.packed else role)
        return (*operands, *aux), results


def _rule(call: _Call) -> str:
    """The Shardy rule: the leading axes and the heads pass through. The query heads (of q, lse,
    sinks) and the key/value heads are separate factors: a compound factor would let Shardy split
    one mesh axis into sub-axes across them, which no PartitionSpec can express. The partition
    callback shards the key/value heads with the query heads (_layout)."""
    lead = " ".join(f"b{i}" for i in range(call.lead))
    dims = {
        "q": f"{lead} s hq d",
        "kv": f"{lead} t h d",
        "lse": f"{lead} hq s",
        "q_ids": f"{lead} s",
        "kv_ids": f"{lead} t",
        "sinks": f"{lead} hq",
        "sinks_packed": "u hq",
        "cu": "n",
        # The decode call: cache lengths and block table per sequence, a page pool that no
        # batch axis divides.
        "lens": f"{lead}",
        "table": f"{lead} nb",
        "pages": "np bs h d",
    }
    operands, results = call.roles()
    rule = ", ".join(dims[r].strip() for r in operands) + " -> "
    return rule + ", ".join(dims[r].strip() for r in results)


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _describe(entry) -> str:
    names = _axes(entry)
    return repr(names[0]) if len(names) == 1 else repr(names)


def _layout(call: _Call, mesh, q_sharding, *, warn: bool):
    """(leading axes' specs, heads' spec) of the kernel's blocks, from q's sharding. What the
    kernel cannot split is replicated, with a warning when ``warn``."""
    name = call.name
    rank = call.lead + 3
    if isinstance(q_sharding, NamedSharding):
        spec = tuple(q_sharding.spec)
    else:
        # Without a mesh to read it against (no NamedSharding; e.g. inside a shard_map that
        # leaves some mesh axes automatic), q's sharding has no axis names: the call runs
        # replicated over them, and says so if q was in fact sharded.
        spec = ()
        if warn and not q_sharding.is_fully_replicated:
            _warn_once(
                f"jax_flash.{name}: q's sharding {q_sharding} names no mesh axes, so q, k and v "
                "are all-gathered; shard them with a NamedSharding, and inside shard_map make "
                "every mesh axis manual (e.g. in_specs P('data', 'sp'))"
            )
    spec = spec + (None,) * (rank - len(spec))
    lead, seq, heads, head_dim = spec[: call.lead], spec[call.lead], spec[-2], spec[-1]
    axis_kind = "packed-token" if call.packed else "sequence"
    if seq is not None and warn:
        _warn_once(
            f"jax_flash.{name}: q's {axis_kind} axis is sharded over mesh axis {_describe(seq)}; "
            "the kernel needs whole sequences, so q, k and v are all-gathered along it "
            "(inside shard_map, jax_flash.ring_attention keeps the sequence sharded)"
        )
    if head_dim is not None and warn:
        _warn_once(
            f"jax_flash.{name}: q's head_dim axis is sharded over mesh axis "
            f"{_describe(head_dim)}; the kernel needs whole head vectors, so q, k and v are "
            "all-gathered along it"
        )
    shards = math.prod(mesh.shape[a] for a in _axes(heads))
    if heads is not None and call.heads_kv % shards:
        if warn:
            _warn_once(
                f"jax_flash.{name}: the heads axis is sharded {shards} ways over mesh axis "
                f"{_describe(heads)}, which does not divide heads_kv={call.heads_kv}; the key "
                "and value heads of one device's query heads would not be whole, so the heads "
                "are all-gathered along it"
            )
        heads = None
    return lead, heads


def _role_spec(role: str, lead: tuple, heads) -> PartitionSpec:
    specs = {
        "q": (*lead, None, heads, None),
        "kv": (*lead, None, heads, None),
        "lse": (*lead, heads, None),
        "q_ids": (*lead, None),
        "kv_ids": (*lead, None),
        "sinks": (*lead, heads),
        "sinks_packed": (None, heads),
        "cu": (None,),
        "lens": (*lead,),
        "table": (*lead, None),
        "pages": (None, None, heads, None),
    }
    return PartitionSpec(*specs[role])


def _shardings(call: _Call, mesh, arg_shapes, *, warn: bool):
    lead, heads = _layout(call, mesh, arg_shapes[0].sharding, warn=warn)
    operands, results = call.roles()

    def named(roles):
        return tuple(NamedSharding(mesh, _role_spec(r, lead, heads)) for r in roles)

    return named(operands), named(results)


# The kernel calls by kind, as _kernel.py and kvcache.py register them: "forward" and "backward"
# take (*arrays, aux, spec), "decode" (q, k, v, cache_seqlens, block_table, sinks, spec,
# num_splits).
_LOCAL: dict[str, Callable] = {}


def _local_call(call: _Call, aux_type, *operands):
    """The kernel call on whatever block of the arrays this device holds."""
    fixed = len(_ROLES[call.kind][0])
    arrays, aux_values = operands[:fixed], operands[fixed:]
    aux = aux_type(**dict(zip(call.aux_fields, aux_values, strict=True)))
    return _LOCAL[call.kind](*arrays, aux, call.spec)


def _partitioned_op(
    call, local: Callable, one_call_per_element: bool, with_lead: Callable[[int], Callable]
) -> Callable:
    """``local`` (a kernel call on whatever block of its operands a device holds) as a
    custom_partitioning op with the rule and shardings of ``call``, and a vmap rule (the
    partitioning primitive has none): an added leading axis is one more batch axis
    (``with_lead(lead)`` builds the op for that many), or, where the call has no batch axis to
    fold it into (``one_call_per_element``), one call per element."""

    def partition(mesh, arg_shapes, result_shape):
        arg_shardings, result_shardings = _shardings(call, mesh, arg_shapes, warn=True)
        return mesh, local, result_shardings, arg_shardings

    def infer(mesh, arg_shapes, result_shape):
        return _shardings(call, mesh, arg_shapes, warn=False)[1]

    partitioned = custom_partitioning(local)
    try:
        partitioned.def_partition(
            partition, infer_sharding_from_operands=infer, sharding_rule=_rule(call)
        )
    except TypeError:
        # A JAX without the GSPMD partitioner may no longer take its inference callback.
        partitioned.def_partition(partition, sharding_rule=_rule(call))

    @jax.custom_batching.custom_vmap
    def op(*operands):
        return tuple(partitioned(*operands))

    @op.def_vmap
    def rule_vmap(axis_size, in_batched, *operands):
        if one_call_per_element:

            def one(mapped):
                it = iter(mapped)
                pairs = zip(operands, in_batched, strict=True)
                return op(*(next(it) if b else x for x, b in pairs))

            mapped = tuple(x for x, b in zip(operands, in_batched, strict=True) if b)
            outs = jax.lax.map(one, mapped)
        else:
            # The kernels fold every leading axis into the batch: broadcast the unbatched
            # operands and call the op with one more leading axis.
            full = tuple(
                x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
                for x, b in zip(operands, in_batched, strict=True)
            )
            outs = with_lead(call.lead + 1)(*full)
        return outs, tuple(True for _ in outs)

    return op


@functools.cache
def _op(call: _Call, aux_type) -> Callable:
    """The partitioned kernel call for one static description. A packed call has no batch axis:
    a vmapped one runs per element."""
    return _partitioned_op(
        call,
        functools.partial(_local_call, call, aux_type),
        call.packed,
        lambda lead: _op(dataclasses.replace(call, lead=lead), aux_type),
    )


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.10: the manual axis type
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def vary_like(outs: tuple, ins) -> tuple:
    """outs typed as varying over every manual mesh axis that any of ins varies over. Inside
    shard_map each value carries the axes it varies over; XLA's custom calls return untyped
    results, which a custom VJP then rejects as cotangents of sharded inputs."""
    axes = frozenset().union(*(_varying_axes(x) for x in jax.tree.leaves(ins)))
    if not axes:
        return outs

    def cast(x):
        missing = axes - _varying_axes(x)
        return jax.lax.pcast(x, tuple(sorted(missing, key=str)), to="varying") if missing else x

    return tuple(cast(x) for x in outs)


def partitioned(kind: str, local: Callable) -> Callable:
    """``local(*arrays, aux, spec)`` (the per-platform kernel call of ``kind``, "forward" or
    "backward") as a call that partitions over batch and heads under jit."""
    _LOCAL[kind] = local

    def call(*args):
        *arrays, aux, spec = args
        q, k = arrays[0], arrays[1]
        fields = tuple(f for f in aux._fields if getattr(aux, f) is not None)
        desc = _Call(
            kind=kind,
            spec=spec,
            aux_fields=fields,
            lead=q.ndim - 3,
            heads_kv=k.shape[-2],
        )
        operands = (*arrays, *(getattr(aux, f) for f in fields))
        return vary_like(_op(desc, type(aux))(*operands), operands)

    return call


# ----------------------------------------------------------------------------------------------
# The decode call (attention_with_kvcache): the same batch and head partitioning. A paged cache's
# page pool is shared by the whole batch, so it is split over the heads only (each device of a
# batch shard holds the whole pool of its heads); a contiguous cache is split like k.


@dataclasses.dataclass(frozen=True)
class _DecodeCall:
    spec: object  # _kernel.Spec
    num_splits: int | None  # None: chosen from each device's block of the call
    lead: int
    heads_kv: int
    paged: bool
    has_sinks: bool

    packed = False
    name = "attention_with_kvcache"

    def roles(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        cache = "pages" if self.paged else "kv"
        operands = ("q", cache, cache, "lens")
        operands += ("table",) if self.paged else ()
        operands += ("sinks",) if self.has_sinks else ()
        return operands, ("q", "lse")


def _decode_local_call(call: _DecodeCall, *operands):
    q, k, v, lens, *rest = operands
    table = rest.pop(0) if call.paged else None
    sinks = rest.pop(0) if call.has_sinks else None
    return _LOCAL["decode"](q, k, v, lens, table, sinks, call.spec, call.num_splits)


@functools.cache
def _decode_op(call: _DecodeCall) -> Callable:
    """The partitioned decode call for one static description. The page pool has no batch axis
    to fold a new one into: a vmapped paged call runs per element."""
    return _partitioned_op(
        call,
        functools.partial(_decode_local_call, call),
        call.paged,
        lambda lead: _decode_op(dataclasses.replace(call, lead=lead)),
    )


def partitioned_decode(local: Callable) -> Callable:
    """``local(q, k, v, cache_seqlens, block_table, sinks, spec, num_splits)`` (the per-platform
    decode call; block_table and sinks may be None) as a call that partitions over batch and
    heads under jit."""
    _LOCAL["decode"] = local

    def call(q, k, v, cache_seqlens, block_table, sinks, spec, num_splits):
        desc = _DecodeCall(
            spec=spec,
            num_splits=num_splits,
            lead=q.ndim - 3,
            heads_kv=k.shape[-2],
            paged=block_table is not None,
            has_sinks=sinks is not None,
        )
        operands = (q, k, v, cache_seqlens)
        operands += (block_table,) if block_table is not None else ()
        operands += (sinks,) if sinks is not None else ()
        return vary_like(_decode_op(desc)(*operands), operands)

    return call
