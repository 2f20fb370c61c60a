"""Fused w1/w3 + SiTU-GLU grouped matmul on Pallas Mosaic GPU (:mod:`pallas_kernels.moe.mosaic_gpu_glu`): its tile
table, its numerics in the Mosaic GPU interpreter against the fp32 reference, its lowering for sm_90 from this CPU
host (both JAX versions) and, on a GPU (``-m gpu``), K3-shaped calls against the reference."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe import mosaic_gpu_glu as mg
from tests._gpu import skip_unless_hopper
from tests._mosaic_gpu_lowering import JAX_0112_PYTHON, lower_for_sm90, run_under_jax_0112

K3 = (65536, 3584, 3072, 64)  # M, K, N, E


def _inputs(m: int, k: int, n: int, e: int, seed: int = 0):
    """bf16 ``x``, ``w1``, ``w3`` scaled so that gate and up reach the nonlinear range of SiTU-GLU."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = lambda key: (jax.random.normal(key, (e, k, n), jnp.float32) * (3.0 / k**0.5)).astype(jnp.bfloat16)
    return x, w(ks[1]), w(ks[2])


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _reference_by_group(x, w1, w3, sizes) -> jax.Array:
    """:func:`mg.gmm_glu_reference` for concrete ``sizes``, called on one group at a time: at K3's shape XLA:GPU's
    fp32 ``ragged_dot`` behind it needs a 56 GiB temporary over all groups at once, too much beside other tests."""
    ends = np.cumsum(sizes)
    rows = [mg.gmm_glu_reference(x[end - size:end], w1[g:g + 1], w3[g:g + 1], jnp.array([size], jnp.int32))
            for g, (size, end) in enumerate(zip(sizes, ends, strict=True)) if size]
    tail = jnp.zeros((x.shape[0] - int(ends[-1]), w1.shape[-1]), jnp.bfloat16)
    return jnp.concatenate([*rows, tail])


def _check_against_reference(sizes, m, k, n, tol, by_group: bool = False, **kwargs) -> None:
    """:func:`mg.gmm_glu` on ``group_sizes = sizes`` vs :func:`mg.gmm_glu_reference` (``by_group``: its per-group
    form, :func:`_reference_by_group`): relative error within ``tol`` over the groups' rows, every row past
    ``sum(sizes)`` exactly zero."""
    x, w1, w3 = _inputs(m, k, n, len(sizes))
    gs = jnp.array(sizes, jnp.int32)
    got = np.asarray(mg.gmm_glu(x, w1, w3, gs, **kwargs).astype(jnp.float32))
    want = _reference_by_group(x, w1, w3, sizes) if by_group else mg.gmm_glu_reference(x, w1, w3, gs)
    want = np.asarray(want.astype(jnp.float32))
    total = sum(sizes)
    assert got.shape == (m, n)
    assert np.isfinite(got).all()
    assert np.all(got[total:] == 0.0)
    assert np.abs(want[:total]).max() > 1.0  # the activation's nonlinear range is exercised
    assert _rel(got[:total], want[:total]) < tol, _rel(got[:total], want[:total])


def test_per_group_reference_equals_the_reference():
    """The GPU test's per-group reference is :func:`mg.gmm_glu_reference` (empty groups, trailing rows)."""
    sizes, m = [5, 0, 9, 1], 20
    x, w1, w3 = _inputs(m, 64, 32, len(sizes))
    want = mg.gmm_glu_reference(x, w1, w3, jnp.array(sizes, jnp.int32))
    got = _reference_by_group(x, w1, w3, sizes)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


# ------------------------------------------------------------------------------------------------ tile table
@pytest.mark.parametrize("sizes, m", [
    ([70, 0, 130, 60, 20], 304),  # M = 300 as the kernel pads it
    ([3, 5, 1, 0, 20, 60, 39], 128),
    ([0, 203, 0], 208),
    ([1024] * 64, 65536),
    ([4096] * 8 + [1] * 40 + [0] * 8 + [999] * 8, 65536),
])
def test_tile_table_covers_every_row_once_with_boxes_inside_x(sizes, m):
    """(``m`` a multiple of 8, at least 128, as :func:`mg.gmm_glu` pads ``x``.) Every row below ``m`` is in exactly
    one tile, of its own group (``E`` past ``sum(sizes)``); each tile's rows
    fit the 128 rows loaded from its 8-row boundary (clamped to ``m - 128``); the table is large enough."""
    gs = jnp.array(sizes, jnp.int32)
    group, row0, rows, num = (np.asarray(a) for a in mg.tile_table(gs, m, 128))
    num = int(num[0])
    assert num <= len(group) == mg.table_size(m, len(sizes), 128)
    owner = np.repeat(np.arange(len(sizes) + 1), [*sizes, m - sum(sizes)])
    seen = np.zeros(m, np.int64)
    for g, r0, r in zip(group[:num], row0[:num], rows[:num], strict=True):
        load0 = min(r0 - r0 % 8, m - 128)
        assert r >= 1 and load0 % 8 == 0 and 0 <= load0 <= r0 and r0 + r <= load0 + 128
        assert np.all(owner[r0:r0 + r] == g)
        seen[r0:r0 + r] += 1
    assert np.all(seen == 1)


# ------------------------------------------------------------------------------------------------ interpreter
def test_interpreter_groups_crossing_tiles_an_empty_group_and_trailing_rows():
    """Five groups over 300 rows (one empty, starts off the 8-row grid, a group of 130 rows over two tiles), 20
    trailing rows written as zeros (the last tile loaded from row ``M - 128``), two column tiles, four K steps
    through two pipeline slots, three CTAs walking four work items each (the output buffer reused), with the
    interpreter's race detection on (it raises on an unsynchronised shared-memory access)."""
    blocks = mg.Blocks(stages=2, num_ctas=3)
    _check_against_reference([70, 0, 130, 60, 20], 300, 256, 256, 1e-2, blocks=blocks,
                             interpret=plgpu.InterpretGPUParams(detect_races=True))


def test_interpreter_all_rows_in_one_group():
    """One group of all 203 rows (``M`` padded to 208), between two empty groups."""
    _check_against_reference([0, 203, 0], 203, 128, 128, 1e-2, interpret=True, blocks=mg.Blocks(num_ctas=2))


def test_interpreter_small_groups_sharing_tiles_at_64_columns():
    """Groups of 1 to 8 rows sharing 8-row boundaries and a tile (each group's tile computes the shared rows and
    stores its own), ``block_n = 64``."""
    _check_against_reference([3, 5, 1, 0, 20, 60, 39], 128, 128, 128, 1e-2, interpret=True,
                             blocks=mg.Blocks(block_n=64, stages=2, num_ctas=2))


# ------------------------------------------------------------------------------------------------ contract
@pytest.mark.parametrize("shapes, match", [
    (((128, 100), (2, 100, 128), (2, 100, 128)), "K a multiple of block_k=64, got K=100"),
    (((128, 128), (2, 128, 96), (2, 128, 96)), "N a multiple of block_n=64, got N=96"),
    (((128, 128), (2, 128, 128), (3, 128, 128)), "w3 must be"),
])
def test_rejects_shapes_outside_its_contract(shapes, match):
    x, w1, w3 = (jnp.zeros(s, jnp.bfloat16) for s in shapes)
    with pytest.raises(ValueError, match=match):
        mg.gmm_glu(x, w1, w3, jnp.zeros((2,), jnp.int32), interpret=True)


def test_reasons():
    assert mg.shape_reason("bfloat16", 3584, 3072) is None
    assert "bfloat16" in mg.shape_reason("float32", 3584, 3072)
    assert "block_n must be" in mg.shape_reason("bfloat16", 3584, 3072, mg.Blocks(block_n=256))
    assert "shared memory" in mg.shape_reason("bfloat16", 3584, 3072, mg.Blocks(stages=5))


# ------------------------------------------------------------------------------------------------ lowering
def _k3_args():
    m, k, n, e = K3
    s = jax.ShapeDtypeStruct
    return s((m, k), jnp.bfloat16), s((e, k, n), jnp.bfloat16), s((e, k, n), jnp.bfloat16), s((e,), jnp.int32)


def test_lowers_to_one_mosaic_gpu_kernel_with_wgmma_at_k3_shape():
    """At the K3 shape the kernel lowers for sm_90 (Mosaic GPU lowers the kernel here: layout inference, shared
    memory within 227 KiB): one kernel, wgmma (m64n128k16), every copy between device and shared memory with at
    most one integer index."""
    text, int_indices = lower_for_sm90(lambda *a: mg.gmm_glu(*a), *_k3_args())
    assert text.count("custom_call @mosaic_gpu") == 1
    assert "wgmma.mma_async" in text and "m64n128k16" in text
    assert int_indices and max(int_indices) == 1, int_indices


def test_lowers_under_jax_0112():
    """The kernel also lowers under the H200's JAX (0.11.2)."""
    if not os.path.exists(JAX_0112_PYTHON):
        pytest.skip(f"no jax 0.11.2 environment at {JAX_0112_PYTHON} (K3_JAX_0112_PYTHON)")
    out = run_under_jax_0112("""
        import jax, jax.numpy as jnp
        from pallas_kernels.moe import mosaic_gpu_glu as mg
        from tests._mosaic_gpu_lowering import lower_for_sm90
        s = jax.ShapeDtypeStruct
        m, k, n, e = 65536, 3584, 3072, 64
        args = (s((m, k), jnp.bfloat16), s((e, k, n), jnp.bfloat16), s((e, k, n), jnp.bfloat16), s((e,), jnp.int32))
        text, ints = lower_for_sm90(lambda *a: mg.gmm_glu(*a), *args)
        assert text.count("custom_call @mosaic_gpu") == 1 and "wgmma.mma_async" in text and max(ints) == 1, ints
    """)
    assert out.returncode == 0 and "ok 0.11.2" in out.stdout, out.stderr[-3000:]


# ------------------------------------------------------------------------------------------------ GPU
def _skewed(m: int, e: int, seed: int = 0) -> list[int]:
    """Zipf-like group sizes summing to ``m - 77`` (77 trailing rows), a few groups empty."""
    weights = 1.0 / np.arange(1, e + 1) ** 1.2
    weights[np.random.default_rng(seed).choice(e, 4, replace=False)] = 0.0
    sizes = np.floor(weights / weights.sum() * (m - 77)).astype(int)
    sizes[0] += m - 77 - sizes.sum()
    return [int(s) for s in sizes]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["balanced", "skewed"])
def test_gpu_k3_shape_matches_reference(kind):
    skip_unless_hopper()
    m, k, n, e = K3
    sizes = [m // e] * e if kind == "balanced" else _skewed(m, e)
    _check_against_reference(sizes, m, k, n, 2e-2, by_group=True)


@pytest.mark.gpu
def test_gpu_ragged_small_shape_matches_reference():
    """The interpreter's ragged case on the GPU (rows past the sum are uninitialised there unless written)."""
    skip_unless_hopper()
    _check_against_reference([70, 0, 130, 60, 20, 3, 5, 1], 301, 256, 384, 2e-2)
