"""KDA over the ``T`` verified tokens with every state, as one Mosaic TPU kernel (the ``mosaic_tpu`` backend of
:data:`pallas_kernels.kda.verify.VERIFY`).

Grid ``(B, H / hb)``, both axes ``"parallel"``: a program loads the ``[K, V]`` f32 state of each of its ``hb`` heads
once, runs the ``T`` tokens through it in a static loop with the decode kernel's per-token update
(:func:`pallas_kernels.kda.tpu.decode_update`, so keeping ``n`` tokens gives the state ``n`` decode steps give) and
writes the output and the state after every token. The state stays in vregs/VMEM across the tokens: HBM sees the
``B`` initial states once and the ``T`` states written once (the per-token decode step would read and write a
state per token and leave the stacking of the trace to XLA).

Blocks: the tokens' vectors ``[T, hb, K]`` (``hb = 8`` heads when ``H % 8 == 0``, else all ``H``: the sublane rule
for the second-to-last block dim), the initial states ``[hb, K, V]``, the outputs ``[T, hb, V]`` and the states
``[T, hb, K, V]``; each double-buffered. :func:`vmem_bytes` is that footprint; :func:`supports_reason` refuses a
call whose footprint exceeds :data:`VMEM_LIMIT` (Mosaic's default scoped VMEM limit on v5p).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.forward_only import forward_only
from pallas_kernels.kda.tpu import decode_update

HEADS_PER_BLOCK = 8
VMEM_LIMIT = 16 * 2**20
"""Mosaic's default scoped VMEM limit on v5p (v6e: 32 MiB): the kernel's double-buffered blocks must fit it."""
KERNEL_NAME = "kda_verify_tpu"


def heads_per_block(num_heads: int) -> int:
    """Heads per program: :data:`HEADS_PER_BLOCK` when it divides ``num_heads``, else all of them."""
    return HEADS_PER_BLOCK if num_heads % HEADS_PER_BLOCK == 0 else num_heads


def vmem_bytes(tokens: int, num_heads: int, k: int, v: int, in_bytes: int) -> int:
    """VMEM the kernel's blocks ask for, double-buffered: vectors padded to (8 sublanes, 128 lanes)."""
    lane = lambda n: -(-n // 128) * 128  # noqa: E731
    sub = lambda n: -(-n // 8) * 8  # noqa: E731
    hb = heads_per_block(num_heads)
    vectors = tokens * sub(hb) * (2 * lane(k) * in_bytes + lane(k) * 4 + lane(v) * in_bytes + lane(1) * 4)
    outputs = tokens * sub(hb) * lane(v) * in_bytes + tokens * hb * sub(k) * lane(v) * 4
    return 2 * (vectors + hb * sub(k) * lane(v) * 4 + outputs)


def supports_reason(tokens: int, num_heads: int, k: int, v: int, dtype: str) -> str | None:
    """None when the kernel's blocks fit :data:`VMEM_LIMIT`, else why not."""
    need = vmem_bytes(tokens, num_heads, k, v, jnp.dtype(dtype).itemsize)
    if need > VMEM_LIMIT:
        return (f"T={tokens} tokens x {heads_per_block(num_heads)} heads of [{k}, {v}] f32 states need "
                f"~{need:,} B of VMEM (double-buffered), over the {VMEM_LIMIT:,} B scoped limit")
    return None


def _verify_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, h0_ref, o_ref, states_ref, *, scale: float):
    num_tokens, hb, _ = q_ref.shape
    for h in range(hb):
        one = pl.ds(h, 1)
        s = h0_ref[h]  # [K, V] f32
        for t in range(num_tokens):
            o, s = decode_update(s, q_ref[t, one, :], k_ref[t, one, :], v_ref[t, one, :], g_ref[t, one, :],
                                 beta_ref[t, one, :], scale)
            o_ref[t, one, :] = o.astype(o_ref.dtype)
            states_ref[t, h] = s


def verify_states(q, k, v, g, beta, scale: float, initial_state, interpret=False):
    """The ``T`` tokens' outputs and states (contract of :func:`pallas_kernels.kda.verify.recurrent_kda_states`).

    Args: ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``, ``beta [B, T, H]``, ``initial_state [B, H, K, V]`` (cast to
    f32). Returns ``(o [B, T, H, V] in v.dtype, states [B, T, H, K, V] f32)``. ``interpret`` may be ``True`` or a
    ``pltpu.InterpretParams`` (runs the kernel on CPU).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    hb = heads_per_block(H)
    if interpret is True:
        interpret = pltpu.InterpretParams()
    vec = lambda d: pl.BlockSpec((None, T, hb, d), lambda b, h: (b, 0, h, 0))  # noqa: E731
    state = pl.BlockSpec((None, hb, K, V), lambda b, h: (b, h, 0, 0))
    states = pl.BlockSpec((None, T, hb, K, V), lambda b, h: (b, 0, h, 0, 0))
    size = lambda a: a.size * a.dtype.itemsize  # noqa: E731
    cost = pl.CostEstimate(  # the initial states read once, the T states written, the tokens' vectors
        flops=6 * B * T * H * K * V, transcendentals=B * T * H * K,
        bytes_accessed=(1 + T) * B * H * K * V * 4 + sum(size(a) for a in (q, k, v, g, beta)) + size(v))
    o, trace = forward_only(pl.pallas_call(
        functools.partial(_verify_kernel, scale=float(scale)),
        grid=(B, H // hb),
        in_specs=[vec(K), vec(K), vec(V), vec(K), vec(1), state],
        out_specs=[vec(V), states],
        out_shape=[jax.ShapeDtypeStruct((B, T, H, V), v.dtype), jax.ShapeDtypeStruct((B, T, H, K, V), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        cost_estimate=cost,
        name=KERNEL_NAME,
    ), q, k, v, g, beta[..., None], initial_state.astype(jnp.float32), name="kda.verify_tpu.verify_states")
    return o, trace
