"""Paged MLA latent cache + slot-indexed KDA state pool.

K3's decode cache has two very different parts:

* **KDA layers** (69 in K3): a fixed-size recurrent state ``S [H, K, V] f32`` plus the short-conv history
  (the last ``W-1`` projected q/k/v inputs, ``[W-1, 3·H·Dk]``) per sequence, whatever its length. They live
  in a *slot pool* ``[L_kda, slots, ...]`` indexed by decode slot and are zeroed when a slot is freed.
* **MLA layers** (24 in K3): per token only the normalised latent ``ĉ`` (kv_lora) and the shared, unrotated
  ``k_rot`` (rope dim) — 576 values per token per layer for K3, never per-head K/V. They live in a *page
  pool* ``[L_mla, num_pages, page_size, kv_lora + rope]`` addressed through a page table ``[slots,
  max_pages]``. Page 0 is reserved as the null page: unused page-table entries point to it, and writes of
  padding tokens land there (it is never read as valid data because reads are masked by length).

Optional FP8 (``float8_e4m3fn``) latent storage keeps one f32 scale per token (``amax / 448``), so a token's
576 values cost 576 + 4 bytes.

Host-side bookkeeping (which pages a slot owns) is :class:`PageAllocator`; all device functions are pure and
jit-able with the cache arrays donated.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.cache import cache_bytes_per_sequence  # noqa: F401 - re-exported (see __all__)
from k3_jax.layers.paged_latent import FP8_MAX, write_pages

__all__ = [
    "PagedCacheSpec",
    "PagedCache",
    "PageAllocator",
    "init_paged_cache",
    "write_latent",
    "gather_latent",
    "reset_slots",
    "cache_bytes_per_sequence",
    "FP8_MAX",
]


@dataclasses.dataclass(frozen=True)
class PagedCacheSpec:
    """Static shapes of the serving cache."""

    num_slots: int
    max_len: int
    page_size: int
    num_pages: int  # including the reserved null page 0
    num_mla_layers: int
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim
    num_kda_layers: int
    kda_heads: int
    kda_head_dim: int
    conv_width: int  # short_conv_kernel_size; history kept = conv_width - 1
    latent_dtype: str = "bfloat16"  # "float32" | "bfloat16" | "float8_e4m3fn"
    conv_dtype: str = "float32"

    @property
    def max_pages_per_slot(self) -> int:
        return -(-self.max_len // self.page_size)

    @property
    def fp8(self) -> bool:
        return self.latent_dtype == "float8_e4m3fn"

    @staticmethod
    def from_config(
        cfg: Any,
        num_slots: int,
        max_len: int,
        page_size: int = 16,
        num_pages: int | None = None,
        latent_dtype: str = "bfloat16",
        conv_dtype: str = "float32",
    ) -> PagedCacheSpec:
        """Shapes for ``cfg`` (a :class:`k3_jax.config.K3Config`); by default enough pages for every slot
        to reach ``max_len`` (+1 null page)."""
        pages_per_slot = -(-max_len // page_size)
        return PagedCacheSpec(
            num_slots=num_slots,
            max_len=max_len,
            page_size=page_size,
            num_pages=num_pages if num_pages is not None else num_slots * pages_per_slot + 1,
            num_mla_layers=len(cfg.mla_layers),
            latent_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
            num_kda_layers=len(cfg.kda_layers),
            kda_heads=cfg.kda_num_heads,
            kda_head_dim=cfg.kda_head_dim,
            conv_width=cfg.short_conv_kernel_size,
            latent_dtype=latent_dtype,
            conv_dtype=conv_dtype,
        )


class PagedCache(NamedTuple):
    """Device arrays of the serving cache (a pytree; donate it to the decode step)."""

    latent: jax.Array  # [L_mla, P, S, D] latent_dtype
    latent_scale: jax.Array  # [L_mla, P, S] f32 (ones unless fp8)
    page_table: jax.Array  # [slots, max_pages] i32 (0 = null page)
    lengths: jax.Array  # [slots] i32 tokens cached per slot
    kda_state: jax.Array  # [L_kda, slots, H, K, V] f32
    kda_conv: jax.Array  # [L_kda, slots, W-1, 3·H·Dk] conv_dtype


def init_paged_cache(spec: PagedCacheSpec) -> PagedCache:
    """All-zero cache (every page-table entry points to the null page)."""
    hk = spec.kda_heads * spec.kda_head_dim
    return PagedCache(
        latent=jnp.zeros((spec.num_mla_layers, spec.num_pages, spec.page_size, spec.latent_dim), spec.latent_dtype),
        latent_scale=jnp.ones((spec.num_mla_layers, spec.num_pages, spec.page_size), jnp.float32),
        page_table=jnp.zeros((spec.num_slots, spec.max_pages_per_slot), jnp.int32),
        lengths=jnp.zeros((spec.num_slots,), jnp.int32),
        kda_state=jnp.zeros(
            (spec.num_kda_layers, spec.num_slots, spec.kda_heads, spec.kda_head_dim, spec.kda_head_dim),
            jnp.float32,
        ),
        kda_conv=jnp.zeros((spec.num_kda_layers, spec.num_slots, spec.conv_width - 1, 3 * hk), spec.conv_dtype),
    )


class OutOfPages(RuntimeError):
    """The page pool cannot hold the requested tokens; the scheduler should wait or preempt."""


class PageAllocator:
    """Host-side page bookkeeping: a free list, the page ids mapped by each slot, and a reference count per page.

    ``table`` (numpy ``[slots, max_pages] i32``) mirrors the device page table; push it with
    ``cache._replace(page_table=jnp.asarray(alloc.table))`` after changes.

    A page is referenced by every slot that maps it and by every other holder that called :meth:`retain`
    (the prefix cache); it returns to the free list when its count drops to 0. Invariant: a page in the free
    list has count 0, every mapped page has count >= 1. A page mapped by several slots is read-only for all of
    them (the prefix cache shares only pages below every sharer's length: writes land at positions >= length).
    """

    def __init__(self, spec: PagedCacheSpec):
        self.spec = spec
        self.free_pages: list[int] = list(range(spec.num_pages - 1, 0, -1))  # page 0 = null
        self.owned: list[list[int]] = [[] for _ in range(spec.num_slots)]
        self.table = np.zeros((spec.num_slots, spec.max_pages_per_slot), np.int32)
        self.refs = np.zeros(spec.num_pages, np.int32)

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def pages_needed(self, slot: int, length: int) -> int:
        return max(0, -(-length // self.spec.page_size) - len(self.owned[slot]))

    def can_fit(self, slot: int, length: int) -> bool:
        return length <= self.spec.max_len and self.pages_needed(slot, length) <= self.num_free

    def _map(self, slot: int, page: int) -> None:
        self.table[slot, len(self.owned[slot])] = page
        self.owned[slot].append(page)

    def ensure(self, slot: int, length: int) -> bool:
        """Make ``slot`` own enough pages for ``length`` tokens. Returns True when the table changed."""
        if length > self.spec.max_len:
            raise ValueError(f"slot {slot}: length {length} exceeds max_len {self.spec.max_len}")
        need = self.pages_needed(slot, length)
        if need > self.num_free:
            raise OutOfPages(f"slot {slot} needs {need} more pages, {self.num_free} free")
        for _ in range(need):
            page = self.free_pages.pop()
            self.refs[page] = 1
            self._map(slot, page)
        return need > 0

    def share(self, slot: int, pages: list[int]) -> None:
        """Map already-referenced ``pages`` (in order) as the first pages of the empty ``slot`` (count + 1 each)."""
        if self.owned[slot]:
            raise ValueError(f"slot {slot} already maps {len(self.owned[slot])} pages; share() needs an empty slot")
        for page in pages:
            if page <= 0 or self.refs[page] < 1:
                raise ValueError(f"page {page} is not a referenced page (count {self.refs[page]})")
            self.refs[page] += 1
            self._map(slot, page)

    def retain(self, page: int) -> None:
        """Add a reference to a mapped or retained page."""
        if page <= 0 or self.refs[page] < 1:
            raise ValueError(f"page {page} is not a referenced page (count {self.refs[page]})")
        self.refs[page] += 1

    def release(self, page: int) -> bool:
        """Drop a reference; returns True when the page went back to the free list."""
        if self.refs[page] < 1:
            raise ValueError(f"page {page} has no reference to release")
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free_pages.append(page)
            return True
        return False

    def free(self, slot: int) -> None:
        """Drop the slot's references to its pages (unreferenced ones return to the pool) and point its table row
        at the null page."""
        for page in reversed(self.owned[slot]):
            self.release(page)
        self.owned[slot] = []
        self.table[slot] = 0


def write_latent(
    latent: jax.Array,
    latent_scale: jax.Array,
    page_table: jax.Array,
    positions: jax.Array,
    values: jax.Array,
    valid: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter new tokens of one MLA layer into its page pool (:func:`k3_jax.layers.paged_latent.write_pages`).

    Args:
      latent: ``[P, S, D]`` pool of one layer; latent_scale: ``[P, S] f32``.
      page_table: ``[B, max_pages] i32`` rows of the slots being written.
      positions: ``[B, T] i32`` absolute token positions; values: ``[B, T, D]``; valid: ``[B, T] bool``
        (invalid tokens, and tokens at positions past the table's ``max_pages · S``, go to the null page 0).
    Returns: updated ``(latent, latent_scale)``.
    """
    return write_pages(latent, latent_scale, page_table, positions, values, valid)


def gather_latent(
    latent: jax.Array, latent_scale: jax.Array, page_table: jax.Array, dtype: Any = jnp.float32
) -> jax.Array:
    """Gather the pages of ``B`` slots into a contiguous ``[B, max_pages·S, D]`` (dequantised, ``dtype``).

    Positions beyond a slot's length hold garbage (null-page or stale data): mask them by length.
    """
    b, max_pages = page_table.shape
    _, s, d = latent.shape
    pages = latent[page_table]  # [B, max_pages, S, D]
    out = pages.astype(jnp.float32)
    if latent.dtype == jnp.float8_e4m3fn:
        out = out * latent_scale[page_table][..., None]
    return out.reshape(b, max_pages * s, d).astype(dtype)


def reset_slots(cache: PagedCache, slot_mask: jax.Array) -> PagedCache:
    """Zero the KDA state/conv and length of the slots where ``slot_mask [slots] bool`` is set.

    MLA pages need no zeroing: they are returned to the allocator and masked by length on read.
    """
    # where (not a multiply): a NaN left by an idle slot must not survive the reset
    state = jnp.where(slot_mask[None, :, None, None, None], 0, cache.kda_state).astype(cache.kda_state.dtype)
    conv = jnp.where(slot_mask[None, :, None, None], 0, cache.kda_conv).astype(cache.kda_conv.dtype)
    return cache._replace(kda_state=state, kda_conv=conv, lengths=jnp.where(slot_mask, 0, cache.lengths))


def device_cache_bytes(cache: PagedCache) -> int:
    """Bytes actually held by a cache pytree (for comparison with the analytic figure)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)))
