"""Pure-JAX MoE reference: grouped matmul, SiTU-GLU, expert FFN (bf16 / MXFP4), dispatch + combine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.quant import pack_mxfp4, unpack_mxfp4
from pallas_kernels.moe import reference as ref
from tests._jaxpr_walk import iter_eqns

HI = jax.lax.Precision.HIGHEST


def _loop_gmm(lhs, rhs, gs):
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float64)
    start = 0
    for e, n in enumerate(np.asarray(gs)):
        out[start:start + n] = np.asarray(lhs[start:start + n], np.float64) @ np.asarray(rhs[e], np.float64)
        start += n
    return out


def test_grouped_matmul_empty_groups_and_trailing_rows():
    k0, k1 = jax.random.split(jax.random.key(0))
    lhs = jax.random.normal(k0, (24, 16), jnp.float32)
    rhs = jax.random.normal(k1, (5, 16, 8), jnp.float32)
    gs = jnp.array([0, 7, 0, 10, 3], jnp.int32)  # sum 20 < 24
    got = jax.jit(ref.grouped_matmul)(lhs, rhs, gs)
    np.testing.assert_allclose(np.asarray(got), _loop_gmm(lhs, rhs, gs), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got[20:]) == 0)
    one = ref.grouped_matmul(lhs, rhs, jnp.array([0, 0, 24, 0, 0], jnp.int32))
    np.testing.assert_allclose(np.asarray(one), np.asarray(lhs @ rhs[2]), rtol=1e-5, atol=1e-5)


def test_situ_glu_formula_and_dtype():
    g = jnp.linspace(-30, 30, 64, dtype=jnp.float32)
    u = jnp.linspace(-200, 200, 64, dtype=jnp.float32)
    want = 4 * np.tanh(g / 4) / (1 + np.exp(-g)) * 25 * np.tanh(u / 25)
    np.testing.assert_allclose(np.asarray(ref.situ_glu(g, u)), want, rtol=1e-5, atol=1e-5)
    assert ref.situ_glu(g.astype(jnp.bfloat16), u.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    assert float(jnp.max(jnp.abs(ref.situ_glu(g, u)))) <= 100.0


def _problem(t=16, k=3, e=8, lat=64, inter=32, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    z = jax.random.normal(ks[0], (t, lat), jnp.float32).astype(dtype)
    ids = jnp.argsort(jax.random.uniform(ks[1], (t, e)), axis=-1)[:, :k].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[2], (t, k)), axis=-1).astype(jnp.float32)
    experts = {
        "w1": (jax.random.normal(ks[3], (e, lat, inter)) / np.sqrt(lat)).astype(dtype),
        "w3": (jax.random.normal(ks[4], (e, lat, inter)) / np.sqrt(lat)).astype(dtype),
        "w2": (jax.random.normal(ks[5], (e, inter, lat)) / np.sqrt(inter)).astype(dtype),
    }
    return z, ids, w, experts


def _dense_moe(z, ids, w, experts, beta1=4.0, beta2=25.0):
    """Every expert on every token, masked by the routing (no sorting)."""
    g = jnp.einsum("tl,eli->eti", z, experts["w1"], precision=HI)
    u = jnp.einsum("tl,eli->eti", z, experts["w3"], precision=HI)
    h = ref.situ_glu(g, u, beta1, beta2)
    y = jnp.einsum("eti,eil->etl", h, experts["w2"], precision=HI)
    e = experts["w1"].shape[0]
    p = jnp.sum(jax.nn.one_hot(ids, e) * w[..., None], axis=1)  # [T, E]
    return jnp.einsum("te,etl->tl", p, y.astype(jnp.float32), precision=HI).astype(z.dtype)


def test_dispatch_combine_matches_dense_fp32():
    z, ids, w, experts = _problem()
    got = jax.jit(ref.moe_dispatch_combine)(z, ids, w, experts)
    want = _dense_moe(z, ids, w, experts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_dispatch_combine_skewed_routing():
    z, _, w, experts = _problem(seed=1)
    ids = jnp.stack([jnp.full((16,), 5), jnp.full((16,), 2), jnp.arange(16) % 2], 1).astype(jnp.int32)
    got = ref.moe_dispatch_combine(z, ids, w, experts)
    want = _dense_moe(z, ids, w, experts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_gradients_match_dense():
    z, ids, w, experts = _problem(t=8, k=2, e=4, lat=32, inter=16, seed=2)

    def loss(fn, z, w, experts):
        return jnp.sum(jnp.sin(fn(z, ids, w, experts)))

    ga = jax.grad(lambda *a: loss(ref.moe_dispatch_combine, *a), argnums=(0, 1, 2))(z, w, experts)
    gb = jax.grad(lambda *a: loss(_dense_moe, *a), argnums=(0, 1, 2))(z, w, experts)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_bf16_output_dtype_and_grad():
    z, ids, w, experts = _problem(dtype=jnp.bfloat16, seed=3)
    out = ref.moe_dispatch_combine(z, ids, w, experts)
    assert out.dtype == jnp.bfloat16
    want = _dense_moe(z.astype(jnp.float32), ids, w, jax.tree.map(lambda a: a.astype(jnp.float32), experts))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), rtol=5e-2, atol=5e-2)
    gw = jax.grad(lambda e: jnp.sum(ref.moe_dispatch_combine(z, ids, w, e).astype(jnp.float32)))(experts)
    assert gw["w1"].dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(gw["w2"].astype(jnp.float32))))


def test_mxfp4_path_equals_dequantized_bf16_path():
    z, ids, w, experts = _problem(dtype=jnp.bfloat16, seed=4)
    q = {}
    deq = {}
    for name, arr in experts.items():
        packed, scale = pack_mxfp4(jnp.swapaxes(arr, 1, 2))  # HF [E, out, in]
        q[name] = {"weight_packed": packed, "weight_scale": scale}
        deq[name] = jnp.swapaxes(unpack_mxfp4(packed, scale, jnp.bfloat16), 1, 2)
    a = jax.jit(ref.moe_dispatch_combine)(z, ids, w, q)
    b = jax.jit(ref.moe_dispatch_combine)(z, ids, w, deq)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    c = ref.moe_dispatch_combine(z, ids, w, q, mxfp8_activations=True)
    assert c.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(c.astype(jnp.float32))))


def test_tiled_grouped_matmul_equals_ragged_dot():
    """The CPU formulation of grouped_matmul equals jax.lax.ragged_dot: empty groups, one group taking every row,
    trailing rows, M not a multiple of the tile; values and gradients."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.moe.reference import grouped_matmul_tiled

    key = jax.random.PRNGKey(0)
    lhs = jax.random.normal(key, (150, 24))
    rhs = jax.random.normal(jax.random.PRNGKey(1), (5, 24, 7))
    for sizes in ([0, 37, 0, 90, 13], [150, 0, 0, 0, 0], [3, 0, 60, 1, 40], [0, 0, 0, 0, 0]):
        gs = jnp.asarray(sizes, jnp.int32)

        def ours(a, b, gs=gs):
            return grouped_matmul_tiled(a, b, gs, tile=16)

        def ref(a, b, gs=gs):
            return jax.lax.ragged_dot(a, b, gs, precision=jax.lax.Precision.HIGHEST)

        np.testing.assert_allclose(ours(lhs, rhs), ref(lhs, rhs), rtol=1e-5, atol=1e-5)
        g1 = jax.grad(lambda a, b: jnp.sum(ours(a, b) ** 2), argnums=(0, 1))(lhs, rhs)
        g2 = jax.grad(lambda a, b: jnp.sum(ref(a, b) ** 2), argnums=(0, 1))(lhs, rhs)
        for x, y in zip(g1, g2, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("t, k, num_experts", [(1, 16, 896), (64, 16, 64), (9, 3, 4), (256, 16, 896)])
def test_sort_by_expert_counting_equals_the_stable_sort(t, k, num_experts, monkeypatch):
    """The comparison ranking (decode sizes) gives the stable argsort's order, inverse and group sizes (repeated
    ids, empty experts), and is what runs at these sizes: no sort in its program."""
    from pallas_kernels.moe import reference as moe_ref

    ids = jnp.asarray(np.random.default_rng(t).integers(0, min(num_experts, 3 * k), (t, k)), jnp.int32)
    got = moe_ref.sort_by_expert(ids, num_experts)
    assert "sort" not in {e.primitive.name for e in iter_eqns(lambda i: moe_ref.sort_by_expert(i, num_experts), ids)}
    monkeypatch.setattr(moe_ref, "COUNTING_SORT_MAX", 0)
    want = moe_ref.sort_by_expert(ids, num_experts)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    flat = np.asarray(ids).reshape(-1)
    np.testing.assert_array_equal(np.asarray(got[0]), np.argsort(flat, kind="stable"))


def test_dispatch_permutations_have_gather_only_gradients():
    """dispatch_rows / undispatch_rows equal ``jnp.take`` in value and gradient, and their backward is a gather
    (no scatter-add: atomics in the rows' dtype on GPU)."""
    from pallas_kernels.moe.reference import dispatch_rows, sort_by_expert, undispatch_rows

    t, k, width, num_experts = 9, 3, 5, 4
    ids = jnp.asarray(np.random.default_rng(3).integers(0, num_experts, (t, k)), jnp.int32)
    order, inverse, _ = sort_by_expert(ids, num_experts)
    z = jax.random.normal(jax.random.key(0), (t, width))
    weight = jnp.arange(1.0, t * k + 1.0)[:, None]

    def ours(z):
        y = undispatch_rows(jnp.tanh(dispatch_rows(z, order, inverse, k)), order, inverse)
        return jnp.sum(y * weight)

    def plain(z):
        y = jnp.take(jnp.tanh(jnp.take(z, order // k, axis=0)), inverse, axis=0)
        return jnp.sum(y * weight)

    np.testing.assert_allclose(ours(z), plain(z), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(ours)(z), jax.grad(plain)(z), rtol=1e-6, atol=1e-6)

    def primitives(fn) -> set[str]:
        return {e.primitive.name for e in iter_eqns(fn, z)}

    assert not any("scatter" in p for p in primitives(jax.grad(ours)))
    assert any("scatter" in p for p in primitives(jax.grad(plain)))  # what autodiff of jnp.take gives
