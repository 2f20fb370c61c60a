"""Training loop: exact resume (straight N vs N/2 + restore + N/2), QB balances a skewed router in the step,
loss falls, CLI parsing. Uses a 2-layer micro K3 (one KDA+dense, one MLA+MoE) so one compile serves all."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.training.loop import TrainConfig, Trainer
from k3_jax.training.optim import OptimConfig, build_optimizer, param_labels
from k3_jax.training.step import StepConfig, make_train_step

MICRO = {
    "hidden_size": 64, "num_hidden_layers": 2, "kda_layers": [0], "mla_layers": [1],
    "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "kda_num_heads": 2, "kda_head_dim": 16,
    "intermediate_size": 128, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
    "moe_intermediate_size": 32, "routed_expert_hidden_size": 32, "attn_res_block_size": 2,
    "kda_chunk_size": 16,
}


def _tc(tmp_path, **kw):
    base = dict(model_overrides={k: tuple(v) if isinstance(v, list) else v for k, v in MICRO.items()},
                workdir=str(tmp_path / "run"), steps=6, seq_len=32, batch_size=8, lr=1e-2, eval_every=0,
                tensorboard=False, log_every=100)
    base.update(kw)
    return TrainConfig(**base)


def test_resume_reproduces_straight_run_exactly(tmp_path):
    tr = Trainer(_tc(tmp_path, workdir=str(tmp_path / "straight")))
    straight = tr.run()["losses"]
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    assert straight[6] < straight[1]  # it learns

    # same trainer object (one compile), new workdir: "killed" after step 3, then resumed
    tr.tc = dataclasses.replace(tr.tc, workdir=str(tmp_path / "resumed"), stop_at=3)
    first = tr.run()
    assert first["final_step"] == 3
    tr.tc = dataclasses.replace(tr.tc, stop_at=None)
    second = tr.run()
    assert sorted(second["losses"]) == [4, 5, 6]
    for s in (1, 2, 3):
        assert first["losses"][s] == straight[s]
    for s in (4, 5, 6):
        assert second["losses"][s] == straight[s], (s, second["losses"][s], straight[s])
    # the QB-updated router bias is part of the restored state
    bias = second["state"]["params"]["model"]["segment_1"]["layer_0"]["block_sparse_moe"]["gate"][
        "e_score_correction_bias"]
    assert float(jnp.abs(bias).max()) > 0
    lines = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert any('"resumed": true' in ln for ln in lines)


def test_qb_balances_skewed_router_in_train_step(tmp_path):
    tc = _tc(tmp_path)
    tr = Trainer(tc)
    cfg, model = tr.cfg, tr.model
    params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 32), jnp.int32)))["params"]
    moe_path = ("model", "segment_1", "layer_0", "block_sparse_moe", "gate", "kernel")
    gate = params
    for k in moe_path[:-1]:
        gate = gate[k]
    gate["kernel"] = gate["kernel"].at[..., :2].add(0.5)  # experts 0 and 1 win almost every token
    labels = param_labels(params, cfg)
    tx = build_optimizer(OptimConfig(lr=0.0, total_steps=10, weight_clip=None), labels)
    step = jax.jit(make_train_step(model, tx, labels, cfg, StepConfig(weight_clip=None)))
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
             "rng": jax.random.key_data(jax.random.key(1))}
    batch = jax.tree.map(jnp.asarray, next(tr.data_iterator()))
    loads = []
    for _ in range(4):
        state, m = step(state, batch)
        loads.append(float(m["load_max_mean"]))
    # lr = 0: params never change, so without balancing every step would route like step 1
    assert loads[0] > 2.0, loads
    assert loads[-1] < 0.6 * loads[0], loads
    assert loads[-1] < 1.6, loads


def test_cli_builds_config():
    from train import build_train_config

    tc = build_train_config(["--steps", "7", "--set", "lr=0.01", "--set", "dtype=float32",
                             "--set", "kda_layers=[0]", "--mesh", "fsdp=-1", "--config", "configs/k3-small.json"])
    assert tc.steps == 7 and tc.lr == 0.01 and tc.mesh == "fsdp=-1"
    assert tc.model_overrides == {"dtype": "float32", "kda_layers": (0,)}
    assert tc.workdir == "runs/k3-small"
    with pytest.raises(SystemExit):
        build_train_config(["--set", "novalue"])


def test_flops_per_token_counts_active_params():
    from k3_jax.config import count_params, load_config
    from k3_jax.training.metrics import flops_per_token

    cfg = load_config("configs/k3-tiny.json")
    f = flops_per_token(cfg, 128)
    assert f["matmul"] == 6 * count_params(cfg)["active"]
    assert 0 < f["attention"] < f["matmul"] and np.isclose(f["total"], f["matmul"] + f["attention"])
