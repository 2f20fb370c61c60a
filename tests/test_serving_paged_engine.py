"""Engine with the paged MLA latent cache: greedy output equals the from-scratch full forward, requests wait
for pages when the pool is short, and every page returns to the pool."""

import functools

import numpy as np
import pytest

from k3_jax.serving.engine import Engine, RequestError
from k3_jax.serving.sampling import SamplingParams
from tests.serving_common import MAX_LEN, reference_greedy_check, tiny_setup

# one paged-engine layout for both tests, so the single-device engine's programs compile once per run (the
# persistent compilation cache): 3 slots but only 6 usable pages of 8 tokens; prefill in pieces of 16 + single
# tokens (2 prefill shapes: a multi-token piece on the row's gathered view, a single token in place)
PAGED = dict(max_batch=3, max_len=MAX_LEN, page_size=8, num_pages=7, prefill_chunk=16, prefill_mode="unit",
             paged=True, eos_ids=())


@functools.cache
def _paged_engine() -> Engine:
    """The single-device paged engine (PAGED), shared by both tests: its jitted programs are traced and compiled
    once per process. Every test leaves it idle with all pages free (each test asserts that)."""
    cfg, variables, _, _ = tiny_setup()
    return Engine(cfg, variables["params"], **PAGED)


@pytest.mark.slow
def test_paged_engine_greedy_exact_and_page_accounting():
    cfg, variables, _, fwd = tiny_setup()
    # 3 slots but only 6 usable pages of 8 tokens: two 20-token requests fill the pool, the third waits
    engine = _paged_engine()
    rs = np.random.RandomState(1)
    prompts = [rs.randint(3, cfg.vocab_size, n).tolist() for n in (1, 20, 9)]
    params = SamplingParams(max_tokens=12)
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {i: [] for i in ids}
    while engine.has_work:
        for ev in engine.step():
            outs[ev.request_id].append(ev.token)
    assert engine.stats["waits_for_pages"] > 0
    for rid, p in zip(ids, prompts, strict=True):
        assert len(outs[rid]) == 12
        reference_greedy_check(fwd, variables, p, outs[rid])
    assert engine.allocator.num_free == 6 and not engine.allocator.table.any()
    with pytest.raises(RequestError, match="pages"):
        engine.add_request([5] * 50, SamplingParams(max_tokens=20))


@pytest.mark.skipif(__import__("jax").device_count() < 2, reason="needs 2 (virtual) devices; see tests/conftest.py")
def test_paged_engine_on_a_mesh_equals_one_device():
    """The paged engine with the model split over a tensor=2 mesh (serve preset): greedy output equals the
    single-device paged engine's, and the pages go back to the pool. The prompts (5 and 17 tokens) run both
    prefill shapes (17 = 16 + 1) and decode on the mesh, and need 2 + 3 of the 6 pages (no request waits). The
    single-device side is the shared ``_paged_engine`` (same layout, so no second trace of its programs)."""
    import jax

    from sharding.mesh import make_mesh

    cfg, variables, _, _ = tiny_setup()
    rs = np.random.RandomState(2)
    prompts = [rs.randint(3, cfg.vocab_size, n).tolist() for n in (5, 17)]
    outs = []
    for mesh in (None, make_mesh("tensor=2", devices=jax.devices()[:2])):
        engine = _paged_engine() if mesh is None else Engine(cfg, variables["params"], mesh=mesh, **PAGED)
        waits = engine.stats["waits_for_pages"]  # the shared engine may have waited in the other test
        outs.append(engine.generate(prompts, max_new_tokens=6))
        assert engine.stats["waits_for_pages"] == waits
        assert not engine.allocator.table.any() and engine.allocator.num_free == 6
        if mesh is not None:  # the model really is split
            assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(engine.variables))
    assert outs[0] == outs[1]
