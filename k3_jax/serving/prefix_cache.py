"""Hybrid prefix cache: KDA state snapshots at hash endpoints inside shared MLA pages (host-side bookkeeping).

Three independent granularities (:class:`PrefixCacheConfig`):

* **MLA page** (``page_size`` tokens): the engine's physical page of latent cache. Pages live in the engine's
  page pool (:class:`k3_jax.serving.paged_cache.PageAllocator`) and are reference-counted there; the cache
  holds one reference on every page one of its entries covers.
* **hash block** (``block_size`` tokens): the unit of prefix identity. Block ``i`` of a prompt has the chain
  hash ``h_i = blake2b(h_{i-1} | tokens of block i | media digests of block i)``; only full blocks are hashed.
  Each hashed block is a node that stores its tokens, its media digests and its parent, and a lookup checks
  all three, so two different prefixes never share an entry, even on a hash collision.
* **KDA checkpoint stride** (``stride`` tokens, a multiple of ``block_size``): endpoints ``e = k·stride`` where
  an entry may exist. An entry is ``(KDA snapshot of every KDA layer after e tokens, the pages covering [0,
  e))``; the snapshot is taken by the engine in the prefill pass itself (its prefill pieces end on the
  endpoints), never by a second prefill.

A hit at endpoint ``e`` gives the pages of ``[0, e)``: the full pages (``e // page_size`` of them) are shared
with the new request; the page holding ``e`` (when ``e`` is not a page boundary) is the partial page, which the
engine copies into a fresh page before writing tokens ``>= e`` into it (copy on write).

Memory: entries are evicted least recently used first, under two explicit byte budgets, one for the KDA
snapshots and one for the MLA pages the cache holds (a page is counted once however many entries share it).
An entry in use by an admission is pinned (reference count > 0) and is not evicted.

Media hook: ``media`` is a sequence of ``(start, end, digest)`` token spans (e.g. an image's placeholder
tokens and its content digest); a block's hash and identity include the digests of the spans that overlap it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["PrefixCacheConfig", "PrefixCache", "PrefixHit", "block_hashes", "MediaSpan"]

MediaSpan = tuple[int, int, bytes]  # [start, end) token span and the content digest of the media it holds


@dataclasses.dataclass(frozen=True)
class PrefixCacheConfig:
    """Granularities and budgets of the prefix cache.

    ``stride`` defaults to 8192 = 16 blocks: the prefill chunk of the long-context engine, so snapshot
    endpoints fall on chunk boundaries and cost no extra prefill call; a hit recomputes at most ``stride - 1``
    tokens (about 1/16 of a 131k prefix), and a 1M-token context has at most 128 endpoints (K3: ~0.45 GB each,
    so the KDA budget, not the stride, bounds what is kept).
    Budgets are bytes and have no default: a deployment states them (see ``sharding.plan``).
    """

    mla_budget_bytes: int
    kda_budget_bytes: int
    page_size: int = 6144
    block_size: int = 512
    stride: int = 8192

    def __post_init__(self) -> None:
        for name in ("page_size", "block_size", "stride"):
            if getattr(self, name) < 1:
                raise ValueError(f"prefix cache {name} must be >= 1, got {getattr(self, name)}")
        if self.stride % self.block_size:
            raise ValueError(f"prefix cache stride {self.stride} must be a multiple of block_size {self.block_size}")
        if self.mla_budget_bytes < 0 or self.kda_budget_bytes < 0:
            raise ValueError(f"prefix cache budgets must be >= 0 bytes, got mla={self.mla_budget_bytes} "
                             f"kda={self.kda_budget_bytes}")


def _media_of_block(media: Sequence[MediaSpan], start: int, end: int) -> tuple[bytes, ...]:
    return tuple(d for s, e, d in media if s < end and e > start)


def block_hashes(tokens: Sequence[int], block_size: int, media: Sequence[MediaSpan] = ()) -> list[bytes]:
    """Chain hashes of the full blocks of ``tokens`` (``len(tokens) // block_size`` of them, 16 bytes each)."""
    arr = np.asarray(tokens, np.int64)
    out, prev = [], b""
    for i in range(len(arr) // block_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(arr[i * block_size : (i + 1) * block_size].tobytes())
        for d in _media_of_block(media, i * block_size, (i + 1) * block_size):
            h.update(b"media")
            h.update(d)
        prev = h.digest()
        out.append(prev)
    return out


@dataclasses.dataclass(eq=False)
class _Node:
    """One hashed block of a cached prefix (exact identity: tokens + media + parent)."""

    key: bytes
    parent: _Node | None
    tokens: tuple[int, ...]
    media: tuple[bytes, ...]
    end: int  # tokens covered from the start of the prompt
    children: int = 0
    entry: _Entry | None = None


@dataclasses.dataclass(eq=False)
class _Entry:
    node: _Node
    pages: list[int]  # pool pages covering [0, end)
    snapshot: Any  # device pytree: the KDA entries of one slot row after `end` tokens
    snapshot_bytes: int
    pins: int = 0

    @property
    def end(self) -> int:
        return self.node.end


@dataclasses.dataclass
class PrefixHit:
    """A pinned entry found by :meth:`PrefixCache.lookup`; :meth:`PrefixCache.unpin` it when done."""

    end: int  # tokens served from the cache
    shared_pages: list[int]  # full pages the request maps read-only
    partial_page: int | None  # page holding tokens [shared·page_size, end) to copy, or None at a page boundary
    snapshot: Any
    _entry: _Entry


class PrefixCache:
    """Entries at stride endpoints over chains of block hashes, in LRU order, under two byte budgets.

    Args:
      config: granularities + budgets; ``config.page_size`` must equal the allocator's page size.
      allocator: the engine's page allocator (``retain`` / ``release``, counts per page).
      page_bytes: bytes of one page over all MLA layers (latent + scales).
    """

    def __init__(self, config: PrefixCacheConfig, allocator: Any, page_bytes: int):
        if allocator.spec.page_size != config.page_size:
            raise ValueError(f"prefix cache page_size {config.page_size} != the engine's page size "
                             f"{allocator.spec.page_size}")
        self.config, self.allocator, self.page_bytes = config, allocator, int(page_bytes)
        self._nodes: dict[bytes, _Node] = {}
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # id(entry), LRU first
        self._held: collections.Counter[int] = collections.Counter()  # page -> entries covering it
        self.snapshot_bytes = 0
        self.stats: collections.Counter[str] = collections.Counter()
        self._memo: tuple[Any, tuple, list[bytes]] | None = None  # (tokens object, media, its block hashes)

    def _hashes(self, tokens: Sequence[int], media: Sequence[MediaSpan], n_blocks: int) -> list[bytes]:
        """The first ``n_blocks`` chain hashes of ``tokens``; the last prompt's are kept, so the engine's calls for
        one prompt (lookup, then an insert per endpoint) hash it once. A stale memo (a list changed in place)
        cannot share an entry: every match also compares the tokens."""
        media = tuple(media)
        memo = self._memo
        n_all = len(tokens) // self.config.block_size
        if memo is None or memo[0] is not tokens or memo[1] != media or len(memo[2]) != n_all:
            memo = (tokens, media, block_hashes(tokens, self.config.block_size, media))
            self._memo = memo
        return memo[2][:n_blocks]

    # ------------------------------------------------------------------ sizes
    @property
    def mla_bytes(self) -> int:
        """Bytes of the distinct pages the cache holds."""
        return len(self._held) * self.page_bytes

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_pages(self) -> int:
        return len(self._held)

    def endpoints(self, start: int, stop: int) -> list[int]:
        """Stride endpoints ``e`` with ``start < e <= stop``."""
        s = self.config.stride
        return list(range((start // s + 1) * s, stop + 1, s))

    # ------------------------------------------------------------------ lookup
    def _walk(self, tokens: Sequence[int], media: Sequence[MediaSpan], limit: int) -> list[_Node]:
        """Nodes of the cached blocks matching ``tokens[:limit]`` exactly, from the first block on."""
        b = self.config.block_size
        nodes: list[_Node] = []
        parent = None
        for i, key in enumerate(self._hashes(tokens, media, limit // b)):
            node = self._nodes.get(key)
            lo, hi = i * b, (i + 1) * b
            if (node is None or node.parent is not parent or node.tokens != tuple(tokens[lo:hi])
                    or node.media != _media_of_block(media, lo, hi)):
                if node is not None:
                    self.stats["hash_mismatches"] += 1
                break
            nodes.append(node)
            parent = node
        return nodes

    def lookup(self, tokens: Sequence[int], media: Sequence[MediaSpan] = (), limit: int | None = None
               ) -> PrefixHit | None:
        """The longest entry whose prefix equals ``tokens[:end]`` with ``end <= limit`` (default
        ``len(tokens) - 1``: at least one token is left to prefill for the first logits), pinned; or None.
        Counts nothing: the engine calls :meth:`record` once per admitted request."""
        limit = len(tokens) - 1 if limit is None else min(limit, len(tokens))
        for node in reversed(self._walk(tokens, media, limit)):
            entry = node.entry
            if entry is not None:
                entry.pins += 1
                self._entries.move_to_end(id(entry))
                p = self.config.page_size
                full = entry.end // p
                return PrefixHit(end=entry.end, shared_pages=entry.pages[:full],
                                 partial_page=entry.pages[full] if entry.end % p else None,
                                 snapshot=entry.snapshot, _entry=entry)
        return None

    def unpin(self, hit: PrefixHit | None) -> None:
        if hit is not None:
            hit._entry.pins -= 1

    def record(self, prompt_tokens: int, hit: PrefixHit | None) -> None:
        """Count one admitted request: a query, a hit (or miss) and the tokens it took from the cache."""
        self.stats["queries"] += 1
        self.stats["prompt_tokens"] += prompt_tokens
        if hit is not None:
            self.stats["hits"] += 1
            self.stats["cached_tokens"] += hit.end

    def has_entry(self, tokens: Sequence[int], end: int, media: Sequence[MediaSpan] = ()) -> bool:
        nodes = self._walk(tokens, media, end)
        return bool(nodes) and nodes[-1].end == end and nodes[-1].entry is not None

    # ------------------------------------------------------------------ insert / evict
    def insert(self, tokens: Sequence[int], end: int, pages: Sequence[int], snapshot: Any, snapshot_bytes: int,
               media: Sequence[MediaSpan] = ()) -> bool:
        """Store the entry for ``tokens[:end]`` (``end`` a stride endpoint): ``pages`` cover ``[0, end)`` (the
        cache takes one reference on each), ``snapshot`` is the KDA state after ``end`` tokens. Evicts LRU entries
        to stay in budget; returns False (nothing stored) when the entry alone exceeds a budget or exists."""
        c = self.config
        if end % c.stride or end < c.stride or end > len(tokens):
            raise ValueError(f"prefix cache entry end {end} must be a positive multiple of stride {c.stride} "
                             f"within the {len(tokens)} tokens")
        n_pages = -(-end // c.page_size)
        if len(pages) < n_pages:
            raise ValueError(f"an entry of {end} tokens needs {n_pages} pages, got {len(pages)}")
        if snapshot_bytes > c.kda_budget_bytes or n_pages * self.page_bytes > c.mla_budget_bytes:
            self.stats["over_budget"] += 1
            return False
        nodes = self._walk(tokens, media, end)
        if nodes and nodes[-1].end == end and nodes[-1].entry is not None:
            return False
        b = c.block_size
        keys = self._hashes(tokens, media, end // b)
        parent = nodes[-1] if nodes else None
        for i in range(len(nodes), len(keys)):
            lo, hi = i * b, (i + 1) * b
            if keys[i] in self._nodes:  # a different prefix with this hash: keep the cached one, store nothing
                self.stats["hash_mismatches"] += 1
                self._prune(parent)
                return False
            node = _Node(keys[i], parent, tuple(int(t) for t in tokens[lo:hi]), _media_of_block(media, lo, hi), hi)
            self._nodes[node.key] = node
            if parent is not None:
                parent.children += 1
            parent = node
        entry = _Entry(parent, list(pages[:n_pages]), snapshot, int(snapshot_bytes))
        parent.entry = entry
        self._entries[id(entry)] = entry
        for page in entry.pages:
            if self._held[page] == 0:
                self.allocator.retain(page)
            self._held[page] += 1
        self.snapshot_bytes += entry.snapshot_bytes
        self.stats["inserts"] += 1
        entry.pins += 1  # not evicted by its own insertion
        self._fit_budgets()
        entry.pins -= 1
        return True

    def _fit_budgets(self) -> None:
        c = self.config
        while self.snapshot_bytes > c.kda_budget_bytes and self._evict_lru("kda_budget"):
            pass
        while self.mla_bytes > c.mla_budget_bytes and self._evict_lru("mla_budget"):
            pass

    def evict_for_free_pages(self, need: int) -> None:
        """Evict LRU entries until the pool has ``need`` free pages or no unpinned entry is left."""
        while self.allocator.num_free < need and self._evict_lru("pool"):
            pass

    def _evict_lru(self, reason: str) -> bool:
        for key, entry in self._entries.items():
            if entry.pins == 0:
                del self._entries[key]
                self._drop(entry)
                self.stats[f"evictions_{reason}"] += 1
                return True
        return False

    def _drop(self, entry: _Entry) -> None:
        self.snapshot_bytes -= entry.snapshot_bytes
        self.stats["evicted_snapshots"] += 1
        self.stats["evicted_snapshot_bytes"] += entry.snapshot_bytes
        for page in entry.pages:
            self._held[page] -= 1
            if self._held[page] == 0:
                del self._held[page]
                self.stats["evicted_pages"] += 1
                self.allocator.release(page)
        entry.node.entry = None
        entry.snapshot = None
        self._prune(entry.node)

    def _prune(self, node: _Node | None) -> None:
        """Remove ``node`` and its ancestors while they hold no entry and no child."""
        while node is not None and node.entry is None and node.children == 0:
            del self._nodes[node.key]
            if node.parent is not None:
                node.parent.children -= 1
            node = node.parent

    def clear(self) -> None:
        """Drop every entry (pinned ones too): the device pages they described are gone."""
        for entry in list(self._entries.values()):
            self._drop(entry)
        self._entries.clear()
        self.stats["clears"] += 1
