"""The router's top-k expert selection by ranking (:func:`k3_jax.layers.moe.top_k_ids_by_rank`, used on GPU for
decode-sized batches) against ``jax.lax.top_k``: the same ids in the same order, ties to the lower index, on
scores full of ties, signed zeros, infinities and NaNs, at K3's (896 experts, top-16) and k3-slice's (16, top-4)
router shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.layers.moe import ROUTER_REDUCE_ROWS, select_experts, top_k_ids_by_rank
from pallas_kernels.registry import platform_scope


def _scores(n: int, e: int, seed: int) -> np.ndarray:
    """Router-like selection scores with many exact ties (a few levels), ±0, ±inf and ±NaN sprinkled in."""
    rs = np.random.RandomState(seed)
    x = rs.choice(np.float32([0.25, 0.5, 0.5000001, 0.75, 1.0]), size=(n, e)).astype(np.float32)
    x += rs.standard_normal((n, e)).astype(np.float32) * (rs.rand(n, e) < 0.5)
    specials = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan])
    mask = rs.rand(n, e) < 0.05
    x[mask] = rs.choice(specials, size=int(mask.sum()))
    x[0] = 0.5  # one row all tied
    return x


@pytest.mark.parametrize("n, e, k", [(64, 896, 16), (64, 16, 4), (1, 896, 16), (3, 16, 16)])
def test_rank_selection_equals_lax_top_k(n, e, k):
    x = jnp.asarray(_scores(n, e, seed=n + e + k))
    want = jax.lax.top_k(x, k)[1]
    got = jax.jit(top_k_ids_by_rank, static_argnums=1)(x, k)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.dtype == jnp.int32


def test_select_experts_ranks_on_gpu_for_decode_batches_only():
    x = jnp.asarray(_scores(8, 896, seed=1))
    prims = lambda n: str(jax.make_jaxpr(lambda s: select_experts(s, 16))(jnp.zeros((n, 896), jnp.float32)))
    with platform_scope("gpu"):
        np.testing.assert_array_equal(np.asarray(select_experts(x, 16)), np.asarray(jax.lax.top_k(x, 16)[1]))
        assert "top_k" not in prims(ROUTER_REDUCE_ROWS) and "top_k" in prims(ROUTER_REDUCE_ROWS + 1)
    with platform_scope("cpu"):
        assert "top_k" in prims(8)


def test_rank_selection_rejects_bad_k():
    with pytest.raises(ValueError, match="k must be in"):
        top_k_ids_by_rank(jnp.zeros((2, 4)), 5)


def test_rank_selection_gathers_values_at_the_selected_ids():
    """``top_k_ids_by_rank(x, k, values)`` = the ids and ``take_along_axis(values, ids)``, bit for bit; and the
    router (``route``) on GPU at decode sizes gives what its ``lax.top_k`` path gives, gradients of the weights
    included."""
    from k3_jax.layers.moe import route

    x = jnp.asarray(_scores(64, 896, seed=5))
    vals = jnp.asarray(np.random.RandomState(6).standard_normal((64, 896)).astype(np.float32))
    ids, got = jax.jit(top_k_ids_by_rank, static_argnums=1)(x, 16, vals)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(jax.lax.top_k(x, 16)[1]))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.take_along_axis(vals, ids, axis=-1)))

    rs = np.random.RandomState(7)
    h, w = jnp.asarray(rs.standard_normal((8, 32)), jnp.float32), jnp.asarray(rs.standard_normal((32, 16)) * 0.3,
                                                                               jnp.float32)
    bias = jnp.asarray(rs.standard_normal(16) * 0.1, jnp.float32)

    def weights_sum(h, w, platform):
        with platform_scope(platform):
            _, ids, weights = route(h, w, bias, 4)
        return jnp.sum(weights * jnp.arange(4.0)), ids

    (v_gpu, ids_gpu), g_gpu = jax.value_and_grad(weights_sum, argnums=(0, 1), has_aux=True)(h, w, "gpu")
    (v_cpu, ids_cpu), g_cpu = jax.value_and_grad(weights_sum, argnums=(0, 1), has_aux=True)(h, w, "cpu")
    np.testing.assert_array_equal(np.asarray(ids_gpu), np.asarray(ids_cpu))
    np.testing.assert_allclose(float(v_gpu), float(v_cpu), rtol=1e-6)
    for a, b in zip(g_gpu, g_cpu, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
