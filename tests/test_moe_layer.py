"""Router, SiTU-GLU and the LatentMoE layer semantics."""

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.layers.moe import route, situ_glu


def test_bias_changes_selection_not_weight_formula():
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 16))
    w = jax.random.normal(jax.random.PRNGKey(1), (16, 8)) * 0.3
    bias0 = jnp.zeros(8)
    bias1 = jnp.zeros(8).at[3].set(5.0)  # force expert 3 into every token's top-k
    s0, ids0, p0 = route(x, w, bias0, 2)
    s1, ids1, p1 = route(x, w, bias1, 2)
    np.testing.assert_array_equal(np.asarray(s0), np.asarray(s1))
    assert not np.array_equal(np.asarray(ids0), np.asarray(ids1))
    assert np.all(np.any(np.asarray(ids1) == 3, axis=1))
    # weights are the renormalised *raw* scores of the chosen experts
    chosen = np.take_along_axis(np.asarray(s1), np.asarray(ids1), axis=1)
    np.testing.assert_allclose(np.asarray(p1), chosen / (chosen.sum(1, keepdims=True) + 1e-20), rtol=1e-6)


def test_loss_gradient_wrt_bias_is_zero_but_not_wrt_router():
    x = jax.random.normal(jax.random.PRNGKey(0), (32, 16))
    w = jax.random.normal(jax.random.PRNGKey(1), (16, 8)) * 0.3
    target = jax.random.normal(jax.random.PRNGKey(2), (32, 2))

    def loss(w, bias):
        _, _, p = route(x, w, bias, 2)
        return jnp.sum((p - target) ** 2)

    gw, gb = jax.grad(loss, argnums=(0, 1))(w, jnp.linspace(-0.1, 0.1, 8))
    assert np.all(np.asarray(gb) == 0)
    assert np.abs(np.asarray(gw)).max() > 0


def test_situ_glu_bounded_and_swiglu_near_zero():
    g = jnp.linspace(-1e4, 1e4, 20001)
    u = jnp.linspace(1e4, -1e4, 20001)
    y = situ_glu(g, u, 4.0, 25.0)
    assert float(jnp.max(jnp.abs(y))) <= 4.0 * 25.0
    small_g = jnp.linspace(-1e-2, 1e-2, 101)
    small_u = jnp.linspace(2e-2, -2e-2, 101)
    swiglu = jax.nn.silu(small_g) * small_u
    situ = situ_glu(small_g, small_u, 4.0, 25.0)
    # SiTU = SwiGLU · (1 + O(x²)): relative difference is second order
    rel = np.abs(np.asarray(situ - swiglu)) / (np.abs(np.asarray(swiglu)) + 1e-30)
    assert rel.max() < 1e-4
