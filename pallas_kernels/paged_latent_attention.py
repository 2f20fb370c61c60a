"""MLA decode attention in the absorbed form over a paged latent cache, read through the page table in place.

The pages of one MLA layer are a pool ``[P, S, C + Dr]`` (or a stack ``[R, P, S, C + Dr]`` of a segment's layers,
read at a traced ``layer``) holding per token the normalised latent ĉ (C) and the shared key part (Dr); row ``b``'s
token ``p`` lives in page ``table[b, p // S]`` at offset ``p % S``. Page 0 is the null page: a table entry of 0 is
never read (its positions are invisible). For queries ``q_lat [B, T, H, C]`` (the no-position part already
multiplied into the latent space), ``q_rot [B, T, H, Dr]`` and ``pos [B]`` (query ``t`` of row ``b`` sits at
``pos[b] + t`` and sees the positions up to it on mapped pages)::

    s[b, t, h, p] = scale · (q_lat[b, t, h] · ĉ[b, p] + q_rot[b, t, h] · k_rot[b, p])
    o_lat[b, t, h] = Σ_p softmax_p(s[b, t, h])[p] · ĉ[b, p]        (up-projected by the value weights outside)

FP8 pages carry one f32 scale per token (``page_scale [(R,) P, S]``); the values read are ``page · scale``.

Implementations (registry :data:`PAGED_DECODE`, ``cfg.mla_paged_decode_implementation``):

* :func:`paged_attention_reference`: every row's whole table gathered into a dense ``[B, max_pages · S, C + Dr]``
  view, then one masked softmax (the engine's former path; the tests' reference);
* ``xla`` (:func:`paged_attention_xla`): split-K over work items (FlashDecoding / paged decode): each row's pages
  up to its last visible position are cut into items of ``pages_per_item`` pages; a ``lax.while_loop`` visits
  only the items that exist (``items_per_step`` per step, rows of very different lengths packed together), each
  step gathering just its items' pages, computing partial softmax statistics, and merging them into the rows'
  running (max, denominator, fp32 output) by a log-sum-exp merge. Reads ``Σ_b len_b`` positions (rounded up to
  items), not ``B · max_len``;
* ``triton`` (:func:`paged_attention_triton`): Pallas Triton split-K flash decoding: each row's visited positions
  cut into equal splits, one program per (query-row block, split, row) walking its positions ``step`` at a time,
  each step's rows gathered from their pages through the table, with an online softmax; the splits' partial (max,
  denominator, output) merged by log-sum-exp. Non-FP8 pages, one device, C / Dr / page size powers of two >= 16;
* ``mosaic_gpu`` (:mod:`pallas_kernels.paged_latent_attention_mosaic_gpu`): Pallas Mosaic GPU split-K flash
  decoding with wgmma and TMA (sm_90): 64 query rows per CTA, a memory warpgroup loading each step's pages through
  the table into two slots, two compute warpgroups sharing the output's columns; bf16, one device. After ``triton``
  in the order until the GPU suite has run with it first;
* ``mosaic_tpu`` (:func:`paged_attention_tpu`): Pallas Mosaic TPU flash decoding with the page table and the
  positions scalar-prefetched: grid ``(B, max_pages)``, one page per step DMA'd straight from the pool at
  ``table[b, j]`` (steps past the row's last visible page repeat the previous page index: no DMA, no work), online
  softmax in fp32 VMEM scratch. Non-FP8 pages, one device (no ``shard_map`` wrapper).

Scores and softmax are fp32; probabilities are cast to the query dtype for the value product (the xla and kernel
forms cast unnormalised probabilities and divide the fp32 accumulator at the end: equal to the reference in fp32,
within bf16 rounding in bf16). Rows with no visible position give zeros. Forward only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.forward_only import forward_only
from pallas_kernels.registry import (
    Backend,
    Registry,
    platform_reason,
    sm90_reason,
    target_compute_capability,
    target_platform,
    triton_missing_reason,
)

NEG_INF = -1e30
HIGHEST = jax.lax.Precision.HIGHEST
ITEM_TOKENS = 512
"""Default positions per work item of :func:`paged_attention_xla` (``pages_per_item = ITEM_TOKENS // S``)."""
STEP_TOKENS = 16384
"""Default positions × queries per loop step of :func:`paged_attention_xla` (``items_per_step`` follows)."""
HEAD_BLOCK = 16
"""Query rows (of the ``T·H``) per program of :func:`paged_attention_triton`."""
STEP_POSITIONS = 64
"""Cached positions :func:`paged_attention_triton` reads per loop step (gathered row by row through the table)."""
SPLIT_POSITIONS = 1024
""":func:`paged_attention_triton` cuts each row's visited positions into ``clamp(max_pages · S // SPLIT_POSITIONS,
1, MAX_SPLITS)`` splits."""
MAX_SPLITS = 16


@dataclasses.dataclass(frozen=True)
class PagedDecodeCall:
    """What the backends look at: target platform, query dtype, page dtype, ``shape = (B, T, H, C, Dr, S,
    max_pages)``, the devices of the active mesh, and whether the Pallas interpreter may stand in (CPU tests)."""

    platform: str
    dtype: str
    page_dtype: str
    shape: tuple[int, int, int, int, int, int, int]
    mesh_devices: int = 1
    interpret: bool = False
    compute_capability: float | None = None


def _tpu_reason(call: PagedDecodeCall) -> str | None:
    if (reason := platform_reason(call, "tpu")) is not None:
        return reason
    if call.dtype not in ("float32", "bfloat16"):
        return f"takes float32 or bfloat16 queries, got {call.dtype}"
    if call.page_dtype not in ("float32", "bfloat16"):
        return f"reads float32 or bfloat16 pages, got {call.page_dtype} (fp8 pages: xla)"
    if call.mesh_devices > 1:
        return f"runs on one device (no shard_map wrapper), the active mesh has {call.mesh_devices}"
    return None


def _triton_reason(call: PagedDecodeCall) -> str | None:
    missing = triton_missing_reason()
    if missing is not None:
        return missing
    if (reason := platform_reason(call, "gpu")) is not None:
        return reason
    if call.dtype not in ("float32", "bfloat16") or call.page_dtype not in ("float32", "bfloat16"):
        return f"takes float32 or bfloat16 queries and pages, got {call.dtype} queries, {call.page_dtype} pages"
    b, t, h, c, dr, s, _ = call.shape
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0
    if not (pow2(c) and pow2(dr) and pow2(s)):
        return f"needs C, Dr and the page size to be powers of two >= 16 (tl.dot tiles), got {c}, {dr}, {s}"
    if (t * h) % HEAD_BLOCK:
        return f"needs T·H divisible by {HEAD_BLOCK}, got {t}·{h}"
    if call.mesh_devices > 1:
        return f"runs on one device (no shard_map wrapper), the active mesh has {call.mesh_devices}"
    return None


def _mosaic_gpu_reason(call: PagedDecodeCall) -> str | None:
    if (reason := platform_reason(call, "gpu", "the Mosaic GPU interpreter")) is not None:
        return reason
    if (reason := sm90_reason(call, "wgmma, TMA")) is not None:
        return reason
    if call.mesh_devices > 1:
        return f"runs on one device (no shard_map wrapper), the active mesh has {call.mesh_devices}"
    from pallas_kernels import paged_latent_attention_mosaic_gpu as mgpu  # noqa: PLC0415 (the Mosaic GPU toolchain)

    _, _, _, c, dr, s, _ = call.shape
    return mgpu.supports_reason(dtype=call.dtype, page_dtype=call.page_dtype, c=c, dr=dr, page_size=s)


PAGED_DECODE = Registry("mla.paged_decode_attention", (
    Backend("mosaic_tpu", "Pallas Mosaic TPU flash decoding reading each row's pages in place through the "
                          "scalar-prefetched page table", _tpu_reason),
    Backend("triton", "Pallas Triton split-K flash decoding over each row's pages through the page table, "
                      "log-sum-exp merge of the splits", _triton_reason),
    Backend("mosaic_gpu", "Pallas Mosaic GPU split-K flash decoding (wgmma, TMA) over each row's pages through the "
                          "page table, log-sum-exp merge of the splits", _mosaic_gpu_reason),
    Backend("xla", "split-K over each row's visited pages (lax.while_loop over work items, log-sum-exp merge)",
            lambda call: None),
))


def make_call(q_lat, pages, table, platform: str | None = None, mesh_devices: int = 1,
              interpret: bool = False) -> PagedDecodeCall:
    """The :class:`PagedDecodeCall` of queries ``q_lat [B, T, H, C]`` against ``pages [(R,) P, S, C + Dr]``
    through ``table [B, max_pages]`` (arrays or ``jax.ShapeDtypeStruct`` s: only shapes and dtypes are read)."""
    b, t, h, c = q_lat.shape
    target = target_platform(platform)
    cc = target_compute_capability(target)
    return PagedDecodeCall(target, jnp.dtype(q_lat.dtype).name, jnp.dtype(pages.dtype).name,
                           (b, t, h, c, pages.shape[-1] - c, pages.shape[-2], table.shape[1]), int(mesh_devices),
                           bool(interpret), cc)


def select(implementation: str, q_lat, pages, table, platform: str | None = None, mesh_devices: int = 1,
           interpret: bool = False) -> str:
    """The backend :data:`PAGED_DECODE` picks for this call (logged by the registry)."""
    return PAGED_DECODE.select(implementation, make_call(q_lat, pages, table, platform, mesh_devices,
                                                         interpret)).backend


def _check(q_lat, q_rot, pages, page_scale, table, pos, layer, name: str, fp8_pages: bool = True) -> None:
    """Shapes of a paged decode call agree (``fp8_pages=False``: a kernel that reads float32/bfloat16 pages only)."""
    if not fp8_pages and page_scale is not None:
        raise ValueError(f"{name} reads float32/bfloat16 pages: page_scale must be None")
    want = 3 if layer is None else 4
    if pages.ndim != want:
        raise ValueError(f"{name}: pages must be [{'R, ' if layer is not None else ''}P, S, C + Dr] ({want} dims"
                         f"{' with layer=' if layer is not None else ''}), got shape {pages.shape}")
    if q_lat.ndim != 4:
        raise ValueError(f"{name}: q_lat must be [B, T, H, C], got shape {q_lat.shape}")
    b, t, h, c = q_lat.shape
    dr = pages.shape[-1] - c
    if q_rot.shape != (b, t, h, dr) or table.ndim != 2 or table.shape[0] != b or pos.shape != (b,):
        raise ValueError(f"{name}: q_lat [B, T, H, C] = {q_lat.shape}, q_rot [B, T, H, Dr] = {q_rot.shape}, pages "
                         f"[..., P, S, C + Dr] = {pages.shape}, table [B, max_pages] = {table.shape} and pos [B] = "
                         f"{pos.shape} do not agree")
    if page_scale is not None and page_scale.shape != pages.shape[:-1]:
        raise ValueError(f"{name}: page_scale must be pages.shape[:-1] = {pages.shape[:-1]}, got {page_scale.shape}")


def _dequantized(vals: jax.Array, scale: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    """Page values ``[..., D]`` (times their per-token ``scale [...]`` when given) in ``dtype``."""
    if scale is None:
        return vals.astype(dtype)
    return (vals.astype(jnp.float32) * scale[..., None]).astype(dtype)


def paged_attention_reference(q_lat: jax.Array, q_rot: jax.Array, pages: jax.Array, page_scale: jax.Array | None,
                              table: jax.Array, pos: jax.Array, scale: float,
                              layer: jax.Array | None = None) -> jax.Array:
    """Reference: ``o_lat [B, T, H, C]`` in ``q_lat.dtype`` from every row's pages gathered into a dense view
    (module docstring for the arguments)."""
    _check(q_lat, q_rot, pages, page_scale, table, pos, layer, "paged_attention_reference")
    if layer is not None:
        pages = jax.lax.dynamic_index_in_dim(pages, layer, 0, keepdims=False)
        page_scale = None if page_scale is None else jax.lax.dynamic_index_in_dim(page_scale, layer, 0, False)
    b, t, h, c = q_lat.shape
    dt = q_lat.dtype
    s_len = pages.shape[1]
    view = _dequantized(pages[table], None if page_scale is None else page_scale[table], dt)
    view = view.reshape(b, -1, pages.shape[-1])  # [B, max_pages · S, C + Dr]
    key_pos = jnp.arange(view.shape[1])
    mapped = jnp.repeat(table != 0, s_len, axis=1)  # [B, max_pages · S]
    visible = mapped[:, None, :] & (key_pos[None, None, :] <= (pos[:, None] + jnp.arange(t)[None, :])[..., None])
    seen = mapped & (key_pos[None, :] <= pos[:, None] + t - 1)
    view = jnp.where(seen[..., None], view, jnp.zeros((), dt))  # null-page / stale data never reaches a product
    prec = HIGHEST if dt == jnp.float32 else None
    f32 = jnp.float32
    s = jnp.einsum("bthc,bsc->bths", q_lat, view[..., :c], precision=prec, preferred_element_type=f32)
    s = s + jnp.einsum("bthr,bsr->bths", q_rot, view[..., c:], precision=prec, preferred_element_type=f32)
    vis = visible[:, :, None, :]
    s = jnp.where(vis, s * scale, NEG_INF)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)) * vis
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    return jnp.einsum("bths,bsc->bthc", p.astype(dt), view[..., :c], precision=prec,
                      preferred_element_type=f32).astype(dt)


def visited_pages(table: jax.Array, pos: jax.Array, t: int, page_size: int) -> jax.Array:
    """``[B] i32``: pages of each row a call of ``t`` queries at ``pos [B]`` must visit: up to the page of its last
    query, and no further than its last mapped (non-null) table entry."""
    max_pages = table.shape[1]
    last_mapped = jnp.max(jnp.where(table != 0, jnp.arange(1, max_pages + 1, dtype=jnp.int32)[None, :], 0), axis=1)
    return jnp.minimum((pos.astype(jnp.int32) + t - 1) // page_size + 1, last_mapped)


def paged_attention_xla(q_lat: jax.Array, q_rot: jax.Array, pages: jax.Array, page_scale: jax.Array | None,
                        table: jax.Array, pos: jax.Array, scale: float, layer: jax.Array | None = None, *,
                        pages_per_item: int | None = None, items_per_step: int | None = None) -> jax.Array:
    """Split-K paged attention (module docstring): the result of :func:`paged_attention_reference`, reading only
    each row's visited pages. ``pages_per_item`` (default ``ITEM_TOKENS // S``) and ``items_per_step`` (default
    from :data:`STEP_TOKENS`) set the work granularity; per step the scores are ``[items, T, H, pages_per_item·S]``
    f32. Forward only (a data-dependent ``lax.while_loop``)."""
    _check(q_lat, q_rot, pages, page_scale, table, pos, layer, "paged_attention_xla")
    b, t, h, c = q_lat.shape
    s_len, width = pages.shape[-2], pages.shape[-1]
    max_pages = table.shape[1]
    k = min(max_pages, pages_per_item or max(1, ITEM_TOKENS // s_len))
    items_per_row_max = -(-max_pages // k)
    n_items = b * items_per_row_max  # static bound on the work items
    w = min(n_items, items_per_step or max(1, STEP_TOKENS // (k * s_len * t)))
    dt, f32 = q_lat.dtype, jnp.float32
    prec = HIGHEST if dt == f32 else None

    per_row = -(-visited_pages(table, pos, t, s_len) // k)  # [B] work items of each row
    ends = jnp.cumsum(per_row)
    total = ends[-1]
    n_pad = -(-n_items // w) * w
    idx = jnp.arange(n_pad, dtype=jnp.int32)
    item_row = jnp.searchsorted(ends, idx, side="right").astype(jnp.int32)  # B for idx >= total (padding)
    item_blk = idx - jnp.take(ends - per_row, jnp.minimum(item_row, b - 1))
    offs = jnp.arange(k * s_len, dtype=jnp.int32)
    q_pos = pos.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]

    def step(carry: tuple) -> tuple:
        i, m_run, l_run, acc = carry
        rows = jax.lax.dynamic_slice_in_dim(item_row, i * w, w)  # [W]
        real = rows < b
        rows_c = jnp.minimum(rows, b - 1)
        logical = jax.lax.dynamic_slice_in_dim(item_blk, i * w, w)[:, None] * k + jnp.arange(k)[None, :]  # [W, k]
        ids = jnp.take_along_axis(table[rows_c], jnp.minimum(logical, max_pages - 1), axis=1)  # [W, k]
        mapped = real[:, None] & (logical < max_pages) & (ids != 0)
        ids = jnp.where(mapped, ids, 0)
        vals = pages[ids] if layer is None else pages[layer, ids]  # [W, k, S, C + Dr]
        sc = None if page_scale is None else (page_scale[ids] if layer is None else page_scale[layer, ids])
        key_pos = logical[:, :1] * s_len + offs[None, :]  # [W, k·S]
        # positions past the row's last query hold stale data (or null-page garbage): zeroed, never multiplied
        key_ok = jnp.repeat(mapped, s_len, axis=1) & (key_pos <= q_pos[rows_c, -1:])  # [W, k·S]
        vals = jnp.where(key_ok[..., None], _dequantized(vals, sc, dt).reshape(w, k * s_len, width),
                         jnp.zeros((), dt))
        vis = key_ok[:, None, :] & (key_pos[:, None, :] <= q_pos[rows_c][:, :, None])  # [W, T, k·S]
        vis = vis[:, :, None, :]
        s = jnp.einsum("wthc,wsc->wths", q_lat[rows_c], vals[..., :c], precision=prec, preferred_element_type=f32)
        s = s + jnp.einsum("wthr,wsr->wths", q_rot[rows_c], vals[..., c:], precision=prec,
                           preferred_element_type=f32)
        s = jnp.where(vis, s * scale, NEG_INF)
        m_item = jnp.max(s, axis=-1)  # [W, T, H]
        p = jnp.exp(s - m_item[..., None]) * vis
        l_item = jnp.sum(p, axis=-1)
        o_item = jnp.einsum("wths,wsc->wthc", p.astype(dt), vals[..., :c], precision=prec,
                            preferred_element_type=f32)
        seg = jnp.where(real, rows, b)  # padding items fall outside the B segments: dropped
        m_new = jnp.maximum(m_run, jax.ops.segment_max(m_item, seg, b, indices_are_sorted=True))
        f_run = jnp.exp(m_run - m_new)
        f_item = jnp.exp(m_item - m_new[rows_c])
        l_new = l_run * f_run + jax.ops.segment_sum(l_item * f_item, seg, b, indices_are_sorted=True)
        acc = acc * f_run[..., None] + jax.ops.segment_sum(o_item * f_item[..., None], seg, b,
                                                           indices_are_sorted=True)
        return i + 1, m_new, l_new, acc

    init = (jnp.int32(0), jnp.full((b, t, h), NEG_INF, f32), jnp.zeros((b, t, h), f32), jnp.zeros((b, t, h, c), f32))
    _, _, l_run, acc = jax.lax.while_loop(lambda carry: carry[0] * w < total, step, init)
    return (acc / jnp.maximum(l_run, 1e-30)[..., None]).astype(dt)


def _paged_kernel(pos_ref, table_ref, last_ref, *refs, scale: float, c: int, heads: int, page_size: int,
                  stacked: bool):
    q_lat_ref, q_rot_ref, page_ref, o_ref, m_sc, l_sc, acc_sc = refs[1:] if stacked else refs
    b, j = pl.program_id(0), pl.program_id(1)
    pos = pos_ref[b]
    last_pos = pos + q_lat_ref.shape[0] // heads - 1
    dt = q_lat_ref.dtype
    f32 = jnp.float32
    prec = HIGHEST if dt == f32 else None
    nt = (((1,), (1,)), ((), ()))

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, f32)
        l_sc[...] = jnp.zeros(l_sc.shape, f32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, f32)

    @pl.when((j < last_ref[b]) & (table_ref[b, j] != 0))
    def _step():
        blk = page_ref[...]  # [S, C + Dr]
        rows = j * page_size + jax.lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
        lat = jnp.where(rows <= last_pos, blk[:, :c].astype(dt), jnp.zeros((), dt))  # stale rows: never multiplied
        rot = blk[:, c:].astype(dt)
        s = jax.lax.dot_general(q_lat_ref[...], lat, nt, precision=prec, preferred_element_type=f32)
        s = s + jax.lax.dot_general(q_rot_ref[...], rot, nt, precision=prec, preferred_element_type=f32)
        cols = j * page_size + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)  # [T·H, S]
        q_at = pos + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, s.shape, 0), jnp.int32(heads))
        vis = cols <= q_at
        s = jnp.where(vis, s * scale, NEG_INF)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.where(vis, jnp.exp(s - m_new), 0.0)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_sc[...] = alpha * acc_sc[...] + jax.lax.dot_general(
            p.astype(dt), lat, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=f32)
        m_sc[...] = m_new

    @pl.when(j == pl.num_programs(1) - 1)
    def _out():
        o_ref[...] = (acc_sc[...] / jnp.maximum(l_sc[...], 1e-30)).astype(o_ref.dtype)


def paged_attention_tpu(q_lat: jax.Array, q_rot: jax.Array, pages: jax.Array, page_scale: jax.Array | None,
                        table: jax.Array, pos: jax.Array, scale: float, layer: jax.Array | None = None, *,
                        interpret: bool = False) -> jax.Array:
    """:func:`paged_attention_xla` as a Pallas Mosaic TPU kernel (forward only): the same arguments and result;
    ``page_scale`` must be None (no FP8 pages). ``pages`` is read in place (a stack at ``layer``, clamped into
    ``[0, R)``), one page per grid step, each row only up to its visited pages (:func:`visited_pages`)."""
    _check(q_lat, q_rot, pages, page_scale, table, pos, layer, "paged_attention_tpu", fp8_pages=False)
    b, t, h, c = q_lat.shape
    s_len, width = pages.shape[-2], pages.shape[-1]
    dr = width - c
    max_pages = table.shape[1]
    stacked = layer is not None
    last = visited_pages(table, pos, t, s_len)
    prefetch = [pos.astype(jnp.int32), table.astype(jnp.int32), last]
    if stacked:
        prefetch.append(jnp.clip(jnp.reshape(layer, (1,)).astype(jnp.int32), 0, pages.shape[0] - 1))

    def q_map(i, j, *pf):
        return i, 0, 0

    def page_map(i, j, pos_ref, table_ref, last_ref, *lyr):
        # past the row's last visited page: the previous index again (no DMA)
        jj = jnp.maximum(jnp.minimum(j, last_ref[i] - 1), 0)
        page = table_ref[i, jj]
        return (lyr[0][0], page, 0, 0) if stacked else (page, 0, 0)

    lead = (None,) if stacked else ()
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(b, max_pages),
        in_specs=[pl.BlockSpec((None, t * h, c), q_map), pl.BlockSpec((None, t * h, dr), q_map),
                  pl.BlockSpec((*lead, None, s_len, width), page_map)],
        out_specs=pl.BlockSpec((None, t * h, c), q_map),
        scratch_shapes=[pltpu.VMEM((t * h, 1), jnp.float32), pltpu.VMEM((t * h, 1), jnp.float32),
                        pltpu.VMEM((t * h, c), jnp.float32)],
    )
    size = lambda a: a.size * a.dtype.itemsize
    positions = b * max_pages * s_len
    cost = pl.CostEstimate(flops=2 * t * h * positions * (2 * c + dr), transcendentals=t * h * positions,
                           bytes_accessed=positions * width * pages.dtype.itemsize + 2 * size(q_lat) + size(q_rot))
    kernel = functools.partial(_paged_kernel, scale=float(scale), c=c, heads=h, page_size=s_len, stacked=stacked)
    out = forward_only(pl.pallas_call(
        kernel,
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((b, t * h, c), q_lat.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        cost_estimate=cost,
        name="mla_paged_decode",
    ), *prefetch, q_lat.reshape(b, t * h, c), q_rot.reshape(b, t * h, dr), pages,
        name="paged_latent_attention.paged_attention_tpu")
    return out.reshape(b, t, h, c)


def _triton_kernel(pos_ref, last_ref, base_ref, table_ref, q_lat_ref, q_rot_ref, rows_ref, m_ref, l_ref, acc_ref,
                   *, scale: float, c: int, dr: int, heads: int, page_size: int, step: int, splits: int,
                   interpret: bool):
    hblk, sp, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32, i32 = jnp.float32, jnp.int32
    dt = q_lat_ref.dtype
    prec = HIGHEST if dt == f32 or interpret else None
    nt, nn = (((1,), (1,)), ((), ())), (((1,), (0,)), ((), ()))
    max_pages = table_ref.shape[1]
    last = last_ref[b]  # visited pages of the row
    n_steps = jax.lax.div(last * page_size + step - 1, step)
    chunk = jax.lax.div(n_steps + splits - 1, splits)
    start = sp * chunk
    end = jnp.minimum(start + chunk, n_steps)
    rows = pl.ds(hblk * HEAD_BLOCK, HEAD_BLOCK)
    q_lat = q_lat_ref[b, rows, :]  # [hb, C]
    q_rot = q_rot_ref[b, rows, :]  # [hb, Dr]
    row_ids = hblk * HEAD_BLOCK + jax.lax.broadcasted_iota(i32, (HEAD_BLOCK, 1), 0)
    q_at = pos_ref[b] + jax.lax.div(row_ids, i32(heads))  # [hb, 1] position of each query row
    last_pos = pos_ref[b] + q_lat_ref.shape[1] // heads - 1  # of the row's last query
    base = base_ref[0]
    offs = jax.lax.broadcasted_iota(i32, (step,), 0)

    def body(j, carry):
        m, l, acc = carry
        keys = j * step + offs  # [n] positions of this step
        slot = jax.lax.div(keys, i32(page_size))
        pid = table_ref[b, jnp.minimum(slot, max_pages - 1)]  # [n] each position's page
        ok = (slot < last) & (pid != 0) & (keys <= last_pos)  # stale rows / the null page: never multiplied
        flat = (base + pid) * page_size + jax.lax.rem(keys, i32(page_size))  # [n] rows of the flattened pool
        lat = rows_ref[flat, pl.ds(0, c)]  # [n, C]
        rot = rows_ref[flat, pl.ds(c, dr)]  # [n, Dr]
        lat = jnp.where(ok[:, None], lat.astype(dt), jnp.zeros((), dt))
        s = jax.lax.dot_general(q_lat, lat, nt, precision=prec, preferred_element_type=f32)
        s = s + jax.lax.dot_general(q_rot, rot.astype(dt), nt, precision=prec, preferred_element_type=f32)
        vis = (keys[None, :] <= q_at) & ok[None, :]  # [hb, n]
        s = jnp.where(vis, s * scale, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(vis, jnp.exp(s - m_new), 0.0)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        acc = alpha * acc + jax.lax.dot_general(p.astype(dt), lat, nn, precision=prec, preferred_element_type=f32)
        return m_new, l, acc

    init = (jnp.full((HEAD_BLOCK, 1), NEG_INF, f32), jnp.zeros((HEAD_BLOCK, 1), f32), jnp.zeros((HEAD_BLOCK, c), f32))
    m, l, acc = jax.lax.fori_loop(start, end, body, init)
    m_ref[b, sp, rows, :] = m
    l_ref[b, sp, rows, :] = l
    acc_ref[b, sp, rows, :] = acc


def paged_attention_triton(q_lat: jax.Array, q_rot: jax.Array, pages: jax.Array, page_scale: jax.Array | None,
                           table: jax.Array, pos: jax.Array, scale: float, layer: jax.Array | None = None, *,
                           splits: int | None = None, step: int = STEP_POSITIONS, num_warps: int = 8,
                           num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """:func:`paged_attention_xla` as a Pallas Triton kernel (forward only): the same arguments and result;
    ``page_scale`` must be None. Grid ``(T·H / HEAD_BLOCK, splits, B)``: program ``(hb, sp, b)`` walks split
    ``sp`` of row ``b``'s visited positions (:func:`visited_pages`, cut into ``splits`` equal runs of ``step``
    positions per row, so a short row's programs finish early), each step gathering its ``step`` positions' rows
    from their pages through the table (pages read in place, a stacked pool at ``layer``), with an online softmax
    for its :data:`HEAD_BLOCK` query rows, and writes its partial (max,
    denominator, fp32 output); the splits are merged by log-sum-exp outside the kernel."""
    _check(q_lat, q_rot, pages, page_scale, table, pos, layer, "paged_attention_triton", fp8_pages=False)
    b, t, h, c = q_lat.shape
    s_len, width = pages.shape[-2], pages.shape[-1]
    dr = width - c
    th = t * h
    if th % HEAD_BLOCK:
        raise ValueError(f"paged_attention_triton: T·H = {t}·{h} must be a multiple of {HEAD_BLOCK}")
    if step < 16 or step & (step - 1):
        raise ValueError(f"paged_attention_triton: step must be a power of two >= 16 (tl.dot tiles), got {step}")
    max_pages = table.shape[1]
    ns = splits or max(1, min(MAX_SPLITS, max_pages * s_len // SPLIT_POSITIONS))
    rows = pages.reshape(-1, width)  # [(R ·) P · S, C + Dr]: one row per cached position
    base = jnp.zeros((1,), jnp.int32) if layer is None else (
        jnp.clip(jnp.reshape(layer, (1,)).astype(jnp.int32), 0, pages.shape[0] - 1) * pages.shape[1])
    last = visited_pages(table, pos, t, s_len)
    f32 = jnp.float32
    if interpret:
        params = None
    else:
        from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415 - only where Triton ships

        params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    kernel = functools.partial(_triton_kernel, scale=float(scale), c=c, dr=dr, heads=h, page_size=s_len,
                               step=step, splits=ns, interpret=bool(interpret))
    m, l, acc = forward_only(pl.pallas_call(
        kernel,
        grid=(th // HEAD_BLOCK, ns, b),
        out_shape=[jax.ShapeDtypeStruct((b, ns, th, 1), f32), jax.ShapeDtypeStruct((b, ns, th, 1), f32),
                   jax.ShapeDtypeStruct((b, ns, th, c), f32)],
        compiler_params=params,
        interpret=bool(interpret),
        name="mla_paged_decode_gpu",
    ), pos.astype(jnp.int32), last, base, table.astype(jnp.int32), q_lat.reshape(b, th, c),
        q_rot.reshape(b, th, dr), rows, name="paged_latent_attention.paged_attention_triton")
    return merge_splits(m[..., 0], l[..., 0], acc).astype(q_lat.dtype).reshape(b, t, h, c)


def merge_splits(m: jax.Array, l: jax.Array, acc: jax.Array) -> jax.Array:
    """``[B, T·H, C]`` f32 from the splits' partial (max ``m``, denominator ``l`` ``[B, splits, T·H]``, unnormalised
    output ``acc [B, splits, T·H, C]``) of a split-K kernel, by log-sum-exp; rows no split saw give zeros."""
    m_all = jnp.max(m, axis=1, keepdims=True)
    f = jnp.exp(m - m_all)
    den = jnp.sum(l * f, axis=1)
    return jnp.sum(acc * f[..., None], axis=1) / jnp.maximum(den, 1e-30)[..., None]


def paged_attention_mgpu(q_lat: jax.Array, q_rot: jax.Array, pages: jax.Array, page_scale: jax.Array | None,
                         table: jax.Array, pos: jax.Array, scale: float, layer: jax.Array | None = None, *,
                         splits: int | None = None, page_offset: int = 0, interpret=False) -> jax.Array:
    """:func:`paged_attention_xla` on the Mosaic GPU kernel (forward only): the same arguments and result;
    ``page_scale`` must be None, queries and pages bf16 (:mod:`pallas_kernels.paged_latent_attention_mosaic_gpu`,
    which also says what ``page_offset`` does)."""
    from pallas_kernels import paged_latent_attention_mosaic_gpu as mgpu  # noqa: PLC0415

    _check(q_lat, q_rot, pages, page_scale, table, pos, layer, "paged_attention_mgpu", fp8_pages=False)
    b, t, h, c = q_lat.shape
    last = visited_pages(table, pos, t, pages.shape[-2])
    kernel = functools.partial(mgpu.paged_attention_mosaic_gpu, scale=float(scale), splits=splits,
                               page_offset=page_offset, interpret=interpret)
    stacked = () if layer is None else (jnp.asarray(layer, jnp.int32),)
    m, l, acc = forward_only(lambda *a: kernel(*a[:6], layer=a[6] if stacked else None),
                             q_lat, q_rot, pages, table, pos, last, *stacked,
                             name="paged_latent_attention.paged_attention_mgpu")
    return merge_splits(m, l, acc).astype(q_lat.dtype).reshape(b, t, h, c)


def paged_attention(implementation: str, q_lat: jax.Array, q_rot: jax.Array, pages: jax.Array,
                    page_scale: jax.Array | None, table: jax.Array, pos: jax.Array, scale: float,
                    layer: jax.Array | None = None, *, platform: str | None = None, mesh_devices: int = 1,
                    interpret: bool = False) -> jax.Array:
    """The backend :data:`PAGED_DECODE` selects for ``implementation`` on this call, applied (module docstring)."""
    backend = select(implementation, q_lat, pages, table, platform, mesh_devices, interpret)
    if backend == "mosaic_tpu":
        return paged_attention_tpu(q_lat, q_rot, pages, page_scale, table, pos, scale, layer, interpret=interpret)
    if backend == "triton":
        return paged_attention_triton(q_lat, q_rot, pages, page_scale, table, pos, scale, layer,
                                      interpret=interpret)
    if backend == "mosaic_gpu":
        return paged_attention_mgpu(q_lat, q_rot, pages, page_scale, table, pos, scale, layer, interpret=interpret)
    return paged_attention_xla(q_lat, q_rot, pages, page_scale, table, pos, scale, layer)
