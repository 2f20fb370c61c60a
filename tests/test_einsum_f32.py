"""``einsum_f32``: fp32 output of low-precision operands, and a backward whose GEMMs stay low-precision."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.layers.common import einsum_f32
from tests._jaxpr_walk import iter_eqns


def _dot_operand_dtypes(fn, *args) -> list[tuple[str, str]]:
    """(lhs, rhs) dtypes of every dot_general in ``fn``'s jaxpr, sub-jaxprs included."""
    return [(str(e.invars[0].aval.dtype), str(e.invars[1].aval.dtype))
            for e in iter_eqns(fn, *args) if e.primitive.name == "dot_general"]


def _loss(eq):
    def f(a, b):
        y = einsum_f32(eq, a, b)
        return jnp.sum(jnp.sin(y) * y)  # a cotangent that is not a constant
    return f


def test_bf16_einsum_f32_gradients_match_fp32_and_use_bf16_gemms():
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (2, 48, 4, 32), jnp.float32)
    b = jax.random.normal(kb, (2, 40, 4, 32), jnp.float32) * 0.2
    eq = "bthd,bshd->bhts"
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    y = einsum_f32(eq, a16, b16)
    assert y.dtype == jnp.float32
    want = jnp.einsum(eq, a16.astype(jnp.float32), b16.astype(jnp.float32), precision="highest")
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)  # exact products of bf16 values, fp32 sums

    ga, gb = jax.grad(_loss(eq), argnums=(0, 1))(a16, b16)
    ra, rb = jax.grad(_loss(eq), argnums=(0, 1))(a16.astype(jnp.float32), b16.astype(jnp.float32))
    assert ga.dtype == gb.dtype == jnp.bfloat16
    for g, r in ((ga, ra), (gb, rb)):  # bf16 cotangent and bf16 results: a few bf16 ulps of the largest entry
        err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
        assert err < 4e-2, err

    dots = _dot_operand_dtypes(jax.grad(_loss(eq), argnums=(0, 1)), a16, b16)
    # the backward's two GEMMs take bf16 on both sides, and no dot mixes f32 with bf16 (GPUs run such a dot
    # as an fp32/TF32 GEMM); the forward is bf16 (f32 upcast on CPU)
    assert dots[-2:] == [("bfloat16", "bfloat16")] * 2, dots
    assert all(lhs == rhs for lhs, rhs in dots), dots


def test_fp32_einsum_f32_is_exact_and_differentiable():
    a = jax.random.normal(jax.random.key(1), (8, 16), jnp.float32)
    b = jax.random.normal(jax.random.key(2), (16, 4), jnp.float32)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(einsum_f32("ij,jk->ik", a, b), a64 @ b64, rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda x: jnp.sum(einsum_f32("ij,jk->ik", x, b)))(a)
    np.testing.assert_allclose(g, np.broadcast_to(b64.sum(1), (8, 16)), rtol=1e-5, atol=1e-5)


def test_code_path_follows_the_target_platform_not_the_host():
    """A bf16 einsum_f32 traced for a TPU or GPU target is one bf16 x bf16 -> f32 dot; for a CPU target (this
    host's default device) both operands are upcast to f32 first (XLA:CPU has no bf16 x bf16 -> f32 dot)."""
    from pallas_kernels.registry import platform_scope

    a = jnp.ones((4, 8), jnp.bfloat16)
    fwd = lambda: lambda a, b: einsum_f32("ij,jk->ik", a, b)  # a new function per trace: jit caches by identity
    assert _dot_operand_dtypes(fwd(), a, a.T) == [("float32", "float32")]
    for platform in ("tpu", "gpu"):
        with platform_scope(platform):
            assert _dot_operand_dtypes(fwd(), a, a.T) == [("bfloat16", "bfloat16")], platform
