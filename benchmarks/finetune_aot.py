"""The LoRA fine-tuning step of full-width K3, compiled for a TPU slice on this host, beside the memory plan.

Compiles ``train_step`` (:func:`k3_jax.training.aot.compile_train_step`, the step ``train.py --lora`` runs:
AdamW on the adapters alone, frozen base with packed MXFP4 experts, bf16 elsewhere) for ``--topology`` on
``--mesh`` and prints one JSON line: the compiler's per-device ``argument`` / ``temp`` bytes next to
:func:`sharding.memory.plan`'s per-device estimate of the same model (params, optimizer, activations) — the
peer in the same run.

The routed experts run through ``--moe`` (``moe_implementation``; default ``auto``: the Mosaic TPU MXFP4 kernel
forward, the tokens' gradient on its bf16 kernels over the decoded weights; ``xla``: ``ragged_dot`` over
experts decoded in XLA).

A full 93-layer compile can take too long on a small host: ``--layers L1,L2`` compiles depth cuts of the
release config (its first L layers, real widths and expert count) and reports each, plus the per-layer figure
``(bytes(L2) - bytes(L1)) / (L2 - L1)`` and the 93-layer figure it extrapolates to (``scaled_93``; stated as
such, not compiled).

    python benchmarks/finetune_aot.py --topology v5p:4x4x4 --mesh fsdp=4,expert=4,tensor=4 --layers 4,8   # v5p-128

``--targets`` picks the adapted weights (default attention, shared experts, latent projections; ``experts`` adds
adapters on the packed routed experts, which then run unfused beside their MXFP4 products).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

GB = 1e9
HBM_OOM = re.compile(r"HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")
TARGETS = ("attention", "shared_experts", "latent")


def depth_cut(config: str, layers: int) -> dict:
    """Model overrides keeping the first ``layers`` layers of ``config`` (its KDA/MLA pattern and dense prefix)."""
    from k3_jax.config import load_config

    cfg = load_config(config)
    if layers >= cfg.num_hidden_layers:
        return {}
    return {"num_hidden_layers": layers, "kda_layers": tuple(i for i in cfg.kda_layers if i < layers),
            "mla_layers": tuple(i for i in cfg.mla_layers if i < layers),
            "first_k_dense_replace": min(cfg.first_k_dense_replace, layers)}


def planned(config: str, overrides: dict, mesh: str, batch: int, seq_len: int, rank: int, accum: int = 1,
            targets: tuple[str, ...] = TARGETS) -> dict:
    """:func:`sharding.memory.plan`'s per-device bytes of the LoRA step (as ``python -m sharding.plan --lora``)."""
    import jax.numpy as jnp

    from k3_jax.config import load_config
    from k3_jax.training import lora
    from sharding.memory import plan
    from sharding.plan import abstract_params

    cfg = load_config(config, **overrides)
    boxed = abstract_params(cfg)
    boxed = lora.with_adapters(boxed, lora.adapter_shapes(boxed, lora.LoraConfig(rank=rank, targets=targets),
                                                          dtype=jnp.float32))
    res = plan(cfg, "train", mesh, batch=batch, seq_len=seq_len, optimizer="adamw", boxed=boxed, lora=True,
               accum=accum)
    return {k: int(v) for k, v in res.per_device.items()}


def one(config: str, layers: int | None, topology: str, mesh: str, batch: int, seq_len: int, rank: int,
        moe: str = "auto", remat: str = "none", accum: int = 1, targets: tuple[str, ...] = TARGETS) -> dict:
    from k3_jax.training.aot import compile_train_step

    over = {"expert_format": "mxfp4", "param_dtype": "bfloat16", "moe_implementation": moe, "remat": remat,
            "vision": None, **(depth_cut(config, layers) if layers else {})}  # the text model's step
    t0 = time.perf_counter()
    est = planned(config, over, mesh, batch, seq_len, rank, accum, targets)
    plan_gb = {k: round(v / GB, 3) for k, v in est.items()}
    try:
        out = compile_train_step(config, topology, mesh, batch, seq_len, overrides=over, accum=accum,
                                 train_overrides={"optimizer": "adamw", "lora_rank": rank, "lora_alpha": float(rank),
                                                  "lora_targets": targets})
    except Exception as e:  # XLA:TPU refuses a program over HBM; its message states the bytes it needed
        m = HBM_OOM.search(str(e))
        if m is None:
            raise
        return {"layers": layers or "all", "fits": False, "compiler_temp_gib_required": float(m.group(1)),
                "compiler_hbm_gib": float(m.group(2)), "plan_gb": plan_gb,
                "wall_s": round(time.perf_counter() - t0, 1)}
    return {"layers": layers or "all", "fits": True, "compiler_argument_gb": round(out["argument_bytes"] / GB, 3),
            "compiler_temp_gb": round(out["temp_bytes"] / GB, 3),
            "compiler_output_gb": round(out["output_bytes"] / GB, 3),
            "plan_gb": plan_gb,
            "plan_params_plus_optimizer_gb": round((est.get("params", 0) + est.get("optimizer", 0)) / GB, 3),
            "mosaic_kernels": out["mosaic_kernels"], "lower_s": out["lower_s"], "compile_s": out["compile_s"],
            "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/k3.json")
    ap.add_argument("--topology", default="v5p:4x4x4", help="v5p:4x4x4 = v5p-128 (64 chips), v5p:4x4x8 = v5p-256")
    ap.add_argument("--mesh", default="fsdp=4,expert=4,tensor=4")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--moe", default="auto", help="moe_implementation of the routed experts (see above)")
    ap.add_argument("--layers", default=None, help="L1,L2: depth cuts to compile (default: the whole model)")
    ap.add_argument("--remat", default="none", choices=("none", "full", "dots"), help="the model's remat policy")
    ap.add_argument("--accum", type=int, default=1, help="gradient-accumulation micro-batches per step")
    ap.add_argument("--targets", default=",".join(TARGETS),
                    help="LoRA targets (add `experts` for adapters on the packed routed experts)")
    args = ap.parse_args()
    targets = tuple(t for t in args.targets.split(",") if t)
    from k3_jax.config import load_config

    total = load_config(args.config).num_hidden_layers
    cuts = [int(x) for x in args.layers.split(",")] if args.layers else [None]
    rows = [one(args.config, c, args.topology, args.mesh, args.batch_size, args.seq_len, args.rank, args.moe,
                args.remat, args.accum, targets) for c in cuts]
    res = {"bench": "finetune_aot", "config": args.config, "topology": args.topology, "mesh": args.mesh,
           "batch": args.batch_size, "seq_len": args.seq_len, "lora_rank": args.rank, "lora_targets": targets,
           "experts": "mxfp4 (frozen, packed)", "moe_implementation": args.moe, "remat": args.remat,
           "accum": args.accum, "cuts": rows}
    if len(cuts) == 2 and None not in cuts and all(r["fits"] for r in rows):
        (l1, r1), (l2, r2) = sorted(zip(cuts, rows, strict=True), key=lambda x: x[0])
        scaled = {}
        for key in ("compiler_argument_gb", "compiler_temp_gb"):
            per = (r2[key] - r1[key]) / (l2 - l1)
            scaled[key] = {"per_layer": round(per, 4), "scaled_93": round(r1[key] + per * (total - l1), 2)}
        res["scaled_from_cuts"] = scaled
        res["plan_full_gb"] = {k: round(v / GB, 3) for k, v in planned(
            args.config, {"expert_format": "mxfp4", "param_dtype": "bfloat16", "remat": args.remat}, args.mesh,
            args.batch_size, args.seq_len, args.rank, args.accum, targets).items()}
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
