"""Tokenizers for k3-jax: the release's tiktoken BPE (Kimi layout) and the bundled small BPE.

Both are byte-level BPE in tiktoken's *rank file* format: one line per token, ``base64(token bytes) rank``,
where the rank is both the token id and the merge priority (lower merges first). Nothing is ever
downloaded: the release tokenizer is read from a checkpoint directory, the bundled one from package data.

Kimi layout (K2/K3 ``tokenization_kimi.py``; K3 ``config.json`` vocab 163840):
  * ids ``0 .. N-1`` are the N mergeable ranks of ``tiktoken.model`` (N = 163584 for K3),
  * ids ``N .. N+255`` are 256 special tokens; their names come from ``tokenizer_config.json``'s
    ``added_tokens_decoder`` (e.g. ``[BOS]`` 163584, ``[EOS]`` 163585, ``<|im_end|>`` 163586 ...); unnamed
    slots are ``<|reserved_token_{id}|>``.
  * the pre-tokenizer regex is :data:`KIMI_PAT_STR` (Han runs split off, letter runs with an optional
    leading non-letter and English contractions, digits in groups of <= 3, punctuation, whitespace).
  bos/eos/pad ids come from the checkpoint's ``config.json`` when present (K3: 163584 / 163586 / 163839),
  else from the ``bos_token``/``eos_token``/``pad_token`` names of ``tokenizer_config.json``.

Bundled layout (``k3_jax/data/tokenizer/``; trained by :mod:`k3_jax.training.bpe` on the bundled corpus):
  ids 0..7 are special (``[PAD]`` 0, ``[BOS]`` 1, ``[EOS]`` 2 — matching ``configs/k3-tiny.json`` and
  ``configs/k3-small.json`` — then the Kimi chat markers), ids 8..263 the 256 single bytes, 264..1023 merges.
  The same 1024-token tokenizer serves k3-small (vocab 32768): ids >= 1024 are padding rows never produced.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import tiktoken

# Kimi's pre-tokenizer: alternatives joined with "|" (the `&&` class intersections are fancy-regex syntax,
# which tiktoken's Rust engine understands; Python's `regex` module needs the V1 flag for them).
_KIMI_PAT_PARTS = (
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
)
KIMI_PAT_STR = "|".join(_KIMI_PAT_PARTS)
KIMI_NUM_RESERVED_SPECIAL = 256

BUNDLED_DIR = Path(__file__).resolve().parent / "data" / "tokenizer"
BUNDLED_RANKS = "bundled.tiktoken"
BUNDLED_SPECIALS = ("[PAD]", "[BOS]", "[EOS]", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                    "<|im_middle|>", "<|im_end|>")
#: with ``Tokenizer.bundled(media=True)``: the release's media markers at ids 1024.. (after the bundled 1024 ids)
BUNDLED_MEDIA_SPECIALS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed; the message names the file and what was expected."""


# ------------------------------------------------------------------------------------------- rank files
def read_rank_file(path: str | os.PathLike) -> dict[bytes, int]:
    """Read a tiktoken rank file (``base64 rank`` per line) into ``{token bytes: rank}``."""
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"tokenizer rank file not found: {path}")
    ranks: dict[bytes, int] = {}
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = raw.strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise TokenizerError(f"{path}:{lineno}: expected 'base64 rank', got {line[:80]!r}")
            try:
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except ValueError as e:
                raise TokenizerError(f"{path}:{lineno}: bad entry {line[:80]!r}: {e}") from e
            if token in ranks:
                raise TokenizerError(f"{path}:{lineno}: token {token!r} listed twice")
            ranks[token] = rank
    if not ranks:
        raise TokenizerError(f"{path}: empty rank file")
    return ranks


def write_rank_file(path: str | os.PathLike, ranks: Mapping[bytes, int]) -> None:
    """Write ``{token bytes: rank}`` in tiktoken's rank-file format, sorted by rank."""
    with Path(path).open("wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")


# ------------------------------------------------------------------------------------------- tokenizer
class Tokenizer:
    """Byte-level BPE tokenizer over :class:`tiktoken.Encoding` with bos/eos/pad ids.

    ``encode`` treats special-token strings inside text as plain text unless ``allow_special=True``.
    """

    def __init__(
        self,
        ranks: Mapping[bytes, int],
        special_tokens: Mapping[str, int],
        *,
        pat_str: str = KIMI_PAT_STR,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        name: str = "k3",
    ):
        overlap = set(ranks.values()) & set(special_tokens.values())
        if overlap:
            raise TokenizerError(f"special token ids overlap mergeable ranks: {sorted(overlap)[:8]}")
        self.special_tokens = dict(special_tokens)
        self._enc = tiktoken.Encoding(
            name=name, pat_str=pat_str, mergeable_ranks=dict(ranks), special_tokens=self.special_tokens
        )
        self._special_ids = frozenset(self.special_tokens.values())
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.vocab_size = self._enc.n_vocab  # max id + 1

    # ----------------------------------------------------------------- constructors
    @classmethod
    def bundled(cls, media: bool = False) -> Tokenizer:
        """The bundled 1024-token BPE (package data), bos 1, eos 2, pad 0. ``media=True`` adds
        :data:`BUNDLED_MEDIA_SPECIALS` as ids 1024..1027 (``<|media_pad|>`` = 1027; vocabulary 1028)."""
        ranks = read_rank_file(BUNDLED_DIR / BUNDLED_RANKS)
        specials = {s: i for i, s in enumerate(BUNDLED_SPECIALS)}
        if media:
            base = max(ranks.values()) + 1
            specials.update({s: base + i for i, s in enumerate(BUNDLED_MEDIA_SPECIALS)})
        return cls(ranks, specials, bos_id=1, eos_id=2, pad_id=0, name="k3-bundled")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Load the release tokenizer from a checkpoint dir holding ``tiktoken.model`` (+ optional
        ``tokenizer_config.json`` and ``config.json``). ``path`` may also be the ``tiktoken.model`` file."""
        path = Path(path)
        ckpt_dir = path.parent if path.is_file() else path
        model_file = path if path.is_file() else path / "tiktoken.model"
        ranks = read_rank_file(model_file)
        n = len(ranks)
        if sorted(ranks.values()) != list(range(n)):
            raise TokenizerError(f"{model_file}: ranks are not the dense range 0..{n - 1}")
        names: dict[int, str] = {}
        tok_cfg = _read_json(ckpt_dir / "tokenizer_config.json")
        for key, attrs in (tok_cfg.get("added_tokens_decoder") or {}).items():
            if isinstance(attrs, dict) and isinstance(attrs.get("content"), str):
                names[int(key)] = attrs["content"]
        reserved = range(n, n + KIMI_NUM_RESERVED_SPECIAL)
        specials = {names.get(i, f"<|reserved_token_{i}|>"): i for i in reserved}

        def special_id(field: str) -> int | None:
            cfg = _read_json(ckpt_dir / "config.json")
            for c in (cfg.get("text_config") or {}, cfg):
                if isinstance(c.get(field), int):
                    return c[field]
            tok = tok_cfg.get(field.replace("_id", ""))
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return specials.get(tok) if isinstance(tok, str) else None

        return cls(ranks, specials, bos_id=special_id("bos_token_id"), eos_id=special_id("eos_token_id"),
                   pad_id=special_id("pad_token_id"), name="kimi")

    @classmethod
    def load(cls, path: str | os.PathLike | None) -> Tokenizer:
        """``None`` or ``"bundled"`` -> :meth:`bundled`; anything else -> :meth:`from_pretrained`."""
        if path is None or str(path) == "bundled":
            return cls.bundled()
        return cls.from_pretrained(path)

    # ----------------------------------------------------------------- encode / decode
    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False,
               allow_special: bool = False) -> list[int]:
        """Text -> token ids (``list[int]``), optionally framed by bos/eos."""
        if allow_special:
            ids = self._enc.encode(text, allowed_special="all")
        else:
            ids = self._enc.encode_ordinary(text)
        if add_bos:
            ids = [self._need(self.bos_id, "bos")] + ids
        if add_eos:
            ids = ids + [self._need(self.eos_id, "eos")]
        return ids

    def encode_batch(self, texts: Sequence[str], *, add_bos: bool = False,
                     add_eos: bool = False) -> list[list[int]]:
        """Many texts -> token ids (tiktoken threads), special strings as plain text."""
        out = self._enc.encode_ordinary_batch(list(texts))
        head = [self._need(self.bos_id, "bos")] if add_bos else []
        tail = [self._need(self.eos_id, "eos")] if add_eos else []
        return [head + ids + tail for ids in out] if (head or tail) else out

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Token ids -> text (invalid UTF-8 byte sequences become U+FFFD)."""
        ids = [int(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if i not in self._special_ids]
        return self._enc.decode(ids, errors="replace")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Token ids -> raw bytes (for streaming detokenization across UTF-8 boundaries)."""
        return self._enc.decode_bytes([int(i) for i in ids])

    def token_bytes(self, token_id: int) -> bytes:
        return self._enc.decode_single_token_bytes(int(token_id))

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special_ids

    def special_id(self, name: str) -> int:
        if name not in self.special_tokens:
            raise KeyError(f"no special token {name!r}; have {sorted(self.special_tokens)[:10]}...")
        return self.special_tokens[name]

    def _need(self, value: int | None, what: str) -> int:
        if value is None:
            raise TokenizerError(f"tokenizer has no {what} id")
        return value

    def __repr__(self) -> str:
        return (f"Tokenizer({self._enc.name!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, "
                f"eos={self.eos_id}, pad={self.pad_id})")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: invalid JSON: {e}") from e
