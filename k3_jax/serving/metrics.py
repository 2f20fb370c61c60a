"""Serving latency metrics kept by the engine (plain Python; :mod:`k3_jax.serving.prometheus` exports them).

* TTFT: seconds from a request's arrival (``add_request``) to its first token.
* Per-token latency: seconds between consecutive tokens of one request (a multi-step decode block hands its
  tokens over together: the first of the block carries the block's time, the others ~0).
"""

from __future__ import annotations

import bisect
import dataclasses
import time

__all__ = ["Histogram", "ServingMetrics", "TTFT_BUCKETS", "TOKEN_BUCKETS"]

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 150.0, 300.0, 600.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


@dataclasses.dataclass
class Histogram:
    """Cumulative-bucket histogram: ``counts[i]`` = observations ``<= bounds[i]`` (the last one is +Inf)."""

    bounds: tuple[float, ...]
    counts: list[int] = dataclasses.field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(upper bound as text, cumulative count)]`` ending with ``("+Inf", count)``."""
        out, run = [], 0
        for bound, c in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            run += c
            out.append((bound, run))
        return out


@dataclasses.dataclass
class ServingMetrics:
    ttft: Histogram = dataclasses.field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    per_token: Histogram = dataclasses.field(default_factory=lambda: Histogram(TOKEN_BUCKETS))

    def token(self, arrival: float, last_token_time: float) -> float:
        """Record one emitted token of a request that arrived at ``arrival`` and emitted its previous token at
        ``last_token_time`` (0: this is its first); returns now (``time.perf_counter``)."""
        now = time.perf_counter()
        if last_token_time == 0.0:
            self.ttft.observe(now - arrival)
        else:
            self.per_token.observe(now - last_token_time)
        return now
