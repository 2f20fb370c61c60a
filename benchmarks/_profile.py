"""Device-time breakdown of a jitted call, from a JAX profiler trace (used by the GPU benchmarks).

``device_op_times(fn, *args, out_dir=...)`` runs ``fn(*args)`` ``iters`` times under
``jax.profiler.trace`` and sums the device-side events of the Perfetto trace by name, so a benchmark can
print which kernels take the time (e.g. ``kda_chunk_state_gpu`` vs ``kda_chunk_intra_gpu``, or the
top fusions of a train step) next to its wall-clock figures. On CPU there is no device stream: the result
lists host-side XLA ops instead, so the function is testable without a GPU.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os

import jax


def _device_pids(events: list[dict]) -> tuple[set[int], bool]:
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev = {pid for pid, nm in names.items() if nm.startswith(("/device:GPU", "/device:TPU"))}
    return (dev, True) if dev else (set(names), False)


def summarize_trace(path: str, top: int = 25, divide_by: int = 1) -> dict:
    """Sums ``ph == "X"`` events of a ``perfetto_trace.json.gz`` on device processes, by event name.

    Returns ``{"device_events": bool, "total_ms": float, "n_events": int, "top": [[name, ms, count], ...]}``
    with times divided by ``divide_by`` (the number of profiled iterations).
    """
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    pids, on_device = _device_pids(events)
    total = collections.Counter()
    count = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e:
            total[e["name"]] += float(e["dur"])
            count[e["name"]] += 1
    ms = lambda us: round(us / 1e3 / divide_by, 4)
    return {
        "device_events": on_device,
        "total_ms": ms(sum(total.values())),
        "n_events": sum(count.values()) // divide_by,
        "top": [[n[:120], ms(t), count[n] // divide_by] for n, t in total.most_common(top)],
    }


def device_op_times(fn, *args, out_dir: str, iters: int = 3, top: int = 25, timeline: bool = False) -> dict:
    """Profiles ``iters`` calls of ``fn(*args)`` (already compiled) and returns :func:`summarize_trace`, with
    ``timeline``: plus :func:`device_timeline` under ``"timeline"`` (span, idle gaps: is the device waiting)."""
    jax.block_until_ready(fn(*args))
    os.makedirs(out_dir, exist_ok=True)
    jax.profiler.start_trace(out_dir, create_perfetto_trace=True)
    try:
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
    finally:
        jax.profiler.stop_trace()
    traces = sorted(glob.glob(os.path.join(out_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                    key=os.path.getmtime)
    if not traces:
        return {"error": f"no perfetto_trace.json.gz under {out_dir}"}
    summary = summarize_trace(traces[-1], top=top, divide_by=iters)
    if timeline:
        summary["timeline"] = device_timeline(traces[-1], divide_by=iters)
    return summary


def device_timeline(path: str, divide_by: int = 1, gap_us: float = 20.0) -> dict:
    """The device's timeline in a ``perfetto_trace.json.gz``: from its first to its last event (``span``), the
    union of its events (``busy``), the idle rest, the idle gaps over ``gap_us`` (count, time, the 8 longest with
    the event that ends each) and the device-to-host copies (``MemcpyD2H``: a host wait), per ``divide_by``."""
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    pids, on_device = _device_pids(events)
    evs = sorted((float(e["ts"]), float(e["dur"]), e["name"]) for e in events
                 if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e)
    if not evs:
        return {"device_events": on_device, "span_ms": 0.0}
    busy, end, gaps = 0.0, evs[0][0], []
    for ts, dur, name in evs:
        if ts > end:
            if ts - end > gap_us:
                gaps.append((ts - end, name))
        busy += max(0.0, ts + dur - max(ts, end))
        end = max(end, ts + dur)
    span = end - evs[0][0]
    ms = lambda us: round(us / 1e3 / divide_by, 4)
    return {
        "device_events": on_device,
        "span_ms": ms(span), "busy_ms": ms(busy), "idle_ms": ms(span - busy),
        "gaps_over_threshold": round(len(gaps) / divide_by, 2), "gap_ms": ms(sum(g for g, _ in gaps)),
        "longest_gaps_us": [[round(g, 1), n[:60]] for g, n in sorted(gaps, reverse=True)[:8]],
        "d2h_copies": round(sum(1 for _, _, n in evs if "MemcpyD2H" in n) / divide_by, 2),
    }
