"""Fine-tuning cost: step time, tokens/s and compiled memory of LoRA vs full fine-tuning, bf16 vs MXFP4 base, QAT.

Runs the real train step (:class:`k3_jax.training.loop.Trainer`, AdamW, random token rows) for each variant in
one process and prints one JSON line per variant, then a summary line with the ratios (each variant against
``full``, the peer in the same run):

* ``full``               every weight trains (bf16 experts);
* ``qat``                ``full`` with ``qat="mxfp4"`` (MXFP4 expert weights, MXFP8 expert inputs, STE);
* ``lora{R}_bf16``       rank-R adapters on attention, shared experts, latent projections and routed experts
                         (shared A, per-expert B) over a frozen bf16 base;
* ``lora{R}_mxfp4``      rank-R adapters on attention, shared experts and latent projections over a frozen base
                         whose routed experts stay packed MXFP4.

Per variant: ``step_s`` (median), ``tokens_per_s``, ``trainable`` elements, ``opt_state_gib``, and the
compiled step's ``argument_gib`` / ``temp_gib`` (``memory_analysis``) and ``peak_gib`` (device peak so far).

    python benchmarks/finetune.py --config configs/k3-slice.json --batch-size 8 --seq-len 1024   # H200
    python benchmarks/finetune.py --config configs/k3-tiny.json --batch-size 2 --seq-len 64 --steps 1 \
        --variants full,lora16_mxfp4                                                         # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import numpy as np  # noqa: E402

GIB = 2**30
ALL_TARGETS = ("attention", "shared_experts", "latent", "experts")
PACKED_TARGETS = ("attention", "shared_experts", "latent")


def variant_config(name: str) -> tuple[dict, dict]:
    """``(model_overrides, TrainConfig kwargs)`` of a variant name (see the module docstring)."""
    if name == "full":
        return {}, {}
    if name == "qat":
        return {"qat": "mxfp4"}, {}
    if name.startswith("lora") and "_" in name:
        rank, base = name[4:].split("_", 1)
        if base not in ("bf16", "mxfp4"):
            raise SystemExit(f"variant {name!r}: base must be bf16 or mxfp4")
        targets = ALL_TARGETS if base == "bf16" else PACKED_TARGETS
        return {"expert_format": base}, {"lora_rank": int(rank), "lora_targets": targets}
    raise SystemExit(f"unknown variant {name!r}: full, qat, lora<R>_bf16, lora<R>_mxfp4")


def bench(name: str, config: str, batch: int, seq_len: int, steps: int) -> dict:
    from k3_jax.training import lora
    from k3_jax.training.loop import TrainConfig, Trainer

    over, extra = variant_config(name)
    tc = TrainConfig(config=config, model_overrides=over, workdir="/tmp/k3-bench-finetune", steps=1000,
                     seq_len=seq_len, batch_size=batch, eval_every=0, tensorboard=False, resume=False,
                     optimizer="adamw", **extra)
    tr = Trainer(tc)
    state = tr.init_state()
    train_step, _ = tr.compiled_steps(state)
    rng = np.random.default_rng(0)
    rows = {"tokens": rng.integers(3, tr.cfg.vocab_size, size=(batch, seq_len + 1)).astype(np.int32),
            "segment_ids": np.ones((batch, seq_len + 1), np.int32)}
    b = tr._to_global(rows)
    mem = {}
    if hasattr(train_step, "lower"):
        ma = train_step.lower(state, b).compile().memory_analysis()
        if ma is not None:
            mem = {"argument_gib": round(ma.argument_size_in_bytes / GIB, 3),
                   "temp_gib": round(ma.temp_size_in_bytes / GIB, 3)}
    t0 = time.time()
    state, m = train_step(state, b)
    jax.block_until_ready(m)
    compile_s = time.time() - t0
    times = []
    for _ in range(steps):
        t0 = time.time()
        state, m = train_step(state, b)
        jax.block_until_ready(m)
        times.append(time.time() - t0)
    params = state["params"]
    trainable = (sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) if tr.trainable is None else
                 lora.count_trainable(params, tr.trainable)["lora"])
    step_s = statistics.median(times)
    stats = jax.devices()[0].memory_stats() or {}
    out = {"variant": name, "config": config, "batch": batch, "seq_len": seq_len,
           "device": jax.devices()[0].device_kind, "step_s": round(step_s, 5),
           "tokens_per_s": round(batch * seq_len / step_s, 1), "trainable": trainable,
           "opt_state_gib": round(lora.tree_bytes(state["opt_state"]) / GIB, 4),
           "params_gib": round(lora.tree_bytes(params) / GIB, 4), **mem,
           "peak_gib": round(stats["peak_bytes_in_use"] / GIB, 2) if "peak_bytes_in_use" in stats else None,
           "compile_s": round(compile_s, 1), "loss": round(float(m["loss"]), 4)}
    del state, params, train_step, tr
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/k3-slice.json")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variants", default="full,qat,lora16_bf16,lora64_bf16,lora16_mxfp4,lora64_mxfp4")
    args = ap.parse_args()
    results = {}
    for name in args.variants.split(","):
        r = bench(name, args.config, args.batch_size, args.seq_len, args.steps)
        results[name] = r
        print(json.dumps(r), flush=True)
    if "full" in results:
        base = results["full"]
        print(json.dumps({"summary": {n: {"step_vs_full": round(r["step_s"] / base["step_s"], 3),
                                          "temp_vs_full": (round(r["temp_gib"] / base["temp_gib"], 3)
                                                           if r.get("temp_gib") and base.get("temp_gib") else None)}
                                      for n, r in results.items()}}))


if __name__ == "__main__":
    main()
