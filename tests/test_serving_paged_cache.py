"""Tests for k3_jax.serving.paged_cache (page allocator, latent write/gather, slot reset, byte counts)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.config import load_config
from k3_jax.serving.paged_cache import (
    OutOfPages,
    PageAllocator,
    PagedCacheSpec,
    cache_bytes_per_sequence,
    device_cache_bytes,
    gather_latent,
    init_paged_cache,
    reset_slots,
    write_latent,
)


def _spec(**kw):
    base = dict(
        num_slots=3,
        max_len=20,
        page_size=4,
        num_pages=12,
        num_mla_layers=2,
        latent_dim=8,
        num_kda_layers=2,
        kda_heads=2,
        kda_head_dim=4,
        conv_width=4,
        latent_dtype="float32",
    )
    base.update(kw)
    return PagedCacheSpec(**base)


def test_allocator_alloc_free_reuse():
    spec = _spec()
    alloc = PageAllocator(spec)
    assert alloc.num_free == 11
    alloc.ensure(0, 9)  # 3 pages
    alloc.ensure(1, 4)  # 1 page
    assert alloc.num_free == 7 and len(alloc.owned[0]) == 3
    assert set(alloc.owned[0]).isdisjoint(alloc.owned[1]) and 0 not in alloc.owned[0]
    assert not alloc.ensure(0, 12)  # still 3 pages
    pages0 = list(alloc.owned[0])
    alloc.free(0)
    assert alloc.num_free == 10 and (alloc.table[0] == 0).all()
    alloc.ensure(2, 12)
    assert set(alloc.owned[2]) == set(pages0)  # freed pages are reused
    with pytest.raises(ValueError, match="max_len"):
        alloc.ensure(1, 21)
    alloc.ensure(0, 20)
    with pytest.raises(OutOfPages):
        alloc.ensure(1, 20)


@pytest.mark.parametrize("dtype, tol", [("float32", 0.0), ("bfloat16", 1e-2), ("float8_e4m3fn", 7e-2)])
def test_write_then_gather_roundtrip(dtype, tol):
    spec = _spec(latent_dtype=dtype)
    alloc = PageAllocator(spec)
    cache = init_paged_cache(spec)
    lens = [7, 0, 13]
    for s, n in enumerate(lens):
        alloc.ensure(s, n)
    table = jnp.asarray(alloc.table)
    t = 13
    pos = jnp.broadcast_to(jnp.arange(t), (3, t))
    valid = pos < jnp.asarray(lens)[:, None]
    vals = jax.random.normal(jax.random.key(0), (3, t, 8))
    lat, sc = write_latent(cache.latent[1], cache.latent_scale[1], table, pos, vals, valid)
    got = gather_latent(lat, sc, table)
    assert got.shape == (3, spec.max_pages_per_slot * 4, 8)
    for s, n in enumerate(lens):
        np.testing.assert_allclose(got[s, :n], vals[s, :n], atol=tol * 4, rtol=tol)
    # decode-style single-token append at each slot's length
    new = jax.random.normal(jax.random.key(1), (3, 1, 8))
    for s, n in enumerate(lens):
        alloc.ensure(s, n + 1)
    table = jnp.asarray(alloc.table)
    lat, sc = write_latent(lat, sc, table, jnp.asarray(lens)[:, None], new, jnp.ones((3, 1), bool))
    got = gather_latent(lat, sc, table)
    for s, n in enumerate(lens):
        np.testing.assert_allclose(got[s, n], new[s, 0], atol=tol * 4, rtol=tol)
        np.testing.assert_allclose(got[s, :n], vals[s, :n], atol=tol * 4, rtol=tol)


def test_reset_slots_zeroes_only_freed_slot():
    spec = _spec()
    cache = init_paged_cache(spec)
    cache = cache._replace(
        kda_state=jnp.ones_like(cache.kda_state),
        kda_conv=jnp.ones_like(cache.kda_conv),
        lengths=jnp.asarray([5, 6, 7], jnp.int32),
    )
    out = reset_slots(cache, jnp.asarray([False, True, False]))
    assert float(jnp.abs(out.kda_state[:, 1]).sum()) == 0 and float(jnp.abs(out.kda_conv[:, 1]).sum()) == 0
    assert float(out.kda_state[:, 0].min()) == 1 and float(out.kda_conv[:, 2].min()) == 1
    np.testing.assert_array_equal(out.lengths, [5, 0, 7])


def test_cache_bytes_k3_matches_analytic_figure():
    cfg = load_config("configs/k3.json")
    b = cache_bytes_per_sequence(cfg, 1000, latent_dtype="bfloat16")
    assert b["kda_state"] == 69 * 96 * 128 * 128 * 4
    assert b["kda_conv"] == 69 * 3 * 3 * 96 * 128 * 4
    assert b["mla_latent_per_token"] == 24 * 576 * 2
    b8 = cache_bytes_per_sequence(cfg, 1 << 20, latent_dtype="float8_e4m3fn", fp8_scale_bytes=0)
    assert b8["mla_latent"] == 24 * 576 * (1 << 20)  # 14.496 GB: the seed's FP8 latent figure


def test_device_bytes_match_analytic_for_tiny():
    cfg = load_config("configs/k3-tiny.json")
    spec = PagedCacheSpec.from_config(cfg, num_slots=2, max_len=32, page_size=8, latent_dtype="bfloat16")
    cache = init_paged_cache(spec)
    per_seq = cache_bytes_per_sequence(cfg, 32, latent_dtype="bfloat16")
    expected = 2 * (per_seq["kda_state"] + per_seq["kda_conv"] + per_seq["mla_latent"])
    overhead = device_cache_bytes(cache) - expected
    # remaining bytes: the null page, the scale arrays, the page table and lengths
    null_page = spec.num_mla_layers * spec.page_size * spec.latent_dim * 2
    scales = cache.latent_scale.size * 4
    assert overhead == null_page + scales + cache.page_table.size * 4 + cache.lengths.size * 4
