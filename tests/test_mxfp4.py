"""MXFP4 pack/unpack and MXFP8 fake-quant against ml_dtypes decoding."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k3_jax.quant import E2M1_LUT, fake_quant_mxfp8, pack_mxfp4, quantize_mxfp8, unpack_mxfp4


def _ml_dtypes_unpack(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    vals = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    s = np.exp2(scale.astype(np.float64) - 127).astype(np.float32)
    return (vals.reshape(*scale.shape, 32) * s[..., None]).reshape(vals.shape)


def test_lut_matches_ml_dtypes():
    ref = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(E2M1_LUT, ref)
    np.testing.assert_array_equal(np.signbit(E2M1_LUT), np.signbit(ref))


def test_unpack_matches_ml_dtypes_and_nibble_order():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, size=(3, 5, 32), dtype=np.uint8)
    scale = rng.integers(100, 150, size=(3, 5, 2), dtype=np.uint8)
    got = np.asarray(unpack_mxfp4(jnp.asarray(packed), jnp.asarray(scale)))
    np.testing.assert_array_equal(got, _ml_dtypes_unpack(packed, scale))
    # low nibble first: byte 0x71 -> (code 1 = 0.5, code 7 = 6.0) at scale 2^0
    one = unpack_mxfp4(jnp.full((1, 16), 0x71, jnp.uint8), jnp.full((1, 1), 127, jnp.uint8))
    np.testing.assert_array_equal(np.asarray(one[0, :2]), [0.5, 6.0])
    bf = unpack_mxfp4(jnp.asarray(packed), jnp.asarray(scale), jnp.bfloat16)
    assert bf.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bf, np.float32), got)


def test_scale_ff_is_nan():
    out = unpack_mxfp4(jnp.zeros((2, 16), jnp.uint8), jnp.array([[255], [127]], jnp.uint8))
    assert bool(jnp.all(jnp.isnan(out[0]))) and bool(jnp.all(out[1] == 0))


def test_roundtrip_exact_for_representable():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, size=(4, 8, 32)).astype(np.uint8)
    codes[:, :, 0] = rng.choice([6, 7, 14, 15, 5, 3], size=(4, 8))  # various group maxima
    exps = rng.integers(-20, 20, size=(4, 8)).astype(np.float32)
    w = E2M1_LUT[codes] * np.exp2(exps)[..., None]
    w = w.reshape(4, 256)
    packed, scale = pack_mxfp4(jnp.asarray(w))
    back = np.asarray(unpack_mxfp4(packed, scale))
    np.testing.assert_array_equal(back, w)
    np.testing.assert_array_equal(np.asarray(unpack_mxfp4(*pack_mxfp4(jnp.asarray(back)))), back)


def test_pack_matches_mx_rule_and_ml_dtypes_rounding():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((6, 128)) * np.exp2(rng.integers(-8, 8, size=(6, 1)))).astype(np.float32)
    w[0, :32] = 0.0  # all-zero group
    w[1, 5] = 7.0 * 2.0**-3  # amax mantissa 1.75 -> rounds the scale up
    packed, scale = pack_mxfp4(jnp.asarray(w))
    g = w.reshape(6, 4, 32)
    amax = np.abs(g).max(-1)
    # compressed-tensors rule: round amax to a power of two (mantissa >= 1.75 rounds up), minus 2
    e = np.floor(np.log2(np.where(amax > 0, amax, 1.0)))
    e = e + (amax / np.exp2(e) >= 1.75)
    exp = np.where(amax > 0, e - 2, -127)
    np.testing.assert_array_equal(np.asarray(scale).astype(np.int32) - 127, exp.astype(np.int32))
    el = (g / np.exp2(exp)[..., None]).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    ref = (el * np.exp2(exp)[..., None]).reshape(6, 128)
    np.testing.assert_array_equal(np.asarray(unpack_mxfp4(packed, scale)), ref)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="scale"):
        unpack_mxfp4(jnp.zeros((2, 16), jnp.uint8), jnp.zeros((2, 2), jnp.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_mxfp4(jnp.zeros((2, 48)))


def test_mxfp8_fake_quant():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 64)) * 10).astype(np.float32)
    el, scale = quantize_mxfp8(jnp.asarray(x))
    g = x.reshape(4, 2, 32)
    amax = np.abs(g).max(-1)
    e = np.floor(np.log2(amax))
    e = e + (amax / np.exp2(e) >= 1.75) - 8
    np.testing.assert_array_equal(np.asarray(scale).astype(np.int32) - 127, e.astype(np.int32))
    ref = ((g / np.exp2(e)[..., None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
           * np.exp2(e)[..., None]).reshape(4, 64)
    got = fake_quant_mxfp8(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), ref)
    grad = jax.grad(lambda v: jnp.sum(fake_quant_mxfp8(v) * 3.0))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(grad), 3.0)
