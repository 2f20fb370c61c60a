"""KDA over a few tokens with every intermediate state: the verification step of speculative decoding.

``recurrent_kda_states(q, k, v, g, beta, initial_state)`` runs ``T`` (a handful: the ``k + 1`` verified tokens)
recurrent KDA steps per sequence and returns the output of each and the state after each, so a caller can keep any
prefix of the ``T`` tokens (:mod:`k3_jax.serving.speculative` rolls a rejected suffix back this way). The
arithmetic per token is that of the one-token decode step (:data:`pallas_kernels.kda.ops.DECODE`), so keeping
``n`` tokens gives the state ``n`` decode steps give.

:data:`VERIFY` is the op's registry (``cfg.kda_verify_implementation`` names its backend):

* ``mosaic_tpu``: one Pallas Mosaic TPU kernel for all ``T`` tokens (:mod:`pallas_kernels.kda.verify_tpu`), grid
  ``(B, H / hb)``: a program keeps its heads' ``[K, V]`` fp32 states in VMEM across the tokens and writes the output
  and the state after every token; each token's update is the TPU decode kernel's
  (:func:`pallas_kernels.kda.tpu.decode_update`). Refused when its blocks do not fit the scoped VMEM (long ``T``).
* ``triton``: one Pallas Triton kernel for all ``T`` tokens on one flat grid of ``B * H * (V / BV)`` programs,
  the V slices of one state fastest, then heads, then rows: a program keeps its ``[K, BV]`` fp32 state slice in
  registers across the tokens (a static loop over ``T``) and writes the output and the state slice after every
  token; each token's update is the decode kernel's (:func:`pallas_kernels.kda.gpu.decode_update`).
  ``BV`` is 32 below :data:`WIDE_SLICE_PROGRAMS` programs of 64 columns (few rows: more, smaller programs fill
  the GPU), else 64; 4 warps.
* ``xla``: the reference one-token step (:func:`pallas_kernels.kda.reference.recurrent_kda`) once per token.

Shapes: ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``, ``beta [B, T, H]``, ``initial_state [B, H, K, V]`` f32.
Returns ``(o [B, T, H, V] in v.dtype, states [B, T, H, K, V] f32)`` with ``states[:, i]`` the state after token
``i``. Forward only (inference); any ``g <= 0`` (no gate bound needed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.forward_only import forward_only
from pallas_kernels.kda import gpu, ops
from pallas_kernels.kda import reference as ref
from pallas_kernels.registry import Backend, Registry, platform_reason

NUM_WARPS = 4
WIDE_SLICE_PROGRAMS = 2048
"""At or above this many programs of 64 V columns (``B * H * V / 64``) the Triton kernel takes 64-column slices,
below it 32 (``benchmarks/RESULTS.md``, the verify kernel's row)."""


def _triton_verify(call: ops.KdaCall) -> str | None:
    _, _, _, k, v = call.shape
    dims = None if k & (k - 1) == 0 and v & (v - 1) == 0 else f"head dims must be powers of two, got K={k}, V={v}"
    return ops._first(platform_reason(call, "gpu"), ops._triton_shipped(), ops._dtype_reason(call), dims)


def _tpu_verify(call: ops.KdaCall) -> str | None:
    from pallas_kernels.kda import verify_tpu  # noqa: PLC0415  (imports the Mosaic TPU toolchain)

    _, t, h, k, v = call.shape
    return ops._first(platform_reason(call, "tpu"), ops._dtype_reason(call),
                      verify_tpu.supports_reason(t, h, k, v, call.dtype))


VERIFY = Registry("kda.verify", (
    Backend("mosaic_tpu", "one Pallas Mosaic TPU kernel over the T tokens, writing the state after each", _tpu_verify),
    Backend("triton", "one Pallas Triton kernel over the T tokens, writing the state after each", _triton_verify),
    ops.XLA,
), ops.ALIASES)


def _verify_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, h0_ref, o_ref, states_ref, *, scale: float, block_v: int,
                   num_tokens: int, heads: int):
    b, h, j = gpu.flat_slice_ids(v_ref.shape[-1] // block_v, heads)
    f32 = jnp.float32
    vs = pl.ds(j * block_v, block_v)
    s = h0_ref[b, h, :, vs]  # [K, BV]
    for t in range(num_tokens):  # the decode kernel's update (gpu.decode_update), token by token
        qc = q_ref[b, t, h, :].astype(f32)[:, None]  # [K, 1]
        kc = k_ref[b, t, h, :].astype(f32)[:, None]
        gc = g_ref[b, t, h, :].astype(f32)[:, None]
        vr = v_ref[b, t, h, vs].astype(f32)[None, :]  # [1, BV]
        bb = beta_ref[b, t, h].astype(f32)
        o, s = gpu.decode_update(s, qc, kc, gc, vr, bb, scale)
        o_ref[b, t, h, vs] = o[0].astype(o_ref.dtype)
        states_ref[b, t, h, :, vs] = s


def slice_width(batch: int, heads: int, v: int) -> int:
    """The Triton kernel's V slice: 64 columns at or above :data:`WIDE_SLICE_PROGRAMS` such programs, else 32
    (never wider than ``v``)."""
    return min(v, 64 if batch * heads * max(v // 64, 1) >= WIDE_SLICE_PROGRAMS else 32)


def triton_states(q, k, v, g, beta, scale: float, initial_state, block_v: int | None = None,
                  num_warps: int = NUM_WARPS, interpret: bool = False):
    """The ``triton`` backend (module docstring); ``block_v`` ``None`` takes :func:`slice_width`;
    ``interpret=True`` runs Pallas's interpreter (CPU tests)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    bv = slice_width(B, H, V) if block_v is None else min(block_v, V)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton  # noqa: PLC0415

        params = pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
    o, states = forward_only(pl.pallas_call(
        functools.partial(_verify_kernel, scale=float(scale), block_v=bv, num_tokens=T, heads=H),
        grid=(B * H * (V // bv),),
        out_shape=[jax.ShapeDtypeStruct((B, T, H, V), v.dtype), jax.ShapeDtypeStruct((B, T, H, K, V), jnp.float32)],
        compiler_params=params,
        interpret=bool(interpret),
        name="kda_verify_gpu",
    ), q, k, v, g, beta, initial_state.astype(jnp.float32), name="kda.verify.triton_states")
    return o, states


def _per_token(step, q, k, v, g, beta, initial_state):
    """``step(q_t, k_t, v_t, g_t, beta_t, state) -> (o_t [B, 1, H, V], state)`` over the ``T`` tokens."""
    outs, states, state = [], [], initial_state.astype(jnp.float32)
    for t in range(q.shape[1]):
        o_t, state = step(*(a[:, t:t + 1] for a in (q, k, v, g, beta)), state)
        outs.append(o_t)
        states.append(state.astype(jnp.float32))
    return jnp.concatenate(outs, axis=1), jnp.stack(states, axis=1)


def recurrent_kda_states(q, k, v, g, beta, initial_state, scale: float | None = None, implementation: str = "auto",
                         interpret: bool = False, platform: str | None = None):
    """``(o [B, T, H, V], states [B, T, H, K, V] f32)``: see the module docstring. ``implementation``: a
    :data:`VERIFY` backend or ``"auto"``; ``interpret``: run the Pallas kernels in interpret mode (CPU)."""
    if initial_state is None:
        raise ValueError("recurrent_kda_states: initial_state [B, H, K, V] is required")
    ref._check_inputs(q, k, v, g, beta, initial_state, None, "recurrent_kda_states")
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else float(scale)
    impl = VERIFY.select(implementation, ops.make_call(q, v, 64, None, interpret, platform)).backend
    if impl == "triton":
        return triton_states(q, k, v, g, beta, scale, initial_state, interpret=interpret)
    if impl == "mosaic_tpu":
        from pallas_kernels.kda import verify_tpu  # noqa: PLC0415

        return verify_tpu.verify_states(q, k, v, g, beta, scale, initial_state, interpret=interpret)

    def step(q, k, v, g, beta, s):
        return ref.recurrent_kda(q, k, v, g, beta, scale, s, True)

    return _per_token(step, q, k, v, g, beta, initial_state)
