"""Pictures of a training run from its ``metrics.jsonl``: ``python -m k3_jax.training.plot RUN_DIR [-o OUT.png]``.

One figure (matplotlib, the ``plot`` extra) with
  * train loss over steps, held-out (eval) loss as markers;
  * throughput: tokens/s over steps (the first, compiling step left out) and MFU on a second axis (MFU is null
    on CPU, where it is marked "n/a");
  * MoE balance: the worst layer's max/mean expert load with the Quantile Balancing bias, the same scores
    routed without the bias, and the mean over layers;
  * two heatmaps over MoE layers (rows, model layer index) x steps (columns): max/mean expert load (1 = even)
    and the number of dead experts (experts that received no token in that step).

Input rows are what :class:`k3_jax.training.metrics.MetricsLogger` writes: ``{"step", "kind": "train" |
"eval" | "meta", ...}``; a train row carries ``loss``, ``tokens_per_s``, ``mfu``, ``load_max_mean``,
``load_max_mean_nobias``, ``load_max_mean_avg`` and, per MoE layer, ``load_max_mean_per_layer`` /
``dead_experts_per_layer``; the ``meta`` start row names the MoE layers (``moe_layer_ids``). When a step
appears more than once (a resumed run appends to the same file) its last row wins. Missing metrics leave
their panel with a note instead of failing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows of a run's ``metrics.jsonl`` (``path``: the run directory or the file itself).

    Raises ``FileNotFoundError`` naming the file, ``ValueError`` naming file and line for a malformed line.
    """
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such metrics file (expected RUN_DIR/{METRICS_FILE} of a train.py run)")
    rows = []
    with open(p, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{i}: not a JSON line ({e})") from None
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError(f"{p}:{i}: a metrics row must be an object with a 'step'")
            rows.append(row)
    return rows


def _by_step(rows: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    last: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r.get("kind", "train") == kind:
            last[int(r["step"])] = r
    return [last[s] for s in sorted(last)]


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def _layer_matrix(rows: list[dict[str, Any]], key: str):
    """([steps], matrix [layers, steps] with NaN where a row lacks the key) or None if no row has it."""
    import numpy as np

    have = [r for r in rows if isinstance(r.get(key), list) and r[key]]
    if not have:
        return None
    n = max(len(r[key]) for r in have)
    mat = np.full((n, len(have)), np.nan)
    for j, r in enumerate(have):
        mat[: len(r[key]), j] = r[key]
    return [int(r["step"]) for r in have], mat


def figure(rows: list[dict[str, Any]], title: str | None = None):
    """A matplotlib ``Figure`` of the run (see the module docstring); rows without ``kind`` count as train."""
    import matplotlib.pyplot as plt
    import numpy as np

    train, evals = _by_step(rows, "train"), _by_step(rows, "eval")
    metas = [r for r in rows if r.get("kind") == "meta" and r.get("moe_layer_ids")]
    fig = plt.figure(figsize=(13, 7.2), layout="constrained")
    grid = fig.add_gridspec(2, 6, height_ratios=[1, 1.1])
    ax_loss, ax_tp, ax_bal = (fig.add_subplot(grid[0, 2 * i : 2 * i + 2]) for i in range(3))
    ax_load, ax_dead = fig.add_subplot(grid[1, :3]), fig.add_subplot(grid[1, 3:])

    x, y = _series(train, "loss")
    if x:
        ax_loss.plot(x, y, lw=1.2, label="train")
    ex, ey = _series(evals, "eval_loss")
    if ex:
        ax_loss.plot(ex, ey, "o-", ms=4, label="eval (held out)")
    if x or ex:
        ax_loss.legend()
    else:
        _note(ax_loss, "no loss logged")
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title="loss")

    x, y = _series(train[1:], "tokens_per_s")  # step 1 includes compilation
    if x:
        ax_tp.plot(x, y, lw=1.0, color="tab:green")
        ax_tp.set_ylim(0, max(y) * 1.15)
    else:
        _note(ax_tp, "no throughput logged")
    ax_tp.set(xlabel="step", ylabel="tokens/s", title="throughput (after the compiling step)")
    mx, my = _series(train[1:], "mfu")
    if mx:
        ax_mfu = ax_tp.twinx()
        ax_mfu.plot(mx, [100 * v for v in my], lw=1.0, color="tab:purple")
        ax_mfu.set_ylim(0, max(100 * v for v in my) * 1.15)
        ax_mfu.set_ylabel("MFU (%)", color="tab:purple")
    else:
        ax_tp.text(0.98, 0.04, "MFU n/a (unknown peak FLOP/s, e.g. CPU)", ha="right", transform=ax_tp.transAxes,
                   color="tab:purple", fontsize=8)

    plotted = False
    for key, label, style in (("load_max_mean", "worst layer, with QB bias", "-"),
                              ("load_max_mean_avg", "mean over layers, with bias", "--"),
                              ("load_max_mean_nobias", "worst layer, no bias", ":")):
        x, y = _series(train, key)
        if x:
            ax_bal.plot(x, y, style, lw=1.2, label=label)
            plotted = True
    if plotted:
        ax_bal.axhline(1.0, color="0.6", lw=0.8)
        ax_bal.legend(fontsize=8)
    else:
        _note(ax_bal, "no MoE load logged")
    ax_bal.set(xlabel="step", ylabel="max / mean expert load", title="MoE balance (Quantile Balancing)")

    layer_ids = metas[-1]["moe_layer_ids"] if metas else None
    for ax, key, label, cmap in ((ax_load, "load_max_mean_per_layer", "max / mean expert load", "magma"),
                                 (ax_dead, "dead_experts_per_layer", "dead experts (no token routed)", "Reds")):
        got = _layer_matrix(train, key)
        ax.set(xlabel="step", title=f"{label} per MoE layer")
        if got is None:
            _note(ax, f"no {key} logged")
            continue
        steps, mat = got
        vmin, vmax = (1.0, max(float(np.nanmax(mat)), 1.01)) if "load" in key else (0, max(float(np.nanmax(mat)), 1))
        im = ax.imshow(mat, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest",
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, mat.shape[0] - 0.5, -0.5))
        names = layer_ids if layer_ids and len(layer_ids) == mat.shape[0] else list(range(mat.shape[0]))
        ticks = list(range(0, mat.shape[0], max(1, mat.shape[0] // 12)))
        ax.set_yticks(ticks, [str(names[i]) for i in ticks])
        ax.set_ylabel("layer" if layer_ids else "MoE layer #")
        fig.colorbar(im, ax=ax, fraction=0.04, pad=0.01)
        if "dead" in key and not np.nanmax(mat) > 0:
            _note(ax, "no dead experts in any layer at any step")
    if title:
        fig.suptitle(title)
    return fig


def save_png(rows: list[dict[str, Any]], out: str | os.PathLike[str], *, title: str | None = None,
             dpi: int = 80) -> str:
    """Render :func:`figure` to a PNG at ``out`` (written to a temporary name, then renamed). Returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    return save_figure(figure(rows, title=title), out, dpi)


def save_figure(fig, out: str | os.PathLike[str], dpi: int = 100) -> str:
    """Write ``fig`` as a PNG at ``out`` through a temp file and a rename (never a half-written ``out``);
    closes the figure. Returns ``out``."""
    import matplotlib.pyplot as plt

    out = os.fspath(out)
    tmp = f"{out}.partial-{os.getpid()}.png"
    try:
        fig.savefig(tmp, dpi=dpi)
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3_jax.training.plot", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a train.py --workdir (or its metrics.jsonl)")
    ap.add_argument("-o", "--out", default=None, help="PNG to write (default: RUN_DIR/metrics.png)")
    ap.add_argument("--title", default=None, help="figure title (default: the run directory's name)")
    ap.add_argument("--dpi", type=int, default=80)
    a = ap.parse_args(argv)
    run = Path(a.run_dir)
    out = a.out or str((run if run.is_dir() else run.parent) / "metrics.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: matplotlib is not installed (pip install 'k3-jax[plot]')", file=sys.stderr)
        return 2
    try:
        rows = read_metrics(run)
        title = a.title or (run if run.is_dir() else run.parent).resolve().name
        save_png(rows, out, title=title, dpi=a.dpi)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
