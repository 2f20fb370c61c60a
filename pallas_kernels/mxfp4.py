"""MXFP4 (OCP microscaling, E2M1 elements + E8M0 scales, group 32) pack / unpack in JAX.

Layout is compressed-tensors ``mxfp4-pack-quantized`` (the release's routed experts): for a weight ``W [..., N]``
(N = the input dimension of an HF ``[out, in]`` Linear, N % 32 == 0)

- ``packed u8 [..., N/2]``: element ``2c`` is the LOW nibble of byte ``c``, element ``2c+1`` the high nibble;
- ``scale u8 [..., N/32]``: E8M0 exponent, value ``2^(scale - 127)``; ``0xFF`` is NaN.

``E2M1(code) = (-1)^bit3 * [0, 0.5, 1, 1.5, 2, 3, 4, 6][code & 7]``.

The scale rule of ``pack_mxfp4`` is compressed-tensors' ``generate_mx_scales``: per group,
round ``amax`` to a power of two with a +0.25-mantissa bias (values with mantissa >= 1.75 round up), take its
exponent and subtract 2 (= floor(log2(6))); the elements are ``x / 2^exponent`` rounded to nearest-even
E2M1 with saturation at +-6. Values already of the form ``E2M1 * 2^s`` round-trip exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 32
E2M1_MAX = 6.0
FP4_EXP_OFFSET = 2  # floor(log2(6))

#: E2M1 values indexed by the 4-bit code (bit 3 = sign; code 8 is -0).
E2M1_LUT = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


def e8m0_to_f32(scale: jax.Array) -> jax.Array:
    """E8M0 exponents ``u8 [...]`` -> ``f32 [...]`` equal to ``2^(scale - 127)``; 0xFF -> NaN.

    Built from the f32 bit pattern so it is exact (no transcendental); scale 0 gives 2^-127 (an f32 subnormal,
    which some backends flush to zero).
    """
    s = scale.astype(jnp.uint32)
    normal = jax.lax.bitcast_convert_type(s << 23, jnp.float32)
    sub = jnp.float32(2.0**-127)
    out = jnp.where(s == 0, sub, normal)
    return jnp.where(s == 255, jnp.float32(jnp.nan), out)


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """4-bit E2M1 codes (any int dtype, 0..15) -> ``f32`` of the same shape (arithmetic, no gather).

    magnitude m = code & 7: m < 2 -> m / 2 (subnormal); else 2^((m >> 1) - 1) * (1 + (m & 1) / 2).
    """
    c = codes.astype(jnp.int32)
    m = c & 7
    e = (m >> 1).astype(jnp.float32)
    frac = (m & 1).astype(jnp.float32)
    normal = jnp.exp2(e - 1.0) * (1.0 + 0.5 * frac)
    mag = jnp.where(m < 2, 0.5 * frac, normal)
    return jnp.where((c & 8) != 0, -mag, mag)


def unpack_mxfp4(packed: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Dequantize MXFP4.

    Args:
      packed: ``u8 [..., N/2]`` codes, low nibble first.
      scale: ``u8 [..., N/32]`` E8M0 exponents.
      dtype: output dtype (f32 or bf16; the product is formed in f32 then cast).
    Returns:
      ``dtype [..., N]``.
    """
    if packed.dtype != jnp.uint8 or scale.dtype != jnp.uint8:
        raise TypeError(f"unpack_mxfp4: expected u8 packed/scale, got {packed.dtype}/{scale.dtype}")
    n = packed.shape[-1] * 2
    if packed.shape[:-1] != scale.shape[:-1] or scale.shape[-1] * GROUP != n:
        raise ValueError(
            f"unpack_mxfp4: packed {packed.shape} implies N={n}, expected scale [..., {n // GROUP}] "
            f"with the same leading dims, got {scale.shape}"
        )
    lo = packed & 0x0F
    hi = packed >> 4
    codes = jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], n)
    vals = decode_e2m1(codes).reshape(*packed.shape[:-1], n // GROUP, GROUP)
    out = vals * e8m0_to_f32(scale)[..., None]
    return out.reshape(*packed.shape[:-1], n).astype(dtype)


def _pow2_exponent(amax: jax.Array) -> jax.Array:
    """floor(log2(round_to_power_2(amax))) as i32 (compressed-tensors rounding: mantissa >= 1.75 rounds up).

    ``amax`` f32 >= 0. Zero / subnormal amax gives -127.
    """
    bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.uint32)
    bits = (bits + jnp.uint32(1 << 21)) & jnp.uint32(0x7F800000)
    biased = (bits >> 23).astype(jnp.int32)
    return biased - 127


def mx_scale_exponent(amax: jax.Array, elem_offset: int) -> jax.Array:
    """Unbiased shared exponent per group (i32), clamped to the E8M0 range [-127, 127]."""
    return jnp.clip(_pow2_exponent(amax) - elem_offset, -127, 127)


def quantize_e2m1(x: jax.Array) -> jax.Array:
    """f32 -> E2M1 codes ``u8`` (round to nearest, ties to even code, saturate at +-6; sign -> bit 3)."""
    a = jnp.abs(x)
    # Each threshold moves to the next grid point; '>' where the tie goes down to an even code, '>=' where up.
    m = (
        (a > 0.25).astype(jnp.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).astype(jnp.uint8)
    sign = jnp.where(jnp.signbit(x), jnp.uint8(8), jnp.uint8(0))
    return m | sign


def pack_mxfp4(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Quantize ``w [..., N]`` (N % 32 == 0) to MXFP4 -> ``(packed u8 [..., N/2], scale u8 [..., N/32])``."""
    n = w.shape[-1]
    if n % GROUP:
        raise ValueError(f"pack_mxfp4: last dim must be a multiple of {GROUP}, got shape {w.shape}")
    lead = w.shape[:-1]
    g = w.astype(jnp.float32).reshape(*lead, n // GROUP, GROUP)
    amax = jnp.max(jnp.abs(g), axis=-1)
    exp = mx_scale_exponent(amax, FP4_EXP_OFFSET)
    inv = e8m0_to_f32((-exp + 127).astype(jnp.uint8))  # 2^-exp, exact
    codes = quantize_e2m1(g * inv[..., None]).reshape(*lead, n // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    scale = (exp + 127).astype(jnp.uint8)
    return packed.astype(jnp.uint8), scale


def is_mxfp4(p: object) -> bool:
    """True if ``p`` is an MXFP4 weight dict ``{"weight_packed": u8, "weight_scale": u8}``."""
    return isinstance(p, dict) and "weight_packed" in p and "weight_scale" in p
