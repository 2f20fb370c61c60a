"""A small byte-level BPE trainer producing tiktoken rank files (for the bundled tokenizer).

Algorithm: pre-split text with the Kimi regex (:data:`k3_jax.tokenizer.KIMI_PAT_STR`), count unique pieces,
start from single bytes and repeatedly merge the most frequent adjacent pair (ties broken by the smaller
byte string, so training is deterministic). Pair counts are updated incrementally: only the pieces that
contain the merged pair are re-counted. The learned token for merge m gets rank ``first_merge_rank + m``;
single bytes get ``byte_rank_offset + b``. Encoding with these ranks in tiktoken (lowest-rank pair merges
first) reproduces the merge order.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

import regex

from k3_jax.tokenizer import KIMI_PAT_STR


def pretokenize_counts(texts: Iterable[str], pat_str: str = KIMI_PAT_STR) -> Counter[bytes]:
    """Counts of regex pieces (UTF-8 bytes) over ``texts``."""
    pat = regex.compile(pat_str, flags=regex.V1)  # V1: `&&` set intersection, as in fancy-regex
    counts: Counter[bytes] = Counter()
    for text in texts:
        counts.update(m.encode("utf-8") for m in pat.findall(text))
    return counts


def train_bpe(texts: Iterable[str], vocab_size: int, *, byte_rank_offset: int = 0,
              pat_str: str = KIMI_PAT_STR) -> dict[bytes, int]:
    """Learn ``{token bytes: rank}`` with ranks in ``[byte_rank_offset, vocab_size)``.

    ``vocab_size`` counts everything below it (ids under ``byte_rank_offset`` are left for special tokens),
    so ``vocab_size - byte_rank_offset - 256`` merges are learned (fewer if the corpus runs out of pairs).
    """
    n_merges = vocab_size - byte_rank_offset - 256
    if n_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} < byte_rank_offset {byte_rank_offset} + 256 byte tokens")
    ranks: dict[bytes, int] = {bytes([b]): byte_rank_offset + b for b in range(256)}
    counts = pretokenize_counts(texts, pat_str)
    words: list[list[bytes]] = [[bytes([b]) for b in w] for w in counts]
    freqs: list[int] = list(counts.values())

    pair_count: Counter[tuple[bytes, bytes]] = Counter()
    pair_where: dict[tuple[bytes, bytes], set[int]] = defaultdict(set)
    for i, w in enumerate(words):
        for p in zip(w, w[1:], strict=False):
            pair_count[p] += freqs[i]
            pair_where[p].add(i)

    next_rank = byte_rank_offset + 256
    for _ in range(n_merges):
        if not pair_count:
            break
        best = max(pair_count.items(), key=lambda kv: (kv[1], _neg(kv[0][0] + kv[0][1])))[0]
        merged = best[0] + best[1]
        if merged not in ranks:
            ranks[merged] = next_rank
            next_rank += 1
        for i in list(pair_where.get(best, ())):
            w, f = words[i], freqs[i]
            for p in zip(w, w[1:], strict=False):  # remove this word's old pairs
                pair_count[p] -= f
                if pair_count[p] <= 0:
                    del pair_count[p]
                pair_where[p].discard(i)
            out: list[bytes] = []
            j = 0
            while j < len(w):
                if j + 1 < len(w) and w[j] == best[0] and w[j + 1] == best[1]:
                    out.append(merged)
                    j += 2
                else:
                    out.append(w[j])
                    j += 1
            words[i] = out
            for p in zip(out, out[1:], strict=False):
                pair_count[p] += f
                pair_where[p].add(i)
        pair_count.pop(best, None)
        pair_where.pop(best, None)
    return ranks


class _neg:
    """Sort key that reverses bytes ordering (so max() prefers the lexicographically smaller string)."""

    __slots__ = ("b",)
    __hash__ = None

    def __init__(self, b: bytes):
        self.b = b

    def __lt__(self, other: _neg) -> bool:
        return self.b > other.b

    def __gt__(self, other: _neg) -> bool:
        return self.b < other.b

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _neg) and self.b == other.b
