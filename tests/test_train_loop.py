"""Training loop: exact resume (straight N vs N/2 + restore + N/2), QB balances a skewed router in the step,
loss falls, CLI parsing. Uses a 2-layer micro K3 (one KDA+dense, one MLA+MoE) so one compile serves all.

Training state never lies (the second half): a new run refuses a workdir with checkpoints (or moves them
aside), resume falls back past a damaged latest checkpoint (saying which) or takes the step it is given, and a
config change that breaks exact resume is refused naming the fields (a changed shape names the parameter)."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.training.loop import TrainConfig, Trainer, TrainingDiverged
from k3_jax.training.resume import ResumeError, run_config

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
    from k3_jax.cli.train import build_train_config

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
    from k3_jax.cli.train import build_train_config
    from k3_jax.training.loop import resolve_muon_dtype

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


# ----------------------------------------------------------------- resume hardening
@pytest.fixture(scope="module")
def saved_3_6(trainer):
    """A workdir holding the straight run's checkpoints of steps 3 and 6 (save_every=3)."""
    tr = trainer
    out = _run(tr, workdir=str(tr.tmp / "saved_3_6"), save_every=3)
    assert out["losses"] == tr.straight["losses"]
    assert sorted(p.name for p in (tr.tmp / "saved_3_6" / "checkpoints").iterdir()) == ["3", "6"]
    return tr.tmp / "saved_3_6"


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _run(tr, **kw):
    tr.tc = dataclasses.replace(_tc(tr.tmp), **kw)
    return tr.run()


def test_a_nonfinite_loss_stops_the_run_and_saves_nothing_after_it(trainer, tmp_path, monkeypatch):
    """A step whose loss is NaN (here: the compiled step's loss replaced at step 3 of a run saving every 2 steps)
    raises TrainingDiverged naming the step and the last save; the NaN state is not checkpointed (checkpoint 2
    only, no final one) and the metrics say why. ``halt_on_nonfinite=False`` trains on to the end."""
    tr = trainer
    compiled = tr.compiled_steps

    def with_nan_at_step_3(state):
        train_step, eval_step = compiled(state)

        def step(state, batch):
            state, m = train_step(state, batch)
            return state, {**m, "loss": jnp.where(state["step"] == 3, jnp.nan, m["loss"])}

        return step, eval_step

    monkeypatch.setattr(tr, "compiled_steps", with_nan_at_step_3)
    work = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match=r"step 3: loss = nan; nothing saved after step 2"):
        _run(tr, workdir=str(work), save_every=2, async_checkpoint=False)
    assert sorted(p.name for p in (work / "checkpoints").iterdir()) == ["2"]
    assert any('"event": "nonfinite"' in ln for ln in (work / "metrics.jsonl").read_text().splitlines())
    out = _run(tr, workdir=str(tmp_path / "on"), halt_on_nonfinite=False)
    assert out["final_step"] == 6 and np.isnan(out["losses"][3]) and np.isfinite(out["losses"][6])


def _set_aside(workdir):
    """{folder name: sorted entries} of ``<workdir>/set-aside``."""
    root = workdir / "set-aside"
    return {d.name: sorted(p.name for p in d.iterdir()) for d in root.iterdir()} if root.exists() else {}


def test_no_resume_refuses_a_workdir_with_checkpoints(trainer, saved_3_6, tmp_path, capsys):
    tr = trainer
    work = _copy(saved_3_6, tmp_path / "run")
    with pytest.raises(ResumeError) as e:
        _run(tr, workdir=work, resume=False)
    msg = str(e.value)
    assert f"{work}/checkpoints" in msg and "[3, 6]" in msg and "--workdir" in msg and "--start-over" in msg
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["3", "6"]  # untouched

    # --start-over: the old run is moved aside (not deleted) and the new run's own checkpoint is written
    out = _run(tr, workdir=work, resume=False, start_over=True)
    assert out["losses"] == tr.straight["losses"]
    (name, entries), = _set_aside(tmp_path / "run").items()
    assert name.endswith("-start-over") and entries == ["3", "6", "metrics.jsonl"]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["6"]
    assert "moved checkpoints of steps [3, 6]" in capsys.readouterr().err


def test_train_py_no_resume_into_a_run_exits_2_naming_it(saved_3_6, tmp_path, capsys, monkeypatch):
    """The issue's repro: ``train.py --no-resume`` into a workdir with checkpoints used to exit 0 having saved
    nothing; it now exits 2 before any compile, naming the directory, the steps and the ways on."""
    from k3_jax.cli.train import main

    monkeypatch.setenv("K3_COMPILATION_CACHE", "off")
    monkeypatch.setenv("K3_XLA_DEFAULTS", "off")
    work = _copy(saved_3_6, tmp_path / "run")
    sets = [a for k, v in MICRO.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    argv = ["--workdir", work, "--no-resume", "--mesh", "none", "--seq-len", "32", "--steps", "6", *sets,
            "--set", "tensorboard=false"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --no-resume: ") and f"{work}/checkpoints" in err and "[3, 6]" in err, err
    assert "--start-over" in err and "--workdir" in err
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["3", "6"]


def _truncate_largest_array_file(step_dir):
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "ocdbt.process" not in str(p)]
    big = max(files, key=lambda p: p.stat().st_size)
    big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])


def _empty(step_dir):
    shutil.rmtree(step_dir)
    step_dir.mkdir()


@pytest.mark.parametrize("damage", [_truncate_largest_array_file, _empty], ids=["truncated", "empty"])
def test_resume_falls_back_past_a_damaged_latest_checkpoint(trainer, saved_3_6, tmp_path, capsys,
                                                             damage):
    tr = trainer
    work = _copy(saved_3_6, tmp_path / "run")
    damage(tmp_path / "run" / "checkpoints" / "6")
    out = _run(tr, workdir=work)
    assert sorted(out["losses"]) == [4, 5, 6]
    for s in (4, 5, 6):
        assert out["losses"][s] == tr.straight["losses"][s]
    err = capsys.readouterr().err
    assert f"checkpoint step 6 in {work}/checkpoints/6 is damaged" in err, err
    (name, entries), = _set_aside(tmp_path / "run").items()
    assert name.endswith("-after-step-3") and entries == ["6"]
    meta = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("is damaged" in n for row in meta if row.get("event") == "start" for n in row["notes"])


def test_all_checkpoints_damaged_names_each(trainer, saved_3_6, tmp_path):
    work = _copy(saved_3_6, tmp_path / "run")
    for s in ("3", "6"):
        _empty(tmp_path / "run" / "checkpoints" / s)
    with pytest.raises(ResumeError, match=r"(?s)can be restored.*step 6.*step 3.*--start-over"):
        _run(trainer, workdir=work)
    assert not (tmp_path / "run" / "set-aside").exists()  # nothing moved when nothing could be restored


def test_resume_step_picks_a_checkpoint(trainer, saved_3_6, tmp_path):
    tr = trainer
    work = _copy(saved_3_6, tmp_path / "run")
    with pytest.raises(ResumeError, match=r"--resume-step 5: no checkpoint .* \(steps there: \[3, 6\]\)"):
        _run(tr, workdir=work, resume_step=5)
    out = _run(tr, workdir=work, resume_step=3)
    assert {s: out["losses"][s] for s in (4, 5, 6)} == {s: tr.straight["losses"][s] for s in (4, 5, 6)}
    assert list(_set_aside(tmp_path / "run").values()) == [["6"]]


def test_changed_training_options_are_refused_naming_them(trainer, saved_3_6, tmp_path, capsys):
    tr = trainer
    work = _copy(saved_3_6, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
    with pytest.raises(ResumeError) as e:
        _run(tr, workdir=work, lr=2e-2, batch_size=4, steps=9)
    msg = str(e.value)
    for change in ("train.lr: 0.01 -> 0.02", "train.batch_size: 8 -> 4", "train.steps: 6 -> 9",
                   "--allow-config-change", f"{work}/checkpoints"):
        assert change in msg, msg
    # allowed: resumes, says so, and the next checkpoint stores the new config
    out = _run(tr, workdir=work, lr=2e-2, allow_config_change=True)
    assert sorted(out["losses"]) == [4, 5, 6]
    assert "train.lr: 0.01 -> 0.02" in capsys.readouterr().err
    stored = json.loads((tmp_path / "run" / "checkpoints" / "6" / "run" / "metadata").read_text())
    assert stored["train"]["lr"] == 2e-2 and stored["model"]["hidden_size"] == 64


def test_changed_model_shape_names_the_parameter_and_shapes(trainer, tmp_path):
    """A checkpoint of a model with intermediate_size 96 (its state and stored run config), resumed by the
    trainer of intermediate_size 128: refused, naming the parameter paths, both shapes and the config field."""
    from k3_jax.training.checkpoint import Checkpointer

    tr = trainer
    state = jax.eval_shape(tr.init_state)
    mlp = state["params"]["model"]["segment_0"]["layer_0"]["mlp"]
    mlp["gate_proj"]["kernel"] = jax.ShapeDtypeStruct((1, 64, 96), jnp.float32)
    state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), state)
    run_cfg = run_config(_tc(tr.tmp), tr.cfg.replace(intermediate_size=96), muon_dtype=tr.optim_cfg.muon_dtype)
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", async_save=False)
    ckpt.run_config = run_cfg
    ckpt.save(3, state, {})
    ckpt.close()
    with pytest.raises(ResumeError) as e:
        _run(tr, workdir=str(tmp_path / "run"))
    msg = str(e.value)
    assert "params/model/segment_0/layer_0/mlp/gate_proj/kernel: checkpoint (1, 64, 96), model (1, 64, 128)" in msg
    assert "model.intermediate_size: 96 -> 128" in msg and "checkpoint step 3" in msg, msg


def test_cli_resume_flags():
    from k3_jax.cli.train import build_train_config

    tc = build_train_config(["--resume-step", "3", "--allow-config-change"])
    assert tc.resume and tc.resume_step == 3 and tc.allow_config_change and not tc.start_over
    tc = build_train_config(["--start-over"])
    assert not tc.resume and tc.start_over
    assert not build_train_config(["--no-resume"]).resume and not build_train_config(["--no-resume"]).start_over
    with pytest.raises(SystemExit):
        build_train_config(["--no-resume", "--resume-step", "3"])
