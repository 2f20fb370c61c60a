"""Multimodal logits parity with the K3 release's PyTorch ``KimiK3ForConditionalGeneration`` (golden file).

``tests/fixtures/mm_golden.npz`` is made by ``tests/fixtures/make_mm_golden.py`` (its docstring says how, from
which files, and what stands in for fla's Triton ops): a tiny text model (KDA + gated MLA, LatentMoE, AttnRes) and a
small vision config of our own, two images of different sizes and a 2-frame video packed together, fp32, CPU.
The checkpoint is rebuilt from the stored tensors in the release's layout and read by ``load_checkpoint``.
Tolerance: max abs error <= 1e-4 x the largest magnitude, argmax identical.
"""

from __future__ import annotations

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from PIL import Image

from k3_jax.config import config_from_dict
from k3_jax.convert import names as N
from k3_jax.convert.hf import checkpoint_format, expected_tensors, load_checkpoint
from k3_jax.convert.safetensors_io import write_safetensors
from k3_jax.convert.vision import vision_tensor_specs
from k3_jax.model import K3ForConditionalGeneration
from k3_jax.vision.plan import build_plan
from k3_jax.vision.processor import MediaProcConfig, MediaProcessor
from tests._model_fixtures import bf16_bits_to_f32, load_golden


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    return load_golden("mm_golden.npz", "make_mm_golden.py")


def _checkpoint_tensors(g: dict[str, np.ndarray], raw: dict) -> dict[str, np.ndarray]:
    """The golden's weights as the release checkpoint stores them: table dtypes, ``A_log`` zero-padded."""
    cfg = config_from_dict(raw)
    specs = {name: (res.rule.dtype, N.hf_shape(res.rule, N.dims(cfg)))
             for name, res in expected_tensors(cfg, checkpoint_format(raw)).items()}
    specs.update(vision_tensor_specs(cfg.vision))
    stored = {k[2:] for k in g if k.startswith("w/")}
    assert stored == set(specs), (f"release parameters not in the table: {sorted(stored - set(specs))[:5]}; "
                                  f"table names the release lacks: {sorted(set(specs) - stored)[:5]}")
    out = {}
    for name, (dtype, shape) in specs.items():
        x = bf16_bits_to_f32(g[f"w/{name}"])
        if x.shape != shape:  # A_log: the release module holds [H], the checkpoint [ceil(H / 128) * 128]
            assert name.endswith("A_log") and x.shape[0] < shape[0], (name, x.shape, shape)
            x = np.concatenate([x, np.zeros(shape[0] - x.shape[0], np.float32)])
        out[name] = x.astype(ml_dtypes.bfloat16) if dtype == "BF16" else x.astype(np.float32)
    return out


@pytest.fixture(scope="module")
def loaded(golden, tmp_path_factory):
    raw = json.loads(str(golden["config_json"]))
    ckpt = tmp_path_factory.mktemp("mm_golden_ckpt")
    (ckpt / "config.json").write_text(json.dumps(raw))
    write_safetensors(ckpt / "model.safetensors", _checkpoint_tensors(golden, raw))
    cfg, params = load_checkpoint(ckpt, dtype="float32")
    params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
    return cfg, params


def _assert_close(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != {ref.shape}"
    err = float(np.max(np.abs(ours - ref)))
    tol = 1e-4 * float(np.max(np.abs(ref)))
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"
    assert (np.argmax(ours, -1) == np.argmax(ref, -1)).all(), f"{what}: argmax differs"


def test_logits_and_media_match_release(golden, loaded):
    cfg, params = loaded
    model = K3ForConditionalGeneration(cfg)
    plan = build_plan(golden["grid_thws"], cfg.vision)
    release_ids = golden["input_ids"]  # the release form: one <|media_pad|> per item
    ids = np.asarray(model.bind({"params": params})._maybe_expand(release_ids, plan.tokens_per_item, None))
    assert ids.shape[1] == release_ids.shape[1] + plan.num_tokens - len(plan.tokens_per_item)

    @jax.jit  # one compile for both outputs (the expanded ids are the jittable form of the same call)
    def run(params, ids, pixel_values, arrays):
        v = {"params": params}
        return (model.apply(v, pixel_values, plan=arrays, method="encode_media"),
                model.apply(v, ids, pixel_values, plan=arrays))

    enc, logits = run(params, ids, golden["pixel_values"], plan.arrays())
    _assert_close(np.asarray(enc), golden["encode_media"], "encode_media")
    _assert_close(np.asarray(logits), golden["logits"], "multimodal logits")


def test_processor_matches_release_inputs(golden):
    """Our processor, on the golden's source images and video frames, gives the release's tower input."""
    raw = {k[len("proc/"):]: golden[k] for k in golden if k.startswith("proc/")}
    fixed = int(raw["fixed_output_tokens"])
    pcfg = MediaProcConfig(patch_size=int(raw["patch_size"]), merge_kernel_size=int(raw["merge_kernel_size"]),
                           in_patch_limit=int(raw["in_patch_limit"]),
                           patch_limit_on_one_side=int(raw["patch_limit_on_one_side"]),
                           fixed_output_tokens=None if fixed < 0 else fixed,
                           image_mean=tuple(float(x) for x in raw["image_mean"]),
                           image_std=tuple(float(x) for x in raw["image_std"]))
    images = [Image.fromarray(golden[f"image_{i}"], str(golden[f"image_{i}_mode"])) for i in range(2)]
    out = MediaProcessor(pcfg)([*images, {"type": "video", "frames": [golden["frame_0"], golden["frame_1"]]}])
    np.testing.assert_array_equal(out.grid_thws, golden["grid_thws"])
    np.testing.assert_array_equal(out.pixel_values, golden["pixel_values"])
