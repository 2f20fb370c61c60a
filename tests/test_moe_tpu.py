"""TPU (Mosaic) MoE kernels in TPU interpret mode against the pure-JAX reference (tiny grids)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.quant import pack_mxfp4
from pallas_kernels import moe
from pallas_kernels.moe import reference as ref
from pallas_kernels.moe import tpu

T16 = (16, 128, 128)


def _data(m=64, k=128, n=128, e=4, dtype=jnp.float32, seed=0):
    k0, k1, k2 = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k0, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(k1, (e, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    d = jax.random.normal(k2, (m, n), jnp.float32).astype(dtype)
    return x, w, d


@pytest.mark.parametrize("sizes", [[10, 0, 30, 14], [0, 64, 0, 0]], ids=["empty+trailing", "one_expert_all"])
def test_gmm_forward_and_grads_f32(sizes):
    x, w, d = _data()
    gs = jnp.array(sizes, jnp.int32)

    def loss(fn, a, b):
        return jnp.sum(fn(a, b) * d)

    kern = lambda a, b: moe.grouped_matmul(a, b, gs, implementation="mosaic_tpu", interpret=True, tiles=T16)
    refn = lambda a, b: ref.grouped_matmul(a, b, gs)
    np.testing.assert_allclose(np.asarray(kern(x, w)), np.asarray(refn(x, w)), rtol=1e-5, atol=1e-5)
    ga = jax.grad(lambda a, b: loss(kern, a, b), argnums=(0, 1))(x, w)
    gb = jax.grad(lambda a, b: loss(refn, a, b), argnums=(0, 1))(x, w)
    for a, b in zip(ga, gb, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_gmm_bf16_loose():
    x, w, _ = _data(dtype=jnp.bfloat16, seed=1)
    gs = jnp.array([7, 25, 0, 32], jnp.int32)
    got = tpu.gmm(x, w, gs, tiles=(32, 128, 128), interpret=True)
    want = ref.grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), gs)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)


def _moe_problem(t=16, k=2, e=4, lat=128, inter=128, dtype=jnp.float32, seed=3):
    ks = jax.random.split(jax.random.key(seed), 6)
    z = jax.random.normal(ks[0], (t, lat), jnp.float32).astype(dtype)
    ids = jnp.argsort(jax.random.uniform(ks[1], (t, e)), axis=-1)[:, :k].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[2], (t, k)), axis=-1)
    experts = {
        "w1": (jax.random.normal(ks[3], (e, lat, inter)) / np.sqrt(lat)).astype(dtype),
        "w3": (jax.random.normal(ks[4], (e, lat, inter)) / np.sqrt(lat)).astype(dtype),
        "w2": (jax.random.normal(ks[5], (e, inter, lat)) / np.sqrt(inter)).astype(dtype),
    }
    return z, ids, w, experts


@pytest.mark.parametrize("backend", ["mosaic_tpu", "triton"])
def test_dispatch_matches_reference_with_grads(backend):
    """Dispatch + expert FFN + combine on each kernel backend (interpret mode; mosaic_tpu: the fused w1/w3
    SiTU-GLU kernel, triton: two grouped matmuls) vs the reference, outputs and gradients."""
    z, ids, w, experts = _moe_problem()

    def loss(impl, z, w, experts):
        out = moe.moe_dispatch_combine(z, ids, w, experts, implementation=impl, interpret=True)
        return jnp.sum(jnp.sin(out)), out

    (la, oa), ga = jax.value_and_grad(lambda *a: loss(backend, *a), argnums=(0, 1, 2), has_aux=True)(
        z, w, experts)
    (lb, ob), gb = jax.value_and_grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2), has_aux=True)(
        z, w, experts)
    np.testing.assert_allclose(np.asarray(oa), np.asarray(ob), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_dispatch_mxfp4_bf16():
    z, ids, w, experts = _moe_problem(dtype=jnp.bfloat16, seed=4)
    q = {}
    for name, arr in experts.items():
        p, s = pack_mxfp4(jnp.swapaxes(arr, 1, 2))
        q[name] = {"weight_packed": p, "weight_scale": s}
    got = moe.moe_dispatch_combine(z, ids, w, q, implementation="mosaic_tpu", interpret=True)
    want = ref.moe_dispatch_combine(z, ids, w, q)  # dequantize-then-bf16 path
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=3e-2, atol=3e-2)
    # direct MXFP4 grouped matmul with trailing rows (beyond sum(group_sizes)) -> zeros
    gs = jnp.array([5, 0, 6, 0], jnp.int32)
    out = moe.grouped_matmul(z, q["w1"], gs, implementation="mosaic_tpu", interpret=True)
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(ref.grouped_matmul(z, ref.dense_expert_weight(q["w1"], z.dtype), gs),
                                          np.float32), rtol=2e-2, atol=2e-2)
    assert np.all(np.asarray(out[11:], np.float32) == 0)
