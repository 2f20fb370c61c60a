"""The converter CLI as a user meets it: one ``error:`` line and exit code 2 for every user-facing failure,
output checks before any heavy work, stale ``OUT.partial-PID`` leftovers of killed runs swept, and a
conversion killed (SIGKILL) at two moments leaves nothing that looks complete; the next run cleans up."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3_jax.convert.__main__ import main
from k3_jax.convert.fixture import write_fixture

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "hf"
    write_fixture(d, "k3-tiny", experts="bf16", seed=0, max_shard_bytes=2 << 20)
    return d


def _one_error(capsys, rc, *needles):
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _refuse(*_a, **_k):
    raise AssertionError("heavy work started before the output was checked")


def test_output_under_a_regular_file(ckpt, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "out"
    _one_error(capsys, main(["convert", str(ckpt), str(out), "--quiet"]), str(out), "is a file")
    _one_error(capsys, main(["fixture", str(out), "--quiet"]), "is a file")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc (a path nobody can create, even root)")
def test_unwritable_output(ckpt, capsys):
    out = "/proc/k3-convert-test/out"
    _one_error(capsys, main(["convert", str(ckpt), out, "--quiet"]), out)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_read_only_parent(ckpt, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        _one_error(capsys, main(["convert", str(ckpt), str(ro / "out"), "--quiet"]), str(ro / "out"))
    finally:
        ro.chmod(0o700)


def test_export_source_without_k3_config(ckpt, tmp_path, capsys):
    rc = main(["export", str(ckpt), str(tmp_path / "exp"), "--quiet"])  # an HF dir, not a converted one
    _one_error(capsys, rc, "k3_config.json", str(ckpt))
    assert list(tmp_path.iterdir()) == []


def test_output_checked_before_heavy_work(ckpt, tmp_path, capsys, monkeypatch):
    import k3_jax.convert.fixture as fixture_mod
    import k3_jax.convert.orbax_io as orbax_io

    existing = tmp_path / "exists"
    existing.mkdir()
    monkeypatch.setattr(orbax_io, "restore_params", _refuse)  # export: the model load
    monkeypatch.setattr(orbax_io, "_prepare", _refuse)  # convert: reading / verifying the input
    monkeypatch.setattr(fixture_mod, "random_params", _refuse)  # fixture: drawing the parameters
    orbax_like = tmp_path / "orbax"
    orbax_like.mkdir()
    (orbax_like / "k3_config.json").write_text((ckpt / "config.json").read_text())
    _one_error(capsys, main(["export", str(orbax_like), str(existing), "--quiet"]), str(existing), "exists")
    _one_error(capsys, main(["convert", str(ckpt), str(existing), "--quiet"]), str(existing), "exists")
    _one_error(capsys, main(["fixture", str(existing), "--quiet"]), str(existing), "exists")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_leftovers_swept_live_ones_kept(tmp_path):
    from k3_jax.convert.outdir import OWNER_FILE, sweep_stale

    out = tmp_path / "out"
    dead, host = _dead_pid(), socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name, owner in ((f"out.partial-{dead}", None), (f"out.partial-{live.pid}", None),
                            ("out.partial-1234567", {"host": host + "-elsewhere", "pid": 1234567}),
                            (f"out.old-{dead}", {"host": host, "pid": dead}), ("outer.partial-1", None)):
            (tmp_path / name).mkdir()
            if owner:
                (tmp_path / name / OWNER_FILE).write_text(json.dumps(owner))
        msgs = sweep_stale(str(out))
        left = sorted(p.name for p in tmp_path.iterdir())
        # dead partial removed; the dead run's .old- is the last complete output and comes back as out;
        # a live pid's and another host's leftovers stay (named); another output's name is not ours to touch
        assert left == sorted(["out", f"out.partial-{live.pid}", "out.partial-1234567", "outer.partial-1"]), left
        assert len(msgs) == 4, msgs
        assert any("removed stale" in m and f"partial-{dead}" in m for m in msgs), msgs
        assert any("left alone" in m and str(live.pid) in m for m in msgs), msgs
        assert any("left alone" in m and "elsewhere" in m for m in msgs), msgs
        assert any(m.startswith("restored") for m in msgs), msgs
    finally:
        live.kill()
        live.wait()


def _spawn_convert(src: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "K3_PROGRESS_INTERVAL_S": "0", "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-m", "k3_jax.convert", "convert", str(src), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_when(proc: subprocess.Popen, ready) -> None:
    deadline = time.monotonic() + 240
    while not ready(proc):
        assert proc.poll() is None, f"conversion ended before the kill: {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out waiting for the moment to kill"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def test_killed_conversion_leaves_nothing_complete_and_next_run_cleans_up(ckpt, tmp_path):
    out = tmp_path / "orbax"

    def partial_exists(proc):
        time.sleep(0.01)
        return (tmp_path / f"orbax.partial-{proc.pid}").exists()

    seen: list[str] = []

    def mid_write(proc):  # a progress line past the third layer
        seen.append(proc.stderr.readline())
        return seen[-1].startswith("convert: ") and "layer=3/" in seen[-1]

    pids = []
    for ready in (partial_exists, mid_write):
        proc = _spawn_convert(ckpt, out)
        _kill_when(proc, ready)
        pids.append(proc.pid)
        assert not out.exists()
        partial = tmp_path / f"orbax.partial-{proc.pid}"
        assert partial.is_dir() and not (partial / "k3_config.json").exists()
    # the second run found the first one's leftover (its process is dead) and removed it, saying so
    assert f"removed stale {tmp_path}/orbax.partial-{pids[0]}" in "".join(seen), seen
    proc = _spawn_convert(ckpt, out)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert f"removed stale {tmp_path}/orbax.partial-{pids[1]}" in stderr, stderr
    assert json.loads(stdout.strip().splitlines()[-1])["out"] == str(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["orbax"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["k3_config.json", "_METADATA", "_CHECKPOINT_METADATA", "d", "manifest.ocdbt"]), list(out.iterdir())
