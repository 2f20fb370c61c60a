"""Images and video frames -> ``pixel_values [N_patches, 3, P, P]`` f32 and ``grid_thws [N_media, 3]`` i64.

Pure Python / numpy / PIL, following the release's ``kimi_k3_vision_processing.py`` + ``media_utils.py``
(checked against them, ``tests/test_vision_processor.py``):

1. load: a PIL image, a uint8 numpy array (``[H, W]``, ``[H, W, 3]`` or ``[H, W, 4]``), raw bytes, a
   ``data:`` URL or a file path; converted to RGB with PIL's ``convert("RGB")`` (the release's default, no
   ``transparent_bg_config``: alpha is dropped, not composited);
2. size (``navit_resize_image``): ``scale = min(1, sqrt(in_patch_limit / (max(1, W//P) * max(1, H//P))),
   limit*P/W, limit*P/H)`` with ``limit = patch_limit_on_one_side``; ``new = max(1, int(side * scale))``
   capped at ``limit*P``; then zero padding at the bottom / right to a multiple of ``merge_kernel_size*P``
   (28 px for K3);
3. ``PIL.Image.resize(new, BICUBIC)``, pad, ``(x / 255).astype(f32)``, ``- mean``, ``* (1 / std)``;
4. patchify in (frame, row, column) order, channels first within a patch.

A video is a list of same-size frames (at most ``init_pos_emb_time`` = 4 per item; longer clips are split
by the caller): each frame sized and normalised as an image (the per-frame budget is ``in_patch_limit``),
then stacked as ``t`` frames of one item. The release processor takes images only; its prompt for an image is
``<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>`` (:func:`media_prompt`, one
``<|media_pad|>`` per item). For videos we use the same form with ``video`` (our convention).

Defaults (:class:`MediaProcConfig`) are the release's limits: 65536 patches per image, 512 patches per side
(the vLLM K3 integration rejects larger values as exceeding the checkpoint's), mean = std = 0.5.

Bad input raises :class:`ImageError` naming the item and the problem (not an image, too large, unsupported
mode or dtype), so a server can answer 400.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

MEDIA_PAD = "<|media_pad|>"

#: PIL modes ``convert("RGB")`` maps faithfully; others (16-bit / float / planar) are refused.
SUPPORTED_MODES = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr"})


class ImageError(ValueError):
    """An input the processor cannot take; the message names the item and says why."""


@dataclasses.dataclass(frozen=True)
class MediaProcConfig:
    """The release's ``media_proc_cfg`` (``preprocessor_config.json``) plus input-size guards of our own."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: int | None = None
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_frames: int = 4  # init_pos_emb_time of the tower
    max_image_pixels: int = 8192 * 8192  # decoded size guard (decompression bombs), before resizing
    max_image_bytes: int = 64 << 20  # encoded size guard

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MediaProcConfig:
        """From a ``media_proc_cfg`` dict (unknown keys ignored, e.g. the video-only ones of K2.5)."""
        kw = {f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw}
        for k in ("image_mean", "image_std"):
            if k in kw:
                kw[k] = tuple(float(x) for x in kw[k])
        return cls(**kw)


@dataclasses.dataclass(frozen=True)
class ResizePlan:
    new_width: int
    new_height: int
    pad_width: int
    pad_height: int
    num_tokens: int

    @property
    def grid_hw(self) -> tuple[int, int]:
        return (self.new_height + self.pad_height), (self.new_width + self.pad_width)


@dataclasses.dataclass(frozen=True)
class ProcessedMedia:
    """Processor output for a list of media items (packed in order)."""

    pixel_values: np.ndarray  # f32 [N_patches, 3, P, P]
    grid_thws: np.ndarray  # i64 [N_media, 3] (t, h, w) in patches
    num_tokens: tuple[int, ...]  # merged tokens per item (what its <|media_pad|> expands to)
    prompts: tuple[str, ...]  # the text placeholder of each item


def resize_plan(width: int, height: int, cfg: MediaProcConfig) -> ResizePlan:
    """Target size and padding for an image of ``width`` x ``height`` (``navit_resize_image``)."""
    p, k, limit = cfg.patch_size, cfg.merge_kernel_size, cfg.patch_limit_on_one_side
    s1 = math.sqrt(cfg.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
    scale = min(1.0, s1, limit * p / width, limit * p / height)
    new_w = min(max(1, int(width * scale)), limit * p)
    new_h = min(max(1, int(height * scale)), limit * p)
    factor = k * p
    pad_h = (factor - new_h % factor) % factor
    pad_w = (factor - new_w % factor) % factor
    if cfg.fixed_output_tokens is not None:
        tokens = cfg.fixed_output_tokens
    else:
        th, tw = (new_h + pad_h) // factor, (new_w + pad_w) // factor
        if th * k > limit or tw * k > limit:
            raise ImageError(f"image {width}x{height}: {tw * k}x{th * k} patches after padding exceed "
                             f"patch_limit_on_one_side={limit}")
        tokens = th * tw
    return ResizePlan(new_w, new_h, pad_w, pad_h, tokens)


def media_prompt(width: int, height: int, kind: str = "image") -> str:
    """The release's placeholder text for one item of original size ``width`` x ``height``."""
    return f"<|media_begin|>{kind} {width}x{height}<|media_content|>{MEDIA_PAD}<|media_end|>"


def _decode_bytes(data: bytes, what: str, cfg: MediaProcConfig):
    from PIL import Image, UnidentifiedImageError  # noqa: PLC0415

    if len(data) > cfg.max_image_bytes:
        raise ImageError(f"{what}: {len(data)} bytes, larger than max_image_bytes={cfg.max_image_bytes}")
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(f"{what}: not an image (PIL cannot identify the data)") from None
    except Exception as e:  # noqa: BLE001 - any decoder failure is a bad input
        raise ImageError(f"{what}: cannot open the image ({type(e).__name__}: {e})") from None
    return img


def load_image(src: Any, what: str = "image", cfg: MediaProcConfig | None = None):
    """One image as an RGB ``PIL.Image`` (see the module docstring for accepted inputs)."""
    from PIL import Image  # noqa: PLC0415

    cfg = cfg or MediaProcConfig()
    if isinstance(src, Image.Image):
        img = src
    elif isinstance(src, np.ndarray):
        if src.dtype != np.uint8:
            raise ImageError(f"{what}: numpy images must be uint8, got {src.dtype}")
        if src.ndim == 2 or (src.ndim == 3 and src.shape[-1] in (3, 4)):
            img = Image.fromarray(src, {2: "L", 3: "RGB", 4: "RGBA"}[src.ndim if src.ndim == 2 else src.shape[-1]])
        else:
            raise ImageError(f"{what}: numpy images must be [H, W], [H, W, 3] or [H, W, 4], got {src.shape}")
    elif isinstance(src, bytes | bytearray):
        img = _decode_bytes(bytes(src), what, cfg)
    elif isinstance(src, str) and src.startswith("data:"):
        head, _, payload = src.partition(",")
        if not head.endswith(";base64") or not payload:
            raise ImageError(f"{what}: data URL must be 'data:<mime>;base64,<payload>'")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError(f"{what}: data URL payload is not valid base64") from None
        img = _decode_bytes(raw, what, cfg)
    elif isinstance(src, str | os.PathLike):
        path = os.fspath(src)
        if path.startswith(("http://", "https://")):
            raise ImageError(f"{what}: remote URLs are not fetched ({path[:60]}); pass the bytes or a data URL")
        if not os.path.isfile(path):
            raise ImageError(f"{what}: file {path!r} does not exist")
        with open(path, "rb") as f:
            img = _decode_bytes(f.read(), what, cfg)
    else:
        raise ImageError(f"{what}: unsupported input type {type(src).__name__} (PIL image, uint8 array, bytes, "
                         "data URL or path)")
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError(f"{what}: empty image ({w}x{h})")
    if w * h > cfg.max_image_pixels:
        raise ImageError(f"{what}: {w}x{h} = {w * h} pixels, larger than max_image_pixels={cfg.max_image_pixels}")
    if img.mode not in SUPPORTED_MODES:
        raise ImageError(f"{what}: unsupported image mode {img.mode!r} (supported: {sorted(SUPPORTED_MODES)})")
    try:
        return img.convert("RGB")
    except Exception as e:  # noqa: BLE001 - truncated / corrupt data surfaces when decoding
        raise ImageError(f"{what}: cannot decode the image ({type(e).__name__}: {e})") from None


def _frame_pixels(img, plan: ResizePlan, cfg: MediaProcConfig) -> np.ndarray:
    """Resized, padded, normalised ``[H, W, 3]`` f32 (the release's arithmetic: f64 ops, f32 storage)."""
    from PIL import Image  # noqa: PLC0415

    arr = np.asarray(img.resize((plan.new_width, plan.new_height), resample=Image.Resampling.BICUBIC))
    arr = np.pad(arr, ((0, plan.pad_height), (0, plan.pad_width), (0, 0)))
    x = (arr / 255.0).astype(np.float32)
    x -= np.array(cfg.image_mean)
    x *= 1.0 / np.array(cfg.image_std)
    return x


def patchify(frames: np.ndarray, patch: int) -> tuple[np.ndarray, np.ndarray]:
    """``[T, H, W, 3]`` -> (``[T*(H/P)*(W/P), 3, P, P]``, grid ``(T, H/P, W/P)``), raster order."""
    t, h, w, c = frames.shape
    x = frames.reshape(t, h // patch, patch, w // patch, patch, c).transpose(0, 1, 3, 5, 2, 4)
    return x.reshape(-1, c, patch, patch), np.array([t, h // patch, w // patch], np.int64)


class MediaProcessor:
    """``MediaProcessor(cfg)(medias)`` -> :class:`ProcessedMedia`.

    ``medias``: a list of items, each an image (any :func:`load_image` input) or ``{"type": "image",
    "image": ...}`` or ``{"type": "video", "frames": [...]}`` (1..max_frames same-size frames).
    """

    def __init__(self, cfg: MediaProcConfig | None = None):
        self.cfg = cfg or MediaProcConfig()

    def __call__(self, medias: Sequence[Any]) -> ProcessedMedia:
        if not isinstance(medias, list | tuple):
            medias = [medias]
        if not medias:
            raise ImageError("no media given")
        pixels, grids, tokens, prompts = [], [], [], []
        for i, item in enumerate(medias):
            kind, frames = self._frames(item, i)
            w, h = frames[0].size
            for j, f in enumerate(frames[1:], 1):
                if f.size != (w, h):
                    raise ImageError(f"media item {i}: video frame {j} is {f.size[0]}x{f.size[1]}, frame 0 is "
                                     f"{w}x{h} (all frames of an item must have one size)")
            plan = resize_plan(w, h, self.cfg)
            stack = np.stack([_frame_pixels(f, plan, self.cfg) for f in frames])
            pv, grid = patchify(stack, self.cfg.patch_size)
            pixels.append(pv)
            grids.append(grid)
            tokens.append(plan.num_tokens)
            prompts.append(media_prompt(w, h, kind))
        return ProcessedMedia(np.concatenate(pixels).astype(np.float32), np.stack(grids), tuple(tokens),
                              tuple(prompts))

    def _frames(self, item: Any, i: int) -> tuple[str, list]:
        what = f"media item {i}"
        if isinstance(item, dict):
            kind = item.get("type")
            if kind == "image":
                return "image", [load_image(item.get("image"), what, self.cfg)]
            if kind == "video":
                frames = item.get("frames")
                if not isinstance(frames, list | tuple) or not frames:
                    raise ImageError(f"{what}: a video needs a non-empty list of 'frames'")
                if len(frames) > self.cfg.max_frames:
                    raise ImageError(f"{what}: {len(frames)} frames, at most {self.cfg.max_frames} per item "
                                     "(split the clip into chunks)")
                return "video", [load_image(f, f"{what} frame {j}", self.cfg) for j, f in enumerate(frames)]
            raise ImageError(f"{what}: unsupported media type {kind!r} (expected 'image' or 'video')")
        return "image", [load_image(item, what, self.cfg)]


def expand_media_pads(input_ids: Sequence[int] | np.ndarray, num_tokens: Sequence[int], pad_id: int) -> np.ndarray:
    """Replace the ``i``-th ``<|media_pad|>`` (``pad_id``) of a 1-D id sequence by ``num_tokens[i]`` copies.

    The release's model does this expansion inside ``forward`` (LLaVA style); k3-jax expands on the host so
    the compiled model sees static shapes. Raises when the pad count differs from the number of items.
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 1:
        raise ValueError(f"expand_media_pads takes one sequence [T], got shape {ids.shape}")
    where = np.flatnonzero(ids == pad_id)
    if len(where) != len(num_tokens):
        raise ValueError(f"{len(where)} media placeholder tokens (id {pad_id}) for {len(num_tokens)} media items")
    reps = np.ones(ids.shape[0], np.int64)
    reps[where] = np.asarray(num_tokens, np.int64)
    return np.repeat(ids, reps)
