"""One summary picture next to a benchmark's JSON line: ``save_lines(out_png, series, ...)``.

Benchmarks that compare against peers (ours vs fla, ...) pass ``{label: [(x, y), ...]}``; points whose ``y``
is missing (a peer not installed, a shape skipped) are dropped, and a series left empty is not drawn.
matplotlib (the ``plot`` extra) is imported only here, so a benchmark without ``--plot`` never needs it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence


def save_lines(out_png: str | os.PathLike[str], series: Mapping[str, Sequence[tuple[float, float | None]]], *,
               title: str, xlabel: str, ylabel: str, logx: bool = False, logy: bool = False,
               point_labels: Mapping[float, str] | None = None,
               styles: Mapping[str, Mapping[str, object]] | None = None) -> str:
    """Draw each series as a marked line and write the PNG (temporary name, then renamed); returns the path.

    ``point_labels``: text written under the x axis positions (e.g. the shape behind each point); ``styles``:
    matplotlib line keywords per series label (``{"color": "C0", "ls": "--"}``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
    drawn = 0
    for label, pts in series.items():
        pts = sorted((x, y) for x, y in pts if isinstance(y, int | float) and math.isfinite(y))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, **(styles or {}).get(label, {}))
            drawn += 1
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    if point_labels:
        ax.set_xticks(list(point_labels), list(point_labels.values()), fontsize=8)
        ax.minorticks_off()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no results to draw", ha="center", va="center", transform=ax.transAxes)
    from k3_jax.training.plot import save_figure

    return save_figure(fig, out_png, dpi=100)
