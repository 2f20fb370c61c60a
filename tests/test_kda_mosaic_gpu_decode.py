"""KDA decode step on Pallas Mosaic GPU: its place in the decode table (CPU), its numerics in the Mosaic GPU
interpreter against the reference, its lowering for sm_90 from this CPU host under this JAX and under jax 0.11.2,
and the Triton decode's outputs on a GPU (``-m gpu``)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import registry
from pallas_kernels.kda import mosaic_gpu_decode, ops
from pallas_kernels.kda import reference as ref
from tests._gpu import skip_unless_hopper
from tests._mosaic_gpu_lowering import JAX_0112_PYTHON, lower_decode, run_under_jax_0112
from tests.test_kda_mosaic_gpu import _rel, check_explicit_mosaic_gpu


def _call(platform="gpu", cc=9.0, dtype="bfloat16", shape=(64, 1, 96, 128, 128), interpret=False):
    return ops.KdaCall(platform, dtype, shape, 64, None, interpret, cc)


@pytest.mark.parametrize("shipped, call, want, why", [
    (True, _call(), "triton", None),  # after triton until an H200 run shows it faster
    (False, _call(), "mosaic_gpu", None),
    (False, _call(cc=8.0), "xla", "compute capability >= 9.0"),
    (False, _call(shape=(2, 1, 3, 64, 64)), "xla", "K = V = 128"),
    (False, _call(shape=(2, 5, 3, 128, 128)), "xla", "one-token decode step"),
    (False, _call(platform="cpu", cc=None), "xla", "target is cpu"),
])
def test_decode_order(monkeypatch, shipped, call, want, why):
    monkeypatch.setattr(registry, "TRITON_SHIPPED", shipped)
    sel = ops.DECODE.select("auto", call, record=False)
    assert sel.backend == want
    assert ops.DECODE.names.index("mosaic_gpu") == ops.DECODE.names.index("triton") + 1
    if why is not None:
        assert why in dict(sel.passed_over)["mosaic_gpu"]


def test_explicit_mosaic_gpu_decode_runs_where_it_fits_and_raises_with_the_reason_elsewhere():
    check_explicit_mosaic_gpu(ops.DECODE, _call)


def _decode_inputs(B, H, P, dtype=jnp.bfloat16, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = ref.l2norm(jax.random.normal(ks[0], (B, 1, H, 128), jnp.float32)).astype(dtype)
    k = ref.l2norm(jax.random.normal(ks[1], (B, 1, H, 128), jnp.float32)).astype(dtype)
    v = jax.random.normal(ks[2], (B, 1, H, 128), jnp.float32).astype(dtype)
    g = ref.kda_gate(jax.random.normal(ks[3], (B, 1, H, 128), jnp.float32), jnp.zeros((H,), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, 1, H), jnp.float32))
    pool = jax.random.normal(ks[5], (P, H, 128, 128), jnp.float32)
    return q, k, v, g, beta, pool


def _step_inputs(B, H, P):
    """The decode step's own layout: ``q, k, v, g [B, H, 128]``, ``beta [B, H]``, the pool."""
    *tok, pool = _decode_inputs(B, H, P)
    return (*(x[:, 0] for x in tok), pool)


@pytest.mark.parametrize("dtype, block_v", [(jnp.bfloat16, None), (jnp.float32, 128)])
def test_interpreter_matches_reference_on_slots_out_of_order(dtype, block_v):
    """Three sequences of three heads on a pool of five rows, slots out of order: ``o`` and the three rows equal the
    fp32 reference's, the other two rows are untouched. bf16 through :func:`ops.recurrent_kda` (the model's path,
    default ``block_v``), fp32 through the kernel's entry with one V tile per CTA."""
    q, k, v, g, beta, pool = _decode_inputs(3, 3, 5, dtype)
    slots = jnp.array([4, 0, 2], jnp.int32)
    if block_v is None:
        o, new = ops.recurrent_kda(q, k, v, g, beta, None, pool, state_slots=slots, implementation="mosaic_gpu",
                                   interpret=True)
    else:
        o, new = mosaic_gpu_decode.decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], 128**-0.5, pool,
                                               slots, block_v=block_v, interpret=True)
        o = o[:, None]
    f = lambda x: x.astype(jnp.float32)
    o_ref, ht = ref.recurrent_kda(f(q), f(k), f(v), g, f(beta), None, pool[slots], True)
    assert o.shape == v.shape and o.dtype == dtype
    assert _rel(o, o_ref) < (1e-2 if dtype == jnp.bfloat16 else 1e-5)
    assert _rel(new[slots], ht) < 1e-5
    np.testing.assert_array_equal(np.asarray(new[jnp.array([1, 3])]), np.asarray(pool[jnp.array([1, 3])]))


def test_rejects_calls_outside_its_contract():
    q, k, v, g, beta, pool = _step_inputs(1, 1, 2)
    with pytest.raises(ValueError, match="K = V = 128"):
        mosaic_gpu_decode.decode_step(q[..., :64], k[..., :64], v, g[..., :64], beta, 0.1, pool, jnp.zeros(1, int))
    with pytest.raises(ValueError, match="state_pool must be"):
        mosaic_gpu_decode.decode_step(q, k, v, g, beta, 0.1, pool[:, :, :64], jnp.zeros(1, int))
    with pytest.raises(ValueError, match="block_v"):
        mosaic_gpu_decode.decode_step(q, k, v, g, beta, 0.1, pool, jnp.zeros(1, int), block_v=32)
    with pytest.raises(ValueError, match="lookahead < stages"):
        mosaic_gpu_decode.decode_step(q, k, v, g, beta, 0.1, pool, jnp.zeros(1, int), stages=2, lookahead=2)


COPIES = 1 + 3 * (mosaic_gpu_decode.LOOKAHEAD + mosaic_gpu_decode.STAGES) + 2 * mosaic_gpu_decode.STAGES
"""Copies in the lowered kernel: the CTA's row table, three loads per tile in the prologue and per ring slot, two
stores per ring slot."""


def test_lowers_to_one_mosaic_gpu_kernel_with_the_pool_aliased():
    """Every copy between device and shared memory with at most one integer index (the pool as ``[P * H * K, V]``,
    the token vectors as ``[B * H, D]``, the row table as ``[CTAs, tiles]``)."""
    calls, aliased, ints = lower_decode(64)
    assert calls == 1 and aliased
    assert len(ints) == COPIES and max(ints) == 1, ints
    # 1,024 sequences of 96 heads over 264 CTAs: 745 tiles per CTA, a row table of 768 entries copied in 3 pieces
    # (a TMA box holds at most 256 per dimension)
    calls, aliased, ints = lower_decode(64, batch=1024, heads=96, num_ctas=264)
    assert calls == 1 and aliased and len(ints) == COPIES + 2 and max(ints) == 1, ints


@pytest.mark.parametrize("stages, lookahead, num_ctas", [(2, 1, 5), (4, 2, 3), (3, 2, 7)])
def test_interpreter_ring_of_buffers(stages, lookahead, num_ctas):
    """Other rings: two sequences of five heads, both V tiles (20 tiles) over 3, 5 or 7 CTAs (so CTAs take
    different tile counts and each ring wraps), fp32: ``o`` and the new rows equal the reference's."""
    q, k, v, g, beta, pool = _decode_inputs(2, 5, 4, jnp.float32, seed=2)
    slots = jnp.array([3, 1], jnp.int32)
    o, new = mosaic_gpu_decode.decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], 128**-0.5, pool, slots,
                                           interpret=True, stages=stages, lookahead=lookahead, num_ctas=num_ctas)
    o_ref, ht = ref.recurrent_kda(q, k, v, g, beta, None, pool[slots], True)
    assert _rel(o, o_ref[:, 0]) < 1e-5 and _rel(new[slots], ht) < 1e-5
    np.testing.assert_array_equal(np.asarray(new[jnp.array([0, 2])]), np.asarray(pool[jnp.array([0, 2])]))


def test_lowers_under_jax_0112():
    if not os.path.exists(JAX_0112_PYTHON):
        pytest.skip(f"no jax 0.11.2 environment at {JAX_0112_PYTHON} (K3_JAX_0112_PYTHON)")
    out = run_under_jax_0112("""
        from tests._mosaic_gpu_lowering import lower_decode
        from pallas_kernels.kda import mosaic_gpu_decode as m
        calls, aliased, ints = lower_decode(128)
        copies = 1 + 3 * (m.LOOKAHEAD + m.STAGES) + 2 * m.STAGES
        assert calls == 1 and aliased and len(ints) == copies and max(ints) == 1, (calls, aliased, ints)
    """)
    assert out.returncode == 0 and "ok 0.11.2" in out.stdout, out.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("block_v, ring", [(64, {}), (128, {}), (64, {"num_ctas": 7}),
                                           (64, {"num_ctas": 3, "stages": 2, "lookahead": 1}),
                                           (64, {"num_ctas": 5, "stages": 4, "lookahead": 2})])
def test_gpu_matches_the_triton_decode(block_v, ring):
    """On the GPU against the Triton decode: 40 tiles (4 sequences of 5 heads, both V tiles at 64) one per CTA, and
    over 3, 5 or 7 CTAs whose rings wrap several times (the copies in and out of each buffer overlap for real)."""
    skip_unless_hopper()
    from pallas_kernels.kda import gpu  # noqa: PLC0415

    q, k, v, g, beta, pool = _step_inputs(4, 5, 9)
    slots = jnp.array([7, 0, 3, 5], jnp.int32)
    o_t, pool_t = jax.jit(gpu.decode_step, static_argnums=5)(q, k, v, g, beta, 128**-0.5, pool, slots)
    step = lambda q, k, v, g, b, p, sl: mosaic_gpu_decode.decode_step(q, k, v, g, b, 128**-0.5, p, sl, block_v, **ring)
    o_m, pool_m = jax.jit(step)(q, k, v, g, beta, pool, slots)
    assert _rel(o_m, o_t) < 1e-2
    assert _rel(pool_m, pool_t) < 1e-5
    np.testing.assert_array_equal(np.asarray(pool_m[jnp.array([1, 2, 4, 6, 8])]),
                                  np.asarray(pool[jnp.array([1, 2, 4, 6, 8])]))
