"""Tests for the KDA affine state maps (pallas_kernels/kda/state_map.py) used by sequence parallelism."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda.reference import kda_gate, l2norm, recurrent_kda
from pallas_kernels.kda.state_map import (
    apply_state_map,
    chunk_affine_state_map,
    compose_state_maps,
    identity_state_map,
)

B, H, K, V = 2, 2, 16, 8
LENGTHS = [48, 48, 48, 48]  # four ranges (shards); 48 is not a multiple of the chunk size used (32)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(T, seed=0):
    rng = np.random.default_rng(seed)

    def n(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    q, k, v = l2norm(n(B, T, H, K)), l2norm(n(B, T, H, K)), n(B, T, H, V)
    g = kda_gate(2.0 * n(B, T, H, K), n(H), n(H * K))
    beta = jax.nn.sigmoid(n(B, T, H))
    return q, k, v, g, beta, n(B, H, K, V)


def _ranges(T):
    edges = np.concatenate([[0], np.cumsum(LENGTHS)])
    assert edges[-1] == T
    return [slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def _numpy_states(k, v, g, beta, s0, seg=None):
    """float64 numpy recurrence (independent of the JAX code); returns the state after every token."""
    k, v, g, beta = (np.asarray(x, np.float64) for x in (k, v, g, beta))
    S = np.array(s0, np.float64)
    out = []
    for t in range(k.shape[1]):
        if seg is not None and t > 0:
            S = np.where((np.asarray(seg)[:, t] != np.asarray(seg)[:, t - 1])[:, None, None, None], 0.0, S)
        S = S * np.exp(g[:, t])[..., None]
        err = v[:, t] - np.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + np.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k[:, t], err)
        out.append(S)
    return out


def test_single_range_map_matches_recurrence():
    T = 100
    q, k, v, g, beta, s0 = _inputs(T, seed=1)
    m, u = chunk_affine_state_map(k, g, beta, v)
    assert m.shape == (B, H, K, K) and u.shape == (B, H, K, V) and m.dtype == jnp.float32
    _, s_ref = recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert _rel(apply_state_map((m, u), s0), s_ref) <= 1e-5
    assert _rel(u, _numpy_states(k, v, g, beta, np.zeros(s0.shape))[-1]) <= 1e-5  # zero initial state -> U


def test_four_ranges_sequential_and_associative_scan():
    T = sum(LENGTHS)
    q, k, v, g, beta, s0 = _inputs(T, seed=2)
    maps = [chunk_affine_state_map(k[:, r], g[:, r], beta[:, r], v[:, r], chunk_size=32) for r in _ranges(T)]
    # sequential composition == whole range
    acc = identity_state_map(B, H, K, V)
    for mp in maps:
        acc = compose_state_maps(acc, mp)
    states = _numpy_states(k, v, g, beta, s0)
    assert _rel(apply_state_map(acc, s0), states[-1]) <= 1e-5
    # associative_scan prefix maps == states at every shard boundary
    stacked = (jnp.stack([m for m, _ in maps]), jnp.stack([u for _, u in maps]))
    prefix = jax.lax.associative_scan(compose_state_maps, stacked)
    end = 0
    for i, n in enumerate(LENGTHS):
        end += n
        got = apply_state_map((prefix[0][i], prefix[1][i]), s0)
        assert _rel(got, states[end - 1]) <= 1e-5, i


def test_segments_reset_inside_and_at_range_start():
    T = sum(LENGTHS)
    q, k, v, g, beta, s0 = _inputs(T, seed=3)
    # documents: [0, 60) [60, 96) [96, 192): a reset inside range 1 and exactly at the start of range 2 (96)
    seg = jnp.asarray(np.repeat(np.array([[0, 1, 2]]), [60, 36, 96], axis=1).repeat(B, 0), jnp.int32)
    ranges = _ranges(T)
    maps = []
    for r in ranges:
        prev = None if r.start == 0 else seg[:, r.start - 1]
        maps.append(
            chunk_affine_state_map(k[:, r], g[:, r], beta[:, r], v[:, r], segment_ids=seg[:, r], prev_segment_ids=prev)
        )
    assert float(jnp.max(jnp.abs(maps[1][0]))) == 0.0  # reset inside range 1 -> M == 0
    assert float(jnp.max(jnp.abs(maps[2][0]))) == 0.0  # reset at the start of range 2 -> M == 0
    assert float(jnp.max(jnp.abs(maps[0][0]))) > 0.0
    stacked = (jnp.stack([m for m, _ in maps]), jnp.stack([u for _, u in maps]))
    prefix = jax.lax.associative_scan(compose_state_maps, stacked)
    states = _numpy_states(k, v, g, beta, s0, seg)
    end = 0
    for i, n in enumerate(LENGTHS):
        end += n
        assert _rel(apply_state_map((prefix[0][i], prefix[1][i]), s0), states[end - 1]) <= 1e-5, i
