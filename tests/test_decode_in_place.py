"""The one-token decode step with the stacked cache updated in place (``LayerGroup(in_place=True)``) against the
scanned form (each repeat's cache entry scanned in, the new entries stacked out), which the model still runs
under a multi-device mesh: greedy tokens identical over a long generation, caches equal (CPU, k3-tiny, fp32)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.cache import init_cache
from k3_jax.model import K3ForCausalLM
from tests._model_fixtures import scanned_segment_config_and_params

STEPS = 40
MAX_LEN = 80


@pytest.fixture(scope="module")
def setup():
    cfg, params = scanned_segment_config_and_params(seed=3)
    return cfg, {"params": params}, K3ForCausalLM(cfg)


def _greedy(model, variables, cache, first, steps):
    """``steps`` greedy decode steps from ``cache``; returns (tokens [steps, B], final cache)."""

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(variables, cache, tok):
        logits, cache = model.apply(variables, tok[:, None], cache=cache)
        return jnp.argmax(logits[:, 0], -1).astype(jnp.int32), cache

    toks, tok = [], first
    for _ in range(steps):
        tok, cache = step(variables, cache, tok)
        toks.append(np.asarray(tok))
    return np.stack(toks), cache


GPU_FORMS = dict(platform="gpu", **{f"{op}_implementation": "xla" for op in (
    "kda", "kda_decode", "kda_verify", "moe", "mla_attention", "mla_prefix_attention", "mla_decode_attention",
    "mla_paged_decode")})
"""A GPU target with every kernel choice on XLA: the model's GPU-only forms (the small parameters read by
``select_repeat``, the router's ranking, the per-head gated norm) run on this CPU host."""


def _running_batch(cfg, seed: int, lengths: list[int]):
    """``(cache, first tokens)`` of a running batch: random states, conv tails and latents, rows at ``lengths``."""
    rs = np.random.RandomState(seed)
    cache = jax.tree.map(lambda x: jnp.asarray(0.3 * rs.standard_normal(x.shape), x.dtype),
                         init_cache(cfg, len(lengths), MAX_LEN))
    cache = {**cache, "lengths": jnp.asarray(lengths, jnp.int32)}
    return cache, jnp.asarray(rs.randint(3, cfg.vocab_size, len(lengths)), jnp.int32)


def copy(cache):
    return jax.tree.map(jnp.copy, cache)


def test_in_place_decode_equals_scanned_decode(setup):
    cfg, variables, model = setup
    cache, first = _running_batch(cfg, 0, [9, 5, 2])
    new_toks, new_cache = _greedy(model, variables, copy(cache), first, STEPS)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    with jax.set_mesh(mesh):  # a mesh of more than one device: the scanned form
        old_toks, old_cache = _greedy(model, variables, copy(cache), first, STEPS)

    np.testing.assert_array_equal(new_toks, old_toks)
    assert len(set(new_toks[:, 0].tolist())) > 3  # a real generation, not one repeated token
    np.testing.assert_array_equal(np.asarray(new_cache["lengths"]), np.asarray(cache["lengths"]) + STEPS)
    for a, b in zip(jax.tree.leaves(new_cache), jax.tree.leaves(old_cache), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_gpu_forms_of_the_in_place_decode_equal_the_host_forms(setup):
    """The in-place decode with the GPU target's forms (:data:`GPU_FORMS`) against the host's: the same greedy
    tokens, caches within fp32 rounding."""
    cfg, variables, model = setup
    cache, first = _running_batch(cfg, 1, [7, 3, 11])
    host_toks, host_cache = _greedy(model, variables, copy(cache), first, 12)
    gpu_toks, gpu_cache = _greedy(K3ForCausalLM(cfg.replace(**GPU_FORMS)), variables, copy(cache), first, 12)
    np.testing.assert_array_equal(gpu_toks, host_toks)
    for a, b in zip(jax.tree.leaves(gpu_cache), jax.tree.leaves(host_cache), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_select_repeat_is_the_row_exactly():
    """The in-place decode's read of a small stacked parameter (``select_repeat``): the row itself, bit for bit,
    whatever the other rows hold (inf, NaN), in the stack's dtype."""
    from k3_jax.model import select_repeat

    rows = np.random.RandomState(0).standard_normal((5, 3, 7)).astype(np.float32)
    rows[1, 0, 0], rows[3, 2, 1] = np.inf, np.nan
    for dtype in (jnp.float32, jnp.bfloat16):
        stack = jnp.asarray(rows, dtype)
        for r in (0, 2, 4):
            got = jax.jit(select_repeat)(stack, jnp.int32(r))
            assert got.dtype == stack.dtype
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(stack[r], np.float32))
