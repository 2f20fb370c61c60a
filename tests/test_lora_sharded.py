"""LoRA adapters sharded ZeRO-3 over ``fsdp`` (``lora_rank`` rules of :mod:`sharding.rules`): the LoRA train step
on 8 CPU devices (``fsdp=2,expert=2,tensor=2``, expert parallelism) with adapters on every target — attention,
shared experts, latent projections and the packed MXFP4 routed experts — equals the single-device step (fp32), and
the adapters, their AdamW moments and the step's outputs keep the rules' layout (a routed expert's B split over
expert × fsdp × tensor: nothing of it replicated)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3_jax.training.loop import TrainConfig
from tests.train_common import compiled_trainer

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices; see tests/conftest.py")

MESH = "fsdp=2,expert=2,tensor=2"
BATCH, SEQ, STEPS, RANK = 8, 16, 3, 4
# k3-tiny cut to one MLA + MoE layer, fp32; experts packed (MXFP4, frozen) as in a fine-tune of the release
ONE_MOE_LAYER = {"num_hidden_layers": 1, "kda_layers": (), "mla_layers": (0,), "first_k_dense_replace": 0,
                 "dtype": "float32", "param_dtype": "float32", "expert_format": "mxfp4"}
TARGETS = ("attention", "shared_experts", "latent", "experts")


def _run(mesh: str, tmp_path) -> tuple[list[tuple[float, float]], dict]:
    tc = TrainConfig(config="configs/k3-tiny.json", model_overrides=ONE_MOE_LAYER, workdir=str(tmp_path / mesh),
                     steps=100, seq_len=SEQ, batch_size=BATCH, eval_every=0, tensorboard=False, resume=False,
                     mesh=mesh, optimizer="adamw", lr=1e-2, warmup_frac=0.0, lora_rank=RANK, lora_alpha=8.0,
                     lora_targets=TARGETS)
    tr, state, train_step, batch = compiled_trainer(tc, BATCH, SEQ)
    losses = []  # (loss, gradient norm) per step
    for _ in range(STEPS):
        state, metrics = train_step(state, batch)
        losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return losses, state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_sharded")
    return _run("none", tmp), _run(MESH, tmp)


def _experts(params: dict) -> dict:
    return params["model"]["segment_0"]["layer_0"]["block_sparse_moe"]["experts"]


def test_sharded_lora_step_equals_single_device(runs):
    (want_losses, want), (got_losses, got) = runs
    assert want_losses[-1][0] < want_losses[0][0] - 0.01, want_losses  # the adapters train
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)  # losses and the adapters' gradient norms
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want["params"]))
    n = 0
    for path, x in jax.tree_util.tree_leaves_with_path(got["params"]):
        key = jax.tree_util.keystr(path)
        w = np.asarray(flat_want[path])
        if "lora_" not in key:
            np.testing.assert_array_equal(np.asarray(x), w, err_msg=key)  # the frozen base is untouched
            continue
        # AdamW divides by the gradient's RMS, so summation-order noise in a tiny gradient element moves that
        # element's update (by up to ~1e-3 of the adapter's scale here); the adapter as a whole agrees to 1e-4
        err = np.linalg.norm(np.asarray(x, np.float64) - w) / np.linalg.norm(w)
        assert err < 1e-4, (key, err)
        n += "lora_b" in key
    assert n >= 12  # b of q/kv/o/..., shared experts, latent down/up, experts w1/w3/w2


def test_adapters_and_moments_keep_the_zero3_layout(runs):
    """The routed experts' B ``[layers, experts, rank, out]`` is split over all three axes (w1/w3: rank over
    ``fsdp``; w2, whose ``latent`` took ``fsdp``: rank over ``tensor``), a linear B's rank over ``fsdp``; the
    AdamW moments are laid out as their adapters, after the steps."""
    _, (_, state) = runs
    params = state["params"]
    exp = _experts(params)
    assert exp["w1_lora_b"].sharding.spec == P(None, "expert", "fsdp", "tensor")
    assert exp["w3_lora_b"].sharding.spec == P(None, "expert", "fsdp", "tensor")
    assert exp["w2_lora_b"].sharding.spec == P(None, "expert", "tensor", "fsdp")
    for w in ("w1", "w3", "w2"):
        b = exp[f"{w}_lora_b"]
        assert b.addressable_shards[0].data.size * 8 == b.size, w  # one eighth per device: nothing replicated
    q_b = params["model"]["segment_0"]["layer_0"]["self_attn"]["q_b_proj"]["lora_b"]  # [layers, rank, heads]
    assert q_b.sharding.spec == P(None, "fsdp", "tensor")
    by_key = {jax.tree_util.keystr(p): x.sharding.spec for p, x in jax.tree_util.tree_leaves_with_path(params)}
    checked = 0
    for path, x in jax.tree_util.tree_leaves_with_path(state["opt_state"]):
        key = jax.tree_util.keystr(path)
        for moment in (".mu", ".nu"):
            if moment in key and "lora_b" in key:
                assert x.sharding.spec == by_key[key.split(moment, 1)[1]], key
                checked += 1
    assert checked >= 24
