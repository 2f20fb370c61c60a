"""Block Attention Residuals: schedule (spec b.1) and mixing math (spec b.4)."""

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.layers.attn_res import (
    attn_res_mix,
    attn_res_weights,
    attn_sources_count,
    mlp_sources_count,
    output_slot,
)
from tests._model_fixtures import tiny_config


def official_schedule(num_layers: int, block_size: int):
    """Replays the official bank/prefix bookkeeping and lists the sources each mixing point sees."""
    bank, prefix, points = [], "e", []
    for layer in range(num_layers):
        points.append(("attn", layer, ["e"] if not bank else bank + [prefix]))
        if layer % block_size == 0:
            bank.append(prefix)
            prefix = None
        prefix = f"S{layer // block_size}"
        points.append(("mlp", layer, bank + [prefix]))
    points.append(("out", num_layers, bank + [prefix]))
    return points


def test_tiny_schedule_matches_spec_listing():
    cfg = tiny_config()
    listing = {(kind, layer): srcs for kind, layer, srcs in official_schedule(10, cfg.attn_res_block_size)}
    # spec a.2: blocks {0-3}, {4-7}, {8-9}; the output mixes emb + 3 block sums.
    assert listing[("attn", 0)] == ["e"]
    assert listing[("mlp", 0)] == ["e", "S0"]
    assert listing[("attn", 3)] == ["e", "S0"]
    assert listing[("attn", 4)] == ["e", "S0"]
    assert listing[("mlp", 4)] == ["e", "S0", "S1"]
    assert listing[("attn", 8)] == ["e", "S0", "S1"]
    assert listing[("mlp", 9)] == ["e", "S0", "S1", "S2"]
    assert listing[("out", 10)] == ["e", "S0", "S1", "S2"]
    # Our slot arithmetic reproduces every mixing point: slot 0 = e, slot m+1 = S_m.
    for kind, layer, srcs in official_schedule(10, 4):
        expected = len(srcs)
        if kind == "attn":
            assert int(attn_sources_count(layer, 4)) == expected
        elif kind == "mlp":
            assert int(mlp_sources_count(layer, 4)) == expected
            assert int(output_slot(layer, 4)) == expected - 1  # writes into the current partial block
        else:
            assert cfg.num_attn_res_blocks + 1 == expected


def test_k3_output_mixes_nine_sources():
    points = official_schedule(93, 12)
    assert len(points[-1][2]) == 9


def test_single_source_is_identity():
    v = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 5, 16))
    out = attn_res_mix(v, 1, jax.random.normal(jax.random.PRNGKey(1), (16,)), 1e-5, jnp.float32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(v[0]))


def test_weights_sum_to_one_and_ignore_unfilled_slots():
    v = jax.random.normal(jax.random.PRNGKey(0), (5, 2, 7, 32)) * 3
    q = jax.random.normal(jax.random.PRNGKey(1), (32,))
    p = attn_res_weights(v, 3, q, 1e-5)
    np.testing.assert_allclose(np.asarray(p.sum(0)), 1.0, rtol=1e-6)
    assert np.all(np.asarray(p[3:]) == 0)
    # changing an unfilled slot changes nothing
    v2 = v.at[4].set(1e3)
    np.testing.assert_array_equal(np.asarray(attn_res_mix(v, 3, q, 1e-5, jnp.float32)),
                                  np.asarray(attn_res_mix(v2, 3, q, 1e-5, jnp.float32)))


def test_mix_matches_direct_formula():
    v = jax.random.normal(jax.random.PRNGKey(2), (4, 1, 3, 8))
    q = jax.random.normal(jax.random.PRNGKey(3), (8,))
    vn = np.asarray(v, np.float64)
    k = vn / np.sqrt((vn**2).mean(-1, keepdims=True) + 1e-5)
    logits = (k * np.asarray(q, np.float64)).sum(-1)
    p = np.exp(logits - logits.max(0)) / np.exp(logits - logits.max(0)).sum(0)
    expected = (p[..., None] * vn).sum(0)
    np.testing.assert_allclose(np.asarray(attn_res_mix(v, 4, q, 1e-5, jnp.float32)), expected, rtol=1e-5,
                               atol=1e-6)
