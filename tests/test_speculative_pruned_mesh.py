"""A pruned-head draft (``DraftConfig.head_vocab``) on a mesh of virtual CPU devices: a sharded
:class:`SpeculativeEngine` (``tensor=2``, serve preset: the pruned head split over ``tensor`` like the lm_head's
columns, the vocab map replicated) gives the single-device plain engine's greedy output through both the greedy
round and the sampling round (the draft's q scattered onto the full vocabulary), with the vocab-map refusals of one
device; a draft trained on a ``tensor=2,fsdp=2`` mesh under the train preset (the target's lm_head split over
``fsdp`` × ``tensor``, the pruned head gathered from it inside the step) has the single-device run's losses,
parameters and vocab map."""


import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from k3_jax.draft import DraftConfig, DraftModel, pruned_head, target_head
from k3_jax.serving.sampling import SamplingParams
from k3_jax.serving.speculative import SpeculativeEngine
from k3_jax.training import draft as draft_training
from sharding.rules import ShardingFallbackWarning
from tests.test_speculative import MAX_LEN, NEW, _draft, _greedy, _prompts, _run, _setup, micro_config

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (virtual) devices; see tests/conftest.py")

VOCAB_MAP = np.array([5, 3, 7, 4, 6, 2], np.int32)  # 6 of the micro target's 8 ids: divisible by tensor=2


def _mesh(axes: str, n: int):
    from sharding.mesh import make_mesh

    return make_mesh(axes, devices=jax.devices()[:n])


def test_sharded_pruned_draft_serves_the_plain_output():
    cfg, params, base = _setup()
    dcfg = DraftConfig((0, 1), "mla", head_vocab=len(VOCAB_MAP))
    emb, head = target_head(cfg, params)
    dparams = jax.jit(DraftModel(cfg, dcfg).init)(jax.random.PRNGKey(1), jnp.zeros((1, 2, 2 * cfg.hidden_size)),
                                                  jnp.zeros((1, 2), jnp.int32), emb,
                                                  pruned_head(head, VOCAB_MAP))["params"]
    mesh = _mesh("tensor=2", 2)
    spec = SpeculativeEngine(cfg, params, dparams, dcfg, num_draft_tokens=2, max_batch=3, max_len=MAX_LEN,
                             prefill_chunk=1, mesh=mesh, vocab_map=VOCAB_MAP)
    head_var, map_var = spec.draft_variables["head"], spec.draft_variables["vocab_map"]
    assert head_var.shape == (cfg.hidden_size, len(VOCAB_MAP)) and head_var.sharding.spec == PartitionSpec(None,
                                                                                                          "tensor")
    assert map_var.sharding.is_fully_replicated and len(map_var.sharding.device_set) == 2
    np.testing.assert_array_equal(np.asarray(head_var), np.asarray(head)[:, VOCAB_MAP])
    prompts = _prompts()
    want = _run(base, prompts, [_greedy()] * 3)
    assert _run(spec, prompts, [_greedy()] * 3, draft_tokens=[2, 1, 2]) == want  # the all-greedy round
    assert spec.spec.accepted > 0  # some mapped drafts were kept
    # the sampling round (static: some row samples): q scattered onto the full vocabulary; top-k 1 = greedy
    mixed = [SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.0, top_k=1, seed=3), _greedy(),
             SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.0, top_k=1, seed=5)]
    assert _run(spec, prompts, mixed) == want
    # the vocab-map refusals of one device
    kw = dict(num_draft_tokens=2, max_batch=1, max_len=MAX_LEN, mesh=mesh)
    with pytest.raises(ValueError, match="head_vocab=6 but no vocab_map"):
        SpeculativeEngine(cfg, params, dparams, dcfg, **kw)
    with pytest.raises(ValueError, match=r"expected \[head_vocab=6\] integer ids, got shape \(5,\)"):
        SpeculativeEngine(cfg, params, dparams, dcfg, vocab_map=VOCAB_MAP[:5], **kw)
    with pytest.warns(ShardingFallbackWarning, match="draft/head dim 1"):  # 5 ids: not split over tensor=2
        five = SpeculativeEngine(cfg, params, dparams, dataclasses.replace(dcfg, head_vocab=5),
                                 vocab_map=VOCAB_MAP[:5], **kw)
    assert five.draft_variables["head"].sharding.is_fully_replicated
    full_cfg, full_params = _draft("mla", 1)
    with pytest.raises(ValueError, match="vocab_map given for a draft with head_vocab=None"):
        SpeculativeEngine(cfg, params, full_params, full_cfg, vocab_map=VOCAB_MAP, **kw)


def test_pruned_draft_train_step_on_a_mesh_equals_one_device(monkeypatch):
    """Two steps of the train step (the first at learning rate 0 under the warmup): the same losses and updated
    parameters; the parameters split over both axes, the vocab map replicated."""
    from k3_jax.model import K3ForCausalLM

    cfg = micro_config(vocab=1024)
    monkeypatch.setattr(draft_training, "load_config", lambda *a, **k: cfg)
    dtc = draft_training.DraftTrainConfig(steps=2, batch_size=2, seq_len=8, ttt_steps=1, warmup_steps=1, lr=1e-2,
                                          head_vocab=16, loss="kl", sharding_preset="train")  # LK: p < q on the map
    dcfg = draft_training.draft_config_of(cfg, dtc)
    _, target = draft_training.load_target(dtc)
    rs = np.random.RandomState(0)
    vocab_map = rs.permutation(cfg.vocab_size)[:16].astype(np.int32)
    tokens = jnp.asarray(rs.randint(3, cfg.vocab_size, (2, 2, 9)), jnp.int32)
    segments = jnp.asarray(np.broadcast_to((np.arange(9) >= 4) + 1, (2, 2, 9)), jnp.int32)  # two documents a row

    def run(mesh, target):
        state, step = draft_training.placed_step(cfg, dcfg, dtc, draft_training.init_state(
            cfg, dcfg, dtc, target, vocab_map), mesh)
        losses = []
        for i in range(2):
            state, loss, _ = step(state, target, tokens[i], segments[i])
            losses.append(float(loss))
        return losses, state

    losses, state = run(None, target)
    mesh = _mesh("fsdp=2,tensor=2", 4)
    placed = draft_training.place_on_mesh(K3ForCausalLM(cfg), (jnp.zeros((1, 1), jnp.int32),), target, mesh, "train")
    sharded_losses, sharded = run(mesh, placed)
    np.testing.assert_allclose(sharded_losses, losses, rtol=1e-5)
    # Adam divides by the gradients' own scale, so the step of an entry whose gradient is near zero follows its
    # rounding (seen: 3.3e-6 on one of 8,192): the tolerance is 0.1% of a step at lr (a wrong gradient moves ~lr)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3 * dtc.lr), sharded["params"],
                 state["params"])
    init = draft_training.init_state(cfg, dcfg, dtc, target, vocab_map)["params"]
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(state["params"]),
                                                               jax.tree.leaves(init), strict=True)) > 1e-4
    specs = {str(x.sharding.spec) for x in jax.tree.leaves(sharded["params"])}
    assert any("fsdp" in sp for sp in specs) and any("tensor" in sp for sp in specs)
    assert sharded["vocab_map"].sharding.is_fully_replicated and len(sharded["vocab_map"].sharding.device_set) == 4
