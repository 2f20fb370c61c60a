"""Expert parallelism equals the single-device reference ``moe_dispatch_combine`` (fwd + grad), 8 CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.parallel.expert import moe_dispatch_combine_ep, ragged_all_to_all_emulated
from k3_jax.quant.mxfp4 import pack_mxfp4
from pallas_kernels.moe.reference import moe_dispatch_combine
from sharding.mesh import make_mesh

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices; see tests/conftest.py")

T, L, I, E, K = 32, 32, 32, 16, 4


def _problem(seed=0, skew=False):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    z = jax.random.normal(ks[0], (T, L), jnp.float32)
    scores = jax.random.normal(ks[1], (T, E))
    if skew:  # most tokens pick experts 0..3 -> one rank receives nearly everything
        scores = scores + 5.0 * (jnp.arange(E) < K)
    ids = jax.lax.top_k(scores, K)[1].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[2], (T, K)))
    ex = {"w1": 0.2 * jax.random.normal(ks[3], (E, L, I)), "w3": 0.2 * jax.random.normal(ks[4], (E, L, I)),
          "w2": 0.2 * jax.random.normal(ks[5], (E, I, L))}
    return z, ids, w, ex


def _loss(fn, ids):
    return lambda z, w, ex: jnp.sum(jnp.sin(fn(z, ids, w, ex)))


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


@pytest.fixture(scope="module")
def reference():
    z, ids, w, ex = _problem()
    with jax.default_matmul_precision("highest"):
        ref = moe_dispatch_combine(z, ids, w, ex)
        g_ref = jax.jit(jax.grad(_loss(moe_dispatch_combine, ids), argnums=(0, 1, 2)))(z, w, ex)
    return (z, ids, w, ex), ref, g_ref


@pytest.mark.parametrize("axes, strategy", [
    ({"expert": 8}, "allgather"),
    ({"expert": 2, "tensor": 2, "fsdp": 2}, "all_to_all"),
])
def test_ep_matches_reference_fwd_and_grad(reference, axes, strategy):
    (z, ids, w, ex), ref, g_ref = reference
    mesh = make_mesh(axes)
    ep = lambda z, ids, w, ex: moe_dispatch_combine_ep(z, ids, w, ex, mesh=mesh, strategy=strategy,
                                                        ragged="emulate")
    with jax.default_matmul_precision("highest"):
        out = jax.jit(ep)(z, ids, w, ex)
        g = jax.jit(jax.grad(_loss(ep, ids), argnums=(0, 1, 2)))(z, w, ex)
    assert _rel(out, ref) <= 1e-5
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        assert _rel(a, b) <= 1e-5


def test_all_to_all_skewed_routing_is_dropless():
    """Nearly every token picks experts 0..3 (all on rank 0 of 8): the worst-case receive buffer drops nothing."""
    z, ids, w, ex = _problem(seed=2, skew=True)
    mesh = make_mesh({"expert": 8})
    with jax.default_matmul_precision("highest"):
        ref = moe_dispatch_combine(z, ids, w, ex)
        out = jax.jit(lambda z, w: moe_dispatch_combine_ep(z, ids, w, ex, mesh=mesh, strategy="all_to_all",
                                                           ragged="emulate"))(z, w)
    assert int(jnp.sum(ids < 2)) >= T  # rank 0 (experts 0, 1) gets at least a token's worth of every rank
    assert _rel(out, ref) <= 1e-5


def test_ep_replicated_tokens_and_mxfp4():
    """serve layout: tokens replicated over `expert` (psum path), MXFP4 experts split over expert x tensor."""
    z, ids, w, ex = _problem(seed=1)
    q = {name: dict(zip(("weight_packed", "weight_scale"), pack_mxfp4(jnp.swapaxes(v, 1, 2)), strict=True))
         for name, v in ex.items()}
    mesh = make_mesh({"expert": 4, "tensor": 2})
    with jax.default_matmul_precision("highest"):
        ref = moe_dispatch_combine(z, ids, w, q)
        out = jax.jit(lambda z, w: moe_dispatch_combine_ep(z, ids, w, q, mesh=mesh, token_axes=()))(z, w)
    assert _rel(out, ref) <= 1e-5


def test_ragged_all_to_all_emulation_semantics():
    """Rank r sends (r+j) % 3 rows of value 100r+row to rank j; check every receive buffer by hand."""
    mesh = make_mesh({"expert": 4, "fsdp": 2})
    n = 4

    def body(_):
        r = jax.lax.axis_index("expert")
        send = (r + jnp.arange(n)) % 3
        inoff = jnp.cumsum(send) - send
        operand = (100 * r + jnp.arange(8)).astype(jnp.float32)
        allsz = jax.lax.all_gather(send, "expert")  # [src, dst]
        outoff = jnp.sum(jnp.where(jnp.arange(n)[:, None] < r, allsz, 0), axis=0)
        recv = allsz[:, r]
        out = ragged_all_to_all_emulated(operand, jnp.full((16,), -1.0), inoff.astype(jnp.int32),
                                         send.astype(jnp.int32), outoff.astype(jnp.int32),
                                         recv.astype(jnp.int32), axis_name="expert")
        return out[None]

    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.sharding.PartitionSpec(),
                                out_specs=jax.sharding.PartitionSpec("expert"), check_vma=False))(jnp.zeros(()))
    got = np.asarray(got)
    for dst in range(n):
        expect = []
        for src in range(n):
            sizes = [(src + j) % 3 for j in range(n)]
            off = sum(sizes[:dst])
            expect += [100 * src + off + i for i in range(sizes[dst])]
        expect += [-1.0] * (16 - len(expect))
        np.testing.assert_array_equal(got[dst], np.asarray(expect, np.float32))


def test_native_ragged_all_to_all_lowers():
    """The GPU/TPU path (jax.lax.ragged_all_to_all) traces and lowers, forward and backward (XLA:CPU cannot
    compile it, so only lowering is checked here)."""
    z, ids, w, ex = _problem()
    mesh = make_mesh({"expert": 8})
    f = lambda z, w: jnp.sum(moe_dispatch_combine_ep(z, ids, w, ex, mesh=mesh, strategy="all_to_all",
                                                     ragged="native"))
    assert "ragged_all_to_all" in jax.jit(f).lower(z, w).as_text()
    assert jax.jit(jax.grad(f, argnums=(0, 1))).lower(z, w).as_text().count("ragged_all_to_all") >= 4
