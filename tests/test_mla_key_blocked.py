"""Cached prefill over key blocks (online softmax) vs the absorbed attention it replaces for long caches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.layers import mla
from k3_jax.layers.mla import absorbed_attention, absorbed_attention_key_blocked

B, T, S, H, C, DN, DR, DV = 2, 11, 37, 3, 16, 8, 4, 6  # S = 4 key blocks of 8 + a partial block of 5


def _rel(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _inputs(seed: int = 0) -> tuple[jax.Array, ...]:
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q_nope = 2.0 * jax.random.normal(ks[0], (B, T, H, DN))
    q_rot = 2.0 * jax.random.normal(ks[1], (B, T, H, DR))
    store = jax.random.normal(ks[2], (B, S, C + DR))
    w_uk = jax.random.normal(ks[3], (C, H, DN)) / C ** 0.5
    w_uv = jax.random.normal(ks[4], (C, H, DV)) / C ** 0.5
    return q_nope, q_rot, store, w_uk, w_uv


def _reference(q_nope, q_rot, store, w_uk, w_uv, pos_q, scale):
    mask = jnp.arange(S)[None, None, :] <= pos_q[:, :, None]
    return absorbed_attention(q_nope, q_rot, store, w_uk, w_uv, mask, scale)


@pytest.mark.parametrize("key_block", [8, 5, 37])
@pytest.mark.parametrize("starts", [(0, 3), (26, 9), (29, 0)])
def test_key_blocked_matches_absorbed(key_block: int, starts: tuple[int, int]):
    """Rows with different cached lengths; visible ranges end mid-block, on block edges and in the partial
    last block; (29, 0) puts row 0's last queries at S-1 and row 1 far behind (blocks it must not see)."""
    q_nope, q_rot, store, w_uk, w_uv = _inputs()
    pos_q = jnp.asarray(starts, jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    pos_q = jnp.minimum(pos_q, S - 1)
    scale = (DN + DR) ** -0.5
    ref = _reference(q_nope, q_rot, store, w_uk, w_uv, pos_q, scale)
    out = jax.jit(lambda *a: absorbed_attention_key_blocked(*a, scale, key_block=key_block))(
        q_nope, q_rot, store, w_uk, w_uv, pos_q)
    assert out.shape == ref.shape == (B, T, H, DV)
    assert _rel(out, ref) <= 1e-5


def test_key_blocked_skips_blocks_past_last_query():
    """Keys beyond every query's position (here: NaN garbage) never reach the result."""
    q_nope, q_rot, store, w_uk, w_uv = _inputs(1)
    pos_q = jnp.asarray([[0, 1, 2, 5], [3, 4, 6, 7]], jnp.int32)  # all inside key block 0 (of 8)
    poisoned = store.at[:, 8:].set(jnp.nan)
    out = absorbed_attention_key_blocked(q_nope[:, :4], q_rot[:, :4], poisoned, w_uk, w_uv, pos_q, 0.3, key_block=8)
    ref = _reference(q_nope[:, :4], q_rot[:, :4], store, w_uk, w_uv, pos_q, 0.3)
    assert np.all(np.isfinite(np.asarray(out)))
    assert _rel(out, ref) <= 1e-5


def test_key_blocked_bf16_close_to_absorbed():
    q_nope, q_rot, store, w_uk, w_uv = (x.astype(jnp.bfloat16) for x in _inputs(2))
    pos_q = jnp.asarray([[20], [36]], jnp.int32) + jnp.zeros((1, T), jnp.int32) - jnp.arange(T)[::-1]
    ref = _reference(q_nope, q_rot, store, w_uk, w_uv, pos_q, 0.3)
    out = absorbed_attention_key_blocked(q_nope, q_rot, store, w_uk, w_uv, pos_q, 0.3, key_block=8)
    assert out.dtype == jnp.bfloat16
    assert _rel(out.astype(jnp.float32), ref.astype(jnp.float32)) <= 2e-2


def test_layer_cached_prefill_key_blocked_matches(monkeypatch):
    """The MLA layer: prefill 13 tokens into a 37-slot cache (rows already hold 0 and 20 tokens) in query
    blocks of 4, with key blocks of 8 vs the unblocked-key path; decode afterwards (T = 1, unchanged path)."""
    from k3_jax.config import load_config
    from tests._model_fixtures import REPO

    cfg = load_config(REPO / "configs" / "k3-tiny.json", dtype="float32")
    layer = mla.KimiMLAAttention(cfg)
    t = 13
    x = 0.5 * jax.random.normal(jax.random.PRNGKey(3), (B, t, cfg.hidden_size))
    params = layer.init(jax.random.PRNGKey(4), x[:, :4])
    cache = {"latent": 0.3 * jax.random.normal(jax.random.PRNGKey(5),
                                               (B, S, cfg.kv_lora_rank + cfg.qk_rope_head_dim))}
    lengths = jnp.array([0, 20], jnp.int32)

    def prefill_then_decode(p):
        y, c = layer.apply(p, x, cache=cache, lengths=lengths)
        y1, _ = layer.apply(p, x[:, :1] * 0.7, cache=c, lengths=lengths + t)
        return y, c["latent"], y1

    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return absorbed_attention_key_blocked(*args, **kwargs)

    monkeypatch.setattr(mla, "absorbed_attention_key_blocked", spy)
    monkeypatch.setattr(mla, "QUERY_BLOCK", 4)
    monkeypatch.setattr(mla, "KEY_BLOCK", 1024)
    ref = jax.jit(lambda p: prefill_then_decode(p))(params)  # a fresh function: no jit-cache hit across patches
    assert not calls
    monkeypatch.setattr(mla, "KEY_BLOCK", 8)
    out = jax.jit(lambda p: prefill_then_decode(p))(params)
    assert calls == [(B, 4, cfg.num_attention_heads, cfg.qk_nope_head_dim)]  # prefill blocks only, not decode
    for a, b in zip(out, ref, strict=True):
        assert _rel(a, b) <= 1e-5
