"""A prefill chunk against a cached prefix in the expanded MLA form (pallas_kernels/prefix_attention.py): the
plain-JAX reference of the algorithm equals the absorbed form it replaces (fp32), the MLA layer's wiring, the
registry choice, and (GPU only) the cuDNN backend against the reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.config import load_config
from k3_jax.layers import mla
from pallas_kernels import prefix_attention as pa
from pallas_kernels.registry import Backend, KernelUnavailable, Registry
from tests._model_fixtures import REPO

B, T, S, H, C, DN, DR, DV = 2, 8, 45, 3, 16, 8, 4, 6
HIGHEST = jax.lax.Precision.HIGHEST


def _rel(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _problem(lengths: tuple[int, int], seed: int = 0, dtype=jnp.float32, dims=(T, S, H, C, DN, DR, DV)):
    """Queries of a chunk at ``lengths .. lengths+T-1``, a store holding garbage (large finite values) past each
    row's prefix and the chunk's own entries written at ``lengths``; the absorbed-form result (fp32)."""
    T, S, H, C, DN, DR, DV = dims  # noqa: N806
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    q = 2.0 * jax.random.normal(ks[0], (B, T, H, DN + DR))
    store = jax.random.normal(ks[1], (B, S, C + DR))
    store = jnp.where(jnp.arange(S)[None, :, None] >= jnp.asarray(lengths)[:, None, None], 1e3, store)
    new = jax.random.normal(ks[2], (B, T, C + DR))
    lens = jnp.asarray(lengths, jnp.int32)
    store = jax.vmap(lambda s, n, p: jax.lax.dynamic_update_slice(s, n, (p, 0)))(store, new, lens)
    kv_kernel = jax.random.normal(ks[3], (C, H * (DN + DV))) / C ** 0.5
    scale = (DN + DR) ** -0.5
    pos_q = lens[:, None] + jnp.arange(T)[None]
    mask = jnp.arange(S)[None, None, :] <= pos_q[:, :, None]
    w = kv_kernel.reshape(C, H, DN + DV)
    ref = mla.absorbed_attention(q[..., :DN], q[..., DN:], store, w[..., :DN], w[..., DN:], mask, scale)
    cast = [x.astype(dtype) for x in (q, store, new, kv_kernel)]
    return (*cast, lens, scale, ref)


def _expanded(q, store, new, kv_kernel, lens, scale, partial, key_block, dtype=jnp.float32, nope_dim=DN):
    expand = functools.partial(mla.expand_latent, kv_kernel=kv_kernel, heads=q.shape[2], nope_dim=nope_dim, dtype=dtype,
                               precision=HIGHEST)
    k_self, v_self = expand(new)
    return pa.chunk_prefix_attention(q, k_self, v_self, store, expand, lens, scale, partial, key_block=key_block)


@pytest.mark.parametrize("lengths, key_block", [((16, 37), 8), ((24, 0), 7)])
def test_reference_equals_absorbed_form(lengths: tuple[int, int], key_block: int):
    """Rows with different prefixes (none, on a block edge, mid-block, in the padded last block of a store that
    key blocks do not split evenly); garbage past a prefix never counts."""
    q, store, new, kv_kernel, lens, scale, ref = _problem(lengths)
    out = jax.jit(lambda *a: _expanded(*a, scale, pa.partial_attention_xla, key_block))(q, store, new, kv_kernel, lens)
    assert out.shape == ref.shape == (B, T, H, DV)
    assert _rel(out, ref) <= 1e-5


def test_merge_of_empty_and_full_partials():
    """A row with no key in one part takes the other part alone (weights exactly 0 and 1)."""
    rs = np.random.RandomState(1)
    q, k, v = (jnp.asarray(rs.randn(1, 4, 2, d), jnp.float32) for d in (8, 8, 5))

    @jax.jit
    def parts(q, k, v):
        o, lse = pa.partial_attention_xla(q, k, v, 0.5, causal=True)
        o0, lse0 = pa.partial_attention_xla(q, k, v, 0.5, kv_len=jnp.zeros((1,), jnp.int32))
        return o, lse, o0, lse0, *pa.merge_partials(o0, lse0, o, lse)

    o, lse, o0, lse0, om, lsem = parts(q, k, v)
    assert np.all(np.asarray(o0) == 0) and np.all(np.asarray(lse0) == pa.NEG_INF)
    np.testing.assert_array_equal(np.asarray(om), np.asarray(o))
    np.testing.assert_allclose(np.asarray(lsem), np.asarray(lse), rtol=1e-6)


def test_layer_takes_the_expanded_form_when_chosen(monkeypatch):
    """The MLA layer's cached prefill with the expanded backend (its cuDNN partial replaced by the plain-JAX
    one, since this host has no GPU) equals the absorbed path: output and cache."""
    cfg = load_config(REPO / "configs" / "k3-tiny.json", dtype="float32")
    layer = mla.KimiMLAAttention(cfg)
    t, s = 13, 37
    x = 0.5 * jax.random.normal(jax.random.PRNGKey(3), (B, t, cfg.hidden_size))
    params = layer.init(jax.random.PRNGKey(4), x[:, :4])
    cache = {"latent": 0.3 * jax.random.normal(jax.random.PRNGKey(5), (B, s, cfg.kv_lora_rank + cfg.qk_rope_head_dim))}
    lengths = jnp.array([0, 20], jnp.int32)

    def prefill(p):
        y, c = layer.apply(p, x, cache=cache, lengths=lengths)
        return y, c["latent"]

    ref = jax.jit(lambda p: prefill(p))(params)
    calls = []

    def spy(q, k, v, scale, kv_len=None, causal=False):
        calls.append((q.shape, k.shape[1], causal))
        return pa.partial_attention_xla(q, k, v, scale, kv_len, causal)

    always = Registry("mla.prefix_attention", (Backend("cudnn", "test", lambda call: None),))
    monkeypatch.setattr(pa, "PREFIX_ATTENTION", always)
    monkeypatch.setattr(pa, "partial_attention_cudnn", spy)
    monkeypatch.setattr(pa, "MIN_QUERIES", 4)
    monkeypatch.setattr(pa, "KEY_BLOCK", 8)
    out = jax.jit(lambda p: prefill(p))(params)  # a fresh function: no jit-cache hit across patches
    hq = (B, t, cfg.num_attention_heads, cfg.q_head_dim)
    assert calls == [(hq, t, True), (hq, 8, False)]  # the chunk causally, then the key-block loop body (traced once)
    for a, b in zip(out, ref, strict=True):
        assert _rel(a, b) <= 1e-5


def test_choice_is_visible_and_explicit_cudnn_refused_off_gpu():
    cfg = load_config(REPO / "configs" / "k3-tiny.json")
    q = jnp.zeros((1, 256, 4, 48), jnp.bfloat16)
    if jax.default_backend() != "gpu":
        assert mla.prefix_attention_backend(cfg, q, 32) == "xla"
        with pytest.raises(KernelUnavailable, match="mla.prefix_attention: implementation='cudnn'.*target is cpu"):
            mla.prefix_attention_backend(cfg.replace(mla_prefix_attention_implementation="cudnn"), q, 32)
    sel = pa.PREFIX_ATTENTION.select("auto", pa.PrefixAttentionCall("gpu", "float32", (1, 256, 4, 48, 32), 9.0),
                                     record=False)
    assert sel.backend == "xla" and "bfloat16/float16" in dict(sel.passed_over)["cudnn"]


@pytest.mark.gpu
def test_cudnn_partials_match_reference():
    """cuDNN partial attention (no mask with per-row key lengths, T_q != T_kv; causal, T_q == T_kv) and its
    log-sum-exp against the fp32 reference, at MLA's head dims (192 / 128)."""
    ks = jax.random.split(jax.random.PRNGKey(7), 4)
    q = jax.random.normal(ks[0], (2, 256, 4, 192), jnp.bfloat16)
    k = jax.random.normal(ks[1], (2, 640, 4, 192), jnp.bfloat16)
    v = jax.random.normal(ks[2], (2, 640, 4, 128), jnp.bfloat16)
    scale = 192 ** -0.5
    kv_len = jnp.asarray([300, 0], jnp.int32)
    for args in ((q, k, v, scale, kv_len, False), (q, k[:, :256], v[:, :256], scale, None, True),
                 (q, k, v, scale, None, False)):
        o, lse = jax.jit(pa.partial_attention_cudnn, static_argnums=(3, 5))(*args)
        o_ref, lse_ref = pa.partial_attention_xla(*args)
        assert o.shape == o_ref.shape and lse.shape == lse_ref.shape
        assert _rel(o, o_ref) <= 2e-2
        live = np.asarray(lse_ref) > pa.NEG_INF / 2
        np.testing.assert_allclose(np.asarray(lse)[live], np.asarray(lse_ref)[live], atol=2e-2, rtol=1e-3)
        assert np.all(np.asarray(lse)[~live] == pa.NEG_INF)


@pytest.mark.gpu
def test_cudnn_chunk_prefix_attention_matches_absorbed_bf16():
    """The whole algorithm with cuDNN partials (bf16) against the absorbed form (fp32 inputs)."""
    dims = (256, 1000, 4, 64, 128, 64, 128)  # T, S, H, C, Dn, Dr, Dv: cuDNN takes head dims in multiples of 8
    q, store, new, kv_kernel, lens, scale, ref = _problem((700, 37), seed=2, dtype=jnp.bfloat16, dims=dims)
    out = jax.jit(lambda *a: _expanded(*a, scale, pa.partial_attention_cudnn, 384, jnp.bfloat16, 128))(
        q, store, new, kv_kernel, lens)
    assert out.dtype == jnp.bfloat16
    assert _rel(out.astype(jnp.float32), ref) <= 3e-2


@pytest.mark.gpu
def test_layer_cached_prefill_cudnn_vs_absorbed_bf16():
    """The MLA layer (k3-tiny widths, bf16) prefilling 512 tokens after cached prefixes of 700 and 0 tokens:
    auto (cuDNN, expanded) against the explicit absorbed path."""
    cfg = load_config(REPO / "configs" / "k3-tiny.json", dtype="bfloat16")
    t, s = 512, 1280
    x = 0.5 * jax.random.normal(jax.random.PRNGKey(3), (B, t, cfg.hidden_size), jnp.bfloat16)
    params = mla.KimiMLAAttention(cfg).init(jax.random.PRNGKey(4), x[:, :4])
    cache = {"latent": 0.3 * jax.random.normal(jax.random.PRNGKey(5), (B, s, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                                               jnp.bfloat16)}
    lengths = jnp.array([700, 0], jnp.int32)
    outs = {}
    for impl in ("auto", "xla"):
        layer = mla.KimiMLAAttention(cfg.replace(mla_prefix_attention_implementation=impl))
        outs[impl] = jax.jit(lambda p, layer=layer: layer.apply(p, x, cache=cache, lengths=lengths)[0])(params)
    assert mla.prefix_attention_backend(cfg, jnp.zeros((B, t, 4, cfg.q_head_dim), jnp.bfloat16),
                                        cfg.v_head_dim) == "cudnn"
    assert _rel(outs["auto"].astype(jnp.float32), outs["xla"].astype(jnp.float32)) <= 3e-2
