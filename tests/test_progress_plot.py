"""Progress output off a terminal is plain ``JOB: key=value`` lines; ``python -m k3_jax.training.plot`` draws
the bundled default run (``tests/fixtures/default_run_metrics.jsonl``, from ``python train.py``) into a PNG."""

from __future__ import annotations

import io
import logging
import shutil
from pathlib import Path

import pytest

from k3_jax import progress
from k3_jax.progress import Progress, parse_line

FIXTURE = Path(__file__).parent / "fixtures" / "default_run_metrics.jsonl"


def test_non_tty_progress_is_plain_parseable_lines(monkeypatch, tmp_path):
    stream = io.StringIO()  # not a terminal
    with Progress("convert", 3_000_000_000, unit="B", stream=stream, interval_s=0) as p:
        for i in range(3):
            p.update(1_000_000_000, tensors=f"{i + 1}/3", layer=i)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue(), lines
    parsed = [parse_line(ln) for ln in lines]
    assert {job for job, _ in parsed} == {"convert"}
    first, last = parsed[0][1], parsed[-1][1]
    assert first["pct"] == "33.3" and first["done"] == "1.00GB" and first["total"] == "3.00GB"
    assert first["tensors"] == "1/3" and first["layer"] == "0" and first["rate"].endswith("B/s")
    assert first["eta"].endswith("s") and "elapsed" in last and last["pct"] == "100.0"

    # the trainer's progress goes through the same lines (steps, rate, ETA, tokens/s) between its log lines
    from k3_jax.training.metrics import MetricsLogger

    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setenv("K3_PROGRESS_INTERVAL_S", "0")
    log = MetricsLogger(tmp_path, total_steps=4, print_every=100, tensorboard=False)
    for s in (1, 2):
        log.log(s, {"loss": 5.0 - s, "tokens_per_s": 1234.0, "mfu": None})
    log.close()
    rows = [parse_line(ln) for ln in err.getvalue().splitlines()]
    assert [r[0] for r in rows] == ["train"] * 3, err.getvalue()
    assert rows[0][1]["done"] == "1" and rows[0][1]["total"] == "4" and rows[1][1]["tokens_per_s"] == "1234"
    assert rows[1][1]["eta"].endswith("s") and rows[1][1]["rate"].endswith("step/s")

    progress.set_quiet(True)
    try:
        quiet = io.StringIO()
        with Progress("verify", 10, stream=quiet, interval_s=0) as p:
            p.update(10)
        assert quiet.getvalue() == ""
    finally:
        progress.set_quiet(False)
    with pytest.raises(ValueError, match="not a progress line"):
        parse_line("Traceback (most recent call last):")

    # long prefills report on the serving logger, short ones not at all
    assert progress.prefill_progress(progress.LONG_PREFILL_TOKENS - 1, "r0") is None
    got: list[str] = []
    monkeypatch.setattr(logging.getLogger("k3_jax.serving"), "info", got.append)
    p = progress.prefill_progress(4 * progress.LONG_PREFILL_TOKENS, "cmpl-7")
    p.update(progress.LONG_PREFILL_TOKENS)
    p.close()
    job, fields = parse_line(got[-1])
    assert job == "prefill" and fields["request"] == "cmpl-7" and fields["pct"] == "25.0", got


def test_plot_command_writes_png_of_the_default_run(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    from matplotlib import image

    from k3_jax.training.plot import main, read_metrics

    rows = read_metrics(FIXTURE)
    train = [r for r in rows if r.get("kind") == "train"]
    assert len(train) >= 50 and all(len(r["load_max_mean_per_layer"]) == 9 for r in train)
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(FIXTURE, run / "metrics.jsonl")
    out = tmp_path / "run.png"
    assert main([str(run), "-o", str(out)]) == 0
    assert 20_000 < out.stat().st_size < 400_000, out.stat().st_size
    img = image.imread(out)
    assert img.ndim == 3 and img.shape[0] > 400 and img.shape[1] > 800, img.shape
    assert img[..., :3].std() > 0.05  # not a blank canvas
    assert main([str(tmp_path / "nowhere")]) == 2  # a missing run: one error line, exit code 2


def test_kda_benchmark_plot_option(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    kda = pytest.importorskip("benchmarks.kda", reason="benchmarks/kda.py imports failed")
    out = {"device": "test", "results": [
        {"shape": "B=1,T=8192,H=96,K=128,V=128", "ours_fwd_ms": 1.0, "fla_fwd_ms": 1.3, "ours_fwdbwd_ms": 3.0},
        {"shape": "B=1,T=32768,H=32,K=128,V=128", "ours_fwd_ms": 2.0, "fla_fwd_ms": None},
        {"shape": "8x4096x32", "error": "RuntimeError()"}]}
    path = kda.plot_results(out, str(tmp_path / "kda.png"))
    assert Path(path).stat().st_size > 5_000
