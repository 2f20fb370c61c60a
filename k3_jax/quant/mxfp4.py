"""MXFP4 codec (E2M1 elements, E8M0 scale per group of 32): the public name of :mod:`pallas_kernels.mxfp4`,
plus :func:`fake_quant_mxfp4`, the quantise-dequantise of quantization-aware training."""

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mxfp4 import (
    E2M1_LUT,
    E2M1_MAX,
    FP4_EXP_OFFSET,
    GROUP,
    decode_e2m1,
    e8m0_to_f32,
    is_mxfp4,
    mx_scale_exponent,
    pack_mxfp4,
    quantize_e2m1,
    unpack_mxfp4,
)

__all__ = ["E2M1_LUT", "E2M1_MAX", "FP4_EXP_OFFSET", "GROUP", "decode_e2m1", "e8m0_to_f32", "fake_quant_mxfp4",
           "is_mxfp4", "mx_scale_exponent", "pack_mxfp4", "quantize_e2m1", "unpack_mxfp4"]


def _quant_dequant(w: jax.Array, axis: int) -> jax.Array:
    moved = jnp.moveaxis(w, axis, -1)
    q = unpack_mxfp4(*pack_mxfp4(moved), dtype=jnp.float32)
    return jnp.moveaxis(q, -1, axis).astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fake_quant_mxfp4(w: jax.Array, axis: int = -2) -> jax.Array:
    """QAT: ``w`` (float, any shape) -> its MXFP4 values in ``w.dtype``: exactly
    ``unpack_mxfp4(*pack_mxfp4(w))`` with the groups of 32 along ``axis`` (E8M0 scales, :func:`pack_mxfp4`'s
    rule), so a model run on these values equals the model exported with ``pack_mxfp4`` bit for bit.

    Straight-through gradient: the cotangent passes to ``w`` unchanged. For routed-expert weights held
    ``[E, in, out]`` the default ``axis=-2`` groups along the input dimension, as the release packs them.
    """
    return _quant_dequant(w, axis)


def _fake_quant_fwd(w: jax.Array, axis: int) -> tuple[jax.Array, None]:
    return _quant_dequant(w, axis), None


def _fake_quant_bwd(axis: int, _: None, g: jax.Array) -> tuple[jax.Array]:
    return (g,)


fake_quant_mxfp4.defvjp(_fake_quant_fwd, _fake_quant_bwd)
