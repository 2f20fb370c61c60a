"""Shared building blocks: dtype lookup, logically-partitioned initialisers, bias-free Dense, RMSNorm."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3_jax.config import K3Config
from pallas_kernels.registry import target_platform

HIGHEST = jax.lax.Precision.HIGHEST
Initializer = Callable[..., jax.Array]


def compute_dtype(cfg: K3Config) -> jnp.dtype:
    return jnp.dtype(cfg.dtype)


def param_dtype(cfg: K3Config) -> jnp.dtype:
    return jnp.dtype(cfg.param_dtype)


def matmul_precision(cfg: K3Config) -> jax.lax.Precision:
    """fp32 runs (tests, references) get exact fp32 matmuls; bf16 runs use the default (native bf16)."""
    return HIGHEST if jnp.dtype(cfg.dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def logical(init: Initializer, names: Sequence[str | None]) -> Initializer:
    """Attach logical axis names to an initialiser (the param is boxed in ``nn.LogicallyPartitioned``)."""
    return nn.with_logical_partitioning(init, tuple(names))


def einsum_f32(eq: str, *operands: jax.Array) -> jax.Array:
    """``einsum`` accumulating in fp32 and returning fp32, whatever the operand dtype.

    fp32 operands use HIGHEST precision. XLA:CPU has no bf16×bf16→f32 dot, so when the target platform
    (:func:`pallas_kernels.registry.target_platform`: the mesh's devices, else the default device) is CPU, bf16
    operands are upcast first (same result); on GPU/TPU they stay bf16 with an fp32 accumulator.

    With two operands of one low-precision dtype (bf16), the backward casts the fp32 output cotangent to that
    dtype before its two GEMMs (:func:`_einsum_f32_lowp_grads`), as a bf16 layer's backward does: left to
    autodiff, each would be an f32 × bf16 dot, which GPUs run as an fp32/TF32 GEMM at a fraction of the bf16
    rate (the lm_head and MLA score/value products were ~7% of a K3-width train step that way).
    """
    dtypes = {x.dtype for x in operands}
    if dtypes == {jnp.dtype(jnp.float32)}:
        return jnp.einsum(eq, *operands, precision=HIGHEST)
    platform = target_platform()  # a static argument below: JAX caches traces by function, avals and statics
    if len(operands) == 2 and len(dtypes) == 1:
        return _einsum_f32_lowp_grads(eq, platform, *operands)
    return _einsum_f32_forward(eq, platform, *operands)


def _einsum_f32_forward(eq: str, platform: str, *operands: jax.Array) -> jax.Array:
    if platform == "cpu":
        return jnp.einsum(eq, *(x.astype(jnp.float32) for x in operands), precision=HIGHEST)
    return jnp.einsum(eq, *operands, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _einsum_f32_lowp_grads(eq: str, platform: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """fp32-output einsum of two same-dtype low-precision operands whose gradients are low-precision GEMMs."""
    return _einsum_f32_forward(eq, platform, a, b)


def _einsum_f32_lowp_fwd(eq: str, platform: str, a: jax.Array,
                         b: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _einsum_f32_forward(eq, platform, a, b), (a, b)


def _einsum_f32_lowp_bwd(eq: str, platform: str, res: tuple[jax.Array, jax.Array],
                         g: jax.Array) -> tuple[jax.Array, jax.Array]:
    a, b = res
    _, vjp = jax.vjp(lambda x, y: jnp.einsum(eq, x, y), a, b)  # products in a.dtype, fp32 accumulation in the GEMM
    return vjp(g.astype(a.dtype))


_einsum_f32_lowp_grads.defvjp(_einsum_f32_lowp_fwd, _einsum_f32_lowp_bwd)


LORA_LEAVES = ("lora_a", "lora_b", "lora_scale")
"""Adapter leaves a module may hold beside its weight (added by :mod:`k3_jax.training.lora`, never by init)."""


def lora_adapter(module: nn.Module, prefix: str = "") -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """``(a, b, scale)`` when ``module``'s params hold ``{prefix}lora_a/lora_b/lora_scale``, else None.

    For a weight ``[in, out]``: ``a [in, r]``, ``b [r, out]``, ``scale []`` f32; the adapted weight is
    ``W + scale · a @ b`` (routed experts: ``a [in, r]`` shared or ``[E, in, r]``, ``b [E, r, out]``).
    """
    if not module.has_variable("params", prefix + LORA_LEAVES[0]):
        return None
    a, b, s = (module.get_variable("params", prefix + n) for n in LORA_LEAVES)
    return a, b, s


def lora_delta(a: jax.Array, b: jax.Array, scale: jax.Array) -> jax.Array:
    """``scale · a @ b`` in f32 (HIGHEST): ``[in, r] x [r, out]``, ``[in, r] x [E, r, out]`` (shared A) or
    ``[E, in, r] x [E, r, out]`` -> ``[in, out]`` / ``[E, in, out]``."""
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    if a.ndim == 2 and b.ndim == 3:
        d = jnp.einsum("ir,ero->eio", a32, b32, precision=HIGHEST)
    else:
        d = jnp.matmul(a32, b32, precision=HIGHEST)
    return d * scale.astype(jnp.float32)


class LinearKernel(nn.Module):
    """Holds a linear ``kernel`` [in, out] (same path/init as :class:`Linear`) and returns it, unapplied.

    For layers that use one weight in two ways (MLA's ``kv_b_proj`` expanded vs absorbed).
    """

    in_features: int
    features: int
    names: tuple[str | None, str | None]
    cfg: K3Config
    init_std: float = 0.02

    @nn.compact
    def __call__(self) -> jax.Array:
        kernel = self.param(
            "kernel", logical(nn.initializers.normal(self.init_std), self.names),
            (self.in_features, self.features), param_dtype(self.cfg),
        )
        adapter = lora_adapter(self)
        if adapter is None:
            return kernel
        return kernel.astype(jnp.float32) + lora_delta(*adapter)


class Linear(nn.Module):
    """Bias-free linear layer ``y = x @ kernel``; ``kernel`` [in, out] carries logical axis names.

    Input ``[..., in]`` (any dtype) -> output ``[..., out]`` in ``cfg.dtype``. With LoRA adapters
    (:func:`lora_adapter`): ``x @ kernel + scale · (x @ a) @ b``, the low-rank path on the activations.
    """

    features: int
    names: tuple[str | None, str | None]
    cfg: K3Config
    init_std: float = 0.02

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel", logical(nn.initializers.normal(self.init_std), self.names),
            (x.shape[-1], self.features), param_dtype(self.cfg),
        )
        dt = compute_dtype(self.cfg)
        prec = matmul_precision(self.cfg)
        y = jnp.matmul(x.astype(dt), kernel.astype(dt), precision=prec)
        adapter = lora_adapter(self)
        if adapter is None:
            return y
        a, b, scale = adapter
        xa = jnp.matmul(x.astype(dt), a.astype(dt), precision=prec)
        return y + jnp.matmul(xa, b.astype(dt), precision=prec) * scale.astype(dt)


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm as in the official ``KimiRMSNorm``: normalise in fp32, cast back to ``x.dtype``, times weight.

    ``x`` [..., D] any float dtype; ``weight`` [D] or None; result has ``x.dtype``. Under ``jax.checkpoint``:
    the backward recomputes the fp32 normalisation from ``x`` instead of keeping an f32 copy of ``x`` (and the
    normalised bf16 values) per norm — 3× the bytes of ``x`` per norm in a bf16 model.
    """
    return _rms_norm(x, weight, float(eps))


@functools.partial(jax.checkpoint, static_argnums=(2,))
def _rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = y.astype(x.dtype)
    if weight is None:
        return y
    return y * weight.astype(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a ``weight`` parameter [D] (logical name ``names``) initialised to ones."""

    eps: float
    names: tuple[str | None] = ("norm",)
    dtype: str = "float32"  # parameter dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("weight", logical(nn.initializers.ones, self.names), (x.shape[-1],),
                       jnp.dtype(self.dtype))
        return rms_norm(x, w, self.eps)


class Weight(nn.Module):
    """A module holding one parameter (default name ``weight``) so its path reads ``<module>.<leaf>``.

    ``init`` is ``"ones" | "zeros" | "normal"`` (std 0.02) or an initialiser ``(key, shape, dtype)``.
    """

    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    init: Any = "ones"
    dtype: str = "float32"
    leaf: str = "weight"

    @nn.compact
    def __call__(self) -> jax.Array:
        named = {"ones": nn.initializers.ones, "zeros": nn.initializers.zeros,
                 "normal": nn.initializers.normal(0.02)}
        init = named[self.init] if isinstance(self.init, str) else self.init
        return self.param(self.leaf, logical(init, self.names), self.shape, jnp.dtype(self.dtype))
