"""Converter with the vision tower: the released index maps all 168 vision tensors, a multimodal fixture in the
release's format round-trips (load, text-only load, export)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from k3_jax.convert import load_checkpoint, save_checkpoint, verify, write_fixture
from k3_jax.convert.safetensors_io import SafetensorsFile
from k3_jax.convert.vision import expected_vision_names
from k3_jax.vision.config import VisionConfig
from tests._model_fixtures import REPO

SHARED = Path(os.environ.get("K3_SHARED", REPO.parent / "shared"))
VISION = VisionConfig(init_pos_emb_height=6, init_pos_emb_width=6, vt_hidden_size=32, vt_intermediate_size=64,
                      vt_num_attention_heads=2, vt_num_hidden_layers=2, qkv_hidden_size=32, mm_hidden_size=32,
                      text_hidden_size=256)


def test_release_index_maps_every_vision_tensor():
    index = SHARED / "reference" / "model.safetensors.index.json.gz"
    config = SHARED / "reference" / "config.json"
    if not index.exists() or not config.exists():
        pytest.skip(f"released index / config not found under {SHARED / 'reference'} (shared/ absent)")
    assert len(list(expected_vision_names(VisionConfig()))) == 168
    rep = verify(index, config)
    assert rep.ok, rep.errors
    assert (rep.vision, rep.unknown) == (0, 0)
    assert rep.mapped == 497_220 and rep.bytes == rep.declared == 1_560_860_324_864


def _leaves(tree, path=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaves(v, (*path, k))
        else:
            yield (*path, k), v


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("mm") / "ckpt"
    cfg, params = write_fixture(out, "k3-tiny", experts="bf16", vision=VISION)
    return out, cfg, params


def test_multimodal_fixture_round_trip(fixture_dir, tmp_path):
    out, cfg, written = fixture_dir
    raw = json.loads((out / "config.json").read_text())
    assert raw["vision_config"]["vt_hidden_size"] == 32 and raw["media_placeholder_token_id"] == 7
    rep = verify(out)
    assert rep.ok and rep.vision == 0 and rep.unknown == 0, rep.errors
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    vision_names = [n for n, _, _ in expected_vision_names(VISION)]
    assert all(n in index for n in vision_names) and len(vision_names) == 2 + 6 * 2 + 1 + 2 + 1
    with SafetensorsFile(str(out / index[vision_names[0]])) as f:
        assert f.tensors[vision_names[0]].dtype == "BF16" and f.tensors[vision_names[0]].shape == (32, 3, 14, 14)

    lcfg, loaded = load_checkpoint(out)
    assert lcfg.vision == VISION and set(loaded) == {"model", "lm_head", "vision_tower", "mm_projector"}
    for path, v in _leaves({k: written[k] for k in ("vision_tower", "mm_projector")}):
        got = loaded
        for k in path:
            got = got[k]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(v), err_msg="/".join(path))

    tcfg, text = load_checkpoint(out, vision=False)
    assert tcfg.vision is None and set(text) == {"model", "lm_head"}

    back = save_checkpoint(lcfg, loaded, tmp_path / "again")
    assert verify(back).ok
    again = json.loads((Path(back) / "model.safetensors.index.json").read_text())["weight_map"]
    for n in vision_names:
        with SafetensorsFile(str(out / index[n])) as a, SafetensorsFile(str(Path(back) / again[n])) as b:
            np.testing.assert_array_equal(a.get(n), b.get(n), err_msg=n)
    text_only = save_checkpoint(tcfg, text, tmp_path / "text")
    assert "vision_config" not in json.loads((Path(text_only) / "config.json").read_text())
    assert verify(text_only).ok
