"""Attention of a prefill chunk against a cached prefix, in the expanded MLA form, for cached (chunked) prefill.

A prefill chunk of ``T`` queries at positions ``L .. L+T-1`` attends to the ``L`` cached positions and causally
to itself. The cache holds MLA's latent ``[S, C + Dr]`` per position, not per-head K/V; the absorbed form
(:func:`k3_jax.layers.mla.absorbed_attention_key_blocked`) scores queries against the latent directly, at
``2·H·(2·C + Dr)`` FLOP per query-key pair (K3: 209k). The expanded form here up-projects the latent of each
key block to per-head K/V once per call (``2·C·H·(Dn + Dv)`` FLOP per key, 31.5M for K3) and then attends at
``2·H·(Dqk + Dv)`` FLOP per pair (61k), so it costs less from ~213 queries per call up (:data:`MIN_QUERIES`)
and runs as flash attention:

* the chunk against itself: causal, ``T_q == T_kv``;
* the chunk against each key block of ``key_block`` cached positions (:data:`KEY_BLOCK`): no mask, the valid
  length of the block given per row (``kv_len``, cuDNN's padding mask), so the block shape is static while the
  prefix length is data;
* the partial results merged by their log-sum-exp (:func:`merge_partials`), in fp32.

Only key blocks below the longest prefix of the batch are visited (a ``lax.while_loop``): forward only.

:data:`PREFIX_ATTENTION` is the op's registry: ``cudnn`` (this form, with cuDNN's fused flash attention
returning its softmax statistics, ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` with
``return_residual``), then ``xla`` (the absorbed form of :mod:`k3_jax.layers.mla`). The same algorithm with
plain-JAX partial attention (:func:`partial_attention_xla`) is the reference of the cuDNN backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.attention import cudnn_platform_reason
from pallas_kernels.registry import Backend, Registry, target_compute_capability, target_platform

NEG_INF = -1e30
MIN_QUERIES = 256
"""Fewest queries per call that take the expanded form: below ~213 (K3's widths) the up-projection of every
cached key costs more than the absorbed form saves; shorter calls (decode, verification, small remainder
pieces) stay in the absorbed form without consulting the registry."""
KEY_BLOCK = 16384
"""Cached positions up-projected per step (K3: 1 GiB of bf16 K/V per block at batch 1)."""

Partial = Callable[..., tuple[jax.Array, jax.Array]]
"""``partial(q, k, v, scale, kv_len, causal) -> (o [B, T, H, Dv] f32, lse [B, H, T] f32)``: softmax attention
over one key set and the log-sum-exp of its scaled scores; rows with no visible key give ``o = 0`` and
``lse = NEG_INF``."""


@dataclasses.dataclass(frozen=True)
class PrefixAttentionCall:
    """What the backends look at: ``shape = (B, T, H, Dqk, Dv)`` of the chunk's queries and values; the target
    GPU's ``compute_capability`` (None if unknown)."""

    platform: str
    dtype: str
    shape: tuple[int, int, int, int, int]
    compute_capability: float | None


def _cudnn_reason(call: PrefixAttentionCall) -> str | None:
    reason = cudnn_platform_reason(call.platform, call.compute_capability)
    if reason is None and call.dtype not in ("bfloat16", "float16"):
        reason = f"takes bfloat16/float16, got {call.dtype}"
    return reason


PREFIX_ATTENTION = Registry("mla.prefix_attention", (
    Backend("cudnn", "expanded form: cuDNN flash attention over up-projected key blocks of the cached prefix "
                     "and causally over the chunk, merged by log-sum-exp", _cudnn_reason),
    Backend("xla", "absorbed form over the latent cache, online softmax over key blocks (k3_jax.layers.mla)",
            lambda call: None),
))


def make_call(q: jax.Array, dv: int, platform: str | None) -> PrefixAttentionCall:
    """The call of queries ``q [B, T, H, Dqk]`` with value head dim ``dv`` on ``platform`` (None: the target)."""
    b, t, h, dqk = q.shape
    target = target_platform(platform)
    cc = target_compute_capability(target)
    return PrefixAttentionCall(target, jnp.dtype(q.dtype).name, (b, t, h, dqk, dv), cc)


def _visible(b: int, t: int, s: int, kv_len: jax.Array | None, causal: bool) -> jax.Array:
    """``[B, 1, T, S]`` bool: key ``s`` is visible to query ``t`` (below ``kv_len[b]``; ``s <= t`` if causal)."""
    mask = jnp.ones((b, 1, t, s), bool)
    if kv_len is not None:
        mask &= (jnp.arange(s)[None, :] < kv_len[:, None])[:, None, None, :]
    if causal:
        mask &= (jnp.arange(s)[None, :] <= jnp.arange(t)[:, None])[None, None]
    return mask


def partial_attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                          kv_len: jax.Array | None = None, causal: bool = False) -> tuple[jax.Array, jax.Array]:
    """Plain-JAX :data:`Partial` in fp32 (HIGHEST). q ``[B, T, H, Dqk]``, k ``[B, S, H, Dqk]``, v ``[B, S, H, Dv]``,
    kv_len ``[B]`` int32 or None (all ``S`` keys), causal: key ``s`` visible to query ``t`` iff ``s <= t``."""
    f32 = jnp.float32
    b, t = q.shape[:2]
    s = jnp.einsum("bthd,bshd->bhts", q.astype(f32), k.astype(f32), precision="highest") * scale
    mask = _visible(b, t, k.shape[1], kv_len, causal)
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=-1)  # [B, H, T]
    p = jnp.exp(s - m[..., None]) * mask
    denom = jnp.sum(p, axis=-1)
    o = jnp.einsum("bhts,bshd->bthd", p, v.astype(f32), precision="highest")
    o = o / jnp.maximum(jnp.moveaxis(denom, 1, 2), 1e-30)[..., None]
    lse = jnp.where(denom > 0, m + jnp.log(jnp.maximum(denom, 1e-30)), NEG_INF)
    return o, lse


def partial_attention_cudnn(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                            kv_len: jax.Array | None = None, causal: bool = False) -> tuple[jax.Array, jax.Array]:
    """:data:`Partial` through cuDNN's fused flash attention (bf16/fp16 operands, Hopper for ``Dqk != Dv``);
    shapes and masks as :func:`partial_attention_xla`. ``causal`` needs ``T == S`` (cuDNN aligns its causal mask
    top-left). The output is cuDNN's (in q's dtype), returned as fp32; the statistics are fp32."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention  # noqa: PLC0415

    b, t = q.shape[:2]
    if causal and k.shape[1] != t:
        raise ValueError(f"causal partial attention needs as many keys as queries, got T={t}, S={k.shape[1]}")
    if kv_len is None:
        o, lse = dot_product_attention(q, k, v, scale=scale, qkv_layout="BTNH", return_residual=True,
                                       mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK)
        return o.astype(jnp.float32), lse
    kv_len = kv_len.astype(jnp.int32)
    o, lse = dot_product_attention(q, k, v, q_seqlen=jnp.full((b,), t, jnp.int32), kv_seqlen=kv_len, scale=scale,
                                   qkv_layout="BTNH", return_residual=True,
                                   mask_type=MaskType.PADDING_CAUSAL if causal else MaskType.PADDING)
    empty = kv_len <= 0  # a row that sees no key of this block contributes nothing
    o = jnp.where(empty[:, None, None, None], 0.0, o.astype(jnp.float32))
    return o, jnp.where(empty[:, None, None], NEG_INF, lse)


def merge_partials(o1: jax.Array, lse1: jax.Array, o2: jax.Array, lse2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax attention over the union of two disjoint key sets from the two partial results (fp32):
    ``o [B, T, H, Dv]``, ``lse [B, H, T]``. Two empty rows (``NEG_INF``) stay ``o = 0``."""
    m = jnp.maximum(lse1, lse2)
    w1, w2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)
    tot = w1 + w2
    o = (o1 * jnp.moveaxis(w1 / tot, 1, 2)[..., None] + o2 * jnp.moveaxis(w2 / tot, 1, 2)[..., None])
    return o, m + jnp.log(tot)


def chunk_prefix_attention(q: jax.Array, k_self: jax.Array, v_self: jax.Array, store: jax.Array,
                           expand: Callable[[jax.Array], tuple[jax.Array, jax.Array]], prefix_len: jax.Array,
                           scale: float, partial: Partial, key_block: int | None = None) -> jax.Array:
    """A chunk's attention against its cached prefix and causally against itself (the module docstring).

    Args:
      q: ``[B, T, H, Dqk]`` the chunk's queries.  k_self, v_self: ``[B, T, H, Dqk]`` / ``[B, T, H, Dv]`` its keys
        and values (query ``t`` sees chunk keys ``0 .. t``).
      store: ``[B, S, D]`` cache rows; row ``b``'s prefix is ``store[b, :prefix_len[b]]`` (positions past it,
        e.g. the chunk's own entries or garbage, are never read into the result).
      expand: ``block [B, kb, D] -> (k [B, kb, H, Dqk], v [B, kb, H, Dv])`` (the up-projection).
      prefix_len: ``[B]`` int32 cached positions per row (0: the chunk alone).
      partial: :func:`partial_attention_cudnn` or the reference :func:`partial_attention_xla`.
      key_block: cached positions per step (default :data:`KEY_BLOCK`, at most ``S``).
    Returns:
      ``[B, T, H, Dv]`` in q's dtype; equals softmax attention over ``[prefix, chunk causal]`` to fp32 rounding.
    """
    o, lse = partial(q, k_self, v_self, scale, None, True)
    s_len = store.shape[1]
    kb = min(KEY_BLOCK if key_block is None else key_block, s_len)
    pad = -s_len % kb
    if pad:  # whole blocks only: a block's valid keys are always a prefix of it
        store = jnp.pad(store, [(0, 0), (0, pad), (0, 0)])
    prefix_len = prefix_len.astype(jnp.int32)
    n_visit = (jnp.max(prefix_len) + kb - 1) // kb

    def body(carry: tuple) -> tuple:
        j, o, lse = carry
        k, v = expand(jax.lax.dynamic_slice_in_dim(store, j * kb, kb, axis=1))
        o2, lse2 = partial(q, k, v, scale, jnp.clip(prefix_len - j * kb, 0, kb), False)
        return (j + 1, *merge_partials(o, lse, o2, lse2))

    _, o, _ = jax.lax.while_loop(lambda c: c[0] < n_visit, body, (jnp.int32(0), o, lse))
    return o.astype(q.dtype)
