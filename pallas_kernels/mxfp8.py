"""MXFP8 activation fake-quant (E4M3 elements, E8M0 scale per group of 32 along the last axis).

Optional emulation of SGLang's runtime MXFP8 quantization of routed-expert inputs; off by default everywhere.
Scale rule as MXFP4 with element offset floor(log2(448)) = 8; elements are ``x / 2^exp`` cast to
``float8_e4m3fn`` (round-to-nearest-even, saturated at +-448).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mxfp4 import GROUP, e8m0_to_f32, mx_scale_exponent

E4M3_MAX = 448.0
FP8_EXP_OFFSET = 8


def quantize_mxfp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [..., N]`` (N % 32 == 0) -> ``(elements float8_e4m3fn [..., N], scale u8 [..., N/32])``."""
    n = x.shape[-1]
    if n % GROUP:
        raise ValueError(f"quantize_mxfp8: last dim must be a multiple of {GROUP}, got shape {x.shape}")
    g = x.astype(jnp.float32).reshape(*x.shape[:-1], n // GROUP, GROUP)
    exp = mx_scale_exponent(jnp.max(jnp.abs(g), axis=-1), FP8_EXP_OFFSET)
    inv = e8m0_to_f32((127 - exp).astype(jnp.uint8))
    el = jnp.clip(g * inv[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return el.reshape(x.shape), (exp + 127).astype(jnp.uint8)


def dequantize_mxfp8(el: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Inverse of :func:`quantize_mxfp8` -> ``dtype [..., N]``."""
    n = el.shape[-1]
    g = el.astype(jnp.float32).reshape(*el.shape[:-1], n // GROUP, GROUP)
    return (g * e8m0_to_f32(scale)[..., None]).reshape(el.shape).astype(dtype)


def fake_quant_mxfp8(x: jax.Array) -> jax.Array:
    """Quantize-dequantize ``x [..., N]`` through MXFP8 (same dtype out); straight-through gradient."""
    q = dequantize_mxfp8(*quantize_mxfp8(x), dtype=x.dtype)
    return x + jax.lax.stop_gradient(q - x)
