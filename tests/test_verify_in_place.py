"""Cached multi-token forwards with the stacked cache updated in place (``LayerGroup(in_place=True)``, one device)
against the scanned form (each repeat's cache entry scanned in, the new entries stacked out), which the model still
runs under a multi-device mesh: the speculative verify pass (``record_position_states``: logits, draft features,
KDA state/conv traces, the entry left as it came in) and a cached prefill piece (logits, states, conv tails,
latents). CPU, k3-tiny widths, fp32, both layer kinds in a segment of two repeats."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.cache import init_cache
from k3_jax.layers.kda import record_position_states
from k3_jax.model import FEATURES, K3ForCausalLM
from tests._model_fixtures import scanned_segment_config_and_params

MAX_LEN = 24
LENGTHS = [9, 5, 0]


@pytest.fixture(scope="module")
def setup():
    cfg, params = scanned_segment_config_and_params(seed=5)
    rs = np.random.RandomState(1)
    # a running batch: random states, conv tails and latents, rows at different lengths (one empty)
    cache = jax.tree.map(lambda x: np.asarray(0.3 * rs.standard_normal(x.shape), x.dtype),
                         init_cache(cfg, len(LENGTHS), MAX_LEN))
    cache = {**cache, "lengths": np.asarray(LENGTHS, np.int32)}
    return cfg, {"params": params}, K3ForCausalLM(cfg), cache, rs


def _both_forms(fn, *args):
    """``fn(*args)`` jitted, in place (no mesh) and scanned (a mesh of two devices)."""
    in_place = jax.jit(fn)(*args)
    with jax.set_mesh(jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])):
        scanned = jax.jit(fn)(*args)
    return jax.device_get(in_place), jax.device_get(scanned)


def _assert_trees_close(a, b):
    def close(path, x, y):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path))

    jax.tree_util.tree_map_with_path(close, a, b)


def test_cached_multi_token_forwards_in_place_equal_scanned(setup):
    """One program: the verify pass over 5 tokens and a cached prefill piece of 7 (both from the same cache)."""
    cfg, variables, model, cache, rs = setup
    verify_tokens = jnp.asarray(rs.randint(3, cfg.vocab_size, (len(LENGTHS), 5)), jnp.int32)
    prefill_tokens = jnp.asarray(rs.randint(3, cfg.vocab_size, (len(LENGTHS), 7)), jnp.int32)

    def forwards(variables, verify_tokens, prefill_tokens, cache):
        with record_position_states():
            verify = model.apply(variables, verify_tokens, cache=cache, mutable=[FEATURES])
        return verify, model.apply(variables, prefill_tokens, cache=cache)

    in_place, scanned = _both_forms(forwards, variables, verify_tokens, prefill_tokens, cache)
    _assert_trees_close(in_place, scanned)
    ((_, new), _), (_, filled) = in_place

    # the verify pass: KDA traces beside the entry, which it leaves as it came in; MLA: the 5 new latents
    np.testing.assert_array_equal(new["lengths"], np.asarray(LENGTHS) + 5)
    for seg, old in zip(new["segments"], cache["segments"], strict=True):
        for name, entry in seg.items():
            if "state" in entry:
                state = old[name]["state"]
                assert entry["state_trace"].shape == (*state.shape[:2], 5, *state.shape[2:])
                np.testing.assert_array_equal(entry["state"], state)
                np.testing.assert_array_equal(entry["conv"], old[name]["conv"])
                assert not np.allclose(entry["state_trace"][:, :, 0], state)
            else:
                lat, lat0 = entry["latent"], old[name]["latent"]
                for row, n in enumerate(LENGTHS):
                    np.testing.assert_array_equal(lat[:, row, :n], lat0[:, row, :n])
                    np.testing.assert_array_equal(lat[:, row, n + 5:], lat0[:, row, n + 5:])
                    assert not np.allclose(lat[:, row, n:n + 5], lat0[:, row, n:n + 5])

    # the prefill piece: every state, conv tail and latent updated, nothing more in the entries
    for seg, old in zip(filled["segments"], cache["segments"], strict=True):
        for name, entry in seg.items():
            assert set(entry) == set(old[name])
            for key in entry:
                assert not np.array_equal(entry[key], old[name][key]), (name, key)
