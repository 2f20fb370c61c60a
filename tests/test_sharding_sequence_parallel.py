"""Sequence parallelism (KDA state-map scan + conv halo, MLA latent all-gather) equals the unsharded math."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.layers.kda import causal_depthwise_conv
from k3_jax.layers.mla import absorbed_attention, causal_segment_mask, expanded_attention
from k3_jax.parallel.sequence import (
    kda_sequence_parallel,
    mla_sequence_parallel,
    short_conv_sequence_parallel,
)
from pallas_kernels.kda import reference as kda_ref
from sharding.mesh import make_mesh

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices; see tests/conftest.py")

B, T, H, K, V, C = 2, 64, 2, 16, 16, 8  # 4 shards x 16 tokens, 2 chunks of 8 per shard


def _segments():
    seg = np.zeros((B, T), np.int32)
    seg[0, 16:] = 1  # boundary exactly at a shard boundary
    seg[0, 37:] = 2  # inside a chunk of shard 2
    seg[1, 5:] = 1
    return jnp.asarray(seg)


def _kda_inputs(seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = kda_ref.l2norm(jax.random.normal(ks[0], (B, T, H, K)))
    k = kda_ref.l2norm(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    s0 = 0.1 * jax.random.normal(ks[5], (B, H, K, V))
    return q, k, v, g, beta, s0


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


def test_kda_sequence_parallel_matches_chunk_kda():
    """Packed documents: one boundary exactly at a shard boundary, one inside a chunk; nonzero initial state."""
    q, k, v, g, beta, s0 = _kda_inputs()
    seg = _segments()
    mesh = make_mesh({"sequence": 4, "fsdp": 2})
    o_ref, s_ref = kda_ref.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                     segment_ids=seg, chunk_size=C)
    o, s = jax.jit(lambda *a: kda_sequence_parallel(*a, mesh=mesh, segment_ids=seg, initial_state=s0,
                                                    chunk_size=C))(q, k, v, g, beta)
    assert _rel(o, o_ref) <= 1e-5
    assert _rel(s, s_ref) <= 1e-5


def test_kda_sequence_parallel_grad():
    q, k, v, g, beta, _ = _kda_inputs(1)
    mesh = make_mesh({"sequence": 4, "tensor": 2})

    def loss(fn):
        return lambda q, k, v, g, beta: jnp.sum(jnp.sin(fn(q, k, v, g, beta)[0]))

    ref = lambda *a: kda_ref.chunk_kda(*a, output_final_state=True, chunk_size=C)
    sp = lambda *a: kda_sequence_parallel(*a, mesh=mesh, chunk_size=C)
    g_ref = jax.grad(loss(ref), argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
    g_sp = jax.jit(jax.grad(loss(sp), argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta)
    for a, b in zip(g_sp, g_ref, strict=True):
        assert _rel(a, b) <= 1e-5


def test_short_conv_halo():
    ks = jax.random.split(jax.random.PRNGKey(3), 2)
    u = jax.random.normal(ks[0], (B, T, 32))
    ker = jax.random.normal(ks[1], (4, 32))
    seg = _segments()
    mesh = make_mesh({"sequence": 8})  # 8-token shards: the 3-token halo crosses every boundary
    for s in (None, seg):
        ref, _ = causal_depthwise_conv(u, ker, None, s)
        out = jax.jit(lambda u, s: short_conv_sequence_parallel(u, ker, mesh=mesh, segment_ids=s))(u, s)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)


def test_mla_sequence_parallel_matches_expanded_attention():
    hh, dn, dr, dv, c = 4, 16, 8, 16, 32
    ks = jax.random.split(jax.random.PRNGKey(4), 5)
    q = jax.random.normal(ks[0], (B, T, hh, dn + dr))
    latent = jax.random.normal(ks[1], (B, T, c))
    k_rot = jax.random.normal(ks[2], (B, T, dr))
    w_uk = 0.2 * jax.random.normal(ks[3], (c, hh, dn))
    w_uv = 0.2 * jax.random.normal(ks[4], (c, hh, dv))
    seg = _segments()
    scale = (dn + dr) ** -0.5
    # unsharded expanded form (the model's training path)
    k_full = jnp.concatenate([jnp.einsum("btc,chd->bthd", latent, w_uk, precision="highest"),
                              jnp.broadcast_to(k_rot[:, :, None], (B, T, hh, dr))], axis=-1)
    v_full = jnp.einsum("btc,chd->bthd", latent, w_uv, precision="highest")
    ref = expanded_attention(q, k_full, v_full, causal_segment_mask(seg, B, T), scale)
    mesh = make_mesh({"sequence": 4, "tensor": 2})
    out = jax.jit(lambda q: mla_sequence_parallel(q[..., :dn], q[..., dn:], latent, k_rot, w_uk, w_uv,
                                                  scale=scale, attend=absorbed_attention, mesh=mesh,
                                                  segment_ids=seg))(q)
    assert _rel(out, ref) <= 1e-5
