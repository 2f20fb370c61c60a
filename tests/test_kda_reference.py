"""Tests for the pure-JAX KDA reference (pallas_kernels/kda/reference.py): the delta rule with per-channel decay."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda.reference import chunk_kda, kda_gate, l2norm, recurrent_kda

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "kda_golden.npz"


def _rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_inputs(B, T, H, K, V, seed=0, dtype=jnp.float32):
    """Random unit-norm q/k, gate from kda_gate, sigmoid beta, initial state (numpy RNG: no compiles)."""
    rng = np.random.default_rng(seed)
    n = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q, k, v, f = l2norm(n(B, T, H, K)), l2norm(n(B, T, H, K)), n(B, T, H, V), 2.0 * n(B, T, H, K)
    g = kda_gate(f, n(H), n(H * K))
    beta = jax.nn.sigmoid(n(B, T, H))
    s0 = 0.5 * n(B, H, K, V)
    return tuple(x.astype(dtype) for x in (q, k, v)) + (g, beta.astype(dtype), s0)


def numpy_recurrent(q, k, v, g, beta, initial_state=None, segment_ids=None):
    """Independent float64 numpy loop of the KDA recurrence (scale K^-1/2):
    ``S_t = (I - beta k k^T) diag(exp g) S_{t-1} + beta k v^T``."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    S = np.zeros((B, H, K, v.shape[-1])) if initial_state is None else np.array(initial_state, np.float64)
    o = np.zeros(v.shape)
    for t in range(T):
        if segment_ids is not None and t > 0:
            S = np.where(
                (np.asarray(segment_ids)[:, t] != np.asarray(segment_ids)[:, t - 1])[:, None, None, None], 0.0, S
            )
        S = S * np.exp(g[:, t])[..., None]
        err = v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + np.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], err)
        o[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t] * K**-0.5, S)
    return o, S


B_, H_, K_, V_ = 2, 2, 16, 8  # shared shape so that jit caches are reused across tests


@pytest.mark.parametrize("T", [1, 15, 64, 200])
def test_chunk_matches_recurrent(T):
    q, k, v, g, beta, s0 = make_inputs(B_, T, H_, K_, V_, seed=T)
    o1, s1 = recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o2, s2 = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert o2.shape == (B_, T, H_, V_) and o2.dtype == jnp.float32
    assert s2.shape == (B_, H_, K_, V_) and s2.dtype == jnp.float32
    assert _rel(o2, o1) <= 1e-5
    assert _rel(s2, s1) <= 1e-5
    on, sn = numpy_recurrent(q, k, v, g, beta, initial_state=s0)  # independent float64 loop
    assert _rel(o1, on) <= 1e-5 and _rel(s1, sn) <= 1e-5


def test_chunk_sizes_scale_and_no_final_state():
    """Chunk / sub-chunk sizes 16 / 16 and 32 / 8 equal the float64 loop, no final state unless asked; an explicit
    ``scale`` (twice the default, on the 32 / 8 call: q is scaled before any chunking, so one compile covers both
    properties) doubles the output."""
    q, k, v, g, beta, s0 = make_inputs(B_, 64, H_, K_, V_, seed=3)
    ref, _ = numpy_recurrent(q, k, v, g, beta, initial_state=s0)
    for cs, sub, mult in [(16, 16, 1), (32, 8, 2)]:
        scale = None if mult == 1 else mult * K_**-0.5
        o, s = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=s0, chunk_size=cs, sub_chunk_size=sub)
        assert s is None
        assert _rel(o, mult * ref) <= 1e-5, (cs, sub, scale)


@pytest.mark.parametrize("fn", [recurrent_kda, chunk_kda])
def test_state_carry_across_calls(fn):
    """215 tokens at once equal 15 (one padded chunk, so the state leaves a partial chunk) then 200 (four chunks,
    from the carried state); the two pieces have the shapes of test_chunk_matches_recurrent[15] / [200], so they
    reuse those compiles."""
    q, k, v, g, beta, s0 = make_inputs(B_, 215, H_, K_, V_, seed=5)
    full, s_full = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    c = 15
    a, s_a = fn(q[:, :c], k[:, :c], v[:, :c], g[:, :c], beta[:, :c], initial_state=s0, output_final_state=True)
    b, s_b = fn(q[:, c:], k[:, c:], v[:, c:], g[:, c:], beta[:, c:], initial_state=s_a, output_final_state=True)
    assert _rel(jnp.concatenate([a, b], axis=1), full) <= 1e-5
    assert _rel(s_b, s_full) <= 1e-5


@pytest.mark.parametrize("fn", [recurrent_kda, chunk_kda])
def test_packed_segments_equal_separate_documents(fn):
    # Row 0: documents of 10, 54, 1, 71, 64 tokens: boundaries inside a chunk, exactly at a chunk edge (64),
    # a single-token document. Row 1: random ids (resets almost every token, some long runs).
    T = 200
    lengths = [10, 54, 1, 71, 64]
    q, k, v, g, beta, s0 = make_inputs(B_, T, H_, K_, V_, seed=6)
    seg = np.zeros((B_, T), np.int32)
    seg[0] = np.repeat(np.arange(len(lengths)) + 7, lengths)
    seg[1] = np.random.default_rng(0).integers(0, 3, size=T)
    o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True, segment_ids=jnp.asarray(seg))
    on, sn = numpy_recurrent(q, k, v, g, beta, initial_state=s0, segment_ids=seg)
    assert _rel(o, on) <= 1e-5 and _rel(s, sn) <= 1e-5
    # row 0 document by document (initial_state only reaches the first one)
    start = 0
    for d, n in enumerate(lengths):
        sl = slice(start, start + n)
        init = s0[:1] if d == 0 else None
        od, sd = numpy_recurrent(q[:1, sl], k[:1, sl], v[:1, sl], g[:1, sl], beta[:1, sl], initial_state=init)
        assert _rel(o[:1, sl], od) <= 1e-5, d
        start += n
    assert _rel(s[:1], sd) <= 1e-5


def test_gate_strictly_inside_bounds_for_extreme_inputs():
    H, K = 3, 4
    vals = jnp.array([-jnp.inf, -1e30, -1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4, 1e30, jnp.inf])
    f = jnp.broadcast_to(vals[None, :, None, None], (1, vals.size, H, K))
    A_log = jnp.array([-3.0, 0.0, 3.0])
    dt_bias = jnp.linspace(-2, 2, H * K)
    for lb in (-5.0, -1.0):
        g = kda_gate(f, A_log, dt_bias, lower_bound=lb)
        assert g.dtype == jnp.float32 and g.shape == f.shape
        assert bool(jnp.all(jnp.isfinite(g)))
        assert bool(jnp.all(g > lb)) and bool(jnp.all(g < 0))
        assert bool(jnp.all(jnp.exp(g) <= 1.0))
    # bf16 f and [H, K] dt_bias are accepted; unsaturated values equal the formula.
    f2 = jax.random.normal(jax.random.PRNGKey(0), (2, 5, H, K))
    g2 = kda_gate(f2.astype(jnp.bfloat16), A_log, dt_bias.reshape(H, K))
    expect = -5.0 * jax.nn.sigmoid(
        jnp.exp(A_log)[:, None] * (f2.astype(jnp.bfloat16).astype(jnp.float32) + dt_bias.reshape(H, K))
    )
    np.testing.assert_allclose(g2, expect, rtol=1e-6)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(f2, jnp.zeros((H + 1,)), dt_bias)


def test_gate_gradient_finite():
    f = jnp.array([-1e4, -10.0, 0.0, 10.0, 1e4]).reshape(1, 5, 1, 1)
    dg = jax.grad(lambda x: kda_gate(x, jnp.zeros((1,))).sum())(f)
    assert bool(jnp.all(jnp.isfinite(dg)))


@pytest.mark.parametrize("fn", [recurrent_kda, chunk_kda])
def test_long_minimum_decay_is_finite(fn):
    B, T, H, K = 1, 1024, 2, 16
    q, k, v, _, beta, s0 = make_inputs(B, T, H, K, K, seed=8)
    g = kda_gate(jnp.full((B, T, H, K), 1e4), jnp.zeros((H,)))  # saturated: g ~ -5 everywhere
    o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(s)))
    # and the no-decay extreme (g ~ -1e-38) too
    g0 = kda_gate(jnp.full((B, T, H, K), -1e4), jnp.zeros((H,)))
    o0, s0_ = fn(q, k, v, g0, beta, initial_state=s0, output_final_state=True)
    assert bool(jnp.all(jnp.isfinite(o0))) and bool(jnp.all(jnp.isfinite(s0_)))


def test_chunk_matches_recurrent_at_minimum_decay():
    q, k, v, _, beta, s0 = make_inputs(B_, 200, H_, K_, V_, seed=9)
    g = jnp.full(q.shape, -5.0) + 1e-3 * jnp.asarray(np.random.default_rng(1).uniform(size=q.shape), jnp.float32)
    o1, s1 = recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o2, s2 = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert _rel(o2, o1) <= 1e-5 and _rel(s2, s1) <= 1e-5


def test_chunk_matches_recurrent_adversarial_keys():
    """Identical keys, no decay, beta = 1: (I + A)^-1 of a dense lower-triangular matrix of ones (a Neumann
    series would cancel catastrophically here; the blocked inverse must not)."""
    q, k, v, _, _, s0 = make_inputs(B_, 200, H_, K_, V_, seed=12)
    k = jnp.broadcast_to(k[:, :1], k.shape)
    g = jnp.full(q.shape, -1e-30, jnp.float32)
    beta = jnp.ones((B_, 200, H_), jnp.float32)
    o1, s1 = recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o2, s2 = chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert _rel(o2, o1) <= 1e-5 and _rel(s2, s1) <= 1e-5


def test_bf16_inputs():
    """bf16 q/k/v/beta (fp32 g, state): both forms within 2e-2 of the fp32 result, 1e-2 of each other."""
    q, k, v, g, beta, s0 = make_inputs(B_, 200, H_, K_, V_, seed=10)
    ref, _ = numpy_recurrent(q, k, v, g, beta, initial_state=s0)
    qb, kb, vb, bb = (x.astype(jnp.bfloat16) for x in (q, k, v, beta))
    outs = []
    for fn in (recurrent_kda, chunk_kda):
        o, s = fn(qb, kb, vb, g, bb, initial_state=s0, output_final_state=True)
        assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
        assert _rel(o.astype(jnp.float32), ref) <= 2e-2, fn.__name__
        outs.append(o.astype(jnp.float32))
    assert _rel(outs[1], outs[0]) <= 1e-2


def test_gradients_chunk_vs_recurrent():
    q, k, v, g, beta, s0 = make_inputs(1, 40, 2, 8, 8, seed=11)
    seg = jnp.asarray(np.repeat([0, 1], [25, 15])[None], jnp.int32)
    w = jax.random.normal(jax.random.PRNGKey(2), (1, 40, 2, 8))
    ws = jax.random.normal(jax.random.PRNGKey(3), s0.shape)

    def loss(fn, *args):
        o, s = fn(
            *args[:5],
            initial_state=args[5],
            output_final_state=True,
            segment_ids=seg,
            **({"chunk_size": 16} if fn is chunk_kda else {}),
        )
        return jnp.sum(o * w) + jnp.sum(s * ws)

    gr = jax.grad(lambda *a: loss(recurrent_kda, *a), argnums=tuple(range(6)))(q, k, v, g, beta, s0)
    gc = jax.grad(lambda *a: loss(chunk_kda, *a), argnums=tuple(range(6)))(q, k, v, g, beta, s0)
    for name, a, b in zip("q k v g beta s0".split(), gc, gr, strict=True):
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert _rel(a, b) <= 1e-4, name


def test_shape_errors_name_the_tensor():
    q, k, v, g, beta, s0 = make_inputs(1, 8, 2, 8, 4)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        recurrent_kda(q, k, v, g, beta, initial_state=s0[:, :1])
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(q, k, v, g, beta, chunk_size=48, sub_chunk_size=32)


def _load_golden() -> dict[str, dict[str, np.ndarray]]:
    data = np.load(GOLDEN)
    cases: dict[str, dict[str, np.ndarray]] = {}
    for key in data.files:
        case, name = key.split("/", 1)
        x = data[key]
        if x.dtype == np.uint16:  # bf16 bit patterns -> exact fp32
            x = (x.astype(np.uint32) << 16).view(np.float32)
        cases.setdefault(case, {})[name] = x
    return cases


@pytest.mark.parametrize("fn", [recurrent_kda, chunk_kda])
def test_matches_fla_golden(fn):
    """fla's naive_recurrent_kda / naive_chunk_kda outputs (tests/fixtures/make_kda_golden.py)."""
    if not GOLDEN.exists():
        pytest.skip(f"golden file {GOLDEN} missing (generate with tests/fixtures/make_kda_golden.py)")
    cases = _load_golden()
    assert set(cases) == {"T37", "T128"}, sorted(cases)
    for case, d in cases.items():
        args = (jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta"))
        o, s = fn(
            *args, scale=float(d["scale"]), initial_state=jnp.asarray(d["initial_state"]), output_final_state=True
        )
        for form in ("recurrent", "chunk"):
            assert o.shape == d[f"o_{form}"].shape and s.shape == d[f"s_{form}"].shape
            assert _rel(o, d[f"o_{form}"]) <= 1e-5, (case, form)
            assert _rel(s, d[f"s_{form}"]) <= 1e-5, (case, form)
