"""The GPU (Pallas Triton) chunked KDA forward — A, solve, W/U and state kernels — in the generic Pallas
interpreter on CPU, vs the recurrent reference. (Lowering to Triton for sm_90: tests/test_triton_lowering.py;
on a real GPU: tests/test_kda_kernels_gpu.py.)"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallas_kernels.kda import gpu
from tests.test_kda_kernels import make_inputs, ref_recurrent, rel

# (B, T, H, K, V, cuts per batch row, kwargs): T not a multiple of 64, documents starting mid-chunk and at a
# chunk boundary, K=V=128 (two K slices in the A kernel) and K=V=64 with B=2, H=2 and different documents per
# row (the kernels index [B, T, H, D] inputs per (sequence, head) program; one K slice, 32-wide W/U column
# blocks, BV=32, decay cumsum by XLA instead of the scan kernel).
CASES = [
    (1, 300, 1, 128, 128, [(40, 128, 201)], {}),
    (2, 200, 2, 64, 64, [(64, 77), (5, 150)], {"block_k": 32, "block_v": 32, "decay_cumsum": "xla"}),
]


def segments_per_row(T, cuts_per_row):
    """[B, T] int32 ids with document starts at ``cuts_per_row[b]`` in row b."""
    t = jnp.arange(T)
    return jnp.stack([sum((t >= c).astype(jnp.int32) for c in cuts) for cuts in cuts_per_row])


@pytest.mark.parametrize("case", CASES, ids=["K128", "K64-B2-H2"])
def test_gpu_chunk_fwd_interpret_fp32(case):
    B, T, H, K, V, cuts, kw = case
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V)
    seg = segments_per_row(T, cuts)
    o, ht = gpu.chunk_kda_fwd(q, k, v, g, beta, K**-0.5, h0, seg, interpret=True, **kw)
    ro, rh = ref_recurrent(q, k, v, g, beta, h0, seg)
    assert o.shape == ro.shape and o.dtype == ro.dtype and ht.shape == (B, H, K, V)
    assert rel(o, ro) < 1e-4 and rel(ht, rh) < 1e-4


def test_gpu_chunk_fwd_interpret_bf16():
    """bf16 inputs: bf16 matmul operands (fp32 accumulation) and X = (I + N)^-1 stored in bf16; documented
    tolerance 2e-2 relative vs the fp32 reference on the same inputs (measured 4.3e-3 / 2.3e-3 here; an fp32
    X gives 4.0e-3 / 1.7e-3)."""
    B, T, H, K, V, cuts, _ = CASES[0]
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, jnp.bfloat16)
    seg = segments_per_row(T, cuts)
    o, ht = gpu.chunk_kda_fwd(q, k, v, g, beta, K**-0.5, h0, seg, interpret=True)
    ro, rh = ref_recurrent(q, k, v, g, beta, h0, seg)
    assert o.dtype == jnp.bfloat16 and ht.dtype == jnp.float32
    assert rel(o, ro) < 2e-2 and rel(ht, rh) < 2e-2


def test_gpu_chunk_fwd_interpret_extreme_gate():
    """Strongest allowed decay on half the channels (g -> -5), ~0 on the rest, chunk 32: in-tile exponents
    reach ~80 (the limit of the factored products) and nothing from the masked later columns (exponents up
    to ~160, clamped) may leak into kept entries; no segments, T a multiple of the chunk; decay cumsum fused
    into the A and W/U kernels."""
    B, T, H, K, V = 1, 64, 1, 64, 64
    q, k, v, _, beta, h0 = make_inputs(B, T, H, K, V, seed=5)
    g = jnp.where(jnp.arange(K) % 2 == 0, -4.999, -1e-4) * jnp.ones((B, T, H, K))
    o, ht = gpu.chunk_kda_fwd(q, k, v, g, beta, K**-0.5, h0, None, 32, interpret=True, decay_cumsum="fused")
    ro, rh = ref_recurrent(q, k, v, g, beta, h0, None)
    assert bool(jnp.all(jnp.isfinite(o))) and rel(o, ro) < 1e-4 and rel(ht, rh) < 1e-4
