"""The decode step's small-op forms against their general forms (CPU, exact): the top-k of the log-probs in
chunks vs ``lax.top_k``, the one-token short conv vs the T-token conv, the GPU expert kernels' tile table vs a
row-by-row count; the GPU grouped matmul's decode tiles (interpreted on CPU, compiled on a GPU) and the one-row
lm_head (GPU) against the reference products."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.layers.common import einsum_f32
from k3_jax.layers.kda import causal_depthwise_conv
from k3_jax.model import lm_head_logits
from k3_jax.serving import sampling
from k3_jax.serving.sampling import top_k_in_chunks
from pallas_kernels.moe import gpu
from pallas_kernels.moe import reference as ref
from pallas_kernels.moe.gpu import make_tile_table


@pytest.mark.parametrize("b, v, k", [(3, 16384, 5), (1, 4096, 20), (2, 1000, 5), (4, 4096, 1), (64, 32768, 5)])
def test_top_k_in_chunks_equals_top_k(b, v, k):
    rs = np.random.RandomState(v + k)
    x = np.round(4 * rs.standard_normal((b, v))) / 4  # many ties: ids must still come out in lax.top_k's order
    x[:, [3, 700, v - 1]] = x.max() + 1.0  # a tie at the top across chunks
    assert (b, v) != (3, 16384) or b * v // sampling.TOP_K_CHUNK <= sampling.TOP_K_CHUNKED_MAX_ROWS  # 2 passes
    x = jnp.asarray(x, jnp.float32)
    want, got = jax.lax.top_k(x, k), jax.jit(top_k_in_chunks, static_argnums=1)(x, k)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_token_conv_equals_the_sequence_conv(dtype):
    rs = np.random.RandomState(0)
    u = jnp.asarray(rs.standard_normal((3, 2, 64)), dtype)
    tail = jnp.asarray(rs.standard_normal((3, 3, 64)), dtype)
    kernel = jnp.asarray(rs.standard_normal((4, 64)), jnp.float32)
    seg = jnp.asarray([[1, 1], [2, 2], [0, 0]], jnp.int32)
    one = jax.jit(causal_depthwise_conv)
    out1, tail1 = one(u[:, :1], kernel, tail, None)
    out2, tail2 = jax.jit(causal_depthwise_conv)(u, kernel, tail, seg)  # the T-token path, first token
    np.testing.assert_array_equal(np.asarray(out1[:, 0]), np.asarray(out2[:, 0]))
    np.testing.assert_array_equal(np.asarray(tail1), np.asarray(jnp.concatenate([tail, u[:, :1]], 1)[:, 1:]))
    out_seg, _ = one(u[:, :1], kernel, tail, seg[:, :1])  # one token is always in its tail's document
    np.testing.assert_array_equal(np.asarray(out_seg), np.asarray(out1))


@pytest.mark.parametrize("sizes, m, tm", [([0, 5, 0, 17, 1, 0], 32, 8), ([3, 0, 0], 4, 16), ([0, 0], 8, 4)])
def test_tile_table_matches_a_row_count(sizes, m, tm):
    gid, row0, ends, num = jax.jit(make_tile_table, static_argnums=(1, 2))(jnp.asarray(sizes, jnp.int32), m, tm)
    full = sizes + [max(m - sum(sizes), 0)]  # the trailing virtual group
    want = [(g, start + r) for g, (start, size) in enumerate(zip(np.cumsum([0] + full[:-1]), full, strict=True))
            for r in range(0, size, tm)]
    n = int(num[0])
    assert n == len(want)
    assert [(int(g), int(r)) for g, r in zip(gid[:n], row0[:n], strict=True)] == want
    np.testing.assert_array_equal(np.asarray(ends), np.cumsum(full))
    assert (np.asarray(gid[n:]) == int(gid[n - 1])).all()  # past the live count: the last live tile again


@pytest.mark.gpu
def test_one_row_lm_head_equals_the_plain_product():
    rs = np.random.RandomState(0)
    h = jnp.asarray(rs.standard_normal((1, 1, 512)), jnp.bfloat16)
    w = jnp.asarray(0.05 * rs.standard_normal((512, 4096)), jnp.bfloat16)
    got = jax.jit(lm_head_logits)(h, w)
    want = jax.jit(lambda h, w: einsum_f32("btd,dv->btv", h, w))(h, w)
    assert got.shape == (1, 1, 4096) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _decode_gmm_case(k: int, n: int, dtype, key: int):
    ks = jax.random.split(jax.random.key(key), 2)
    x = jax.random.normal(ks[0], (4, k), jnp.float32).astype(dtype)  # 4 rows: DECODE_TILES
    w = (jax.random.normal(ks[1], (2, 6, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)  # [L, E, K, N]
    gs = jnp.asarray([1, 0, 2, 0, 1, 0], jnp.int32)
    want = ref.grouped_matmul(x.astype(jnp.float32), w[1].astype(jnp.float32), gs)
    return x, w, gs, want


def test_decode_rows_gmm_interpret():
    x, w, gs, want = _decode_gmm_case(128, 192, jnp.float32, 0)
    with jax.default_matmul_precision("highest"):
        got = gpu.gmm(x, w, gs, layer=jnp.int32(1), interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_decode_rows_gmm_on_gpu():
    x, w, gs, want = _decode_gmm_case(3584, 3072, jnp.bfloat16, 1)
    got = jax.jit(lambda x, w, gs: gpu.gmm(x, w, gs, layer=jnp.int32(1), preferred_element_type=jnp.float32))(
        x, w, gs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2)
