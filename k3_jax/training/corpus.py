"""The bundled corpus: build it (text + tokenizer + pre-tokenized shard) and load it.

Source (see ``k3_jax/data/README.md``): English prose shipped with CPython itself, under the PSF License v2
(permissive): the Python Language Reference topics in ``pydoc_data/topics.py`` split into sections, plus
the docstrings (modules, classes, functions; ≥ 200 characters) of the top-level pure-Python stdlib modules.

Files written to ``k3_jax/data/`` (package data, so training needs no tokenization step):
  * ``corpus.jsonl.gz``          one ``{"text": ...}`` per document,
  * ``tokenizer/bundled.tiktoken`` the 1024-token BPE (:mod:`k3_jax.training.bpe`),
  * ``corpus_tokens.npz``        ``tokens`` uint16 [N] (documents back to back, no bos/eos) and
                                 ``offsets`` int64 [D+1] (document d = tokens[offsets[d]:offsets[d+1]]).

Rebuild with ``python -m k3_jax.training.corpus`` (output depends on the Python version's stdlib; the
shipped files were made with CPython 3.12.1).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from k3_jax.tokenizer import BUNDLED_DIR, BUNDLED_RANKS, BUNDLED_SPECIALS, Tokenizer, write_rank_file

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
CORPUS_FILE = DATA_DIR / "corpus.jsonl.gz"
TOKENS_FILE = DATA_DIR / "corpus_tokens.npz"
BUNDLED_VOCAB = 1024
MAX_DOC_CHARS = 4000
MIN_DOC_CHARS = 200


def _split_paragraphs(text: str, max_chars: int) -> Iterator[str]:
    """Split ``text`` at blank lines into chunks of at most ~``max_chars`` characters."""
    buf: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        if buf and size + len(para) > max_chars:
            yield "\n\n".join(buf)
            buf, size = [], 0
        buf.append(para)
        size += len(para) + 2
    if buf:
        yield "\n\n".join(buf)


def stdlib_documents() -> list[str]:
    """The corpus documents, in a fixed order (language-reference sections, then stdlib docstrings)."""
    import pydoc_data.topics as topics

    docs: list[str] = []
    for name in sorted(topics.topics):
        docs.extend(c.strip() for c in _split_paragraphs(topics.topics[name], MAX_DOC_CHARS))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= MIN_DOC_CHARS:
                    docs.extend(c.strip() for c in _split_paragraphs(doc, MAX_DOC_CHARS))
    return [d for d in docs if len(d) >= MIN_DOC_CHARS // 4]


def load_corpus_texts(path: Path = CORPUS_FILE) -> list[str]:
    """Documents of a ``.jsonl[.gz]`` corpus (one ``{"text": ...}`` object per line)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def tokenize_documents(tok: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``texts`` -> (tokens [N] uint16|uint32, offsets [D+1] int64); no bos/eos added."""
    ids = tok.encode_batch(texts)
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(x) for x in ids])
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    tokens = np.fromiter((t for x in ids for t in x), dtype=dtype, count=int(offsets[-1]))
    return tokens, offsets


def save_token_shard(path: str | Path, tokens: np.ndarray, offsets: np.ndarray) -> None:
    np.savez(path, tokens=tokens, offsets=offsets)


def load_token_shard(path: str | Path = TOKENS_FILE) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [N], offsets [D+1] int64) from an ``.npz`` written by :func:`save_token_shard`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"token shard not found: {path} (make one with python -m k3_jax.training.tokenize)")
    with np.load(path) as z:
        for key in ("tokens", "offsets"):
            if key not in z:
                raise KeyError(f"{path}: missing array {key!r}; have {list(z.keys())}")
        tokens, offsets = z["tokens"], z["offsets"].astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 0):
        raise ValueError(f"{path}: offsets must rise from 0 to len(tokens)={len(tokens)}")
    return tokens, offsets


def build(vocab_size: int = BUNDLED_VOCAB) -> None:
    """Rebuild corpus text, tokenizer and token shard in ``k3_jax/data``."""
    from k3_jax.training.bpe import train_bpe

    docs = stdlib_documents()
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(CORPUS_FILE, "wb", mtime=0) as f:
        for d in docs:
            f.write((json.dumps({"text": d}, ensure_ascii=False) + "\n").encode("utf-8"))
    ranks = train_bpe(docs, vocab_size, byte_rank_offset=len(BUNDLED_SPECIALS))
    BUNDLED_DIR.mkdir(parents=True, exist_ok=True)
    write_rank_file(BUNDLED_DIR / BUNDLED_RANKS, ranks)
    tok = Tokenizer.bundled()
    tokens, offsets = tokenize_documents(tok, docs)
    save_token_shard(TOKENS_FILE, tokens, offsets)
    chars = sum(len(d) for d in docs)
    print(json.dumps({"documents": len(docs), "chars": chars, "tokens": int(len(tokens)),
                      "chars_per_token": round(chars / len(tokens), 3), "vocab": tok.vocab_size}))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    build()


if __name__ == "__main__":
    main()
