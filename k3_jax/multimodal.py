"""K3ForConditionalGeneration: the K3 text model with the MoonViT3d tower and projector (the release's top model).

``apply(variables, input_ids [B, T], pixel_values=None, grid_thws=None, segment_ids=None) -> logits [B, T', V]``
takes the release forward's inputs and gives its logits: media are encoded (:mod:`k3_jax.vision.tower`) and
their projected tokens replace the ``<|media_pad|>`` (``cfg.media_placeholder_token_id``) positions of the prompt,
in order (row-major over the batch). Two prompt forms are accepted:

- *expanded*: item ``i``'s pad repeated ``num_tokens[i]`` times (what :func:`k3_jax.vision.processor.expand_media_pads`
  makes); the sequence length is unchanged (``T' = T``) and the call can be jitted;
- *release form*: one pad per item; the release model grows the sequence inside ``forward`` (LLaVA style). Here
  the expansion happens on the host before the model, so it needs concrete ``input_ids`` (not under ``jit``);
  it is chosen when the pad count equals the number of items and differs from the total token count
  (``T' = T + sum(num_tokens) - n_items``). ``segment_ids`` must then be omitted.

As in the release, when media are present the embeddings at ``pad_token_id`` positions are zeroed. Media rows are
consumed from the first: with a decode cache (chunked prefill), pass each chunk the rows of its own
``<|media_pad|>`` positions as ``media_embeds``.
``grid_thws`` must be host data (it decides shapes); ``plan=`` takes a prebuilt :class:`~k3_jax.vision.plan.MediaPlan`
(padded for bucketed compiles) or its ``arrays()`` dict (traced inputs of a jitted step; ids must be expanded), and
``media_embeds=`` precomputed ``encode_media`` output (serving encodes each item once).
``apply(variables, pixel_values, grid_thws, method="encode_media") -> [N_tokens, hidden]``.

Parameter tree: the text model's (``model``, ``lm_head``: exactly :class:`~k3_jax.model.K3ForCausalLM`'s, which
ignores the rest) plus ``vision_tower`` and ``mm_projector`` at the root — the checkpoint's names without the
``language_model.`` prefix, as for the text model. One loaded tree serves both classes.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.config import K3Config
from k3_jax.model import K3ForCausalLM
from k3_jax.vision.plan import MediaPlan, build_plan
from k3_jax.vision.processor import expand_media_pads
from k3_jax.vision.tower import MoonViT3d, PatchMergerMLPV2


def splice_media(embeds: jax.Array, media_mask: jax.Array, media: jax.Array) -> jax.Array:
    """Replace the rows of ``embeds [B, T, D]`` where ``media_mask [B, T]`` is set by ``media [N, D]``, in order.

    The k-th masked position (row-major) gets ``media[k]``; ``N`` may exceed the mask count (padded tokens).
    """
    b, t, d = embeds.shape
    flat = media_mask.reshape(-1)
    idx = jnp.clip(jnp.cumsum(flat.astype(jnp.int32)) - 1, 0, media.shape[0] - 1)
    rows = jnp.take(media, idx, axis=0).reshape(b, t, d).astype(embeds.dtype)
    return jnp.where(media_mask[..., None], rows, embeds)


def _concrete(x: Any) -> np.ndarray | None:
    """``x`` as numpy when it is host / concrete data, None when traced."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


class K3ForConditionalGeneration(nn.Module):
    """The K3 release model: text + vision (see the module docstring for the call contract)."""

    cfg: K3Config

    def setup(self) -> None:
        cfg = self.cfg
        if cfg.vision is None:
            raise ValueError("K3ForConditionalGeneration needs a config with a vision_config (cfg.vision); "
                             "use K3ForCausalLM for a text-only model")
        if cfg.vision.text_hidden_size != cfg.hidden_size:
            raise ValueError(f"vision_config.text_hidden_size={cfg.vision.text_hidden_size} != text hidden_size="
                             f"{cfg.hidden_size}: the projector's output must be the text width")
        if cfg.media_placeholder_token_id is None:
            raise ValueError("config has no media_placeholder_token_id (the <|media_pad|> id)")
        self.language_model = K3ForCausalLM(cfg)
        nn.share_scope(self, self.language_model)  # its params at the root: {"model", "lm_head", ...}
        self.vision_tower = MoonViT3d(cfg)
        self.mm_projector = PatchMergerMLPV2(cfg)

    def _plan(self, grid_thws: Any, plan: MediaPlan | dict | None) -> MediaPlan | dict:
        if plan is not None:
            return plan
        if grid_thws is None:
            raise ValueError("pixel_values given without grid_thws (or plan=)")
        return build_plan(grid_thws, self.cfg.vision)

    def encode_media(self, pixel_values: jax.Array, grid_thws: Any = None,
                     plan: MediaPlan | dict | None = None) -> jax.Array:
        """``pixel_values [Np, 3, P, P]`` + ``grid_thws`` (or ``plan``: a MediaPlan, or its ``arrays()`` as traced
        inputs, e.g. in a train step) -> projected media tokens ``[Nt, D]``."""
        p = self._plan(grid_thws, plan)
        arrays = p if isinstance(p, dict) else p.arrays()
        if pixel_values.shape[0] != arrays["segment_ids"].shape[0]:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thws / plan describe "
                             f"{arrays['segment_ids'].shape[0]}")
        return self.mm_projector(self.vision_tower(pixel_values, arrays))

    def __call__(self, input_ids: jax.Array, pixel_values: jax.Array | None = None, grid_thws: Any = None,
                 segment_ids: jax.Array | None = None, *, plan: MediaPlan | dict | None = None,
                 media_embeds: jax.Array | None = None, cache: dict | None = None,
                 return_hidden: bool = False) -> Any:
        cfg = self.cfg
        v = cfg.vision
        if self.is_initializing() and pixel_values is None and media_embeds is None:
            kh, kw = v.merge_kernel_size  # create the tower's parameters with one minimal image
            dummy = build_plan(np.array([[1, kh, kw]]), v)
            self.encode_media(jnp.zeros((kh * kw, 3, v.patch_size, v.patch_size), jnp.float32), plan=dummy)
        hook = None
        if pixel_values is not None or media_embeds is not None:
            counts: tuple[int, ...] | None = None
            if media_embeds is None:
                p = self._plan(grid_thws, plan)
                counts = None if isinstance(p, dict) else p.tokens_per_item  # plan arrays: ids pre-expanded
                media_embeds = self.encode_media(pixel_values, plan=p)
            input_ids = self._maybe_expand(input_ids, counts, segment_ids)
            pad_id, tok_pad = cfg.media_placeholder_token_id, cfg.pad_token_id
            mask = input_ids == pad_id
            zero = (input_ids == tok_pad) if tok_pad is not None else None

            def hook(e: jax.Array) -> jax.Array:
                e = splice_media(e, mask, media_embeds)
                return e if zero is None else jnp.where(zero[..., None], 0, e)

        return self.language_model(input_ids, segment_ids, cache, return_hidden, embeds_hook=hook)

    def _maybe_expand(self, input_ids: jax.Array, counts: tuple[int, ...] | None,
                      segment_ids: jax.Array | None) -> jax.Array:
        ids = _concrete(input_ids)
        if ids is None or counts is None:
            return input_ids  # traced: the expanded form is assumed
        pad_id = self.cfg.media_placeholder_token_id
        n_pads, total = int((ids == pad_id).sum()), sum(counts)
        if n_pads == total:
            return input_ids
        if n_pads == len(counts):
            if segment_ids is not None:
                raise ValueError("segment_ids cannot be combined with one-<|media_pad|>-per-item input_ids (the "
                                 "sequence grows); expand the prompt first (k3_jax.vision.processor."
                                 "expand_media_pads)")
            rows = [expand_media_pads(r, counts[self._row_items(ids, i)], pad_id) for i, r in enumerate(ids)]
            width = max(len(r) for r in rows)
            if any(len(r) != width for r in rows):
                raise ValueError("rows of input_ids expand to different lengths; pad them to one media token "
                                 "count or expand the prompts yourself")
            return jnp.asarray(np.stack(rows))
        raise ValueError(f"input_ids hold {n_pads} <|media_pad|> tokens (id {pad_id}); expected one per media item "
                         f"({len(counts)}) or one per media token ({total})")

    def _row_items(self, ids: np.ndarray, row: int) -> slice:
        pad_id = self.cfg.media_placeholder_token_id
        before = int((ids[:row] == pad_id).sum())
        return slice(before, before + int((ids[row] == pad_id).sum()))
