"""Images through training: the bundled image-text example (procedural shapes + captions) trains tower, projector
and text model end to end through the Trainer that ``train.py`` runs (tiny multimodal config, its text model cut to
one MLA layer to keep the compile cheap)."""

from __future__ import annotations

import dataclasses

import numpy as np

from k3_jax.config import load_config
from k3_jax.tokenizer import Tokenizer
from k3_jax.training.loop import TrainConfig, Trainer
from k3_jax.vision.shapes_data import ShapesCaptions
from tests._model_fixtures import REPO

CONFIG = str(REPO / "configs" / "k3-tiny-vision.json")
MICRO_TEXT = {"hidden_size": 64, "num_hidden_layers": 1, "kda_layers": (), "mla_layers": (0,),
              "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
              "qk_rope_head_dim": 8, "v_head_dim": 16, "intermediate_size": 128, "num_experts": 0,
              "attn_res_block_size": 1, "dtype": "float32"}


def test_shapes_batches_are_deterministic_and_mask_media():
    cfg = load_config(CONFIG)
    a = ShapesCaptions(Tokenizer.bundled(media=True), cfg, seq_len=40, batch_size=3, seed=1)
    first, second = next(a), next(a)
    b = ShapesCaptions(Tokenizer.bundled(media=True), cfg, seq_len=40, batch_size=3, seed=1)
    b.set_state({"rows": {"0": {"index": 1}}})
    np.testing.assert_array_equal(next(b)["pixel_values"], second["pixel_values"])
    assert not np.array_equal(first["pixel_values"], second["pixel_values"])
    assert (first["tokens"] == cfg.media_placeholder_token_id).sum(axis=1).tolist() == [4, 4, 4]  # 56x56: 2x2 tokens


def test_train_py_trains_on_images(tmp_path):
    base = load_config(CONFIG)
    vision = dataclasses.replace(base.vision, text_hidden_size=MICRO_TEXT["hidden_size"], vt_num_hidden_layers=1)
    tc = TrainConfig(config=CONFIG, model_overrides={**MICRO_TEXT, "vision": vision}, workdir=str(tmp_path),
                     steps=5, seq_len=48, batch_size=2, eval_every=0, log_every=100, tensorboard=False,
                     async_checkpoint=False, mesh="none", optimizer="adamw", lr=3e-3, warmup_frac=0.0)
    trainer = Trainer(tc)
    before = np.asarray(trainer.init_state()["params"]["vision_tower"]["patch_embed"]["proj"]["kernel"])
    out = trainer.run()
    losses = [out["losses"][s] for s in sorted(out["losses"])]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.1, losses
    after = np.asarray(out["state"]["params"]["vision_tower"]["patch_embed"]["proj"]["kernel"])
    assert np.max(np.abs(after - before)) > 1e-3  # the tower is trained (not frozen / not cut from the graph)
