"""The debug taps of the Mosaic GPU KDA per-chunk kernel (``intra_chunks(..., taps=...)``) that
``benchmarks/kda_mosaic_probe.py stages`` compares on the H200: in the Mosaic GPU interpreter every tap matches
the probe's plain-JAX fp32 intermediate, and the kernel's outputs are unchanged by the taps."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.kda_mosaic_probe import SCALE, compare_taps, inputs, tap_references
from pallas_kernels.kda.mosaic_gpu_common import interpret_params
from pallas_kernels.kda.mosaic_gpu_intra import TAP_WIDTHS, intra_chunks
from tests._gpu import skip_unless_hopper


def test_interpreter_taps_match_their_references():
    q, k, _, g, beta, _ = inputs(1, 64, 1, seed=64, normalize_q=False)
    beta_t = jnp.swapaxes(beta, 1, 2)
    ip = interpret_params(True)
    *outs, taps = intra_chunks(q, k, g, beta_t, scale=SCALE, interpret=ip, taps=tuple(TAP_WIDTHS))
    assert set(taps) == set(TAP_WIDTHS)
    assert all(taps[n].shape == (1, 1, 1, 64, w) for n, w in TAP_WIDTHS.items())
    rows, first = compare_taps(taps, tap_references(q, k, g, beta_t, scale=SCALE))
    assert first is None, [r for r in rows if r["tap"] == first]
    plain = intra_chunks(q, k, g, beta_t, scale=SCALE, interpret=ip)
    for a, b in zip(outs, plain, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.gpu
def test_gpu_taps_match_their_references_where_the_kernel_is_right():
    """On an sm_90+ GPU at a shape where the production kernel was right (2x256x3), the taps build is right too
    and every tap matches its reference."""
    skip_unless_hopper()
    q, k, _, g, beta, _ = inputs(2, 256, 3, seed=256, normalize_q=False)
    beta_t = jnp.swapaxes(beta, 1, 2)
    *_, taps = intra_chunks(q, k, g, beta_t, scale=SCALE, taps=tuple(TAP_WIDTHS))
    rows, first = compare_taps(taps, tap_references(q, k, g, beta_t, scale=SCALE))
    assert first is None, [r for r in rows if r["tap"] == first]


def test_compare_taps_names_the_first_wrong_tap():
    want = {n: np.ones((1, 1, 1, 64, w), np.float32) for n, w in TAP_WIDTHS.items()}
    got = dict(want, e1_0=want["e1_0"] * 2, akk=np.full_like(want["akk"], np.inf))
    rows, first = compare_taps(got, want)
    assert first == "e1_0"
    assert {r["tap"]: r["bad_chunks"] for r in rows}["e1_0"] == [[0, 0, 0]]
    assert not {r["tap"]: r["finite"] for r in rows}["akk"]


def test_unknown_tap_is_named():
    x = jnp.zeros((1, 64, 1, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="unknown taps \\['e9_0'\\]"):
        intra_chunks(x, x, x.astype(jnp.float32), jnp.zeros((1, 1, 64)), scale=SCALE, taps=("e9_0",))
