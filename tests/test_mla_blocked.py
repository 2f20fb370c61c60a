"""MLA attention in query blocks (training/prefill) vs the full ``[B, H, T, T]`` form it replaced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.config import load_config
from k3_jax.layers import mla
from k3_jax.layers.mla import KimiMLAAttention, blocked_causal_attention, causal_segment_mask, expanded_attention
from tests._model_fixtures import REPO

B, T, H, DQK, DV = 2, 37, 3, 12, 8  # T = 4 blocks of 8 + a partial block of 5


def _rel(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _segments() -> jax.Array:
    """Row 0: documents of 5, 14, 18 tokens (boundaries inside blocks); row 1: one document."""
    row0 = np.concatenate([np.full(5, 1), np.full(14, 2), np.full(T - 19, 3)])
    return jnp.asarray(np.stack([row0, np.zeros(T)]), jnp.int32)


def _qkv(seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (2.0 * jax.random.normal(ks[0], (B, T, H, DQK)), jax.random.normal(ks[1], (B, T, H, DQK)),
            jax.random.normal(ks[2], (B, T, H, DV)))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("block", [8, 37, 64])
def test_blocked_attention_matches_full_forward_and_grads(packed: bool, block: int):
    q, k, v = _qkv()
    seg = _segments() if packed else None
    scale = DQK ** -0.5
    w = jax.random.normal(jax.random.PRNGKey(9), (B, T, H, DV))  # a non-uniform cotangent

    def full(q, k, v):
        return jnp.sum(w * expanded_attention(q, k, v, causal_segment_mask(seg, B, T), scale))

    def blocked(q, k, v):
        return jnp.sum(w * blocked_causal_attention(q, k, v, scale, seg, block=block))

    ref = expanded_attention(q, k, v, causal_segment_mask(seg, B, T), scale)
    out = jax.jit(lambda q, k, v: blocked_causal_attention(q, k, v, scale, seg, block=block))(q, k, v)
    assert out.shape == ref.shape
    assert _rel(out, ref) <= 1e-5
    g_ref = jax.grad(full, argnums=(0, 1, 2))(q, k, v)
    g_out = jax.jit(jax.grad(blocked, argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", g_out, g_ref, strict=True):
        assert _rel(a, b) <= 1e-5, name


def test_blocked_attention_bf16_matches_full():
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(1))
    seg = _segments()
    ref = expanded_attention(q, k, v, causal_segment_mask(seg, B, T), 0.3)
    out = blocked_causal_attention(q, k, v, 0.3, seg, block=8)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def _layer_setup():
    cfg = load_config(REPO / "configs" / "k3-tiny.json", dtype="float32")
    layer = KimiMLAAttention(cfg)
    x = 0.5 * jax.random.normal(jax.random.PRNGKey(3), (B, T, cfg.hidden_size))
    params = layer.init(jax.random.PRNGKey(4), x[:, :4])
    return cfg, layer, x, params


def _query_blocks_mapped(f, *args) -> bool:
    """Whether tracing ``f`` maps over query blocks (``lax.map`` lowers to a ``scan`` in the jaxpr)."""
    return "scan[" in str(jax.make_jaxpr(f)(*args))


def test_layer_blocked_matches_full(monkeypatch):
    """The layer with 8-query blocks vs one block holding all T (= the old full-score path)."""
    cfg, layer, x, params = _layer_setup()
    seg = _segments()

    def loss(p, x):
        y, _ = layer.apply(p, x, segment_ids=seg)
        return jnp.sum(jnp.sin(y)), y

    def run(query_block: int):
        # a fresh function per block size: jit caches traces by function, and QUERY_BLOCK is read at trace time
        monkeypatch.setattr(mla, "QUERY_BLOCK", query_block)
        f = jax.value_and_grad(lambda p, x: loss(p, x), argnums=(0, 1), has_aux=True)
        return jax.jit(f)(params, x), _query_blocks_mapped(f, params, x)

    ((_, y_ref), g_ref), mapped_ref = run(1024)
    ((_, y_blk), g_blk), mapped_blk = run(8)
    assert not mapped_ref and mapped_blk, "the blocked path did not run (or the reference was blocked too)"
    assert _rel(y_blk, y_ref) <= 1e-5
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_blk), jax.tree_util.tree_leaves(g_ref),
                            strict=True):
        assert _rel(a, b) <= 1e-5, jax.tree_util.keystr(path)


def test_layer_cached_prefill_blocked_matches_full(monkeypatch):
    """Prefill through the cache (absorbed form) in blocks of 8 vs one block; also decode right after."""
    cfg, layer, x, params = _layer_setup()
    cache = {"latent": jnp.zeros((B, 48, cfg.kv_lora_rank + cfg.qk_rope_head_dim), jnp.float32)}
    lengths = jnp.array([0, 3], jnp.int32)
    x_next = x[:, :1] * 0.7

    def prefill_then_decode(p):
        y, c = layer.apply(p, x, cache=cache, lengths=lengths)
        y1, _ = layer.apply(p, x_next, cache=c, lengths=lengths + T)
        return y, c["latent"], y1

    def run(query_block: int):
        monkeypatch.setattr(mla, "QUERY_BLOCK", query_block)
        f = lambda p: prefill_then_decode(p)  # noqa: E731 - fresh per block size (jit caches by function)
        return jax.jit(f)(params), _query_blocks_mapped(f, params)

    ref, mapped_ref = run(1024)
    out, mapped_blk = run(8)
    assert not mapped_ref and mapped_blk, "the blocked path did not run (or the reference was blocked too)"
    for a, b in zip(out, ref, strict=True):
        assert _rel(a, b) <= 1e-5


def test_blocked_attention_backward_keeps_no_full_scores():
    """Compile only: the VJP residuals are the inputs (no ``[B, H, T, T]`` score/probability tensor)."""
    b, t, h, d = 1, 1024, 2, 16
    spec = jax.ShapeDtypeStruct((b, t, h, d), jnp.float32)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)
    full_scores = b * h * t * t * 4

    def residual_bytes(f):
        def res(q, k, v, s):
            _, vjp = jax.vjp(lambda q, k, v: f(q, k, v, s), q, k, v)
            return jax.tree_util.tree_leaves(vjp)

        return sum(x.size * x.dtype.itemsize for x in jax.eval_shape(res, spec, spec, spec, seg))

    blocked = residual_bytes(lambda q, k, v, s: blocked_causal_attention(q, k, v, 0.25, s, block=128))
    full = residual_bytes(lambda q, k, v, s: expanded_attention(q, k, v, causal_segment_mask(s, b, t), 0.25))
    assert full >= full_scores  # the old form keeps at least the probabilities
    assert blocked <= 4 * 3 * b * t * h * d * 4 + 2 * b * t * 4, (blocked, full)
