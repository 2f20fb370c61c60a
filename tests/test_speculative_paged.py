"""Speculative decoding on the paged latent cache, with the prefix cache (micro fp32 model of test_speculative):
greedy output equals the plain paged engine's (several k, batch 3 with per-row draft lengths, prompts of 1 to 18
tokens through a pool too small for all of them, so requests wait for pages and reuse freed ones; one- and
three-round calls), the draft's cache of a request prefilled while others decode is the one it gets alone, every
page returns to the pool, a prefix-cache hit (at a prefill endpoint and at an endpoint a speculative round
reached) gives the tokens of the cold run, and sampled output equals the contiguous speculative engine's for the
same seeds."""

import functools

import numpy as np

from k3_jax.serving.engine import Engine
from k3_jax.serving.prefix_cache import PrefixCacheConfig
from k3_jax.serving.sampling import SamplingParams
from k3_jax.serving.speculative import SpeculativeEngine
from tests.test_speculative import MAX_LEN, _draft, _greedy, _run, _setup

PAGE = 4
PAGES = 14  # 13 usable pages of 4 tokens: the four requests below need 4 + 5 + 6 + 8
PC = PrefixCacheConfig(page_size=PAGE, block_size=2, stride=4, mla_budget_bytes=1 << 20, kda_budget_bytes=1 << 20)


def _prompts():
    rs = np.random.RandomState(4)
    return [rs.randint(3, 8, n).tolist() for n in (1, 4, 7, 18)]


@functools.cache
def _plain_paged():
    cfg, params, _ = _setup()
    return Engine(cfg, params, max_batch=3, max_len=MAX_LEN, paged=True, page_size=PAGE, num_pages=PAGES,
                  prefill_chunk=4, prefill_mode="unit")


def _spec(**kw):
    """A paged speculative engine (k = 3) of the micro model over ``_setup``'s target and an MLA draft."""
    cfg, params, _ = _setup()
    dcfg, dparams = _draft("mla", 1)
    return SpeculativeEngine(cfg, params, dparams, dcfg, num_draft_tokens=3, max_batch=3, max_len=MAX_LEN,
                             paged=True, page_size=PAGE, prefill_chunk=4, prefill_mode="unit", **kw)


@functools.cache
def _paged_spec():
    return _spec(num_pages=PAGES)


def _pool_back(engine, held: int = 0) -> None:
    """Idle engine: every usable page is free, or held (once) by the prefix cache."""
    assert not engine.has_work
    alloc = engine.allocator
    assert alloc.num_free + held == engine.page_spec.num_pages - 1
    assert not alloc.table.any() and not any(alloc.owned)
    assert (alloc.refs[alloc.free_pages] == 0).all()


def _draft_rows_at_first_token(engine, prompts, draft_tokens) -> dict[int, tuple[int, np.ndarray]]:
    """Run greedy requests together; per request, its draft cache row (length, latent rows) after the engine step
    that produced its first token (its prefill's last piece and its first round)."""
    ids = [engine.add_request(p, _greedy(), draft_tokens=d) for p, d in zip(prompts, draft_tokens, strict=True)]
    rows = {}
    while engine.has_work:
        for ev in engine.step():
            if ev.index == 0:
                slot = engine._by_id[ev.request_id].slot
                n = int(engine.dcache["lengths"][slot])
                rows[ids.index(ev.request_id)] = (n, np.asarray(engine.dcache["layer"]["latent"][slot, :n]))
    return rows


def test_paged_greedy_identical_and_pages_return():
    prompts = _prompts()
    want = _run(_plain_paged(), prompts, [_greedy()] * 4)
    spec = _paged_spec()
    got = _run(spec, prompts, [_greedy()] * 4, draft_tokens=[3, 1, 2, 3])
    assert got == want
    assert spec.stats["waits_for_pages"] > 0  # the fourth request waited for a finished one's pages
    hist = spec.spec.accepted_hist
    assert any(0 < n < 3 for n in hist) and 0 in hist, hist  # rows accepted different numbers of drafts
    _pool_back(spec)
    # the draft's cache of a request prefilled piece by piece while other rows ran rounds is the one it gets alone
    # (the outputs cannot tell: verification is lossless)
    together = _draft_rows_at_first_token(spec, prompts, [3, 1, 2, 3])
    for i, (p, d) in enumerate(zip(prompts, [3, 1, 2, 3], strict=True)):
        (alone,) = _draft_rows_at_first_token(spec, [p], [d]).values()
        assert together[i][0] == alone[0] == len(p)  # n - 1 prompt pairs + the first round's pending pair
        np.testing.assert_allclose(together[i][1], alone[1], rtol=1e-5, atol=1e-6)
    spec.decode_block = 3  # rounds in blocks: the page table is an argument of the scanned rounds
    try:
        steps = spec.stats["decode_steps"]
        assert _run(spec, prompts, [_greedy()] * 4, draft_tokens=[2, 3, 1, 2]) == want
        assert spec.stats["decode_steps"] - steps > 3
    finally:
        spec.decode_block = 1
    _pool_back(spec)


def test_sampling_equals_contiguous_speculative_engine():
    """Same seeds, same tokens as the contiguous-cache speculative engine: the acceptance rule and its random
    draws are untouched by the paged cache (test_speculative checks the rule's distribution by chi-square)."""
    cfg, params, _ = _setup()
    dcfg, dparams = _draft("mla", 1)
    contiguous = SpeculativeEngine(cfg, params, dparams, dcfg, num_draft_tokens=3, max_batch=3, max_len=MAX_LEN,
                                   prefill_chunk=4, prefill_mode="unit")
    prompts = [[3], [5, 4], [6, 3, 7]]  # prefill pieces of one token: few compiles
    sampled = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, top_p=0.9, seed=s) for s in (1, 2, 3)]
    spec = _paged_spec()
    want = _run(contiguous, prompts, sampled)
    assert _run(spec, prompts, sampled) == want
    assert len({tuple(o) for o in want}) == 3
    _pool_back(spec)


def _alone(engine, prompt, n=12, cold=False):
    """(greedy tokens, tokens restored from the prefix cache) of one request run alone."""
    prefix = engine.prefix
    before = prefix.stats["cached_tokens"]
    engine.prefix = None if cold else prefix
    try:
        (out,) = _run(engine, [prompt], [_greedy(n)])
    finally:
        engine.prefix = prefix
    return out, prefix.stats["cached_tokens"] - before


def test_prefix_hit_with_speculation_equals_cold():
    spec = _spec(prefix_cache=PC)
    plain = _plain_paged()
    p = _prompts()[3][:14]
    cold, cached = _alone(spec, p, cold=True)
    assert cached == 0 and cold == _run(plain, [p], [_greedy(12)])[0]
    first, cached = _alone(spec, p)  # fills the cache: entries at 4, 8, 12 from the prefill, more from rounds
    assert cached == 0 and first == cold
    hits = spec.prefix.stats["hits"]
    again, cached = _alone(spec, p)
    assert cached == 12 and again == cold and spec.prefix.stats["hits"] == hits + 1
    # rounds stored entries only where their kept tokens ended on an endpoint: prompt + committed output
    full = p + cold
    decoded = [e for e in range(16, len(full), 4) if spec.prefix.has_entry(full, e)]
    assert decoded, "no speculative round stored an entry"
    # the next turn (prompt + reply + new tokens) starts from the last entry a round stored, and equals cold
    turn2 = full + [5, 3, 6]
    want, _ = _alone(spec, turn2, n=6, cold=True)
    got, cached = _alone(spec, turn2, n=6)
    assert cached == decoded[-1] and got == want == _run(plain, [turn2], [_greedy(6)])[0]
    # two requests at once on the pages of one entry (12 tokens: 3 full pages mapped read-only by both)
    both = [p[:12] + [3, 4], p[:12] + [6]]
    hits, cached_before = spec.prefix.stats["hits"], spec.prefix.stats["cached_tokens"]
    assert _run(spec, both, [_greedy(8)] * 2, draft_tokens=[3, 2]) == _run(plain, both, [_greedy(8)] * 2)
    assert spec.prefix.stats["hits"] == hits + 2 and spec.prefix.stats["cached_tokens"] == cached_before + 24
    assert spec.spec.accepted > 0
    _pool_back(spec, held=spec.prefix.num_pages)
    spec.prefix.clear()
    _pool_back(spec)
