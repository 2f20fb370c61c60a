"""KDA Pallas (Triton) kernels on a real GPU vs the pure-JAX reference. Skipped without a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import kda
from pallas_kernels.kda import gpu
from pallas_kernels.kda import reference as ref
from tests.test_kda_kernels import make_inputs, ref_recurrent, rel, segments

pytestmark = pytest.mark.gpu  # skipped unless the default backend is a GPU (tests/conftest.py)

CASES = [(2, 300, 3, 128, 128, (40, 128, 201)), (1, 200, 2, 64, 64, (64, 77))]


@pytest.mark.parametrize("case", CASES, ids=["K128", "K64"])
def test_gpu_chunk_fwd_fp32(case):
    B, T, H, K, V, cuts = case
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V)
    seg = segments(B, T, cuts)
    ro, rh = ref_recurrent(q, k, v, g, beta, h0, seg)
    o, ht = gpu.chunk_kda_fwd(q, k, v, g, beta, K**-0.5, h0, seg, block_v=32 if K == 64 else 64)
    assert rel(o, ro) < 1e-4 and rel(ht, rh) < 1e-4


@pytest.mark.parametrize("knobs", [
    {"a_num_warps": 8, "solve_num_warps": 1, "wu_num_warps": 8, "block_k": 32, "num_warps": 8,
     "decay_cumsum": "fused"},
    {"a_num_warps": 2, "solve_num_warps": 2, "wu_num_warps": 2, "block_v": 32, "decay_cumsum": "xla"},
], ids=["wide-fused-cumsum", "narrow-xla-cumsum"])
def test_gpu_chunk_fwd_knobs(knobs):
    """The per-kernel launch knobs the benchmark sweeps compile on the GPU and leave the result unchanged."""
    B, T, H, K, V, cuts = CASES[0]
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V)
    seg = segments(B, T, cuts)
    ro, rh = ref_recurrent(q, k, v, g, beta, h0, seg)
    o, ht = gpu.chunk_kda_fwd(q, k, v, g, beta, K**-0.5, h0, seg, **knobs)
    assert rel(o, ro) < 1e-4 and rel(ht, rh) < 1e-4


@pytest.mark.parametrize("x_dtype", [None, jnp.float32], ids=["x-bf16", "x-fp32"])
def test_gpu_chunk_fwd_bf16_x_dtype(x_dtype):
    """bf16 inputs with X = (I + N)^-1 stored in bf16 (default) or fp32: both within the bf16 tolerance."""
    B, T, H, K, V, cuts = CASES[0]
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, jnp.bfloat16)
    seg = segments(B, T, cuts)
    o, ht = gpu.chunk_kda_fwd(q, k, v, g, beta, K**-0.5, h0, seg, x_dtype=x_dtype)
    ro, rh = ref_recurrent(q, k, v, g, beta, h0, seg)
    assert o.dtype == jnp.bfloat16 and rel(o, ro) < 2e-2 and rel(ht, rh) < 2e-2


def test_gpu_chunk_fwd_bf16():
    B, T, H, K, V, cuts = CASES[0]
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, jnp.bfloat16)
    seg = segments(B, T, cuts)
    o, ht = kda.chunk_kda(q, k, v, g, beta, None, h0, True, seg, implementation="pallas_gpu")
    ro, rh = ref_recurrent(q, k, v, g, beta, h0, seg)
    assert o.dtype == jnp.bfloat16 and rel(o, ro) < 2e-2 and rel(ht, rh) < 2e-2


def test_gpu_chunk_grads():
    B, T, H, K, V = 1, 150, 2, 128, 128
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, seed=1)
    seg = segments(B, T, (70,))
    w = jax.random.normal(jax.random.PRNGKey(3), (B, T, H, V))

    def loss(fn):
        def f(q, k, v, g, beta, h0):
            o, ht = fn(q, k, v, g, beta, None, h0, True, seg)
            return jnp.sum(o * w) + 0.5 * jnp.sum(ht * ht)

        return f

    pal = lambda *a: kda.chunk_kda(*a, implementation="pallas_gpu")
    gp = jax.grad(loss(pal), argnums=range(6))(q, k, v, g, beta, h0)
    gr = jax.grad(loss(ref.recurrent_kda), argnums=range(6))(q, k, v, g, beta, h0)
    for name, a, b in zip("q k v g beta h0".split(), gp, gr, strict=True):
        assert rel(a, b) < 1e-3, name


def test_gpu_decode_pool():
    B, H, K, V, P = 5, 8, 128, 128, 9
    q, k, v, g, beta, _ = make_inputs(B, 1, H, K, V, seed=2)
    pool = jax.random.normal(jax.random.PRNGKey(9), (P, H, K, V))
    slots = jnp.array([8, 0, 3, 5, 1], jnp.int32)
    ro, rh = ref.recurrent_kda(q, k, v, g, beta, None, pool[slots], True)
    o, new_pool = kda.recurrent_kda(q, k, v, g, beta, initial_state=pool, state_slots=slots)
    assert rel(o, ro) < 1e-4 and rel(new_pool[slots], rh) < 1e-4
    rest = jnp.array([2, 4, 6, 7])
    assert jnp.array_equal(new_pool[rest], pool[rest])
