"""Sequence (context) parallelism over the ``sequence`` mesh axis for the 1M-token context.

The token dimension ``T`` of every activation is split into ``n`` contiguous shards (rank ``r`` holds tokens
``[r·T/n, (r+1)·T/n)``).

* **KDA**: the state recurrence is affine per chunk, ``S_out = M S_in + U``. Each shard folds its
  chunks' maps into one shard map ``(M_r [K, K], U_r [K, V])`` per (batch, head) with
  ``pallas_kernels.kda.reference.chunk_state_maps``; the maps are all-gathered over ``sequence`` (``n·K·(K+V)``
  floats per head — independent of ``T``) and every shard composes the maps of the shards before it (an
  exclusive prefix scan) to get its incoming state, then runs ``chunk_kda`` on its tokens from that state.
  Packed documents: a shard whose first token starts a new document gets a zero incoming state (and its map
  is built with a reset at token 0).
* **Short conv halo**: the causal depthwise conv (width ``W = 4``) needs the last ``W − 1`` pre-conv inputs
  (and their document ids) of the previous shard: one ``ppermute`` of ``[B, W−1, C]``.
* **MLA**: the normalised latent ``ĉ`` and the shared ``k_rot`` (576 values per token for K3) are
  all-gathered over ``sequence``; each shard runs causal (absorbed-form) attention for its own queries.
* AttnRes, norms, MLPs and MoE are per token and need nothing.

Functions named ``*_sequence_parallel`` take global arrays (inside ``jit``) and a mesh and wrap the per-shard
bodies in ``jax.shard_map``; the batch may also be split over ``batch_axes`` and heads over ``head_axis``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from k3_jax.parallel.mesh_axes import axis_sizes, mesh_or_active, split_axes
from pallas_kernels.kda import reference as kda_ref

HIGHEST = jax.lax.Precision.HIGHEST

AbsorbedAttention = Callable[..., jax.Array]
"""``attend(q_nope, q_rot, store [B, S, C + Dr], w_uk, w_uv, mask [B, Tq, S] bool, scale) -> [B, Tq, H, Dv]`` — the
layer's absorbed-form MLA attention (``k3_jax.layers.mla.absorbed_attention``; ``store`` = the latent, then the
shared key part, per position)."""


def _ein(eq: str, *xs: jax.Array) -> jax.Array:
    return jnp.einsum(eq, *xs, precision=HIGHEST, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- halo exchange
def halo_from_previous(x: jax.Array, width: int, axis_name: str, time_axis: int = 1) -> jax.Array:
    """Inside shard_map: the last ``width`` entries along ``time_axis`` of the previous shard (zeros on rank 0)."""
    n = jax.lax.axis_size(axis_name)
    tail = jax.lax.slice_in_dim(x, x.shape[time_axis] - width, x.shape[time_axis], axis=time_axis)
    return jax.lax.ppermute(tail, axis_name, [(i, i + 1) for i in range(n - 1)])


def short_conv_local(u: jax.Array, kernel: jax.Array, axis_name: str,
                     segment_ids: jax.Array | None = None) -> jax.Array:
    """Per-shard causal depthwise conv with a halo: ``u [B, T_loc, C]``, ``kernel [W, C]`` f32 → ``[B, T_loc, C]``.

    Equals the unsharded conv (zero history at the sequence start; taps never cross a document boundary).
    """
    w = kernel.shape[0]
    t = u.shape[1]
    if w == 1:
        return (u.astype(jnp.float32) * kernel[0].astype(jnp.float32)).astype(u.dtype)
    halo = halo_from_previous(u, w - 1, axis_name)
    full = jnp.concatenate([halo, u], axis=1).astype(jnp.float32)
    if segment_ids is not None:
        seg_halo = halo_from_previous(segment_ids, w - 1, axis_name)
        seg_full = jnp.concatenate([seg_halo, segment_ids], axis=1)
    out = jnp.zeros(u.shape, jnp.float32)
    for j in range(w):
        tap = full[:, j:j + t, :] * kernel[j].astype(jnp.float32)
        if segment_ids is not None:
            tap = jnp.where((seg_full[:, j:j + t] == segment_ids)[..., None], tap, 0.0)
        out = out + tap
    return out.astype(u.dtype)


# ----------------------------------------------------------------------------- KDA state maps
def shard_state_map(k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, reset: jax.Array,
                    chunk_size: int) -> tuple[jax.Array, jax.Array]:
    """Affine map of a whole token range: ``S_out = M S_in + U`` with ``M [B, H, K, K]``, ``U [B, H, K, V]`` f32.

    Folds the per-chunk maps of ``kda_ref.chunk_state_maps`` (``reset [B, T] bool`` as there).
    """
    m, bm = kda_ref.chunk_state_maps(k, v, g, beta, reset, chunk_size=chunk_size,
                                     sub_chunk_size=min(16, chunk_size))
    b, h, _, kk, vv = bm.shape
    eye = jnp.broadcast_to(jnp.eye(kk, dtype=jnp.float32), (b, h, kk, kk))

    def step(carry, mb):
        mc, uc = carry
        mn, bn = mb
        return (_ein("bhij,bhjk->bhik", mn, mc), _ein("bhij,bhjv->bhiv", mn, uc) + bn), None

    (mt, ut), _ = jax.lax.scan(step, (eye, jnp.zeros((b, h, kk, vv), jnp.float32)),
                               (jnp.moveaxis(m, 2, 0), jnp.moveaxis(bm, 2, 0)))
    return mt, ut


def incoming_state(m_all: jax.Array, u_all: jax.Array, s0: jax.Array, rank: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exclusive prefix of gathered shard maps ``m_all [n, B, H, K, K]``, ``u_all [n, B, H, K, V]`` from ``s0``.

    Returns ``(state entering shard `rank`, state after the last shard)``, both ``[B, H, K, V]`` f32.
    """
    def step(carry, xs):
        s, s_in = carry
        i, m, u = xs
        s_in = jnp.where(i == rank, s, s_in)
        return (_ein("bhij,bhjv->bhiv", m, s) + u, s_in), None

    n = m_all.shape[0]
    (s_last, s_in), _ = jax.lax.scan(step, (s0, s0), (jnp.arange(n), m_all, u_all))
    return s_in, s_last


def kda_local(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *, axis_name: str,
              segment_ids: jax.Array | None = None, initial_state: jax.Array | None = None,
              scale: float | None = None, chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """Per-shard body of sequence-parallel KDA (inside shard_map over ``axis_name``).

    ``q, k, g [B, T_loc, H, K]``, ``v [B, T_loc, H, V]``, ``beta [B, T_loc, H]``, ``segment_ids [B, T_loc]``;
    ``initial_state [B, H, K, V]`` (the state before the *global* first token). Returns
    ``(o [B, T_loc, H, V] in v.dtype, final_state [B, H, K, V] f32)`` (final state of the whole sequence,
    identical on every shard).
    """
    b, t, h, kk = k.shape
    vv = v.shape[-1]
    rank = jax.lax.axis_index(axis_name)
    if segment_ids is not None:
        prev_last = halo_from_previous(segment_ids, 1, axis_name)[:, 0]
        starts_new_doc = (segment_ids[:, 0] != prev_last) & (rank > 0)  # [B]
        reset = kda_ref.segment_resets(segment_ids, b, t)
        reset = reset.at[:, 0].set(starts_new_doc)
    else:
        starts_new_doc = jnp.zeros((b,), bool)
        reset = jnp.zeros((b, t), bool)
    m, u = shard_state_map(k, v, g, beta, reset, chunk_size)
    m_all = jax.lax.all_gather(m, axis_name)  # [n, B, H, K, K]
    u_all = jax.lax.all_gather(u, axis_name)
    s0 = jnp.zeros((b, h, kk, vv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    s_in, s_final = incoming_state(m_all, u_all, s0, rank)
    s_in = jnp.where(starts_new_doc[:, None, None, None], 0.0, s_in)
    o, _ = kda_ref.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=s_in, output_final_state=False,
                             segment_ids=segment_ids, chunk_size=chunk_size, sub_chunk_size=min(16, chunk_size))
    return o, s_final


# ----------------------------------------------------------------------------- MLA
def mla_local(q_nope: jax.Array, q_rot: jax.Array, latent: jax.Array, k_rot: jax.Array, w_uk: jax.Array,
              w_uv: jax.Array, *, axis_name: str, scale: float, attend: AbsorbedAttention,
              segment_ids: jax.Array | None = None) -> jax.Array:
    """Per-shard causal MLA: all-gather the latent ``[B, T_loc, C]`` and ``k_rot [B, T_loc, Dr]`` (side by side, one
    collective) over ``axis_name``, attend the local queries ``[B, T_loc, H, *]`` with ``attend`` (absorbed form).
    Returns ``[B, T_loc, H, Dv]``."""
    t = q_nope.shape[1]
    rank = jax.lax.axis_index(axis_name)
    store = jax.lax.all_gather(jnp.concatenate([latent, k_rot], axis=-1), axis_name, axis=1, tiled=True)
    s = store.shape[1]
    pos_q = rank * t + jnp.arange(t)
    mask = (jnp.arange(s)[None, :] <= pos_q[:, None])[None]  # [1, T_loc, T]
    if segment_ids is not None:
        seg_all = jax.lax.all_gather(segment_ids, axis_name, axis=1, tiled=True)
        mask = mask & (segment_ids[:, :, None] == seg_all[:, None, :])
    mask = jnp.broadcast_to(mask, (q_nope.shape[0], t, s))
    return attend(q_nope, q_rot, store, w_uk, w_uv, mask, scale)


# ----------------------------------------------------------------------------- global wrappers
def kda_sequence_parallel(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                          mesh: Mesh | None = None, axis: str = "sequence",
                          batch_axes: Sequence[str] | None = ("data", "fsdp"), head_axis: str | None = "tensor",
                          segment_ids: jax.Array | None = None, initial_state: jax.Array | None = None,
                          scale: float | None = None, chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """``chunk_kda`` with ``T`` split over ``axis`` (same arguments/shapes; ``T`` divisible by the axis size).

    Returns ``(o [B, T, H, V], final_state [B, H, K, V] f32)``.
    """
    mesh = mesh_or_active(mesh, "sequence parallel")
    sizes = axis_sizes(mesh)
    b, t, h, _ = q.shape
    if t % sizes.get(axis, 1):
        raise ValueError(f"sequence parallel KDA: T={t} is not divisible by mesh axis {axis!r}={sizes[axis]}")
    bx = split_axes(batch_axes, sizes, b)
    hx = split_axes(head_axis, sizes, h)
    sx = split_axes(axis, sizes)
    x4, x3, x2 = P(bx, sx, hx, None), P(bx, sx, hx), P(bx, sx)
    st = P(bx, hx, None, None)
    if sx is None:  # nothing to split: plain kernel
        return kda_ref.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                 output_final_state=True, segment_ids=segment_ids, chunk_size=chunk_size,
                                 sub_chunk_size=min(16, chunk_size))

    def body(q, k, v, g, beta, seg, s0):
        return kda_local(q, k, v, g, beta, axis_name=axis, segment_ids=seg, initial_state=s0, scale=scale,
                         chunk_size=chunk_size)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(x4, x4, x4, x4, x3, x2 if segment_ids is not None else None,
                                                  st if initial_state is not None else None),
                       out_specs=(x4, st), check_vma=False)
    return fn(q, k, v, g, beta, segment_ids, initial_state)


def short_conv_sequence_parallel(u: jax.Array, kernel: jax.Array, *, mesh: Mesh | None = None,
                                 axis: str = "sequence", batch_axes: Sequence[str] | None = ("data", "fsdp"),
                                 channel_axis: str | None = "tensor",
                                 segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal depthwise conv ``u [B, T, C]`` × ``kernel [W, C]`` with ``T`` split over ``axis`` (3-token halo)."""
    mesh = mesh_or_active(mesh, "sequence parallel")
    sizes = axis_sizes(mesh)
    bx = split_axes(batch_axes, sizes, u.shape[0])
    cx = split_axes(channel_axis, sizes, u.shape[2])
    sx = split_axes(axis, sizes)

    def body(u, ker, seg):
        return short_conv_local(u, ker, axis, seg)

    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(P(bx, sx, cx), P(None, cx), P(bx, sx) if segment_ids is not None else None),
                       out_specs=P(bx, sx, cx), check_vma=False)
    return fn(u, kernel, segment_ids)


def mla_sequence_parallel(q_nope: jax.Array, q_rot: jax.Array, latent: jax.Array, k_rot: jax.Array,
                          w_uk: jax.Array, w_uv: jax.Array, *, scale: float, attend: AbsorbedAttention,
                          mesh: Mesh | None = None,
                          axis: str = "sequence", batch_axes: Sequence[str] | None = ("data", "fsdp"),
                          head_axis: str | None = "tensor", segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal MLA over a ``T``-sharded sequence from the latent (see :func:`mla_local`), by the layer's ``attend``.

    ``q_nope [B, T, H, Dn]``, ``q_rot [B, T, H, Dr]``, ``latent [B, T, C]``, ``k_rot [B, T, Dr]``,
    ``w_uk [C, H, Dn]``, ``w_uv [C, H, Dv]`` → ``[B, T, H, Dv]``.
    """
    mesh = mesh_or_active(mesh, "sequence parallel")
    sizes = axis_sizes(mesh)
    b, _, h, _ = q_nope.shape
    bx = split_axes(batch_axes, sizes, b)
    hx = split_axes(head_axis, sizes, h)
    sx = split_axes(axis, sizes)
    axis_name = axis if sx is not None else None

    def body(qn, qr, lat, kr, wk, wv, seg):
        if axis_name is None:
            t = qn.shape[1]
            mask = jnp.tril(jnp.ones((t, t), bool))[None]
            if seg is not None:
                mask = mask & (seg[:, :, None] == seg[:, None, :])
            return attend(qn, qr, lat, kr, wk, wv, jnp.broadcast_to(mask, (qn.shape[0], t, t)), scale)
        return mla_local(qn, qr, lat, kr, wk, wv, axis_name=axis_name, scale=scale, attend=attend,
                         segment_ids=seg)

    q4 = P(bx, sx, hx, None)
    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(q4, q4, P(bx, sx, None), P(bx, sx, None), P(None, hx, None), P(None, hx, None),
                                 P(bx, sx) if segment_ids is not None else None),
                       out_specs=q4, check_vma=False)
    return fn(q_nope, q_rot, latent, k_rot, w_uk, w_uv, segment_ids)
