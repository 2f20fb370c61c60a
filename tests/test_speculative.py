"""Speculative decoding (k3_jax.draft, k3_jax.serving.speculative, k3_jax.training.draft) on a micro fp32 model:
greedy output with a random draft equals plain decoding (batch 3, several draft lengths, MLA and KDA drafts),
the target's KDA state / MLA latent after partial acceptances equal plain decoding's, sampling through the
speculative path keeps the target distribution (the acceptance rule as a pure function, chi-square over many
draws; one engine-level check with top-k 1), the LK loss and gradient equal numpy, and draft training resumes
exactly."""

import dataclasses
import functools
import gc
import threading
import time
import types
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.draft import DraftConfig, DraftModel, target_head
from k3_jax.model import K3ForCausalLM
from k3_jax.serving.engine import Engine
from k3_jax.serving.sampling import SamplingParams
from k3_jax.serving.speculative import (
    SpeculativeEngine,
    greedy_accept,
    load_draft,
    sampling_probs,
    speculative_accept,
)
from k3_jax.training import draft as draft_training
from k3_jax.training.resume import ResumeError
from tests._model_fixtures import tiny_config

MAX_LEN = 40
NEW = 14


def micro_config(vocab: int = 8):
    """Two dense layers (KDA, MLA), width 64 (few compiles); a vocabulary of 8 so a random draft is often right
    (MoE routing is per token, so verifying k + 1 tokens at once changes nothing there)."""
    return tiny_config(num_hidden_layers=2, kda_layers=(0,), mla_layers=(1,), hidden_size=64,
                       intermediate_size=128, vocab_size=vocab, num_attention_heads=2, kda_num_heads=2,
                       kda_head_dim=16, num_experts=0, num_experts_per_token=0, num_shared_experts=0,
                       moe_intermediate_size=0, routed_expert_hidden_size=0, q_lora_rank=32, kv_lora_rank=16,
                       qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


@functools.cache
def _setup():
    cfg = micro_config()
    params = nn.unbox(jax.jit(K3ForCausalLM(cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    base = Engine(cfg, params, max_batch=3, max_len=MAX_LEN, prefill_chunk=1)
    return cfg, params, base


@functools.cache
def _draft(mixer: str, seed: int):
    cfg, params, _ = _setup()
    dcfg = DraftConfig((0, 1), mixer)
    emb, head = target_head(cfg, params)
    v = jax.jit(DraftModel(cfg, dcfg).init)(jax.random.PRNGKey(seed), jnp.zeros((1, 2, 2 * cfg.hidden_size)),
                                            jnp.zeros((1, 2), jnp.int32), emb, head)
    return dcfg, nn.unbox(v)["params"]


def _prompts():
    rs = np.random.RandomState(0)
    return [rs.randint(3, 8, n).tolist() for n in (1, 4, 7)]


def _run(engine, prompts, params, draft_tokens=None):
    ids = [engine.add_request(p, sp, **({} if draft_tokens is None else {"draft_tokens": d}))
           for p, sp, d in zip(prompts, params, draft_tokens or [None] * len(prompts), strict=True)]
    outs = {i: [] for i in ids}
    while engine.has_work:
        for ev in engine.step():
            outs[ev.request_id].append(ev.token)
    return [outs[i] for i in ids]


def _greedy(n=NEW):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _target_rows(engine, slot: int, length: int):
    """KDA states and conv tails, MLA latents[:length] of ``slot`` (float64 numpy)."""
    rows = []
    for seg in engine.cache["segments"]:
        for entry in seg.values():
            if "state" in entry:
                rows += [np.asarray(entry["state"][:, slot]), np.asarray(entry["conv"][:, slot])]
            else:
                rows.append(np.asarray(entry["latent"][:, slot, :length]))
    return rows


@pytest.fixture(scope="module")
def spec_mla():
    cfg, params, base = _setup()
    dcfg, dparams = _draft("mla", 1)
    return SpeculativeEngine(cfg, params, dparams, dcfg, num_draft_tokens=3, max_batch=3, max_len=MAX_LEN,
                             prefill_chunk=1)


def test_greedy_identical_batch_and_draft_lengths(spec_mla):
    cfg, params, base = _setup()
    prompts = _prompts()
    want = _run(base, prompts, [_greedy()] * 3)
    got = _run(spec_mla, prompts, [_greedy()] * 3, draft_tokens=[3, 1, 2])
    assert got == want
    got_full = _run(spec_mla, prompts, [_greedy()] * 3)  # k = 3 for every row, the slots reused
    assert got_full == want
    hist = spec_mla.spec.accepted_hist
    assert any(0 < n < 3 for n in hist) and 0 in hist, hist  # partial and full rejections happened
    assert spec_mla.spec.acceptance_length > 1.0
    # sampling path, top-k 1: the target distribution is one-hot, so the output is the greedy one
    sampled = [SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.0, top_k=1, seed=s) for s in (3, 4, 5)]
    assert _run(spec_mla, prompts, sampled) == want


def test_several_rounds_per_call_equal_single_rounds(spec_mla):
    """decode_block=3: rounds run in one scan with the bookkeeping on the device; rows that reach max_tokens or a
    stop token inside a block, per-request draft lengths and sampling keys (the per-row step) all as single rounds."""
    cfg, params, base = _setup()
    prompts = _prompts()
    want = _run(base, prompts, [_greedy()] * 3)
    stop = want[1][4]  # request 1 stops at its 5th token (or earlier, where that token comes first)
    greedy = [_greedy(), SamplingParams(max_tokens=NEW, ignore_eos=True, stop_token_ids=(stop,)), _greedy(9)]
    sampled = [SamplingParams(max_tokens=NEW - i, ignore_eos=True, temperature=1.0, seed=s)
               for i, s in enumerate((11, 12, 13))]
    single = _run(spec_mla, prompts, sampled, draft_tokens=[3, 2, 1])
    spec_mla.decode_block = 3
    try:
        steps = spec_mla.stats["decode_steps"]
        got = _run(spec_mla, prompts, greedy, draft_tokens=[3, 1, 2])
        assert spec_mla.stats["decode_steps"] - steps > 3  # blocks of 3 rounds ran
        assert _run(spec_mla, prompts, sampled, draft_tokens=[3, 2, 1]) == single
    finally:
        spec_mla.decode_block = 1
    assert got[0] == want[0] and got[2] == want[2][:9]
    assert got[1] == want[1][:want[1].index(stop) + 1]


def test_target_state_after_partial_acceptance_equals_plain_decode(spec_mla):
    cfg, params, base = _setup()
    prompt = [3, 5, 4, 6, 7]
    before = dict(spec_mla.spec.accepted_hist)
    (want,) = _run(base, [prompt], [_greedy(11)])
    (got,) = _run(spec_mla, [prompt], [_greedy(11)])
    assert got == want
    after = spec_mla.spec.accepted_hist
    assert any(after.get(n, 0) > before.get(n, 0) for n in (1, 2)), (before, after)  # a partial acceptance
    length = len(prompt) + len(want) - 1
    assert int(spec_mla.cache["lengths"][0]) == int(base.cache["lengths"][0]) == length
    for a, b in zip(_target_rows(spec_mla, 0, length), _target_rows(base, 0, length), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_sampling_is_reproducible_per_seed(spec_mla):
    prompts = _prompts()
    sp = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=s) for s in (7, 8, 9)]
    a = _run(spec_mla, prompts, sp)
    b = _run(spec_mla, prompts[::-1], sp[::-1])[::-1]  # other slots, other neighbours
    assert a == b
    assert all(0 <= t < 8 for o in a for t in o)


def test_kda_draft_greedy_identical():
    cfg, params, base = _setup()
    dcfg, dparams = _draft("kda", 2)
    spec = SpeculativeEngine(cfg, params, dparams, dcfg, num_draft_tokens=2, max_batch=3, max_len=MAX_LEN,
                             prefill_chunk=1)
    prompts = _prompts()
    assert _run(spec, prompts, [_greedy()] * 3) == _run(base, prompts, [_greedy()] * 3)
    assert spec.spec.accepted > 0


def test_speculative_engines_of_one_layout_share_their_rounds_and_hold_no_engine(spec_mla):
    """Another draft length, same target layout and draft config: the rounds' and draft's jitted functions are
    spec_mla's; the prefill that collects prompt features stays per engine; another draft mixer gets its own
    rounds; the shared functions keep no engine alive."""
    cfg, params, _ = _setup()
    dcfg, dparams = _draft("mla", 1)
    other = SpeculativeEngine(cfg, params, dparams, dcfg, num_draft_tokens=2, max_batch=2, max_len=MAX_LEN)
    names = ("_round", "_rounds", "_draft_prefill", "_draft_reset", "_draft_pending", "_prefill_with_features")
    assert all(getattr(other, n) is getattr(spec_mla, n) for n in names)
    assert other._prefill is not spec_mla._prefill
    kcfg, kparams = _draft("kda", 2)
    # the same draft, its MLP width spelled out: a layout no other test builds
    kcfg = dataclasses.replace(kcfg, intermediate_size=cfg.intermediate_size)
    kda = SpeculativeEngine(cfg, params, kparams, kcfg, num_draft_tokens=2, max_batch=2, max_len=MAX_LEN)
    assert kda._round is not spec_mla._round
    gone = weakref.ref(kda)  # the engine that built its layout's functions
    del kda
    gc.collect()
    assert gone() is None, "a shared jitted function holds the engine that built it"


def test_engine_rejects_bad_draft_tokens(spec_mla):
    cfg, params, _ = _setup()
    with pytest.raises(ValueError, match="draft_tokens"):
        spec_mla.add_request([3, 4], _greedy(), draft_tokens=4)
    with pytest.raises(ValueError, match="feature_layers"):
        DraftConfig((5,)).validate(cfg)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 (virtual) devices; see tests/conftest.py")
def test_sharded_target_greedy_identical():
    """The target and draft split over a tensor=2 mesh (serve preset: heads over `tensor`, the KDA cache by
    heads), one round and two-round blocks: greedy output = the single-device plain engine's."""
    from sharding.mesh import make_mesh

    cfg, params, base = _setup()
    dcfg, dparams = _draft("mla", 1)
    mesh = make_mesh("tensor=2", devices=jax.devices()[:2])
    spec = SpeculativeEngine(cfg, params, dparams, dcfg, num_draft_tokens=2, max_batch=3, max_len=MAX_LEN,
                             prefill_chunk=1, decode_block=2, mesh=mesh)
    prompts = _prompts()
    assert _run(spec, prompts, [_greedy()] * 3, draft_tokens=[2, 1, 2]) == _run(base, prompts, [_greedy()] * 3)
    assert spec.spec.accepted > 0
    split = [x for x in jax.tree.leaves((spec.variables, spec.draft_variables, spec.cache))
             if not x.sharding.is_fully_replicated]
    assert split and all(len(x.sharding.device_set) == 2 for x in split)
    state = spec.cache["segments"][0]["layer_0"]["state"]  # the KDA layer's state [R, B, H, K, V]: heads split
    assert state.sharding.spec[2] == "tensor"


# ------------------------------------------------------------------------------------------ acceptance rule
@functools.cache
def _accept_fn():
    return jax.jit(speculative_accept)


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    from scipy.stats import chisquare

    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of zero probability was emitted"
    return float(chisquare(counts[keep], probs[keep] * counts.sum()).pvalue)


def test_acceptance_rule_keeps_target_distribution():
    """First emitted token ~ p_0 and, given it was an accepted draft, the second ~ p_1: chi-square on V=5."""
    rs = np.random.RandomState(0)
    v, k, n = 5, 2, 40000
    p0 = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    q0 = np.array([0.1, 0.2, 0.3, 0.25, 0.15])
    p1 = np.array([0.05, 0.05, 0.2, 0.3, 0.4])
    q1 = np.array([0.3, 0.3, 0.2, 0.1, 0.1])
    p2 = np.full(v, 0.2)
    drafts = np.stack([rs.choice(v, n, p=q0), rs.choice(v, n, p=q1)], axis=1).astype(np.int32)
    p = np.broadcast_to(np.stack([p0, p1, p2]), (n, k + 1, v)).astype(np.float32)
    q = np.broadcast_to(np.stack([q0, q1]), (n, k, v)).astype(np.float32)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(n))
    accepted, nxt = map(np.asarray, _accept_fn()(jnp.asarray(p), jnp.asarray(q), jnp.asarray(drafts),
                                                 jnp.full((n,), k, jnp.int32), keys))
    first = np.where(accepted >= 1, drafts[:, 0], nxt)
    assert _chi_square_p(np.bincount(first, minlength=v), p0) > 1e-3
    # the token after an accepted first draft: p_1 (independent of the first here)
    second = np.where(accepted >= 2, drafts[:, 1], nxt)[accepted >= 1]
    assert _chi_square_p(np.bincount(second, minlength=v), p1) > 1e-3
    # acceptance probability of the first draft is sum_x min(p0, q0)
    assert abs((accepted >= 1).mean() - np.minimum(p0, q0).sum()) < 0.01
    # num_drafts = 0: a plain draw from p_0
    _, plain = _accept_fn()(jnp.asarray(p), jnp.asarray(q), jnp.asarray(drafts), jnp.zeros((n,), jnp.int32), keys)
    assert _chi_square_p(np.bincount(np.asarray(plain), minlength=v), p0) > 1e-3


def test_acceptance_rule_greedy():
    eye = np.eye(4, dtype=np.float32)
    p = jnp.asarray(eye[[[1, 2, 3], [1, 2, 3], [0, 0, 0]]])  # target argmax per position
    q = jnp.asarray(eye[[[1, 2], [1, 3], [2, 0]]])
    drafts = jnp.asarray([[1, 2], [1, 3], [2, 0]], jnp.int32)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(1), i))(jnp.arange(3))
    accepted, nxt = _accept_fn()(p, q, drafts, jnp.asarray([2, 2, 2], jnp.int32), keys)
    assert np.asarray(accepted).tolist() == [2, 1, 0]
    assert np.asarray(nxt).tolist() == [3, 2, 0]
    accepted, nxt = _accept_fn()(p, q, drafts, jnp.asarray([1, 2, 0], jnp.int32), keys)
    assert np.asarray(accepted).tolist() == [1, 1, 0]
    assert np.asarray(nxt).tolist() == [2, 2, 0]
    # the all-greedy round's rule (argmax comparisons, no distributions) equals the rule on the one-hot
    # distributions sampling_probs gives at temperature 0, for drafts that often match
    rs = np.random.RandomState(2)
    b, k, v = 64, 4, 6
    logits = jnp.asarray(rs.randn(b, k + 1, v), jnp.float32)
    zeros = jnp.zeros((b,), jnp.float32)
    p = sampling_probs(logits, zeros, jnp.zeros((b,), jnp.int32), zeros + 1)
    target = np.asarray(jnp.argmax(logits, axis=-1))
    drafts = np.where(rs.rand(b, k) < 0.7, target[:, :k], rs.randint(0, v, (b, k))).astype(np.int32)
    q = jnp.asarray(np.eye(v, dtype=np.float32)[drafts])
    num = jnp.asarray(rs.randint(0, k + 1, b), jnp.int32)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(3), i))(jnp.arange(b))
    want = _accept_fn()(p, q, jnp.asarray(drafts), num, keys)
    got = jax.jit(greedy_accept)(jnp.asarray(target, jnp.int32), jnp.asarray(drafts), num)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert len(set(np.asarray(got[0]).tolist())) == k + 1  # every acceptance count occurs


# ------------------------------------------------------------------------------------------ training
def test_lk_loss_and_gradient_match_numpy():
    rs = np.random.RandomState(3)
    zp, zq = rs.randn(4, 7).astype(np.float64), rs.randn(4, 7).astype(np.float64)
    mask = np.array([1, 1, 0, 1], bool)

    def softmax(z):
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, q = softmax(zp), softmax(zq)
    s = np.minimum(p, q).sum(-1)
    want = (-np.log(s) * mask).sum() / mask.sum()
    m = (q < p).astype(np.float64)  # d/dz_j of sum_x min(p, q): sum over x with q_x < p_x of q_x (delta - q_j)
    grad = -(m * q - q * (m * q).sum(-1, keepdims=True)) / s[:, None] * mask[:, None] / mask.sum()
    loss, g = jax.value_and_grad(lambda z: draft_training.draft_loss("lk", jnp.asarray(zp, jnp.float32), z,
                                                                     jnp.asarray(mask)))(jnp.asarray(zq, jnp.float32))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g), grad, rtol=1e-4, atol=1e-6)
    kl = draft_training.draft_loss("kl", jnp.asarray(zp), jnp.asarray(zq), jnp.asarray(mask))
    np.testing.assert_allclose(float(kl), ((p * np.log(p / q)).sum(-1) * mask).sum() / mask.sum(), rtol=1e-5)
    with pytest.raises(ValueError, match="draft loss"):
        draft_training.draft_loss("mse", jnp.asarray(zp), jnp.asarray(zq), jnp.asarray(mask))


def test_losses_at_the_serving_temperature_match_numpy():
    """``temperature`` T: LK and KL of the softmaxes of the logits / T (the distributions the engine samples at
    temperature T), LK's gradient too; T = 0 (greedy verification): both become the cross-entropy against the
    target's argmax, as does the pruned LK when the argmax lies in the map (an argmax outside it: no draft token
    can match, the loss is clamped and has no gradient)."""
    rs = np.random.RandomState(5)
    zp, zq = rs.randn(5, 9) * 2, rs.randn(5, 9) * 2
    mask = np.array([1, 0, 1, 1, 1], bool)

    def softmax(z):
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    f32 = lambda x: jnp.asarray(x, jnp.float32)
    for t in (0.5, 2.0):
        p, q = softmax(zp / t), softmax(zq / t)
        s = np.minimum(p, q).sum(-1)
        want = (-np.log(s) * mask).sum() / mask.sum()
        m = (q < p).astype(np.float64)  # the T = 1 gradient of the test above, times 1/T (chain rule on z / T)
        grad = -(m * q - q * (m * q).sum(-1, keepdims=True)) / s[:, None] * mask[:, None] / mask.sum() / t
        loss, g = jax.value_and_grad(lambda z, t=t: draft_training.draft_loss("lk", f32(zp), z, f32(mask),
                                                                              temperature=t))(f32(zq))
        np.testing.assert_allclose(float(loss), want, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(g), grad, rtol=1e-4, atol=1e-6)
        kl = draft_training.draft_loss("kl", f32(zp), f32(zq), f32(mask), temperature=t)
        np.testing.assert_allclose(float(kl), ((p * np.log(p / q)).sum(-1) * mask).sum() / mask.sum(), rtol=1e-4)
    q1 = softmax(zq)
    ce = -np.log(q1[np.arange(5), zp.argmax(-1)])
    for kind in ("lk", "kl", "ce"):
        np.testing.assert_allclose(np.asarray(draft_training.PER_POSITION[kind](f32(zp), f32(zq), 0.0)), ce,
                                   rtol=1e-5)
    vocab_map = np.array([zp[0].argmax(), (zp[1].argmax() + 1) % 9, 4])
    pruned = np.asarray(draft_training.pruned_loss("lk", f32(zp[:2]), f32(zq[:2, :3]), jnp.asarray(vocab_map),
                                                   temperature=0.0))
    np.testing.assert_allclose(pruned[0], -np.log(softmax(zq[0, :3])[0]), rtol=1e-5)
    assert zp[1].argmax() not in vocab_map and pruned[1] > 60
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        draft_training.draft_loss("lk", f32(zp), f32(zq), f32(mask), temperature=-1.0)
    with pytest.raises(ValueError, match="--temperature must be >= 0"):
        draft_training.DraftTrainConfig(temperature=-0.5).validate()


def test_draft_training_stops_on_a_nonfinite_loss(tmp_path, monkeypatch):
    """A target whose outputs are NaN makes the draft's loss NaN: training stops at the first read loss with
    TrainingDiverged (the CLI exits 3) and exports no draft."""
    from k3_jax.training.loop import TrainingDiverged

    cfg = micro_config(vocab=1024)
    monkeypatch.setattr(draft_training, "load_config", lambda *a, **k: cfg)
    load = draft_training.load_target

    def nan_target(dtc, mesh):
        c, params = load(dtc, mesh)
        return c, jax.tree.map(lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else x, params)

    monkeypatch.setattr(draft_training, "load_target", nan_target)
    dtc = draft_training.DraftTrainConfig(out=str(tmp_path / "a"), steps=2, batch_size=2, seq_len=8, ttt_steps=2,
                                          save_every=0, warmup_steps=1)
    with pytest.raises(TrainingDiverged, match="draft step 1: loss nan"):
        draft_training.train(dtc, say=lambda s: None)
    assert not (tmp_path / "a" / "draft").exists()


def test_draft_training_resumes_exactly(tmp_path, monkeypatch):
    cfg = micro_config(vocab=1024)
    monkeypatch.setattr(draft_training, "load_config", lambda *a, **k: cfg)
    common = dict(steps=4, batch_size=2, seq_len=8, ttt_steps=2, save_every=0, warmup_steps=1, lr=1e-2)

    def train(out, **kw):
        dtc = draft_training.DraftTrainConfig(out=str(tmp_path / out), **{**common, **kw.pop("change", {})})
        return draft_training.train(dtc, say=lambda s: None, **kw)

    straight = train("a")
    first = train("b", stop_at=1)  # the packer holds no remainder after one row: its JSON state must still restore
    with pytest.raises(ResumeError, match="train.lr"):  # a changed option is refused on resume
        train("b", change={"lr": 2e-2})
    rest = train("b")
    assert first["losses"] + rest["losses"] == straight["losses"]
    clock = iter(range(1000))  # the trainer's clock: each reading one second later (t0, per-step checks, logs)
    monkeypatch.setattr(draft_training, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    timed = train("c", change={"max_seconds": 2.5})  # readings 1 (step 1), 2 (its log), 3 (step 2): stops there
    monkeypatch.setattr(draft_training, "time", time)
    assert timed["step"] == 2 and load_draft(timed["draft_dir"], cfg)[0] is not None  # checkpointed and exported
    assert timed["losses"] + train("c")["losses"] == straight["losses"]  # a re-run without the limit resumes
    assert straight["losses"][-1] < straight["losses"][0]
    flag = tmp_path / "target.done"  # --wait-for: compiled on a random target first, then trained once flag exists
    threading.Timer(0.5, flag.touch).start()
    said = []
    waited = draft_training.train(draft_training.DraftTrainConfig(out=str(tmp_path / "d"), wait_for=str(flag),
                                                                  **common), say=said.append)
    assert waited["losses"] == straight["losses"] and any("waiting for" in line for line in said)
    dtc = draft_training.DraftTrainConfig(**common)
    step = draft_training._compiled_step(cfg, draft_training.draft_config_of(cfg, dtc),
                                         draft_training._step_options(dtc))
    assert step._cache_size() == 1  # one compile for fresh, resumed, timed and precompiled runs
    dcfg, dparams = load_draft(straight["draft_dir"], cfg)
    assert dcfg == draft_training.draft_config_of(cfg, draft_training.DraftTrainConfig())
    assert jax.tree.structure(dparams) is not None
    if jax.device_count() >= 2:  # the target (and draft) split over a mesh: the same losses (fp32)
        sharded = train("e", change={"mesh": "data=2,tensor=2,expert=-1"}, stop_at=2)
        np.testing.assert_allclose(sharded["losses"], straight["losses"][:2], rtol=1e-5)
