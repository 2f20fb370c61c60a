"""K3ForConditionalGeneration (text + vision): media splice vs the release's merge, the call forms, parameter
trees and counts (the release tower ~401M + projector ~46M, analytic and from eval_shape)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.config import load_config
from k3_jax.convert.vision import vision_param_shapes
from k3_jax.model import K3ForCausalLM, K3ForConditionalGeneration
from k3_jax.multimodal import splice_media
from k3_jax.vision.config import VisionConfig, count_vision_params, vision_config_from_dict
from k3_jax.vision.plan import build_plan
from k3_jax.vision.processor import expand_media_pads
from k3_jax.vision.tower import MediaEncoder
from tests._model_fixtures import REPO, tiny_config
from tests.test_vision_golden import golden  # noqa: F401  (module-scoped fixture)

SHARED = Path(os.environ.get("K3_SHARED", REPO.parent / "shared"))
PAD = 7  # the tiny config's media placeholder id (any id of the bundled 1024-token vocabulary)
SMALL_VISION = VisionConfig(init_pos_emb_height=6, init_pos_emb_width=6, vt_hidden_size=32, vt_intermediate_size=64,
                            vt_num_attention_heads=2, vt_num_hidden_layers=2, qkv_hidden_size=32, mm_hidden_size=32,
                            text_hidden_size=64)
MICRO = {  # a 1-layer micro K3 text model (MLA, dense FFN: KDA's and the MoE's backward are compile-heavy, and
    # are tested elsewhere; here the media path is under test)
    "hidden_size": 64, "num_hidden_layers": 1, "kda_layers": (), "mla_layers": (0,),
    "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "kda_num_heads": 2, "kda_head_dim": 16,
    "intermediate_size": 128, "num_experts": 0, "attn_res_block_size": 1, "kda_chunk_size": 16,
}


def _shapes(tree):
    return jax.tree_util.tree_map(lambda x: tuple(x.shape), tree)


def test_splice_matches_release_merge(golden):  # noqa: F811
    """The release grows the prompt inside forward; we expand the ids first and splice: same embeddings."""
    ids, text = golden["merge/input_ids"][0], golden["merge/inputs_embeds"][0]
    pad = 163605
    counts = [(h // 2) * (w // 2) for _, h, w in golden["tower/grid_thws"]]
    expanded = expand_media_pads(ids, counts, pad)
    embeds = np.zeros((1, len(expanded), text.shape[1]), np.float32)  # media rows: any value, replaced
    embeds[0, expanded != pad] = text[ids != pad]
    out = splice_media(jnp.asarray(embeds), jnp.asarray(expanded == pad)[None], golden["tower/encode_media"])
    np.testing.assert_array_equal(np.asarray(out), golden["merge/embeds"])


@pytest.fixture(scope="module")
def mm():
    cfg = tiny_config(**MICRO, vision=SMALL_VISION, media_placeholder_token_id=PAD)
    model = K3ForConditionalGeneration(cfg)
    # parameters from the init's shapes (no init compile): norms / AttnRes weights 1, everything else N(0, 0.05)
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    rng = np.random.default_rng(0)

    def fill(path, s):
        names = [getattr(k, "key", "") for k in path]
        if names[-1] == "weight" and "pos_emb" not in names:
            return jnp.ones(s.shape, s.dtype)
        return jnp.asarray(0.05 * rng.standard_normal(s.shape), s.dtype)

    params = jax.tree_util.tree_map_with_path(fill, shapes)
    grid = np.array([[1, 2, 4], [2, 4, 2]])  # an image and a 2-frame video
    plan = build_plan(grid, SMALL_VISION)
    px = jax.random.normal(jax.random.PRNGKey(3), (plan.num_patches, 3, 14, 14))
    return cfg, model, params, grid, plan, px


def test_init_tree_matches_converter_table(mm):
    cfg, model, params, grid, plan, px = mm
    assert set(params) == {"model", "lm_head", "vision_tower", "mm_projector"}  # a text-only init creates the tower
    table = vision_param_shapes(SMALL_VISION)
    assert {k: _shapes(params[k]) for k in table} == table
    text = jax.eval_shape(K3ForCausalLM(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    assert _shapes(nn.unbox(text)["params"]) == {k: _shapes(params[k]) for k in ("model", "lm_head")}


def test_release_form_ids_are_expanded(mm):
    cfg, model, params, grid, plan, px = mm
    counts = plan.tokens_per_item  # (2, 2)
    release_ids = np.array([[1, 40, 41, PAD, 42, 43, PAD, 44, 45]])  # one pad per item, as the release takes
    bound = model.bind({"params": params})
    expanded = np.asarray(bound._maybe_expand(release_ids, counts, None))
    assert expanded.tolist() == [expand_media_pads(release_ids[0], counts, PAD).tolist()]
    assert bound._maybe_expand(expanded, counts, None) is expanded  # already expanded: unchanged
    enc = model.apply({"params": params}, px, grid, method="encode_media")
    assert enc.shape == (sum(counts), cfg.hidden_size)


def test_bad_media_calls(mm):
    cfg, model, params, grid, plan, px = mm
    with pytest.raises(ValueError, match="expected one per media item"):
        model.apply({"params": params}, np.array([[1, PAD, 2]]), px, grid)
    with pytest.raises(ValueError, match="needs a config with a vision_config"):
        K3ForConditionalGeneration(tiny_config()).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))


def test_release_vision_param_count():
    v = VisionConfig()  # the defaults are the release's vision_config
    counts = count_vision_params(v)
    assert counts == {"tower": 401_214_464, "projector": 46_144_512, "total": 447_358_976}
    cfg = tiny_config(vision=v)
    plan = build_plan(np.array([[1, 2, 2]]), v)
    shapes = jax.eval_shape(MediaEncoder(cfg).init, jax.random.PRNGKey(0),
                            jnp.zeros((4, 3, 14, 14)), plan.arrays())["params"]
    sizes = {k: sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nn.unbox(shapes[k])))
             for k in ("vision_tower", "mm_projector")}
    assert sizes == {"vision_tower": counts["tower"], "mm_projector": counts["projector"]}
    # sharding: the tower's width FSDP-sharded in training, nothing on expert / tensor; replicated for serving
    from sharding.rules import logical_to_pspec

    names = jax.tree_util.tree_leaves(nn.get_partition_spec(shapes), is_leaf=lambda x: isinstance(x, tuple))
    leaves = jax.tree_util.tree_leaves(nn.unbox(shapes))
    mesh = {"data": 1, "fsdp": 4, "expert": 2, "tensor": 2}
    train = [logical_to_pspec(n, "train", mesh, x.shape) for n, x in zip(names, leaves, strict=True)]
    serve = [logical_to_pspec(n, "serve", mesh, x.shape) for n, x in zip(names, leaves, strict=True)]
    assert all(a in (None, "fsdp") for spec in train for a in spec)
    assert sum("fsdp" in tuple(spec) for spec in train) >= 8  # every kernel / norm of the tower
    assert all(all(a is None for a in spec) for spec in serve)
    ref = SHARED / "reference" / "config.json"
    if not ref.exists():
        pytest.skip(f"release config not found at {ref} (shared/ absent); defaults checked only")
    assert vision_config_from_dict(json.loads(ref.read_text())["vision_config"]) == v
    assert load_config(ref).vision == v


def test_image_text_training_step_grads(mm):
    """Packed image-text batch: loss over text targets only, finite gradients reach the tower and projector."""
    from k3_jax.training.step import StepConfig
    from k3_jax.vision.processor import ProcessedMedia
    from k3_jax.vision.train import image_text_batch, loss_and_grads

    cfg, model, params, grid, plan, px = mm
    media = ProcessedMedia(np.asarray(px), grid, plan.tokens_per_item, ("", ""))
    rows = [[1, 40, 41, PAD, 42, 43], [1, 50, PAD, 51, 52, 53, 54]]
    batch = image_text_batch(rows, media, SMALL_VISION, PAD, seq_len=12)
    assert batch["pixel_values"].shape[0] == 256 and batch["media"]["merge_index"].shape[0] == 64  # buckets
    step = loss_and_grads(model, StepConfig())
    (loss_sum, (n, _, _)), grads = step(params, batch)
    tokens = batch["tokens"]
    text_targets = int(np.sum((batch["segment_ids"][:, 1:] > 0) & (tokens[:, 1:] != PAD) & (tokens[:, 1:] != 0)))
    assert int(n) == text_targets and np.isfinite(float(loss_sum))  # media positions are never targets
    for part in ("vision_tower", "mm_projector", "model"):
        norm = float(sum(jnp.sum(jnp.square(g)) for g in jax.tree_util.tree_leaves(grads[part])))
        assert np.isfinite(norm) and norm > 0, part
    swapped = dict(batch, pixel_values=batch["pixel_values"][::-1].copy())
    (other, _), _ = step(params, swapped)  # same compiled step: the pixels reach the loss
    assert abs(float(other) - float(loss_sum)) > 1e-6
    with pytest.raises(ValueError, match="media items"):
        image_text_batch([[1, PAD, 2]], media, SMALL_VISION, PAD, seq_len=12)
