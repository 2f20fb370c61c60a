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
