"""The image / video processor against the release processor's outputs (golden), and its input errors."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from k3_jax.vision.processor import (
    ImageError,
    MediaProcConfig,
    MediaProcessor,
    expand_media_pads,
    load_image,
    resize_plan,
)
from tests.test_vision_golden import golden  # noqa: F401  (module-scoped fixture)


def _case_cfg(g, case: str) -> MediaProcConfig:
    pre = f"proc/{case}/cfg/"
    raw = {k[len(pre):]: g[k] for k in g if k.startswith(pre)}
    fixed = int(raw.pop("fixed_output_tokens"))
    return MediaProcConfig(patch_size=int(raw["patch_size"]), merge_kernel_size=int(raw["merge_kernel_size"]),
                           in_patch_limit=int(raw["in_patch_limit"]),
                           patch_limit_on_one_side=int(raw["patch_limit_on_one_side"]),
                           fixed_output_tokens=None if fixed < 0 else fixed,
                           image_mean=tuple(float(x) for x in raw["image_mean"]),
                           image_std=tuple(float(x) for x in raw["image_std"]))


def _images(g, case: str) -> list[Image.Image]:
    out, i = [], 0
    while f"proc/{case}/image_{i}" in g:
        out.append(Image.fromarray(g[f"proc/{case}/image_{i}"], str(g[f"proc/{case}/image_{i}_mode"])))
        i += 1
    return out


@pytest.mark.parametrize("case", ["release", "limited"])
def test_matches_release_processor(golden, case):  # noqa: F811
    images = _images(golden, case)
    out = MediaProcessor(_case_cfg(golden, case))(images)
    np.testing.assert_array_equal(out.grid_thws, golden[f"proc/{case}/grid_thws"])
    assert out.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(out.pixel_values, golden[f"proc/{case}/pixel_values"])
    assert list(out.prompts) == [str(p) for p in golden[f"proc/{case}/prompts"]]
    assert list(out.num_tokens) == golden[f"proc/{case}/num_tokens"].tolist()


def test_video_matches_release_pieces(golden):  # noqa: F811
    frames = [golden["video/frame_0"], golden["video/frame_1"]]  # uint8 numpy frames
    out = MediaProcessor(_case_cfg(golden, "release"))([{"type": "video", "frames": frames}])
    np.testing.assert_array_equal(out.grid_thws[0], golden["video/grid_thw"])
    np.testing.assert_array_equal(out.pixel_values, golden["video/pixel_values"])
    assert out.prompts[0].startswith("<|media_begin|>video 112x56")


def test_resize_limits():
    cfg = MediaProcConfig()
    big = resize_plan(20000, 300, cfg)  # per-side limit: 512 patches x 14 px
    assert big.new_width + big.pad_width <= 512 * 14 and big.grid_hw[1] % 28 == 0
    huge = resize_plan(4000, 4000, cfg)  # budget: scale sqrt(65536 / (285 * 285)); padding can pass it slightly
    assert (huge.new_width, huge.grid_hw, huge.num_tokens) == (3592, (3612, 3612), 129 * 129)
    small = resize_plan(10, 5, cfg)
    assert (small.new_width, small.new_height, small.grid_hw) == (10, 5, (28, 28)) and small.num_tokens == 1


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def test_inputs_accepted():
    rgb = Image.new("RGB", (30, 20), (10, 200, 30))
    data_url = "data:image/png;base64," + base64.b64encode(_png(rgb)).decode()
    for src in (rgb, np.asarray(rgb), _png(rgb), data_url, Image.new("P", (30, 20)), Image.new("LA", (30, 20))):
        assert load_image(src).mode == "RGB"


@pytest.mark.parametrize("src, message", [
    (b"not an image at all", "not an image"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("https://example.com/cat.png", "remote URLs are not fetched"),
    (np.zeros((4, 4), np.float32), "must be uint8"),
    (np.zeros((4, 4, 2), np.uint8), r"\[H, W, 3\]"),
    (Image.new("I;16", (8, 8)), "unsupported image mode"),
    (Image.new("F", (8, 8)), "unsupported image mode"),
    (12, "unsupported input type"),
])
def test_bad_inputs(src, message):
    with pytest.raises(ImageError, match=message):
        MediaProcessor()([src])


def test_too_large_and_video_errors():
    cfg = MediaProcConfig(max_image_pixels=100, max_image_bytes=10**6)
    with pytest.raises(ImageError, match="larger than max_image_pixels"):
        MediaProcessor(cfg)([Image.new("RGB", (20, 20))])
    with pytest.raises(ImageError, match="larger than max_image_bytes"):
        load_image(b"x" * 200, cfg=MediaProcConfig(max_image_bytes=100))
    frames = [np.zeros((28, 28, 3), np.uint8)] * 5
    with pytest.raises(ImageError, match="at most 4"):
        MediaProcessor()([{"type": "video", "frames": frames}])
    with pytest.raises(ImageError, match="one size"):
        MediaProcessor()([{"type": "video", "frames": [frames[0], np.zeros((28, 56, 3), np.uint8)]}])


def test_expand_media_pads():
    ids = expand_media_pads([5, 9, 7, 9, 8], [3, 1], pad_id=9)
    assert ids.tolist() == [5, 9, 9, 9, 7, 9, 8]
    with pytest.raises(ValueError, match="2 media placeholder tokens"):
        expand_media_pads([9, 9], [1], pad_id=9)


def test_chat_content_parts():
    from k3_jax.vision.content import message_pieces

    png = _png(Image.new("RGB", (40, 30), (1, 2, 3)))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "what is "},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "?"}]}]
    pieces, media = message_pieces(msgs)
    assert pieces[0] == [(False, "be brief")]
    assert pieces[1] == [(False, "what is "), (True, "<|media_begin|>"), (False, "image 40x30"),
                         (True, "<|media_content|>"), (True, "<|media_pad|>"), (True, "<|media_end|>"), (False, "?")]
    assert media.grid_thws.tolist() == [[1, 4, 4]] and media.num_tokens == (4,)
    bad = [
        ({"type": "image_url", "image_url": {"url": "https://x/cat.png"}}, "remote fetch disabled"),
        ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "local image files are not read"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}, "not an image"),
        ({"type": "audio", "audio": "x"}, "unsupported content part type"),
    ]
    for part, message in bad:
        with pytest.raises(ImageError, match=r"messages\[0\]\.content\[0\]: .*" + message):
            message_pieces([{"role": "user", "content": [part]}])
    with pytest.raises(ImageError, match="user messages only"):
        message_pieces([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
