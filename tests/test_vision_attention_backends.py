"""The vision tower's attention registry: the Pallas TPU flash attention (segment ids = media items) equals the XLA
reference, outputs and gradients (interpret mode on CPU), the tower AOT-compiles for v5p with the Mosaic kernel in
its HLO, and explicit choices that cannot run raise with the reason."""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.errors import ConfigError
from k3_jax.vision.attention import VISION_ATTENTION, attention_choice, attention_windows, packed_attention
from k3_jax.vision.config import ATTENTION_CHOICES, VisionConfig
from pallas_kernels.registry import KernelUnavailable, platform_scope


def test_choices_are_visible_and_impossible_ones_raise():
    assert ATTENTION_CHOICES == VISION_ATTENTION.choices
    assert attention_choice("auto", jnp.float32, 256, 256, 32, platform="cpu")[0] == "xla"
    assert attention_choice("auto", jnp.bfloat16, 256, 256, 128, platform="tpu")[0] == "mosaic_tpu"
    with pytest.raises(KernelUnavailable, match="mosaic_tpu.*needs target platform tpu"):
        attention_choice("mosaic_tpu", jnp.float32, 256, 256, 32, platform="cpu")
    with pytest.raises(KernelUnavailable, match="head dim"):
        attention_choice("mosaic_tpu", jnp.bfloat16, 256, 256, 192, platform="tpu")
    with pytest.raises(ConfigError, match="vision_config.attention"):
        VisionConfig(attention="splash")


def test_mosaic_flash_matches_xla_in_interpret_mode():
    import jax.experimental.pallas.tpu as pltpu

    rng = np.random.default_rng(0)
    seg_np = np.repeat([0, 1, 2, -1], [7, 150, 39, 4]).astype(np.int32)  # 200 rows: 3 items + padding
    n = seg_np.shape[0]
    q, k, v = (jnp.asarray(rng.standard_normal((n, 2, 32)), jnp.float32) for _ in range(3))
    kv_start, bq, w = attention_windows(seg_np, 64, align=8)
    args = (q, k, v, jnp.asarray(seg_np), jnp.asarray(kv_start), jnp.arange(bq), jnp.arange(w))
    ref = np.asarray(packed_attention(*args, "xla"))
    with platform_scope("tpu"), pltpu.force_tpu_interpret_mode():
        out = np.asarray(packed_attention(*args, "mosaic_tpu"))
    real = seg_np >= 0
    np.testing.assert_allclose(out[real], ref[real], atol=2e-5)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (extra 'aot')")
def test_tower_compiles_for_v5p_with_the_mosaic_kernel():
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from k3_jax.vision.plan import build_plan
    from k3_jax.vision.tower import MediaEncoder
    from tests._model_fixtures import tiny_config

    try:
        dev = topologies.get_topology_desc("v5p:2x2x1", platform="tpu").devices[0]
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"libtpu cannot describe v5p: {type(exc).__name__}: {exc}")
    v = VisionConfig(init_pos_emb_height=8, init_pos_emb_width=8, vt_hidden_size=256, vt_intermediate_size=512,
                     vt_num_attention_heads=2, vt_num_hidden_layers=1, qkv_hidden_size=256, mm_hidden_size=256,
                     text_hidden_size=256, attention="mosaic_tpu")
    cfg = tiny_config(vision=v, dtype="bfloat16", platform="tpu")  # the target, as for any AOT compile
    plan = build_plan(np.array([[1, 8, 12], [2, 4, 4]]), v)
    model = MediaEncoder(cfg)
    s = SingleDeviceSharding(dev)
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    px = jax.ShapeDtypeStruct((plan.num_patches, 3, 14, 14), jnp.bfloat16, sharding=s)
    arrays = jax.tree.map(spec, plan.arrays())
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), px, plan.arrays())
    params = jax.tree.map(spec, params)
    compiled = jax.jit(model.apply).lower(params, px, arrays).compile()
    hlo = compiled.as_text()
    assert "tpu_custom_call" in hlo, "the Mosaic flash-attention kernel is not in the compiled tower"


def test_mosaic_flash_gradient_matches_xla_in_interpret_mode():
    """Training through the tower: the Pallas kernel's own backward (its custom VJP) gives XLA's gradients."""
    import jax.experimental.pallas.tpu as pltpu

    rng = np.random.default_rng(1)
    seg_np = np.repeat([0, 1, -1], [40, 80, 8]).astype(np.int32)  # 128 rows: 2 items + padding
    n = seg_np.shape[0]
    q, k, v = (jnp.asarray(rng.standard_normal((n, 2, 32)), jnp.float32) for _ in range(3))
    cot = jnp.asarray(rng.standard_normal((n, 2, 32)) * (seg_np >= 0)[:, None, None], jnp.float32)  # real rows
    kv_start, bq, w = attention_windows(seg_np, 64, align=8)
    rest = (jnp.asarray(seg_np), jnp.asarray(kv_start), jnp.arange(bq), jnp.arange(w))

    def grads(impl):
        loss = lambda q, k, v: jnp.sum(packed_attention(q, k, v, *rest, impl) * cot)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    ref = grads("xla")
    with platform_scope("tpu"), pltpu.force_tpu_interpret_mode():
        out = grads("mosaic_tpu")
    for name, a, b in zip("qkv", out, ref, strict=True):
        scale = float(jnp.max(jnp.abs(b)))
        assert scale > 0, f"d{name} is zero"
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * max(scale, 1.0), err_msg=f"d{name}")
