"""The MLA layer's paged latent cache: new tokens written straight into their pages, attention read through the
page table (:mod:`pallas_kernels.paged_latent_attention`), no dense view of any row.

A paged cache entry of an MLA layer is ``{"pages": [(R,) P, S, C + Dr], "scale": [(R,) P, S] f32}`` (``R``: the
segment's stacked repeats, present on the in-place decode path where the layer reads and writes repeat ``layer``);
the page table ``[B, max_pages] i32`` maps row ``b``'s token ``p`` to page ``table[b, p // S]``, offset ``p % S``.
Page 0 is the null page: tokens whose table entry is 0 (rows the caller masked out, positions past the mapped
pages) are written there and never read. FP8 (``float8_e4m3fn``) pages keep one f32 scale per token
(``amax / FP8_MAX``); other dtypes leave the scales untouched (ones).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from k3_jax.layers.common import einsum_f32
from pallas_kernels import paged_latent_attention as pla
from sharding.local_kernels import active_mesh_size

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [..., D]`` -> (e4m3 values, per-vector f32 scale ``[...]``)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (x / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def write_pages(pages: jax.Array, page_scale: jax.Array, table: jax.Array, positions: jax.Array, values: jax.Array,
                valid: jax.Array | None = None, layer: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Scatter tokens into a page pool in place.

    Args:
      pages: ``[P, S, D]`` (or ``[R, P, S, D]`` with ``layer``); page_scale: ``pages.shape[:-1]`` f32.
      table: ``[B, max_pages] i32``.  positions: ``[B, T] i32`` absolute token positions.
      values: ``[B, T, D]``.  valid: ``[B, T] bool`` or None (all); invalid tokens, tokens at positions outside
        ``[0, max_pages · S)`` and tokens whose table entry is 0 go to the null page 0.
      layer: scalar i32 repeat of a stacked pool, or None.
    Returns: updated ``(pages, page_scale)`` (the scales change only for FP8 pages).
    """
    page_size = pages.shape[-2]
    max_pages = table.shape[1]
    ok = (positions >= 0) & (positions < max_pages * page_size)
    if valid is not None:
        ok = ok & valid
    page = jnp.take_along_axis(table, jnp.clip(positions // page_size, 0, max_pages - 1), axis=1)
    page = jnp.where(ok, page, 0)
    offset = jnp.where(ok, positions % page_size, 0)
    at = (page, offset) if layer is None else (layer, page, offset)
    if pages.dtype == jnp.float8_e4m3fn:
        q, scale = quantize_fp8(values)
        return pages.at[at].set(q, mode="drop"), page_scale.at[at].set(scale, mode="drop")
    return pages.at[at].set(values.astype(pages.dtype), mode="drop"), page_scale


def paged_cached_attention(implementation: str, platform: str | None, q_nope: jax.Array, q_rot: jax.Array,
                           new_entries: jax.Array, entry: dict, table: jax.Array, lengths: jax.Array,
                           kv_kernel: jax.Array, scale: float,
                           layer: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """Append ``new_entries [B, T, C + Dr]`` at ``lengths .. lengths + T - 1`` of each row's pages, then attend
    the queries at those positions (``q_nope [B, T, H, Dn]``, ``q_rot [B, T, H, Dr]``, compute dtype) in the
    absorbed form over each row's pages up to them (``kv_kernel [C, H, Dn + Dv]``), through the registry
    :data:`pallas_kernels.paged_latent_attention.PAGED_DECODE` with ``implementation``.
    Returns ``(o [B, T, H, Dv] in q_nope.dtype, the updated entry)``."""
    t = q_nope.shape[1]
    dt, dn = q_nope.dtype, q_nope.shape[-1]
    positions = lengths[:, None] + jnp.arange(t, dtype=lengths.dtype)[None, :]
    pages, page_scale = write_pages(entry["pages"], entry["scale"], table, positions, new_entries, layer=layer)
    q_lat = einsum_f32("bthd,chd->bthc", q_nope, kv_kernel[..., :dn].astype(dt)).astype(dt)
    o_lat = pla.paged_attention(implementation, q_lat, q_rot, pages,
                                page_scale if pages.dtype == jnp.float8_e4m3fn else None, table, lengths, scale,
                                layer, platform=platform, mesh_devices=active_mesh_size())
    o = einsum_f32("bthc,chd->bthd", o_lat, kv_kernel[..., dn:].astype(dt)).astype(dt)
    return o, {"pages": pages, "scale": page_scale}


def is_paged(entry: Any) -> bool:
    """Whether an MLA cache entry is a page pool (``{"pages", "scale"}``) rather than ``{"latent"}`` rows."""
    return isinstance(entry, dict) and "pages" in entry
