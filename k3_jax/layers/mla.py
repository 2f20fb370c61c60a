"""Gated Multi-head Latent Attention with NoPE (no rotary embedding).

Training / prefill without a cache uses the expanded form (per-head K/V from ``kv_b_proj``). With a cache the
layer stores only the normalised latent ``ĉ`` [kv_lora] and the shared unrotated key part ``k_rot`` [rope] per
token and attends in the absorbed form (:func:`absorbed_attention`), so decode never materialises per-head K/V.

Whenever more than :data:`QUERY_BLOCK` queries attend at once (training, prefill) the queries are processed in
blocks of that size (:func:`map_query_blocks`): each block computes its fp32 scores ``[B, H, blk, S]`` against
every key, with the same row-wise softmax as the full form, under ``jax.checkpoint`` so the backward keeps only
the block inputs. The full ``[B, H, T, T]`` scores/probabilities and the ``[B, T, T]`` mask never exist.

Cached prefill (T > 1) against a latent cache longer than :data:`KEY_BLOCK` also blocks the keys
(:func:`absorbed_attention_key_blocked`): an online softmax (running max / denominator / output in fp32) over
key blocks, so a query block holds ``[B, H, blk, KEY_BLOCK]`` scores instead of ``[B, H, blk, S]``, and key
blocks past the last query position are never visited. It is forward-only (a ``lax.while_loop``).

A cached prefill call of at least :data:`pallas_kernels.prefix_attention.MIN_QUERIES` queries goes through
the registry :data:`pallas_kernels.prefix_attention.PREFIX_ATTENTION` (``cfg.mla_prefix_attention_implementation``):
``cudnn`` = the expanded form (the cached latent up-projected per key block, :func:`expand_latent`, then cuDNN
flash attention against the prefix and causally within the chunk, merged by log-sum-exp), ``xla`` = the
absorbed form above.

The one-token decode step (the engine's in-place step on a segment's stacked cache) takes its scores, softmax and
value product from the registry :data:`pallas_kernels.mla_decode.DECODE` (``cfg.mla_decode_attention_implementation``):
``mosaic_tpu`` / ``mosaic_gpu`` = flash decoding over the stacked latent cache read in place, up to each row's
position; ``xla`` = the absorbed form above over the layer's whole cache.

A paged cache entry (``{"pages", "scale"}`` with the model's ``page_table``; the serving engine's paged cache) goes
through :mod:`k3_jax.layers.paged_latent`: the new tokens are written into their pages and the queries attend over
each row's pages read in place (registry :data:`pallas_kernels.paged_latent_attention.PAGED_DECODE`,
``cfg.mla_paged_decode_implementation``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3_jax.config import K3Config
from k3_jax.layers import paged_latent
from k3_jax.layers.common import Linear, LinearKernel, RMSNorm, compute_dtype, einsum_f32, matmul_precision
from k3_jax.layers.parallel import axis_size
from k3_jax.parallel.sequence import mla_sequence_parallel
from pallas_kernels import attention, mla_decode, prefix_attention
from pallas_kernels.registry import platform_scope

NEG_INF = -1e30
QUERY_BLOCK = 512
"""Queries per attention block for T > 1 (scores ``[B, H, QUERY_BLOCK, S]`` f32 live at a time)."""
KEY_BLOCK = 2048
"""Keys per online-softmax step of cached prefill when the cache holds more than this many positions."""


def _softmax_attend(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked softmax over the last axis in fp32; fully masked rows give zeros."""
    scores = jnp.where(mask, scores, NEG_INF)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - m) * mask
    return p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)


def expanded_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Plain attention. q, k ``[B, T, H, Dqk]``, v ``[B, S, H, Dv]``, mask ``[B, T, S]`` bool -> ``[B, T, H, Dv]``.

    Scores and softmax in fp32; the probabilities are cast to ``v.dtype`` for the value product.
    """
    s = einsum_f32("bthd,bshd->bhts", q, k) * scale
    p = _softmax_attend(s, mask[:, None, :, :])
    return einsum_f32("bhts,bshd->bthd", p.astype(v.dtype), v).astype(v.dtype)


def map_query_blocks(fn: Callable[..., jax.Array], xs: Sequence[jax.Array], block: int) -> jax.Array:
    """Apply ``fn`` to query blocks: ``xs`` are ``[B, T, ...]`` per-query inputs, ``fn(*blocks)`` -> ``[B, blk, ...]``.

    ``T`` is padded up to a multiple of ``block`` (padding rows are computed and dropped; they get no gradient).
    Blocks run sequentially (``lax.map``) under ``jax.checkpoint``: autodiff saves only each block's inputs and
    recomputes the block in the backward. With ``T <= block`` ``fn`` is applied once, directly.
    """
    t = xs[0].shape[1]
    if t <= block:
        return fn(*xs)
    n = -(-t // block)
    pad = n * block - t

    def to_blocks(x: jax.Array) -> jax.Array:  # [B, T, ...] -> [n, B, blk, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(x.shape[0], n, block, *x.shape[2:]), 1, 0)

    out = jax.lax.map(lambda blocks: jax.checkpoint(fn)(*blocks), [to_blocks(x) for x in xs])  # [n, B, blk, ...]
    out = jnp.moveaxis(out, 0, 1)
    return out.reshape(out.shape[0], n * block, *out.shape[3:])[:, :t]


def blocked_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                             segment_ids: jax.Array | None = None, block: int | None = None) -> jax.Array:
    """Causal (and same-document) attention in query blocks; equals
    ``expanded_attention(q, k, v, causal_segment_mask(segment_ids, B, T), scale)`` to fp32 rounding.

    q, k ``[B, T, H, Dqk]``, v ``[B, T, H, Dv]``, segment_ids ``[B, T]`` int32 or None -> ``[B, T, H, Dv]``
    in ``v.dtype``. Each block of ``block`` (default :data:`QUERY_BLOCK`) queries scores all T keys in fp32 and
    builds its ``[B, blk, T]`` mask from positions; peak extra memory ~``B·H·blk·T`` f32 instead of ``B·H·T·T``.
    """
    b, t = q.shape[:2]
    block = QUERY_BLOCK if block is None else block
    pos_k = jnp.arange(t, dtype=jnp.int32)
    pos_q = jnp.broadcast_to(pos_k[None], (b, t))
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)

    def attend(q_blk: jax.Array, pos_blk: jax.Array, seg_blk: jax.Array) -> jax.Array:
        mask = (pos_k[None, None, :] <= pos_blk[:, :, None]) & (seg[:, None, :] == seg_blk[:, :, None])
        return expanded_attention(q_blk, k, v, mask, scale)

    return map_query_blocks(attend, [q, pos_q, seg], block)


def causal_attention(cfg: K3Config, q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                     segment_ids: jax.Array | None) -> jax.Array:
    """Causal same-document attention through the registry :data:`pallas_kernels.attention.ATTENTION` with
    ``cfg.mla_attention_implementation`` on ``cfg.platform``: cuDNN flash attention
    (:func:`pallas_kernels.attention.cudnn_causal_attention`) or :func:`blocked_causal_attention` (``xla``).
    Shapes as the latter; an explicit choice that cannot run raises ``KernelUnavailable`` with the reason."""
    call = attention.make_call(q, v, segment_ids, cfg.platform)
    if attention.ATTENTION.select(cfg.mla_attention_implementation, call).backend == "xla":
        return blocked_causal_attention(q, k, v, scale, segment_ids)
    return attention.cudnn_causal_attention(q, k, v, scale, segment_ids)


def absorbed_attention(
    q_nope: jax.Array,
    q_rot: jax.Array,
    store: jax.Array,
    w_uk: jax.Array,
    w_uv: jax.Array,
    mask: jax.Array,
    scale: float,
) -> jax.Array:
    """MLA attention straight from the latent cache (weight absorption).

    Args:
      q_nope: ``[B, T, H, Dn]`` no-position query part.  q_rot: ``[B, T, H, Dr]`` (unrotated, NoPE).
      store: ``[B, S, C + Dr]`` the latent cache as the layer stores it: the normalised latent ĉ, then the shared
        key part.
      w_uk: ``[C, H, Dn]`` key up-projection.  w_uv: ``[C, H, Dv]`` value up-projection.
      mask: ``[B, T, S]`` bool, True where query t may attend to cached position s.
    Returns:
      ``[B, T, H, Dv]`` in ``q_nope.dtype``; scores/softmax fp32.

    Both products read whole cache rows: the scores as one product of ``[q_lat | q_rot]`` with ``[ĉ | k_rot]``
    (the sum of the two parts' products in one fp32 accumulation), the latent output as ``p · [ĉ | k_rot]`` of which
    the first ``C`` columns are kept. A product with a column slice of the cache would first copy that slice out of
    the whole cache on every call.
    """
    dt = q_nope.dtype
    c = w_uk.shape[0]
    q_lat = einsum_f32("bthd,chd->bthc", q_nope, w_uk.astype(dt)).astype(dt)
    rows = store.astype(dt)
    s = einsum_f32("bthc,bsc->bhts", jnp.concatenate([q_lat, q_rot.astype(dt)], axis=-1), rows)
    p = _softmax_attend(s * scale, mask[:, None, :, :])
    o_lat = einsum_f32("bhts,bsc->bthc", p.astype(dt), rows)[..., :c].astype(dt)
    return einsum_f32("bthc,chd->bthd", o_lat, w_uv.astype(dt)).astype(dt)


def absorbed_attention_key_blocked(
    q_nope: jax.Array,
    q_rot: jax.Array,
    store: jax.Array,
    w_uk: jax.Array,
    w_uv: jax.Array,
    pos_q: jax.Array,
    scale: float,
    key_block: int | None = None,
) -> jax.Array:
    """:func:`absorbed_attention` with the causal cache mask ``s <= pos_q``, over key blocks (online softmax).

    Args:
      q_nope: ``[B, T, H, Dn]``.  q_rot: ``[B, T, H, Dr]``.
      store: ``[B, S, C + Dr]`` latent cache (ĉ then the shared key part, as the layer stores it).
      w_uk: ``[C, H, Dn]``.  w_uv: ``[C, H, Dv]``.
      pos_q: ``[B, T]`` int32 position of each query; query t sees cache positions ``0 .. pos_q[b, t]``.
      key_block: keys per step (default :data:`KEY_BLOCK`).
    Returns:
      ``[B, T, H, Dv]`` in ``q_nope.dtype``; equals :func:`absorbed_attention` with that mask to fp32 rounding.

    Scores ``[B, H, T, key_block]`` f32 exist one block at a time; the running max ``m`` and denominator ``l``
    ``[B, H, T]`` and the latent output ``[B, T, H, C]`` are fp32. Masked scores are the finite ``NEG_INF`` and
    their probabilities are multiplied by the mask, so a fully masked block (or row) contributes exactly zero
    and never makes NaN (``exp(NEG_INF - NEG_INF) = 1`` only rescales a zero sum). A last partial block is read
    at ``S - key_block`` (no padded copy of the cache); positions already covered by the previous block are
    masked. Only blocks up to the largest query position are visited (data-dependent ``lax.while_loop``), so
    this is forward-only (no reverse-mode autodiff).
    """
    key_block = KEY_BLOCK if key_block is None else key_block
    b, t, h, _ = q_nope.shape
    s_len = store.shape[1]
    c = w_uk.shape[0]
    if s_len < key_block:
        raise ValueError(f"key-blocked attention needs a cache of at least key_block={key_block} positions, "
                         f"got S={s_len}")
    dt = q_nope.dtype
    q_lat = einsum_f32("bthd,chd->bthc", q_nope, w_uk.astype(dt)).astype(dt)
    n_blocks = -(-s_len // key_block)
    # blocks 0 .. last hold every visible key (max position over the batch and the query block)
    n_visit = jnp.minimum(jnp.max(pos_q) // key_block + 1, n_blocks).astype(jnp.int32)
    offs = jnp.arange(key_block, dtype=jnp.int32)

    def body(carry: tuple) -> tuple:
        j, m, l, acc = carry
        start = jnp.minimum(j * key_block, s_len - key_block)
        blk = jax.lax.dynamic_slice_in_dim(store, start, key_block, axis=1).astype(dt)  # [B, KB, C+Dr]
        lat, rot = blk[..., :c], blk[..., c:]
        pos_k = start + offs  # [KB]
        mask = (pos_k[None, None, :] >= j * key_block) & (pos_k[None, None, :] <= pos_q[:, :, None])  # [B, T, KB]
        mask = mask[:, None, :, :]  # [B, 1, T, KB]
        s = einsum_f32("bthc,bsc->bhts", q_lat, lat) + einsum_f32("bthr,bsr->bhts", q_rot, rot)
        s = jnp.where(mask, s * scale, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # [B, H, T]
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None]) * mask
        l = l * alpha + jnp.sum(p, axis=-1)
        acc = acc * jnp.moveaxis(alpha, 1, 2)[..., None] + einsum_f32("bhts,bsc->bthc", p.astype(dt), lat)
        return j + 1, m_new, l, acc

    init = (jnp.int32(0), jnp.full((b, h, t), NEG_INF, jnp.float32), jnp.zeros((b, h, t), jnp.float32),
            jnp.zeros((b, t, h, c), jnp.float32))
    _, _, l, acc = jax.lax.while_loop(lambda carry: carry[0] < n_visit, body, init)
    o_lat = (acc / jnp.maximum(jnp.moveaxis(l, 1, 2), 1e-30)[..., None]).astype(dt)
    return einsum_f32("bthc,chd->bthd", o_lat, w_uv.astype(dt)).astype(dt)


def _absorbed_cached_attention(q_nope: jax.Array, q_rot: jax.Array, store: jax.Array, kv_kernel: jax.Array,
                               lengths: jax.Array, scale: float) -> jax.Array:
    """Queries at ``lengths .. lengths+T-1`` against the latent ``store [B, S, C+Dr]`` (which holds them) in the
    absorbed form; ``kv_kernel [C, H, Dn+Dv]``. Decode (T = 1) is one direct call; a longer call goes in query
    blocks (and key blocks when S > :data:`KEY_BLOCK`)."""
    b, t = q_nope.shape[:2]
    dn = q_nope.shape[-1]
    s_max = store.shape[1]
    pos_q = lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]

    def attend_cached(qn: jax.Array, qr: jax.Array, pos: jax.Array) -> jax.Array:
        if t > 1 and s_max > KEY_BLOCK:  # long cache: online softmax over key blocks (forward only)
            return absorbed_attention_key_blocked(qn, qr, store, kv_kernel[..., :dn], kv_kernel[..., dn:],
                                                  pos, scale)
        mask = jnp.arange(s_max)[None, None, :] <= pos[:, :, None]  # [B, blk, S]
        return absorbed_attention(qn, qr, store, kv_kernel[..., :dn], kv_kernel[..., dn:], mask, scale)

    return map_query_blocks(attend_cached, [q_nope, q_rot, pos_q], QUERY_BLOCK)


def _kernel_decode_attention(backend: str, q_nope: jax.Array, q_rot: jax.Array, stacked: jax.Array,
                             kv_kernel: jax.Array, lengths: jax.Array, layer: jax.Array, scale: float) -> jax.Array:
    """One-token decode (``q_nope [B, 1, H, Dn]``, ``q_rot [B, 1, H, Dr]``) in the absorbed form with the scores,
    softmax and value product in the kernel of :data:`pallas_kernels.mla_decode.DECODE`'s ``backend``
    (``mosaic_tpu``: :func:`~pallas_kernels.mla_decode.latent_attention_tpu`, ``mosaic_gpu``:
    :func:`~pallas_kernels.mla_decode.latent_attention_mgpu`) over the stacked latent cache ``[R, B, S, C+Dr]`` at
    repeat ``layer``; ``kv_kernel [C, H, Dn+Dv]``. Returns ``[B, 1, H, Dv]``."""
    dt, dn = q_nope.dtype, q_nope.shape[-1]
    q_lat = einsum_f32("bthd,chd->bthc", q_nope, kv_kernel[..., :dn].astype(dt)).astype(dt)
    attend = mla_decode.latent_attention_tpu if backend == "mosaic_tpu" else mla_decode.latent_attention_mgpu
    o_lat = attend(q_lat[:, 0], q_rot[:, 0], stacked, lengths, scale, layer)
    return einsum_f32("bthc,chd->bthd", o_lat[:, None], kv_kernel[..., dn:].astype(dt)).astype(dt)


def expand_latent(block: jax.Array, kv_kernel: jax.Array, heads: int, nope_dim: int, dtype: jnp.dtype,
                  precision: jax.lax.Precision) -> tuple[jax.Array, jax.Array]:
    """Per-head K/V of cached positions: ``block [B, S, C+Dr]`` (latent ĉ then the shared key part),
    ``kv_kernel [C, H·(Dn+Dv)]`` -> k ``[B, S, H, Dn+Dr]`` (the shared part broadcast), v ``[B, S, H, Dv]`` in
    ``dtype``; the same up-projection as the layer's cache-free path."""
    b, s, _ = block.shape
    c = kv_kernel.shape[0]
    lat, rot = block[..., :c].astype(dtype), block[..., c:].astype(dtype)
    kv = jnp.matmul(lat, kv_kernel.astype(dtype), precision=precision).reshape(b, s, heads, -1)
    k = jnp.concatenate([kv[..., :nope_dim], jnp.broadcast_to(rot[:, :, None, :], (b, s, heads, rot.shape[-1]))],
                        axis=-1)
    return k, kv[..., nope_dim:]


def prefix_attention_backend(cfg: K3Config, q: jax.Array, dv: int) -> str:
    """The backend of :data:`pallas_kernels.prefix_attention.PREFIX_ATTENTION` that
    ``cfg.mla_prefix_attention_implementation`` selects for queries ``q [B, T, H, Dqk]`` (raises
    ``KernelUnavailable`` with the reason for an explicit choice that cannot run)."""
    call = prefix_attention.make_call(q, dv, cfg.platform)
    return prefix_attention.PREFIX_ATTENTION.select(cfg.mla_prefix_attention_implementation, call).backend


@functools.partial(jax.checkpoint, static_argnums=(2,))
def sigmoid_gate(o: jax.Array, gate: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``f32(o) · sigmoid(f32(gate))`` in ``dtype``; recomputed in the backward (no f32 ``[B, T, H·Dv]`` kept)."""
    return (o.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(dtype)


def causal_segment_mask(segment_ids: jax.Array | None, b: int, t: int) -> jax.Array:
    """``[B, T, T]`` bool: causal, and within one document when ``segment_ids`` [B, T] is given."""
    causal = jnp.tril(jnp.ones((t, t), bool))[None]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (b, t, t))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal & same


class KimiMLAAttention(nn.Module):
    """Gated MLA (NoPE). ``x`` [B, T, D] -> ``y`` [B, T, D]; with ``cache`` also the new cache entry.

    Cache entry: ``{"latent": [B, S_max, kv_lora + rope]}``; ``lengths`` [B] = tokens already cached per row
    (the new T tokens are written at ``lengths .. lengths+T-1``).
    """

    cfg: K3Config

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None, cache: dict | None = None,
                 lengths: jax.Array | None = None, cache_index: jax.Array | None = None,
                 page_table: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
        """``cache_index``: ``cache`` is a segment's stacked entry ``{"latent": [R, B, S_max, C+Dr]}``; the ``T``
        new tokens are written into repeat ``cache_index`` at each row's ``lengths`` in place (positions past
        ``S_max`` clip to the last one) and the whole stacked entry is returned.
        ``page_table [B, max_pages] i32``: ``cache`` is a page pool ``{"pages", "scale"}`` (stacked too with
        ``cache_index``), read and written through the table (:mod:`k3_jax.layers.paged_latent`)."""
        with platform_scope(self.cfg.platform):  # einsum_f32's code path follows cfg.platform when it is set
            return self._attend(x, segment_ids, cache, lengths, cache_index, page_table)

    @nn.compact
    def _attend(self, x: jax.Array, segment_ids: jax.Array | None, cache: dict | None,
                lengths: jax.Array | None, cache_index: jax.Array | None,
                page_table: jax.Array | None) -> tuple[jax.Array, dict | None]:
        cfg = self.cfg
        b, t, _ = x.shape
        h, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        c = cfg.kv_lora_rank
        dt = compute_dtype(cfg)
        scale = (dn + dr) ** -0.5

        q_a = Linear(cfg.q_lora_rank, ("embed", "q_lora"), cfg, name="q_a_proj")(x)
        q_a = RMSNorm(cfg.mla_norm_eps, ("q_lora",), cfg.param_dtype, name="q_a_layernorm")(q_a)
        q = Linear(h * (dn + dr), ("q_lora", "heads"), cfg, name="q_b_proj")(q_a).reshape(b, t, h, dn + dr)
        q_nope, q_rot = q[..., :dn], q[..., dn:]

        ckv = Linear(c + dr, ("embed", "kv_lora"), cfg, name="kv_a_proj_with_mqa")(x)
        latent = RMSNorm(cfg.mla_norm_eps, ("kv_lora",), cfg.param_dtype, name="kv_a_layernorm")(ckv[..., :c])
        k_rot = ckv[..., c:]
        kv_kernel = LinearKernel(c, h * (dn + dv), ("kv_lora", "heads"), cfg, name="kv_b_proj")()

        new_cache = None
        if cache is None and axis_size("sequence") > 1:
            # T split over `sequence`: all-gather only the 576-value latent, attend in the absorbed form
            w = kv_kernel.reshape(c, h, dn + dv)
            o = mla_sequence_parallel(q_nope.astype(dt), q_rot.astype(dt), latent.astype(dt), k_rot.astype(dt),
                                      w[..., :dn], w[..., dn:], scale=scale, attend=absorbed_attention,
                                      segment_ids=segment_ids)
        elif cache is None:
            kv = jnp.matmul(latent.astype(dt), kv_kernel.astype(dt), precision=matmul_precision(cfg))
            kv = kv.reshape(b, t, h, dn + dv)
            k_nope, v = kv[..., :dn], kv[..., dn:]
            k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot[:, :, None, :], (b, t, h, dr))], axis=-1)
            o = causal_attention(cfg, q.astype(dt), k.astype(dt), v.astype(dt), scale, segment_ids)
        elif paged_latent.is_paged(cache):
            if lengths is None or page_table is None:
                raise ValueError("MLA with a paged cache needs `lengths` [B] and `page_table` [B, max_pages]")
            new_entries = jnp.concatenate([latent, k_rot], axis=-1)  # [B, T, C+Dr]
            o, new_cache = paged_latent.paged_cached_attention(
                cfg.mla_paged_decode_implementation, cfg.platform, q_nope.astype(dt), q_rot.astype(dt),
                new_entries, cache, page_table, lengths, kv_kernel.reshape(c, h, dn + dv), scale, cache_index)
        else:
            if lengths is None:
                raise ValueError("MLA with a cache needs `lengths` [B] (tokens already cached per row)")
            store = cache["latent"]
            new_entries = jnp.concatenate([latent, k_rot], axis=-1).astype(store.dtype)  # [B, T, C+Dr]
            decode_kernel = None  # the kernel backend reading the stacked cache in place, if any
            if cache_index is not None and t > 1:  # T tokens into repeat cache_index at each row's length, in place
                pos = lengths[:, None] + jnp.arange(t, dtype=lengths.dtype)[None, :]  # [B, T]
                stacked = store.at[cache_index, jnp.arange(b)[:, None], pos].set(new_entries, mode="clip")
                new_cache = {"latent": stacked}
                store = jax.lax.dynamic_index_in_dim(stacked, cache_index, 0, keepdims=False)
            elif cache_index is not None:  # one token into repeat cache_index of the stacked latents, in place
                stacked = store.at[cache_index, jnp.arange(b), lengths].set(new_entries[:, 0], mode="clip")
                new_cache = {"latent": stacked}
                q_lat_shape = jax.ShapeDtypeStruct((b, h, c), dt)
                backend = mla_decode.select(cfg.mla_decode_attention_implementation, q_lat_shape, q_rot[:, 0],
                                            stacked)
                decode_kernel = backend if backend in ("mosaic_tpu", "mosaic_gpu") else None
                store = stacked if decode_kernel else jax.lax.dynamic_index_in_dim(stacked, cache_index, 0,
                                                                                     keepdims=False)
            else:
                store = jax.vmap(lambda s, n, pos: jax.lax.dynamic_update_slice(s, n, (pos, 0)))(
                    store, new_entries, lengths)
                new_cache = {"latent": store}
            if decode_kernel:  # the stacked cache read in place at cache_index, up to each row's position
                o = _kernel_decode_attention(decode_kernel, q_nope.astype(dt), q_rot.astype(dt), stacked,
                                             kv_kernel.reshape(c, h, dn + dv), lengths, cache_index, scale)
            elif (t >= prefix_attention.MIN_QUERIES
                    and prefix_attention_backend(cfg, q.astype(dt), dv) == "cudnn"):
                expand = functools.partial(expand_latent, kv_kernel=kv_kernel, heads=h, nope_dim=dn, dtype=dt,
                                           precision=matmul_precision(cfg))
                k_self, v_self = expand(new_entries)
                o = prefix_attention.chunk_prefix_attention(q.astype(dt), k_self, v_self, store, expand, lengths,
                                                            scale, prefix_attention.partial_attention_cudnn)
            else:
                o = _absorbed_cached_attention(q_nope.astype(dt), q_rot.astype(dt), store,
                                               kv_kernel.reshape(c, h, dn + dv), lengths, scale)

        gate = Linear(h * dv, ("embed", "heads"), cfg, name="g_proj")(x)
        y = sigmoid_gate(o.reshape(b, t, h * dv), gate, dt)
        y = Linear(cfg.hidden_size, ("heads", "embed"), cfg, name="o_proj")(y)
        return y, new_cache
