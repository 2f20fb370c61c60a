"""Tokenize user text into a token shard for training: ``python -m k3_jax.training.tokenize``.

Examples::

    python -m k3_jax.training.tokenize notes/*.txt --out my.npz               # bundled 1024-token BPE
    python -m k3_jax.training.tokenize data.jsonl --field text --out my.npz
    python -m k3_jax.training.tokenize book.txt --split-paragraphs --tokenizer /ckpt/K3 --out k3.npz
    python train.py --data my.npz

Inputs: ``.txt``/``.md`` files (one document each, or one per blank-line-separated block with
``--split-paragraphs``), ``.jsonl``/``.jsonl.gz`` (one document per line, text under ``--field``), or ``-``
for standard input. The shard is an ``.npz`` with ``tokens`` (uint16 when the vocabulary fits, else uint32)
and ``offsets`` [D+1] int64; bos/eos are added by the data pipeline, not stored.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from k3_jax.tokenizer import Tokenizer
from k3_jax.training.corpus import save_token_shard, tokenize_documents


def read_documents(path: str, *, field: str = "text", split_paragraphs: bool = False) -> Iterator[str]:
    """Documents of one input file (see module doc)."""
    if path == "-":
        text = sys.stdin.read()
        yield from (_paragraphs(text) if split_paragraphs else [text])
        return
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"input file not found: {p}")
    name = p.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(p, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                obj = json.loads(line)
                if field not in obj:
                    raise KeyError(f"{p}:{lineno}: no field {field!r} (have {sorted(obj)[:8]})")
                yield obj[field]
        return
    text = p.read_text(encoding="utf-8")
    yield from (_paragraphs(text) if split_paragraphs else [text])


def _paragraphs(text: str) -> list[str]:
    return [b.strip() for b in text.split("\n\n") if b.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("inputs", nargs="+", help=".txt/.md/.jsonl[.gz] files or - for stdin")
    ap.add_argument("--out", required=True, help="output shard (.npz)")
    ap.add_argument("--tokenizer", default="bundled",
                    help="'bundled' or a checkpoint dir / tiktoken.model file (release tokenizer)")
    ap.add_argument("--field", default="text", help="jsonl field holding the text")
    ap.add_argument("--split-paragraphs", action="store_true", help="one document per blank-line block")
    args = ap.parse_args(argv)
    tok = Tokenizer.load(args.tokenizer)
    docs = [d for path in args.inputs for d in read_documents(path, field=args.field,
                                                              split_paragraphs=args.split_paragraphs)]
    docs = [d for d in docs if d]
    if not docs:
        ap.error("no non-empty documents in the inputs")
    tokens, offsets = tokenize_documents(tok, docs)
    save_token_shard(args.out, tokens, offsets)
    print(json.dumps({"out": args.out, "documents": len(docs), "tokens": int(len(tokens)),
                      "dtype": str(tokens.dtype), "tokenizer": repr(tok)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
