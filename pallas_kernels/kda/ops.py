"""Public KDA entry points dispatching between the Pallas kernels and the pure-JAX reference.

``implementation``:
  * ``"auto"``: ``"pallas_tpu"`` on TPU; ``"pallas_gpu"`` on GPU (H200, bf16, B=1, T=8192, H=96: forward
    2.50 ms vs 20.6 ms for the XLA reference and 2.42 ms for fla; k3-small train step 0.177 vs 0.281 s with the
    reference, benchmarks/RESULTS.md), except for the chunked form when K or V is not a power of two >= 16
    (the Triton kernels' block rule), which takes the reference; ``"reference"`` elsewhere (on CPU,
    ``interpret`` truthy selects ``"pallas_tpu"`` in TPU interpret mode, which is how CI runs the kernel);
  * ``"reference"``: :mod:`pallas_kernels.kda.reference` (any ``g <= 0``);
  * ``"pallas_tpu"`` / ``"pallas_gpu"``: the kernels (they require the K3 lower-bounded gate ``g >= -5``).

Gradients: the Pallas forward sits inside ``jax.custom_vjp`` (nothing but the inputs is saved), so ``jax.grad``
gives gradients for q, k, v, g, beta and the initial state on every implementation. ``backward`` picks the
backward: ``"auto"`` / ``"pallas"`` = the backward kernels of the implementation
(:mod:`pallas_kernels.kda.tpu_bwd`: state sweep + reverse chunk sweep for ``"pallas_tpu"``;
:mod:`pallas_kernels.kda.gpu_bwd`: eight Triton kernels for ``"pallas_gpu"``); ``"reference"`` = the
recomputed chunked reference's VJP.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.kda import reference as ref

IMPLEMENTATIONS = ("auto", "reference", "pallas_tpu", "pallas_gpu")
BACKWARDS = ("auto", "pallas", "reference")


def _resolve(implementation: str, interpret, name: str) -> str:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{name}: implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation != "auto":
        return implementation
    backend = jax.default_backend()
    if backend == "tpu":
        return "pallas_tpu"
    if backend in ("gpu", "cuda"):
        return "pallas_gpu"
    return "pallas_tpu" if interpret else "reference"


def _kernel_fwd(impl: str, q, k, v, g, beta, scale, h0, seg, chunk_size, interpret):
    if impl == "pallas_tpu":
        from pallas_kernels.kda import tpu

        return tpu.chunk_kda_fwd(q, k, v, g, beta, scale, h0, seg, chunk_size, interpret=interpret)
    from pallas_kernels.kda import gpu

    return gpu.chunk_kda_fwd(q, k, v, g, beta, scale, h0, seg, chunk_size, interpret=interpret)


@functools.cache
def _pallas_chunk_fn(impl: str, scale: float, chunk_size: int, interpret, backward: str = "reference"):
    """``f(q, k, v, g, beta, h0, seg) -> (o, ht)``; VJP by the backward kernels of ``impl``
    (``backward="pallas"``) or by recomputing the chunked reference (``"reference"``)."""

    @jax.custom_vjp
    def f(q, k, v, g, beta, h0, seg):
        return _kernel_fwd(impl, q, k, v, g, beta, scale, h0, seg, chunk_size, interpret)

    def f_fwd(q, k, v, g, beta, h0, seg):
        return f(q, k, v, g, beta, h0, seg), (q, k, v, g, beta, h0, seg)

    def f_bwd(res, cts):
        q, k, v, g, beta, h0, seg = res
        do, dht = cts
        if backward == "pallas":
            if impl == "pallas_gpu":
                from pallas_kernels.kda import gpu_bwd as bwd_mod
            else:
                from pallas_kernels.kda import tpu_bwd as bwd_mod

            grads = bwd_mod.chunk_kda_bwd(q, k, v, g, beta, scale, h0, seg, do.astype(v.dtype),
                                          dht.astype(jnp.float32), chunk_size, interpret=interpret)
            return (*grads, None)

        def fwd(q, k, v, g, beta, h0):
            return ref.chunk_kda(q, k, v, g, beta, scale, h0, True, seg, chunk_size)

        _, vjp = jax.vjp(fwd, q, k, v, g, beta, h0)
        grads = vjp((do.astype(v.dtype), dht.astype(jnp.float32)))
        return (*grads, None)

    f.defvjp(f_fwd, f_bwd)
    return f


def _fused_inputs(q, k, g, A_log, dt_bias, lower_bound, use_qk_l2norm):
    """Optional gate / L2-norm preprocessing (fla's ``use_gate_in_kernel`` / ``use_qk_l2norm_in_kernel``),
    done in JAX in front of the kernel (XLA fuses it with the kernel's input layout pass; differentiable)."""
    if A_log is not None:
        g = ref.kda_gate(g, A_log, dt_bias, lower_bound)
    elif dt_bias is not None:
        raise ValueError("chunk_kda: dt_bias given without A_log (the raw-gate path needs A_log)")
    if use_qk_l2norm:
        q, k = ref.l2norm(q), ref.l2norm(k)
    return q, k, g


def chunk_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    chunk_size: int = 64,
    implementation: str = "auto",
    interpret=False,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    lower_bound: float = -5.0,
    use_qk_l2norm: bool = False,
    safe_gate: bool = True,
    backward: str = "auto",
) -> tuple[jax.Array, jax.Array | None]:
    """Chunked KDA (training / prefill). Shapes as :func:`pallas_kernels.kda.reference.chunk_kda`:

    ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``, ``beta [B, T, H]``, ``initial_state [B, H, K, V] f32``,
    ``segment_ids [B, T] int``. Returns ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] f32 or None)``.
    With ``A_log [H]`` (and optional ``dt_bias [H*K]``), ``g`` is the raw gate ``f`` and the K3 log-decay
    ``lower_bound * sigmoid(exp(A_log) (f + dt_bias))`` is computed first; ``use_qk_l2norm`` L2-normalises
    q and k first (scale is still applied after the norm).
    ``safe_gate=True`` (default) promises ``g >= -5`` per token (K3's gate; fla's ``safe_gate``), which the
    Pallas kernels need; with ``safe_gate=False`` (e.g. the unbounded Kimi-Linear gate) ``"auto"`` uses the
    reference, which is exact for any ``g <= 0``.
    ``backward``: ``"auto"`` | ``"pallas"`` | ``"reference"`` (see the module docstring).
    """
    if backward not in BACKWARDS:
        raise ValueError(f"chunk_kda: backward must be one of {BACKWARDS}, got {backward!r}")
    q, k, g = _fused_inputs(q, k, g, A_log, dt_bias, lower_bound, use_qk_l2norm)
    impl = _resolve(implementation, interpret, "chunk_kda")
    if not safe_gate and implementation == "auto":
        impl = "reference"
    if A_log is not None and lower_bound < -5.0 and implementation == "auto":
        impl = "reference"
    if impl == "pallas_gpu" and implementation == "auto" and not all(
        d >= 16 and d & (d - 1) == 0 for d in (q.shape[-1], v.shape[-1])
    ):
        impl = "reference"  # the Triton chunk kernels need power-of-two head dims >= 16
    if impl == "reference":
        return ref.chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, segment_ids, chunk_size)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    h0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    interp = interpret
    if impl == "pallas_tpu" and interpret is True:
        from jax.experimental.pallas import tpu as pltpu

        interp = pltpu.InterpretParams()
    bwd = "pallas" if backward == "auto" else backward
    fn = _pallas_chunk_fn(impl, float(scale), int(chunk_size), interp, bwd)
    o, ht = fn(q, k, v, g, beta, h0, segment_ids)
    return o, (ht if output_final_state else None)


def recurrent_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    state_slots: jax.Array | None = None,
    implementation: str = "auto",
    interpret=False,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    lower_bound: float = -5.0,
    use_qk_l2norm: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Recurrent KDA; the Pallas path is the decode step (``T == 1``).

    Without ``state_slots``: ``initial_state [B, H, K, V]`` (zeros if None), returns
    ``(o [B, T, H, V], final_state [B, H, K, V] f32 or None)``.
    With ``state_slots [B] i32``: ``initial_state`` is a state pool ``[P, H, K, V] f32`` and sequence b
    reads/writes row ``state_slots[b]`` (distinct slots); returns ``(o, new_pool)`` where the other rows are
    unchanged. On the Pallas path the pool is updated in place (aliased: donate it under ``jit``).
    ``T > 1`` and ``implementation="reference"`` use the reference scan; ``segment_ids`` only matter there.
    Not differentiable on the Pallas path (inference only). ``A_log``/``dt_bias``/``use_qk_l2norm`` as in
    :func:`chunk_kda`.
    """
    q, k, g = _fused_inputs(q, k, g, A_log, dt_bias, lower_bound, use_qk_l2norm)
    impl = _resolve(implementation, interpret, "recurrent_kda")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    if state_slots is not None:
        if initial_state is None or initial_state.ndim != 4 or initial_state.shape[1:] != (H, K, V):
            raise ValueError(
                f"recurrent_kda: with state_slots, initial_state must be a pool [P, {H}, {K}, {V}], "
                f"got {None if initial_state is None else initial_state.shape}"
            )
        if state_slots.shape != (B,):
            raise ValueError(f"recurrent_kda: state_slots must be [B]=[{B}], got {state_slots.shape}")
    if impl == "reference" or T != 1:
        h0 = initial_state if state_slots is None else initial_state[state_slots]
        o, ht = ref.recurrent_kda(q, k, v, g, beta, scale, h0, True, segment_ids)
        if state_slots is not None:
            ht = initial_state.astype(jnp.float32).at[state_slots].set(ht)
        return o, (ht if output_final_state or state_slots is not None else None)
    ref._check_inputs(q, k, v, g, beta, None, segment_ids, "recurrent_kda")
    if state_slots is None:
        pool = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state
        slots = jnp.arange(B, dtype=jnp.int32)
    else:
        pool, slots = initial_state, state_slots
    args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], float(scale), pool, slots)
    if impl == "pallas_tpu":
        from pallas_kernels.kda import tpu

        o, pool = tpu.decode_step(*args, interpret=interpret)
    else:
        from pallas_kernels.kda import gpu

        o, pool = gpu.decode_step(*args, interpret=interpret)
    return o[:, None], (pool if output_final_state or state_slots is not None else None)
