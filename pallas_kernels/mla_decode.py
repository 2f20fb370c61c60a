"""One-token MLA decode attention over the latent cache, in the absorbed form, read in place.

A decode step of MLA scores each head's absorbed query against every cached latent row: with ``q_lat [H, C]``
(the no-position query part already multiplied into the latent space by the key up-projection) and ``q_rot [H, Dr]``,
and a cache row ``[ĉ (C) | k_rot (Dr)]`` per position,

    s[h, p] = scale · (q_lat[h] · ĉ[p] + q_rot[h] · k_rot[p])    for the positions p <= pos (the new token's),
    o_lat[h] = Σ_p softmax_p(s[h])[p] · ĉ[p]                      (then up-projected by the value weights outside).

:data:`DECODE` is the op's registry (``cfg.mla_decode_attention_implementation``):

* ``mosaic_tpu`` (:func:`latent_attention_tpu`): flash decoding on Pallas Mosaic TPU. Grid ``(B, S / block)``:
  each batch row walks its cache in blocks of ``block`` positions with an online softmax (running max, denominator
  and ``[H, C]`` accumulator in fp32 VMEM scratch), so the cache is read once and only up to the row's position
  (blocks past it repeat the last block index: no DMA, no work), and no ``[B, H, S]`` scores reach HBM. It reads a
  segment's stacked cache ``[R, B, S, C + Dr]`` in place at the layer index (scalar prefetch), as the engine's
  in-place decode step holds it;
* ``mosaic_gpu`` (:func:`latent_attention_mgpu`): the cache viewed as pages of 16 positions, read by the Pallas
  Mosaic GPU paged kernel (:mod:`pallas_kernels.paged_latent_attention_mosaic_gpu`: split-K flash decoding with
  wgmma, each row up to its position); sm_90, bf16, one device. After ``xla`` in the order (explicit) until the GPU
  suite has run with it first;
* ``xla``: the absorbed form of :mod:`k3_jax.layers.mla` (scores over the whole cache, masked softmax), which
  :func:`latent_attention_xla` restates here as the kernel's reference.

Precision: scores and softmax in fp32; the probabilities are cast to the cache rows' compute dtype for the value
product (the reference casts the normalised probabilities, the kernel the unnormalised ones and divides the fp32
accumulator at the end: equal in fp32, within bf16 rounding in bf16).
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
)

NEG_INF = -1e30
BLOCK = 512
"""Cache positions per grid step of the TPU kernel (K3: a ``[512, 576]`` bf16 block, 576 KiB)."""
HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class DecodeCall:
    """What the backends look at: the target platform, the query dtype, ``shape = (B, H, C, Dr, S)``."""

    platform: str
    dtype: str
    shape: tuple[int, int, int, int, int]
    interpret: bool = False
    compute_capability: float | None = None


def _tpu_reason(call: DecodeCall) -> str | None:
    if (reason := platform_reason(call, "tpu")) is not None:
        return reason
    if call.dtype not in ("float32", "bfloat16"):
        return f"takes float32 or bfloat16 queries, got {call.dtype}"
    return None


PAGE = 16
"""Positions per page of the cache as :func:`latent_attention_mgpu` views it."""


def _mosaic_gpu_reason(call: DecodeCall) -> str | None:
    if (reason := platform_reason(call, "gpu", "the Mosaic GPU interpreter")) is not None:
        return reason
    if (reason := sm90_reason(call, "wgmma, TMA")) is not None:
        return reason
    b, h, c, dr, s = call.shape
    if s % PAGE:
        return f"needs the cache length to be a multiple of {PAGE} (its pages), got {s}"
    from pallas_kernels import paged_latent_attention_mosaic_gpu as mgpu  # noqa: PLC0415

    return mgpu.supports_reason(dtype=call.dtype, page_dtype=call.dtype, c=c, dr=dr, page_size=PAGE)


DECODE = Registry("mla.decode_attention", (
    Backend("mosaic_tpu", "Pallas Mosaic TPU flash decoding over the latent cache, read in place up to each "
                          "row's position", _tpu_reason),
    Backend("xla", "absorbed attention over the whole latent cache (k3_jax.layers.mla)", lambda call: None),
    Backend("mosaic_gpu", "the cache as pages of 16 positions through the Pallas Mosaic GPU paged split-K kernel, "
                          "each row up to its position", _mosaic_gpu_reason),
))


def make_call(q_lat, q_rot, store, platform: str | None = None, interpret: bool = False) -> DecodeCall:
    """The :class:`DecodeCall` of queries ``q_lat [B, H, C]``, ``q_rot [B, H, Dr]`` against ``store [(R,) B, S,
    C + Dr]`` (arrays or ``jax.ShapeDtypeStruct`` s: only shapes and dtypes are read)."""
    b, h, c = q_lat.shape
    target = target_platform(platform)
    cc = target_compute_capability(target)
    return DecodeCall(target, jnp.dtype(q_lat.dtype).name, (b, h, c, q_rot.shape[-1], store.shape[-2]),
                      bool(interpret), cc)


def select(implementation: str, q_lat, q_rot, store, platform: str | None = None, interpret: bool = False) -> str:
    """The backend :data:`DECODE` picks for this call (logged by the registry)."""
    return DECODE.select(implementation, make_call(q_lat, q_rot, store, platform, interpret)).backend


def _check(q_lat, q_rot, store, pos, layer, name: str) -> None:
    b, h, c = q_lat.shape
    want = 3 if layer is None else 4
    if store.ndim != want:
        raise ValueError(f"{name}: store must be [{'R, ' if layer is not None else ''}B, S, C + Dr] "
                         f"({want} dims{' with layer=' if layer is not None else ''}), got shape {store.shape}")
    dr = q_rot.shape[-1]
    if q_rot.shape != (b, h, dr) or store.shape[-3] != b or store.shape[-1] != c + dr or pos.shape != (b,):
        raise ValueError(f"{name}: q_lat [B, H, C] = {q_lat.shape}, q_rot [B, H, Dr] = {q_rot.shape}, store "
                         f"[..., B, S, C + Dr] = {store.shape} and pos [B] = {pos.shape} do not agree")


def latent_attention_xla(q_lat: jax.Array, q_rot: jax.Array, store: jax.Array, pos: jax.Array, scale: float,
                         layer: jax.Array | None = None) -> jax.Array:
    """Reference: ``o_lat [B, H, C]`` in ``q_lat.dtype`` for queries ``q_lat [B, H, C]``, ``q_rot [B, H, Dr]``
    against the cache ``store [B, S, C + Dr]`` (or a stack ``[R, B, S, C + Dr]`` at ``layer``), positions
    ``0 .. pos[b]`` visible (``pos [B] i32``)."""
    _check(q_lat, q_rot, store, pos, layer, "latent_attention_xla")
    if layer is not None:
        store = jax.lax.dynamic_index_in_dim(store, layer, 0, keepdims=False)
    dt, c = q_lat.dtype, q_lat.shape[-1]
    f32 = jnp.float32
    prec = HIGHEST if dt == f32 else None
    lat, rot = store[..., :c].astype(dt), store[..., c:].astype(dt)
    s = jnp.einsum("bhc,bsc->bhs", q_lat, lat, precision=prec, preferred_element_type=f32)
    s = s + jnp.einsum("bhr,bsr->bhs", q_rot, rot, precision=prec, preferred_element_type=f32)
    visible = (jnp.arange(store.shape[-2])[None, :] <= pos[:, None])[:, None, :]  # [B, 1, S]
    s = jnp.where(visible, s * scale, NEG_INF)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)) * visible
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    return jnp.einsum("bhs,bsc->bhc", p.astype(dt), lat, precision=prec, preferred_element_type=f32).astype(dt)


def _decode_kernel(*refs, scale: float, c: int, block: int, stacked: bool):
    pos_ref = refs[0]
    q_lat_ref, q_rot_ref, store_ref, o_ref, m_sc, l_sc, acc_sc = refs[2 if stacked else 1:]
    b, j = pl.program_id(0), pl.program_id(1)
    pos = pos_ref[b]
    dt = q_lat_ref.dtype
    f32 = jnp.float32
    prec = HIGHEST if dt == f32 else None
    nt = (((1,), (1,)), ((), ()))

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, f32)
        l_sc[...] = jnp.zeros(l_sc.shape, f32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, f32)

    @pl.when(j * block <= pos)
    def _step():
        blk = store_ref[...]  # [block, C + Dr]
        rows = j * block + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
        lat = jnp.where(rows <= pos, blk[:, :c].astype(dt), jnp.zeros((), dt))  # rows past the array: garbage
        rot = blk[:, c:].astype(dt)
        s = jax.lax.dot_general(q_lat_ref[...], lat, nt, precision=prec, preferred_element_type=f32)
        s = s + jax.lax.dot_general(q_rot_ref[...], rot, nt, precision=prec, preferred_element_type=f32)
        cols = j * block + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(cols <= pos, s * scale, NEG_INF)  # [H, block]
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        acc_sc[...] = alpha * acc_sc[...] + jax.lax.dot_general(
            p.astype(dt), lat, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=f32)
        m_sc[...] = m_new

    @pl.when(j == pl.num_programs(1) - 1)
    def _out():
        o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)


def latent_attention_tpu(q_lat: jax.Array, q_rot: jax.Array, store: jax.Array, pos: jax.Array, scale: float,
                         layer: jax.Array | None = None, *, block: int = BLOCK, interpret: bool = False) -> jax.Array:
    """:func:`latent_attention_xla` as a Pallas Mosaic TPU kernel (forward only): the same arguments and result.

    ``store`` is read in place (a stack ``[R, B, S, C + Dr]`` at ``layer``, clamped into ``[0, R)``), each row only
    up to ``pos[b]`` (in blocks of ``block`` positions; ``S`` need not be a multiple). The cost estimate given to
    XLA counts every cache position once: what the kernel reads at most."""
    _check(q_lat, q_rot, store, pos, layer, "latent_attention_tpu")
    b, h, c = q_lat.shape
    s_len, width = store.shape[-2], store.shape[-1]
    block = min(block, s_len)
    stacked = layer is not None
    prefetch = [pos.astype(jnp.int32)]
    if stacked:
        prefetch.append(jnp.clip(jnp.reshape(layer, (1,)).astype(jnp.int32), 0, store.shape[0] - 1))

    def q_map(i, j, *pf):
        return i, 0, 0

    def store_map(i, j, pos_ref, *lyr):
        blk = jnp.minimum(j, jax.lax.div(pos_ref[i], block))  # past the row's position: the same block, no DMA
        return (lyr[0][0], i, blk, 0) if stacked else (i, blk, 0)

    lead = (None,) if stacked else ()
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(b, pl.cdiv(s_len, block)),
        in_specs=[pl.BlockSpec((None, h, c), q_map), pl.BlockSpec((None, h, q_rot.shape[-1]), q_map),
                  pl.BlockSpec((*lead, None, block, width), store_map)],
        out_specs=pl.BlockSpec((None, h, c), q_map),
        scratch_shapes=[pltpu.VMEM((h, 1), jnp.float32), pltpu.VMEM((h, 1), jnp.float32),
                        pltpu.VMEM((h, c), jnp.float32)],
    )
    size = lambda a: a.size * a.dtype.itemsize
    cost = pl.CostEstimate(flops=2 * b * h * s_len * (2 * c + q_rot.shape[-1]), transcendentals=b * h * s_len,
                           bytes_accessed=b * s_len * width * store.dtype.itemsize + size(q_lat) + size(q_rot)
                           + size(q_lat))
    kernel = functools.partial(_decode_kernel, scale=float(scale), c=c, block=block, stacked=stacked)
    return forward_only(pl.pallas_call(
        kernel,
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((b, h, c), q_lat.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        cost_estimate=cost,
        name="mla_decode",
    ), *prefetch, q_lat, q_rot, store, name="mla_decode.latent_attention_tpu")


def latent_attention_mgpu(q_lat: jax.Array, q_rot: jax.Array, store: jax.Array, pos: jax.Array, scale: float,
                          layer: jax.Array | None = None, *, interpret=False) -> jax.Array:
    """:func:`latent_attention_xla` on the Mosaic GPU paged kernel (forward only): the same arguments and result;
    bf16, ``S`` a multiple of :data:`PAGE`. The cache (a stack at ``layer``, clamped) is read in place as pages of
    :data:`PAGE` positions, row ``b``'s page ``j`` being page ``b * S / PAGE + j`` of the layer, up to ``pos[b]``."""
    from pallas_kernels import paged_latent_attention as pla  # noqa: PLC0415

    _check(q_lat, q_rot, store, pos, layer, "latent_attention_mgpu")
    b, h, c = q_lat.shape
    s_len, width = store.shape[-2], store.shape[-1]
    if s_len % PAGE:
        raise ValueError(f"latent_attention_mgpu: the cache length must be a multiple of {PAGE}, got {s_len}")
    per_row = s_len // PAGE
    pages = store.reshape(*store.shape[:-3], b * per_row, PAGE, width)  # a view: no copy
    table = jnp.arange(b * per_row, dtype=jnp.int32).reshape(b, per_row) + 1  # 1-based: no entry is null
    o = pla.paged_attention_mgpu(q_lat[:, None], q_rot[:, None], pages, None, table, pos, scale, layer,
                                 page_offset=-1, interpret=interpret)
    return o.reshape(b, h, c)
