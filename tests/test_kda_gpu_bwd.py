"""KDA GPU backward kernels (:mod:`pallas_kernels.kda.gpu_bwd`) vs the pure-JAX reference VJP: in the generic
Pallas interpreter on CPU, through ``pallas_kernels.kda.chunk_kda`` (custom VJP wiring), and on a real GPU
(``gpu`` mark). Lowering to Triton for sm_90: tests/test_triton_lowering.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import kda
from pallas_kernels.kda import gpu_bwd
from pallas_kernels.kda import reference as ref
from tests.test_kda_kernels import make_inputs, rel, segments
from tests.test_kda_tpu_bwd import NAMES, cotangents, ref_vjp


def kernel_vjp(q, k, v, g, beta, h0, seg, do, dht, interpret=True, **kw):
    K = q.shape[-1]
    fn = jax.jit(lambda *a: gpu_bwd.chunk_kda_bwd(*a[:5], K**-0.5, a[5], a[6], a[7], a[8], interpret=interpret,
                                                  **kw))
    return fn(q, k, v, g, beta, h0, seg, do, dht)


def check(got, want, inputs, tol):
    for name, a, b, x in zip(NAMES, got, want, inputs, strict=True):
        assert a.shape == x.shape and a.dtype == x.dtype, (name, a.shape, a.dtype)
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert rel(a, b) < tol, (name, rel(a, b))


# (B, T, H, K, V, cuts, kwargs): T not a multiple of 64, several packed documents (mid-chunk and at a chunk
# boundary); K=V=128 with the default blocks (two K blocks of 64 in the per-chunk kernels, two V slices in
# the sweeps) and K=V=64 with B=2, H=2 (per-(sequence, head) indexing of the [B, T, H, D] tiles) and 32-wide
# K / V blocks. Grid steps: ~35 and ~140.
CASES = [
    (1, 150, 1, 128, 128, (40, 64, 110), {}),
    (2, 100, 2, 64, 64, (17, 70), {"block_k": 32, "block_v": 32}),
]


@pytest.mark.parametrize("case", CASES, ids=["K128", "K64-B2-H2-blocks32"])
def test_gpu_bwd_interpret_fp32(case):
    """fp32: measured rel. errors ~1e-7..1e-6 (bound 1e-3)."""
    B, T, H, K, V, cuts, kw = case
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V)
    seg = segments(B, T, cuts)
    do, dht = cotangents(v, h0, jnp.float32)
    got = kernel_vjp(q, k, v, g, beta, h0, seg, do, dht, **kw)
    check(got, ref_vjp(q, k, v, g, beta, h0, seg, do, dht), (q, k, v, g, beta, h0), 1e-3)


@pytest.mark.parametrize("case", ["K128-segments", "K64-strong-decay"])
def test_gpu_bwd_interpret_bf16(case):
    """bf16 inputs (bf16 operands for A, W/U, the sweeps and the state products; fp32 inverse / dL chain; TF32
    decay-product gradients, emulated; h, dh, dV~ stored in bf16): documented tolerance 2e-2 vs the fp32 VJP on
    the same inputs. Measured K128-segments 1.5e-3 .. 4.0e-3; K64-strong-decay (gate of N(0, 1)
    pre-activations, mean g ~ -2.5, no initial state - the benchmark's inputs) 2.8e-3 .. 8.2e-3 (dg), where
    bf16 decay-product operands gave 5.6e-2 (dG = x dx - y dy cancels)."""
    if case == "K128-segments":
        B, T, H, K, V, cuts, _ = CASES[0]
        q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, jnp.bfloat16)
        seg = segments(B, T, cuts)
    else:
        B, T, H, K, V = 1, 128, 1, 64, 64
        q, k, v, _, beta, h0 = make_inputs(B, T, H, K, V, jnp.bfloat16)
        g = ref.kda_gate(jax.random.normal(jax.random.PRNGKey(3), (B, T, H, K)), jnp.zeros((H,)))
        h0, seg = jnp.zeros_like(h0), None
    do, dht = cotangents(v, h0, jnp.bfloat16)
    got = kernel_vjp(q, k, v, g, beta, h0, seg, do, dht)
    check(got, ref_vjp(q, k, v, g, beta, h0, seg, do, dht), (q, k, v, g, beta, h0), 2e-2)


def test_gpu_bwd_interpret_extreme_gate_chunk32():
    """Strongest allowed decay on half the channels (g -> -5), ~0 on the rest, chunk 32, no segments, no
    final-state cotangent: column-tile exponents reach ~75; gradients stay finite and exact."""
    B, T, H, K, V = 1, 96, 1, 64, 64
    q, k, v, _, beta, h0 = make_inputs(B, T, H, K, V, seed=5)
    g = jnp.where(jnp.arange(K) % 2 == 0, -4.999, -1e-4) * jnp.ones((B, T, H, K))
    do, _ = cotangents(v, h0, jnp.float32, seed=1)
    got = jax.jit(lambda q, k, v, g, beta, h0, do: gpu_bwd.chunk_kda_bwd(
        q, k, v, g, beta, K**-0.5, h0, None, do, chunk_size=32, interpret=True))(q, k, v, g, beta, h0, do)
    check(got, ref_vjp(q, k, v, g, beta, h0, None, do, jnp.zeros_like(h0)), (q, k, v, g, beta, h0), 1e-3)


# Static variants of steps 7 and 8 besides the defaults (triangular step 8, split one-pass-TF32 step 7: the H200
# sweep's fastest, benchmarks/kda_bwd.py). K=V=32 keeps the interpreter cheap while the chunk still has 4 row
# tiles; one call per case (each interpreted backward costs ~6 s to compile): the fp32 case covers the unsplit
# step-7 kernel and the whole-chunk step 8, the bf16 case the looped step 8 with the split step 7.
VARIANT_CASES = [
    ("fp32", {"da_mode": "full", "da_block_k": None, "wy_split": False}),
    ("bf16", {"da_mode": "loop", "da_block_k": 16, "wy_split": True, "wy_precision": "tf32"}),
]


@pytest.mark.parametrize("case", VARIANT_CASES, ids=["fp32-full-unsplit", "bf16-loop-bk16-split-tf32"])
def test_gpu_bwd_interpret_variants(case):
    """fp32: within 1e-3 of the reference VJP (fp32 inputs keep 3xTF32 in step 7 whatever ``wy_precision``
    says), two documents, 16-wide blocks. bf16 with the benchmark's strong-decay gate (where bf16 decay-product
    operands gave dg 5.6e-2): within the documented 2e-2, measured 1.4e-3 .. 5.6e-3 (dg), as the default code
    path on the same inputs."""
    dtype, variant = case
    B, H, K, V = 1, 1, 32, 32
    if dtype == "fp32":
        T = 100
        q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V)
        seg, tol, kw = segments(B, T, (17, 70)), 1e-3, {"block_k": 16, "block_v": 16}
        do, dht = cotangents(v, h0, jnp.float32)
    else:
        T = 128
        q, k, v, _, beta, h0 = make_inputs(B, T, H, K, V, jnp.bfloat16)
        g = ref.kda_gate(jax.random.normal(jax.random.PRNGKey(3), (B, T, H, K)), jnp.zeros((H,)))
        h0, seg, tol, kw = jnp.zeros_like(h0), None, 2e-2, {}
        do, dht = cotangents(v, h0, jnp.bfloat16)
    got = kernel_vjp(q, k, v, g, beta, h0, seg, do, dht, **kw, **variant)
    check(got, ref_vjp(q, k, v, g, beta, h0, seg, do, dht), (q, k, v, g, beta, h0), tol)


def test_gpu_bwd_variant_args_checked():
    q, k, v, g, beta, h0 = make_inputs(1, 32, 1, 32, 32)
    for bad in ({"da_mode": "rows"}, {"wy_precision": "bf16"}, {"da_block_k": 24}):
        with pytest.raises(ValueError, match="da_mode|wy_precision|da_block_k"):
            gpu_bwd.chunk_kda_bwd(q, k, v, g, beta, 0.2, h0, None, v, None, interpret=True, **bad)
    with pytest.raises(ValueError, match="num_warps keys"):
        gpu_bwd.chunk_kda_bwd(q, k, v, g, beta, 0.2, h0, None, v, None, interpret=True, num_warps={"wy": 8})


def test_chunk_kda_pallas_gpu_grad_uses_kernels():
    """``chunk_kda(implementation="pallas_gpu")``: ``backward="auto"`` runs the GPU backward kernels (seen in
    the jaxpr) and its gradients match the reference implementation's; ``backward="reference"`` keeps the
    forward kernels but not the backward ones."""
    B, T, H, K, V = 1, 80, 1, 64, 64
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, seed=3)
    seg = segments(B, T, (30,))

    def loss(impl, bwd):
        def f(q, k, v, g, beta, h0):
            o, ht = kda.chunk_kda(q, k, v, g, beta, None, h0, True, seg, implementation=impl, interpret=True,
                                  backward=bwd)
            return jnp.sum(o * o) + jnp.sum(ht * ht)

        return jax.grad(f, argnums=tuple(range(6)))

    jaxpr = str(jax.make_jaxpr(loss("pallas_gpu", "auto"))(q, k, v, g, beta, h0))
    assert all(n in jaxpr for n in gpu_bwd.launched_kernels())
    jaxpr_ref_vjp = str(jax.make_jaxpr(loss("pallas_gpu", "reference"))(q, k, v, g, beta, h0))
    assert "kda_chunk_state_gpu" in jaxpr_ref_vjp and not any(
        n in jaxpr_ref_vjp for n in gpu_bwd.KERNEL_NAMES + gpu_bwd.SPLIT_WY_NAMES)
    got = jax.jit(loss("pallas_gpu", "auto"))(q, k, v, g, beta, h0)
    want = jax.jit(loss("reference", "auto"))(q, k, v, g, beta, h0)
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert rel(a, b) < 1e-3, (name, rel(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [(2, 300, 3, 128, 128, (40, 128, 201)), (1, 200, 2, 64, 64, (64, 77))],
                         ids=["K128", "K64"])
def test_gpu_bwd_on_gpu(case, dtype):
    """Real GPU: fp32 (3xTF32 inverse chain) within 1e-3 of the fp32 reference VJP, bf16 within 2e-2; also with
    non-default launch knobs and (K=128) the step-7/8 variants."""
    B, T, H, K, V, cuts = case
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, dtype)
    seg = segments(B, T, cuts)
    do, dht = cotangents(v, h0, dtype)
    want = ref_vjp(q, k, v, g, beta, h0, seg, do, dht)
    tol = 1e-3 if dtype == jnp.float32 else 2e-2
    check(kernel_vjp(q, k, v, g, beta, h0, seg, do, dht, interpret=False), want, (q, k, v, g, beta, h0), tol)
    knobs = {"block_k": 32, "block_v": 32, "num_warps": {n: 8 for n in gpu_bwd.KERNEL_NAMES}}
    check(kernel_vjp(q, k, v, g, beta, h0, seg, do, dht, interpret=False, **knobs), want,
          (q, k, v, g, beta, h0), tol)
    if K == 128:  # the other step-7/8 variants: the looped step 8, and the unsplit whole-chunk 3xTF32 path
        for knobs in ({"da_mode": "loop"}, {"da_mode": "full", "da_block_k": None, "wy_split": False,
                                            "wy_precision": "x3", "num_warps": {"kda_bwd_dqkw_gpu": 4}}):
            check(kernel_vjp(q, k, v, g, beta, h0, seg, do, dht, interpret=False, **knobs), want,
                  (q, k, v, g, beta, h0), tol)
