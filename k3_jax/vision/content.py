"""OpenAI-style chat content parts with images -> text pieces, media placeholders and processed media.

For a server: ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (or ``"image_url":
"data:..."``, or ``{"type": "image", "image": <bytes | PIL | data URL>}``) parts of user messages are loaded
with :func:`k3_jax.vision.processor.load_image`; remote URLs are refused (nothing here has a network). Every
problem raises :class:`~k3_jax.vision.processor.ImageError` naming ``messages[i].content[j]`` — answer 400.

:func:`message_pieces` returns a message's content as ``(is_special, text)`` pieces in the format of
:mod:`k3_jax.serving.chat`'s prompt segments: the release's image placeholder
``<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>`` with its markers as special tokens (user
text can never produce them), one ``<|media_pad|>`` per image; expand it to the image's token count with
:func:`~k3_jax.vision.processor.expand_media_pads` after tokenizing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from k3_jax.vision.processor import MEDIA_PAD, ImageError, MediaProcConfig, MediaProcessor, ProcessedMedia, load_image

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END = "<|media_begin|>", "<|media_content|>", "<|media_end|>"


def _image_source(part: Mapping[str, Any], where: str) -> Any:
    kind = part.get("type")
    if kind == "image_url":
        src = part.get("image_url")
        url = src.get("url") if isinstance(src, Mapping) else src
        if not isinstance(url, str) or not url:
            raise ImageError(f"{where}: image_url needs a 'url' string")
        if not url.startswith("data:"):
            raise ImageError(f"{where}: only data: URLs are accepted (remote image URLs are not fetched; send "
                             "'data:image/png;base64,...')")
        return url
    if kind == "image":
        if "image" not in part:
            raise ImageError(f"{where}: image part without 'image'")
        return part["image"]
    raise ImageError(f"{where}: unsupported content part type {kind!r} (text, image_url or image)")


def message_pieces(messages: Sequence[Mapping[str, Any]], cfg: MediaProcConfig | None = None
                   ) -> tuple[list[list[tuple[bool, str]]], ProcessedMedia | None]:
    """Per message, its content as ``(is_special, text)`` pieces; and the processed images of all messages in
    order (None when there are none). Text-only string contents pass through as one piece."""
    cfg = cfg or MediaProcConfig()
    images, out = [], []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if content is None or isinstance(content, str):
            out.append([(False, content or "")])
            continue
        if not isinstance(content, Sequence):
            raise ImageError(f"messages[{i}].content must be a string or a list of parts")
        pieces: list[tuple[bool, str]] = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if not isinstance(part, Mapping):
                raise ImageError(f"{where}: a content part must be an object, got {type(part).__name__}")
            if part.get("type", "text") == "text":
                pieces.append((False, str(part.get("text", ""))))
                continue
            if msg.get("role") != "user":
                raise ImageError(f"{where}: images are accepted in user messages only")
            img = load_image(_image_source(part, where), where, cfg)
            images.append(img)
            w, h = img.size
            pieces += [(True, MEDIA_BEGIN), (False, f"image {w}x{h}"), (True, MEDIA_CONTENT), (True, MEDIA_PAD),
                       (True, MEDIA_END)]
        out.append(pieces)
    return out, (MediaProcessor(cfg)(images) if images else None)
