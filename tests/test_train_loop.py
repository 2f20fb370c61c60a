"""Training loop: exact resume (straight N vs N/2 + restore + N/2), QB balances a skewed router in the step,
loss falls, CLI parsing. Uses a 2-layer micro K3 (one KDA+dense, one MLA+MoE) so one compile serves all."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.training.loop import TrainConfig, Trainer

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
                tensorboard=False, log_every=100, mesh="none")
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """One Trainer (one compile of init + train step) shared by the tests below."""
    tmp = tmp_path_factory.mktemp("train")
    tr = Trainer(_tc(tmp, workdir=str(tmp / "straight")))
    tr.tmp = tmp
    tr.straight = tr.run()
    return tr


def test_resume_reproduces_straight_run_exactly(trainer):
    tr, tmp = trainer, trainer.tmp
    straight = tr.straight["losses"]
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    assert straight[6] < straight[1]  # it learns

    # same trainer object (no recompile), new workdir: "killed" after step 3, then resumed
    tr.tc = dataclasses.replace(tr.tc, workdir=str(tmp / "resumed"), stop_at=3)
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
    lines = (tmp / "resumed" / "metrics.jsonl").read_text().splitlines()
    assert any('"resumed": true' in ln for ln in lines)
    assert (tmp / "resumed" / "checkpoints" / "6").is_dir()


def test_qb_balances_skewed_router_in_train_step(trainer):
    tr = trainer
    state = tr.init_state()
    gate = state["params"]["model"]["segment_1"]["layer_0"]["block_sparse_moe"]["gate"]
    gate["kernel"] = gate["kernel"].at[..., :2].add(0.5)  # experts 0 and 1 win almost every token
    train_step, _ = tr.compiled_steps(state)
    batch = jax.tree.map(jnp.asarray, next(tr.data_iterator()))
    with_qb, without = [], []
    for _ in range(4):
        state, m = train_step(state, batch)
        with_qb.append(float(m["load_max_mean"]))  # routed with the QB bias of the previous step
        without.append(float(m["load_max_mean_nobias"]))  # the same scores routed with no bias
    # step 1: bias still 0, so both agree; busiest expert gets > 1.75x the mean load
    assert with_qb[0] == without[0] > 1.75, (with_qb, without)
    assert min(without) > 1.75, without  # the router itself stays skewed over these steps
    # from step 2 on the QB bias of the previous step routes the tokens: close to balanced
    assert max(with_qb[1:]) < 1.35 and max(with_qb[1:]) < 0.7 * min(without), (with_qb, without)


def test_cli_builds_config():
    from train import build_train_config

    tc = build_train_config(["--steps", "7", "--set", "lr=0.01", "--set", "dtype=float32",
                             "--set", "kda_layers=[0]", "--mesh", "fsdp=-1", "--config", "configs/k3-small.json"])
    assert tc.steps == 7 and tc.lr == 0.01 and tc.mesh == "fsdp=-1"
    assert tc.model_overrides == {"dtype": "float32", "kda_layers": (0,)}
    assert tc.workdir == "runs/k3-small"
    with pytest.raises(SystemExit):
        build_train_config(["--set", "novalue"])


def test_muon_dtype_auto_and_bad_value():
    """``muon_dtype="auto"`` is fp32 on CPU (bf16 on GPU/TPU); ``--set muon_dtype=...`` reaches TrainConfig; an
    unknown dtype is refused with the key's name."""
    from k3_jax.training.loop import resolve_muon_dtype
    from train import build_train_config

    assert jax.default_backend() != "cpu" or resolve_muon_dtype("auto") == "float32"
    assert resolve_muon_dtype("bfloat16") == "bfloat16"
    assert build_train_config(["--set", "muon_dtype=bfloat16"]).muon_dtype == "bfloat16"
    with pytest.raises(ValueError, match="muon_dtype"):
        resolve_muon_dtype("fp8")


def test_flops_per_token_counts_active_params():
    from k3_jax.config import count_params, load_config
    from k3_jax.training.metrics import flops_per_token

    cfg = load_config("configs/k3-tiny.json")
    f = flops_per_token(cfg, 128)
    assert f["matmul"] == 6 * count_params(cfg)["active"]
    assert 0 < f["attention"] < f["matmul"] and np.isclose(f["total"], f["matmul"] + f["attention"])


def test_muon_flops_per_step_counts_blocks_heads_and_stacks():
    import jax

    from k3_jax.training.metrics import muon_flops_per_step

    leaves = {"a": jax.ShapeDtypeStruct((4, 8), np.float32),        # one 4x8 block
              "b": jax.ShapeDtypeStruct((3, 16, 8), np.float32),    # 3 stacked 8x16 blocks (transposed)
              "h": jax.ShapeDtypeStruct((8, 12), np.float32),       # 2 heads of 8x6 -> a=6, b=8
              "e": jax.ShapeDtypeStruct((8,), np.float32)}          # AdamW leaf: no NS
    labels = {"a": "muon", "b": "muon", "h": "muon_h2", "e": "adamw"}

    def per_block(a, b):
        return 4 * a * a * b + 2 * a ** 3

    want = 5 * (per_block(4, 8) + 3 * per_block(8, 16) + 2 * per_block(6, 8))
    assert muon_flops_per_step(leaves, labels, ns_steps=5) == want


def test_sigterm_sets_preemption_flag():
    import os
    import signal

    from k3_jax.training.checkpoint import PreemptionFlag

    flag = PreemptionFlag()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.triggered and flag.signum == signal.SIGTERM
    finally:
        flag.restore_handlers()
    assert signal.getsignal(signal.SIGTERM) is not flag._handle
