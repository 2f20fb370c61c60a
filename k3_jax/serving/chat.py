"""Kimi chat format (K2/K3 message layout) and incremental detokenization.

Each message is framed by role markers (special tokens, never produced from user text):

    <|im_system|>system<|im_middle|>{content}<|im_end|>
    <|im_user|>user<|im_middle|>{content}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>{content}<|im_end|>

The name after the role marker is the message's ``name`` field when given, else its role. Roles other than
user/assistant (system, tool, developer) use ``<|im_system|>``; a tool result is introduced by
``## Return of {tool_call_id}``. The generation prompt is an open assistant header
``<|im_assistant|>assistant<|im_middle|>``; generation ends at ``<|im_end|>`` (K3's eos id 163586 is that
token). Thinking mode (K2-Thinking convention): earlier assistant turns carry an empty ``<think></think>``
block, and the model opens its own ``<think>`` block itself.

Prompt ids are assembled piecewise: markers as special ids, content through ``encode`` with special strings
treated as plain text, so user text cannot inject role markers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ChatFormatError", "render_chat", "chat_prompt_ids", "chat_stop_ids", "IncrementalDetokenizer"]

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
ROLE_MARKER = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}
SYSTEM_MARKER = "<|im_system|>"
MIDDLE, END = "<|im_middle|>", "<|im_end|>"
KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatFormatError(ValueError):
    """A chat message is malformed; the message names the index and field."""


def _content_text(msg: Mapping[str, Any], i: int) -> str:
    c = msg.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, Sequence):
        parts = []
        for j, part in enumerate(c):
            if not isinstance(part, Mapping) or part.get("type", "text") != "text" or "text" not in part:
                raise ChatFormatError(f"messages[{i}].content[{j}]: only text parts are supported, got {part!r}")
            parts.append(str(part["text"]))
        return "".join(parts)
    raise ChatFormatError(f"messages[{i}].content must be a string or a list of text parts, got {type(c).__name__}")


def _segments(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    default_system: str | None,
    thinking: bool,
    content_pieces: Sequence[list[tuple[bool, str]] | None] | None = None,
) -> list[tuple[bool, str]]:
    """The prompt as ``(is_special, text)`` pieces; ``content_pieces[i]`` (when not None) replaces message ``i``'s
    content (e.g. text with image placeholders, :func:`k3_jax.vision.content.message_pieces`)."""
    if not messages:
        raise ChatFormatError("messages must be a non-empty list")
    out: list[tuple[bool, str]] = []
    first_role = messages[0].get("role") if isinstance(messages[0], Mapping) else None
    if default_system is not None and first_role != "system":
        out += [
            (True, SYSTEM_MARKER),
            (False, "system"),
            (True, MIDDLE),
            (False, default_system),
            (True, END),
        ]
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or "role" not in msg:
            raise ChatFormatError(f"messages[{i}] must be an object with a 'role', got {msg!r}")
        role = msg["role"]
        if role not in KNOWN_ROLES:
            raise ChatFormatError(f"messages[{i}].role must be one of {KNOWN_ROLES}, got {role!r}")
        pieces = content_pieces[i] if content_pieces is not None else None
        text = _content_text(msg, i) if pieces is None else ""
        name = msg.get("name") or role
        out += [(True, ROLE_MARKER.get(role, SYSTEM_MARKER)), (False, str(name)), (True, MIDDLE)]
        if pieces is not None:
            out += [*pieces, (True, END)]
            continue
        if role == "tool":
            text = f"## Return of {msg.get('tool_call_id', '')}\n{text}"
        if role == "assistant" and thinking:
            reasoning = msg.get("reasoning_content") or ""
            text = f"<think>{reasoning}</think>{text}"
        out += [(False, text), (True, END)]
    if add_generation_prompt:
        out += [(True, ROLE_MARKER["assistant"]), (False, "assistant"), (True, MIDDLE)]
    return [(s, t) for s, t in out if t]


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    default_system: str | None = None,
    thinking: bool = False,
) -> str:
    """The chat prompt as one string (for display/logging; tokenize with :func:`chat_prompt_ids`)."""
    return "".join(t for _, t in _segments(messages, add_generation_prompt, default_system, thinking))


def chat_prompt_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    default_system: str | None = None,
    thinking: bool = False,
    add_bos: bool = False,
    content_pieces: Sequence[list[tuple[bool, str]] | None] | None = None,
) -> list[int]:
    """Token ids of the chat prompt; markers are special ids, content is plain text (``content_pieces``: see
    ``_segments``)."""
    ids: list[int] = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
    for special, text in _segments(messages, add_generation_prompt, default_system, thinking, content_pieces):
        ids += [tokenizer.special_id(text)] if special else tokenizer.encode(text)
    return ids


def chat_stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """Token ids that end an assistant turn: ``<|im_end|>`` and eos."""
    out = []
    try:
        out.append(tokenizer.special_id(END))
    except KeyError:
        pass
    if tokenizer.eos_id is not None:
        out.append(tokenizer.eos_id)
    return tuple(dict.fromkeys(out))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting UTF-8 characters.

    ``push(token_id) -> str`` returns the newly completed text; incomplete byte sequences are held until
    the next token completes them (``flush`` emits what is left, replacing invalid bytes).
    Special tokens are dropped when ``skip_special``.
    """

    def __init__(self, tokenizer: Any, skip_special: bool = True):
        self.tok = tokenizer
        self.skip_special = skip_special
        self._pending = b""

    def push(self, token_id: int) -> str:
        if self.skip_special and self.tok.is_special(token_id):
            return ""
        self._pending += self.tok.token_bytes(token_id)
        # emit the longest prefix that is complete UTF-8
        for cut in range(len(self._pending), max(len(self._pending) - 4, -1), -1):
            try:
                text = self._pending[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self._pending = self._pending[cut:]
            return text
        text = self._pending.decode("utf-8", errors="replace")  # not a UTF-8 prefix at all
        self._pending = b""
        return text

    def flush(self) -> str:
        text = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        return text
