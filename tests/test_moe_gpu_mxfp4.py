"""GPU (Pallas Triton) MXFP4 grouped matmul and fused SiTU-GLU kernels, in the generic interpreter on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.quant import pack_mxfp4
from k3_jax.quant.mxfp4 import E2M1_LUT
from pallas_kernels import moe
from pallas_kernels.moe import gpu
from pallas_kernels.moe import reference as ref

MX_TILES = (8, 16, 16, 4, 2)  # tm, tkh, tn: 2 K steps and 2 N tiles on the shapes below
GLU_TILES = (16, 32, 32, 4, 2)
SIZES = ([5, 0, 12, 3], [0, 0, 20, 0])  # empty experts + trailing rows; one expert takes every row
E, K, N, M = 4, 64, 32, 24


def _mx_weight(key, e, n, k, spread: int = 6, base: int = 0):
    """HF-layout MXFP4 weight ``(codes [E, N, K/2], scales [E, N, K/32])`` with per-group scales spread over
    ``2^(+-spread)`` and every E2M1 code present (the values are exactly representable)."""
    k1, k2 = jax.random.split(key)
    codes = jax.random.randint(k1, (e, n, k), 0, 16)
    vals = jnp.asarray(E2M1_LUT)[codes]
    exps = jax.random.randint(k2, (e, n, k // 32, 1), base - spread, base + spread + 1).astype(jnp.float32)
    w = (vals.reshape(e, n, k // 32, 32) * jnp.exp2(exps)).reshape(e, n, k)
    return pack_mxfp4(w)


def _ref_mx(x, packed, scale, gs, absolute: bool = False):
    w = ref.dense_expert_weight({"weight_packed": packed, "weight_scale": scale}, jnp.float32)
    return ref.grouped_matmul(jnp.abs(x), jnp.abs(w), gs) if absolute else ref.grouped_matmul(x, w, gs)


def _assert_f32_close(got, want, magnitude):
    """Equal up to f32 summation order: |got - want| <= 1e-6 * (|x| @ |W|) + 1e-6 * |want| elementwise."""
    got, want, magnitude = (np.asarray(a, np.float64) for a in (got, want, magnitude))
    assert np.all(np.abs(got - want) <= 1e-6 * magnitude + 1e-6 * np.abs(want) + 1e-30), np.max(np.abs(got - want))


@pytest.mark.parametrize("sizes", SIZES)
def test_gmm_mxfp4_matches_dequantized_reference(sizes):
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (M, K))
    packed, scale = _mx_weight(kw, E, N, K)
    gs = jnp.array(sizes, jnp.int32)
    got = gpu.gmm_mxfp4(x, [(packed, scale)], gs, tiles=MX_TILES, interpret=True)
    _assert_f32_close(got, _ref_mx(x, packed, scale, gs), _ref_mx(x, packed, scale, gs, absolute=True))
    assert np.all(np.asarray(got[sum(sizes):]) == 0)


def test_gmm_mxfp4_fused_situ_glu():
    k0, k1, k3 = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k0, (M, K))
    w1, w3 = _mx_weight(k1, E, N, K, 1, -3), _mx_weight(k3, E, N, K, 1, -3)
    gs = jnp.array(SIZES[0], jnp.int32)
    got = gpu.gmm_mxfp4(x, [w1, w3], gs, epilogue=gpu.situ_epilogue(4.0, 25.0, jnp.float32), tiles=MX_TILES,
                        interpret=True)
    want = ref.situ_glu(_ref_mx(x, *w1, gs), _ref_mx(x, *w3, gs))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_scale_edge_values():
    """E8M0 0 (2^-127), 127 (1.0), 240 (largest exact), 255 (NaN) against the reference decode."""
    s = jnp.array([0, 1, 127, 200, 240, 255], jnp.int32)
    f = np.asarray(gpu._scale_factor(s)) / 16384.0
    want = np.ldexp(np.float32(1.0), np.asarray(s[1:5]) - 127).astype(np.float32)
    np.testing.assert_array_equal(f[1:5], want)
    assert f[0] == np.float32(2.0**-127) and np.isnan(f[5])
    codes = jnp.arange(16, dtype=jnp.int32)[None, :]
    vals = np.asarray(gpu._decode(codes + 0x70, jnp.ones((1, 16), jnp.float32) * 16384.0, jnp.float32))[0]
    np.testing.assert_array_equal(vals, E2M1_LUT)  # high bits ignored, signed zero kept
    assert np.signbit(vals[8])


def test_gmm_glu_forward_and_grads():
    k0, k1, k2, k3 = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(k0, (M, K))
    w1 = jax.random.normal(k1, (E, K, N)) / 8
    w3 = jax.random.normal(k2, (E, K, N)) / 8
    d = jax.random.normal(k3, (M, N))
    gs = jnp.array(SIZES[0], jnp.int32)
    refn = lambda a, b, c: ref.situ_glu(ref.grouped_matmul(a, b, gs), ref.grouped_matmul(a, c, gs))
    np.testing.assert_allclose(np.asarray(gpu.gmm_glu(x, w1, w3, gs, tiles=GLU_TILES, interpret=True)),
                               np.asarray(refn(x, w1, w3)), rtol=1e-5, atol=1e-5)
    glu = moe.ops.gpu_glu_fn(4.0, 25.0, True)
    ga = jax.grad(lambda *p: jnp.sum(glu(*p, gs) * d), argnums=(0, 1, 2))(x, w1, w3)
    gb = jax.grad(lambda *p: jnp.sum(refn(*p) * d), argnums=(0, 1, 2))(x, w1, w3)
    for a, b in zip(ga, gb, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_ops_dispatch_mxfp4_expert_ffn_and_gmm():
    """ops.expert_ffn / grouped_matmul with MXFP4 dicts on pallas_gpu (interpret) equal the reference."""
    lat, inter = 64, 32
    ks = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(ks[0], (M, lat))
    mk = lambda key, n, k: dict(zip(("weight_packed", "weight_scale"), _mx_weight(key, E, n, k, 1, -3),
                                    strict=True))
    w1, w3, w2 = mk(ks[1], inter, lat), mk(ks[2], inter, lat), mk(ks[3], lat, inter)
    gs = jnp.array(SIZES[0], jnp.int32)
    got = moe.expert_ffn(x, gs, w1, w3, w2, implementation="pallas_gpu", interpret=True)
    want = ref.expert_ffn(x, gs, w1, w3, w2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    got = moe.grouped_matmul(x, w1, gs, implementation="pallas_gpu", interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_ref_mx(x, w1["weight_packed"], w1["weight_scale"],
                                                                   gs)), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_mxfp4_and_glu_on_gpu():
    """Compiled Triton kernels: MXFP4 decode (single and fused w1/w3) and bf16 fused GLU vs the reference."""
    e, lat, inter, m = 8, 256, 512, 64
    ks = jax.random.split(jax.random.key(4), 5)
    x = jax.random.normal(ks[0], (m, lat), jnp.bfloat16)
    gs = jnp.array([0, 20, 3, 0, 8, 1, 0, 30], jnp.int32)  # sum 62 < 64
    w1, w3 = _mx_weight(ks[1], e, inter, lat, 1, -4), _mx_weight(ks[2], e, inter, lat, 1, -4)
    got = gpu.gmm_mxfp4(x, [w1], gs)
    want = _ref_mx(x.astype(jnp.float32), *w1, gs)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)
    assert np.all(np.asarray(got[62:], np.float32) == 0)
    got = gpu.gmm_mxfp4(x, [w1, w3], gs, epilogue=gpu.situ_epilogue(4.0, 25.0, jnp.bfloat16))
    want = ref.situ_glu(want, _ref_mx(x.astype(jnp.float32), *w3, gs))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=3e-2, atol=3e-2)
    d1 = jax.random.normal(ks[3], (e, lat, inter), jnp.bfloat16) / 16
    d3 = jax.random.normal(ks[4], (e, lat, inter), jnp.bfloat16) / 16
    got = gpu.gmm_glu(x, d1, d3, gs)
    want = ref.situ_glu(jax.lax.ragged_dot(x, d1, gs, preferred_element_type=jnp.float32),
                        jax.lax.ragged_dot(x, d3, gs, preferred_element_type=jnp.float32))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=3e-2, atol=3e-2)
