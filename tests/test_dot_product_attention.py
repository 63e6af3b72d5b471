"""jax_flash.dot_product_attention against jax.nn.dot_product_attention(implementation="xla"):
random configurations of both ranks, GQA, top-left causal with Sq != Sk, sequence lengths and
windows, including rows that see no key; gradients; the refused arguments; forward mode.

jax.nn computes its softmax in float32 even for float64 inputs, so in float64 it is a float32
quality reference: jax_flash is compared with it at float32 tolerances, and with the float64
reference (top-left diagonal) at 1e-10 where every row sees a key.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOL_F64, dtype_id, normal, rel_l2

import jax_flash
from jax_flash.reference import attention_reference

TOL = {"fwd": 2e-5, "grad": 1e-4}


def _config(seed):
    """A random configuration: rank, shapes, GQA group, causal, lengths, window."""
    r = np.random.default_rng(seed)
    rank = int(r.choice([3, 4]))
    batch = 1 if rank == 3 else int(r.integers(1, 3))
    heads_kv = int(r.choice([1, 2]))
    cfg = {
        "rank": rank,
        "batch": batch,
        "seqlen_q": int(r.integers(1, 24)),
        "seqlen_k": int(r.integers(1, 24)),
        "heads_q": heads_kv * int(r.choice([1, 2, 3])),
        "heads_kv": heads_kv,
        "head_dim": int(r.choice([4, 8, 16])),
        "kw": {"is_causal": bool(r.integers(2))},
    }
    if r.integers(2):
        # Lengths of 0 included: rows without a single visible key.
        cfg["kw"]["query_seq_lengths"] = r.integers(0, cfg["seqlen_q"] + 1, batch)
    if r.integers(2):
        cfg["kw"]["key_value_seq_lengths"] = r.integers(0, cfg["seqlen_k"] + 1, batch)
    if r.integers(2):
        w = (int(r.integers(0, 6)), int(r.integers(0, 6)))
        cfg["kw"]["local_window_size"] = w if r.integers(2) else w[0]
    if r.integers(2):
        cfg["kw"]["scale"] = float(r.uniform(0.1, 1.0))
    return cfg


# Eight seeds cover both ranks, GQA/MQA, causal with Sq < Sk and Sq > Sk, both kinds of lengths,
# symmetric and asymmetric windows; float64 repeats half of them.
CASES = [(seed, jnp.float32) for seed in range(8)] + [
    (seed, jnp.float64) for seed in range(0, 8, 2)
]


def _inputs(rng, cfg, dtype):
    lead = (cfg["batch"],) if cfg["rank"] == 4 else ()
    q = normal(rng, (*lead, cfg["seqlen_q"], cfg["heads_q"], cfg["head_dim"]), dtype)
    k = normal(rng, (*lead, cfg["seqlen_k"], cfg["heads_kv"], cfg["head_dim"]), dtype)
    v = normal(rng, (*lead, cfg["seqlen_k"], cfg["heads_kv"], cfg["head_dim"]), dtype)
    dout = normal(rng, q.shape, dtype)
    kw = dict(cfg["kw"])
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kw:
            kw[name] = jnp.asarray(kw[name], jnp.int32)
    return q, k, v, dout, kw


def _both(q, k, v, dout, kw):
    """(out, residual, dq, dk, dv) of jax_flash and of jax.nn's xla implementation."""
    results = []
    for fn in (jax_flash.dot_product_attention, jax.nn.dot_product_attention):
        extra = {} if fn is jax_flash.dot_product_attention else {"implementation": "xla"}

        def run(q, k, v, fn=fn, extra=extra):
            out, res = fn(q, k, v, return_residual=True, **kw, **extra)
            return out, res

        (out, res), pullback = jax.vjp(jax.jit(run), q, k, v)
        grads = pullback((dout, jnp.zeros_like(res)))
        results.append((out, res, *grads))
    return results


@pytest.mark.parametrize(
    ("seed", "dtype"), CASES, ids=lambda x: dtype_id(x) if not isinstance(x, int) else str(x)
)
def test_matches_jax_nn(rng, seed, dtype):
    cfg = _config(seed)
    q, k, v, dout, kw = _inputs(rng, cfg, dtype)
    ours, theirs = _both(q, k, v, dout, kw)
    names = ("out", "residual", "dq", "dk", "dv")
    for name, a, b in zip(names, ours, theirs, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype)
        if name == "residual":
            # Rows without keys carry jax.nn's masked-logit constant, exactly.
            np.testing.assert_array_equal(a <= -1e37, b <= -1e37)
            a, b = (jnp.where(b <= -1e37, 0, x) for x in (a, b))
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
            continue
        kind = "fwd" if name == "out" else "grad"
        assert rel_l2(a, b, floor=0.1) <= TOL[kind], (name, cfg, rel_l2(a, b, floor=0.1))


def test_rows_without_keys_follow_jax_nn(rng):
    # Batch 0: query 3 onwards is padding (output 0). Batch 1: no key at all, so every row is
    # the mean of the values, as jax.nn's uniform softmax gives; its gradient reaches v.
    q = normal(rng, (2, 5, 4, 8), jnp.float32)
    k = normal(rng, (2, 6, 2, 8), jnp.float32)
    v = normal(rng, (2, 6, 2, 8), jnp.float32)
    kw = {
        "query_seq_lengths": jnp.array([3, 5], jnp.int32),
        "key_value_seq_lengths": jnp.array([6, 0], jnp.int32),
    }
    # One jitted call for the output and the gradient: eager calls compile op by op.
    out, pullback = jax.vjp(jax.jit(lambda v: jax_flash.dot_product_attention(q, k, v, **kw)), v)
    np.testing.assert_array_equal(out[0, 3:], 0)
    mean = jnp.repeat(v[1].mean(axis=0), 2, axis=0)
    np.testing.assert_allclose(out[1], jnp.broadcast_to(mean, out[1].shape), rtol=1e-6)
    (dv,) = pullback(jnp.zeros_like(out).at[1].set(1))
    np.testing.assert_allclose(dv[1], jnp.full_like(dv[1], 5 * 2 / 6), rtol=1e-6)
    # A window that leaves query rows past the keys with nothing: the same mean.
    q_long = normal(rng, (1, 9, 2, 8), jnp.float32)
    out = jax.jit(jax_flash.dot_product_attention, static_argnames="local_window_size")(
        q_long, k[:1], v[:1], local_window_size=(0, 0)
    )
    ref = jax.nn.dot_product_attention(
        q_long, k[:1], v[:1], local_window_size=(0, 0), implementation="xla"
    )
    np.testing.assert_allclose(out[0, 6:], ref[0, 6:], rtol=1e-6)
    assert float(jnp.abs(out[0, 6:]).max()) > 0


@pytest.mark.parametrize("causal", [False, True])
def test_float64_matches_the_float64_reference(rng, causal):
    # Sq != Sk: top-left alignment is diagonal offset 0, jax.nn's, not attention()'s default.
    q = normal(rng, (2, 9, 4, 16), jnp.float64)
    k = normal(rng, (2, 13, 2, 16), jnp.float64)
    v = normal(rng, (2, 13, 2, 16), jnp.float64)
    out = jax_flash.dot_product_attention(q, k, v, is_causal=causal, local_window_size=(3, 2))
    ref = attention_reference(q, k, v, causal=causal, window=(3, 2), diagonal_offset=0)
    assert rel_l2(out, ref) <= TOL_F64
    bottom_right = jax_flash.attention(q, k, v, causal=causal, window=(3, 2))
    assert rel_l2(bottom_right, ref) > 1e-3, "top-left and bottom-right must differ here"


def test_signature_covers_jax_nn():
    ours = inspect.signature(jax_flash.dot_product_attention).parameters
    theirs = inspect.signature(jax.nn.dot_product_attention).parameters
    # jax.nn's parameters in jax.nn's order, then jax_flash's own keyword-only options, whose
    # defaults keep jax.nn's behaviour.
    assert list(ours)[: len(theirs)] == list(theirs)
    extras = {name: p for name, p in ours.items() if name not in theirs}
    assert set(extras) == {"deterministic"}
    assert all(p.kind == p.KEYWORD_ONLY and p.default is False for p in extras.values())
    for name, p in theirs.items():
        assert ours[name].kind == p.kind, name
        if name != "implementation":
            assert ours[name].default == p.default, name


def test_jit_vmap_grad(rng):
    q = normal(rng, (3, 2, 7, 2, 8), jnp.float32)
    kv = normal(rng, (3, 2, 7, 1, 8), jnp.float32)

    def f(q, kv):
        return jax_flash.dot_product_attention(q, kv, kv, is_causal=True).sum()

    def g(q, kv):
        return jax.nn.dot_product_attention(q, kv, kv, is_causal=True, implementation="xla").sum()

    ours = jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1))))(q, kv)
    theirs = jax.vmap(jax.grad(g, argnums=(0, 1)))(q, kv)
    for a, b in zip(ours, theirs, strict=True):
        assert rel_l2(a, b) <= TOL["grad"]
    jac = jax.jit(jax.jacrev(lambda q: jax_flash.dot_product_attention(q, kv[0], kv[0])))(q[0])
    assert jac.shape == q[0].shape * 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bias": jnp.zeros((1, 1, 4, 4))}, "bias has no fused kernel.*is_causal"),
        ({"mask": jnp.ones((1, 1, 4, 4), bool)}, "mask has no fused kernel.*local_window_size"),
        ({"implementation": "xla"}, "implementation must be None or 'jax_flash'"),
        ({"implementation": "cudnn"}, "implementation must be None or 'jax_flash'"),
        ({"scale": -1.0}, "scale must be a static finite number > 0"),
        ({"local_window_size": (2, -1)}, "local_window_size must be"),
        ({"local_window_size": (1, 2, 3)}, "local_window_size must be"),
        ({"query_seq_lengths": jnp.array([4], jnp.int64)}, "query_seq_lengths must be an int32"),
        ({"key_value_seq_lengths": jnp.array([4, 4], jnp.int32)}, "key_value_seq_lengths must"),
    ],
)
def test_refused_arguments(kwargs, match):
    x = jnp.zeros((1, 4, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=match):
        jax_flash.dot_product_attention(x, x, x, **kwargs)


def test_implementation_name_is_accepted(rng):
    x = normal(rng, (4, 2, 8), jnp.float32)
    a = jax_flash.dot_product_attention(x, x, x, implementation="jax_flash")
    b = jax_flash.dot_product_attention(x, x, x)
    np.testing.assert_array_equal(a, b)


def _sum_attention(x):
    return jax_flash.dot_product_attention(x, x, x).sum()


FORWARD_MODE = {
    "jvp": lambda f, x: jax.jvp(f, (x,), (x,)),
    "jit_of_jvp": lambda f, x: jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x),
    "jacfwd": lambda f, x: jax.jacfwd(f)(x),
    "grad_of_grad": lambda f, x: jax.grad(lambda x: jax.grad(f)(x).sum())(x),
    "hessian": lambda f, x: jax.hessian(f)(x),
}


@pytest.mark.parametrize("transform", list(FORWARD_MODE))
def test_forward_mode_names_what_works(rng, transform):
    x = normal(rng, (1, 4, 2, 8), jnp.float32)
    with pytest.raises(jax_flash.ForwardModeError, match="jax.grad, .*jax.vjp, jax.jacrev"):
        FORWARD_MODE[transform](_sum_attention, x)


def test_reverse_mode_still_works(rng):
    from jax.test_util import check_grads

    x = normal(rng, (1, 4, 2, 8), jnp.float64)
    check_grads(_sum_attention, (x,), order=1, modes=("rev",))
    assert jax.jit(jax.grad(_sum_attention))(x).shape == x.shape
