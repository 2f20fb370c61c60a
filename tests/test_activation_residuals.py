"""What autodiff keeps for the backward: the elementwise fp32 chains (norms, SiTU-GLU, gates) are recomputed,
so a bf16 model saves no f32 copies of its token activations there (the K3-width train step's peak memory and
HBM traffic; benchmarks/RESULTS.md, night session of 2026-11-29)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from k3_jax.config import load_config
from k3_jax.layers.common import rms_norm
from k3_jax.layers.kda import KimiDeltaAttention, gated_output_norm
from k3_jax.layers.mla import sigmoid_gate
from pallas_kernels.moe.reference import situ_glu

saved_residuals = pytest.importorskip("jax._src.ad_checkpoint").saved_residuals

B, T, H, D = 2, 16, 4, 32


def _f32_residuals(fn, *args) -> list[tuple[tuple[int, ...], str]]:
    """(shape, source) of every f32 residual of ``sum(fn(*args))`` that is per token (leading dims B, T)."""
    res = saved_residuals(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), *args)
    return [(a.shape, src) for a, src in res if a.dtype == jnp.float32 and tuple(a.shape[:2]) == (B, T)]


def _bf16(*shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(jnp.bfloat16)


def test_elementwise_chains_keep_no_f32_copies():
    x, g = _bf16(B, T, H, D), _bf16(B, T, H, D, seed=1)
    w = jnp.ones((D,), jnp.float32)
    assert _f32_residuals(lambda x: rms_norm(x, w.astype(jnp.bfloat16), 1e-5), x) == []
    assert _f32_residuals(lambda a, b: situ_glu(a, b, 4.0, 25.0), x, g) == []
    assert _f32_residuals(lambda o, gt: gated_output_norm(o, w, gt, 1e-5, jnp.bfloat16), x, g) == []
    assert _f32_residuals(lambda o, gt: sigmoid_gate(o, gt, jnp.bfloat16), x, g) == []


def test_recomputed_chains_have_the_same_gradients():
    x, g = _bf16(B, T, H, D), _bf16(B, T, H, D, seed=1)
    w = jnp.full((D,), 1.5, jnp.float32)

    def plain(o, gt):  # the same math without the checkpoint
        o32 = o.astype(jnp.float32)
        y = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, -1, keepdims=True) + 1e-5)
        return (y * w * jax.nn.sigmoid(gt.astype(jnp.float32))).astype(jnp.bfloat16)

    def loss(fn):
        return lambda o, gt: jnp.sum(jnp.sin(fn(o, gt).astype(jnp.float32)))

    got = jax.grad(loss(lambda o, gt: gated_output_norm(o, w, gt, 1e-5, jnp.bfloat16)), argnums=(0, 1))(x, g)
    want = jax.grad(loss(plain), argnums=(0, 1))(x, g)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)


def test_kda_layer_keeps_only_the_gate_in_f32():
    """The KDA layer as the GPU kernels trace it (traced only, never run here): of its token-sized f32
    residuals only the log-decay gate (a kernel input) is left."""
    cfg = load_config("configs/k3-tiny.json", dtype="bfloat16", kda_implementation="triton",
                      platform="gpu")
    layer = KimiDeltaAttention(cfg)
    x = _bf16(B, T, cfg.hidden_size)
    seg = jnp.ones((B, T), jnp.int32)
    params = nn.unbox(jax.eval_shape(layer.init, jax.random.key(0), x, seg)["params"])
    params = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
    f32 = _f32_residuals(lambda p, x: layer.apply({"params": p}, x, seg)[0], params, x)
    h, dk = cfg.kda_num_heads, cfg.kda_head_dim
    big = [(s, src) for s, src in f32 if np.prod(s) >= B * T * h * dk]
    assert [s for s, _ in big] == [(B, T, h, dk)] and "kda_gate" in big[0][1], f32
