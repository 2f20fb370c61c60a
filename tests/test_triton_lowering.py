"""Every Pallas Triton (GPU) kernel lowers to a Triton module that passes MLIR verification — on CPU.

XLA:GPU rejects an invalid Triton module only when it compiles it on a GPU ("Failed to parse Triton module",
seen on the H200 for an ``scf.for`` whose bounds had mixed types). Here each kernel is lowered for the
``cuda`` platform on this CPU host with a Hopper (sm_90) target and its module is verified, so such errors
show up in CI. This relies on JAX internals (``jax._src.pallas.triton``): if those move, the test skips and
says so rather than passing silently.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_latent_attention as pla
from pallas_kernels.kda import gpu as kda_gpu
from pallas_kernels.kda import gpu_bwd
from pallas_kernels.moe import gpu as moe_gpu
from pallas_kernels.moe.reference import situ_epilogue

try:
    from jax._src.pallas.triton import pallas_call_registration as registration
except ImportError:  # pragma: no cover - depends on the JAX version
    registration = None

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@pytest.fixture
def verified_modules(monkeypatch):
    """Patch the Triton lowering to verify each module; yields the list of verified kernel names."""
    if registration is None or not hasattr(registration, "gpu_info_lib"):
        pytest.skip("jax._src.pallas.triton internals changed: cannot lower Triton kernels on CPU")
    info_cls = registration.gpu_info_lib.GpuInfo
    names = {f.name for f in dataclasses.fields(info_cls)}
    if not {"gpu_version", "arch_name", "compute_capability"} <= names:
        pytest.skip(f"GpuInfo fields changed ({sorted(names)}): cannot fake a Hopper target")
    monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info",
                        lambda: info_cls(gpu_version=None, arch_name="9.0", compute_capability=90))
    lower = registration.lowering.lower_jaxpr_to_triton_module
    seen: list[str] = []

    def lower_and_verify(jaxpr, *args, **kwargs):
        result = lower(jaxpr, *args, **kwargs)
        result.module.operation.verify()  # raises MLIRError naming the op and source line
        seen.append(str(jaxpr.debug_info.func_name) if jaxpr.debug_info else "?")
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    return seen


def _lower_for_cuda(fn, *args) -> None:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def _mxfp4(e: int, n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    codes = jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8)
    scales = jnp.asarray(rng.integers(120, 130, (e, n, k // 32)), jnp.uint8)
    return codes, scales


def test_moe_kernels_lower(verified_modules):
    e, m, k, n = 4, 96, 256, 384
    x = jnp.ones((m, k), jnp.bfloat16)
    w = jnp.ones((e, k, n), jnp.bfloat16)
    gs = jnp.array([30, 0, 50, 16], jnp.int32)
    _lower_for_cuda(lambda x, w: moe_gpu.gmm(x, w, gs), x, w)
    _lower_for_cuda(jax.grad(lambda x, w: moe_gpu.gmm(x, w, gs).astype(jnp.float32).sum(), (0, 1)), x, w)
    c1, s1 = _mxfp4(e, n, k, 0)
    c3, s3 = _mxfp4(e, n, k, 1)
    for xx in (x, x.astype(jnp.float32)):  # the PTX decode (bf16) and the f32 decode, single weight and fused w1/w3
        _lower_for_cuda(lambda x: moe_gpu.gmm_mxfp4(x, [(c1, s1)], gs), xx)
        _lower_for_cuda(lambda x: moe_gpu.gmm_mxfp4(x, [(c1, s1), (c3, s3)], gs,
                                                    epilogue=situ_epilogue(4.0, 25.0, jnp.bfloat16)), xx)
    _lower_for_cuda(lambda x: moe_gpu.gmm_mxfp4(x, [(c1, s1)], gs, tiles=(16, 256, 128, 8, 3)), x)
    assert len(verified_modules) >= 3 + 2 * 2 + 1, verified_modules


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_kda_kernels_lower(verified_modules, dtype):
    """All chunk-forward kernels (decay scan, A, solve, W/U, state) and the decode step, for bf16 operands and
    for fp32 (3xTF32) operands, K=V=64 and 128 (fp32 at 128: the state kernel with the stages that fit)."""
    b, t, h = 1, 128, 2
    chunk = ["kda_chunk_cumsum_gpu", "kda_chunk_a_gpu", "kda_chunk_solve_gpu", "kda_chunk_wu_gpu",
             "kda_chunk_state_gpu"]
    want = []
    for d in (64, 128):
        q = jnp.ones((b, t, h, d), dtype)
        g = jnp.full((b, t, h, d), -0.1, jnp.float32)
        beta = jnp.full((b, t, h), 0.5, dtype)
        seg = jnp.ones((b, t), jnp.int32)
        _lower_for_cuda(lambda q, g, beta, seg: kda_gpu.chunk_kda_fwd(
            q, q, q, g, beta, q.shape[-1] ** -0.5, segment_ids=seg), q, g, beta, seg)
        want += chunk
    pool = jnp.zeros((3, h, d, d), jnp.float32)
    slots = jnp.array([2], jnp.int32)
    _lower_for_cuda(lambda q1, g1, b1, pool: kda_gpu.decode_step(q1, q1, q1, g1, b1, d ** -0.5, pool, slots),
                    q[:, 0], g[:, 0], beta[:, 0], pool)
    assert verified_modules == want + ["kda_decode_gpu"], verified_modules


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_kda_bwd_kernels_lower(verified_modules, dtype):
    """The ten chunk-backward kernels (pallas_kernels.kda.gpu_bwd), K=V=64 and 128, T not a multiple of the
    chunk, with segment ids; bf16 and fp32 (3xTF32) operands."""
    b, h = 1, 2
    for t, d in ((128, 64), (200, 128)):
        q = jnp.ones((b, t, h, d), dtype)
        g = jnp.full((b, t, h, d), -0.1, jnp.float32)
        beta = jnp.full((b, t, h), 0.5, dtype)
        seg = jnp.ones((b, t), jnp.int32)
        h0 = jnp.zeros((b, h, d, d), jnp.float32)
        _lower_for_cuda(lambda q, g, beta, seg, h0: gpu_bwd.chunk_kda_bwd(
            q, q, q, g, beta, q.shape[-1] ** -0.5, h0, seg, q, h0), q, g, beta, seg, h0)
    assert verified_modules == list(gpu_bwd.KERNEL_NAMES) * 2, verified_modules


def test_paged_decode_kernel_lowers(verified_modules):
    """The paged MLA decode kernel (pallas_kernels.paged_latent_attention) at K3's widths (96 heads, C 512, Dr 64,
    16-token pages: several pages gathered per step), bf16, a stacked pool read at a traced layer, T = 1 and 2."""
    b, h, c, dr, s, max_pages = 3, 96, 512, 64, 16, 9
    pages = jnp.ones((2, 20, s, c + dr), jnp.bfloat16)
    table = jnp.ones((b, max_pages), jnp.int32)
    pos = jnp.array([0, 40, 100], jnp.int32)
    for t in (1, 2):
        q_lat = jnp.ones((b, t, h, c), jnp.bfloat16)
        q_rot = jnp.ones((b, t, h, dr), jnp.bfloat16)
        _lower_for_cuda(lambda q_lat, q_rot, pages, table, pos, layer: pla.paged_attention_triton(
            q_lat, q_rot, pages, None, table, pos, 0.07, layer), q_lat, q_rot, pages, table, pos, jnp.int32(1))
    assert verified_modules == ["mla_paged_decode_gpu"] * 2, verified_modules
