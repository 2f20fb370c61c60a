"""Parity of the vision tower, projector and media merge with the K3 release's PyTorch code (golden file).

``tests/fixtures/vision_golden.npz`` is made by ``tests/fixtures/make_vision_golden.py`` (its docstring says
how and from which files): a small vision config of our own, two images of different sizes and a 2-frame video
packed together, fp32, CPU. Tolerance: max abs error <= 1e-4 x the largest magnitude.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.convert.vision import vision_params_from_hf, vision_params_to_hf
from k3_jax.vision.config import VisionConfig
from k3_jax.vision.plan import build_plan
from k3_jax.vision.tower import MoonViT3d, PatchMergerMLPV2
from tests._model_fixtures import bf16_bits_to_f32, load_golden, tiny_config


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    return load_golden("vision_golden.npz", "make_vision_golden.py")


def golden_vision_config(g: dict[str, np.ndarray]) -> VisionConfig:
    c = {k[len("config/"):]: g[k] for k in g if k.startswith("config/")}
    return VisionConfig(
        patch_size=int(c["patch_size"]), init_pos_emb_height=int(c["init_pos_emb_height"]),
        init_pos_emb_width=int(c["init_pos_emb_width"]), init_pos_emb_time=int(c["init_pos_emb_time"]),
        vt_hidden_size=int(c["vt_hidden_size"]), vt_intermediate_size=int(c["vt_intermediate_size"]),
        vt_num_attention_heads=int(c["vt_num_attention_heads"]), vt_num_hidden_layers=int(c["vt_num_hidden_layers"]),
        qkv_hidden_size=int(c["qkv_hidden_size"]), merge_kernel_size=tuple(int(k) for k in c["merge_kernel_size"]),
        mm_hidden_size=int(c["vt_hidden_size"]), text_hidden_size=int(c["text_hidden_size"]),
        projector_ln_eps=float(c["projector_ln_eps"]))


def golden_params(g: dict[str, np.ndarray], v: VisionConfig) -> dict:
    return vision_params_from_hf(lambda name: bf16_bits_to_f32(g[f"w/{name}"]), v)


def golden_pixels(g: dict[str, np.ndarray]) -> np.ndarray:
    rows = int(g["tower/patch_rows"][0])
    return np.concatenate([g["proc/release/pixel_values"][:rows], g["video/pixel_values"]])


class _TowerAndProjector(nn.Module):
    cfg: object

    @nn.compact
    def __call__(self, pixel_values, plan):
        merged = MoonViT3d(self.cfg, name="vision_tower")(pixel_values, plan)
        return merged, PatchMergerMLPV2(self.cfg, name="mm_projector")(merged)


def assert_close(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != {ref.shape}"
    err = float(np.max(np.abs(ours - ref)))
    tol = 1e-4 * float(np.max(np.abs(ref)))
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


def test_tower_and_projector_match_release(golden):
    v = golden_vision_config(golden)
    cfg = tiny_config(vision=v)
    params = golden_params(golden, v)
    plan = build_plan(golden["tower/grid_thws"], v)
    merged, enc = jax.jit(_TowerAndProjector(cfg).apply)({"params": params}, golden_pixels(golden), plan.arrays())
    assert_close(np.asarray(merged), golden["tower/merged"], "tower (merged tokens)")
    assert_close(np.asarray(enc), golden["tower/encode_media"], "encode_media")
    assert (np.argmax(np.asarray(enc), -1) == np.argmax(golden["tower/encode_media"], -1)).all()


def test_vision_weights_round_trip(golden):
    v = golden_vision_config(golden)
    params = golden_params(golden, v)
    back = dict(vision_params_to_hf(params, v))
    assert len(back) == sum(k.startswith("w/") for k in golden)
    for name, x in back.items():
        np.testing.assert_array_equal(x, bf16_bits_to_f32(golden[f"w/{name}"]), err_msg=name)


def test_padded_plan_keeps_real_rows(golden):
    """Bucketed shapes: padding patches / tokens (a plan for a fixed compiled size) leaves the real rows alone."""
    v = golden_vision_config(golden)
    cfg = tiny_config(vision=v)
    params = golden_params(golden, v)
    pixels = golden_pixels(golden)
    plan = build_plan(golden["tower/grid_thws"], v, pad_patches_to=160, pad_tokens_to=32)
    padded = np.concatenate([pixels, np.ones((160 - pixels.shape[0], *pixels.shape[1:]), np.float32)])
    _, enc = jax.jit(_TowerAndProjector(cfg).apply)({"params": params}, padded, plan.arrays())
    enc = np.asarray(enc)
    assert_close(enc[: plan.num_tokens], golden["tower/encode_media"], "encode_media (padded plan)")
    assert not np.any(enc[plan.num_tokens:])


def test_windowed_attention_is_block_diagonal():
    from k3_jax.vision.attention import attention_choice, attention_windows, packed_attention

    rng = np.random.default_rng(0)
    seg_np = np.repeat([0, 1, 2, 3, -1], [7, 150, 9, 30, 4]).astype(np.int32)  # 200 rows, padding last
    n = seg_np.shape[0]
    q, k, v = (jnp.asarray(rng.standard_normal((n, 2, 8)), jnp.float32) for _ in range(3))
    seg = jnp.asarray(seg_np)
    same = seg_np[:, None] == seg_np[None, :]  # dense reference
    s = np.einsum("qhd,khd->hqk", np.asarray(q), np.asarray(k)) / np.sqrt(8.0)
    s = np.where(same[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), np.asarray(v))
    for block in (16, 64, 256):
        kv_start, bq, w = attention_windows(seg_np, block, align=8)
        assert w < n or block == 256  # small blocks: windows narrower than the sequence
        out = packed_attention(q, k, v, seg, jnp.asarray(kv_start), jnp.arange(bq), jnp.arange(w), "xla")
        real = seg_np >= 0  # padding rows (segment -1) are don't-care
        np.testing.assert_allclose(np.asarray(out)[real], ref[real], atol=2e-6, err_msg=f"block {block}")
    assert attention_choice("auto", jnp.float32, n, w)[0] == "xla"  # fp32 / CPU: the reference, with a reason
    with pytest.raises(ValueError, match="cannot run"):
        attention_choice("cudnn", jnp.float32, n, w)
