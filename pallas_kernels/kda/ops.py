"""Public KDA entry points: a registry of backends per op and the dispatch through it.

Two ops, each an ordered table (:class:`pallas_kernels.registry.Registry`; ``"auto"`` = the first that supports
the call, an explicit name that cannot run raises with the reason):

* :data:`CHUNK` (``chunk_kda``, training / prefill): ``mosaic_tpu`` (:mod:`.tpu`, :mod:`.tpu_bwd`), ``triton``
  (:mod:`.gpu`, :mod:`.gpu_bwd`), ``mosaic_gpu`` (:mod:`.mosaic_gpu`: the sm_90 forward as a per-chunk kernel and
  a state pass; its backward is the Triton kernels' with three steps on Mosaic GPU while JAX ships Triton, else
  every step on Mosaic GPU), ``xla``
  (:mod:`.reference`, the chunked UT/WY form).
* :data:`DECODE` (``recurrent_kda`` with one token, on a state pool): ``mosaic_tpu``, ``triton``, ``mosaic_gpu``
  (:mod:`.mosaic_gpu_decode`, sm_90, K = V = 128; after ``triton`` until an H200 run shows it faster:
  ``benchmarks/kda.py`` times both; speculative verification, :data:`.verify.VERIFY`, has no Mosaic GPU entry),
  ``xla``.

:func:`fused_decode_step` (a decode token from a layer's projections: the short conv, gate and beta, then the
:data:`DECODE` step on stacked states read at a layer) takes its kernel from :data:`DECODE`; on ``triton`` the
prologue runs inside the decode kernel (:mod:`.gpu_decode_fused`).

Order on a GPU: ``mosaic_gpu`` on sm_90+ (:attr:`KdaCall.compute_capability`; faster than the Triton forward on
the H200 in a same-run comparison, benchmarks/RESULTS.md), then
``triton`` while JAX ships the Pallas Triton backend (``registry.TRITON_SHIPPED``), then ``xla``. The decode table
puts ``triton`` ahead of ``mosaic_gpu``.

What a backend checks (``supports``): the target platform (``platform=`` or
:func:`pallas_kernels.registry.target_platform`: the mesh's devices, else the default device; ``interpret=True``
runs the Pallas kernels on CPU in interpret mode, ``"auto"`` then picks ``mosaic_tpu``; an explicit
``mosaic_gpu`` then runs the Mosaic GPU interpreter), the dtype, head dims,
chunk size, the Triton launch's shared memory (:mod:`.launch`), and the gate bound: the kernels need the K3
lower-bounded log-decay ``g >= -5`` per token; a call promises ``g >= gate_bound`` (``None``: no bound), and
``gate_bound < -5`` or None leaves only ``xla`` (exact for any ``g <= 0``).

Gradients: the kernel forwards sit inside ``jax.custom_vjp`` (the inputs are saved; ``mosaic_gpu`` with the kernel
backward also saves its per-chunk results, :class:`pallas_kernels.kda._layout.ChunkResiduals`, which the Triton
backward takes instead of recomputing them); ``backward="auto"`` /
``"kernel"`` = the backend's backward kernels (for ``mosaic_gpu``: the Triton backward with the steps of
:data:`pallas_kernels.kda.gpu_bwd.KERNEL_BACKWARD_MOSAIC_GPU_STEPS` on Mosaic GPU kernels), ``"mosaic_gpu"``
(``mosaic_gpu`` only) = the backward with every step on Mosaic GPU kernels
(:data:`pallas_kernels.kda.gpu_bwd.MOSAIC_GPU_STEPS`, taking the forward's per-chunk results: no Triton kernel
runs; slower than ``"kernel"`` on the H200, faster than ``"xla"``: ``"auto"`` on ``mosaic_gpu`` takes it when JAX
no longer ships Triton), ``"xla"`` = the VJP of the recomputed chunked reference.
The decode kernels are forward-only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.kda import launch
from pallas_kernels.kda import reference as ref
from pallas_kernels.registry import (
    Backend,
    Registry,
    platform_reason,
    sm90_reason,
    target_compute_capability,
    target_platform,
)

KERNEL_GATE_BOUND = -5.0
"""The Pallas kernels' factored decay products need every per-token log-decay ``>= KERNEL_GATE_BOUND``."""
BACKWARDS = ("auto", "kernel", "mosaic_gpu", "xla")
ALIASES = {"reference": "xla"}
"""Old name of the reference still accepted (``sharding.plan``, benchmark scripts)."""


@dataclasses.dataclass(frozen=True)
class KdaCall:
    """What the backends of a KDA op look at. ``shape = (B, T, H, K, V)``; ``dtype`` = promoted q/v dtype;
    ``compute_capability``: the target GPU's (None when the target is not a GPU or unknown); ``packed``: the
    call has ``segment_ids``."""

    platform: str
    dtype: str
    shape: tuple[int, int, int, int, int]
    chunk_size: int
    gate_bound: float | None
    interpret: bool = False
    compute_capability: float | None = None
    packed: bool = False


def _pow2(d: int) -> bool:
    return d >= 16 and d & (d - 1) == 0


def _gate_reason(call: KdaCall) -> str | None:
    if call.gate_bound is None or call.gate_bound < KERNEL_GATE_BOUND:
        return (f"needs the lower-bounded gate g >= {KERNEL_GATE_BOUND:g} per token, the call promises "
                f"{'no bound' if call.gate_bound is None else f'g >= {call.gate_bound:g}'}")
    return None


def _dtype_reason(call: KdaCall) -> str | None:
    if call.dtype not in ("float32", "bfloat16"):
        return f"takes float32 or bfloat16 inputs, got {call.dtype}"
    return None


def _first(*reasons: str | None) -> str | None:
    return next((r for r in reasons if r is not None), None)


def _tpu_chunk(call: KdaCall) -> str | None:
    c = call.chunk_size
    return _first(platform_reason(call, "tpu"), _dtype_reason(call), _gate_reason(call),
                  None if c >= 16 and c & (c - 1) == 0 else f"chunk_size must be a power of two >= 16, got {c}")


def _triton_shipped() -> str | None:
    return registry.triton_missing_reason()


def _triton_chunk(call: KdaCall) -> str | None:
    _, _, _, k, v = call.shape
    dims = None if _pow2(k) and _pow2(v) and _pow2(call.chunk_size) else (
        f"head dims and chunk must be powers of two >= 16, got K={k}, V={v}, chunk {call.chunk_size}")
    smem = None
    if call.platform == "gpu" and dims is None:
        dt = jnp.dtype(call.dtype)
        smem = launch.chunk_launch_reason(chunk=call.chunk_size, k=k, v=v, q_dtype=dt, v_dtype=dt)
    return _first(platform_reason(call, "gpu"), _triton_shipped(), _dtype_reason(call), _gate_reason(call), dims,
                  smem)


def _mosaic_gpu_chunk(call: KdaCall) -> str | None:
    if (reason := platform_reason(call, "gpu", "the Mosaic GPU interpreter")) is not None:
        return reason
    arch = sm90_reason(call, "wgmma, TMA")
    from pallas_kernels.kda import mosaic_gpu  # noqa: PLC0415  (imports the Mosaic GPU toolchain)

    _, _, _, k, v = call.shape
    return _first(arch, _gate_reason(call), mosaic_gpu.supports_reason(
        dtype=call.dtype, k=k, v=v, chunk_size=call.chunk_size))


def _decode_reason(call: KdaCall) -> str | None:
    t = call.shape[1]
    return None if t == 1 else f"the kernel is the one-token decode step, got T={t}"


def _tpu_decode(call: KdaCall) -> str | None:
    return _first(platform_reason(call, "tpu"), _decode_reason(call), _dtype_reason(call))


def _triton_decode(call: KdaCall) -> str | None:
    return _first(platform_reason(call, "gpu"), _triton_shipped(), _decode_reason(call), _dtype_reason(call))


def _mosaic_gpu_decode(call: KdaCall) -> str | None:
    if (reason := platform_reason(call, "gpu", "the Mosaic GPU interpreter")) is not None:
        return reason
    arch = sm90_reason(call, "TMA")
    from pallas_kernels.kda import mosaic_gpu_decode  # noqa: PLC0415  (imports the Mosaic GPU toolchain)

    _, _, _, k, v = call.shape
    return _first(arch, _decode_reason(call), mosaic_gpu_decode.supports_reason(dtype=call.dtype, k=k, v=v))


XLA = Backend("xla", "pure-JAX reference (any g <= 0, any dtype and head dims)", lambda call: None)
CHUNK = Registry("kda.chunk", (
    Backend("mosaic_tpu", "Pallas Mosaic TPU chunk forward + backward kernels", _tpu_chunk),
    Backend("mosaic_gpu", "Pallas Mosaic GPU chunk forward (sm_90 wgmma + TMA: a per-chunk kernel over all chunks, "
            "then a warp-specialised state pass); backward: the Triton kernels while shipped, else the reference "
            "VJP", _mosaic_gpu_chunk),
    Backend("triton", "Pallas Triton chunk forward (5 kernels) + backward (9 kernels)", _triton_chunk),
    XLA,
), ALIASES)
DECODE = Registry("kda.decode", (
    Backend("mosaic_tpu", "Pallas Mosaic TPU decode step on a state pool (in place)", _tpu_decode),
    Backend("triton", "Pallas Triton decode step on a state pool (in place)", _triton_decode),
    Backend("mosaic_gpu", "Pallas Mosaic GPU decode step on a state pool (sm_90 TMA, in place)", _mosaic_gpu_decode),
    XLA,
), ALIASES)


def make_call(q, v, chunk_size: int, gate_bound: float | None, interpret, platform: str | None,
              packed: bool = False) -> KdaCall:
    B, T, H, K = q.shape
    target = target_platform(platform)
    return KdaCall(target, jnp.promote_types(q.dtype, v.dtype).name, (B, T, H, K, v.shape[-1]), int(chunk_size),
                   None if gate_bound is None else float(gate_bound), bool(interpret),
                   target_compute_capability(target), bool(packed))


def _kernel_fwd(impl: str, q, k, v, g, beta, scale, h0, seg, chunk_size, interpret, residuals: bool = False):
    """``(o, ht)``; with ``residuals`` (``mosaic_gpu`` only) also the per-chunk results for the backward."""
    if impl == "mosaic_gpu":
        from pallas_kernels.kda import mosaic_gpu  # noqa: PLC0415

        return mosaic_gpu.chunk_kda_fwd(q, k, v, g, beta, scale, h0, seg, chunk_size, interpret=interpret,
                                        residuals=residuals)
    if impl == "mosaic_tpu":
        from pallas_kernels.kda import tpu  # noqa: PLC0415

        return tpu.chunk_kda_fwd(q, k, v, g, beta, scale, h0, seg, chunk_size, interpret=interpret)
    from pallas_kernels.kda import gpu  # noqa: PLC0415

    return gpu.chunk_kda_fwd(q, k, v, g, beta, scale, h0, seg, chunk_size, interpret=interpret)


@functools.cache
def _kernel_chunk_fn(impl: str, scale: float, chunk_size: int, interpret, backward: str):
    """``f(q, k, v, g, beta, h0, seg) -> (o, ht)``; VJP by the backward kernels of ``impl``
    (``backward="kernel"``, for ``mosaic_gpu`` with some steps on Mosaic GPU; ``"mosaic_gpu"``: the GPU backward
    with every step on Mosaic GPU) or by recomputing the
    chunked reference (``"xla"``). ``mosaic_gpu`` with a kernel backward saves its forward's per-chunk results for
    the backward (which then skips recomputing them)."""
    reuses_chunks = impl == "mosaic_gpu" and backward in ("kernel", "mosaic_gpu")

    @jax.custom_vjp
    def f(q, k, v, g, beta, h0, seg):
        return _kernel_fwd(impl, q, k, v, g, beta, scale, h0, seg, chunk_size, interpret)

    def f_fwd(q, k, v, g, beta, h0, seg):
        if reuses_chunks:
            o, ht, chunks = _kernel_fwd(impl, q, k, v, g, beta, scale, h0, seg, chunk_size, interpret, True)
            return (o, ht), (q, k, v, g, beta, h0, seg, chunks)
        return f(q, k, v, g, beta, h0, seg), (q, k, v, g, beta, h0, seg, None)

    def f_bwd(res, cts):
        q, k, v, g, beta, h0, seg, chunks = res
        do, dht = cts
        if backward in ("kernel", "mosaic_gpu"):
            if impl in ("triton", "mosaic_gpu"):
                from pallas_kernels.kda import gpu_bwd as bwd_mod  # noqa: PLC0415

                if backward == "mosaic_gpu":
                    steps = bwd_mod.MOSAIC_GPU_STEPS
                else:
                    steps = bwd_mod.KERNEL_BACKWARD_MOSAIC_GPU_STEPS if impl == "mosaic_gpu" else ()
                extra = dict(interpret=bool(interpret), residuals=chunks, mosaic_gpu_steps=steps)
            else:
                from pallas_kernels.kda import tpu_bwd as bwd_mod  # noqa: PLC0415

                extra = dict(interpret=interpret)
            grads = bwd_mod.chunk_kda_bwd(q, k, v, g, beta, scale, h0, seg, do.astype(v.dtype),
                                          dht.astype(jnp.float32), chunk_size, **extra)
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


def _interpret_params(impl: str, interpret):
    if impl == "mosaic_tpu" and interpret is True:
        from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415

        return pltpu.InterpretParams()
    if impl == "mosaic_gpu" and interpret is True:
        from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415

        return plgpu.InterpretGPUParams()
    return interpret


def _backward_for(impl: str, backward: str) -> str:
    """``"kernel"``, ``"mosaic_gpu"`` or ``"xla"`` for ``backward`` (one of :data:`BACKWARDS`) on kernel backend
    ``impl``."""
    if backward == "mosaic_gpu" and impl != "mosaic_gpu":
        raise ValueError(f"chunk_kda: backward='mosaic_gpu' takes the Mosaic GPU forward's per-chunk results, so it "
                         f"needs implementation 'mosaic_gpu', which chose {impl!r}")
    if impl != "mosaic_gpu":
        return "kernel" if backward == "auto" else backward
    if backward == "auto":
        return "kernel" if registry.TRITON_SHIPPED else "mosaic_gpu"
    if backward == "kernel" and not registry.TRITON_SHIPPED:
        raise ValueError("chunk_kda: backward='kernel' on mosaic_gpu needs the Triton backward kernels, which this "
                         "JAX no longer ships; use backward='auto' or 'xla'")
    return backward


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
    gate_bound: float | None = KERNEL_GATE_BOUND,
    backward: str = "auto",
    platform: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Chunked KDA (training / prefill). Shapes as :func:`pallas_kernels.kda.reference.chunk_kda`:

    ``q, k, g [B, T, H, K]``, ``v [B, T, H, V]``, ``beta [B, T, H]``, ``initial_state [B, H, K, V] f32``,
    ``segment_ids [B, T] int``. Returns ``(o [B, T, H, V] in v.dtype, final_state [B, H, K, V] f32 or None)``.
    With ``A_log [H]`` (and optional ``dt_bias [H*K]``), ``g`` is the raw gate ``f`` and the K3 log-decay
    ``lower_bound * sigmoid(exp(A_log) (f + dt_bias))`` is computed first (then ``gate_bound = lower_bound``);
    ``use_qk_l2norm`` L2-normalises q and k first (scale is still applied after the norm).
    ``gate_bound``: the caller's promise ``g >= gate_bound`` per token (None: no bound, e.g. Kimi-Linear's
    gate); the kernels need ``>= -5`` (module docstring). ``implementation``: ``"auto"`` or a name of
    :data:`CHUNK`; ``backward``: one of :data:`BACKWARDS`; ``platform``: the target platform (default:
    :func:`pallas_kernels.registry.target_platform`).
    """
    if backward not in BACKWARDS:
        raise ValueError(f"chunk_kda: backward must be one of {BACKWARDS}, got {backward!r}")
    q, k, g = _fused_inputs(q, k, g, A_log, dt_bias, lower_bound, use_qk_l2norm)
    if A_log is not None:
        gate_bound = lower_bound
    call = make_call(q, v, chunk_size, gate_bound, interpret, platform, packed=segment_ids is not None)
    impl = CHUNK.select(implementation, call).backend
    if impl == "xla":
        return ref.chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, segment_ids, chunk_size)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    h0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    fn = _kernel_chunk_fn(impl, float(scale), int(chunk_size), _interpret_params(impl, interpret),
                          _backward_for(impl, backward))
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
    platform: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Recurrent KDA; the kernels (:data:`DECODE`) are the one-token decode step (``T == 1``).

    Without ``state_slots``: ``initial_state [B, H, K, V]`` (zeros if None), returns
    ``(o [B, T, H, V], final_state [B, H, K, V] f32 or None)``.
    With ``state_slots [B] i32``: ``initial_state`` is a state pool ``[P, H, K, V] f32`` and sequence b
    reads/writes row ``state_slots[b]`` (distinct slots); returns ``(o, new_pool)`` where the other rows are
    unchanged. On a kernel the pool is updated in place (aliased: donate it under ``jit``).
    ``T > 1`` runs the reference scan (``"auto"``; an explicit kernel raises); ``segment_ids`` only matter
    there. Not differentiable on a kernel (inference only). ``A_log``/``dt_bias``/``use_qk_l2norm`` as in
    :func:`chunk_kda`. The decode step is exact for any ``g <= 0`` (no gate bound needed).
    """
    q, k, g = _fused_inputs(q, k, g, A_log, dt_bias, lower_bound, use_qk_l2norm)
    impl = DECODE.select(implementation, make_call(q, v, 64, None, interpret, platform)).backend
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
    if impl == "xla":
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
    if impl == "mosaic_tpu":
        from pallas_kernels.kda import tpu  # noqa: PLC0415

        o, pool = tpu.decode_step(*args, interpret=interpret)
    elif impl == "mosaic_gpu":
        from pallas_kernels.kda import mosaic_gpu_decode  # noqa: PLC0415

        o, pool = mosaic_gpu_decode.decode_step(*args, interpret=interpret)
    else:
        from pallas_kernels.kda import gpu  # noqa: PLC0415

        o, pool = gpu.decode_step(*args, interpret=interpret)
    return o[:, None], (pool if output_final_state or state_slots is not None else None)


def fused_decode_step(
    q_proj: jax.Array,
    k_proj: jax.Array,
    v_proj: jax.Array,
    f_proj: jax.Array,
    b_proj: jax.Array,
    state: jax.Array,
    conv: jax.Array,
    conv_weights: tuple[jax.Array, jax.Array, jax.Array],
    A_log: jax.Array,
    dt_bias: jax.Array | None,
    layer: jax.Array,
    *,
    lower_bound: float = -5.0,
    scale: float | None = None,
    implementation: str = "auto",
    interpret=False,
    platform: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode token of layer ``layer`` of a stack of KDA layers, from its projections:
    :func:`reference.decode_prologue` (short conv, SiLU, q / k L2 norm, gate, beta), then the decode step
    (:func:`recurrent_kda`) on that layer's states, read and written in place.

    Args:
      q_proj, k_proj, f_proj: ``[B, H*K]``; v_proj: ``[B, H*V]`` (one dtype); b_proj: ``[B, H]`` beta logits.
      state: ``[L, B, H, K, V]`` f32 recurrent states (updated in place on a kernel: donate them under ``jit``).
      conv: ``[L, B, W-1, 2*H*K + H*V]`` conv tails (the q | k | v inputs, oldest first), read in place.
      conv_weights: ``(wq [L, W, H*K], wk [L, W, H*K], wv [L, W, H*V])``; A_log ``[L, H]``; dt_bias ``[L, H*K]``
        or None: every layer's, read at ``layer``.
      layer: i32 scalar in ``[0, L)``.
    Returns:
      ``(o [B, H, V]`` in v_proj's dtype, the new states ``[L, B, H, K, V]`` (other layers unchanged), the new conv
      tails ``[B, W-1, 2*H*K + H*V]`` in conv's dtype — the caller writes them to ``conv[layer]``).

    ``implementation`` picks the decode kernel from :data:`DECODE` (its choice is logged there): ``triton`` runs
    the prologue inside its decode kernel (:mod:`.gpu_decode_fused`: one launch, the stacked arrays read in
    place); every other backend takes the prologue computed in JAX on ``layer``'s slices ahead of its decode step.
    Forward only.
    """
    if state.ndim != 5 or conv.ndim != 4 or state.shape[:2] != conv.shape[:2]:
        raise ValueError(f"fused_decode_step: state must be [L, B, H, K, V] and conv [L, B, W-1, C] with the same "
                         f"L and B, got {state.shape} / {conv.shape}")
    L, B, H, K, V = state.shape
    W = conv_weights[0].shape[-2]
    want = {"q_proj": (q_proj, (B, H * K)), "k_proj": (k_proj, (B, H * K)), "v_proj": (v_proj, (B, H * V)),
            "f_proj": (f_proj, (B, H * K)), "b_proj": (b_proj, (B, H)),
            "conv": (conv, (L, B, W - 1, 2 * H * K + H * V)), "wq": (conv_weights[0], (L, W, H * K)),
            "wk": (conv_weights[1], (L, W, H * K)), "wv": (conv_weights[2], (L, W, H * V)), "A_log": (A_log, (L, H))}
    if dt_bias is not None:
        want["dt_bias"] = (dt_bias, (L, H * K))
    for name, (x, shape) in want.items():
        if x.shape != shape:
            raise ValueError(f"fused_decode_step: {name} must be {list(shape)} for states {list(state.shape)} and "
                             f"{W} conv taps, got {list(x.shape)}")
    if scale is None:
        scale = K**-0.5
    call = make_call(q_proj.reshape(B, 1, H, K), v_proj.reshape(B, 1, H, V), 64, None, interpret, platform)
    impl = DECODE.select(implementation, call).backend
    layer = jnp.asarray(layer, jnp.int32)
    if impl == "triton":
        from pallas_kernels.kda import gpu_decode_fused  # noqa: PLC0415

        bias = jnp.zeros((L, H * K), jnp.float32) if dt_bias is None else dt_bias
        return gpu_decode_fused.fused_decode_step(
            q_proj, k_proj, v_proj, f_proj, b_proj, state, conv, conv_weights, A_log, bias, layer,
            scale=float(scale), lower_bound=float(lower_bound), interpret=bool(interpret))
    at = lambda x: jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)
    q, k, v, g, beta, tail = ref.decode_prologue(
        q_proj, k_proj, v_proj, f_proj, b_proj, at(conv), tuple(at(w) for w in conv_weights), at(A_log),
        None if dt_bias is None else at(dt_bias), lower_bound)
    o, pool = recurrent_kda(q, k, v, g, beta, scale, initial_state=state.reshape(L * B, H, K, V),
                            state_slots=layer * B + jnp.arange(B, dtype=jnp.int32), implementation=impl,
                            interpret=interpret, platform=platform)
    return o[:, 0], pool.reshape(state.shape), tail
