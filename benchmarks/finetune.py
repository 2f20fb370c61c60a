"""Fine-tuning cost: step time, tokens/s and memory of LoRA vs full fine-tuning, bf16 vs MXFP4 base, QAT.

Runs the real train step (:class:`k3_jax.training.loop.Trainer`, AdamW, random token rows) of each variant in
its own process and prints one JSON line per variant, then a summary line with the ratios (each variant against
``full``, the peer in the same run):

* ``full``               every weight trains (fp32 masters, bf16 experts);
* ``qat``                ``full`` with ``qat="mxfp4"`` (MXFP4 expert weights, MXFP8 expert inputs, STE);
* ``lora{R}_bf16``       rank-R adapters (fp32) on attention, shared experts, latent projections and routed
                         experts (shared A, per-expert B) over a frozen bf16 base (``param_dtype=bfloat16``);
* ``lora{R}_mxfp4``      rank-R adapters on attention, shared experts and latent projections over a frozen bf16
                         base whose routed experts stay packed MXFP4 (forward on the MXFP4 kernels; the tokens'
                         gradient on the bf16 kernels over the decoded weights, ``pallas_kernels.moe.ops``).

The variants' processes compile at the same time (:meth:`Trainer.precompile`, from shapes, nothing on the
device) and then take turns on the accelerator (a file lock): each places its state, runs one warm-up step and
``--steps`` timed steps alone, and exits, so ``peak_gib`` (the allocator's peak) is that variant's alone. Per
variant: ``step_s`` (median), ``tokens_per_s``, ``trainable`` elements, ``params_gib``, ``opt_state_gib``, the
compiled step's ``argument_gib`` / ``temp_gib`` / ``output_gib`` (``memory_analysis``), ``peak_gib`` and
``compile_s`` (init + train + eval steps).

    python benchmarks/finetune.py --config configs/k3-slice.json --batch-size 8 --seq-len 1024   # H200
    python benchmarks/finetune.py --config configs/k3-tiny.json --batch-size 2 --seq-len 64 --steps 1 \\
        --variants full,lora16_mxfp4 --jobs 1                                                 # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

GIB = 2**30
ALL_TARGETS = ("attention", "shared_experts", "latent", "experts")
PACKED_TARGETS = ("attention", "shared_experts", "latent")
DEFAULT_VARIANTS = "full,qat,lora16_bf16,lora64_bf16,lora16_mxfp4,lora64_mxfp4"


def variant_config(name: str) -> tuple[dict, dict]:
    """``(model_overrides, TrainConfig kwargs)`` of a variant name (see the module docstring)."""
    if name == "full":
        return {}, {}
    if name == "qat":
        return {"qat": "mxfp4"}, {}
    if name.startswith("lora") and "_" in name:
        rank, base = name[4:].split("_", 1)
        if base not in ("bf16", "mxfp4") or not rank.isdigit():
            raise SystemExit(f"variant {name!r}: expected lora<RANK>_bf16 or lora<RANK>_mxfp4")
        targets = ALL_TARGETS if base == "bf16" else PACKED_TARGETS
        return ({"expert_format": base, "param_dtype": "bfloat16"},
                {"lora_rank": int(rank), "lora_alpha": float(rank), "lora_targets": targets})
    raise SystemExit(f"unknown variant {name!r}: full, qat, lora<R>_bf16, lora<R>_mxfp4")


def bench(name: str, config: str, batch: int, seq_len: int, steps: int, overrides: dict | None = None) -> dict:
    """Compile variant ``name``, then (holding the accelerator lock) place its state and time ``steps`` steps."""
    import jax
    import numpy as np

    from benchmarks._lock import accelerator_lock
    from benchmarks.train import peak_memory_gib
    from k3_jax.training import lora
    from k3_jax.training.loop import TrainConfig, Trainer

    over, extra = variant_config(name)
    tc = TrainConfig(config=config, model_overrides={**(overrides or {}), **over}, workdir="/tmp/k3-bench-finetune",
                     steps=1000, seq_len=seq_len, batch_size=batch, eval_every=0, tensorboard=False, resume=False,
                     optimizer="adamw", mesh="none", **extra)
    tr = Trainer(tc)
    pre = tr.precompile()
    ma = pre["train"].memory_analysis()
    mem = {} if ma is None else {"argument_gib": round(ma.argument_size_in_bytes / GIB, 3),
                                 "temp_gib": round(ma.temp_size_in_bytes / GIB, 3),
                                 "output_gib": round(ma.output_size_in_bytes / GIB, 3)}
    rng = np.random.default_rng(0)
    rows = {"tokens": rng.integers(3, tr.cfg.vocab_size, size=(batch, seq_len + 1)).astype(np.int32),
            "segment_ids": np.ones((batch, seq_len + 1), np.int32)}
    train_step, _ = tr.compiled_steps(None)
    with accelerator_lock():
        state = tr.init_state()
        b = tr._to_global(rows)
        state, m = train_step(state, b)  # warm-up (compiled already)
        jax.block_until_ready(m)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            state, m = train_step(state, b)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t0)
        peak = peak_memory_gib()
    params = state["params"]
    trainable = (sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) if tr.trainable is None else
                 lora.count_trainable(params, tr.trainable)["lora"])
    step_s = statistics.median(times)
    return {"variant": name, "config": config, "batch": batch, "seq_len": seq_len,
            "device": jax.devices()[0].device_kind, "moe_implementation": tr.cfg.moe_implementation,
            "step_s": round(step_s, 5),
            "tokens_per_s": round(batch * seq_len / step_s, 1), "trainable": trainable,
            "params_gib": round(lora.tree_bytes(params) / GIB, 3),
            "opt_state_gib": round(lora.tree_bytes(state["opt_state"]) / GIB, 3), **mem, "peak_gib": peak,
            "compile_s": round(pre["compile_s"], 1), "loss": round(float(m["loss"]), 4)}


def parse_overrides(items: list[str]) -> dict:
    """``["key=JSON", ...]`` -> model-config overrides (lists become tuples; a bare word is a string)."""
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def summary(results: dict[str, dict]) -> dict:
    """Each variant's step time, tokens/s and peak memory over ``full``'s (and QAT's step-time overhead)."""
    base = results.get("full")
    if base is None:
        return {}

    def ratio(a, b):
        return round(a / b, 3) if isinstance(a, int | float) and isinstance(b, int | float) and b else None

    out = {n: {"step_vs_full": ratio(r["step_s"], base["step_s"]),
               "peak_vs_full": ratio(r.get("peak_gib"), base.get("peak_gib")),
               "temp_vs_full": ratio(r.get("temp_gib"), base.get("temp_gib"))} for n, r in results.items()}
    if "qat" in results:
        out["qat_step_overhead"] = round(results["qat"]["step_s"] / base["step_s"] - 1.0, 4)
    return out


def run_variants(variants: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """One process per variant, ``args.jobs`` at a time (compiles overlap; timing is serialised by the lock)."""
    env = dict(os.environ)
    lock = env.setdefault("K3_BENCH_LOCK", os.path.join(tempfile.gettempdir(), f"k3-finetune-{os.getpid()}.lock"))
    Path(lock).touch()
    cmd = [sys.executable, __file__, "--config", args.config, "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           *(x for kv in args.set for x in ("--set", kv)), "--child"]
    logs = Path(tempfile.mkdtemp(prefix="k3-finetune-logs-"))  # a child's stdout; its last line is its JSON
    results: dict[str, dict] = {}
    pending = list(variants)
    running: dict[str, subprocess.Popen] = {}
    stopped = threading.Event()  # SIGTERM: stop the variants still going and report the others
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    while (pending or running) and not stopped.is_set():
        while pending and len(running) < max(args.jobs, 1):
            name = pending.pop(0)
            log = logs / f"{name}.log"
            with open(log, "w") as f:
                running[name] = subprocess.Popen([*cmd, name], env=env, stdout=f, text=True)
        for name, proc in list(running.items()):
            if proc.poll() is None:
                continue
            out = (logs / f"{name}.log").read_text().strip().splitlines()
            del running[name]
            if proc.returncode != 0 or not out:
                results[name] = {"variant": name, "error": f"exit {proc.returncode}"}
            else:
                results[name] = json.loads(out[-1])
            print(json.dumps(results[name]), flush=True)
        time.sleep(0.5)
    for name in [*running, *pending]:
        if name in running:
            running[name].kill()
            running[name].wait()
        results[name] = {"variant": name, "error": "stopped by SIGTERM"}
        print(json.dumps(results[name]), flush=True)
    return {n: results[n] for n in variants}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/k3-slice.json")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--jobs", type=int, default=0, help="variant processes at a time (0: all at once)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="model-config override for every variant (e.g. num_hidden_layers=2; repeatable)")
    ap.add_argument("--child", default=None, metavar="VARIANT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(bench(args.child, args.config, args.batch_size, args.seq_len, args.steps,
                               parse_overrides(args.set))), flush=True)
        return
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        variant_config(v)  # refuse a bad name before any process starts
    args.jobs = args.jobs or len(variants)
    results = run_variants(variants, args)
    print(json.dumps({"summary": summary({n: r for n, r in results.items() if "error" not in r})}), flush=True)


if __name__ == "__main__":
    main()
