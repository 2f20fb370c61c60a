"""Train a K3 model: ``python train.py`` trains ``configs/k3-tiny.json`` on the bundled corpus (CPU, minutes).

Examples::

    python train.py                                   # tiny model, bundled corpus, loss falls
    python train.py --config configs/k3-small.json --steps 2000 --batch-size 64 --seq-len 1024
    python train.py --set lr=1e-3 --set dtype=float32 # --set: TrainConfig fields or model-config fields
    python train.py --mesh fsdp=-1 --preset train     # shard over all devices (sharding/ presets)
    python train.py --data my_tokens.npz               # shards from python -m k3_jax.training.tokenize

The same command runs on one CPU, one GPU, a multi-GPU host or a TPU pod: on several processes
``jax.distributed`` is initialised from the launcher's environment (TPU pod metadata, SLURM, Open MPI, or
``JAX_COORDINATOR_ADDRESS``/``JAX_NUM_PROCESSES``/``JAX_PROCESS_ID``; locally: ``python -m k3_jax.launch``),
each process reads the rows of the global batch its devices hold, and checkpoints are written by all processes
into one orbax directory.
Re-running with the same ``--workdir`` resumes from the latest checkpoint (exact same loss trajectory);
SIGTERM saves a checkpoint and exits. Metrics: ``<workdir>/metrics.jsonl`` (+ TensorBoard if installed).

Resume is checked: each checkpoint stores the run's config (model config + the training options the loss
trajectory depends on); a resume with a changed value is refused, naming each field with its old and new
value, unless ``--allow-config-change``; a changed model shape names the parameter and both shapes. A damaged
latest checkpoint is reported and the previous one used; ``--resume-step N`` picks a step. Checkpoints after
the resumed step are moved to ``<workdir>/set-aside/`` (never deleted). ``--no-resume`` starts a new run and
refuses a --workdir that holds checkpoints; ``--start-over`` moves them (and the metrics) to
``<workdir>/set-aside/`` first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def build_train_config(argv: list[str] | None = None):
    from k3_jax.training.loop import TrainConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--config", default=None, help="model config json (default configs/k3-tiny.json)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a TrainConfig field or a model-config field (repeatable; JSON values)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None, help="global rows per step")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--accum", type=int, default=None, help="gradient-accumulation micro-batches")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--optimizer", choices=("muon", "adamw"), default=None)
    p.add_argument("--data", action="append", default=None, help="token shard .npz (repeatable)")
    p.add_argument("--mesh", default=None, help='mesh axes, e.g. "fsdp=-1" or "data=2,fsdp=4,tensor=2"')
    p.add_argument("--preset", default=None, help="sharding preset (train, long-context, or a json name)")
    p.add_argument("--save-every", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--no-resume", action="store_true",
                   help="start a new run; refused if --workdir already holds checkpoints (see --start-over)")
    p.add_argument("--start-over", action="store_true",
                   help="start a new run at step 0 in --workdir, first moving its checkpoints and metrics to "
                        "<workdir>/set-aside/<time>-start-over/ (implies --no-resume)")
    p.add_argument("--resume-step", type=int, default=None, metavar="N",
                   help="resume checkpoint step N instead of the latest good one (later steps are moved aside)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume although the checkpoint's stored run config differs (the changes are printed)")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="fine-tune: start from a converted (HF layout) checkpoint; its config.json is the model")
    p.add_argument("--lora", type=int, default=None, metavar="RANK",
                   help="LoRA fine-tuning of rank RANK: only adapters train, the base stays frozen (MXFP4 packed)")
    p.add_argument("--lora-targets", default=None, metavar="T1,T2",
                   help="comma-separated: attention, mlp, shared_experts, latent, experts, or path regexes")
    p.add_argument("--lora-alpha", type=float, default=None)
    p.add_argument("--lora-experts", choices=("shared_a", "per_expert"), default=None,
                   help="routed-expert adapters: one A shared by all experts with per-expert B, or A/B per expert")
    p.add_argument("--qat", choices=("none", "mxfp4"), default=None,
                   help="mxfp4: routed experts run on MXFP4 weights and MXFP8 inputs (straight-through grads)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--quiet", action="store_true", help="no progress bar / progress lines (metric lines stay)")
    args = p.parse_args(argv)
    if args.quiet:
        from k3_jax import progress

        progress.set_quiet()
    if args.resume_step is not None and (args.no_resume or args.start_over):
        p.error("--resume-step resumes a run; it cannot go with --no-resume or --start-over")

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    hints = typing.get_type_hints(TrainConfig)
    train_kw: dict = {}
    model_kw: dict = {}
    for item in args.set:
        if "=" not in item:
            p.error(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        value = _parse_value(value)
        if key in fields and key != "model_overrides":
            if hints[key] is tuple[str, ...] or key == "data":
                value = tuple(value) if isinstance(value, list) else (value,)
            train_kw[key] = value
        else:
            model_kw[key] = tuple(value) if isinstance(value, list) else value
    direct = {"config": args.config, "workdir": args.workdir, "steps": args.steps,
              "batch_size": args.batch_size, "seq_len": args.seq_len, "accum": args.accum, "lr": args.lr,
              "optimizer": args.optimizer, "mesh": args.mesh, "preset": args.preset,
              "save_every": args.save_every, "eval_every": args.eval_every, "seed": args.seed,
              "data": tuple(args.data) if args.data else None, "init_from": args.init_from,
              "lora_rank": args.lora, "lora_alpha": args.lora_alpha, "lora_experts": args.lora_experts,
              "lora_targets": tuple(t for t in args.lora_targets.split(",") if t) if args.lora_targets else None}
    if args.qat is not None:
        model_kw["qat"] = args.qat
    train_kw.update({k: v for k, v in direct.items() if v is not None})
    if args.no_resume or args.start_over:
        train_kw["resume"] = False
    if args.start_over:
        train_kw["start_over"] = True
    if args.resume_step is not None:
        train_kw["resume_step"] = args.resume_step
    if args.allow_config_change:
        train_kw["allow_config_change"] = True
    if "workdir" not in train_kw and "config" in train_kw:
        from pathlib import Path

        train_kw["workdir"] = f"runs/{Path(train_kw['config']).stem}"
    return TrainConfig(model_overrides=model_kw, **train_kw)


def main(argv: list[str] | None = None) -> int:
    from k3_jax import xla_flags

    xla_flags.apply_defaults()  # before any backend exists (cuBLAS GEMMs on GPU; see k3_jax/xla_flags.py)
    try:
        from sharding.mesh import initialize_distributed
    except ImportError:  # sharding package absent: single process only
        initialize_distributed = None
    if initialize_distributed is not None:
        initialize_distributed()
    tc = build_train_config(argv)
    from k3_jax import compile_cache
    from k3_jax.training.loop import Trainer

    compile_cache.enable()

    from k3_jax.training.checkpoint import CheckpointError
    from k3_jax.training.loop import TrainingDiverged
    from k3_jax.training.resume import ResumeError

    trainer = Trainer(tc)
    print(f"k3-jax train: {tc.config} | steps {tc.steps} | batch {tc.batch_size}x{tc.seq_len} | "
          f"optimizer {tc.optimizer} | params {trainer.param_groups} | workdir {tc.workdir}", flush=True)
    try:
        out = trainer.run()
    except (ResumeError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except TrainingDiverged as e:
        print(f"error: training diverged: {e}", file=sys.stderr, flush=True)
        return 3
    losses = out["losses"]
    if losses:
        steps = sorted(losses)
        first, last = losses[steps[0]], losses[steps[-1]]
        print(json.dumps({"first_step": steps[0], "first_loss": round(first, 4), "last_step": steps[-1],
                          "last_loss": round(last, 4), "eval": out["eval"][-1:] or None,
                          "wall_s": round(out["wall_s"], 1), "compile_s": round(out["compile_s"] or 0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
