"""MoE grouped matmul on Pallas Mosaic GPU: the per-platform selection (CPU), the kernels' lowering for sm_90
from a CPU host (JAX's ragged-dot kernels have no interpret mode), and numerics/gradients against the reference on a
GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import registry
from pallas_kernels.moe import mosaic_gpu, ops
from pallas_kernels.moe import reference as ref
from pallas_kernels.registry import KernelUnavailable
from tests._gpu import skip_unless_hopper

K3 = (65536, 3584, 3072)  # rows, L, I of the K3 expert FFN


def _call(platform="gpu", cc=9.0, dtype="bfloat16", shape=K3, mxfp4=False, interpret=False):
    return ops.MoeCall(platform, dtype, shape, 64, mxfp4, interpret, cc)


@pytest.mark.parametrize("call, want", [
    (_call(), "triton"),  # faster on the H200 than the Mosaic GPU grouped matmul: first while JAX ships it
    (_call(cc=8.0), "triton"),
    (_call(mxfp4=True), "triton"),
    (_call(platform="cpu"), "xla"),
])
def test_auto_order_with_triton_shipped(call, want):
    assert ops.EXPERT_FFN.select("auto", call, record=False).backend == want


@pytest.mark.parametrize("call, want, why", [
    (_call(), "mosaic_gpu", None),
    (_call(shape=(64, 128, 256)), "mosaic_gpu", None),
    (_call(cc=8.0), "xla", "compute capability >= 9.0"),  # A100 / L4 / T4 class
    (_call(cc=None), "xla", "unknown"),
    (_call(mxfp4=True), "mosaic_gpu", None),  # pallas_kernels.moe.mosaic_gpu_mxfp4
    (_call(mxfp4=True, dtype="float32"), "xla", "bfloat16 activations with MXFP4"),
    (_call(mxfp4=True, cc=8.0), "xla", "compute capability >= 9.0"),
    (_call(dtype="float32"), "xla", "bfloat16"),
    (_call(shape=(64, 128, 64)), "xla", "multiples of 128"),
])
def test_auto_order_once_jax_drops_triton(monkeypatch, call, want, why):
    """Without the Pallas Triton backend: mosaic_gpu on sm_90+ for what it takes, else the XLA reference, each
    passed-over backend with its reason."""
    monkeypatch.setattr(registry, "TRITON_SHIPPED", False)
    sel = ops.EXPERT_FFN.select("auto", call, record=False)
    assert sel.backend == want
    passed = dict(sel.passed_over)
    assert "no longer ships" in passed["triton"]
    if why is not None:
        assert why in passed["mosaic_gpu"]


def test_explicit_mosaic_gpu_runs_where_it_fits():
    assert ops.EXPERT_FFN.select("mosaic_gpu", _call(), record=False).backend == "mosaic_gpu"


def test_explicit_mosaic_gpu_that_cannot_run_raises_with_the_reason():
    with pytest.raises(KernelUnavailable, match="compute capability >= 9.0"):
        ops.EXPERT_FFN.select("mosaic_gpu", _call(cc=8.6), record=False)
    with pytest.raises(KernelUnavailable, match="no interpret mode"):
        ops.EXPERT_FFN.select("mosaic_gpu", _call(platform="cpu", interpret=True), record=False)
    with pytest.raises(KernelUnavailable, match="the Mosaic GPU interpreter"):
        ops.EXPERT_FFN.select("mosaic_gpu", _call(platform="cpu", mxfp4=True), record=False)


def test_explicit_mosaic_gpu_runs_mxfp4_in_its_interpreter_on_cpu():
    """The MXFP4 kernel has an interpret mode (the bf16 ragged-dot kernels do not); ``auto`` still picks
    ``mosaic_tpu`` for interpret on CPU."""
    call = _call(platform="cpu", mxfp4=True, interpret=True, cc=None)
    assert ops.EXPERT_FFN.select("mosaic_gpu", call, record=False).backend == "mosaic_gpu"
    assert ops.EXPERT_FFN.select("auto", call, record=False).backend == "mosaic_tpu"


def _lowered_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_forward_and_dlhs_lower_to_mosaic_gpu_wgmma_on_a_cpu_host():
    """The forward and the ``dout x rhs^T`` product lower (for CUDA, on this CPU host) to one Mosaic GPU custom
    call each, with wgmma in the kernel. (``drhs`` reads the SM count off a GPU device: GPU test below.)"""
    m, k, n, e = 256, 256, 384, 4
    s = jax.ShapeDtypeStruct
    x, w, gs = s((m, k), jnp.bfloat16), s((e, k, n), jnp.bfloat16), s((e,), jnp.int32)
    dy = s((m, n), jnp.bfloat16)
    for fn, args in ((lambda x, w, g: mosaic_gpu.gmm(x, w, g), (x, w, gs)),
                     (lambda d, w, g: mosaic_gpu._fwd_product(d, w, g, True), (dy, w, gs))):
        text = _lowered_text(fn, *args)
        assert text.count("custom_call @mosaic_gpu") == 1
        assert "wgmma.mma_async" in text


def test_gmm_rejects_shapes_outside_its_contract():
    x = jnp.zeros((8, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiples of 128"):
        mosaic_gpu.gmm(x, jnp.zeros((2, 64, 128), jnp.bfloat16), jnp.array([4, 4], jnp.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [[100, 0, 250, 30], [0, 0, 512, 0], [64, 64, 64, 64]])
def test_gpu_gmm_forward_and_grads_match_reference(sizes):
    """Empty groups, one group taking every row, trailing rows past sum(group_sizes) (the first case)."""
    m, k, n = 512, 256, 384
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (4, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(ks[2], (m, n), jnp.bfloat16)
    gs = jnp.array(sizes, jnp.int32)

    def f32_ref(x, w):
        return ref.grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), gs)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)

    with jax.default_matmul_precision("highest"):
        out, vjp = jax.vjp(lambda a, b: mosaic_gpu.gmm(a, b, gs), x, w)
        want, vjp_ref = jax.vjp(f32_ref, x, w)
        (dx, dw), (dx_ref, dw_ref) = vjp(dy), vjp_ref(dy.astype(jnp.float32))
    assert rel(out, want) < 1e-2 and rel(dx, dx_ref) < 1e-2 and rel(dw, dw_ref) < 1e-2
    assert np.all(np.asarray(out[sum(sizes):]) == 0) and np.all(np.asarray(dx[sum(sizes):]) == 0)
    for g, size in enumerate(sizes):
        if size == 0:
            assert np.all(np.asarray(dw[g]) == 0)


@pytest.mark.gpu
def test_gpu_expert_ffn_mosaic_gpu_on_hopper():
    skip_unless_hopper()
    m, lat, inter, e = 512, 256, 128, 4
    ks = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(ks[0], (m, lat), jnp.bfloat16)
    w1, w3 = ((jax.random.normal(k, (e, lat, inter)) / np.sqrt(lat)).astype(jnp.bfloat16) for k in ks[1:3])
    w2 = (jax.random.normal(ks[3], (e, inter, lat)) / np.sqrt(inter)).astype(jnp.bfloat16)
    gs = jnp.array([200, 100, 0, 212], jnp.int32)
    dy = jax.random.normal(ks[0], (m, lat), jnp.bfloat16)
    assert ops.select("mosaic_gpu", x, w1) == "mosaic_gpu"
    ffn = lambda impl: lambda *a: ops.expert_ffn(a[0], gs, *a[1:], implementation=impl)
    # the fused w1/w3 + SiTU-GLU kernel forward; its backward recomputes gate and up with the grouped matmul
    got, vjp = jax.vjp(ffn("mosaic_gpu"), x, w1, w3, w2)
    want, vjp_ref = jax.vjp(ffn("xla"), x, w1, w3, w2)

    def rel(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    assert rel(got, want) < 2e-2
    for name, g, g_ref in zip(("x", "w1", "w3", "w2"), vjp(dy), vjp_ref(dy), strict=True):
        assert rel(g, g_ref) < 3e-2, name
