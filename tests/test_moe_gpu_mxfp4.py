"""GPU (Pallas Triton) MXFP4 grouped matmul and fused SiTU-GLU kernels, in the generic interpreter on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.quant import pack_mxfp4
from k3_jax.quant.mxfp4 import E2M1_LUT, unpack_mxfp4
from pallas_kernels import moe
from pallas_kernels.moe import gpu
from pallas_kernels.moe import reference as ref


@pytest.fixture(autouse=True)
def _fp32_reference_dots(request):
    """fp32 dots in the references of the interpret-mode tests: on a GPU backend XLA's default precision is TF32
    (their f32 comparisons failed by ~0.6 against TF32 references on the H200). The compiled-kernel test keeps
    the default precision (its tolerances are bf16's; under "highest" it ran past 100 s on the H200)."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield


MX_TILES = (8, 8, 16, 4, 2)  # tm, tq (u16 code words), tn: 2 K steps and 2 N tiles on the shapes below
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
    got = gpu.gmm_mxfp4(x, [w1, w3], gs, epilogue=ref.situ_epilogue(4.0, 25.0, jnp.float32), tiles=MX_TILES,
                        interpret=True)
    want = ref.situ_glu(_ref_mx(x, *w1, gs), _ref_mx(x, *w3, gs))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_scale_edge_values():
    """E8M0 0 (2^-127), 127 (1.0), 240 (largest exact), 255 (NaN) against the reference decode."""
    s = jnp.array([0, 1, 127, 200, 240, 255], jnp.int32)
    f = np.asarray(gpu.scale_factor_f16(s)) / 16384.0
    want = np.ldexp(np.float32(1.0), np.asarray(s[1:5]) - 127).astype(np.float32)
    np.testing.assert_array_equal(f[1:5], want)
    assert f[0] == np.float32(2.0**-127) and np.isnan(f[5])
    codes = jnp.arange(16, dtype=jnp.int32)[None, :]
    vals = np.asarray(gpu.decode_f16(codes + 0x70, jnp.ones((1, 16), jnp.float32) * 16384.0, jnp.float32))[0]
    np.testing.assert_array_equal(vals, E2M1_LUT)  # high bits ignored, signed zero kept
    assert np.signbit(vals[8])


def test_ops_dispatch_mxfp4_expert_ffn_and_gmm():
    """ops.expert_ffn / grouped_matmul with MXFP4 dicts on triton (interpret) equal the reference."""
    lat, inter = 64, 32
    ks = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(ks[0], (M, lat))
    mk = lambda key, n, k: dict(zip(("weight_packed", "weight_scale"), _mx_weight(key, E, n, k, 1, -3),
                                    strict=True))
    w1, w3, w2 = mk(ks[1], inter, lat), mk(ks[2], inter, lat), mk(ks[3], lat, inter)
    gs = jnp.array(SIZES[0], jnp.int32)
    got = moe.expert_ffn(x, gs, w1, w3, w2, implementation="triton", interpret=True)
    want = np.asarray(ref.expert_ffn(x, gs, w1, w3, w2))
    # f32 sums in another order: absolute error scales with the output's magnitude (|want| up to ~30 here;
    # 2.7e-5 seen on numpy 2.5 / ml_dtypes 0.6), so atol is relative to it
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=2e-6 * np.abs(want).max())
    got = moe.grouped_matmul(x, w1, gs, implementation="triton", interpret=True)
    want = np.asarray(_ref_mx(x, w1["weight_packed"], w1["weight_scale"], gs))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=2e-6 * np.abs(want).max())


# ------------------------------------------------------------------------------------------------- decodes
#: E8M0 scales each decode gets exactly (see the comment above gpu.XSHIFT). f32 from 2 here: its f32 products for
#: s = 0/1 are subnormal and XLA:CPU flushes them (the GPU keeps them).
EXACT_SCALES = {"f32": range(2, 241), "asm": range(gpu.EXACT_SCALES[0], gpu.EXACT_SCALES[1] + 1)}


def _all_bytes_tile(scales):
    """Every packed byte (all 16 x 16 code pairs) under each scale: codes ``u8 [S, 256]``, scales ``u8 [S, 16]``."""
    s = np.asarray(list(scales), np.uint8)
    codes = np.broadcast_to(np.arange(256, dtype=np.uint8), (s.size, 256))
    return jnp.asarray(codes), jnp.asarray(np.repeat(s[:, None], 16, axis=1))


def _reference_classes(codes, scales):
    """Exact MXFP4 values (float64 E2M1 x 2^(s-127), 255 -> NaN, then f32: overflow -> inf like the f32 reference)
    of K elements 4j + c, c = 0..3 (the nibble classes). Computed in numpy: XLA:CPU flushes the f32 subnormals that
    scale 0/1 give."""
    c, s = np.asarray(codes).astype(np.int64), np.repeat(np.asarray(scales).astype(np.float64), 32, axis=1)
    scale = np.where(s == 255, np.nan, np.exp2(s - 127.0))
    nib = np.stack([c & 15, c >> 4], axis=-1).reshape(c.shape[0], -1)  # element 2i = low nibble of byte i
    with np.errstate(over="ignore", invalid="ignore"):
        vals = (E2M1_LUT[nib].astype(np.float64) * scale).astype(np.float32)
    return tuple(vals[:, cls::4] for cls in range(4))


def _bits_f32(x) -> np.ndarray:
    """bf16 (jax or numpy) -> f32 through the bit pattern (no subnormal flushing)."""
    return (np.asarray(x).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _assert_same_values(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_array_equal(got, want)  # NaN == NaN here; +-0 compared below
    both = ~np.isnan(want)
    assert np.array_equal(np.signbit(got[both]), np.signbit(want[both])), "signed zero lost"


def test_code_words_are_little_endian_byte_pairs():
    codes = jnp.asarray(np.arange(8, dtype=np.uint8).reshape(1, 8))
    np.testing.assert_array_equal(np.asarray(gpu.code_words(codes)), [[0x0100, 0x0302, 0x0504, 0x0706]])
    x = jnp.arange(8.0)[None]
    np.testing.assert_array_equal(np.asarray(gpu.columns_mod4(x)), [[0, 4, 1, 5, 2, 6, 3, 7]])


def test_f32_decode_exact_on_all_codes():
    """Every byte (16 x 16 codes) x every E8M0 scale of its contract: the f32 decode (f32 activations, and bf16 in
    the interpreter) gives the reference values in bf16. The PTX decode is checked on its text below (IEEE
    arithmetic: XLA:CPU flushes the bf16 subnormals it passes +-0.5 through)."""
    codes, scales = _all_bytes_tile(EXACT_SCALES["f32"])
    got = gpu._decode_tile(gpu.code_words(codes), scales, jnp.bfloat16, interpret=True)
    for g, want in zip(got, _reference_classes(codes, scales), strict=True):
        _assert_same_values(_bits_f32(g), want)


# A tiny PTX interpreter for the instructions of gpu._mxfp4_asm, so the asm text itself is checked on CPU.
def _bf16_bits_to_f32(h):
    return (np.asarray(h, np.uint32) << 16).view(np.float32)


def _f32_to_bf16_bits_exact(f):
    b = np.asarray(f, np.float32).view(np.uint32)
    assert np.all(((b & 0xFFFF) == 0) | np.isnan(f)), "bf16 product not exact (test assumes exact products)"
    return np.where(np.isnan(f), 0x7FC0, b >> 16).astype(np.uint32)


def _run_ptx(asm: str, regs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    regs = dict(regs)
    val = lambda tok: regs[tok] if tok in regs else np.uint32(int(tok, 0))
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        a = [t.strip() for t in args.split(",")]
        x = [np.asarray(val(t), np.uint32) for t in a[1:]]
        if op == "shr.b32":
            r = x[0] >> x[1]
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "mul.lo.u32":
            r = (x[0].astype(np.uint64) * x[1].astype(np.uint64)) & np.uint64(0xFFFFFFFF)
        elif op == "mul.rn.bf16x2":
            with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 past the exact scales
                lo = _bf16_bits_to_f32(x[0] & 0xFFFF) * _bf16_bits_to_f32(x[1] & 0xFFFF)
                hi = _bf16_bits_to_f32(x[0] >> 16) * _bf16_bits_to_f32(x[1] >> 16)
                r = _f32_to_bf16_bits_exact(lo) | (_f32_to_bf16_bits_exact(hi) << 16)
        else:
            raise AssertionError(f"PTX op {op} not emulated")
        regs[a[0]] = np.asarray(r, np.uint32)
    return regs


def _ptx_decode(scales) -> list[np.ndarray]:
    """gpu._mxfp4_asm's four classes through the emulator on all 256 bytes under each scale, times 2^XSHIFT (the
    activations' factor): ``[S, 128]`` f32 per class."""
    s = np.asarray(list(scales), np.int32)
    sbits = np.asarray(gpu.scale_bits_bf16(jnp.asarray(s)), np.uint32)
    words = np.arange(256, dtype=np.uint32).reshape(64, 2, 2)  # words [64, 2]: bytes (2w, 2w + 1)
    words = (words[..., 0] | words[..., 1] << 8).astype(np.uint32)
    pair = np.broadcast_to((words[:, 0] | words[:, 1] << 16)[None], (s.size, 64))
    sreg = np.broadcast_to((sbits | sbits << 16)[:, None], (s.size, 64)).astype(np.uint32)
    out = []
    for cls in range(4):
        r = _run_ptx(gpu._mxfp4_asm(cls), {"$1": pair, "$2": sreg})["$0"]
        v = _bf16_bits_to_f32(np.stack([r & 0xFFFF, r >> 16], axis=-1).reshape(s.size, 128))
        out.append(v * np.float32(2.0**gpu.XSHIFT))
    return out


def test_inline_ptx_decodes_like_reference():
    """gpu._mxfp4_asm's PTX, run by the emulator above on all 256 bytes x every E8M0 scale it gets exactly."""
    codes, sc = _all_bytes_tile(EXACT_SCALES["asm"])
    for got, want in zip(_ptx_decode(EXACT_SCALES["asm"]), _reference_classes(codes, sc), strict=True):
        _assert_same_values(got, want)


def test_inline_ptx_saturates_large_scales():
    """Scales past gpu.EXACT_SCALES (255 = NaN included) decode to non-finite values, never to finite wrong ones."""
    for got in _ptx_decode(range(gpu.EXACT_SCALES[1] + 1, 256)):
        assert not np.isfinite(got).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gmm_mxfp4_bf16_and_f32_match_reference(dtype):
    """Both activation dtypes in the interpreter with empty experts and trailing rows: the kernel around the
    decode (tiles, masks, virtual group)."""
    kx, kw = jax.random.split(jax.random.key(5))
    x = jax.random.normal(kx, (M, K)).astype(dtype)
    packed, scale = _mx_weight(kw, E, N, K)
    gs = jnp.array(SIZES[0], jnp.int32)
    got = gpu.gmm_mxfp4(x, [(packed, scale)], gs, tiles=MX_TILES, interpret=True)
    assert got.dtype == dtype
    xf = x.astype(jnp.float32)
    want, mag = _ref_mx(xf, packed, scale, gs), _ref_mx(xf, packed, scale, gs, absolute=True)
    if dtype == jnp.float32:
        _assert_f32_close(got, want, mag)
    else:  # exact bf16 weights, f32 accumulation: only the final bf16 rounding differs
        np.testing.assert_array_less(np.abs(np.asarray(got, np.float32) - np.asarray(want)),
                                     np.asarray(mag) * 2.0**-8 + 1e-6)
    assert np.all(np.asarray(got[sum(SIZES[0]):], np.float32) == 0)


def test_gmm_mxfp4_fused_glu_bf16():
    k0, k1, k3 = jax.random.split(jax.random.key(6), 3)
    x = jax.random.normal(k0, (M, K)).astype(jnp.bfloat16)
    w1, w3 = _mx_weight(k1, E, N, K, 1, -3), _mx_weight(k3, E, N, K, 1, -3)
    gs = jnp.array(SIZES[1], jnp.int32)
    got = gpu.gmm_mxfp4(x, [w1, w3], gs, epilogue=ref.situ_epilogue(4.0, 25.0, jnp.float32), tiles=MX_TILES,
                        interpret=True, out_dtype=jnp.float32)
    xf = x.astype(jnp.float32)
    want = ref.situ_glu(_ref_mx(xf, *w1, gs), _ref_mx(xf, *w3, gs))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_mxfp4_and_glu_on_gpu():
    """Compiled Triton kernels: MXFP4 decode (single and fused w1/w3 with the SiTU-GLU epilogue) vs the reference."""
    e, lat, inter, m = 8, 256, 512, 64
    ks = jax.random.split(jax.random.key(4), 5)
    x = jax.random.normal(ks[0], (m, lat), jnp.bfloat16)
    gs = jnp.array([0, 20, 3, 0, 8, 1, 0, 30], jnp.int32)  # sum 62 < 64
    w1, w3 = _mx_weight(ks[1], e, inter, lat, 1, -4), _mx_weight(ks[2], e, inter, lat, 1, -4)
    want = _ref_mx(x.astype(jnp.float32), *w1, gs)
    for dtype in (jnp.bfloat16, jnp.float32):  # the PTX decode, the f32 decode
        got = gpu.gmm_mxfp4(x.astype(dtype), [w1], gs)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2,
                                   err_msg=str(dtype))
        assert np.all(np.asarray(got[62:], np.float32) == 0)
    # every code pair (the +-0.5 code goes through a bf16 subnormal in the PTX decode), compiled vs reference
    codes, scales = _all_bytes_tile(range(97, 129))
    eye = jnp.eye(512, dtype=jnp.bfloat16)
    w = gpu.gmm_mxfp4(eye, [(codes[None], scales[None])], jnp.array([512], jnp.int32), out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(w).T, np.asarray(unpack_mxfp4(codes, scales, jnp.float32)))
    got = gpu.gmm_mxfp4(x, [w1, w3], gs, epilogue=ref.situ_epilogue(4.0, 25.0, jnp.bfloat16))
    want = ref.situ_glu(want, _ref_mx(x.astype(jnp.float32), *w3, gs))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=3e-2, atol=3e-2)
