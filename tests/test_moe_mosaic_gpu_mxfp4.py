"""MXFP4 grouped matmul on Pallas Mosaic GPU (:mod:`pallas_kernels.moe.mosaic_gpu_mxfp4`): the Mosaic GPU interpreter
against the dequantised f32 reference on CPU, the kernel's lowering for sm_90 from a CPU host at K3's shapes (also
under the H200's jax 0.11.2 where that environment exists), the compiled decode's bit placement, and the compiled
kernel against the reference on an sm_90 GPU."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.moe import gpu, ops
from pallas_kernels.moe import mosaic_gpu_mxfp4 as mx
from pallas_kernels.moe import reference as ref
from pallas_kernels.mxfp4 import E2M1_LUT, unpack_mxfp4
from tests._gpu import skip_unless_hopper
from tests._mosaic_gpu_lowering import (
    CUDA_AOT_PYTHON,
    JAX_0112_PYTHON,
    cuda_aot_missing_reason,
    lower_for_sm90,
    run_under_jax_0112,
)

GLU = ref.situ_epilogue(4.0, 25.0, jnp.bfloat16)


def _weight(key, e: int, n: int, k: int, scales=(110, 135), lead=()) -> tuple[jax.Array, jax.Array]:
    a, b = jax.random.split(key)
    codes = jax.random.randint(a, (*lead, e, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    s = jax.random.randint(b, (*lead, e, n, k // 32), scales[0], scales[1] + 1, jnp.int32).astype(jnp.uint8)
    return codes, s


def _dense(w) -> jax.Array:
    """``[E, K, N]`` f32 (exact dequantisation)."""
    return jnp.swapaxes(unpack_mxfp4(w[0], w[1], jnp.float32), -1, -2)


def _product(x, w, gs) -> np.ndarray:
    return np.asarray(ref.grouped_matmul(x.astype(jnp.float32), _dense(w), gs, preferred_element_type=jnp.float32,
                                         platform="cpu"))


def _glu_reference(x, w1, w3, gs) -> np.ndarray:
    return np.asarray(GLU(jnp.asarray(_product(x, w1, gs)), jnp.asarray(_product(x, w3, gs))))


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _x(key, m: int, k: int) -> jax.Array:
    return jax.random.normal(key, (m, k), jnp.bfloat16)


def test_interpreter_single_weight_matches_reference():
    """An empty expert, trailing rows past sum(group_sizes), scales over the interpreter's exact range (2..240):
    bf16 outputs within rounding of the f32 reference, trailing rows exactly zero."""
    m, k, n, e = 24, 512, 64, 3
    ks = jax.random.split(jax.random.key(0), 2)
    x, w = _x(ks[0], m, k), _weight(ks[1], e, n, k, scales=(2, 240))
    gs = jnp.array([5, 0, 11], jnp.int32)
    got = np.asarray(mx.gmm_mxfp4(x, [w], gs, out_dtype=jnp.float32, interpret=True, tiles=(8, 1)))
    want = _product(x, w, gs)
    assert np.all(got[16:] == 0)
    finite = np.isfinite(want) & (np.abs(want) > 0)
    rel = np.abs(got - want)[finite] / np.abs(want)[finite]
    assert np.quantile(rel, 0.999) < 8e-3, np.quantile(rel, 0.999)  # bf16 rounding (2^-8) of the output


def test_interpreter_fused_glu_over_tiles_and_steps_matches_reference():
    """w1/w3 + SiTU-GLU epilogue; an expert whose rows span two row tiles; two K steps through one slot."""
    m, k, n, e = 32, 1024, 64, 3
    ks = jax.random.split(jax.random.key(1), 3)
    x, w1, w3 = _x(ks[0], m, k), _weight(ks[1], e, n, k), _weight(ks[2], e, n, k)
    gs = jnp.array([20, 3, 0], jnp.int32)
    got = mx.gmm_mxfp4(x, [w1, w3], gs, epilogue=GLU, interpret=True, tiles=(16, 1))
    want = _glu_reference(x, w1, w3, gs)
    assert got.dtype == jnp.bfloat16 and _rel(got, want) < 1e-2
    assert np.all(np.asarray(got[23:]) == 0)


def test_interpreter_stacked_layer_reads_that_layer():
    m, k, n, e = 16, 512, 64, 2
    ks = jax.random.split(jax.random.key(2), 2)
    x = _x(ks[0], m, k)
    codes, scales = _weight(ks[1], e, n, k, lead=(3,))
    gs = jnp.array([9, 7], jnp.int32)
    got = mx.gmm_mxfp4(x, [(codes, scales)], gs, out_dtype=jnp.float32, interpret=True, layer=jnp.int32(1),
                       tiles=(8, 2))
    want = _product(x, (codes[1], scales[1]), gs)
    assert _rel(got, want) < 1e-2
    assert _rel(got, _product(x, (codes[0], scales[0]), gs)) > 0.1


def test_ops_grouped_matmul_runs_mxfp4_on_mosaic_gpu_interpreter():
    """``ops.grouped_matmul`` with an MXFP4 weight dict on explicit ``mosaic_gpu`` (interpret, CPU) takes this
    kernel (the registry's MXFP4 path), not a dequantised bf16 product."""
    m, k, n, e = 16, 512, 64, 2
    ks = jax.random.split(jax.random.key(3), 2)
    x = _x(ks[0], m, k)
    codes, scales = _weight(ks[1], e, n, k)
    w = {"weight_packed": codes, "weight_scale": scales}
    gs = jnp.array([6, 10], jnp.int32)
    assert ops.select("mosaic_gpu", x, w, interpret=True, platform="cpu") == "mosaic_gpu"
    fn = lambda x, w, gs: ops.grouped_matmul(x, w, gs, preferred_element_type=jnp.float32,
                                             implementation="mosaic_gpu", interpret=True, platform="cpu")
    assert "mxfp4_gmm_mosaic_gpu" in str(jax.make_jaxpr(fn)(x, w, gs))
    assert _rel(fn(x, w, gs), _product(x, (codes, scales), gs)) < 1e-2


def test_ops_stacked_expert_ffn_reads_the_layer_in_place_on_mosaic_gpu():
    """``ops.expert_ffn(layer=)`` over stacked MXFP4 experts on ``mosaic_gpu``: the fused w1/w3 kernel and the w2
    kernel take the whole stacks (no per-layer slice of a weight in the program)."""
    m, lat, inter, e, n_layers = 8, 512, 512, 2, 3
    s = jax.ShapeDtypeStruct
    mxw = lambda n, k: {"weight_packed": s((n_layers, e, n, k // 2), jnp.uint8),
                        "weight_scale": s((n_layers, e, n, k // 32), jnp.uint8)}
    fn = lambda x, gs, w1, w3, w2, lyr: ops.expert_ffn(x, gs, w1, w3, w2, implementation="mosaic_gpu", interpret=True,
                                                       platform="cpu", layer=lyr)
    jaxpr = str(jax.make_jaxpr(fn)(s((m, lat), jnp.bfloat16), s((e,), jnp.int32), mxw(inter, lat), mxw(inter, lat),
                                   mxw(lat, inter), s((), jnp.int32)))
    assert jaxpr.count("mxfp4_gmm_mosaic_gpu") == 2 and "dynamic_slice" not in jaxpr


def test_compiled_decode_places_every_code_exactly():
    """The compiled decode's bits times its factor (computed here in f64, no subnormal flush) are ``E2M1 *
    2^(s - 127 - XSHIFT)`` and a bf16 for every code of both nibbles and every scale in ``gpu.EXACT_SCALES``."""
    byte = jnp.arange(256, dtype=jnp.uint16)
    lo, hi = (np.asarray(mx.code_bits(byte, high)).view(ml_dtypes.bfloat16).astype(np.float64) for high in (0, 1))
    s = np.arange(gpu.EXACT_SCALES[0], gpu.EXACT_SCALES[1] + 1)
    factor = np.asarray(jax.lax.bitcast_convert_type(gpu.scale_bits_bf16(jnp.asarray(s)).astype(jnp.int16),
                                                     jnp.bfloat16)).astype(np.float64)
    for vals, codes in ((lo, np.arange(256) & 15), (hi, np.arange(256) >> 4)):
        got = vals[:, None] * factor[None, :]
        want = E2M1_LUT[codes].astype(np.float64)[:, None] * np.exp2(s - 127.0 - mx.XSHIFT)[None, :]
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got.astype(ml_dtypes.bfloat16).astype(np.float64), want)


def _run_ptx(ptx: str, regs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Emulate the few PTX instructions of ``mx.DECODE_PTX`` on ``u32`` arrays (``$n`` and named registers)."""
    for line in ptx.replace("{", "").replace("}", "").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        val = [regs[a] if a in regs else np.uint32(int(a, 0)) for a in src]
        if op == "prmt.b32":  # result byte i = byte (selector nibble i & 7) of {src1 (bytes 4..7), src0 (0..3)}
            pool = (val[0].astype(np.uint64) | (np.uint64(val[1]) << np.uint64(32)))
            out = np.zeros_like(val[0])
            for i in range(4):
                sel = (int(val[2]) >> (4 * i)) & 0xF
                assert sel < 8, "sign-replicating selectors are not emulated"
                out |= (((pool >> np.uint64(8 * sel)) & np.uint64(0xFF)).astype(np.uint32) << np.uint32(8 * i))
        elif op == "and.b32":
            out = val[0] & val[1]
        elif op == "mul.lo.u32":
            out = (val[0].astype(np.uint64) * np.uint64(val[1]) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        elif op == "mul.rn.bf16x2":
            halves = [np.stack([(v & 0xFFFF), (v >> 16)], -1).astype(np.uint16).view(ml_dtypes.bfloat16)
                      .astype(np.float64) for v in val]
            prod = (halves[0] * halves[1]).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
            out = prod[..., 0] | (prod[..., 1] << 16)
        else:
            raise AssertionError(f"unexpected PTX instruction {op}")
        regs[d] = out
    return regs


def test_compiled_ptx_decode_equals_the_integer_decode():
    """``mx.DECODE_PTX`` (emulated instruction by instruction) gives, for every pair of code bytes and a scale, the
    bf16 values of :func:`mx.code_bits` times the factor for both bytes and both nibbles."""
    pairs = np.arange(1 << 16, dtype=np.uint32)
    for s in (gpu.EXACT_SCALES[0], 127, gpu.EXACT_SCALES[1]):
        f = int(np.asarray(gpu.scale_bits_bf16(jnp.int32(s))))
        regs = _run_ptx(mx.DECODE_PTX, {"$2": pairs, "$3": np.full_like(pairs, f | (f << 16))})
        fac = np.array(f, np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
        for out, high in (("$0", False), ("$1", True)):
            for byte in range(2):
                code = jnp.asarray((pairs >> (8 * byte)) & 0xFF, jnp.uint16)
                want = np.asarray(mx.code_bits(code, high)).view(ml_dtypes.bfloat16).astype(np.float64) * fac
                got = ((regs[out] >> (16 * byte)) & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16)
                np.testing.assert_array_equal(got.astype(np.float64), want)  # exact: no rounding in the product


def test_gmm_mxfp4_rejects_calls_outside_its_contract():
    x = jnp.zeros((8, 512), jnp.bfloat16)
    w = _weight(jax.random.key(4), 2, 64, 512)
    gs = jnp.array([4, 4], jnp.int32)
    with pytest.raises(TypeError, match="bf16"):
        mx.gmm_mxfp4(x.astype(jnp.float32), [w], gs)
    with pytest.raises(ValueError, match="scales"):
        mx.gmm_mxfp4(x, [(w[0], w[1][..., :8])], gs)
    with pytest.raises(ValueError, match="multiple of 512"):
        mx.gmm_mxfp4(jnp.zeros((8, 256), jnp.bfloat16), [_weight(jax.random.key(5), 2, 64, 256)], gs)
    with pytest.raises(ValueError, match="epilogue"):
        mx.gmm_mxfp4(x, [w, w], gs)


K3_FUSED = (512, 3584, 3072, 64)  # rows (64 experts x 8), L, I, experts
K3_W2 = (512, 3072, 3584, 64)


def _lower_k3(m: int, k: int, n: int, e: int, fused: bool) -> tuple[int, bool, int]:
    """``(mosaic_gpu custom calls, wgmma in the kernel, most integer indices of a copy's device-memory slice)``."""
    s = jax.ShapeDtypeStruct
    w = (s((e, n, k // 2), jnp.uint8), s((e, n, k // 32), jnp.uint8))
    x, gs = s((m, k), jnp.bfloat16), s((e,), jnp.int32)
    if fused:
        text, ints = lower_for_sm90(lambda x, a, b, c, d, g: mx.gmm_mxfp4(x, [(a, b), (c, d)], g, epilogue=GLU),
                                    x, *w, *w, gs)
    else:
        text, ints = lower_for_sm90(lambda x, a, b, g: mx.gmm_mxfp4(x, [(a, b)], g, out_dtype=jnp.float32),
                                    x, *w, gs)
    return text.count("custom_call @mosaic_gpu"), "wgmma.mma_async" in text, max(ints)


@pytest.mark.parametrize("shape, fused", [(K3_FUSED, True), (K3_W2, False)], ids=["w1w3_glu", "w2"])
def test_lowers_for_sm90_at_k3_shapes(shape, fused):
    """One Mosaic GPU kernel with wgmma, lowered for CUDA on this CPU host (the kernel is lowered to its Mosaic GPU
    module here, so layout and shape errors show); every copy's device-memory slice is two dynamic slices."""
    assert _lower_k3(*shape, fused) == (1, True, 0)


@pytest.mark.parametrize("tiles", [(8, 3, 0), (32, 2, 1), (16, 2, 2)])
def test_other_tiles_lower_for_sm90(tiles):
    """The JAX-integer-op decode, 32-row tiles and the operands staged in shared memory also lower (the fused kernel
    at K3's widths)."""
    s = jax.ShapeDtypeStruct
    m, k, n, e = 256, 3584, 3072, 8
    w = (s((e, n, k // 2), jnp.uint8), s((e, n, k // 32), jnp.uint8))
    text, _ = lower_for_sm90(lambda x, a, b, c, d, g: mx.gmm_mxfp4(x, [(a, b), (c, d)], g, epilogue=GLU, tiles=tiles),
                             s((m, k), jnp.bfloat16), *w, *w, s((e,), jnp.int32))
    assert text.count("custom_call @mosaic_gpu") == 1 and "wgmma.mma_async" in text


def test_lowers_for_sm90_under_jax_0112():
    """The same lowering under the H200's jax 0.11.2 (no pytest there: the body imports the kernel alone)."""
    if not os.path.exists(JAX_0112_PYTHON):
        pytest.skip(f"no jax 0.11.2 environment at {JAX_0112_PYTHON} (K3_JAX_0112_PYTHON)")
    out = run_under_jax_0112(f"""
        import jax, jax.numpy as jnp
        from pallas_kernels.moe import mosaic_gpu_mxfp4 as mx
        from pallas_kernels.moe import reference as ref
        from tests._mosaic_gpu_lowering import lower_for_sm90
        glu = ref.situ_epilogue(4.0, 25.0, jnp.bfloat16)
        s = jax.ShapeDtypeStruct
        for (m, k, n, e), fused in (({K3_FUSED}, True), ({K3_W2}, False)):
            w = (s((e, n, k // 2), jnp.uint8), s((e, n, k // 32), jnp.uint8))
            x, gs = s((m, k), jnp.bfloat16), s((e,), jnp.int32)
            if fused:
                f = lambda x, a, b, c, d, g: mx.gmm_mxfp4(x, [(a, b), (c, d)], g, epilogue=glu)
                text, _ = lower_for_sm90(f, x, *w, *w, gs)
            else:
                text, _ = lower_for_sm90(lambda x, a, b, g: mx.gmm_mxfp4(x, [(a, b)], g), x, *w, gs)
            assert text.count("custom_call @mosaic_gpu") == 1 and "wgmma.mma_async" in text
    """)
    assert out.returncode == 0 and "ok 0.11.2" in out.stdout, out.stderr[-3000:]


def test_default_tiles_compile_for_sm90a_without_spills_or_serialised_wgmma():
    """The wrapper's tiles for 1, 8 and 16 rows per expert (tm 8, 16, 32; the register-operand decode) and 5 trailing
    rows (the TMA tiles x by 8 rows), fused w1/w3 and w2 at K3's widths, compiled by ``ptxas`` for sm_90a on this
    host: no spills and no C7511 / C7512 advisory
    (wgmma serialised: every decoded operand of a step live at once, see ``mx._mma_registers``)."""
    import json
    import subprocess

    if reason := cuda_aot_missing_reason():
        pytest.skip(reason)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = f"""
import json, sys
sys.path.insert(0, {root!r})
import jax, jax.numpy as jnp
from benchmarks.gpu_aot import captured_output, compile_for_h200, ptxas_reports
from pallas_kernels.moe import mosaic_gpu_mxfp4 as mx
from pallas_kernels.moe import reference as ref
from tests._gpu import skip_unless_hopper
glu = ref.situ_epilogue(4.0, 25.0, jnp.bfloat16)
s, e = jax.ShapeDtypeStruct, 64
for rows in (1, 8, 16):
    for (k, n), fused in (((3584, 3072), True), ((3072, 3584), False)):
        w = (s((e, n, k // 2), jnp.uint8), s((e, n, k // 32), jnp.uint8))
        x, gs = s((e * rows + 5, k), jnp.bfloat16), s((e,), jnp.int32)  # M % 8 != 0: the TMA's row tiling
        if fused:
            fn, args = (lambda x, a, b, c, d, g: mx.gmm_mxfp4(x, [(a, b), (c, d)], g, epilogue=glu)), (x, *w, *w, gs)
        else:
            fn, args = (lambda x, a, b, g: mx.gmm_mxfp4(x, [(a, b)], g)), (x, *w, gs)
        with captured_output() as lines:
            compile_for_h200(fn, *args)
        tiles = mx.mxfp4_tiles(e * rows + 5, e, 2 if fused else 1)
        print(json.dumps({{"rows": rows, "fused": fused, "tiles": tiles, "reports": ptxas_reports(lines)}}))
"""
    out = subprocess.run([CUDA_AOT_PYTHON, "-c", script], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "MOSAIC_GPU_DUMP_PTXAS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    cases = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(cases) == 6, out.stdout[-2000:]
    for case in cases:
        (r,) = [r for r in case["reports"] if "mxfp4" in r["kernel"]]
        assert r["spill_stores"] == r["spill_loads"] == 0, case
        assert not [w for w in r["warnings"] if w.startswith(("C7511", "C7512"))], case


def _decode_probe(codes: jax.Array, scales: jax.Array, mode: int, interpret: bool = False):
    """The kernel's decode of one chunk alone: ``codes u8 [64, CHUNK_BYTES]`` and the chunk's four scale columns
    (``scales u8 [64, 16]``, columns 0..3 used: a TMA row takes 16 bytes) loaded as the kernel loads them
    (the kernel's shared-memory tiling and swizzle, WGMMA layout), decoded by ``mx._decode_chunk`` (``mode`` as
    ``tiles[2]``), and the low- / high-nibble operands written out: ``(lo, hi)`` bf16 ``[64, CHUNK_BYTES]``.
    No wgmma: a wrong result here is the decode or its layouts."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    c = mx.CHUNK_BYTES
    codes_sw = (plgpu.TilingTransform((8, c)), plgpu.SwizzleTransform(c))
    out_sw = (plgpu.TilingTransform((8, c)), plgpu.SwizzleTransform(2 * c))

    def body(codes_ref, scales_ref, lo_ref, hi_ref, scratch, loaded):
        codes_s, scales_s, lo_s, hi_s = scratch
        plgpu.copy_gmem_to_smem(codes_ref, codes_s, loaded)
        plgpu.copy_gmem_to_smem(scales_ref, scales_s, loaded)
        plgpu.barrier_wait(loaded)
        row = plgpu.Layout.WGMMA.reduce(1)
        columns = [plgpu.load(scales_s.at[:, i], layout=row) for i in range(c // mx.GROUP_BYTES)]
        vals = plgpu.load(codes_s, layout=plgpu.Layout.WGMMA)
        lo, hi = mx._decode_chunk(vals, mx._scale_operand(columns, interpret), interpret, mode != mx.A_JAX)
        lo_s[...] = lo
        hi_s[...] = hi
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lo_s, lo_ref)
        plgpu.copy_smem_to_gmem(hi_s, hi_ref)
        plgpu.wait_smem_to_gmem(0)

    out = jax.ShapeDtypeStruct((mx.ROWS, c), jnp.bfloat16)
    scratch = (plgpu.SMEM((mx.ROWS, c), jnp.uint8, transforms=codes_sw), plgpu.SMEM((mx.ROWS, 16), jnp.uint8),
               plgpu.SMEM((mx.ROWS, c), jnp.bfloat16, transforms=out_sw),
               plgpu.SMEM((mx.ROWS, c), jnp.bfloat16, transforms=out_sw))
    call = plgpu.kernel(body, out_type=(out, out), scratch_types=(scratch, plgpu.Barrier(num_arrivals=2)),
                        grid=(1,), grid_names=("g",),
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
                        interpret=mx.interpret_params(interpret))
    return call(codes, scales)


def _probe_inputs(seed: int = 0):
    a, b = jax.random.split(jax.random.key(seed))
    codes = jax.random.randint(a, (mx.ROWS, mx.CHUNK_BYTES), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jax.random.randint(b, (mx.ROWS, 16), 110, 136, jnp.int32).astype(jnp.uint8)
    return codes, scales


def _probe_reference(codes, scales, shift: int) -> tuple[np.ndarray, np.ndarray]:
    """``E2M1 * 2^(s - 127 - shift)`` of the low and the high nibbles, each code byte's scale its group's."""
    c = np.asarray(codes).astype(np.int64)
    s = np.repeat(np.asarray(scales)[:, : mx.CHUNK_BYTES // mx.GROUP_BYTES].astype(np.float64), mx.GROUP_BYTES, 1)
    f = np.exp2(s - 127.0 - shift)
    return E2M1_LUT[c & 15].astype(np.float64) * f, E2M1_LUT[c >> 4].astype(np.float64) * f


def test_interpreter_decode_probe_matches_the_reference():
    """:func:`_decode_probe` in the Mosaic GPU interpreter (its f16 decode, unscaled): the probe the GPU test runs
    compiled reads, decodes and writes the chunk as the reference says."""
    codes, scales = _probe_inputs()
    lo, hi = _decode_probe(codes, scales, mx.A_PTX, interpret=True)
    for got, want in zip((lo, hi), _probe_reference(codes, scales, 0), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float64), want)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, mode", [(1, mx.A_PTX), (8, mx.A_PTX), (32, mx.A_PTX), (8, mx.A_JAX),
                                        (8, mx.A_STAGED), (32, mx.A_STAGED)])
def test_gpu_fused_glu_at_k3_widths_matches_reference(rows, mode):
    """Compiled fused w1/w3 + SiTU-GLU at K3's widths over 16 experts (one empty), trailing rows, in each decode
    mode (the register-operand modes against the staged one: see ``mx.A_STAGED``)."""
    skip_unless_hopper()
    k, n, e = 3584, 3072, 16
    sizes = [rows] * e
    sizes[3] = 0
    m = sum(sizes) + 5
    ks = jax.random.split(jax.random.key(6), 3)
    x, w1, w3 = _x(ks[0], m, k), _weight(ks[1], e, n, k), _weight(ks[2], e, n, k)
    gs = jnp.array(sizes, jnp.int32)
    tiles = (*mx.mxfp4_tiles(m, e, 2)[:2], mode)
    got = jax.jit(lambda *a: mx.gmm_mxfp4(a[0], [a[1:3], a[3:5]], a[5], epilogue=GLU, tiles=tiles))(x, *w1, *w3, gs)
    with jax.default_matmul_precision("highest"):
        want = _glu_reference(x, w1, w3, gs)
    err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    assert err < 1e-2 and np.all(np.asarray(got[sum(sizes):]) == 0), err


@pytest.mark.gpu
def test_gpu_expert_ffn_on_mosaic_gpu_matches_reference():
    """``ops.expert_ffn(implementation="mosaic_gpu")`` over MXFP4 experts at K3's widths (fused w1/w3, then w2)."""
    skip_unless_hopper()
    lat, inter, e = 3584, 3072, 8
    ks = jax.random.split(jax.random.key(8), 4)
    gs = jnp.array([8, 8, 0, 5, 8, 1, 8, 8], jnp.int32)
    x = _x(ks[0], int(gs.sum()) + 3, lat)
    w1, w3 = ({"weight_packed": c, "weight_scale": s} for c, s in (_weight(k, e, inter, lat) for k in ks[1:3]))
    c2, s2 = _weight(ks[3], e, lat, inter, scales=(112, 122))
    w2 = {"weight_packed": c2, "weight_scale": s2}
    got = jax.jit(lambda *a: ops.expert_ffn(*a, implementation="mosaic_gpu"))(x, gs, w1, w3, w2)
    want = ref.expert_ffn(x, gs, w1, w3, w2)
    err = np.linalg.norm(np.asarray(got, np.float64) - np.asarray(want, np.float64)) / np.linalg.norm(
        np.asarray(want, np.float64))
    assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [mx.A_PTX, mx.A_JAX])
def test_gpu_compiled_decode_of_one_chunk_matches_the_reference(mode):
    """The compiled decode alone (no wgmma, :func:`_decode_probe`): every bf16 operand value exact; a failure counts
    the wrong values per nibble and names the first."""
    skip_unless_hopper()
    codes, scales = _probe_inputs(1)
    got = jax.jit(lambda c, s: _decode_probe(c, s, mode))(codes, scales)
    for name, g, want in zip(("lo", "hi"), got, _probe_reference(codes, scales, mx.XSHIFT), strict=True):
        g = np.asarray(g, np.float64)
        bad = np.argwhere(g != want)
        assert not len(bad), (name, len(bad), [(tuple(i), g[tuple(i)], want[tuple(i)]) for i in bad[:4]])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [mx.A_PTX, mx.A_JAX, mx.A_STAGED])
def test_gpu_one_hot_rows_read_back_the_weights(mode):
    """Rows of ``x`` one-hot at scattered columns ``c_i`` (one expert, two pipeline steps): output row ``i`` must be
    the weights' column ``c_i``, exactly. A failure counts the wrong entries and, for the first, says at which
    weight columns of that row the value it got occurs (a misplaced read shows as a consistent offset)."""
    skip_unless_hopper()
    k, n, m = 2 * mx.K_MULTIPLE, 128, 16
    cols = (np.arange(m) * 131 + 5) % k
    x = np.zeros((m, k), np.float32)
    x[np.arange(m), cols] = 1.0
    codes, scales = _weight(jax.random.key(9), 1, n, k)
    got = jax.jit(lambda *a: mx.gmm_mxfp4(a[0], [a[1:3]], a[3], out_dtype=jnp.float32, tiles=(16, 2, mode)))(
        jnp.asarray(x, jnp.bfloat16), codes, scales, jnp.array([m], jnp.int32))
    dense = np.asarray(unpack_mxfp4(codes, scales, jnp.float32), np.float64)[0]  # [N, K]
    want = dense[:, cols].T
    got = np.asarray(got, np.float64)
    bad = np.argwhere(got != want)
    where = [(int(i), int(j), cols[i], got[i, j], np.flatnonzero(dense[j] == got[i, j])[:6].tolist())
             for i, j in bad[:3]]
    assert not len(bad), (f"{len(bad)} of {got.size} wrong; (row, n, column read, got, columns holding it)", where)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [mx.A_PTX, mx.A_JAX, mx.A_STAGED])
def test_gpu_w2_and_stacked_layer_match_reference(mode):
    """w2 at K3's widths over a stacked layer, in each decode mode; a failure names the experts (row groups) whose
    rows are wrong, and by how much."""
    skip_unless_hopper()
    k, n, e = 3072, 3584, 8
    ks = jax.random.split(jax.random.key(7), 2)
    sizes = [8, 0, 3, 16, 1, 8, 8, 20]
    gs = jnp.array(sizes, jnp.int32)
    x = _x(ks[0], int(gs.sum()), k)
    codes, scales = _weight(ks[1], e, n, k, lead=(2,))
    tiles = (*mx.mxfp4_tiles(x.shape[0], e, 1)[:2], mode)
    got = jax.jit(lambda x, c, s, g, l: mx.gmm_mxfp4(x, [(c, s)], g, out_dtype=jnp.float32, layer=l, tiles=tiles))(
        x, codes, scales, gs, jnp.int32(1))
    with jax.default_matmul_precision("highest"):
        want = _product(x, (codes[1], scales[1]), gs)
    got = np.asarray(got, np.float64)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    ends = np.cumsum(sizes)
    per_expert = {g: round(float(np.linalg.norm(got[a:b] - want[a:b]) / max(np.linalg.norm(want[a:b]), 1e-30)), 4)
                  for g, (a, b) in enumerate(zip(ends - sizes, ends, strict=True)) if b > a}
    assert err < 1e-2, (err, tiles, per_expert)
