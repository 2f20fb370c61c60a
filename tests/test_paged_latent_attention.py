"""Paged MLA decode attention (:mod:`pallas_kernels.paged_latent_attention`) and the layer's page writes
(:mod:`k3_jax.layers.paged_latent`): the split-K XLA form and the Mosaic TPU kernel (Pallas interpreter on CPU)
against the dense gather reference, fp32, rows of very different lengths with shared pages, T = 1 and T > 1, a
stacked pool read at a traced layer, FP8 pages, rows that map no page; the registry's choices; and (with ``libtpu``)
the kernel compiled for v5p."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.layers import paged_latent
from pallas_kernels import paged_latent_attention as pla
from pallas_kernels.registry import TRITON_SHIPPED, KernelUnavailable
from tests._gpu import skip_unless_hopper
from tests._mosaic_gpu_lowering import JAX_0112_PYTHON, lower_paged_attention, run_under_jax_0112

B, H, C, DR, S, MAXP, P, R = 5, 4, 32, 8, 8, 16, 80, 2
LENGTHS = [0, 5, 40, 121, 44]  # one token, a partial page, several pages, almost the whole table, a prefix sharer


def _table(t: int) -> jax.Array:
    """Each row maps the pages its ``len + t`` tokens need (shuffled pool); row 4 shares row 2's first 5 pages
    (a prefix hit: positions 0..39), row 0's second entry is left null."""
    perm = np.random.default_rng(0).permutation(np.arange(1, P))
    table = np.zeros((B, MAXP), np.int32)
    at = 0
    for b, n in enumerate(LENGTHS):
        need = -(-(n + t) // S)
        table[b, :need] = perm[at:at + need]
        at += need
    table[4, :5] = table[2, :5]
    return jnp.asarray(table)


def _inputs(t: int, dtype=jnp.float32, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 3)
    q_lat = jax.random.normal(k[0], (B, t, H, C)).astype(dtype)
    q_rot = jax.random.normal(k[1], (B, t, H, DR)).astype(dtype)
    pages = jax.random.normal(k[2], (R, P, S, C + DR)).astype(dtype)
    pages = pages.at[:, 0].set(jnp.nan)  # the null page's garbage must never reach an output
    return q_lat, q_rot, pages, _table(t), jnp.asarray(LENGTHS, jnp.int32)


@pytest.mark.parametrize("t", [1, 3])
def test_split_k_xla_equals_gather_reference_fp32(t):
    q_lat, q_rot, pages, table, pos = _inputs(t)

    @jax.jit
    def both(layer):  # two pages per item, three items per step: several loop steps and a padded last step
        got = pla.paged_attention_xla(q_lat, q_rot, pages, None, table, pos, 0.2, layer, pages_per_item=2,
                                      items_per_step=3)
        return got, pla.paged_attention_reference(q_lat, q_rot, pages, None, table, pos, 0.2, layer)

    got, want = both(jnp.int32(1))
    assert got.shape == (B, t, H, C) and np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # row 0 at position 0 sees its one token only: every head's output is that token's latent
    np.testing.assert_allclose(np.asarray(got[0, 0]), np.broadcast_to(np.asarray(pages[1, table[0, 0], 0, :C]),
                                                                      (H, C)), rtol=1e-6)
    # the reference is the dense absorbed attention over each row's positions in order
    lat = np.asarray(pages[1])[np.asarray(table[3])].reshape(-1, C + DR)[: LENGTHS[3] + t]
    s = np.einsum("thc,sc->ths", np.asarray(q_lat[3]), lat[:, :C]) + np.einsum("thr,sr->ths", np.asarray(q_rot[3]),
                                                                               lat[:, C:])
    s = np.where(np.arange(len(lat))[None, None, :] <= LENGTHS[3] + np.arange(t)[:, None, None], 0.2 * s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(want[3]), np.einsum("ths,sc->thc", p / p.sum(-1, keepdims=True),
                                                              lat[:, :C]), rtol=1e-4, atol=1e-5)


def test_fp8_pages_and_rows_that_map_nothing():
    q_lat, q_rot, pages, table, pos = _inputs(1)
    q8, scale = paged_latent.quantize_fp8(jnp.nan_to_num(pages[0]))
    table = table.at[1].set(0)  # an inactive row: all-null table, reads nothing
    got = pla.paged_attention_xla(q_lat, q_rot, q8, scale, table, pos, 0.2, pages_per_item=3)
    want = pla.paged_attention_reference(q_lat, q_rot, q8, scale, table, pos, 0.2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[1]), 0.0)
    dense = pla.paged_attention_reference(q_lat, q_rot, q8.astype(jnp.float32) * scale[..., None], None, table, pos,
                                          0.2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,dtype,tol", [(1, jnp.float32, 1e-5), (3, jnp.float32, 1e-5), (1, jnp.bfloat16, 3e-2)],
                         ids=["t1-f32", "t3-f32", "t1-bf16"])
def test_mosaic_tpu_kernel_equals_reference(t, dtype, tol):
    q_lat, q_rot, pages, table, pos = _inputs(t, dtype)
    got = jax.jit(lambda lyr: pla.paged_attention_tpu(q_lat, q_rot, pages, None, table, pos, 0.2, lyr,
                                                      interpret=True))(jnp.int32(1))
    want = pla.paged_attention_reference(q_lat, q_rot, pages, None, table, pos, 0.2, jnp.int32(1))
    assert got.dtype == dtype
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=tol * np.abs(want).max())


def _wide_inputs(t: int, h: int, c: int, dr: int, s: int, lengths: list[int], dtype, seed: int = 1):
    """Inputs at Triton-friendly widths (C, Dr, page size powers of two >= 16): pool ``[2, P, s, c + dr]`` with a
    NaN null page, each row mapping ``ceil((len + t) / s)`` shuffled pages."""
    b = len(lengths)
    max_pages = -(-(max(lengths) + t) // s)
    need = [-(-(n + t) // s) for n in lengths]
    num_pages = sum(need) + 1
    perm = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
    table = np.zeros((b, max_pages), np.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at:at + n]
        at += n
    k = jax.random.split(jax.random.key(seed), 3)
    pages = jax.random.normal(k[2], (2, num_pages, s, c + dr)).astype(dtype).at[:, 0].set(jnp.nan)
    return (jax.random.normal(k[0], (b, t, h, c)).astype(dtype), jax.random.normal(k[1], (b, t, h, dr)).astype(dtype),
            pages, jnp.asarray(table), jnp.asarray(lengths, jnp.int32))


@pytest.mark.skipif(not TRITON_SHIPPED, reason="this JAX ships no Pallas Triton backend")
@pytest.mark.parametrize("t,splits,step", [(1, 1, 64), (1, 3, 16), (2, 2, 32)])
def test_triton_kernel_interpreted_equals_reference(t, splits, step):
    """Steps of one page (16 positions) and of several (32, 64), against rows of 1 to 151 positions."""
    q_lat, q_rot, pages, table, pos = _wide_inputs(t, 16, 32, 16, 16, [0, 5, 40, 150], jnp.float32)
    got = jax.jit(lambda lyr: pla.paged_attention_triton(q_lat, q_rot, pages, None, table, pos, 0.2, lyr,
                                                         splits=splits, step=step, interpret=True))(jnp.int32(1))
    want = pla.paged_attention_reference(q_lat, q_rot, pages, None, table, pos, 0.2, jnp.int32(1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _check_k3_widths_on_gpu(attend, t: int) -> None:
    """``attend(q_lat, q_rot, pages, table, pos, layer)`` at K3's MLA widths (96 heads, C 512, Dr 64), 16-token
    pages, rows of 1 to 5,000 tokens, bf16, against the reference."""
    q_lat, q_rot, pages, table, pos = _wide_inputs(t, 96, 512, 64, 16, [0, 17, 700, 5000, 2100, 64], jnp.bfloat16)
    got = jax.jit(lambda lyr: attend(q_lat, q_rot, pages, table, pos, lyr))(jnp.int32(1))
    want = pla.paged_attention_reference(q_lat, q_rot, pages, None, table, pos, 0.07, jnp.int32(1))
    want = np.asarray(want, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=3e-2 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
def test_gpu_triton_kernel_at_k3_widths_equals_reference(t):
    """The Triton kernel at K3's widths (:func:`_check_k3_widths_on_gpu`)."""
    _check_k3_widths_on_gpu(lambda ql, qr, p, tb, pos, lyr: pla.paged_attention_triton(ql, qr, p, None, tb, pos, 0.07,
                                                                                       lyr), t)


@pytest.mark.parametrize("t, splits", [(1, None), (3, 3)])
def test_mosaic_gpu_kernel_interpreted_equals_reference(t, splits):
    """The Mosaic GPU kernel in its interpreter, bf16: 8 heads (one block of 64 query rows, padded), C 128, Dr 64,
    16-token pages (two per step) with a NaN null page, rows of 1 to 153 positions, a stacked pool at a traced
    layer; T = 3 puts three queries of a row in one block."""
    q_lat, q_rot, pages, table, pos = _wide_inputs(t, 8, 128, 64, 16, [0, 5, 40, 150], jnp.bfloat16)
    got = jax.jit(lambda lyr: pla.paged_attention_mgpu(q_lat, q_rot, pages, None, table, pos, 0.2, lyr,
                                                       splits=splits, interpret=True))(jnp.int32(1))
    f = lambda x: x.astype(jnp.float32)
    want = pla.paged_attention_reference(f(q_lat), f(q_rot), f(pages), None, table, pos, 0.2, jnp.int32(1))
    assert got.dtype == jnp.bfloat16 and bool(jnp.isfinite(got.astype(jnp.float32)).all())
    assert float(jnp.linalg.norm(f(got) - want) / jnp.linalg.norm(want)) < 5e-3


def test_mosaic_gpu_split_count():
    """Splits per row: ~SPLIT_STEPS steps of the table's longest row, more to fill one wave, at most one per step and
    MAX_SPLITS, fewer pages per split than MAX_SPLIT_PAGES whatever that takes."""
    from pallas_kernels import paged_latent_attention_mosaic_gpu as m

    assert m.num_splits(16, 2, 1028, 2) == 17  # the H200 sweep's case (32k-token rows, batch 16): 16 was fastest
    assert m.num_splits(1, 2, 200, 2) == m.MAX_SPLITS  # one wave wants 66 CTAs per block
    assert m.num_splits(1, 2, 5, 2) == 5 and m.num_splits(64, 2, 5, 2) == 1
    assert m.num_splits(1, 1, 10**5, 2) == 98  # 2,048 pages per split at most


def test_mosaic_gpu_kernel_lowers_for_sm90():
    """At K3's widths (two blocks of 64 of the 96 heads, C 512): one Mosaic GPU kernel, every copy between device and
    shared memory with at most one integer index (also under the H200's jax 0.11.2); table rows longer than a TMA box
    (256 entries) too."""
    calls, ints = lower_paged_attention()
    assert calls == 1 and len(ints) == 8 and max(ints) == 1, (calls, ints)
    from pallas_kernels import paged_latent_attention_mosaic_gpu as pla_mgpu

    for splits in (None, 1, 4, pla_mgpu.MAX_SPLITS):  # 32k-token rows: 1 or 4 splits take table rows of 2,080 or 576
        calls, ints = lower_paged_attention(batch=16, max_pages=2056, splits=splits)
        assert calls == 1 and max(ints) == 1, (splits, calls, ints)
    if not os.path.exists(JAX_0112_PYTHON):
        pytest.skip(f"no jax 0.11.2 environment at {JAX_0112_PYTHON} (K3_JAX_0112_PYTHON)")
    out = run_under_jax_0112("""
        from tests._mosaic_gpu_lowering import lower_paged_attention
        calls, ints = lower_paged_attention(3)
        assert calls == 1 and len(ints) == 8 and max(ints) == 1, (calls, ints)
    """)
    assert out.returncode == 0 and "ok 0.11.2" in out.stdout, out.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
def test_gpu_mosaic_gpu_kernel_at_k3_widths_equals_reference(t):
    """The Mosaic GPU kernel on an sm_90 GPU at K3's widths (:func:`_check_k3_widths_on_gpu`)."""
    skip_unless_hopper()
    _check_k3_widths_on_gpu(lambda ql, qr, p, tb, pos, lyr: pla.paged_attention_mgpu(ql, qr, p, None, tb, pos, 0.07,
                                                                                     lyr), t)


def test_write_pages_in_place_at_a_layer_and_null_rows():
    pages = jnp.zeros((R, P, S, C + DR))
    scale = jnp.ones((R, P, S))
    table = _table(1).at[1].set(0)
    pos = jnp.asarray(LENGTHS, jnp.int32)[:, None]
    vals = jnp.arange(B, dtype=jnp.float32)[:, None, None] + 1 + jnp.zeros((B, 1, C + DR))
    new, new_scale = jax.jit(paged_latent.write_pages)(pages, scale, table, pos, vals, None, jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(new_scale), np.asarray(scale))  # scales change for fp8 pages only
    np.testing.assert_array_equal(np.asarray(new[0]), 0.0)  # the other layer untouched
    for b, n in enumerate(LENGTHS):  # row 1 (null table) writes into the null page 0
        np.testing.assert_array_equal(np.asarray(new[1, int(table[b, n // S]), n % S]), b + 1)
    assert int(np.sum(np.asarray(new[1]) != 0)) == B * (C + DR)  # one token per row, nothing else


def test_registry_choices():
    q_lat, _, pages, table, _ = _inputs(1, jnp.bfloat16)
    assert pla.select("auto", q_lat, pages, table, platform="tpu") == "mosaic_tpu"
    assert pla.select("auto", q_lat, pages, table, platform="gpu") == "xla"  # Dr = 8, S = 8: below tl.dot's 16
    wide = jnp.zeros((P, 16, C + 16), jnp.bfloat16)
    q16 = jnp.zeros((B, 1, 16, C), jnp.bfloat16)
    assert pla.select("auto", q16, wide, table, platform="gpu") == ("triton" if TRITON_SHIPPED else "xla")
    assert pla.select("auto", q_lat, pages, table, platform="cpu", interpret=True) == "mosaic_tpu"
    assert pla.select("auto", q_lat, pages.astype(jnp.float8_e4m3fn), table, platform="tpu") == "xla"
    assert pla.select("auto", q_lat, pages, table, platform="tpu", mesh_devices=2) == "xla"
    with pytest.raises(KernelUnavailable, match="needs target platform tpu"):
        pla.select("mosaic_tpu", q_lat, pages, table, platform="gpu")
    k3_pages, k3_q = jnp.zeros((P, 16, 576), jnp.bfloat16), jnp.zeros((B, 1, 96, 512), jnp.bfloat16)
    assert pla.select("mosaic_gpu", k3_q, k3_pages, table, platform="cpu", interpret=True) == "mosaic_gpu"
    with pytest.raises(KernelUnavailable, match="takes bfloat16 queries and pages"):
        pla.select("mosaic_gpu", k3_q.astype(jnp.float32), k3_pages, table, platform="cpu", interpret=True)
    with pytest.raises(KernelUnavailable, match="needs C a multiple of 128"):
        pla.select("mosaic_gpu", q_lat, pages, table, platform="cpu", interpret=True)
    with pytest.raises(KernelUnavailable, match="fp8 pages"):
        pla.select("mosaic_tpu", q_lat, pages.astype(jnp.float8_e4m3fn), table, platform="tpu")
    with pytest.raises(ValueError, match=r"pages must be \[R, P, S, C \+ Dr\]"):
        pla.paged_attention_xla(q_lat, q_lat[..., :DR], pages[0], None, table, table[:, 0], 0.1, jnp.int32(0))


@pytest.mark.parametrize("shipped, cc, want", [(True, 9.0, "triton"), (False, 9.0, "mosaic_gpu"),
                                                 (False, 8.0, "xla"), (True, 8.0, "triton")])
def test_gpu_order_at_k3_widths(monkeypatch, shipped, cc, want):
    """On a GPU at K3's widths: ``triton`` while JAX ships it, then ``mosaic_gpu`` on sm_90+, else ``xla``, each
    branch with its reason recorded."""
    from pallas_kernels import registry

    monkeypatch.setattr(registry, "TRITON_SHIPPED", shipped)
    q = jnp.zeros((B, 1, 96, 512), jnp.bfloat16)
    with registry.platform_scope("gpu", compute_capability=cc):  # the target GPU's, not this host's
        call = pla.make_call(q, jnp.zeros((P, 16, 576), jnp.bfloat16), jnp.zeros((B, 8), jnp.int32), platform="gpu")
    assert call.compute_capability == cc
    sel = pla.PAGED_DECODE.select("auto", call, record=False)
    assert sel.backend == want
    passed = dict(sel.passed_over)
    if want == "xla":
        assert "compute capability >= 9.0" in passed["mosaic_gpu"] and "no longer ships" in passed["triton"]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_kernel_compiles_for_v5p_and_reads_a_row_major_pool_in_place():
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    from jax.experimental.layout import Format, Layout
    from jax.sharding import SingleDeviceSharding

    from benchmarks.hlo_bytes import op_bytes

    try:
        dev = SingleDeviceSharding(topologies.get_topology_desc("v5p:2x2x1", platform="tpu").devices[0])
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"libtpu cannot describe v5p: {type(exc).__name__}: {exc}")
    b, h, c, dr, s, maxp, p = 16, 96, 512, 64, 16, 256, 2049  # K3's MLA widths, 4,096-token rows, two layers
    sds = lambda shape, dt, sh=dev: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    pool = sds((2, p, s, c + dr), jnp.bfloat16, Format(Layout((0, 1, 2, 3)), dev))  # row-major, as the kernel reads
    fn = lambda ql, qr, pg, tb, pos, lyr: pla.paged_attention_tpu(ql, qr, pg, None, tb, pos, 0.07, lyr)
    compiled = jax.jit(fn).lower(sds((b, 1, h, c), jnp.bfloat16), sds((b, 1, h, dr), jnp.bfloat16),
                                 pool, sds((b, maxp), jnp.int32),
                                 sds((b,), jnp.int32), sds((), jnp.int32)).compile()
    rows = op_bytes(compiled.as_text())
    one_layer = p * s * (c + dr) * 2
    assert [r["kernel"] for r in rows if "kernel" in r] == ["mla_paged_decode"]
    assert sum(r["bytes"] for r in rows if "kernel" not in r) < one_layer // 50, rows[:3]  # no copy of the pool
