"""The tower's cuDNN attention path against the XLA reference (GPU only; skipped elsewhere)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.vision.attention import attention_choice, attention_windows, packed_attention
from k3_jax.vision.config import VisionConfig
from k3_jax.vision.plan import build_plan
from k3_jax.vision.tower import MediaEncoder
from tests._model_fixtures import tiny_config

pytestmark = pytest.mark.gpu


def test_cudnn_attention_matches_xla():
    rng = np.random.default_rng(0)
    seg_np = np.repeat([0, 1, 2, -1], [300, 1500, 200, 48]).astype(np.int32)
    n = seg_np.shape[0]
    q, k, v = (jnp.asarray(rng.standard_normal((n, 12, 128)), jnp.bfloat16) for _ in range(3))
    kv_start, bq, w = attention_windows(seg_np, 512)
    args = (q, k, v, jnp.asarray(seg_np), jnp.asarray(kv_start), jnp.arange(bq), jnp.arange(w))
    assert attention_choice("auto", jnp.bfloat16, n, w)[0] == "cudnn"
    ref = np.asarray(jax.jit(packed_attention, static_argnums=7)(*args, "xla"), np.float32)
    out = np.asarray(jax.jit(packed_attention, static_argnums=7)(*args, "cudnn"), np.float32)
    real = seg_np >= 0
    assert np.max(np.abs(out[real] - ref[real])) <= 2e-2 * np.max(np.abs(ref[real]))


def test_tower_cudnn_matches_xla():
    v = VisionConfig(vt_num_hidden_layers=2, text_hidden_size=256)
    grid = np.array([[1, 32, 48], [1, 64, 64], [2, 16, 16]])
    plan = build_plan(grid, v)
    px = jax.random.normal(jax.random.PRNGKey(0), (plan.num_patches, 3, 14, 14))
    outs = {}
    for impl in ("xla", "cudnn"):
        cfg = tiny_config(dtype="bfloat16", vision=dataclasses.replace(v, attention=impl))
        model = MediaEncoder(cfg)
        params = jax.jit(model.init)(jax.random.PRNGKey(1), px, plan.arrays())
        outs[impl] = np.asarray(jax.jit(model.apply)(params, px, plan.arrays()), np.float32)
    scale = np.max(np.abs(outs["xla"]))
    assert np.max(np.abs(outs["cudnn"] - outs["xla"])) <= 5e-2 * scale
