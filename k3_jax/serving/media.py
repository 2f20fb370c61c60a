"""Images in served requests: chat content parts -> prompt ids + :class:`RequestMedia`; the engine's media encoder
and the media rows of each prefill chunk.

Flow (server -> engine):

1. :func:`chat_request_ids` (request thread): OpenAI content parts ``{"type": "image_url", "image_url": {"url":
   "data:image/png;base64,..."}}`` are loaded and processed (:mod:`k3_jax.vision.content`,
   :mod:`k3_jax.vision.processor`); each image's ``<|media_pad|>`` is expanded to its merged-token count, so the
   prompt the engine sees has one position per media embedding. Problems raise
   :class:`~k3_jax.vision.processor.ImageError` naming ``messages[i].content[j]`` (the server answers 400).
2. :class:`RequestMedia` travels with the request: the processed ``pixel_values`` / ``grid_thws``, the token count
   and a content digest per item (sha256 of the item's ``pixel_values`` bytes and its grid: equal images give equal
   digests, for a prefix cache to hash), and once encoded the projected embeddings ``embeds [sum(num_tokens), D]``.
3. :class:`MediaEncoder` (engine thread, at admission): the vision tower + projector over all items of the request
   in one packed call (each item is encoded once), padded to :func:`k3_jax.vision.plan.bucket` sizes so varied
   images reuse a few compiled shapes.
4. :func:`chunk_media` / :func:`media_embeds_hook`: a prefill chunk ``[start, start + n)`` of the prompt takes the
   rows of the media embeddings of its own ``<|media_pad|>`` positions (the k-th pad of the prompt gets row k), and
   the hook splices them into the token embeddings inside the jitted prefill; as in the release model, the
   embeddings at ``pad_token_id`` positions of a request with media are zeroed. The result equals
   :class:`k3_jax.multimodal.K3ForConditionalGeneration` on the whole sequence.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.config import K3Config
from k3_jax.multimodal import K3ForConditionalGeneration
from k3_jax.serving.chat import chat_prompt_ids
from k3_jax.vision.content import has_media_parts, message_pieces
from k3_jax.vision.plan import MediaError, bucket, build_plan, check_grid
from k3_jax.vision.processor import MEDIA_PAD, ImageError, MediaProcConfig, ProcessedMedia, expand_media_pads

__all__ = ["MediaServingConfig", "RequestMedia", "MediaEncoder", "chat_request_ids", "check_request_media",
           "check_media_tokenizer", "chunk_media", "media_embeds_hook", "media_digest", "prefix_media_spans",
           "ZEROED_PAD_DIGEST"]

ZEROED_PAD_DIGEST = b"pad_token_id embedding zeroed"  # prefix identity of a pad_token_id position in a media request


@dataclasses.dataclass(frozen=True)
class MediaServingConfig:
    """What a server accepts: processor limits, images per request, and the one local directory image files may
    be read from (``None``: data URLs only; http(s) URLs are always refused)."""

    proc: MediaProcConfig = MediaProcConfig()
    max_items: int = 8
    allow_dir: str | None = None

    def __post_init__(self) -> None:
        if self.max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {self.max_items}")


def media_digest(pixel_values: np.ndarray, grid_thw: Sequence[int]) -> str:
    """sha256 hex of one item's ``pixel_values`` (f32 bytes, C order) and its ``(t, h, w)`` grid."""
    h = hashlib.sha256(np.asarray(grid_thw, np.int64).tobytes())
    h.update(np.ascontiguousarray(pixel_values, np.float32).tobytes())
    return h.hexdigest()


@dataclasses.dataclass
class RequestMedia:
    """The media of one request, packed in prompt order.

    ``pixel_values [Np, 3, P, P]`` f32, ``grid_thws [N, 3]``, ``num_tokens[i]`` merged tokens of item ``i`` (the
    prompt holds ``sum(num_tokens)`` ``<|media_pad|>`` ids), ``digests[i]`` (:func:`media_digest`), and
    ``embeds [sum(num_tokens), D]`` once :class:`MediaEncoder` ran (None before).
    """

    pixel_values: np.ndarray
    grid_thws: np.ndarray
    num_tokens: tuple[int, ...]
    digests: tuple[str, ...]
    embeds: np.ndarray | None = None

    @classmethod
    def from_processed(cls, media: ProcessedMedia) -> RequestMedia:
        grid = np.asarray(media.grid_thws, np.int64)
        sizes = [int(t * h * w) for t, h, w in grid]
        bounds = np.cumsum([0, *sizes])
        digests = tuple(media_digest(media.pixel_values[a:b], g)
                        for a, b, g in zip(bounds[:-1], bounds[1:], grid, strict=True))
        return cls(np.asarray(media.pixel_values, np.float32), grid, tuple(int(n) for n in media.num_tokens), digests)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


def check_media_tokenizer(tokenizer: Any, cfg: K3Config) -> None:
    """Raise ``ValueError`` unless ``tokenizer`` has the media markers and its ``<|media_pad|>`` is the model's
    ``media_placeholder_token_id`` (a server with a vision model checks this at start)."""
    from k3_jax.vision.content import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END  # noqa: PLC0415

    ids = {}
    for name in (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END):
        try:
            ids[name] = tokenizer.special_id(name)
        except KeyError:
            raise ValueError(f"the tokenizer has no special token {name!r}, needed for image input (the bundled "
                             "tokenizer has them with Tokenizer.bundled(media=True))") from None
    if ids[MEDIA_PAD] != cfg.media_placeholder_token_id:
        raise ValueError(f"tokenizer {MEDIA_PAD} id {ids[MEDIA_PAD]} != the config's media_placeholder_token_id "
                         f"{cfg.media_placeholder_token_id}")


def chat_request_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], cfg: K3Config,
                     media_cfg: MediaServingConfig | None = None) -> tuple[list[int], RequestMedia | None]:
    """Chat prompt ids (``<|media_pad|>`` expanded) and the request's media (None for a text-only chat).

    A model without a vision tower, or messages without image parts, take the text path
    (:func:`k3_jax.serving.chat.chat_prompt_ids`, which refuses non-text parts). Raises :class:`ImageError`.
    """
    if cfg.vision is None or not has_media_parts(messages):
        return chat_prompt_ids(tokenizer, messages), None
    media_cfg = media_cfg or MediaServingConfig()
    pieces, processed = message_pieces(messages, media_cfg.proc, allow_dir=media_cfg.allow_dir,
                                       max_items=media_cfg.max_items)
    with_media = [p if any(s for s, _ in p) else None for p in pieces]  # text-only messages: the chat path
    ids = chat_prompt_ids(tokenizer, messages, content_pieces=with_media)
    media = RequestMedia.from_processed(processed)
    try:
        check_grid(tuple(tuple(int(x) for x in g) for g in media.grid_thws), cfg.vision)
    except MediaError as e:
        raise ImageError(f"messages: {e}") from None
    pad_id = tokenizer.special_id(MEDIA_PAD)
    return expand_media_pads(ids, media.num_tokens, pad_id).tolist(), media


def check_request_media(prompt: Sequence[int], media: RequestMedia, cfg: K3Config, has_vision_params: bool) -> None:
    """Raise ``ValueError`` naming the problem when ``media`` cannot be served with ``prompt`` on this model."""
    if cfg.vision is None or cfg.media_placeholder_token_id is None:
        raise ValueError("this model has no vision tower (its config has no vision_config): images cannot be served")
    if not has_vision_params:
        raise ValueError("the loaded parameters have no vision_tower / mm_projector (loaded text-only?): images "
                         "cannot be served")
    if not isinstance(media, RequestMedia):
        raise ValueError(f"media must be a RequestMedia, got {type(media).__name__}")
    n_items = len(media.num_tokens)
    if media.grid_thws.shape != (n_items, 3) or len(media.digests) != n_items:
        raise ValueError(f"media: grid_thws {media.grid_thws.shape} / {len(media.digests)} digests for {n_items} items")
    n_patches = int(np.sum(np.prod(media.grid_thws, axis=1)))
    if media.pixel_values.shape[0] != n_patches:
        raise ValueError(f"media: pixel_values has {media.pixel_values.shape[0]} patches, grid_thws describe "
                         f"{n_patches}")
    pads = int(np.sum(np.asarray(prompt) == cfg.media_placeholder_token_id))
    if pads != media.total_tokens:
        raise ValueError(f"prompt holds {pads} <|media_pad|> tokens (id {cfg.media_placeholder_token_id}); its "
                         f"media need {media.total_tokens} (one per media token: expand the pads)")
    if media.embeds is not None and media.embeds.shape != (media.total_tokens, cfg.hidden_size):
        raise ValueError(f"media.embeds has shape {media.embeds.shape}, expected "
                         f"{(media.total_tokens, cfg.hidden_size)}")


class MediaEncoder:
    """``encoder(media) -> embeds [sum(num_tokens), D]`` f32 numpy: the tower + projector of ``variables`` (a
    :class:`~k3_jax.multimodal.K3ForConditionalGeneration` tree) over the request's items, jitted per bucket."""

    def __init__(self, cfg: K3Config, variables: Mapping[str, Any]):
        model = K3ForConditionalGeneration(cfg)
        self.cfg = cfg
        params = variables["params"]
        self._variables = {"params": {k: params[k] for k in ("vision_tower", "mm_projector")}}
        self._encode = jax.jit(lambda v, px, plan: model.apply(v, px, plan=plan, method="encode_media"))

    def __call__(self, media: RequestMedia) -> np.ndarray:
        n_patches, n_tokens = media.pixel_values.shape[0], media.total_tokens
        plan = build_plan(media.grid_thws, self.cfg.vision, pad_patches_to=bucket(n_patches),
                          pad_tokens_to=bucket(n_tokens, 64))
        pixels = np.zeros((plan.segment_ids.shape[0], *media.pixel_values.shape[1:]), np.float32)
        pixels[:n_patches] = media.pixel_values
        out = self._encode(self._variables, jnp.asarray(pixels), plan.arrays())
        return np.asarray(jax.device_get(out), np.float32)[:n_tokens]


def chunk_media(prompt: np.ndarray, embeds: np.ndarray, start: int, n: int, media_pad_id: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """The media inputs of prefill chunk ``prompt[start:start + n]``: ``(rows [n, D] f32, mask [n] bool)``, row
    ``j`` = the embedding of the chunk's ``j``-th position when it is a ``<|media_pad|>`` (the k-th pad of the whole
    prompt takes ``embeds[k]``), zeros elsewhere."""
    is_pad = np.asarray(prompt) == media_pad_id
    first = int(np.sum(is_pad[:start]))
    mask = is_pad[start:start + n]
    rows = np.zeros((n, embeds.shape[1]), np.float32)
    rows[mask] = embeds[first:first + int(mask.sum())]
    return rows, mask


def prefix_media_spans(prompt: Sequence[int], media: RequestMedia | None, media_pad_id: int,
                       pad_token_id: int | None) -> tuple[tuple[int, int, bytes], ...]:
    """The ``(start, end, digest)`` token spans by which a request's embeddings differ from its token ids' (the
    prefix cache hashes them with the tokens): item ``i`` covers the next ``num_tokens[i]`` ``<|media_pad|>``
    positions with its content digest, and, as :func:`media_embeds_hook` zeroes the ``pad_token_id`` positions of a
    request with media, each of those is a one-token span of :data:`ZEROED_PAD_DIGEST` (the same ids without media
    are embedded, so they must not share a prefix entry). Sorted by start; text-only requests have none."""
    if media is None:
        return ()
    prompt = np.asarray(prompt)
    pads = np.flatnonzero(prompt == media_pad_id)
    spans, k = [], 0
    for n, digest in zip(media.num_tokens, media.digests, strict=True):
        spans.append((int(pads[k]), int(pads[k + n - 1]) + 1, digest.encode()))
        k += n
    if pad_token_id is not None:
        spans += [(int(i), int(i) + 1, ZEROED_PAD_DIGEST) for i in np.flatnonzero(prompt == pad_token_id)]
    return tuple(sorted(spans))


def media_embeds_hook(media: tuple[jax.Array, jax.Array] | None, tokens: jax.Array, pad_token_id: int | None):
    """The ``embeds_hook`` of a prefill chunk (traced): ``media = (rows [n, D], mask [n])`` from
    :func:`chunk_media` splices the rows in and zeroes ``pad_token_id`` positions; None (no media) -> None."""
    if media is None:
        return None
    rows, mask = media

    def hook(e: jax.Array) -> jax.Array:
        e = jnp.where(mask[None, :, None], rows[None].astype(e.dtype), e)
        if pad_token_id is not None:
            e = jnp.where((tokens == pad_token_id)[..., None], jnp.zeros((), e.dtype), e)
        return e

    return hook
