"""GPU (Pallas Triton) MoE kernels: generic-interpreter tests on CPU, and a real-GPU test (skipped on CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from pallas_kernels.moe import gpu
from pallas_kernels.moe import reference as ref

TILES = (16, 32, 32, 4, 2)


@pytest.fixture(autouse=True)
def _fp32_reference_dots():
    """fp32 dots in the references: on a GPU backend XLA's default precision is TF32 (seen on the H200: the
    interpret-mode comparisons failed at 1e-5 against TF32 references)."""
    with jax.default_matmul_precision("highest"):
        yield


def test_gmm_forward_and_grads_interpret():
    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k0, (64, 64))
    w = jax.random.normal(k1, (4, 64, 32))
    d = jax.random.normal(k2, (64, 32))
    for sizes in ([10, 0, 30, 14], [0, 0, 0, 64]):  # empty groups + trailing rows; one expert takes all
        gs = jnp.array(sizes, jnp.int32)
        loss = lambda fn: (lambda p, q: jnp.sum(fn(p, q) * d))
        kern = lambda p, q, g=gs: gpu.gmm(p, q, g, tiles=TILES, interpret=True)
        refn = lambda p, q, g=gs: ref.grouped_matmul(p, q, g)
        np.testing.assert_allclose(np.asarray(kern(x, w)), np.asarray(refn(x, w)), rtol=1e-5, atol=1e-5)
        ga = jax.grad(loss(kern), argnums=(0, 1))(x, w)
        gb = jax.grad(loss(refn), argnums=(0, 1))(x, w)
        for a, b in zip(ga, gb, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_dispatch_k3_routing_top16_of_896_interpret():
    """K3 routing shape (16 of 896 experts) on a few tokens, narrow latent/expert widths."""
    t, k, e, lat, inter = 8, 16, 896, 32, 32
    ks = jax.random.split(jax.random.key(1), 6)
    z = jax.random.normal(ks[0], (t, lat))
    ids = jax.lax.top_k(jax.random.normal(ks[1], (t, e)), k)[1].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[2], (t, k)), axis=-1)
    experts = {
        "w1": jax.random.normal(ks[3], (e, lat, inter)) / np.sqrt(lat),
        "w3": jax.random.normal(ks[4], (e, lat, inter)) / np.sqrt(lat),
        "w2": jax.random.normal(ks[5], (e, inter, lat)) / np.sqrt(inter),
    }
    got = jax.jit(lambda z: moe.moe_dispatch_combine(z, ids, w, experts, implementation="triton",
                                                     interpret=True))(z)
    want = ref.moe_dispatch_combine(z, ids, w, experts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gmm_on_gpu_bf16():
    k0, k1 = jax.random.split(jax.random.key(2))
    x = jax.random.normal(k0, (1000, 256), jnp.bfloat16)
    w = jax.random.normal(k1, (8, 256, 384), jnp.bfloat16)
    gs = jnp.array([0, 300, 1, 0, 127, 400, 0, 100], jnp.int32)  # sum 928 < 1000
    got = moe.grouped_matmul(x, w, gs, implementation="triton")
    want = jax.lax.ragged_dot(x, w, gs)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-1)
    assert np.all(np.asarray(got[928:], np.float32) == 0)
