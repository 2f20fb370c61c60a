"""The one-token KDA decode step with its prologue in the same Triton kernel: the short conv over the q, k, v
projections, SiLU, the q / k L2 norm, the gate and beta (:func:`pallas_kernels.kda.reference.decode_prologue`),
then the state update of :func:`pallas_kernels.kda.gpu.decode_update`, on one layer of stacked states, in place.

Grid: the plain decode kernel's flat grid (:func:`pallas_kernels.kda.gpu.flat_slice_ids`: V slices fastest, then
heads, then rows), one program per ``(row b, head h, V slice j)``. Each program convolves and normalises the
head's whole q and k (``K`` columns; the head's V slices repeat this small work) and its slice of v, forms the
head's gate and beta, and updates its ``[K, BV]`` state slice. The states ``[L, B, H, K, V]``, the conv tails
``[L, B, W-1, C]`` and the conv / gate parameters ``[L, ...]`` are read in place at the layer index (row
``layer * B + b`` of the flattened stacks); the new tails go to a separate output: the programs of one head read the
same q / k tail, so none may overwrite it (the V slice 0 program writes the head's new q / k tail, every program its
v slice's).

Rounding as the layer's unfused path: the fp32 conv sum (tap 0 first) rounded to the projections' dtype, SiLU and
the L2 norm in fp32, the results rounded to that dtype again before the update reads them in fp32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.forward_only import forward_only
from pallas_kernels.kda.gpu import _compiler_params, decode_update, flat_slice_ids

L2NORM_EPS = 1e-6
"""As :func:`pallas_kernels.kda.reference.l2norm`."""


def _conv(taps, weights, u, dt):
    """``sum_j taps[j] * weights[j]`` (fp32, tap 0 first; the current token ``u`` is the last tap), rounded to
    ``dt`` and widened back."""
    acc = None
    for tap, w in zip([*taps, u], weights, strict=True):
        term = tap.astype(dt).astype(jnp.float32) * w
        acc = term if acc is None else acc + term
    return acc.astype(dt).astype(jnp.float32)


def _sigmoid(y):
    return 1.0 / (1.0 + jnp.exp(-y))


def _silu(y):
    return y * _sigmoid(y)


def _fused_decode_kernel(layer_ref, q_ref, k_ref, v_ref, f_ref, b_ref, tail_ref, wq_ref, wk_ref, wv_ref, alog_ref,
                         dtb_ref, pool_in_ref, o_ref, pool_out_ref, new_tail_ref,
                         *, scale: float, block_v: int, heads: int, taps: int, lower_bound: float):
    V = v_ref.shape[-1] // heads
    b, h, j = flat_slice_ids(V // block_v, heads)
    f32 = jnp.float32
    dt = q_ref.dtype
    K = q_ref.shape[-1] // heads
    hk = heads * K
    layer = layer_ref[0]
    row = layer * q_ref.shape[0] + b  # of the conv tails and the states, both [L * B, ...]
    cols = pl.ds(h * K, K)

    def branch(offset: int, x_ref, w_ref, sl, normalize: bool):
        """One of q / k / v over the columns ``sl`` of its projection: (activated f32 1-D, the new tail's taps)."""
        old = [tail_ref[row, t, pl.ds(offset + sl.start, sl.size)] for t in range(taps - 1)]
        u = x_ref[b, sl]
        y = _silu(_conv(old, [w_ref[layer, t, sl] for t in range(taps)], u, dt))
        if normalize:
            y = y * jax.lax.rsqrt(jnp.sum(y * y) + L2NORM_EPS)
        return y.astype(dt).astype(f32), [*old[1:], u]

    q, q_tail = branch(0, q_ref, wq_ref, cols, True)
    k, k_tail = branch(hk, k_ref, wk_ref, cols, True)
    vs = pl.ds(h * V + j * block_v, block_v)
    v, v_tail = branch(2 * hk, v_ref, wv_ref, vs, False)

    x = f_ref[b, cols].astype(f32) + dtb_ref[layer, cols]
    g = lower_bound * _sigmoid(jnp.exp(alog_ref[layer, h]) * x)
    lo = float(np.nextafter(np.float32(lower_bound), np.float32(0.0)))
    hi = -float(np.finfo(np.float32).tiny)
    g = jnp.minimum(jnp.maximum(g, lo), hi)
    beta = _sigmoid(b_ref[b, h].astype(f32))

    vcols = pl.ds(j * block_v, block_v)
    s = pool_in_ref[row, h, :, vcols]  # [K, BV]
    o, s = decode_update(s, q[:, None], k[:, None], g[:, None], v[None, :], beta, scale)
    o_ref[b, h, :, vcols] = o.astype(o_ref.dtype)
    pool_out_ref[row, h, :, vcols] = s

    tdt = new_tail_ref.dtype
    for t, tap in enumerate(v_tail):
        new_tail_ref[b, t, pl.ds(2 * hk + vs.start, block_v)] = tap.astype(tdt)

    @pl.when(j == 0)
    def _qk_tail():
        for offset, tail in ((0, q_tail), (hk, k_tail)):
            for t, tap in enumerate(tail):
                new_tail_ref[b, t, pl.ds(offset + h * K, K)] = tap.astype(tdt)


def fused_decode_step(q_proj, k_proj, v_proj, f_proj, b_proj, state, conv, conv_weights, A_log, dt_bias, layer, *,
                      scale: float, lower_bound: float, block_v: int = 64, num_warps: int = 8,
                      interpret: bool = False):
    """The fused decode step (shapes and contract as :func:`pallas_kernels.kda.ops.fused_decode_step`, with
    ``dt_bias`` given). Returns ``(o [B, H, V]`` in ``v_proj``'s dtype, the new states ``[L, B, H, K, V]``
    (updated in place: aliased), the new conv tails ``[B, W-1, 2*H*K + H*V]`` in ``conv``'s dtype).

    ``block_v`` / ``num_warps``: V slice per program and its warps (the plain decode kernel's defaults)."""
    L, B, H, K, V = state.shape
    W = conv_weights[0].shape[1]
    BV = min(block_v, V)
    f32 = jnp.float32
    o, pool, tail = forward_only(pl.pallas_call(
        functools.partial(_fused_decode_kernel, scale=float(scale), block_v=BV, heads=H, taps=W,
                          lower_bound=float(lower_bound)),
        grid=(B * H * (V // BV),),
        out_shape=[jax.ShapeDtypeStruct((B, H, 1, V), v_proj.dtype),
                   jax.ShapeDtypeStruct((L * B, H, K, V), f32),
                   jax.ShapeDtypeStruct((B, W - 1, conv.shape[-1]), conv.dtype)],
        input_output_aliases={12: 1},
        compiler_params=None if interpret else _compiler_params(num_warps, 1),
        interpret=bool(interpret),
        name="kda_fused_decode_gpu",
    ), jnp.asarray(layer, jnp.int32).reshape(1), q_proj, k_proj, v_proj, f_proj, b_proj,
        conv.reshape(L * B, *conv.shape[2:]), *(w.astype(f32) for w in conv_weights), A_log.astype(f32),
        dt_bias.astype(f32), state.astype(f32).reshape(L * B, H, K, V),
        name="kda.gpu_decode_fused.fused_decode_step")
    return o[:, :, 0, :], pool.reshape(state.shape), tail
