"""Fixture writer: a random k3-jax model saved in the exact released checkpoint format.

``write_fixture(out_dir, config="k3-tiny", experts="mxfp4")`` builds a random ``K3ForCausalLM`` parameter tree
(every parameter in its checkpoint dtype (bf16, or fp32 for the six fp32 kinds), optionally
quantizes the routed experts to MXFP4 (compressed-tensors scale rule) and exports with
:func:`k3_jax.convert.save_checkpoint`: sharded ``model-XXXXX-of-XXXXXX.safetensors`` + index +
``config.json`` (with the published ``quantization_config`` block for MXFP4). Returns the params written,
so a test can compare the loaded model against the one that wrote it.
"""

from __future__ import annotations

import os
from typing import Any

import ml_dtypes
import numpy as np

from k3_jax.config import K3Config, config_path, load_config
from k3_jax.convert import names as N
from k3_jax.convert.hf import save_checkpoint
from k3_jax.convert.outdir import check_output
from k3_jax.convert.transforms import pack_mxfp4_np
from k3_jax.vision.config import VisionConfig

FP32_PARAMS = {r.param for r in N.TEXT_RULES if r.dtype == "F32"}


def _checkpoint_dtype(path: tuple[str, ...]) -> np.dtype:
    for p in FP32_PARAMS:
        if path[-len(p) :] == p:
            return np.dtype(np.float32)
    return np.dtype(ml_dtypes.bfloat16)


def random_params(cfg: K3Config, seed: int = 0, experts: str = "bf16") -> dict[str, Any]:
    """Random params of ``K3ForCausalLM(cfg)`` in checkpoint dtypes (numpy), experts bf16 or MXFP4-packed.

    Built from the name table (numpy only, no model trace — fast on a loaded CPU); the tree equals the
    model's ``init`` tree (``tests/test_convert.py`` checks it against ``jax.eval_shape``). Init:
    A_log = log U(1, 16); kernels N(0, 1/fan_in); norm gains 1 + noise;
    dt_bias / routing bias small noise (nonzero so transform mistakes cannot hide).
    """
    from k3_jax.convert.hf import layer_slots

    rng = np.random.default_rng(seed)
    sym = N.dims(cfg)
    slots = layer_slots(cfg)
    params: dict[str, Any] = {}

    def value(rule: N.Rule) -> np.ndarray:
        shape = N.flax_shape(rule, sym)
        last = rule.param[-1]
        if last == "A_log":
            x = np.log(rng.uniform(1.0, 16.0, shape))
        elif last in ("dt_bias", "e_score_correction_bias"):
            x = rng.normal(0.0, 0.05, shape)
        elif last == "weight" and "proj" not in rule.param[-2]:
            x = 1.0 + rng.normal(0.0, 0.05, shape)
        elif rule.transform == "conv":
            x = 0.3 * rng.standard_normal(shape, dtype=np.float32)
        else:
            fan_in = shape[-2] if len(shape) >= 2 else shape[-1]
            x = np.float32(fan_in**-0.5) * rng.standard_normal(shape, dtype=np.float32)
        return x.astype(_checkpoint_dtype(rule.param))

    for layer in range(cfg.num_hidden_layers):
        seg, lay, r, reps = slots[layer]
        for rule in N.TEXT_RULES:
            if rule.scope == "top" or not N.rule_applies(rule, cfg, layer, "bf16"):
                continue
            path = ("model", seg, lay, *rule.param)
            v = value(rule)
            node = params
            for k in path[:-1]:
                node = node.setdefault(k, {})
            if path[-1] not in node:
                node[path[-1]] = np.empty((reps, *v.shape), v.dtype)
            node[path[-1]][r] = v
    for rule in N.TEXT_RULES:
        if rule.scope == "top":
            node = params
            for k in rule.param[:-1]:
                node = node.setdefault(k, {})
            node[rule.param[-1]] = value(rule)
    if experts == "mxfp4":
        for seg in params["model"].values():
            if not isinstance(seg, dict):
                continue
            for lay in seg.values():
                if isinstance(lay, dict) and "block_sparse_moe" in lay:
                    ex = lay["block_sparse_moe"]["experts"]
                    for w in ("w1", "w2", "w3"):
                        hf = np.swapaxes(ex[w].astype(np.float32), -1, -2)  # [R, E, in, out] -> [R, E, out, in]
                        p, s = pack_mxfp4_np(hf)
                        ex[w] = {"weight_packed": p, "weight_scale": s}
    return params


def random_vision_params(v: VisionConfig, seed: int = 0) -> dict[str, Any]:
    """Random ``vision_tower`` / ``mm_projector`` params (bf16 numpy) of the tree the name table implies.

    Norm gains 1 + noise, the learned position grid N(0, 1), kernels N(0, 1/fan_in).
    """
    from k3_jax.convert.vision import vision_param_shapes  # noqa: PLC0415

    rng = np.random.default_rng(seed + 1000)

    def fill(path: tuple[str, ...], shape: tuple[int, ...]) -> np.ndarray:
        if path[-1] == "weight" and "pos_emb" not in path:
            x = 1.0 + rng.normal(0.0, 0.05, shape)
        elif "pos_emb" in path:
            x = rng.standard_normal(shape)
        else:
            x = shape[-2] ** -0.5 * rng.standard_normal(shape)
        return x.astype(ml_dtypes.bfloat16)

    def walk(tree: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        return {k: walk(v, (*path, k)) if isinstance(v, dict) else fill((*path, k), v) for k, v in tree.items()}

    return walk(vision_param_shapes(v), ())


def write_fixture(
    out_dir: str | os.PathLike[str],
    config: str | K3Config = "k3-tiny",
    *,
    experts: str = "mxfp4",
    seed: int = 0,
    max_shard_bytes: int = 4 << 20,
    overwrite: bool = False,
    vision: VisionConfig | None = None,
    media_placeholder_token_id: int = 7,
) -> tuple[K3Config, dict[str, Any]]:
    """Write a random checkpoint of ``config`` (name, path or K3Config) and return ``(cfg, params)``.

    ``vision`` adds a vision tower + projector of that config (``text_hidden_size`` must be the text width):
    a multimodal checkpoint in the release's format (``vision_config`` and ``media_placeholder_token_id`` in
    ``config.json``, the ``vision_tower.*`` / ``mm_projector.*`` tensors in the last shard).

    The output path is checked (and stale leftovers swept) before the parameters are drawn.
    """
    check_output(out_dir, overwrite)
    cfg = config if isinstance(config, K3Config) else load_config(config_path(config))
    cfg = cfg.replace(expert_format=experts)
    if vision is not None:
        cfg = cfg.replace(vision=vision, media_placeholder_token_id=media_placeholder_token_id)
    params = random_params(cfg, seed, experts)
    if vision is not None:
        params.update(random_vision_params(vision, seed))
    save_checkpoint(cfg, params, out_dir, experts=experts, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
    return cfg, params
