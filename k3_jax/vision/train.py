"""Image-text training: packed batches with media, the loss over text targets only, gradients into the tower.

A batch (:func:`image_text_batch`) is the text batch of :mod:`k3_jax.training.step` plus the media::

    {"tokens": [B, T+1] i32, "segment_ids": [B, T+1] i32,       # prompts with <|media_pad|> expanded
     "pixel_values": [Np, 3, P, P] f32, "media": {plan arrays}}  # packed media of the whole batch, in order

Media tokens are never targets (their positions are masked out of the loss, as the release's labels do with
``ignore_index`` at image positions); text after an image is. Patch and token counts are padded to buckets
(:func:`k3_jax.vision.plan.bucket`) so varied batches reuse a few compiled shapes.

:func:`make_multimodal_loss_fn` has the signature of :func:`k3_jax.training.step.make_loss_fn`'s result and plugs
into a train step the same way; gradient accumulation over micro-batches is not supported with media (the media
of a batch are packed across its rows), so use ``accum=1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from k3_jax.training.data import loss_mask
from k3_jax.training.loss import chunked_cross_entropy
from k3_jax.training.step import StepConfig, router_scores
from k3_jax.vision.config import VisionConfig
from k3_jax.vision.plan import bucket, build_plan
from k3_jax.vision.processor import ProcessedMedia, expand_media_pads


def media_loss_mask(tokens: Any, segment_ids: Any, pad_id: int | None, media_pad_id: int) -> Any:
    """:func:`~k3_jax.training.data.loss_mask` without the targets that are media placeholders (np or jnp)."""
    return loss_mask(segment_ids, tokens, pad_id) & (tokens[:, 1:] != media_pad_id)


def image_text_batch(rows: Sequence[Sequence[int]], media: ProcessedMedia, vcfg: VisionConfig, media_pad_id: int,
                     seq_len: int, *, pad_id: int = 0, pad_patches_to: int | None = None,
                     pad_tokens_to: int | None = None) -> dict[str, Any]:
    """Build a batch from token rows holding one ``<|media_pad|>`` per item (items in row-major order across the
    rows, matching ``media``). Each row is expanded, right-padded with ``pad_id`` to ``seq_len + 1`` (segment 0
    = padding) and is one document (segment 1). Raises if a row does not fit."""
    counts = list(media.num_tokens)
    tokens = np.full((len(rows), seq_len + 1), pad_id, np.int32)
    seg = np.zeros_like(tokens)
    used = 0
    for i, r in enumerate(rows):
        n_items = int(np.sum(np.asarray(r) == media_pad_id))
        ids = expand_media_pads(np.asarray(r), counts[used:used + n_items], media_pad_id)
        used += n_items
        if ids.shape[0] > seq_len + 1:
            raise ValueError(f"row {i}: {ids.shape[0]} tokens after expanding its media, seq_len + 1 = {seq_len + 1}")
        if ids.shape[0] == seq_len + 1 and ids[-1] == media_pad_id:
            raise ValueError(f"row {i} ends with a media token in its last (target-only) slot; end rows with text")
        tokens[i, : ids.shape[0]] = ids
        seg[i, : ids.shape[0]] = 1
    if used != len(counts):
        raise ValueError(f"rows hold {used} <|media_pad|> tokens for {len(counts)} media items")
    n_patches, n_tokens = media.pixel_values.shape[0], sum(counts)
    plan = build_plan(media.grid_thws, vcfg, pad_patches_to=pad_patches_to or bucket(n_patches),
                      pad_tokens_to=pad_tokens_to or bucket(n_tokens, 64))
    n_pad = plan.segment_ids.shape[0]
    pixels = np.zeros((n_pad, *media.pixel_values.shape[1:]), np.float32)
    pixels[:n_patches] = media.pixel_values
    return {"tokens": tokens, "segment_ids": seg, "pixel_values": pixels, "media": plan.arrays()}


def make_multimodal_loss_fn(model: Any, step_cfg: StepConfig) -> Callable:
    """``loss_fn(params, batch) -> (loss_sum, (num_tokens, num_correct, scores_by_layer))`` for
    :class:`~k3_jax.multimodal.K3ForConditionalGeneration` on :func:`image_text_batch` batches."""
    media_pad_id = model.cfg.media_placeholder_token_id

    def loss_fn(params, batch):
        tokens, seg = batch["tokens"], batch["segment_ids"]
        inputs, seg_in, targets = tokens[:, :-1], seg[:, :-1], tokens[:, 1:]
        mask = media_loss_mask(tokens, seg, step_cfg.pad_id, media_pad_id)
        hidden, state = model.apply({"params": params}, inputs, batch["pixel_values"], segment_ids=seg_in,
                                    plan=batch["media"], return_hidden=True, mutable=["intermediates"])
        loss_sum, n, correct = chunked_cross_entropy(hidden, params["lm_head"]["kernel"], targets, mask,
                                                     chunk_size=step_cfg.loss_chunk)
        return loss_sum, (n, correct, router_scores(state))

    return loss_fn


def loss_and_grads(model: Any, step_cfg: StepConfig) -> Callable:
    """``f(params, batch) -> ((loss_sum, aux), grads)`` jitted (for tests and simple loops)."""
    return jax.jit(jax.value_and_grad(make_multimodal_loss_fn(model, step_cfg), has_aux=True))
