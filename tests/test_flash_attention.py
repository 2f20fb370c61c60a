"""cuDNN flash attention for MLA training (pallas_kernels/attention.py): the static limits, the
implementation choice, and (GPU only) equality with the blocked XLA path in outputs and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.config import ConfigError, load_config
from k3_jax.layers.mla import blocked_causal_attention, causal_attention
from pallas_kernels import attention as flash_attention
from pallas_kernels.attention import MAX_MASKED_LENGTH, cudnn_causal_attention, cudnn_supports
from tests._model_fixtures import REPO


def test_cudnn_supports_static_limits():
    q = jnp.zeros((1, 64, 2, 8), jnp.bfloat16)
    seg = jnp.zeros((1, 64), jnp.int32)
    assert cudnn_supports(q, seg) and cudnn_supports(q, None)
    assert not cudnn_supports(q.astype(jnp.float32), None)  # cuDNN takes bf16/fp16 only
    assert not cudnn_supports(q[:, :63], seg[:, :63])  # a bias needs an even T in training
    assert cudnn_supports(q[:, :63], None)
    long_q = jax.ShapeDtypeStruct((1, MAX_MASKED_LENGTH + 2, 2, 8), jnp.bfloat16)
    assert not cudnn_supports(long_q, seg)  # the [B, 1, T, T] mask would be too large


def test_choice_falls_back_or_fails_clearly_off_gpu():
    cfg = load_config(REPO / "configs" / "k3-tiny.json")
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k = (jax.random.normal(kk, (1, 16, 2, 8), jnp.bfloat16) for kk in ks[:2])
    v = jax.random.normal(ks[2], (1, 16, 2, 4), jnp.bfloat16)
    if flash_attention.cudnn_attention_available():
        pytest.skip("this host has a cuDNN-capable GPU")
    out = causal_attention(cfg, q, k, v, 0.3, None)  # auto -> the blocked XLA path here
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(blocked_causal_attention(q, k, v, 0.3, None), np.float32))
    with pytest.raises(ValueError, match="mla.attention: implementation='cudnn' cannot run this call: needs"):
        causal_attention(cfg.replace(mla_attention_implementation="cudnn"), q, k, v, 0.3, None)
    with pytest.raises(ConfigError, match="mla_attention_implementation"):
        load_config(REPO / "configs" / "k3-tiny.json", mla_attention_implementation="flash")


@pytest.mark.gpu
@pytest.mark.parametrize("segments", ["none", "one", "three"])
def test_cudnn_matches_blocked_forward_and_grads(segments: str):
    b, t, h, dqk, dv = 2, 256, 4, 192, 128
    ks = jax.random.split(jax.random.PRNGKey(1), 4)
    q = jax.random.normal(ks[0], (b, t, h, dqk), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, t, h, dqk), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, h, dv), jnp.bfloat16)
    do = jax.random.normal(ks[3], (b, t, h, dv), jnp.float32)
    seg = {"none": None, "one": jnp.ones((b, t), jnp.int32),
           "three": jnp.asarray(np.repeat([[1, 2, 3]], b, 0).repeat([40, 100, 116], axis=1), jnp.int32)}[segments]
    scale = dqk ** -0.5

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * do)

    ref = lambda q, k, v: blocked_causal_attention(q, k, v, scale, seg)
    new = lambda q, k, v: cudnn_causal_attention(q, k, v, scale, seg)
    o_ref, o_new = jax.jit(ref)(q, k, v), jax.jit(new)(q, k, v)
    np.testing.assert_allclose(np.asarray(o_new, np.float32), np.asarray(o_ref, np.float32), atol=3e-2, rtol=3e-2)
    g_ref = jax.jit(jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2)))(q, k, v)
    g_new = jax.jit(jax.grad(lambda *a: loss(new, *a), argnums=(0, 1, 2)))(q, k, v)
    for name, a, r in zip("qkv", g_new, g_ref, strict=True):
        a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
        rel = np.linalg.norm(a - r) / np.linalg.norm(r)
        assert rel < 2e-2, (name, rel)
