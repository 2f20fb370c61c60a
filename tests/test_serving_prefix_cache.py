"""Hybrid prefix cache + chunked prefill interleaved with decode, on the tiny fp32 model.

One paged engine for the module (pages of 16 tokens, hash blocks of 4, KDA snapshots every 8 tokens, prefill
pieces of 8 + single tokens): 2 prefill shapes and 1 decode step are compiled once. "Cold" runs use the same
engine with its prefix cache detached (same pieces, same compiled functions), so a hit is compared with the
exact computation it replaces.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.serving.engine import Engine
from k3_jax.serving.paged_cache import PageAllocator, PagedCacheSpec
from k3_jax.serving.prefix_cache import PrefixCache, PrefixCacheConfig, block_hashes
from k3_jax.serving.sampling import SamplingParams
from tests.serving_common import MAX_LEN, tiny_setup

PC = PrefixCacheConfig(page_size=16, block_size=4, stride=8, mla_budget_bytes=1 << 24, kda_budget_bytes=1 << 24)
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def eng():
    cfg, variables, _, _ = tiny_setup()
    engine = Engine(cfg, variables["params"], max_batch=3, max_len=MAX_LEN, prefill_chunk=8, prefill_mode="unit",
                    paged=True, eos_ids=(), prefix_cache=PC)
    first_logits = []
    sample = engine._sample

    def recording_sample(logits, samp, num_top_logprobs, sampling=True):  # the prefill's last logits [1, V] f32
        first_logits.append(np.asarray(logits[0]))
        return sample(logits, samp, num_top_logprobs=num_top_logprobs, sampling=sampling)

    engine._sample = recording_sample
    engine.first_logits = first_logits
    return engine


def _prompt(n, seed):
    return np.random.RandomState(seed).randint(3, 1024, n).tolist()


def _run(engine, prompt, cold=False):
    """(greedy tokens, first-token logits, tokens restored from the cache) of one request run alone."""
    prefix = engine.prefix
    if cold:
        engine.prefix = None
    before = prefix.stats["cached_tokens"]
    try:
        out = engine.generate([prompt], max_new_tokens=GREEDY.max_tokens, stop_token_ids=())[0]
    finally:
        engine.prefix = prefix
    return out, engine.first_logits[-1], prefix.stats["cached_tokens"] - before


def _assert_pool_consistent(engine):
    """Idle engine: every page is free or held by the cache exactly once."""
    held = engine.prefix.num_pages
    assert not engine.has_work
    assert engine.allocator.num_free + held == engine.page_spec.num_pages - 1
    assert (engine.allocator.refs[engine.allocator.free_pages] == 0).all()


def test_hit_at_endpoint_equals_cold_across_page_boundary(eng):
    """30 tokens: entries at 8, 16, 24; the hit at 24 shares page 0 and copies page 1 (holding 16..23)."""
    p = _prompt(30, 0)
    cold, cold_logits, cached = _run(eng, p, cold=True)
    assert cached == 0
    first, _, cached = _run(eng, p)  # fills the cache (no entry yet at admission)
    assert cached == 0 and first == cold
    hit = eng.prefix.lookup(p)
    assert hit.end == 24 and len(hit.shared_pages) == 1 and hit.partial_page is not None
    eng.prefix.unpin(hit)
    out, logits, cached = _run(eng, p)
    assert cached == 24 and out == cold
    np.testing.assert_allclose(logits, cold_logits, rtol=1e-5, atol=1e-5)
    _assert_pool_consistent(eng)


def test_hit_at_non_endpoint_falls_back_to_previous_endpoint(eng):
    """A prompt equal to a cached one for 21 tokens: the hit is at endpoint 16 (a page boundary: no copy)."""
    base = _prompt(30, 0)
    for n_same, want in ((21, 16), (27, 24), (7, 0)):
        p = base[:n_same] + _prompt(30 - n_same, n_same)
        cold, cold_logits, _ = _run(eng, p, cold=True)
        out, logits, cached = _run(eng, p)
        assert cached == want and out == cold
        np.testing.assert_allclose(logits, cold_logits, rtol=1e-5, atol=1e-5)


def test_snapshot_equals_separately_computed_state(eng):
    """The snapshot at 16 (taken after a prefill piece of 8 tokens, chunked KDA) equals the state of a
    token-by-token prefill of the same 16 tokens (recurrent KDA) in another slot."""
    p = _prompt(30, 0)
    hit = eng.prefix.lookup(p, limit=16)
    assert hit.end == 16
    eng.prefix.unpin(hit)
    slot = jnp.asarray(2, jnp.int32)
    eng.allocator.ensure(2, 16)
    table = jnp.asarray(eng.allocator.table)
    cache = eng._reset(eng.cache, slot)
    for t in p[:16]:
        _, cache = eng._prefill(eng.variables, cache, slot, jnp.asarray([[t]], jnp.int32), table)
    eng.cache = cache
    state = eng._take_kda(eng.cache, slot)
    eng.allocator.free(2)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(hit.snapshot), strict=True):  # two KDA algorithms
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4)
    at_8 = eng.prefix.lookup(p, limit=8)
    eng.prefix.unpin(at_8)
    gap = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
              for a, b in zip(jax.tree.leaves(at_8.snapshot), jax.tree.leaves(hit.snapshot), strict=True))
    assert gap > 1e-2  # the tolerance above tells snapshots of different endpoints apart


def test_generated_tokens_are_reused_by_the_next_turn(eng):
    """A 20-token prompt generating 5 tokens: the decode step that brings its cache to 24 tokens stores the
    entry of prompt + 4 generated tokens; the next turn (prompt + reply + 7 new tokens) starts at 24, not at the
    prompt's last endpoint 16, and equals its cold run (the snapshot came from decode steps, so the logits
    agree to rounding, not bit for bit)."""
    p = _prompt(20, 21)
    reply, _, _ = _run(eng, p)
    assert eng.prefix.has_entry(p + reply, 24) and not eng.prefix.has_entry(p + reply, 32)
    turn2 = p + reply + _prompt(7, 22)
    cold, cold_logits, _ = _run(eng, turn2, cold=True)
    out, logits, cached = _run(eng, turn2)
    assert cached == 24 and out == cold
    np.testing.assert_allclose(logits, cold_logits, rtol=1e-4, atol=1e-4)
    _assert_pool_consistent(eng)


def test_concurrent_requests_share_prefix_pages(eng):
    """A request that has prefilled 16 tokens (entries at 8 and 16) is joined by two with the same 20-token
    prefix: they map its page 0 (count 3 + the cache), copy nothing, and all three equal their cold runs."""
    base = _prompt(20, 5)
    prompts = [base + _prompt(10, 50 + i) for i in range(3)]
    colds = [_run(eng, q, cold=True)[0] for q in prompts]
    outs = {}
    rid0 = eng.add_request(prompts[0], GREEDY)
    while True:  # step until the entry at 16 exists
        hit = eng.prefix.lookup(prompts[1])
        eng.prefix.unpin(hit)
        if hit is not None and hit.end == 16:
            break
        for ev in eng.step():
            outs.setdefault(ev.request_id, []).append(ev.token)
    ids = [rid0] + [eng.add_request(q, GREEDY) for q in prompts[1:]]
    hits_before = eng.prefix.stats["hits"]
    eng.step()  # admits both
    page0 = eng.allocator.owned[0][0]
    assert [eng.allocator.owned[s][0] for s in range(3)] == [page0] * 3
    assert eng.allocator.refs[page0] == 4 and eng.prefix.stats["hits"] == hits_before + 2
    while eng.has_work:
        for ev in eng.step():
            outs.setdefault(ev.request_id, []).append(ev.token)
    assert [outs[i] for i in ids[1:]] == colds[1:]
    _assert_pool_consistent(eng)


def test_eviction_under_tiny_budgets(eng):
    """Budgets of two snapshots and three pages: LRU entries go, the byte figures stay within budget, pages
    return to the pool, and a hit after evictions is still exact."""
    pc = eng.prefix
    snap_bytes = pc.snapshot_bytes // pc.num_entries
    pc.config = dataclasses.replace(PC, kda_budget_bytes=2 * snap_bytes, mla_budget_bytes=3 * pc.page_bytes)
    try:
        pc._fit_budgets()
        assert pc.snapshot_bytes <= 2 * snap_bytes and pc.mla_bytes <= 3 * pc.page_bytes
        evicted = pc.stats["evictions_kda_budget"] + pc.stats["evictions_mla_budget"]
        assert evicted > 0 and pc.stats["evicted_pages"] > 0
        p = _prompt(40, 9)
        cold, cold_logits, _ = _run(eng, p, cold=True)
        _run(eng, p)
        assert pc.num_entries <= 2 and pc.snapshot_bytes <= 2 * snap_bytes and pc.mla_bytes <= 3 * pc.page_bytes
        out, logits, cached = _run(eng, p)
        assert cached == 32 and out == cold  # the newest entries survive
        np.testing.assert_allclose(logits, cold_logits, rtol=1e-5, atol=1e-5)
        _assert_pool_consistent(eng)
    finally:
        pc.config = PC


def test_long_prompt_prefill_interleaves_with_decode(eng):
    """A 100-token prompt is prefilled 8 tokens per step; a short request added one step later decodes
    while the long prompt is still being prefilled; both equal their cold outputs."""
    long_p, short_p = _prompt(100, 11), _prompt(5, 12)
    cold_long, cold_short = _run(eng, long_p, cold=True)[0], _run(eng, short_p, cold=True)[0]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    order, outs = [], {}
    rid_long = eng.add_request(long_p, params)
    step = 0
    while eng.has_work:
        if step == 1:
            rid_short = eng.add_request(short_p, params)
        for ev in eng.step():
            order.append((step, ev.request_id))
            outs.setdefault(ev.request_id, []).append(ev.token)
        step += 1
    first_long = min(s for s, r in order if r == rid_long)
    short_steps = [s for s, r in order if r == rid_short]
    assert first_long >= 100 // 8 and len([s for s in short_steps if s < first_long]) == 5
    assert outs[rid_long] == cold_long and outs[rid_short] == cold_short


def test_server_reuses_the_cache_across_turns_and_serves_metrics(eng):
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from k3_jax.serving.server import create_app
    from k3_jax.tokenizer import Tokenizer

    app = create_app(eng, Tokenizer.bundled())
    msgs = [{"role": "user", "content": "Tell me a long story about a cat and a dog who live in a small house."}]
    body = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with TestClient(app) as client:
        r1 = client.post("/v1/chat/completions", json={**body, "messages": msgs})
        assert r1.status_code == 200, r1.text
        before = eng.prefix.stats["cached_tokens"]
        msgs += [{"role": "assistant", "content": "Once upon a time"}, {"role": "user", "content": "And then?"}]
        r2 = client.post("/v1/chat/completions", json={**body, "messages": msgs})
        assert r2.status_code == 200, r2.text
        assert eng.prefix.stats["cached_tokens"] - before >= 16  # turn 2 started from turn 1's prompt
        r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    val = lambda name: fams[name].samples[0].value
    s = eng.prefix.stats
    assert val("k3_prefix_cache_hits") == s["hits"] > 0
    assert val("k3_prefix_cache_hit_rate") == pytest.approx(s["hits"] / s["queries"])
    assert val("k3_prefix_cache_cached_tokens") == s["cached_tokens"]
    assert val("k3_prefix_cache_snapshot_bytes") == eng.prefix.snapshot_bytes
    assert val("k3_prefix_cache_snapshot_budget_bytes") == PC.kda_budget_bytes
    ev = {smp.labels["reason"]: smp.value for smp in fams["k3_prefix_cache_evictions"].samples}
    assert ev == {r: s[f"evictions_{r}"] for r in ("kda_budget", "mla_budget", "pool")}  # whatever ran before
    ttft = {smp.name: smp.value for smp in fams["k3_time_to_first_token_seconds"].samples}
    assert ttft["k3_time_to_first_token_seconds_count"] == eng.metrics.ttft.count > 0
    assert fams["k3_time_per_output_token_seconds"].type == "histogram"


# ---------------------------------------------------------------------------------------------- host-only
def _host_cache(**kw):
    spec = PagedCacheSpec(num_slots=2, max_len=64, page_size=8, num_pages=20, num_mla_layers=1, latent_dim=4,
                          num_kda_layers=1, kda_heads=1, kda_head_dim=2, conv_width=2)
    cfg = PrefixCacheConfig(page_size=8, block_size=2, stride=4, mla_budget_bytes=kw.get("mla", 1 << 20),
                            kda_budget_bytes=kw.get("kda", 1 << 20))
    alloc = PageAllocator(spec)
    return PrefixCache(cfg, alloc, page_bytes=100), alloc


def test_hash_collision_never_shares_an_entry(monkeypatch):
    pc, alloc = _host_cache()
    alloc.ensure(0, 8)
    a, b = [5, 6, 7, 8, 9], [1, 2, 3, 4, 9]
    assert pc.insert(a, 4, alloc.owned[0], "snap-a", 10)
    import k3_jax.serving.prefix_cache as mod

    monkeypatch.setattr(mod, "block_hashes", lambda toks, bs, media=(): block_hashes(a[: len(toks)], bs))
    assert pc.lookup(b) is None and pc.stats["hash_mismatches"] > 0
    assert not pc.insert(b, 4, alloc.owned[0], "snap-b", 10)
    monkeypatch.undo()
    hit = pc.lookup(a)
    assert hit.snapshot == "snap-a" and hit.end == 4
    # media digests are part of the identity: same tokens, other image -> no hit
    assert pc.lookup(a, media=[(0, 2, b"img-1")]) is None
    assert block_hashes(a, 2, [(0, 2, b"x")])[0] != block_hashes(a, 2)[0]


def test_lru_budgets_pins_and_page_counts():
    pc, alloc = _host_cache(kda=25, mla=200)  # two snapshots of 10 bytes, two pages of 100
    seqs = [[i] * 9 for i in range(1, 4)]
    for slot_seq in seqs:
        alloc.ensure(0, 8)
        assert pc.insert(slot_seq, 4, alloc.owned[0], slot_seq[0], 10)
        alloc.free(0)  # the cache keeps its page
    assert pc.num_entries == 2 and pc.stats["evictions_kda_budget"] == 1
    assert pc.lookup(seqs[0]) is None  # the oldest went
    hit = pc.lookup(seqs[1])  # pinned and now most recent
    alloc.ensure(0, 8)
    assert pc.insert([9] * 9, 4, alloc.owned[0], 9, 10)
    assert pc.lookup(seqs[2]) is None and hit._entry.pins == 1  # the pinned one survived
    pc.unpin(hit)
    alloc.free(0)
    assert pc.num_pages == 2 and alloc.num_free == 19 - 2
    pc.evict_for_free_pages(19)
    assert pc.num_entries == 0 and alloc.num_free == 19 and pc.snapshot_bytes == 0
    assert not pc._nodes  # the chain nodes went with their entries
    assert not pc.insert([1] * 9, 4, [1], "big", 26)  # a snapshot over the whole budget is refused


def test_memory_plan_sizes_the_prefix_cache_budgets(capsys):
    import json

    from sharding.plan import main

    assert main(["--config", "configs/k3-tiny.json", "--preset", "serve", "--mesh", "tensor=2", "--seq-len", "4096",
                 "--prefix-kda-gb", "0.002", "--prefix-mla-gb", "0.001", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    whole, dev = d["whole_model"], d["per_device_bytes"]
    # tiny: 6 KDA layers x (6·64·64 f32 state + 3 x 3·6·64 bf16 conv) per snapshot; 3 fit in 2 MB
    assert whole["prefix_kda_snapshot_bytes_each"] == 6 * (6 * 64 * 64 * 4 + 3 * 1152 * 2)
    assert whole["prefix_kda_snapshots_in_budget"] == 3
    assert dev["prefix_kda_snapshots"] == 3 * whole["prefix_kda_snapshot_bytes_each"] / 2  # heads over tensor=2
    # MLA pages: 4 layers x (48 FP8 values + a 4-byte scale) per token, replicated over tensor
    assert whole["prefix_mla_tokens_in_budget"] == 10**6 // (4 * 52)
    assert dev["prefix_mla_pages"] == pytest.approx(whole["prefix_mla_tokens_in_budget"] * 4 * 52)
