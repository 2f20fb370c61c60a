"""Engine tests on the tiny config in fp32: greedy == argmax of a fresh full forward, batching invariance,
slot reuse without leaks, no recompilation as requests come and go, request validation.

"Argmax of a fresh full forward at every step" is checked with one forward per request over
``prompt + generated``: the model is causal, so the logits at position ``i`` of that forward are exactly the
from-scratch logits after ``i + 1`` tokens; the first position where argmax != the engine's token is the first
step where decoding diverges.
"""

import gc
import weakref

import jax
import numpy as np
import pytest

from k3_jax.serving.engine import Engine, RequestError, _prefill_pieces
from k3_jax.serving.sampling import SamplingParams
from tests.serving_common import MAX_LEN, reference_greedy_check, tiny_setup


@pytest.fixture(scope="module")
def setup():
    return tiny_setup()


def _prompts(cfg):
    rs = np.random.RandomState(0)
    return [rs.randint(3, cfg.vocab_size, n).tolist() for n in (1, 15, 70)]


def _run_with_joins(engine, prompts, params, join_after):
    """Add request i after ``join_after[i]`` engine steps; return outputs by request index."""
    outs = {i: [] for i in range(len(prompts))}
    ids, step, done = {}, 0, set()
    while len(done) < len(prompts):
        for i, when in enumerate(join_after):
            if when == step and i not in ids.values():
                ids[engine.add_request(prompts[i], params[i])] = i
        for ev in engine.step():
            outs[ids[ev.request_id]].append(ev.token)
            if ev.finished:
                done.add(ids[ev.request_id])
        step += 1
    return [outs[i] for i in range(len(prompts))]


def test_greedy_equals_full_forward_argmax_with_joins(setup):
    cfg, variables, engine, fwd = setup
    prompts = _prompts(cfg)
    params = [SamplingParams(max_tokens=64, ignore_eos=True)] * 3
    outs = _run_with_joins(engine, prompts, params, join_after=[0, 5, 23])
    for p, o in zip(prompts, outs, strict=True):
        assert len(o) == 64
        reference_greedy_check(fwd, variables, p, o)


def test_batched_sampling_equals_each_alone_and_slot_reuse(setup):
    cfg, variables, engine, fwd = setup
    prompts = _prompts(cfg)
    params = [
        SamplingParams(max_tokens=12, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
        for t, k, p, s in [(0.9, 0, 1.0, 1), (1.3, 50, 0.9, 2), (0.0, 0, 1.0, 3)]
    ]
    together = _run_with_joins(engine, prompts, params, join_after=[2, 0, 4])
    alone = [_run_with_joins(engine, [p], [sp], join_after=[0])[0] for p, sp in zip(prompts, params, strict=True)]
    assert together == alone
    assert len(set(map(tuple, together))) == 3
    # slots were reused many times above: a greedy request is still exact
    out = engine.generate([prompts[1]], max_new_tokens=10, stop_token_ids=())
    reference_greedy_check(fwd, variables, prompts[1], out[0])
    assert not engine.has_work


def test_no_recompilation_and_stop_conditions(setup):
    cfg, _, engine, _ = setup
    prompts = _prompts(cfg)
    decode_before = engine._decode._cache_size()
    prefill_before = engine._prefill._cache_size()
    first = engine.generate([prompts[1]], max_new_tokens=3, stop_token_ids=())[0]
    # stop token id ends the request with the stop token included
    evs = list(engine.generate_stream([prompts[1]], max_new_tokens=10, stop_token_ids=(first[1],)))
    assert [e.token for e in evs] == first[:2] and evs[-1].finish_reason == "stop"
    evs = list(
        engine.generate_stream(
            [prompts[0], prompts[2]], max_new_tokens=4, temperature=0.5, stop_token_ids=(), logprobs=2
        )
    )
    assert sum(e.finished for e in evs) == 2 and all(e.finish_reason == "length" for e in evs if e.finished)
    assert all(e.logprob is not None and e.logprob <= 0 and len(e.top_logprobs) == 2 for e in evs)
    # compiled once each before: all-greedy batches (no sampling sort) and sampling ones, pieces of 16 and of 1
    # (the counts are of the functions engines of this layout share: other engines' shapes may add to them)
    assert engine._decode._cache_size() == decode_before >= 2
    assert engine._prefill._cache_size() == prefill_before >= 2


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], SamplingParams(), "empty"),
        ([5] * MAX_LEN, SamplingParams(), "max_len"),
        ([5, 99999], SamplingParams(), "outside"),
        ([5], SamplingParams(temperature=-1.0), "temperature"),
        ([5], SamplingParams(top_p=0.0), "top_p"),
        ([5], SamplingParams(logprobs=9), "logprobs"),
    ],
)
def test_bad_requests(setup, prompt, params, match):
    engine = setup[2]
    with pytest.raises(RequestError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_work


def test_stop_strings_cut_text(setup):
    cfg, _, engine, _ = setup
    prompt = _prompts(cfg)[1]
    evs = list(engine.generate_stream([prompt], max_new_tokens=16, stop_token_ids=()))
    full = "".join(e.text for e in evs)
    assert len(full) >= 6, full
    stop = full[3:5]
    evs = list(engine.generate_stream([prompt], max_new_tokens=16, stop_token_ids=(), stop=(stop,)))
    assert "".join(e.text for e in evs) == full[: full.index(stop)]
    assert evs[-1].finish_reason == "stop" and len(evs) < 16


def test_prefill_pieces():
    assert _prefill_pieces(70, 16) == [16, 16, 16, 16, 4, 2]
    assert _prefill_pieces(70, 16, "unit") == [16] * 4 + [1] * 6
    assert _prefill_pieces(1, 64) == [1] and _prefill_pieces(64, 64) == [64]
    assert all(sum(_prefill_pieces(n, 8)) == n for n in range(1, 40))
    with pytest.raises(ValueError, match="mode"):
        _prefill_pieces(3, 8, "bogus")


def test_multi_step_decode_equals_single_steps(setup):
    """``decode_block=4`` (4 decode steps per device call) gives the single-step engine's tokens exactly:
    greedy and seeded sampling, requests joining mid-flight, max_tokens not a multiple of 4, a stop token
    inside a block.

    The block engine is the shared engine with ``decode_block`` set to 4 for this test (the engine reads it at
    every step, as test_speculative does for its rounds): same prefill programs, so only the block decode
    compiles; its ``_decode_multi`` cache grows by exactly the two block programs."""
    cfg, variables, engine, fwd = setup
    prompts = _prompts(cfg)
    params = [
        SamplingParams(max_tokens=13, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.2, top_k=20, seed=7, ignore_eos=True),
    ]
    want = _run_with_joins(engine, prompts, params, join_after=[0, 1, 3])
    multi_before = engine._decode_multi._cache_size()
    engine.decode_block = 4
    try:
        got = _run_with_joins(engine, prompts, params, join_after=[0, 1, 3])
        assert got == want
        # the block path ran, compiled once with sampling and once all-greedy (request 0 alone at the end)
        assert engine._decode_multi._cache_size() - multi_before == 2
        reference_greedy_check(fwd, variables, prompts[0], got[0])
        stop = want[0][6]
        evs = list(engine.generate_stream([prompts[0]], max_new_tokens=12, stop_token_ids=(stop,)))
        assert [e.token for e in evs] == want[0][: want[0].index(stop) + 1] and evs[-1].finish_reason == "stop"
        assert not engine.has_work
    finally:
        engine.decode_block = 1


def test_engines_of_one_layout_share_their_jitted_functions_and_hold_no_engine(setup):
    """A second engine of the same model, dtype and cache layout (other slot count) reuses the first one's jitted
    functions, so their compiled programs; each program compiles once; another compute dtype gets its own
    functions; the shared functions keep no engine alive."""
    cfg, variables, engine, _ = setup
    other = Engine(cfg, variables["params"], max_batch=2, max_len=MAX_LEN)
    names = ("_prefill", "_decode", "_decode_multi", "_reset", "_take_kda", "_put_kda", "_copy_page", "_sample")
    assert all(getattr(other, n) is getattr(engine, n) for n in names)
    # committed parameters (as a restored checkpoint's) and a slot count no other test uses: a greedy request
    # compiles one prefill piece shape and one decode program, once each (a fresh uncommitted cache compiled both
    # again on the committed outputs of their first call)
    five = Engine(cfg, jax.device_put(variables["params"], jax.devices()[0]), max_batch=5, max_len=MAX_LEN,
                  prefill_chunk=16, prefill_mode="unit")
    before = five._decode._cache_size(), five._prefill._cache_size()
    five.generate([[5, 6, 7]], max_new_tokens=3, stop_token_ids=())
    assert (five._decode._cache_size(), five._prefill._cache_size()) == (before[0] + 1, before[1] + 1)
    bf16 = Engine(cfg.replace(dtype="bfloat16"), variables["params"], max_batch=2, max_len=MAX_LEN)
    assert bf16._decode is not engine._decode and bf16._prefill is not engine._prefill
    gone = weakref.ref(bf16)  # the engine that built its layout's functions
    del bf16
    gc.collect()
    assert gone() is None, "a shared jitted function holds the engine that built it"


def test_one_device_engine_keeps_its_state_on_the_parameters_device(setup):
    """Parameters committed to another device (one engine per device): the cache is made there, nothing moves to
    the default device; uncommitted parameters are committed to the default device."""
    cfg, variables, _, _ = setup
    if jax.device_count() < 2:
        pytest.skip("needs 2 (virtual) devices; see tests/conftest.py")
    dev = jax.devices()[1]
    engine = Engine(cfg, jax.device_put(variables["params"], dev), max_batch=2, max_len=MAX_LEN)
    leaves = jax.tree.leaves(engine.cache) + jax.tree.leaves(engine.variables)
    assert all(x.committed and x.sharding.device_set == {dev} for x in leaves)
    default = Engine(cfg, variables["params"], max_batch=2, max_len=MAX_LEN)
    assert all(x.committed and x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(default.cache))
