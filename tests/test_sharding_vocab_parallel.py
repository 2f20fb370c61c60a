"""Vocab-parallel embedding / cross-entropy equal the dense versions (fwd + grad), 8 CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.parallel.vocab import vocab_parallel_cross_entropy, vocab_parallel_embed
from sharding.mesh import make_mesh

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices; see tests/conftest.py")

N, D, VOC = 32, 16, 64


def _dense_ce(h, w, y, mask):
    logits = jnp.matmul(h, w, precision="highest")
    per = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[:, None], -1)[:, 0]
    return jnp.sum(per * mask) / jnp.sum(mask)


def test_vocab_parallel_ce_and_embedding():
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    h = jax.random.normal(ks[0], (N, D))
    w = 3.0 * jax.random.normal(ks[1], (D, VOC))  # large logits: the max-shift matters
    y = jax.random.randint(ks[2], (N,), 0, VOC)
    mask = (jnp.arange(N) % 5 != 0).astype(jnp.float32)
    mesh = make_mesh({"tensor": 4, "fsdp": 2})

    def sharded(h, w):
        return vocab_parallel_cross_entropy(h, w, y, mesh=mesh, weights=mask)[0]

    # the vocab-split logits never exist whole: the jitted program's largest f32 buffer is [N/2, V/4]
    hlo = jax.jit(sharded).lower(h, w).compile().as_text()
    assert f"f32[{N // 2},{VOC // 4}]" in hlo and f"f32[{N},{VOC}]" not in hlo
    loss, gh, gw = *[jax.jit(sharded)(h, w)], *jax.jit(jax.grad(sharded, argnums=(0, 1)))(h, w)
    ref = _dense_ce(h, w, y, mask)
    rh, rw = jax.grad(_dense_ce, argnums=(0, 1))(h, w, y, mask)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gh), np.asarray(rh), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(rw), rtol=1e-5, atol=1e-6)

    table = jax.random.normal(ks[3], (VOC, D))
    tok = y.reshape(4, 8)
    emb = jax.jit(lambda t, e: vocab_parallel_embed(t, e, mesh=mesh))(tok, table)
    np.testing.assert_array_equal(np.asarray(emb), np.asarray(table[tok]))
