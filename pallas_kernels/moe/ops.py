"""Public MoE entry points: the expert-FFN / grouped-matmul registry and the dispatch through it.

:data:`EXPERT_FFN` (``grouped_matmul``, ``expert_ffn``, ``moe_dispatch_combine``) is an ordered table
(:class:`pallas_kernels.registry.Registry`; ``"auto"`` = the first that supports the call, an explicit name
that cannot run raises with the reason):

* ``mosaic_tpu`` (:mod:`.tpu`): grouped matmul with a kernel backward, fused w1/w3 + SiTU-GLU kernel (with a
  grouped-matmul-kernel backward), MXFP4 weights decoded in VMEM (forward only);
* ``triton`` (:mod:`.gpu`): grouped matmul with a kernel backward (w1 and w3 as two grouped matmuls, SiTU-GLU
  in XLA), MXFP4 weights decoded in registers from the packed HF layout (forward only; the w1/w3 pair in one
  kernel with the SiTU-GLU epilogue);
* ``mosaic_gpu`` (:mod:`.mosaic_gpu`, sm_90+): grouped matmul (forward, ``dlhs``, ``drhs``) on Pallas Mosaic GPU
  (wgmma + TMA), bf16 with K, N multiples of 128 (JAX's ``ragged_dot_mgpu`` kernels); w1/w3 + SiTU-GLU fused in one
  kernel (:mod:`.mosaic_gpu_glu`, whose backward recomputes gate and up with the grouped matmul); MXFP4 weights
  through :mod:`.mosaic_gpu_mxfp4` (bf16 activations, K a multiple of 512, N of 64; decoded in registers from the
  packed HF layout, forward only; the w1/w3 pair in one kernel with the SiTU-GLU epilogue; stacked weights read in
  place); only that MXFP4 kernel has an interpret mode (the Mosaic GPU interpreter);
* ``xla`` (:mod:`.reference`): ``jax.lax.ragged_dot`` (a tiled einsum form on CPU), any dtype.

Order on a GPU: ``triton`` while JAX ships the Pallas Triton backend (``registry.TRITON_SHIPPED``), then
``mosaic_gpu`` on sm_90+ (:attr:`MoeCall.compute_capability`, the visible GPU's), then ``xla``. ``triton`` is
ahead because the Mosaic GPU grouped matmul loses to it on Hopper (benchmarks/RESULTS.md); ``mosaic_gpu`` is
what ``"auto"`` picks on Hopper once the Triton backend is gone, and can be chosen by name today.
Backends check the target platform (``platform=`` or :func:`pallas_kernels.registry.target_platform`;
``interpret=True`` runs the Pallas kernels on CPU in interpret mode, ``"auto"`` then picks ``mosaic_tpu``;
JAX's Mosaic GPU bf16 grouped-matmul kernels take no interpret flag, the MXFP4 one does) and the dtype.

Gradients: every bf16/f32 path is differentiable w.r.t. tokens, routing weights and expert weights; the MXFP4
kernels are forward only, and :func:`expert_ffn` over MXFP4 weights differentiates w.r.t. the tokens alone
(frozen experts, e.g. LoRA) through the bf16 kernels on the decoded weights.

LoRA adapters on the routed experts (``adapters=``, :data:`reference.ExpertAdapters`): the low-rank terms run on
the activations beside the base products (``x W_e + s·(x A)·B_e``), so the frozen weights stay as they are
(MXFP4 packed). The fused w1/w3 + SiTU-GLU kernels cannot add a term before the activation, so a call with
adapters takes the backend's unfused products: each base product on its own (MXFP4: ``gmm_mxfp4`` with one weight,
f32 out, :func:`mxfp4_grouped_matmul`), the low-rank terms on the same backend's differentiable grouped matmul
(rank zero-padded to :data:`RANK_MULTIPLE`), SiTU-GLU in XLA. Adapters get exact gradients (kernel backward of the
low-rank grouped matmuls); tokens get theirs as without adapters.

Stacked weights (``layer=``, one-token decode): :func:`expert_ffn` and :func:`moe_dispatch_combine` also take the
whole ``[L, E, ...]`` stack of a scanned layer segment plus the layer index. ``triton`` and ``mosaic_tpu`` read
that layer in place (no per-layer weight copy; forward only) when the weights are MXFP4 or already in the
activations' dtype, ``mosaic_gpu`` when they are MXFP4; every other case takes the layer's slice
(:func:`reference.layer_of`, which XLA may copy) and runs as without ``layer``, so results are the same.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import registry
from pallas_kernels.moe import reference as ref
from pallas_kernels.mxfp4 import is_mxfp4
from pallas_kernels.mxfp8 import fake_quant_mxfp8
from pallas_kernels.registry import Backend, Registry, platform_reason, target_compute_capability, target_platform

ALIASES = {"reference": "xla"}
"""Old name of the reference still accepted (``sharding.plan``, benchmark scripts)."""


@dataclasses.dataclass(frozen=True)
class MoeCall:
    """What the expert-FFN backends look at: ``shape = (rows, in, out)`` of the first product, the number of
    experts, the activation dtype, whether the weights are MXFP4, the target GPU's compute capability (None when
    the target is not a GPU or unknown)."""

    platform: str
    dtype: str
    shape: tuple[int, int, int]
    experts: int
    mxfp4: bool
    interpret: bool = False
    compute_capability: float | None = None


def _kernel_reason(platform: str):
    def supports(call: MoeCall) -> str | None:
        reason = platform_reason(call, platform)
        if reason is None and call.dtype not in ("float32", "bfloat16"):
            reason = f"takes float32 or bfloat16 activations, got {call.dtype}"
        return reason

    return supports


def _mosaic_gpu_reason(call: MoeCall) -> str | None:
    if call.mxfp4:
        return _mosaic_gpu_mxfp4_reason(call)
    if call.platform != "gpu":
        return (f"needs target platform gpu (JAX's ragged_dot_mgpu kernels have no interpret mode), "
                f"target is {call.platform}")
    from pallas_kernels.moe import mosaic_gpu  # noqa: PLC0415  (imports the Mosaic GPU toolchain)

    _, k, n = call.shape
    return mosaic_gpu.arch_reason(call.compute_capability) or mosaic_gpu.shape_reason(call.dtype, k, n)


def _mosaic_gpu_mxfp4_reason(call: MoeCall) -> str | None:
    """The MXFP4 kernel (:mod:`.mosaic_gpu_mxfp4`): sm_90+ or its interpreter on CPU, bf16 activations, K a
    multiple of 512 and N of 64 (checked on the first product)."""
    reason = platform_reason(call, "gpu", "the Mosaic GPU interpreter")
    if reason is None and call.platform == "gpu":
        from pallas_kernels.moe import mosaic_gpu  # noqa: PLC0415

        reason = mosaic_gpu.arch_reason(call.compute_capability)
    if reason is None and call.dtype != "bfloat16":
        reason = f"takes bfloat16 activations with MXFP4 weights, got {call.dtype}"
    _, k, n = call.shape
    if reason is None and (k % 512 or n % 64):
        reason = f"needs K a multiple of 512 and N of 64 with MXFP4 weights, got K={k}, N={n}"
    return reason


def _triton_reason(call: MoeCall) -> str | None:
    return registry.triton_missing_reason() or _kernel_reason("gpu")(call)


EXPERT_FFN = Registry("moe.expert_ffn", (
    Backend("mosaic_tpu", "Pallas Mosaic TPU grouped matmul, fused SiTU-GLU, MXFP4 in VMEM", _kernel_reason("tpu")),
    Backend("triton", "Pallas Triton grouped matmul, MXFP4 decoded in registers", _triton_reason),
    Backend("mosaic_gpu", "Pallas Mosaic GPU grouped matmul (sm_90 wgmma + TMA), bf16; MXFP4 decoded in registers",
            _mosaic_gpu_reason),
    Backend("xla", "jax.lax.ragged_dot reference (tiled einsum on CPU)", lambda call: None),
), ALIASES)


def make_call(x: jax.Array, w: Any, interpret: bool, platform: str | None) -> MoeCall:
    """The :class:`MoeCall` of ``x [M, K]`` against expert weight ``w`` (``[E, K, N]`` or an MXFP4 dict)."""
    mx = is_mxfp4(w)
    e, n = ((w["weight_packed"].shape[0], w["weight_packed"].shape[1]) if mx else (w.shape[0], w.shape[-1]))
    target = target_platform(platform)
    return MoeCall(target, jnp.dtype(x.dtype).name, (int(x.shape[0]), int(x.shape[-1]), int(n)), int(e), mx,
                   bool(interpret), target_compute_capability(target))


def select(implementation: str, x: jax.Array, w: Any, interpret: bool = False, platform: str | None = None) -> str:
    """The backend name :data:`EXPERT_FFN` picks for ``x`` against weight ``w`` (see :func:`make_call`)."""
    return EXPERT_FFN.select(implementation, make_call(x, w, interpret, platform)).backend


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array | dict[str, jax.Array],
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    implementation: str = "auto",
    interpret: bool = False,
    tiles: tuple[int, ...] | None = None,
    platform: str | None = None,
) -> jax.Array:
    """``lhs [M, K] x rhs [E, K, N] -> [M, N]`` with ``jax.lax.ragged_dot`` semantics.

    ``rhs`` may be an MXFP4 dict ``{"weight_packed": u8 [E, N, K/2], "weight_scale": u8 [E, N, K/32]}``
    (HF ``[out, in]`` orientation).
    """
    impl = select(implementation, lhs, rhs, interpret, platform)
    if impl == "xla":
        return ref.grouped_matmul(lhs, ref.dense_expert_weight(rhs, lhs.dtype), group_sizes,
                                  preferred_element_type=preferred_element_type, platform=platform)
    if impl == "mosaic_gpu" and not is_mxfp4(rhs):
        from pallas_kernels.moe import mosaic_gpu  # noqa: PLC0415

        return mosaic_gpu.gmm(lhs, ref.dense_expert_weight(rhs, lhs.dtype), group_sizes,
                              preferred_element_type=preferred_element_type)
    kern, mxfp4_operand = _kernels(impl)
    if is_mxfp4(rhs):
        return kern.gmm_mxfp4(lhs, [mxfp4_operand(rhs)], group_sizes, out_dtype=preferred_element_type,
                              interpret=interpret)
    return kern.gmm(lhs, ref.dense_expert_weight(rhs, lhs.dtype), group_sizes,
                    preferred_element_type=preferred_element_type, tiles=tiles, interpret=interpret)


def _kernels(impl: str):
    """``(kernel module, MXFP4 weight dict -> that module's MXFP4 operand)`` for a kernel backend (``mosaic_gpu``:
    its MXFP4 module, whose ``gmm_mxfp4`` is the only kernel taken from it)."""
    if impl == "mosaic_tpu":
        from pallas_kernels.moe import tpu as kern  # noqa: PLC0415
    elif impl == "mosaic_gpu":
        from pallas_kernels.moe import mosaic_gpu_mxfp4 as kern  # noqa: PLC0415
    else:
        from pallas_kernels.moe import gpu as kern  # noqa: PLC0415

    return kern, lambda w: (w["weight_packed"], w["weight_scale"])


@functools.cache
def fused_glu_fn(impl: str, beta1: float, beta2: float, interpret: bool):
    """``f(x, w1, w3, group_sizes) -> [M, I]``: ``impl``'s fused w1/w3 + SiTU-GLU kernel forward (``mosaic_tpu``:
    ``tpu.gmm_glu``; ``mosaic_gpu``: ``mosaic_gpu_glu.gmm_glu``, no interpret mode here); the backward recomputes
    gate and up with ``impl``'s grouped matmul and runs its kernel backward."""
    if impl == "mosaic_tpu":
        from pallas_kernels.moe import tpu  # noqa: PLC0415

        fused = functools.partial(tpu.gmm_glu, beta1=beta1, beta2=beta2, interpret=interpret)
        mm = functools.partial(tpu.gmm, interpret=interpret)
    elif impl == "mosaic_gpu":
        from pallas_kernels.moe import mosaic_gpu, mosaic_gpu_glu  # noqa: PLC0415

        fused = functools.partial(mosaic_gpu_glu.gmm_glu, beta1=beta1, beta2=beta2)
        mm = mosaic_gpu.gmm
    else:
        raise ValueError(f"fused_glu_fn: no fused w1/w3 + SiTU-GLU kernel on {impl!r} (mosaic_tpu, mosaic_gpu)")

    def products(x, w1, w3, gs):
        return mm(x, w1, gs), mm(x, w3, gs)

    act = lambda g, u: ref.situ_glu(g, u, beta1, beta2)

    @jax.custom_vjp
    def f(x, w1, w3, gs):
        return fused(x, w1, w3, gs)

    def fwd(x, w1, w3, gs):
        return f(x, w1, w3, gs), (x, w1, w3, gs)

    def bwd(res, dh):
        x, w1, w3, gs = res
        (gate, up), vjp_mm = jax.vjp(lambda a, b, c: products(a, b, c, gs), x, w1, w3)
        _, vjp_act = jax.vjp(act, gate, up)
        dg, du = vjp_act(dh.astype(gate.dtype))
        dx, dw1, dw3 = vjp_mm((dg, du))
        return dx, dw1, dw3, None

    f.defvjp(fwd, bwd)
    return f


RANK_MULTIPLE = {"triton": 16, "mosaic_gpu": 128}
"""Backends whose grouped matmul needs the adapters' rank (a K or N of the low-rank products) zero-padded to a
multiple of this: Triton's ``tl.dot`` takes no dimension under 16, the Mosaic GPU kernels multiples of 128. The
padded rows/columns are zeros, so values and gradients are those of the unpadded adapter."""


def _padded_adapter(adapter: ref.ExpertAdapter, multiple: int) -> ref.ExpertAdapter:
    a, b, s = adapter
    pad = (-b.shape[-2]) % multiple
    if not pad:
        return adapter
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
    return a, jnp.pad(b, ((0, 0), (0, pad), (0, 0))), s


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def mxfp4_grouped_matmul(impl: str, interpret: bool, platform: str | None, x: jax.Array, group_sizes: jax.Array,
                         w: dict[str, jax.Array]) -> jax.Array:
    """``x [M, K] x W_e`` -> f32 ``[M, N]`` for an MXFP4 weight dict ``w`` (HF ``[E, N, K/2]`` codes) on ``impl``'s
    forward-only MXFP4 kernel (``mosaic_tpu``, ``triton`` or ``mosaic_gpu``: decoded tile by tile, nothing
    dequantized in memory).

    Differentiable w.r.t. ``x`` only: the backward is the transposed product on ``impl``'s bf16 grouped matmul over
    ``W`` decoded to ``x.dtype`` (E2M1 x E8M0 values are exact in bf16, so it is the derivative of the function
    the forward computed); that materialises the layer's ``[E, K, N]`` weight in ``x.dtype`` for the backward.
    Codes, scales and group sizes get zero (float0) cotangents: they are frozen."""
    kern, operand = _kernels(impl)
    return kern.gmm_mxfp4(x, [operand(w)], group_sizes, out_dtype=jnp.float32, interpret=interpret)


def _mxfp4_grouped_matmul_fwd(impl, interpret, platform, x, group_sizes, w):
    return mxfp4_grouped_matmul(impl, interpret, platform, x, group_sizes, w), (x, group_sizes, w)


def _mxfp4_grouped_matmul_bwd(impl, interpret, platform, res, g):
    x, group_sizes, w = res
    dense = ref.dense_expert_weight(w, x.dtype)
    _, vjp = jax.vjp(lambda v: grouped_matmul(v, dense, group_sizes, preferred_element_type=jnp.float32,
                                              implementation=impl, interpret=interpret, platform=platform), x)
    zero = lambda t: jax.tree.map(lambda a: np.zeros(np.shape(a), jax.dtypes.float0), t)
    return vjp(g)[0], zero(group_sizes), zero(w)


mxfp4_grouped_matmul.defvjp(_mxfp4_grouped_matmul_fwd, _mxfp4_grouped_matmul_bwd)


def _expert_ffn_unfused(impl: str, x_sorted: jax.Array, group_sizes: jax.Array, weights: dict[str, Any],
                        adapters: ref.ExpertAdapters, *, beta1: float, beta2: float, mxfp8_activations: bool,
                        interpret: bool, platform: str | None) -> jax.Array:
    """:func:`expert_ffn` with LoRA adapters on a kernel backend ``impl``: every base product on its own (MXFP4
    weights on :func:`mxfp4_grouped_matmul`, dense ones on ``impl``'s grouped matmul), plus the adapters' low-rank
    terms (:func:`reference.lora_product`) in f32 before the rounding to ``x_sorted.dtype``; SiTU-GLU in XLA."""
    dt = x_sorted.dtype
    gmm = lambda lhs, rhs: grouped_matmul(lhs, rhs, group_sizes, preferred_element_type=jnp.float32,
                                          implementation=impl, interpret=interpret, platform=platform)
    multiple = RANK_MULTIPLE.get(impl, 1)

    def product(lhs: jax.Array, name: str) -> jax.Array:
        w = weights[name]
        out = (mxfp4_grouped_matmul(impl, bool(interpret), platform, lhs, group_sizes, w) if is_mxfp4(w)
               else gmm(lhs, ref.dense_expert_weight(w, dt)))
        if name in adapters:
            out = out + ref.lora_product(lhs, _padded_adapter(adapters[name], multiple), gmm)
        return out

    a = fake_quant_mxfp8(x_sorted) if mxfp8_activations else x_sorted
    gate, up = product(a, "w1"), product(a, "w3")
    h = ref.situ_glu(gate.astype(dt), up.astype(dt), beta1, beta2)
    if mxfp8_activations:
        h = fake_quant_mxfp8(h)
    return product(h, "w2").astype(dt)


def _one_layer_shape(w: ref.ExpertWeight) -> Any:
    """Shapes (``jax.ShapeDtypeStruct``) of one layer of a stacked expert weight, for backend selection."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _mxfp4_ffn(impl, beta1, beta2, mxfp8, interpret, platform, x, group_sizes, w1, w3, w2):
    """The expert FFN on the MXFP4 kernels of ``impl`` (forward-only kernels). Its backward gives ``x`` its
    gradient (what LoRA over frozen MXFP4 experts needs): the VJP of the same FFN on ``impl``'s bf16 grouped
    matmuls over the weights decoded to ``x``'s dtype (E2M1 x E8M0 values are exact in bf16, so it is the
    function the forward computed). Codes, scales and group sizes get zero cotangents (they are not trainable)."""
    dt = x.dtype
    quant = lambda h: fake_quant_mxfp8(h) if mxfp8 else h
    kern, operand = _kernels(impl)
    h = kern.gmm_mxfp4(quant(x), [operand(w1), operand(w3)], group_sizes,
                       epilogue=ref.situ_epilogue(beta1, beta2, dt), out_dtype=dt, interpret=interpret)
    return kern.gmm_mxfp4(quant(h), [operand(w2)], group_sizes, out_dtype=jnp.float32,
                          interpret=interpret).astype(dt)


def _mxfp4_ffn_fwd(impl, beta1, beta2, mxfp8, interpret, platform, x, group_sizes, w1, w3, w2):
    out = _mxfp4_ffn(impl, beta1, beta2, mxfp8, interpret, platform, x, group_sizes, w1, w3, w2)
    return out, (x, group_sizes, w1, w3, w2)


def _mxfp4_ffn_bwd(impl, beta1, beta2, mxfp8, interpret, platform, res, g):
    x, group_sizes, w1, w3, w2 = res
    dense = [ref.dense_expert_weight(w, x.dtype) for w in (w1, w3, w2)]
    _, vjp = jax.vjp(lambda v: expert_ffn(v, group_sizes, *dense, beta1=beta1, beta2=beta2,
                                          mxfp8_activations=mxfp8, implementation=impl, interpret=interpret,
                                          platform=platform), x)
    zero = lambda t: jax.tree.map(lambda a: np.zeros(np.shape(a), jax.dtypes.float0), t)
    return (vjp(g)[0], zero(group_sizes), zero(w1), zero(w3), zero(w2))


_mxfp4_ffn.defvjp(_mxfp4_ffn_fwd, _mxfp4_ffn_bwd)


def expert_ffn(
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    w1: ref.ExpertWeight,
    w3: ref.ExpertWeight,
    w2: ref.ExpertWeight,
    *,
    beta1: float = 4.0,
    beta2: float = 25.0,
    mxfp8_activations: bool = False,
    implementation: str = "auto",
    interpret: bool = False,
    platform: str | None = None,
    layer: jax.Array | None = None,
    adapters: ref.ExpertAdapters | None = None,
) -> jax.Array:
    """Routed experts on expert-sorted rows (same contract as :func:`reference.expert_ffn`).

    ``layer`` (i32 scalar): w1/w3/w2 are stacks ``[L, ...]`` of that contract's weights, and layer ``layer`` is
    used (read in place by ``triton`` and ``mosaic_tpu``, and by ``mosaic_gpu`` for MXFP4; sliced otherwise).
    ``adapters``: LoRA adapters of the expert weights (see the module docstring); not with ``layer``.
    """
    impl = select(implementation, x_sorted, w1 if layer is None else _one_layer_shape(w1), interpret, platform)
    if adapters:
        if layer is not None:
            raise ValueError("expert_ffn: adapters= with layer= (stacked decode weights) is not supported; pass the "
                             "layer's own weights and adapters")
        ref.check_adapters(adapters, {"w1": w1, "w3": w3, "w2": w2})
        if impl == "xla":
            return ref.expert_ffn(x_sorted, group_sizes, w1, w3, w2, beta1=beta1, beta2=beta2,
                                  mxfp8_activations=mxfp8_activations, platform=platform, adapters=adapters)
        return _expert_ffn_unfused(impl, x_sorted, group_sizes, {"w1": w1, "w3": w3, "w2": w2}, adapters,
                                   beta1=beta1, beta2=beta2, mxfp8_activations=mxfp8_activations,
                                   interpret=interpret, platform=platform)
    in_place = all(is_mxfp4(w) for w in (w1, w3, w2)) or all(
        not is_mxfp4(w) and w.dtype == x_sorted.dtype for w in (w1, w3, w2))  # no cast of the whole stack
    all_mxfp4 = all(is_mxfp4(w) for w in (w1, w3, w2))
    if layer is not None and in_place and (impl in ("triton", "mosaic_tpu") or (impl == "mosaic_gpu" and all_mxfp4)):
        return _kernel_ffn_layer(impl, x_sorted, group_sizes, w1, w3, w2, layer, beta1=beta1, beta2=beta2,
                                 mxfp8_activations=mxfp8_activations, interpret=interpret)
    if layer is not None:
        w1, w3, w2 = (ref.layer_of(w, layer) for w in (w1, w3, w2))
    if impl == "xla":
        return ref.expert_ffn(x_sorted, group_sizes, w1, w3, w2, beta1=beta1, beta2=beta2,
                              mxfp8_activations=mxfp8_activations, platform=platform)
    dt = x_sorted.dtype
    a = fake_quant_mxfp8(x_sorted) if mxfp8_activations else x_sorted
    quant = lambda h: fake_quant_mxfp8(h) if mxfp8_activations else h
    kern, _ = _kernels(impl)
    if is_mxfp4(w1) and is_mxfp4(w3) and is_mxfp4(w2):
        return _mxfp4_ffn(impl, float(beta1), float(beta2), bool(mxfp8_activations), bool(interpret), platform,
                          x_sorted, group_sizes, w1, w3, w2)
    d1, d3, d2 = (ref.dense_expert_weight(w, dt) for w in (w1, w3, w2))
    if impl == "mosaic_gpu":
        from pallas_kernels.moe import mosaic_gpu  # noqa: PLC0415

        h = fused_glu_fn(impl, float(beta1), float(beta2), False)(a, d1, d3, group_sizes)
        return mosaic_gpu.gmm(quant(h), d2, group_sizes).astype(dt)
    if impl == "mosaic_tpu":
        h = fused_glu_fn(impl, float(beta1), float(beta2), bool(interpret))(a, d1, d3, group_sizes)
    else:
        gate = kern.gmm(a, d1, group_sizes, interpret=interpret)
        up = kern.gmm(a, d3, group_sizes, interpret=interpret)
        h = ref.situ_glu(gate, up, beta1, beta2)
    out = kern.gmm(quant(h), d2, group_sizes, preferred_element_type=jnp.float32, interpret=interpret)
    return out.astype(dt)


def _kernel_ffn_layer(impl, x_sorted, group_sizes, w1, w3, w2, layer, *, beta1, beta2, mxfp8_activations,
                      interpret):
    """:func:`expert_ffn`'s ``triton`` / ``mosaic_tpu`` (and ``mosaic_gpu`` MXFP4) path on stacked weights read in
    place at ``layer`` (forward only): the same kernels as on the layer's slice."""
    kern, pair = _kernels(impl)
    dt = x_sorted.dtype
    a = fake_quant_mxfp8(x_sorted) if mxfp8_activations else x_sorted
    quant = lambda h: fake_quant_mxfp8(h) if mxfp8_activations else h
    if is_mxfp4(w1) and is_mxfp4(w3) and is_mxfp4(w2):
        h = kern.gmm_mxfp4(a, [pair(w1), pair(w3)], group_sizes, epilogue=ref.situ_epilogue(beta1, beta2, dt),
                           out_dtype=dt, interpret=interpret, layer=layer)
        out = kern.gmm_mxfp4(quant(h), [pair(w2)], group_sizes, out_dtype=jnp.float32, interpret=interpret,
                             layer=layer)
        return out.astype(dt)
    mm = lambda lhs, w, **kw: kern.gmm(lhs, w, group_sizes, interpret=interpret, layer=layer, **kw)
    if impl == "mosaic_tpu":  # the fused w1/w3 + SiTU-GLU kernel, as fused_glu_fn's forward on the slice
        h = kern.gmm_glu(a, w1, w3, group_sizes, beta1=beta1, beta2=beta2, interpret=interpret, layer=layer)
    else:
        h = ref.situ_glu(mm(a, w1), mm(a, w3), beta1, beta2)
    return mm(quant(h), w2, preferred_element_type=jnp.float32).astype(dt)


def moe_dispatch_combine(
    z: jax.Array,
    expert_ids: jax.Array,
    weights: jax.Array,
    experts: dict[str, Any],
    *,
    beta1: float = 4.0,
    beta2: float = 25.0,
    mxfp8_activations: bool = False,
    implementation: str = "auto",
    interpret: bool = False,
    platform: str | None = None,
    layer: jax.Array | None = None,
    adapters: ref.ExpertAdapters | None = None,
) -> jax.Array:
    """Routed experts of Stable LatentMoE: ``u = cast(sum_k weights * f32(E_e(z)), z.dtype)`` -> ``[T, L]``.

    Same arguments as :func:`reference.moe_dispatch_combine`; ``implementation`` picks the expert FFN.
    ``layer`` (i32 scalar): ``experts`` holds stacks ``[L, ...]`` and that layer is used (see :func:`expert_ffn`).
    ``adapters``: LoRA adapters of the expert weights (see :func:`expert_ffn`).
    """

    def ffn(x_sorted: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return expert_ffn(x_sorted, group_sizes, experts["w1"], experts["w3"], experts["w2"], beta1=beta1,
                          beta2=beta2, mxfp8_activations=mxfp8_activations, implementation=implementation,
                          interpret=interpret, platform=platform, layer=layer, adapters=adapters)

    w1 = experts["w1"] if layer is None else _one_layer_shape(experts["w1"])
    return ref.dispatch_combine(z, expert_ids, weights, ref.num_experts_of({"w1": w1}), ffn)
