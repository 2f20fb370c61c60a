"""Tests for k3_jax.serving.sampling (batched per-row sampling, stop handling)."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.serving.sampling import (
    SamplingArrays,
    SamplingParams,
    StopStrings,
    hit_stop_token,
    sample,
    stop_id_array,
)


def _arrays(n, temperature=0.0, top_k=0, top_p=1.0, seed=0, step=None):
    full = lambda v, dt: jnp.broadcast_to(jnp.asarray(v, dt), (n,))
    return SamplingArrays(
        temperature=full(temperature, jnp.float32),
        top_k=full(top_k, jnp.int32),
        top_p=full(top_p, jnp.float32),
        seed=full(seed, jnp.uint32),
        step=jnp.arange(n, dtype=jnp.int32) if step is None else full(step, jnp.int32),
    )


def test_greedy_is_argmax_and_logprobs():
    logits = jax.random.normal(jax.random.key(1), (5, 50)) * 3
    out = sample(logits, _arrays(5), num_top_logprobs=3)
    np.testing.assert_array_equal(out.tokens, np.argmax(logits, -1))
    lp = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose(out.logprob, lp[jnp.arange(5), out.tokens], rtol=1e-6)
    np.testing.assert_array_equal(out.top_ids[:, 0], out.tokens)
    np.testing.assert_allclose(out.top_logprobs, jnp.sort(lp, -1)[:, ::-1][:, :3], rtol=1e-6)


def test_temperature_distribution_matches_softmax():
    n = 4000
    base = jnp.log(jnp.asarray([0.5, 0.25, 0.15, 0.1]))
    logits = jnp.broadcast_to(base, (n, 4))
    toks = np.asarray(sample(logits, _arrays(n, temperature=2.0, seed=7)).tokens)
    freq = np.bincount(toks, minlength=4) / n
    want = np.asarray(jax.nn.softmax(base / 2.0))
    np.testing.assert_allclose(freq, want, atol=0.03)


def test_top_k_and_top_p_restrict_support():
    n = 2000
    probs = jnp.asarray([0.05, 0.5, 0.3, 0.15])
    logits = jnp.broadcast_to(jnp.log(probs), (n, 4))
    toks = np.asarray(sample(logits, _arrays(n, temperature=1.0, top_k=2, seed=3)).tokens)
    assert set(np.unique(toks)) == {1, 2}
    toks = np.asarray(sample(logits, _arrays(n, temperature=1.0, top_p=0.7, seed=3)).tokens)
    assert set(np.unique(toks)) == {1, 2}  # smallest prefix with mass >= 0.7 is {0.5, 0.3}
    toks = np.asarray(sample(logits, _arrays(n, temperature=1.0, top_p=0.5, seed=3)).tokens)
    assert set(np.unique(toks)) == {1}
    toks = np.asarray(sample(logits, _arrays(n, temperature=1.0, top_k=1, seed=3)).tokens)
    assert set(np.unique(toks)) == {1}


def test_per_row_parameters_and_seed_independent_of_batch_position():
    logits = jax.random.normal(jax.random.key(0), (1, 64))
    row = dict(temperature=1.3, top_k=20, top_p=0.9, seed=1234, step=5)
    alone = sample(logits, _arrays(1, **row)).tokens[0]
    # same request in row 2 of a mixed batch (greedy + other seeds around it)
    big = jnp.concatenate([jax.random.normal(jax.random.key(9), (2, 64)), logits, logits], 0)
    arrs = SamplingArrays(
        temperature=jnp.asarray([0.0, 0.7, 1.3, 1.3], jnp.float32),
        top_k=jnp.asarray([0, 5, 20, 20], jnp.int32),
        top_p=jnp.asarray([1.0, 0.5, 0.9, 0.9], jnp.float32),
        seed=jnp.asarray([1, 2, 1234, 99], jnp.uint32),
        step=jnp.asarray([0, 0, 5, 5], jnp.int32),
    )
    out = sample(big, arrs).tokens
    assert int(out[2]) == int(alone)
    assert int(out[0]) == int(jnp.argmax(big[0]))
    # different steps of the same seed give different draws (over many steps, not all equal)
    many = sample(jnp.broadcast_to(logits, (32, 64)), _arrays(32, temperature=1.0, seed=1234)).tokens
    assert len(np.unique(np.asarray(many))) > 3


def test_changing_values_does_not_recompile():
    logits = jnp.zeros((3, 16))
    sample(logits, _arrays(3))
    before = sample._cache_size()
    for t, k, p in [(0.5, 3, 0.9), (1.0, 0, 1.0), (0.0, 7, 0.2)]:
        sample(logits, _arrays(3, temperature=t, top_k=k, top_p=p, seed=11)).tokens.block_until_ready()
    assert sample._cache_size() == before


def test_stop_token_ids():
    ids = jnp.asarray(stop_id_array([[2, 5], [], [7]]))
    hits = hit_stop_token(jnp.asarray([5, 2, 7], jnp.int32), ids)
    np.testing.assert_array_equal(hits, [True, False, True])
    with pytest.raises(ValueError, match="stop token ids"):
        stop_id_array([list(range(20))])


def test_stop_strings_streaming():
    s = StopStrings(["END", "\n\n"])
    out = []
    for piece in ["Hel", "lo E", "N", "X wor", "ld\n", "\nmore"]:
        text, stopped = s.push(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "Hello ENX world"
    assert stopped
    s2 = StopStrings(["abc"])
    assert s2.push("xxab") == ("xx", False)
    assert s2.flush() == "ab"
    assert StopStrings([]).push("anything") == ("anything", False)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(stop=("",)), "stop"),
        (dict(logprobs=50), "logprobs"),
        (dict(stop_token_ids=(5000,)), "stop token id"),
    ],
)
def test_validate_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate(vocab_size=1024)


def _primitives(jaxpr) -> set[str]:
    """Names of the primitives in ``jaxpr`` and every jaxpr nested in its equations' parameters."""
    names = set()
    for e in jaxpr.eqns:
        names.add(e.primitive.name)
        stack = list(e.params.values())
        while stack:
            v = stack.pop()
            if isinstance(v, (tuple, list)):
                stack.extend(v)
            elif isinstance(v, jax.extend.core.ClosedJaxpr):
                names |= _primitives(v.jaxpr)
            elif isinstance(v, jax.extend.core.Jaxpr):
                names |= _primitives(v)
    return names


def test_all_greedy_program_skips_the_vocabulary_sort():
    """``sampling=False`` (the engine knows on the host that every row is greedy) is the argmax alone: no sort in
    the program, and the same outputs as the default program for greedy rows; the default sorts and samples."""
    logits = jax.random.normal(jax.random.key(5), (4, 64)) * 2
    greedy = _arrays(4)
    for a, b in zip(sample(logits, greedy, num_top_logprobs=3),
                    sample(logits, greedy, num_top_logprobs=3, sampling=False), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(sample(logits, greedy, sampling=False).tokens),
                                  np.argmax(np.asarray(logits), -1))
    jaxpr = lambda flag: jax.make_jaxpr(lambda lg, p: sample.__wrapped__(lg, p, sampling=flag))(logits, greedy).jaxpr
    assert "sort" not in _primitives(jaxpr(False))
    assert "sort" in _primitives(jaxpr(True))
