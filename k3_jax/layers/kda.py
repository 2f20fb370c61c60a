"""Kimi Delta Attention layer: projections, causal short conv, lower-bounded gate, delta rule, gated norm.

The delta-rule recurrence itself lives in ``pallas_kernels.kda`` (reference + kernels, chosen through the
registries ``pallas_kernels.kda.ops.CHUNK`` (``cfg.kda_implementation``), ``DECODE``
(``cfg.kda_decode_implementation``) and ``pallas_kernels.kda.verify.VERIFY`` (speculative verification,
``cfg.kda_verify_implementation``) on ``cfg.platform``, with the gate bound ``cfg.gate_lower_bound``); this
module is the layer around it and matches the checkpoint's ``self_attn.*`` names for KDA layers.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3_jax.config import K3Config
from k3_jax.layers.common import Linear, Weight, compute_dtype, logical, rms_norm
from k3_jax.layers.parallel import axis_size
from k3_jax.parallel.sequence import kda_sequence_parallel, short_conv_sequence_parallel
from pallas_kernels.kda import ops as kda_ops
from pallas_kernels.kda import reference as kda_reference
from pallas_kernels.kda import verify as kda_verify
from pallas_kernels.registry import target_platform
from sharding.local_kernels import per_shard

_POSITION_STATES = contextvars.ContextVar("kda_position_states", default=False)


@contextlib.contextmanager
def record_position_states() -> Iterator[None]:
    """While tracing inside this context, a cached KDA call over ``T > 1`` tokens runs the recurrent form token
    by token with the decode step's arithmetic (:func:`pallas_kernels.kda.verify.recurrent_kda_states`, one kernel
    call for the ``T`` tokens on a GPU) and adds to its cache entry ``state_trace [B, T, H, K, V]`` f32 (the
    state after each token) and ``conv_trace [B, W-1+T, 3·H·K]`` (the conv inputs: the tail after ``i + 1``
    tokens is ``conv_trace[:, i + 1 : i + W]``), so a caller can keep any prefix of the ``T`` tokens
    (speculative verification, :mod:`k3_jax.serving.speculative`). The entry's ``state`` and ``conv`` are then
    returned as they came in (the state before the ``T`` tokens): the caller builds the kept state from the
    traces, so the pass writes no state of its own."""
    token = _POSITION_STATES.set(True)
    try:
        yield
    finally:
        _POSITION_STATES.reset(token)


def causal_depthwise_conv(
    u: jax.Array,
    kernel: jax.Array,
    conv_state: jax.Array | None,
    segment_ids: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv over time, fp32 inside (tap ``W-1`` multiplies the current token).

    Args:
      u: ``[B, T, C]`` inputs.
      kernel: ``[W, C]`` f32 taps (``kernel[j, c] == torch_weight[c, 0, j]``).
      conv_state: ``[B, W-1, C]`` the previous ``W-1`` inputs (zeros = start of sequence) or None.
      segment_ids: ``[B, T]`` int; a tap never reaches into an earlier document.
    Returns:
      ``([B, T, C]`` outputs in ``u.dtype``, new conv state ``[B, W-1, C]`` in ``u.dtype``).
    """
    b, t, c = u.shape
    w = kernel.shape[0]
    if conv_state is None:
        conv_state = jnp.zeros((b, w - 1, c), u.dtype)
    if t == 1:  # decode step: the taps read the tail in place (the same f32 sums as below, no [B, W, C] concat)
        taps = [conv_state[:, j : j + 1].astype(u.dtype) for j in range(w - 1)] + [u]
        kernel32 = kernel.astype(jnp.float32)
        out = jnp.zeros((b, 1, c), jnp.float32)
        for j, tap in enumerate(taps):
            out = out + tap.astype(jnp.float32) * kernel32[j]
        new_state = jnp.concatenate(taps[1:], axis=1) if w > 1 else u[:, :0, :]
        return out.astype(u.dtype), new_state
    full = jnp.concatenate([conv_state.astype(u.dtype), u], axis=1)  # [B, W-1+T, C]
    full32 = full.astype(jnp.float32)
    kernel32 = kernel.astype(jnp.float32)
    if segment_ids is not None:
        # Positions of the conv state continue the first token's document.
        seg_full = jnp.concatenate([jnp.repeat(segment_ids[:, :1], w - 1, axis=1), segment_ids], axis=1)
    out = jnp.zeros((b, t, c), jnp.float32)
    for j in range(w):
        tap = full32[:, j : j + t, :] * kernel32[j]
        if segment_ids is not None:
            # a [B, T, 1] 0/1 factor, not a select against a [B, T, C] mask: XLA may hoist a loop-invariant
            # full-width mask (and its zeros) out of the layer scan and then stream them from HBM per tap
            same = (seg_full[:, j : j + t] == segment_ids).astype(jnp.float32)
            tap = tap * same[..., None]
        out = out + tap
    new_state = full[:, -(w - 1):, :] if w > 1 else full[:, :0, :]
    return out.astype(u.dtype), new_state


def activate_conv_output(o: jax.Array, num_heads: int, normalize: bool, dtype: jnp.dtype) -> jax.Array:
    """SiLU in fp32, then (q, k) the per-head L2 norm: ``[B, T, H·D]`` -> ``[B, T, H, D]`` in ``dtype``."""
    b, t, hk = o.shape
    y = jax.nn.silu(o.astype(jnp.float32)).reshape(b, t, num_heads, hk // num_heads)
    return (kda_reference.l2norm(y) if normalize else y).astype(dtype)


_activate_recomputed = jax.checkpoint(activate_conv_output, static_argnums=(1, 2, 3))
""":func:`activate_conv_output` recomputed in the backward (for the sequence-parallel conv's output)."""


@functools.partial(jax.checkpoint, static_argnums=(4, 5, 6))
def conv_branch(u: jax.Array, kernel: jax.Array, conv_state: jax.Array | None, segment_ids: jax.Array | None,
                num_heads: int, normalize: bool, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """One of q/k/v after its projection: :func:`causal_depthwise_conv` then :func:`activate_conv_output`.

    ``u [B, T, H·D]`` -> ``([B, T, H, D]`` in ``dtype``, new conv state ``[B, W-1, H·D]``). Under
    ``jax.checkpoint``: the backward recomputes this elementwise chain from ``u`` instead of saving its fp32
    intermediates (several ``[B, T, H·D]`` f32 arrays per branch and layer at K3's width), which costs more
    HBM traffic to write and read back than the recomputation.
    """
    o, new_state = causal_depthwise_conv(u, kernel, conv_state, segment_ids)
    return activate_conv_output(o, num_heads, normalize, dtype), new_state


@functools.partial(jax.checkpoint, static_argnums=(3, 4))
def gated_output_norm(o: jax.Array, weight: jax.Array, gate: jax.Array, eps: float, dtype: jnp.dtype) -> jax.Array:
    """``rms_norm(f32(o)) · weight · sigmoid(f32(gate))`` per head, in ``dtype``: ``o, gate [B, T, H, D]``.

    Recomputed in the backward from ``o`` and ``gate``: its five f32 ``[B, T, H, D]`` intermediates are not kept.
    Off GPU the gate is multiplied in its flat ``[B, T, H·D]`` form (the projection's output as it comes): split into
    heads there, XLA:TPU makes the gate projection a matmul batched over the heads and transposes its whole weight on
    every call. On GPU it is split into heads, so that XLA:GPU's normalisation kernel takes the gate and the cast
    too (one kernel, not two). The same values either way.
    """
    b, t, h, d = o.shape
    if target_platform() == "gpu":  # per head: XLA:GPU fuses the gate and the cast into its normalisation kernel
        y = rms_norm(o.astype(jnp.float32), weight, eps) * jax.nn.sigmoid(gate.astype(jnp.float32))
        return y.astype(dtype)
    normed = rms_norm(o.astype(jnp.float32), weight, eps).reshape(b, t, h * d)
    y = normed * jax.nn.sigmoid(gate.reshape(b, t, h * d).astype(jnp.float32))
    return y.astype(dtype).reshape(b, t, h, d)


_X4 = ("batch", None, "kda_heads", None)  # q, k, v, g, o [B, T, H, D]; T whole (sequence parallel is separate)
_STATE = ("batch", "kda_heads", None, None)  # [B, H, K, V]


def _kernel_per_shard(op, q, k, v, g, beta, implementation: str, *, initial_state, segment_ids,
                      output_final_state: bool, **kw):
    """``op`` (``pallas_kernels.kda.ops.chunk_kda`` / ``recurrent_kda``) per shard of the active mesh: the
    kernels are single-device, each sequence and head is independent (:func:`sharding.local_kernels.per_shard`)."""
    def call(q, k, v, g, beta, s0, seg):
        return op(q, k, v, g, beta, initial_state=s0, segment_ids=seg, output_final_state=output_final_state,
                  implementation=implementation, **kw)

    return per_shard(call, (q, k, v, g, beta, initial_state, segment_ids),
                     (_X4, _X4, _X4, _X4, ("batch", None, "kda_heads"), _STATE, ("batch", None)), (_X4, _STATE))


def _states_per_shard(q, k, v, g, beta, initial_state, cfg: K3Config) -> tuple[jax.Array, jax.Array]:
    """:func:`pallas_kernels.kda.verify.recurrent_kda_states` per shard of the active mesh (as
    :func:`_kernel_per_shard`): ``(o [B, T, H, V], states [B, T, H, K, V] f32)``."""
    def call(q, k, v, g, beta, s0):
        return kda_verify.recurrent_kda_states(q, k, v, g, beta, s0, implementation=cfg.kda_verify_implementation,
                                               platform=cfg.platform)

    return per_shard(call, (q, k, v, g, beta, initial_state),
                     (_X4, _X4, _X4, _X4, ("batch", None, "kda_heads"), _STATE),
                     (_X4, ("batch", None, "kda_heads", None, None)))


class KimiDeltaAttention(nn.Module):
    """KDA mixer. ``x`` [B, T, D] -> ``y`` [B, T, D] (cfg.dtype), plus the new cache entry when given one.

    Cache entry (decode): ``{"state": [B, H, K, V] f32, "conv": [B, W-1, 3·H·K]}`` (q, k, v pre-conv inputs).
    With ``cache_index`` (a cached call on one device): ``cache`` is a segment's stacked entry
    ``{"state": [R, B, H, K, V], "conv": [R, B, W-1, 3·H·K]}`` and repeat ``cache_index`` is read and updated
    in place (one token: with ``stacked``, the segment's stacked conv and gate parameters
    (:func:`stacked_decode_params`), the short conv, gate and decode step in one op,
    :func:`pallas_kernels.kda.ops.fused_decode_step`, else the states as the decode kernel's state pool
    ``[R·B, H, K, V]``, rows ``cache_index·B + b``; ``T > 1``: the repeat's state and conv tail read by dynamic
    index and the new ones written by dynamic-update-slice); the returned entry is the whole stacked one, plus the
    un-stacked ``state_trace``/``conv_trace`` of this layer under :func:`record_position_states` (which leave the
    stacked entry untouched).
    """

    cfg: K3Config

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array | None = None,
                 cache: dict | None = None, cache_index: jax.Array | None = None,
                 stacked: dict | None = None) -> tuple[jax.Array, dict | None]:
        cfg = self.cfg
        h, dk = cfg.kda_num_heads, cfg.kda_head_dim
        hk = h * dk
        w = cfg.short_conv_kernel_size
        b, t, _ = x.shape
        dt = compute_dtype(cfg)

        q = Linear(hk, ("embed", "kda_heads"), cfg, name="q_proj")(x)
        k = Linear(hk, ("embed", "kda_heads"), cfg, name="k_proj")(x)
        v = Linear(hk, ("embed", "kda_heads"), cfg, name="v_proj")(x)

        def conv_kernel(name: str) -> jax.Array:
            # torch's default Conv1d init is U(-1/sqrt(W), 1/sqrt(W)) for a depthwise conv
            bound = 1.0 / (w ** 0.5)
            init = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
            return Weight((w, hk), ("conv", "kda_heads"), init, "float32", leaf="kernel", name=name)()

        kernels = [conv_kernel(n) for n in ("q_conv1d", "k_conv1d", "v_conv1d")]
        if cache_index is not None and t == 1 and stacked is not None:  # decode step, stacked cache in place
            o, new_cache = self._decode_in_place(x, q, k, v, stacked, cache, cache_index)
            return self._output(x, o), new_cache
        conv_cache = None if cache is None else cache["conv"]
        if cache_index is not None:
            conv_cache = jax.lax.dynamic_index_in_dim(conv_cache, cache_index, 0, keepdims=False)
        conv_states = [None, None, None]
        trace = cache is not None and t > 1 and _POSITION_STATES.get()
        if cache is not None:
            conv_states = jnp.split(conv_cache, 3, axis=-1)
        if trace:
            conv_trace = jnp.concatenate([conv_cache, jnp.concatenate([q, k, v], axis=-1).astype(
                conv_cache.dtype)], axis=1)
        outs, new_conv = [], []
        seq_parallel = cache is None and axis_size("sequence") > 1
        for u, ker, st, normalize in zip((q, k, v), kernels, conv_states, (True, True, False), strict=True):
            if seq_parallel:  # T is split over `sequence`: 3-token halo from the previous shard
                o = short_conv_sequence_parallel(u, ker, segment_ids=segment_ids)
                o, ns = _activate_recomputed(o, h, normalize, dt), None
            else:
                o, ns = conv_branch(u, ker, st, segment_ids, h, normalize, dt)
            outs.append(o)
            new_conv.append(ns)
        q, k, v = outs

        f, a_log, dt_bias, b_logits = self._gate_inputs(x)
        # recomputed in the backward from f (bf16): only the f32 gate itself (a kernel input) is kept
        g = jax.checkpoint(functools.partial(kda_reference.kda_gate, lower_bound=cfg.gate_lower_bound))(
            f.reshape(b, t, h, dk), a_log, dt_bias)
        beta = jax.nn.sigmoid(b_logits.astype(jnp.float32))

        initial_state = None if cache is None else cache["state"]
        if cache_index is not None and t > 1:  # this repeat's state of the stacked ones
            initial_state = jax.lax.dynamic_index_in_dim(initial_state, cache_index, 0, keepdims=False)
        kwargs = dict(initial_state=initial_state, output_final_state=cache is not None,
                      segment_ids=segment_ids, platform=cfg.platform)
        if seq_parallel:  # per-shard affine state maps combined by a prefix over `sequence`
            o, final_state = kda_sequence_parallel(q, k, v, g, beta, segment_ids=segment_ids,
                                                   initial_state=initial_state, chunk_size=cfg.kda_chunk_size)
        elif cache_index is not None and t == 1:  # decode step on the stacked states, in place (single device)
            r = initial_state.shape[0]
            pool = initial_state.reshape(r * b, *initial_state.shape[2:])
            slots = cache_index.astype(jnp.int32) * b + jnp.arange(b, dtype=jnp.int32)
            o, pool = kda_ops.recurrent_kda(q, k, v, g, beta, initial_state=pool, state_slots=slots,
                                            implementation=cfg.kda_decode_implementation, platform=cfg.platform)
            final_state = pool.reshape(initial_state.shape)
        elif cache is not None and t == 1:  # decode step: one token per sequence, the recurrent form
            o, final_state = _kernel_per_shard(kda_ops.recurrent_kda, q, k, v, g, beta, cfg.kda_decode_implementation,
                                               **kwargs)
        elif trace:  # T decode steps in one call, keeping every state (see record_position_states)
            o, state_trace = _states_per_shard(q, k, v, g, beta, initial_state, cfg)
            final_state = None
        else:
            o, final_state = _kernel_per_shard(kda_ops.chunk_kda, q, k, v, g, beta, cfg.kda_implementation,
                                               chunk_size=cfg.kda_chunk_size, gate_bound=cfg.gate_lower_bound,
                                               **kwargs)

        y = self._output(x, o)
        new_cache = None
        if trace:  # the entry as it came in (stacked or not), the traces beside it
            new_cache = {"state": cache["state"], "conv": cache["conv"], "state_trace": state_trace,
                         "conv_trace": conv_trace}
        elif cache is not None:
            conv = jnp.concatenate(new_conv, axis=-1).astype(cache["conv"].dtype)
            state = final_state.astype(jnp.float32)
            if cache_index is not None:
                conv = jax.lax.dynamic_update_index_in_dim(cache["conv"], conv, cache_index, 0)
                if t > 1:  # (one token: the kernel updated the stacked states in place)
                    state = jax.lax.dynamic_update_index_in_dim(cache["state"], state, cache_index, 0)
            new_cache = {"state": state, "conv": conv}
        return y, new_cache

    def _gate_inputs(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``(f [B, T, H·K]`` the raw gate, ``A_log [H]``, ``dt_bias [H·K]``, the beta logits ``[B, T, H])``."""
        cfg = self.cfg
        h, dk = cfg.kda_num_heads, cfg.kda_head_dim
        f = Linear(dk, ("embed", "gate_lowrank"), cfg, name="f_a_proj")(x)
        f = Linear(h * dk, ("gate_lowrank", "kda_heads"), cfg, name="f_b_proj")(f)
        a_log = self.param(
            "A_log",
            logical(lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0)),
                    ("kda_heads",)),
            (h,), jnp.float32,
        )
        dt_bias = self.param("dt_bias", logical(nn.initializers.zeros, ("kda_heads",)), (h * dk,), jnp.float32)
        return f, a_log, dt_bias, Linear(h, ("embed", "kda_heads"), cfg, name="b_proj")(x)

    def _output(self, x: jax.Array, o: jax.Array) -> jax.Array:
        """The gated output norm and ``o_proj``: ``o [B, T, H, V]`` -> ``[B, T, D]``."""
        cfg = self.cfg
        b, t, h, dk = o.shape
        o_norm = Weight((dk,), ("head_dim",), "ones", "float32", name="o_norm")()
        gate = Linear(h * dk, ("embed", "kda_heads"), cfg, name="g_proj")(x).reshape(b, t, h, dk)
        y = gated_output_norm(o, o_norm, gate, cfg.rms_norm_eps, compute_dtype(cfg)).reshape(b, t, h * dk)
        return Linear(cfg.hidden_size, ("kda_heads", "embed"), cfg, name="o_proj")(y)

    def _decode_in_place(self, x, q, k, v, stacked: dict, cache: dict, cache_index: jax.Array
                         ) -> tuple[jax.Array, dict]:
        """One token on a segment's stacked entry, read and written in place (single device): the short conv,
        gate and decode step in one op (:func:`pallas_kernels.kda.ops.fused_decode_step`, one kernel on the
        Triton backend) on the segment's stacked conv and gate parameters (:func:`stacked_decode_params`, read
        at repeat ``cache_index``). Returns ``(o [B, 1, H, V], the updated stacked entry)``."""
        cfg = self.cfg
        f, _, _, b_logits = self._gate_inputs(x)
        o, state, tail = kda_ops.fused_decode_step(
            q[:, 0], k[:, 0], v[:, 0], f[:, 0], b_logits[:, 0], cache["state"], cache["conv"], stacked["conv"],
            stacked["A_log"], stacked["dt_bias"], cache_index, lower_bound=cfg.gate_lower_bound,
            implementation=cfg.kda_decode_implementation, platform=cfg.platform)
        conv = jax.lax.dynamic_update_index_in_dim(cache["conv"], tail, cache_index, 0)
        return o[:, None], {"state": state, "conv": conv}


def stacked_decode_params(self_attn: dict | None) -> dict | None:
    """A scanned segment's stacked KDA parameters that the one-token decode reads at the repeat's index
    (``KimiDeltaAttention(..., stacked=...)``): ``{"conv": (q, k, v conv taps [R, W, H·K]), "A_log": [R, H],
    "dt_bias": [R, H·K]}`` from the layer's ``self_attn`` params as they are (no copy); None when absent."""
    if not self_attn or "q_conv1d" not in self_attn:
        return None
    conv = tuple(self_attn[f"{n}_conv1d"]["kernel"] for n in "qkv")
    return {"conv": conv, "A_log": self_attn["A_log"], "dt_bias": self_attn["dt_bias"]}
