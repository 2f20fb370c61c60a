"""Training throughput: tokens/s and MFU of one train step, Pallas kernels vs the pure-JAX reference.

Runs the real train step (chunked CE, Muon/AdamW, QB, weight clipping) of :mod:`k3_jax.training` on random
token rows for ``--config`` twice — ``kda_implementation``/``moe_implementation`` = ``auto`` (Pallas kernels
where the backend has them) and ``reference`` — and prints one JSON line per run plus a summary line:
``{"impl", "config", "batch", "seq_len", "step_s", "tokens_per_s", "tflops_per_device", "mfu", "compile_s"}``.
FLOPs per token and the MFU definition: :mod:`k3_jax.training.metrics`.

    python benchmarks/train.py --config configs/k3-small.json --batch-size 16 --seq-len 2048   # H200
    python benchmarks/train.py --config configs/k3-slice.json --batch-size 4 --seq-len 1024 --impls auto  # K3 widths
    python benchmarks/train.py --config configs/k3-slice.json --batch-size 16 --seq-len 1024 --impls auto \
        --optimizer adamw --steps 3           # H200 headline (AdamW, no remat)
    XLA_PYTHON_CLIENT_PREALLOCATE=true python benchmarks/train.py --config configs/k3-slice.json \
        --batch-size 256 --accum 16 --seq-len 1024 --impls auto --steps 2   # Muon, 262k tokens per step

Muon's Newton–Schulz costs a fixed ``optimizer_tflop_per_step`` (430 TFLOP for k3-slice), so a step of a few
thousand tokens measures the optimizer, not the model: state tokens per step (``batch × seq_len``) with the MFU.
    python benchmarks/train.py --config configs/k3-tiny.json --batch-size 4 --seq-len 128 --steps 3  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The benchmark owns the accelerator: let XLA's GPU allocator use 95% of it, not JAX's default 75% (which also
# caps on-demand growth with XLA_PYTHON_CLIENT_PREALLOCATE=false). Set the variable to override.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._lock import accelerator_lock  # noqa: E402


def bench(config: str, impl: str, batch: int, seq_len: int, steps: int, accum: int, remat: str,
          mesh: str | None, peak_tflops: float | None, profile_dir: str | None = None,
          muon_dtype: str = "auto", optimizer: str = "muon", profile_top: int = 60,
          mla_attention: str = "auto") -> dict:
    from k3_jax.training.loop import TrainConfig, Trainer

    overrides = {"kda_implementation": impl, "moe_implementation": impl, "remat": remat,
                 "mla_attention_implementation": mla_attention}
    tc = TrainConfig(config=config, model_overrides=overrides, workdir="/tmp/k3-bench-train", steps=1000,
                     seq_len=seq_len, batch_size=batch, accum=accum, eval_every=0, tensorboard=False,
                     resume=False, mesh=mesh, peak_tflops=peak_tflops, muon_dtype=muon_dtype,
                     optimizer=optimizer)
    tr = Trainer(tc)
    state = tr.init_state()
    train_step, _ = tr.compiled_steps(state)
    rng = np.random.default_rng(0)
    rows = {"tokens": rng.integers(3, tr.cfg.vocab_size, size=(batch, seq_len + 1)).astype(np.int32),
            "segment_ids": np.ones((batch, seq_len + 1), np.int32)}
    b = tr._to_global(rows)
    t0 = time.time()
    state, m = train_step(state, b)
    jax.block_until_ready(m)
    compile_s = time.time() - t0
    times = []
    with accelerator_lock():
        for _ in range(steps):
            t0 = time.time()
            state, m = train_step(state, b)
            jax.block_until_ready(m)
            times.append(time.time() - t0)
        prof = None
        if profile_dir:
            from benchmarks._profile import device_op_times

            state_box = [state]

            def one_step(b):
                state_box[0], m = train_step(state_box[0], b)
                return m

            prof = device_op_times(one_step, b, out_dir=os.path.join(profile_dir, impl), iters=1, top=profile_top)
    step_s = statistics.median(times)
    tokens = batch * seq_len
    achieved = tr.flops["total"] * tokens / step_s
    n_dev = jax.device_count()
    return {"impl": impl, "config": config, "batch": batch, "seq_len": seq_len, "accum": accum,
            "remat": remat, "mla_attention": mla_attention, "devices": n_dev, "device": jax.devices()[0].device_kind,
            "step_s": round(step_s, 5), "tokens_per_s": round(tokens / step_s, 1),
            "tflops_per_device": round(achieved / n_dev / 1e12, 3),
            "mfu": round(achieved / (tr.peak * n_dev), 4) if tr.peak else None,
            "compile_s": round(compile_s, 1), "loss": round(float(m["loss"]), 4),
            "flops_per_token": tr.flops["total"], "optimizer": optimizer,
            "muon_dtype": tr.optim_cfg.muon_dtype if optimizer == "muon" else None,
            "optimizer_tflop_per_step": round(tr.optimizer_flops / 1e12, 2),
            "model_tflop_per_step": round(tr.flops["total"] * tokens / 1e12, 2),
            "mem_fraction": float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]),
            "peak_gib": peak_memory_gib(), **({"device_profile": prof} if prof else {})}


def peak_memory_gib() -> float | None:
    """Peak bytes in use on device 0 so far (``Device.memory_stats``; None where the backend has none)."""
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return round(peak / 2**30, 2) if peak is not None else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/k3-small.json")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--remat", default="none", choices=("none", "full", "dots"))
    ap.add_argument("--impls", default="auto,reference")
    ap.add_argument("--mesh", default=None)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--muon-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="Newton-Schulz matmul dtype of Muon (TrainConfig.muon_dtype; auto = bf16 on GPU/TPU)")
    ap.add_argument("--optimizer", default="muon", choices=("muon", "adamw"),
                    help="TrainConfig.optimizer; Muon's Newton-Schulz FLOPs per step are reported, not in MFU")
    ap.add_argument("--mla-attention", default="auto", choices=("auto", "xla", "cudnn"),
                    help="K3Config.mla_attention_implementation (auto = cuDNN flash attention on Hopper GPUs)")
    ap.add_argument("--profile-top", type=int, default=60, help="device ops listed in device_profile")
    ap.add_argument("--profile-dir", default=None,
                    help="also profile one step per impl; adds device_profile (top device ops, ms) to the JSON")
    args = ap.parse_args()
    results = []
    for impl in args.impls.split(","):
        try:
            r = bench(args.config, impl, args.batch_size, args.seq_len, args.steps, args.accum, args.remat,
                      args.mesh, args.peak_tflops, args.profile_dir, args.muon_dtype, args.optimizer,
                      args.profile_top, args.mla_attention)
        except Exception as e:  # noqa: BLE001 - report and continue with the peer
            r = {"impl": impl, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(r), flush=True)
        results.append(r)
    ok = [r for r in results if "tokens_per_s" in r]
    if len(ok) == 2:
        print(json.dumps({"summary": "speedup", ok[0]["impl"]: ok[0]["tokens_per_s"],
                          ok[1]["impl"]: ok[1]["tokens_per_s"],
                          "ratio": round(ok[0]["tokens_per_s"] / ok[1]["tokens_per_s"], 3)}))


if __name__ == "__main__":
    main()
