"""Kill-at-random-points: ``train.py`` SIGKILLed three times (during a step, while a checkpoint is being
written, right after one is committed) and restarted each time ends exactly where an uninterrupted run ends:
every logged loss equals the uninterrupted run's, the final train state is bitwise equal, each restart resumed
from the newest committed checkpoint (which was complete), and no temporary checkpoint directory is left.

Cost: five subprocesses of a one-layer KDA model; the first compiles (persistent compilation cache in a
temporary directory), the other four load the executables from the cache.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS, SAVE_EVERY = 10, 2
ARGS = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--seq-len", "16", "--batch-size", "2",
        "--optimizer", "adamw", "--lr", "1e-2", "--mesh", "none"]
for _kv in ("hidden_size=32", "num_hidden_layers=1", "kda_layers=[0]", "mla_layers=[]", "kda_num_heads=1",
            "kda_head_dim=16", "intermediate_size=64", "num_experts=0", "attn_res_block_size=1",
            "kda_chunk_size=16", "tensorboard=false", "eval_every=0", "log_every=1000"):
    ARGS += ["--set", _kv]
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("xla_cache")
    return {**os.environ, "PYTHONPATH": str(REPO), "K3_COMPILATION_CACHE": str(cache), "JAX_PLATFORMS": "cpu"}


def _start(workdir: Path, env: dict) -> subprocess.Popen:
    with open(workdir.parent / f"{workdir.name}.log", "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, str(REPO / "train.py"), "--workdir", str(workdir), *ARGS],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _rows(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written when the process was killed
            pass
    return rows


def _entries(workdir: Path) -> tuple[set[int], set[str]]:
    """(committed step numbers, temporary directories) under ``workdir/checkpoints``."""
    d = workdir / "checkpoints"
    names = [p.name for p in d.iterdir()] if d.exists() else []
    return {int(n) for n in names if n.isdigit()}, {n for n in names if not n.isdigit()}


def _kill_when(proc: subprocess.Popen, cond) -> bool:
    """SIGKILL ``proc`` as soon as ``cond()`` holds; False if it ended first."""
    deadline = time.time() + TIMEOUT_S
    while proc.poll() is None and time.time() < deadline:
        if cond():
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.002)
    if proc.poll() is None:
        proc.kill()
        pytest.fail("train.py neither reached the kill point nor finished in time")
    return False


def _restore(step_dir: Path) -> dict:
    return ocp.StandardCheckpointer().restore(step_dir / "state")


@pytest.mark.slow
def test_killed_training_resumes_exactly(env, tmp_path):
    ref = tmp_path / "straight"
    proc = _start(ref, env)
    assert proc.wait(TIMEOUT_S) == 0, (tmp_path / "straight.log").read_text()[-3000:]
    ref_losses = {r["step"]: r["loss"] for r in _rows(ref) if r["kind"] == "train"}
    assert sorted(ref_losses) == list(range(1, STEPS + 1))

    work = tmp_path / "killed"

    def logged_step() -> int:
        return max((r["step"] for r in _rows(work) if r["kind"] == "train"), default=0)

    def new_tmp_dir(before):
        return lambda: bool(_entries(work)[1] - before)

    # three kills, each later in the run than the one before: right after the first commit, during a step
    # (three steps past the resumed one, the async save of step 4 possibly in flight), while a save is written
    kill_points = {
        "after a commit": lambda steps, tmp: lambda: bool(_entries(work)[0] - steps),
        "during a step": lambda steps, tmp: lambda: logged_step() >= max(steps, default=0) + 3,
        "during a save": lambda steps, tmp: new_tmp_dir(tmp),
    }
    starts = []
    for name, make_cond in kill_points.items():
        steps, tmp = _entries(work)
        starts.append(max(steps, default=0))
        killed = _kill_when(_start(work, env), make_cond(steps, tmp))
        steps_after, tmp_after = _entries(work)
        print(f"kill {name}: {'killed' if killed else 'ended first'} at logged step {logged_step()}; "
              f"committed {sorted(steps_after)}, temporary {sorted(tmp_after)}")
        if steps_after:  # the newest committed step is complete: it restores, at the step its name says
            latest = max(steps_after)
            assert int(_restore(work / "checkpoints" / str(latest))["step"]) == latest
    steps, _ = _entries(work)
    starts.append(max(steps, default=0))
    proc = _start(work, env)
    assert proc.wait(TIMEOUT_S) == 0, (tmp_path / "killed.log").read_text()[-3000:]

    rows = _rows(work)
    # each process resumed from the newest step committed when it started (0: none yet)
    assert [r["step"] for r in rows if r.get("event") == "start"] == starts
    for r in rows:  # every loss logged, by killed and resumed processes alike, is the straight run's
        if r["kind"] == "train":
            assert r["loss"] == ref_losses[r["step"]], (r["step"], r["loss"], ref_losses[r["step"]])
    assert {r["step"] for r in rows if r["kind"] == "train"} == set(ref_losses)
    log = (tmp_path / "killed.log").read_text()
    assert "damaged" not in log, log[-3000:]

    ref_steps, ref_tmp = _entries(ref)
    steps, tmp = _entries(work)
    assert steps == ref_steps and not tmp and not ref_tmp, (steps, tmp, ref_steps)
    a, b = _restore(ref / "checkpoints" / str(STEPS)), _restore(work / "checkpoints" / str(STEPS))
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))
