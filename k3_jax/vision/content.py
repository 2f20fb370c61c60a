"""OpenAI-style chat content parts with images -> text pieces, media placeholders and processed media.

For a server: ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (or ``"image_url":
"data:..."``, or ``{"type": "image", "image": <bytes | PIL | data URL>}``) parts of user messages are loaded
with :func:`k3_jax.vision.processor.load_image`; http(s) URLs are refused ("remote fetch disabled": nothing here
has a network), ``file://`` URLs / paths are read only under an explicit ``allow_dir``. Every
problem raises :class:`~k3_jax.vision.processor.ImageError` naming ``messages[i].content[j]`` — answer 400.

:func:`message_pieces` returns a message's content as ``(is_special, text)`` pieces in the format of
:mod:`k3_jax.serving.chat`'s prompt segments: the release's image placeholder
``<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>`` with its markers as special tokens (user
text can never produce them), one ``<|media_pad|>`` per image; expand it to the image's token count with
:func:`~k3_jax.vision.processor.expand_media_pads` after tokenizing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from k3_jax.vision.processor import MEDIA_PAD, ImageError, MediaProcConfig, MediaProcessor, ProcessedMedia, load_image

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END = "<|media_begin|>", "<|media_content|>", "<|media_end|>"


def _local_file(url: str, where: str, allow_dir: str | None) -> str:
    """The real path of a ``file://`` URL or path under ``allow_dir``; anything else raises."""
    if allow_dir is None:
        raise ImageError(f"{where}: local image files are not read by this server (it was started without an "
                         "image directory); send 'data:image/png;base64,...'")
    path = os.path.realpath(url[len("file://"):] if url.startswith("file://") else url)
    root = os.path.realpath(allow_dir)
    if os.path.commonpath([path, root]) != root:
        raise ImageError(f"{where}: {url[:80]!r} is outside the server's image directory")
    return path


def _image_source(part: Mapping[str, Any], where: str, allow_dir: str | None = None) -> Any:
    kind = part.get("type")
    if kind == "image_url":
        src = part.get("image_url")
        url = src.get("url") if isinstance(src, Mapping) else src
        if not isinstance(url, str) or not url:
            raise ImageError(f"{where}: image_url needs a 'url' string")
        if url.startswith("data:"):
            return url
        if url.startswith(("http://", "https://")):
            raise ImageError(f"{where}: remote fetch disabled (image URLs are not fetched); send "
                             "'data:image/png;base64,...'")
        if "://" in url and not url.startswith("file://"):
            raise ImageError(f"{where}: unsupported image URL scheme {url.split(':', 1)[0]!r} (data: URLs)")
        return _local_file(url, where, allow_dir)
    if kind == "image":
        if "image" not in part:
            raise ImageError(f"{where}: image part without 'image'")
        img = part["image"]
        if isinstance(img, str) and not img.startswith("data:"):
            return _image_source({"type": "image_url", "image_url": img}, where, allow_dir)
        return img
    raise ImageError(f"{where}: unsupported content part type {kind!r} (text, image_url or image)")


def has_media_parts(messages: Sequence[Mapping[str, Any]]) -> bool:
    """True when some message's content is a list holding a part whose type is not ``text``."""
    return any(isinstance(m, Mapping) and isinstance(m.get("content"), list | tuple)
               and any(isinstance(p, Mapping) and p.get("type", "text") != "text" for p in m["content"])
               for m in messages)


def message_pieces(messages: Sequence[Mapping[str, Any]], cfg: MediaProcConfig | None = None, *,
                   allow_dir: str | None = None, max_items: int | None = None
                   ) -> tuple[list[list[tuple[bool, str]]], ProcessedMedia | None]:
    """Per message, its content as ``(is_special, text)`` pieces; and the processed images of all messages in
    order (None when there are none). Text-only string contents pass through as one piece. Image files (``file://``
    URLs or paths) are read only from under ``allow_dir``; more than ``max_items`` images raise."""
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
            if max_items is not None and len(images) >= max_items:
                raise ImageError(f"{where}: more than {max_items} images in one request")
            img = load_image(_image_source(part, where, allow_dir), where, cfg)
            images.append(img)
            w, h = img.size
            pieces += [(True, MEDIA_BEGIN), (False, f"image {w}x{h}"), (True, MEDIA_CONTENT), (True, MEDIA_PAD),
                       (True, MEDIA_END)]
        out.append(pieces)
    return out, (MediaProcessor(cfg)(images) if images else None)
