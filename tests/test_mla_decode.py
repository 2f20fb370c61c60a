"""One-token MLA decode attention over the latent cache (:mod:`pallas_kernels.mla_decode`): the Mosaic TPU flash
decoding kernel (Pallas interpreter on CPU) against its reference, on a stacked cache read at a traced layer with
rows at different positions; the layer's kernel path against its absorbed XLA path; the registry's choices; and
(with ``libtpu``) the kernel compiled for v5p reads a row-major cache with no copy."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.layers import mla
from pallas_kernels import mla_decode
from pallas_kernels.registry import KernelUnavailable

B, H, C, DR, S, R = 3, 8, 64, 16, 100, 2
POS = jnp.array([0, 37, 99], jnp.int32)  # the first position only, a partial block, the last position


def _inputs(dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    q_lat = jax.random.normal(k[0], (B, H, C)).astype(dtype)
    q_rot = jax.random.normal(k[1], (B, H, DR)).astype(dtype)
    store = jax.random.normal(k[2], (R, B, S, C + DR)).astype(dtype)
    return q_lat, q_rot, store


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)], ids=["f32", "bf16"])
def test_kernel_equals_reference_on_the_stack_at_a_traced_layer(dtype, tol):
    q_lat, q_rot, store = _inputs(dtype)

    @jax.jit
    def both(layer):  # block 32: four blocks, the last one past the end of S = 100
        got = mla_decode.latent_attention_tpu(q_lat, q_rot, store, POS, 0.1, layer, block=32, interpret=True)
        return got, mla_decode.latent_attention_xla(q_lat, q_rot, store, POS, 0.1, layer)

    got, want = both(jnp.int32(1))
    assert got.dtype == dtype
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=tol * np.abs(want).max())
    # row 0 sees position 0 only: its output is that cache row's latent part, for every head
    np.testing.assert_allclose(np.asarray(got[0], np.float32),
                               np.broadcast_to(np.asarray(store[1, 0, 0, :C], np.float32), (H, C)), rtol=tol)


def test_layer_kernel_path_equals_absorbed_xla_path(monkeypatch):
    """``mla._kernel_decode_attention`` (kernel over the stack at the layer) = ``mla._absorbed_cached_attention``
    (the xla backend on that layer's slice), fp32."""
    k = jax.random.split(jax.random.key(3), 4)
    dn, dv = 12, 10
    q_nope = jax.random.normal(k[0], (B, 1, H, dn))
    q_rot = jax.random.normal(k[1], (B, 1, H, DR))
    kv = 0.3 * jax.random.normal(k[2], (C, H, dn + dv))
    store = jax.random.normal(k[3], (R, B, S, C + DR))
    layer = jnp.int32(1)
    real = mla_decode.latent_attention_tpu
    monkeypatch.setattr(mla_decode, "latent_attention_tpu", lambda *a, **kw: real(*a, **kw, block=32, interpret=True))
    with mla.platform_scope("cpu"):
        want = mla._absorbed_cached_attention(q_nope, q_rot, store[1], kv, POS, 0.2)
        got = mla._kernel_decode_attention("mosaic_tpu", q_nope, q_rot, store, kv, POS, layer, 0.2)
    assert got.shape == (B, 1, H, dv)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_mosaic_gpu_path_interpreted_equals_reference():
    """The cache viewed as pages of 16 read by the Mosaic GPU paged kernel (its interpreter), bf16, a stack at a
    traced layer, rows at positions 0, 37 and 95 of 96; through the layer's kernel path too."""
    k = jax.random.split(jax.random.key(5), 6)
    b, h, c, dr, s = 3, 8, 128, 64, 96
    pos = jnp.array([0, 37, 95], jnp.int32)
    q_lat = jax.random.normal(k[0], (b, h, c)).astype(jnp.bfloat16)
    q_rot = jax.random.normal(k[1], (b, h, dr)).astype(jnp.bfloat16)
    store = jax.random.normal(k[2], (R, b, s, c + dr)).astype(jnp.bfloat16)
    got = jax.jit(lambda lyr: mla_decode.latent_attention_mgpu(q_lat, q_rot, store, pos, 0.1, lyr,
                                                               interpret=True))(jnp.int32(1))
    f = lambda x: x.astype(jnp.float32)
    want = mla_decode.latent_attention_xla(f(q_lat), f(q_rot), f(store), pos, 0.1, jnp.int32(1))
    assert got.dtype == jnp.bfloat16
    assert float(jnp.linalg.norm(f(got) - want) / jnp.linalg.norm(want)) < 5e-3
    dn, dv = 16, 32
    q_nope = jax.random.normal(k[3], (b, 1, h, dn)).astype(jnp.bfloat16)
    kv = (0.3 * jax.random.normal(k[4], (c, h, dn + dv))).astype(jnp.bfloat16)
    real = mla_decode.latent_attention_mgpu
    with pytest.MonkeyPatch.context() as mp, mla.platform_scope("cpu"):
        mp.setattr(mla_decode, "latent_attention_mgpu", lambda *a, **kw: real(*a, **kw, interpret=True))
        got = mla._kernel_decode_attention("mosaic_gpu", q_nope, q_rot[:, None], store, kv, pos, jnp.int32(1), 0.2)
        want = mla._absorbed_cached_attention(f(q_nope), f(q_rot[:, None]), f(store[1]), f(kv), pos, 0.2)
    assert got.shape == (b, 1, h, dv)
    assert float(jnp.linalg.norm(f(got) - want) / jnp.linalg.norm(want)) < 1e-2


def test_registry_choices():
    q_lat, q_rot, store = _inputs(jnp.bfloat16)
    assert mla_decode.select("auto", q_lat, q_rot, store, platform="tpu") == "mosaic_tpu"
    assert mla_decode.select("auto", q_lat, q_rot, store, platform="gpu") == "xla"
    assert mla_decode.select("auto", q_lat, q_rot, store, platform="cpu", interpret=True) == "mosaic_tpu"
    with pytest.raises(KernelUnavailable, match="needs target platform tpu"):
        mla_decode.select("mosaic_tpu", q_lat, q_rot, store, platform="gpu")
    k3 = (jnp.zeros((B, H, 512), jnp.bfloat16), jnp.zeros((B, H, 64), jnp.bfloat16))
    assert mla_decode.select("mosaic_gpu", *k3, jnp.zeros((R, B, 96, 576), jnp.bfloat16), platform="cpu",
                             interpret=True) == "mosaic_gpu"
    with pytest.raises(KernelUnavailable, match="multiple of 16"):
        mla_decode.select("mosaic_gpu", *k3, jnp.zeros((R, B, 100, 576), jnp.bfloat16), platform="cpu",
                          interpret=True)
    with pytest.raises(KernelUnavailable, match="needs compute capability"):
        mla_decode.select("mosaic_gpu", *k3, jnp.zeros((R, B, 96, 576), jnp.bfloat16), platform="gpu")
    with pytest.raises(ValueError, match=r"store must be \[R, B, S, C \+ Dr\]"):
        mla_decode.latent_attention_tpu(q_lat, q_rot, store[0], POS, 0.1, jnp.int32(0), interpret=True)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_kernel_compiles_for_v5p_and_reads_a_row_major_cache_in_place():
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    from jax.experimental.layout import Format, Layout
    from jax.sharding import SingleDeviceSharding

    from benchmarks.hlo_bytes import op_bytes

    try:
        dev = SingleDeviceSharding(topologies.get_topology_desc("v5p:2x2x1", platform="tpu").devices[0])
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"libtpu cannot describe v5p: {type(exc).__name__}: {exc}")
    b, h, c, dr, s = 64, 96, 512, 64, 2048  # K3's MLA widths, a 2,048-position cache of two layers
    sds = lambda shape, dt, sh=dev: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    store = sds((2, b, s, c + dr), jnp.bfloat16, Format(Layout((0, 1, 2, 3)), dev))
    fn = lambda ql, qr, st, pos, lyr: mla_decode.latent_attention_tpu(ql, qr, st, pos, 0.07, lyr)
    compiled = jax.jit(fn).lower(sds((b, h, c), jnp.bfloat16), sds((b, h, dr), jnp.bfloat16), store,
                                 sds((b,), jnp.int32), sds((), jnp.int32)).compile()
    rows = op_bytes(compiled.as_text())
    one_layer = b * s * (c + dr) * 2
    assert [r["kernel"] for r in rows if "kernel" in r] == ["mla_decode"]
    assert sum(r["bytes"] for r in rows if "kernel" not in r) < one_layer // 50, rows[:3]  # no copy of the cache
