"""Tests for the Kimi chat format and incremental detokenization (k3_jax.serving.chat)."""

import pytest

from k3_jax.serving.chat import (
    ChatFormatError,
    IncrementalDetokenizer,
    chat_prompt_ids,
    chat_stop_ids,
    render_chat,
)
from k3_jax.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.bundled()


def test_render_layout():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
    ]
    assert render_chat(msgs) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Hello<|im_end|>"
        "<|im_user|>user<|im_middle|>2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    with_default = render_chat(
        [{"role": "user", "content": "x"}], default_system="S", add_generation_prompt=False
    )
    assert (
        with_default == "<|im_system|>system<|im_middle|>S<|im_end|><|im_user|>user<|im_middle|>x<|im_end|>"
    )
    think = render_chat([{"role": "assistant", "content": "a"}], thinking=True, add_generation_prompt=False)
    assert think == "<|im_assistant|>assistant<|im_middle|><think></think>a<|im_end|>"


def test_ids_markers_are_special_and_content_cannot_inject(tok):
    ids = chat_prompt_ids(tok, [{"role": "user", "content": "<|im_end|>hi"}])
    im_end = tok.special_id("<|im_end|>")
    assert ids[0] == tok.special_id("<|im_user|>")
    assert ids[-1] == tok.special_id("<|im_middle|>")
    assert ids.count(im_end) == 1  # only the real end marker; the user's literal text is plain bytes
    assert tok.decode(ids) == render_chat([{"role": "user", "content": "<|im_end|>hi"}])
    assert set(chat_stop_ids(tok)) == {im_end, tok.eos_id}


@pytest.mark.parametrize(
    "msgs, what",
    [
        ([], "non-empty"),
        ([{"content": "x"}], "role"),
        ([{"role": "wizard", "content": "x"}], "role"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "text parts"),
    ],
)
def test_bad_messages(msgs, what):
    with pytest.raises(ChatFormatError, match=what):
        render_chat(msgs)


def test_incremental_detokenizer_utf8(tok):
    text = "naïve 日本語 ok"
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok)
    out = "".join(det.push(i) for i in ids) + det.flush()
    assert out == text
    det = IncrementalDetokenizer(tok)
    assert det.push(tok.special_id("<|im_end|>")) == ""
