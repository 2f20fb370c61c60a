"""A draft with a pruned-vocabulary head (``DraftConfig.head_vocab``): greedy speculation stays identical to the
plain engine, the acceptance rule keeps the target distribution when the draft's q is zero outside its map, and
the vocab map round-trips through the draft directory with clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.draft import (
    DraftConfig,
    DraftModel,
    check_vocab_map,
    count_vocab_map,
    head_variables,
    load_vocab_map,
    pruned_head,
    save_vocab_map,
    target_head,
)
from k3_jax.serving.sampling import SamplingParams
from k3_jax.serving.speculative import SpeculativeEngine, load_draft
from k3_jax.training import draft as draft_training
from tests.test_speculative import MAX_LEN, NEW, _accept_fn, _chi_square_p, _greedy, _prompts, _run, _setup

VOCAB_MAP = np.array([5, 3, 7, 4, 6], np.int32)  # 5 of the micro target's 8 ids


def _pruned_draft():
    cfg, params, _ = _setup()
    dcfg = DraftConfig((0, 1), "mla", head_vocab=len(VOCAB_MAP))
    emb, head = target_head(cfg, params)
    v = jax.jit(DraftModel(cfg, dcfg).init)(jax.random.PRNGKey(1), jnp.zeros((1, 2, 2 * cfg.hidden_size)),
                                            jnp.zeros((1, 2), jnp.int32), emb, pruned_head(head, VOCAB_MAP))
    return dcfg, v["params"]


def test_pruned_draft_greedy_identical():
    cfg, params, base = _setup()
    dcfg, dparams = _pruned_draft()
    spec = SpeculativeEngine(cfg, params, dparams, dcfg, num_draft_tokens=3, max_batch=3, max_len=MAX_LEN,
                             prefill_chunk=1, vocab_map=VOCAB_MAP)
    assert spec.draft_variables["head"].shape == (cfg.hidden_size, len(VOCAB_MAP))
    prompts = _prompts()
    want = _run(base, prompts, [_greedy()] * 3)
    assert _run(spec, prompts, [_greedy()] * 3, draft_tokens=[3, 1, 2]) == want
    assert spec.spec.acceptance_length > 1.0  # some mapped drafts were accepted
    # the sampling path (q scattered onto the full vocabulary), top-k 1: the greedy output
    sampled = [SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.0, top_k=1, seed=s) for s in (3, 4, 5)]
    assert _run(spec, prompts, sampled) == want
    with pytest.raises(ValueError, match="head_vocab=5 but no vocab_map"):
        SpeculativeEngine(cfg, params, dparams, dcfg, num_draft_tokens=3, max_batch=1, max_len=MAX_LEN)


def test_acceptance_rule_keeps_target_distribution_with_pruned_q():
    """q zero outside the map {1, 3, 4}; p has mass outside it, which only the residual can emit: chi-square."""
    rs = np.random.RandomState(1)
    v, n = 5, 40000
    p0 = np.array([0.3, 0.2, 0.15, 0.25, 0.1])
    q0 = np.array([0.0, 0.5, 0.0, 0.2, 0.3])
    drafts = rs.choice(v, (n, 1), p=q0).astype(np.int32)
    p = np.broadcast_to(np.stack([p0, np.full(v, 0.2)]), (n, 2, v)).astype(np.float32)
    q = np.broadcast_to(q0[None], (n, 1, v)).astype(np.float32)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(3), i))(jnp.arange(n))
    accepted, nxt = map(np.asarray, _accept_fn()(jnp.asarray(p), jnp.asarray(q), jnp.asarray(drafts),
                                                 jnp.ones((n,), jnp.int32), keys))
    first = np.where(accepted >= 1, drafts[:, 0], nxt)
    assert _chi_square_p(np.bincount(first, minlength=v), p0) > 1e-3
    assert abs((accepted >= 1).mean() - np.minimum(p0, q0).sum()) < 0.01


def test_vocab_map_round_trip_and_errors(tmp_path):
    cfg, params, _ = _setup()
    dcfg = DraftConfig((0, 1), head_vocab=3)
    m = count_vocab_map([np.array([[4, 4, 2], [2, 4, 7]]), np.array([7, 7, 7, 1])], cfg.vocab_size, 3)
    np.testing.assert_array_equal(m, [7, 4, 2])  # by count, ties by id
    dcfg.save(tmp_path)
    save_vocab_map(tmp_path, m)
    assert DraftConfig.load(tmp_path) == dcfg
    np.testing.assert_array_equal(load_vocab_map(tmp_path, dcfg, cfg.vocab_size), m)
    with pytest.raises(ValueError, match=r"head_vocab=4"):
        load_vocab_map(tmp_path, DraftConfig((0, 1), head_vocab=4), cfg.vocab_size)
    with pytest.raises(ValueError, match=r"ids outside \[0, 4\)"):
        load_vocab_map(tmp_path, dcfg, 4)
    with pytest.raises(ValueError, match="head_vocab=None"):
        load_vocab_map(tmp_path, DraftConfig((0, 1)), cfg.vocab_size)
    with pytest.raises(ValueError, match="repeated"):
        check_vocab_map([1, 1, 2], dcfg, cfg.vocab_size)
    (tmp_path / "vocab_map.npy").unlink()
    with pytest.raises(FileNotFoundError, match="vocab_map.npy: missing"):
        load_vocab_map(tmp_path, dcfg, cfg.vocab_size)
    with pytest.raises(ValueError, match="head_vocab must be None or in"):
        DraftConfig((0, 1), head_vocab=9).validate(cfg)
    hv = head_variables(cfg, dcfg, params, m)
    np.testing.assert_array_equal(np.asarray(hv["head"]), np.asarray(target_head(cfg, params)[1])[:, m])


def test_pruned_losses_over_the_map():
    """LK on the map: Σ_{x∈map} min(p(x), q(x)) with p's unnormalised mass; CE / KL: p renormalised on the map."""
    rs = np.random.RandomState(0)
    zp, zq = rs.randn(2, 3, 8), rs.randn(2, 3, 3)
    m = np.array([6, 1, 3])
    p = np.exp(zp) / np.exp(zp).sum(-1, keepdims=True)
    q = np.exp(zq) / np.exp(zq).sum(-1, keepdims=True)
    lk = draft_training.pruned_loss("lk", jnp.asarray(zp, jnp.float32), jnp.asarray(zq, jnp.float32), jnp.asarray(m))
    np.testing.assert_allclose(np.asarray(lk), -np.log(np.minimum(p[..., m], q).sum(-1)), rtol=1e-5)
    pm = p[..., m] / p[..., m].sum(-1, keepdims=True)
    kl = draft_training.pruned_loss("kl", jnp.asarray(zp, jnp.float32), jnp.asarray(zq, jnp.float32), jnp.asarray(m))
    np.testing.assert_allclose(np.asarray(kl), (pm * (np.log(pm) - np.log(q))).sum(-1), rtol=1e-4, atol=1e-6)
    ce = draft_training.pruned_loss("ce", jnp.asarray(zp, jnp.float32), jnp.asarray(zq, jnp.float32), jnp.asarray(m))
    np.testing.assert_allclose(np.asarray(ce), -np.log(np.take_along_axis(q, pm.argmax(-1)[..., None], -1)[..., 0]),
                               rtol=1e-5)


def test_pruned_draft_training_resumes_and_exports_the_map(tmp_path, monkeypatch):
    from tests.test_speculative import micro_config

    cfg = micro_config(vocab=1024)
    monkeypatch.setattr(draft_training, "load_config", lambda *a, **k: cfg)
    # kl, not lk: against a near-uniform random target, LK's min(p, q) has a zero gradient wherever q > p on
    # every mapped id, so an lk draft would not move and the resume comparison would prove nothing
    common = dict(steps=2, batch_size=2, seq_len=8, ttt_steps=1, save_every=0, warmup_steps=1, lr=1e-2,
                  head_vocab=16, loss="kl")

    def train(out, **kw):
        return draft_training.train(draft_training.DraftTrainConfig(out=str(tmp_path / out), **common),
                                    say=lambda s: None, **kw)

    straight = train("a")
    first = train("b", stop_at=1)
    assert first["losses"] + train("b")["losses"] == straight["losses"]  # the map came back from the checkpoint
    assert np.isfinite(straight["losses"]).all()
    _, params = load_draft(straight["draft_dir"], cfg)  # the draft moved: its exported params are not the init
    frozen = draft_training.train(draft_training.DraftTrainConfig(out=str(tmp_path / "c"), **{**common, "lr": 0.0}),
                                  say=lambda s: None)
    _, init = load_draft(frozen["draft_dir"], cfg)
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(init), strict=True))
    dcfg, _ = load_draft(straight["draft_dir"], cfg)
    assert dcfg.head_vocab == 16
    want = draft_training.corpus_vocab_map(draft_training.DraftTrainConfig(**common), cfg.vocab_size)
    np.testing.assert_array_equal(load_vocab_map(straight["draft_dir"], dcfg, cfg.vocab_size), want)
