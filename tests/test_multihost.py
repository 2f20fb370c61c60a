"""Several JAX processes on this machine (``python -m k3_jax.launch``, gloo CPU collectives) = one process.

One reference run (this pytest process, 1 process x 8 devices, checkpoints at steps 2 and 4) and two launched
runs of the same ``train.py`` arguments, one after the other in one work directory — the ``train`` preset on
mesh ``expert=8``, so the expert-parallel all-to-alls cross processes:

* 2 processes x 4 devices, process 1 SIGKILLed after step 3 (checkpoint of step 2 committed): the launcher
  stops the other and says which process died and how; the losses of steps 1-3 and the params of its step-2
  checkpoint (written by both processes) equal the reference's within fp32 reduction-order tolerance;
* restarted as 4 processes x 2 devices (another process count: the train state is orbax arrays resharded on
  restore, the data state is stored per global batch row, see ``training/data.py``): it resumes at step 2 and
  ends at the reference's losses of steps 3-4 and its final params (its orbax checkpoint, written by all four).

A restart with the same layout repeating the interrupted step bit for bit is ``tests/test_train_kill.py``
(one process). Also: a converted micro checkpoint restored onto a 2-process mesh gives the single-process
logits. Compiles dominate the cost (every process compiles its train step once per layout), so the model is
one MLA + MoE layer of a micro config; the file costs about 330 CPU-seconds (``-m multihost`` selects it alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from k3_jax.cli import train
from k3_jax.launch import free_port, process_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices; see tests/conftest.py")

MICRO = {"hidden_size": 64, "num_hidden_layers": 1, "kda_layers": [], "mla_layers": [0], "first_k_dense_replace": 0,
         "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "kda_num_heads": 2, "kda_head_dim": 16, "intermediate_size": 128,
         "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 32,
         "routed_expert_hidden_size": 32, "attn_res_block_size": 1, "kda_chunk_size": 16}
STEPS, LR = 4, 1e-3
LOSS_RTOL = 1e-5  # observed: 1e-6 relative after 4 steps (cross-process all-reduces sum in another order)
PARAM_ATOL = 2e-5  # observed below; Adam-normalised updates of near-zero gradients amplify order differences


def _args(workdir: Path) -> list[str]:
    sets = [f"--set={k}={json.dumps(v)}" for k, v in MICRO.items()]
    return ["--workdir", str(workdir), "--steps", str(STEPS), "--save-every", "2", "--batch-size", "8",
            "--seq-len", "32", "--mesh", "expert=8", "--preset", "train", "--lr", str(LR),
            "--set=eval_every=0", "--set=tensorboard=false", "--set=log_every=1", "--set=warmup_frac=0.0", *sets]


def _launch(processes: int, program: list[str], cache: Path, extra_env: dict | None = None,
            grace_s: float = 5.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "K3_COMPILATION_CACHE": str(cache), **(extra_env or {})}
    cmd = [sys.executable, "-m", "k3_jax.launch", "--processes", str(processes), "--devices-per-process",
           str(8 // processes), "--grace-s", str(grace_s), "--", *program]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    noise = ("[Gloo]", "    @ ")
    print("\n".join(line for line in out.stdout.splitlines() if not any(n in line for n in noise))[-6000:])
    print(out.stderr[-2000:])
    return out


def _train_rows(workdir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def _losses(workdir: Path) -> dict[int, float]:
    """Step -> loss, the last logged value per step (a resumed run re-logs the steps after its checkpoint)."""
    return {r["step"]: r["loss"] for r in _train_rows(workdir)}


def _read_params(state_dir: Path):
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    tree = ckptr.metadata(state_dir).item_metadata.tree
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), tree)
    return jax.tree.map(np.asarray, ckptr.restore(state_dir, target)["params"])


def _assert_params_close(got, want, what: str) -> None:
    worst = max(float(np.max(np.abs(np.asarray(a, np.float64) - b), initial=0.0))
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    print(f"{what}: max |param difference| {worst:.3g}")
    assert worst <= PARAM_ATOL, f"{what}: params differ by up to {worst:.3g} (tolerance {PARAM_ATOL})"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    cache = tmp / "xla-cache"
    ref = train.build_train_config(_args(tmp / "ref"))
    from k3_jax.training.loop import Trainer

    out = Trainer(ref).run()
    result = {"tmp": tmp, "ref_losses": out["losses"],
              "ref_params": jax.tree.map(np.asarray, jax.device_get(out["state"]["params"]))}
    result["killed"] = _launch(2, ["tests/multihost/train_then_die.py", *_args(tmp / "run")], cache,
                               {"K3_DIE_AFTER_STEP": "3", "K3_DIE_PROCESS": "1", "K3_DIE_AFTER_CHECKPOINT": "2"})
    result["killed_rows"] = _train_rows(tmp / "run")
    result["resumed"] = _launch(4, ["train.py", *_args(tmp / "run")], cache)
    return result


def _assert_losses_match_reference(losses: dict[int, float], steps, ref: dict[int, float], what: str) -> None:
    steps = list(steps)
    assert sorted(losses) == steps, (what, sorted(losses))
    np.testing.assert_allclose([losses[s] for s in steps], [ref[s] for s in steps], rtol=LOSS_RTOL, err_msg=what)


@pytest.mark.multihost
def test_launcher_stops_everyone_when_one_process_dies(runs):
    out = runs["killed"]
    assert out.returncode == 128 + 9, (out.returncode, out.stderr[-2000:])
    assert "process 1 (pid" in out.stderr and "was killed by SIGKILL; stopping the other 1 running" in out.stderr
    # process 0 logged step 2 (committed) and maybe step 3 before it was stopped, never step 4
    assert [r["step"] for r in runs["killed_rows"]] in ([1, 2], [1, 2, 3]), runs["killed_rows"]


@pytest.mark.multihost
def test_two_processes_train_like_one(runs):
    killed = {r["step"]: r["loss"] for r in runs["killed_rows"]}
    _assert_losses_match_reference(killed, sorted(killed), runs["ref_losses"], "2x4 vs 1x8")
    _assert_params_close(_read_params(runs["tmp"] / "run" / "checkpoints" / "2" / "state"),
                         _read_params(runs["tmp"] / "ref" / "checkpoints" / "2" / "state"), "2x4 vs 1x8 at step 2")


@pytest.mark.multihost
def test_restart_on_four_processes_resumes_where_two_were_killed(runs):
    out = runs["resumed"]
    assert out.returncode == 0, out.stderr[-2000:]
    rows = _train_rows(runs["tmp"] / "run")
    killed_steps = [r["step"] for r in runs["killed_rows"]]
    assert [r["step"] for r in rows] == [*killed_steps, 3, 4], rows  # resumed from the step-2 checkpoint
    _assert_losses_match_reference(_losses(runs["tmp"] / "run"), range(1, STEPS + 1), runs["ref_losses"],
                                   "2x4 killed, resumed 4x2, vs 1x8")
    _assert_params_close(_read_params(runs["tmp"] / "run" / "checkpoints" / str(STEPS) / "state"),
                         runs["ref_params"], "4x2 (resumed) vs 1x8")


@pytest.mark.multihost
def test_converted_checkpoint_restored_on_two_processes_gives_single_process_logits(tmp_path):
    from k3_jax.config import load_config
    from k3_jax.convert.fixture import write_fixture
    from k3_jax.convert.orbax_io import convert_to_orbax, restore_params_on_mesh
    from k3_jax.model import K3ForCausalLM

    # the micro config with a KDA layer in front: every kind of converted tensor, MXFP4 experts included
    micro = {**MICRO, "num_hidden_layers": 2, "kda_layers": [0], "mla_layers": [1]}
    cfg = load_config(ROOT / "configs" / "k3-tiny.json").replace(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in micro.items()})
    write_fixture(tmp_path / "hf", cfg, experts="mxfp4", seed=0)
    convert_to_orbax(tmp_path / "hf", tmp_path / "orbax")
    out = _launch(2, ["tests/multihost/converted_logits.py", str(tmp_path / "orbax"), str(tmp_path / "mp.npz")],
                  tmp_path / "xla-cache")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "process 1/2: 4 local shards" in out.stdout
    cfg, params = restore_params_on_mesh(tmp_path / "orbax", None, "serve", dtype="float32")
    tokens = ((7 * np.arange(2 * 16) + 3) % cfg.vocab_size).astype(np.int32).reshape(2, 16)
    want = np.asarray(jax.jit(lambda p, t: K3ForCausalLM(cfg).apply({"params": p}, t))(params, tokens))
    got = np.load(tmp_path / "mp.npz")["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_process_env_sets_distributed_and_cpu_device_variables():
    env = process_env({"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"}, process_id=2,
                      num_processes=4, coordinator=f"127.0.0.1:{free_port()}", platform="cpu",
                      devices_per_process=2)
    assert env["JAX_PROCESS_ID"] == "2" and env["JAX_NUM_PROCESSES"] == "4"
    assert env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo" and env["JAX_PLATFORMS"] == "cpu"
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=2"
    gpu = process_env({}, process_id=1, num_processes=2, coordinator="127.0.0.1:1", platform="gpu",
                      devices_per_process=4)
    assert gpu["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_launcher_prefixes_output_and_stops_the_rest_on_failure():
    """No JAX: process 1 prints and exits 3 while process 0 would sleep for a minute."""
    prog = ("import os, sys, time; i = int(os.environ['JAX_PROCESS_ID']); print('hello from', i, flush=True); "
            "time.sleep(60 if i == 0 else 0.5); sys.exit(3)")
    cmd = [sys.executable, "-m", "k3_jax.launch", "--processes", "2", "--grace-s", "2", "--", "-c", prog]
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 3, out
    assert "[p0] hello from 0" in out.stdout and "[p1] hello from 1" in out.stdout
    assert "process 1 (pid" in out.stderr and "exited with code 3; stopping the other 1 running" in out.stderr


def test_plan_process_layout():
    from sharding.plan import process_layout

    sizes = {"data": 1, "fsdp": 2, "expert": 4, "sequence": 1, "tensor": 1}
    two = process_layout(sizes, 2, 8, 1e9)
    assert two == {"processes": 2, "devices_per_process": 4, "per_process_bytes": 4e9, "batch_rows_per_process": 4,
                   "axes_across_processes": ["fsdp"]}
    assert process_layout(sizes, 4, 8, 1e9)["axes_across_processes"] == ["fsdp", "expert"]
    with pytest.raises(ValueError, match="do not split"):
        process_layout(sizes, 3, 8, 1e9)
