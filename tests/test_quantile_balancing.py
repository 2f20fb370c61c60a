"""Quantile Balancing: Figure-5 example, convergence on skewed scores, histogram vs exact."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.training.quantile_balancing import (
    admission_threshold,
    exact_quantile,
    expert_loads,
    histogram_counts,
    histogram_quantile,
    margin_bounds,
    margins,
    qb_bias_update,
    quantile_from_histogram,
)

# Figure 5 of the report: 8 tokens, 4 experts, k = 1. Plain top-1 gives loads (4, 3, 1, 0): expert 0 is
# overloaded, expert 3 dead. Tokens 2 and 3 have expert 3 as a close second choice, token 6 has expert 2 as a
# close second choice; each column's 3rd largest margin (q + 1 = 3, q = mk/n = 2) is well separated from
# the 2nd so one update moves exactly those tokens.
FIG5_SCORES = np.array(
    [
        [0.95, 0.30, 0.20, 0.10],
        [0.90, 0.35, 0.20, 0.10],
        [0.70, 0.10, 0.20, 0.60],
        [0.65, 0.15, 0.10, 0.60],
        [0.15, 0.90, 0.10, 0.05],
        [0.20, 0.85, 0.10, 0.15],
        [0.10, 0.60, 0.55, 0.05],
        [0.30, 0.10, 0.80, 0.20],
    ],
    np.float32,
)


# The functions run jitted, as in the train step: one compile per function and shape instead of one per eager op.
_loads = jax.jit(expert_loads, static_argnums=2)


@functools.cache
def _update(**kw) -> Callable:
    """``qb_bias_update`` jitted with its static arguments ``kw`` (k, method, ...): ``(scores, bias) -> bias``; one
    jitted function per argument set, so repeated calls reuse its trace."""
    return jax.jit(functools.partial(qb_bias_update, **kw))


def _skewed_scores(seed: int, m: int = 4096, n: int = 64) -> jax.Array:
    """Sigmoid scores with strong expert-dependent offsets (a few hot experts, a long cold tail)."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    offsets = jnp.linspace(2.0, -2.0, n) + 0.5 * jax.random.normal(k1, (n,))
    logits = jax.random.normal(k2, (m, n)) + offsets[None, :]
    return jax.nn.sigmoid(logits)


@pytest.mark.parametrize("method", ["exact", "histogram"])
def test_figure5_one_update_balances(method):
    s = jnp.asarray(FIG5_SCORES)
    b0 = jnp.zeros(4, jnp.float32)
    np.testing.assert_array_equal(np.asarray(_loads(s, b0, 1)), [4, 3, 1, 0])
    b1 = _update(k=1, method=method)(s, b0)
    np.testing.assert_array_equal(np.asarray(_loads(s, b1, 1)), [2, 2, 2, 2])


def test_figure5_threshold_is_k_plus_1_th_and_bias_values():
    s = jnp.asarray(FIG5_SCORES)
    alpha = admission_threshold(s, jnp.zeros(4), 1)
    np.testing.assert_allclose(np.asarray(alpha), np.sort(FIG5_SCORES, axis=1)[:, -2])
    # b̂_j = −(3rd largest margin of column j) = (−0.10, −0.05, +0.05, +0.05), then minus its mean −0.0125
    b1 = qb_bias_update(s, jnp.zeros(4), 1, method="exact")
    np.testing.assert_allclose(np.asarray(b1), [-0.0875, -0.0375, 0.0625, 0.0625], atol=1e-6)


@pytest.mark.parametrize(
    "method,hist_range", [("exact", "data"), ("histogram", "data"), ("histogram", "static")]
)
def test_skewed_64_experts_converges_within_5_updates(method, hist_range):
    k, n = 4, 64
    s = _skewed_scores(0, n=n)
    b = jnp.zeros(n, jnp.float32)
    loads0 = _loads(s, b, k)
    assert float(loads0.max() / loads0.mean()) > 3.0  # the example really is skewed
    update = _update(k=k, method=method, hist_range=hist_range)
    ratios = []
    for _ in range(5):
        b = update(s, b)
        loads = _loads(s, b, k)
        ratios.append(float(loads.max() / loads.mean()))
    assert ratios[0] < 0.5 * float(loads0.max() / loads0.mean()), ratios
    assert min(ratios) <= 1.1, ratios
    if hist_range == "data":  # the coarse static-range bins hover around 1.1 (bin = 0.0027 in margin)
        assert ratios[-1] <= 1.1, ratios


def test_bias_is_mean_centred():
    s = _skewed_scores(1, m=512, n=32)
    b = 0.3 * jax.random.normal(jax.random.PRNGKey(5), (32,)) + 0.7  # deliberately off-centre input
    for method in ("exact", "histogram"):
        nb = _update(k=2, method=method)(s, b)
        assert abs(float(jnp.mean(nb))) < 1e-6
        # adding a constant to the input bias changes nothing (top-k invariance)
        nb2 = _update(k=2, method="exact")(s, b + 3.0)
        if method == "exact":
            np.testing.assert_allclose(np.asarray(nb), np.asarray(nb2), atol=1e-5)


@pytest.mark.parametrize("num_bins", [50, 1000])
def test_histogram_quantile_within_one_bin_of_exact(num_bins):
    s = _skewed_scores(2, m=2048, n=64)
    b = 0.1 * jax.random.normal(jax.random.PRNGKey(3), (64,))
    p = 1.0 - 4 / 64

    @jax.jit
    def quantiles(s, b):
        marg = margins(s, admission_threshold(s, b, 4))
        lo, hi = margin_bounds(b)
        exact = exact_quantile(marg, p)
        approx = quantile_from_histogram(histogram_counts(marg, lo, hi, num_bins), lo, hi, p)
        return marg, lo, hi, exact, approx, histogram_quantile(marg, p, num_bins)

    marg, lo, hi, exact, approx, approx2 = quantiles(s, b)
    assert float(marg.min()) >= float(lo) and float(marg.max()) <= float(hi)
    width = float(hi - lo) / num_bins
    err = np.abs(np.asarray(approx) - np.asarray(exact))
    assert err.max() <= width * (1 + 1e-4), (err.max(), width)
    # data-range bounds give a finer bin and still stay within it (approx2: histogram_quantile(marg, p, num_bins))
    width2 = float(marg.max() - marg.min()) / num_bins
    assert np.abs(np.asarray(approx2) - np.asarray(exact)).max() <= width2 * (1 + 1e-3)
    # the inverted-CDF definition: sorted(x)[ceil(p m) - 1]
    np.testing.assert_array_equal(
        np.asarray(exact), np.sort(np.asarray(marg), axis=0)[int(np.ceil(p * 2048)) - 1]
    )


def test_histogram_counts_combine_across_shards():
    """Histogram counts of four shards sum to the whole's, directly and through a psum over a vmapped "data" axis;
    the bias update with ``axis_name`` over that axis equals the single-device update (all in one jit)."""
    s = _skewed_scores(4, m=1024, n=16)
    b = jnp.zeros(16)

    @jax.jit
    def counts_and_updates(s, b):
        marg = margins(s, admission_threshold(s, b, 2))
        lo, hi = margin_bounds(b)
        whole = histogram_counts(marg, lo, hi, 100)
        parts = sum(histogram_counts(marg[i * 256 : (i + 1) * 256], lo, hi, 100) for i in range(4))
        shards = marg.reshape(4, 256, 16)
        summed = jax.vmap(lambda x: jax.lax.psum(histogram_counts(x, lo, hi, 100), "data"), axis_name="data")(
            shards
        )
        s_sh = s.reshape(4, 256, 16)
        nb_dp = jax.vmap(lambda x: qb_bias_update(x, b, 2, axis_name="data"), axis_name="data")(s_sh)
        return whole, parts, summed, nb_dp, qb_bias_update(s, b, 2)

    whole, parts, summed, nb_dp, nb_one = counts_and_updates(s, b)
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(parts))
    assert int(whole.sum()) == 1024 * 16
    # and through a real collective: psum over a vmapped "data" axis equals the single-device update
    np.testing.assert_array_equal(np.asarray(summed[0]), np.asarray(whole))
    np.testing.assert_allclose(np.asarray(nb_dp[0]), np.asarray(nb_one), atol=1e-6)


def test_invalid_k_and_method():
    s = jnp.asarray(FIG5_SCORES)
    with pytest.raises(ValueError, match="k must satisfy"):
        admission_threshold(s, jnp.zeros(4), 4)
    with pytest.raises(ValueError, match="method"):
        qb_bias_update(s, jnp.zeros(4), 1, method="sign")


def test_histogram_quantile_has_no_quadratic_cumsum():
    """The bin cumsum is a log-depth scan: jnp.cumsum lowers to a reduce_window that XLA:GPU runs as
    O(bins^2) work per row (10 ms of an H200 train step for 48 x 1000 bins, benchmarks/RESULTS.md)."""
    counts = jnp.arange(48 * 1000, dtype=jnp.int32).reshape(48, 1000) % 7
    lowered = jax.jit(lambda c: quantile_from_histogram(c, -1.0, 1.0, 0.9)).lower(counts)
    assert "reduce_window" not in lowered.as_text()
    cum = np.cumsum(np.asarray(counts), axis=-1)
    target = 0.9 * cum[:, -1:]
    b = np.argmax(cum >= target - 1e-3, axis=-1)
    got = np.asarray(lowered.compile()(counts))  # the program checked above (one compile, no eager ops)
    np.testing.assert_array_equal(np.floor((got + 1.0) / 2.0 * 1000 + 1e-4).clip(max=999).astype(int), b)
