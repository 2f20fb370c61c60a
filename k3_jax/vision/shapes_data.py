"""The bundled image-text example: procedurally drawn coloured shapes with their captions (nothing stored on disk).

Each example is one 56×56 image — a ``{colour}`` circle, square or triangle at a random place and size on a
``{background}`` of another colour — and the caption ``"a {colour} {shape} on a {background} background."``.
A row is ``[BOS] <|media_begin|>image 56x56<|media_content|><|media_pad|><|media_end|> caption [EOS]`` (the
release's image placeholder; the pad is expanded to the image's 4 merged tokens), so the loss is on the caption
only and predicting its colour words needs the image: the vision tower and projector get gradients.

:class:`ShapesCaptions` yields :func:`k3_jax.vision.train.image_text_batch` batches, deterministic in
``(seed, split, batch index)``; its state (``{"rows": {"0": {"index": n}}}``) is the next batch index, so a
resumed run continues the same sequence of batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from k3_jax.config import K3Config
from k3_jax.vision.content import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END
from k3_jax.vision.processor import MEDIA_PAD, MediaProcConfig, MediaProcessor
from k3_jax.vision.train import image_text_batch

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (50, 80, 220), "yellow": (235, 210, 40),
    "purple": (140, 60, 180), "white": (245, 245, 245), "black": (15, 15, 15),
}
SHAPES = ("circle", "square", "triangle")
IMAGE_SIZE = 56
_SPLITS = {"train": 0, "eval": 1}


def draw_example(rng: np.random.Generator) -> tuple[Any, str]:
    """One ``(PIL image, caption)``."""
    from PIL import Image, ImageDraw  # noqa: PLC0415

    names = list(COLOURS)
    fg, bg = rng.choice(len(names), size=2, replace=False)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), COLOURS[names[bg]])
    size = int(rng.integers(20, 44))
    x0, y0 = (int(v) for v in rng.integers(0, IMAGE_SIZE - size, size=2))
    box = (x0, y0, x0 + size, y0 + size)
    d = ImageDraw.Draw(img)
    colour = COLOURS[names[fg]]
    if shape == "circle":
        d.ellipse(box, fill=colour)
    elif shape == "square":
        d.rectangle(box, fill=colour)
    else:
        d.polygon([(x0 + size // 2, y0), (x0, y0 + size), (x0 + size, y0 + size)], fill=colour)
    return img, f"a {names[fg]} {shape} on a {names[bg]} background."


class ShapesCaptions:
    """Iterator of image-text batches (``batch_size`` rows of ``seq_len + 1`` tokens, one image per row)."""

    def __init__(self, tokenizer: Any, cfg: K3Config, seq_len: int, batch_size: int, seed: int = 0,
                 split: str = "train"):
        if cfg.vision is None or cfg.media_placeholder_token_id is None:
            raise ValueError("the image-text example needs a config with a vision_config and a "
                             "media_placeholder_token_id")
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {tuple(_SPLITS)}, got {split!r}")
        if tokenizer.special_id(MEDIA_PAD) != cfg.media_placeholder_token_id:
            raise ValueError(f"tokenizer {MEDIA_PAD} id {tokenizer.special_id(MEDIA_PAD)} != the config's "
                             f"media_placeholder_token_id {cfg.media_placeholder_token_id}")
        self.tok, self.cfg, self.seq_len, self.batch_size = tokenizer, cfg, seq_len, batch_size
        self.seed, self.split, self.index = seed, split, 0
        self.processor = MediaProcessor(MediaProcConfig(patch_size=cfg.vision.patch_size,
                                                        merge_kernel_size=cfg.vision.merge_kernel_size[0]))
        sp = tokenizer.special_id
        self._head = [sp(MEDIA_BEGIN), *tokenizer.encode(f"image {IMAGE_SIZE}x{IMAGE_SIZE}"), sp(MEDIA_CONTENT),
                      cfg.media_placeholder_token_id, sp(MEDIA_END)]

    def __iter__(self) -> ShapesCaptions:
        return self

    def __next__(self) -> dict[str, Any]:
        rng = np.random.default_rng([self.seed, _SPLITS[self.split], self.index])
        self.index += 1
        images, rows = [], []
        for _ in range(self.batch_size):
            img, caption = draw_example(rng)
            images.append(img)
            rows.append([self.cfg.bos_token_id or 1, *self._head, *self.tok.encode(caption),
                         self.cfg.eos_token_id or 2])
        media = self.processor(images)
        return image_text_batch(rows, media, self.cfg.vision, self.cfg.media_placeholder_token_id, self.seq_len,
                                pad_id=self.cfg.pad_token_id or 0)

    def get_state(self) -> dict[str, Any]:
        return {"rows": {"0": {"index": self.index}}}

    def set_state(self, state: dict[str, Any]) -> None:
        self.index = int(state["rows"]["0"]["index"])
