"""Public MoE entry points dispatching between the Pallas kernels and the pure-JAX reference.

``implementation``:
  * ``"auto"``: ``"pallas_tpu"`` on TPU, ``"pallas_gpu"`` on GPU, ``"reference"`` elsewhere (on CPU a truthy
    ``interpret`` selects ``"pallas_tpu"`` in TPU interpret mode, which is how CI runs the TPU kernels);
  * ``"reference"``: :mod:`pallas_kernels.moe.reference`;
  * ``"pallas_tpu"``: Mosaic kernels (:mod:`.tpu`): grouped matmul with a kernel backward, fused w1/w3 +
    SiTU-GLU kernel, MXFP4 weights decoded in VMEM (forward only);
  * ``"pallas_gpu"``: Triton kernels (:mod:`.gpu`): grouped matmul with a kernel backward, fused w1/w3 +
    SiTU-GLU kernel (grouped-matmul-kernel backward), MXFP4 weights decoded in registers from the packed
    HF layout (forward only; the w1/w3 pair in one kernel with the SiTU-GLU epilogue).

Gradients: every bf16/f32 path is differentiable w.r.t. tokens, routing weights and expert weights. The
MXFP4 paths are for serving: on ``pallas_tpu`` and ``pallas_gpu`` they are forward-only.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.moe import reference as ref
from pallas_kernels.mxfp4 import is_mxfp4
from pallas_kernels.mxfp8 import fake_quant_mxfp8

IMPLEMENTATIONS = ("auto", "reference", "pallas_tpu", "pallas_gpu")
#: pallas_gpu bf16/f32 expert FFN: fused w1/w3 + SiTU-GLU kernel (True) or two grouped matmuls + XLA SiTU-GLU.
#: ``benchmarks/moe.py`` measures both; on the H200 (RESULTS.md, 2026-11-29) the unfused form was faster at
#: K3 expert shapes (forward 584 vs 526 TFLOP/s balanced, 512 vs 475 skewed), so it is the default.
GPU_FUSED_GLU = False


def resolve(implementation: str, interpret: bool = False, name: str = "moe") -> str:
    """Concrete implementation name for ``implementation`` on the current default backend."""
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


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array | dict[str, jax.Array],
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    implementation: str = "auto",
    interpret: bool = False,
    tiles: tuple[int, ...] | None = None,
) -> jax.Array:
    """``lhs [M, K] x rhs [E, K, N] -> [M, N]`` with ``jax.lax.ragged_dot`` semantics.

    ``rhs`` may be an MXFP4 dict ``{"weight_packed": u8 [E, N, K/2], "weight_scale": u8 [E, N, K/32]}``
    (HF ``[out, in]`` orientation).
    """
    impl = resolve(implementation, interpret, "grouped_matmul")
    if impl == "reference":
        return ref.grouped_matmul(lhs, ref.dense_expert_weight(rhs, lhs.dtype), group_sizes,
                                  preferred_element_type=preferred_element_type)
    kern, mxfp4_operand = _kernels(impl)
    if is_mxfp4(rhs):
        return kern.gmm_mxfp4(lhs, [mxfp4_operand(rhs)], group_sizes, out_dtype=preferred_element_type,
                              interpret=interpret)
    return kern.gmm(lhs, ref.dense_expert_weight(rhs, lhs.dtype), group_sizes,
                    preferred_element_type=preferred_element_type, tiles=tiles, interpret=interpret)


def _kernels(impl: str):
    """``(kernel module, MXFP4 weight dict -> that module's MXFP4 operand)`` for a Pallas implementation."""
    if impl == "pallas_tpu":
        from pallas_kernels.moe import tpu

        return tpu, lambda w: tpu.mxfp4_kernel_layout(w["weight_packed"], w["weight_scale"])
    from pallas_kernels.moe import gpu

    return gpu, lambda w: (w["weight_packed"], w["weight_scale"])


@functools.cache
def tpu_glu_fn(beta1: float, beta2: float, interpret: bool):
    """``f(x, w1, w3, group_sizes) -> [M, I]``: fused kernel forward, grouped-matmul-kernel backward."""
    from pallas_kernels.moe import tpu

    return _glu_fn(tpu, beta1, beta2, interpret, save_products=False)


@functools.cache
def gpu_glu_fn(beta1: float, beta2: float, interpret: bool):
    """GPU twin of :func:`tpu_glu_fn`: the fused Triton kernel when not differentiated; under differentiation
    the forward runs the two grouped matmuls and keeps gate/up for the backward (no recompute)."""
    from pallas_kernels.moe import gpu

    return _glu_fn(gpu, beta1, beta2, interpret, save_products=True)


def _glu_fn(kern, beta1: float, beta2: float, interpret: bool, *, save_products: bool):
    """``custom_vjp`` around ``kern.gmm_glu``; the backward uses ``kern.gmm``'s kernel backward.

    ``save_products``: the differentiated forward computes gate/up with ``kern.gmm`` and saves them (trading
    the fused kernel for no recompute); otherwise it runs the fused kernel and the backward recomputes them.
    """

    def products(x, w1, w3, gs):
        return (kern.gmm(x, w1, gs, interpret=interpret), kern.gmm(x, w3, gs, interpret=interpret))

    act = lambda g, u: ref.situ_glu(g, u, beta1, beta2)

    @jax.custom_vjp
    def f(x, w1, w3, gs):
        return kern.gmm_glu(x, w1, w3, gs, beta1=beta1, beta2=beta2, interpret=interpret)

    def fwd(x, w1, w3, gs):
        if save_products:
            (gate, up), vjp_mm = jax.vjp(lambda a, b, c: products(a, b, c, gs), x, w1, w3)
            return act(gate, up), (gate, up, vjp_mm)
        return f(x, w1, w3, gs), (x, w1, w3, gs)

    def bwd(res, dh):
        if save_products:
            gate, up, vjp_mm = res
        else:
            x, w1, w3, gs = res
            (gate, up), vjp_mm = jax.vjp(lambda a, b, c: products(a, b, c, gs), x, w1, w3)
        _, vjp_act = jax.vjp(act, gate, up)
        dg, du = vjp_act(dh.astype(gate.dtype))
        dx, dw1, dw3 = vjp_mm((dg, du))
        return dx, dw1, dw3, None

    f.defvjp(fwd, bwd)
    return f


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
) -> jax.Array:
    """Routed experts on expert-sorted rows (same contract as :func:`reference.expert_ffn`)."""
    impl = resolve(implementation, interpret, "expert_ffn")
    if impl == "reference":
        return ref.expert_ffn(x_sorted, group_sizes, w1, w3, w2, beta1=beta1, beta2=beta2,
                              mxfp8_activations=mxfp8_activations)
    dt = x_sorted.dtype
    a = fake_quant_mxfp8(x_sorted) if mxfp8_activations else x_sorted
    quant = lambda h: fake_quant_mxfp8(h) if mxfp8_activations else h
    kern, mxfp4_operand = _kernels(impl)
    if is_mxfp4(w1) and is_mxfp4(w3) and is_mxfp4(w2):
        h = kern.gmm_mxfp4(a, [mxfp4_operand(w1), mxfp4_operand(w3)], group_sizes,
                           epilogue=ref.situ_epilogue(beta1, beta2, dt), out_dtype=dt, interpret=interpret)
        out = kern.gmm_mxfp4(quant(h), [mxfp4_operand(w2)], group_sizes, out_dtype=jnp.float32, interpret=interpret)
        return out.astype(dt)
    d1, d3, d2 = (ref.dense_expert_weight(w, dt) for w in (w1, w3, w2))
    if impl == "pallas_tpu" or GPU_FUSED_GLU:
        glu_fn = tpu_glu_fn if impl == "pallas_tpu" else gpu_glu_fn
        h = glu_fn(float(beta1), float(beta2), bool(interpret))(a, d1, d3, group_sizes)
    else:
        gate = kern.gmm(a, d1, group_sizes, interpret=interpret)
        up = kern.gmm(a, d3, group_sizes, interpret=interpret)
        h = ref.situ_glu(gate, up, beta1, beta2)
    out = kern.gmm(quant(h), d2, group_sizes, preferred_element_type=jnp.float32, interpret=interpret)
    return out.astype(dt)


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
) -> jax.Array:
    """Routed experts of Stable LatentMoE: ``u = cast(sum_k weights * f32(E_e(z)), z.dtype)`` -> ``[T, L]``.

    Same arguments as :func:`reference.moe_dispatch_combine`; ``implementation`` picks the expert FFN.
    """
    impl = resolve(implementation, interpret, "moe_dispatch_combine")

    def ffn(x_sorted: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return expert_ffn(x_sorted, group_sizes, experts["w1"], experts["w3"], experts["w2"], beta1=beta1,
                          beta2=beta2, mxfp8_activations=mxfp8_activations, implementation=impl,
                          interpret=interpret)

    return ref.dispatch_combine(z, expert_ids, weights, ref.num_experts_of(experts), ffn)
