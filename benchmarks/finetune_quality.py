"""Fine-tuning quality at small scale: pre-train on the bundled corpus, fine-tune on a held-out slice of it.

The bundled corpus (:mod:`k3_jax.training.corpus`, documents in a fixed order: language-reference sections,
then stdlib docstrings) is cut by document index: the first ``1 - --heldout-frac`` of the documents
pre-train ``--config`` for ``--pretrain-steps`` (AdamW); the model is exported in the release layout (bf16
experts, :func:`k3_jax.training.lora.export`) and fine-tuned from it (``init_from``, as
``train.py --init-from`` does) on the remaining documents for ``--finetune-steps`` each, as

* ``full``  every weight trains (AdamW, ``--lr-full``);
* ``qat``   ``full`` with ``qat="mxfp4"`` (MXFP4 expert weights, MXFP8 expert inputs, STE; its evaluation runs
            the same quantised forward, i.e. the model as exported to MXFP4);
* ``lora``  rank ``--lora-rank`` adapters on attention, shared experts, latent projections and routed
            experts (shared A, per-expert B) over the frozen base (AdamW, ``--lr-lora``).

Held-out loss (``Trainer.evaluate``: the eval split of the fine-tuning slice, every 50th of its documents, never
trained on) is measured at step 0 and every ``--eval-every`` steps. Each run is its own process; all compile at
once (:meth:`Trainer.precompile`; the fine-tunes compile before the base exists, through a persistent
compilation cache in ``OUT/xla-cache``) and take turns on the accelerator (``benchmarks/_lock.accelerator_lock``).
Writes ``OUT/curves.json`` (``{run: {"train": [[step, loss]...], "eval": [[step, loss]...], ...}}``) and
prints one JSON line with the final held-out losses; ``--plot PNG`` draws the held-out curves side by side
(also from an existing file: ``--from-curves OUT/curves.json --plot PNG``, no accelerator).

    python benchmarks/finetune_quality.py --out /tmp/ftq --pretrain-steps 300 --finetune-steps 150   # H200
    python benchmarks/finetune_quality.py --config configs/k3-tiny.json --batch-size 2 --seq-len 64 \\
        --pretrain-steps 4 --finetune-steps 2 --eval-every 1 --out /tmp/ftq                          # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

FINETUNES = ("full", "qat", "lora")
LORA_TARGETS = ("attention", "shared_experts", "latent", "experts")


def split_corpus(out: Path, heldout_frac: float) -> tuple[Path, Path, dict]:
    """Write ``OUT/pretrain.npz`` (the first documents) and ``OUT/heldout.npz`` (the rest) of the bundled shard."""
    import numpy as np

    from k3_jax.training.corpus import load_token_shard, save_token_shard

    tokens, offsets = load_token_shard()
    docs = len(offsets) - 1
    cut = int(round(docs * (1.0 - heldout_frac)))
    if not 0 < cut < docs:
        raise SystemExit(f"--heldout-frac {heldout_frac} leaves no documents on one side of {docs}")
    paths = (out / "pretrain.npz", out / "heldout.npz")
    for path, lo, hi in ((paths[0], 0, cut), (paths[1], cut, docs)):
        save_token_shard(path, tokens[offsets[lo]:offsets[hi]], (offsets[lo:hi + 1] - offsets[lo]).astype(np.int64))
    info = {"documents": docs, "pretrain_documents": cut, "heldout_documents": docs - cut,
            "pretrain_tokens": int(offsets[cut]), "heldout_tokens": int(offsets[docs] - offsets[cut])}
    return paths[0], paths[1], info


def train_config(args: argparse.Namespace, run: str):
    """The :class:`TrainConfig` of ``run`` (``pretrain`` or one of :data:`FINETUNES`), without ``init_from``."""
    from benchmarks.finetune import parse_overrides
    from k3_jax.training.loop import TrainConfig

    out = Path(args.out)
    over = parse_overrides(args.set)
    common = {"config": args.config, "seq_len": args.seq_len, "batch_size": args.batch_size, "optimizer": "adamw",
              "tensorboard": False, "resume": False, "mesh": "none", "log_every": 0, "eval_batches": 2,
              "workdir": str(out / run), "save_every": 0}
    if run == "pretrain":
        return TrainConfig(**common, data=(str(out / "pretrain.npz"),), steps=args.pretrain_steps, lr=args.lr_pretrain,
                           eval_every=max(args.pretrain_steps // 4, 1), model_overrides=over)
    ft = {**common, "data": (str(out / "heldout.npz"),), "steps": args.finetune_steps, "eval_every": args.eval_every}
    if run == "full":
        return TrainConfig(**ft, lr=args.lr_full, model_overrides=over)
    if run == "qat":
        return TrainConfig(**ft, lr=args.lr_full, model_overrides={**over, "qat": "mxfp4"})
    if run == "lora":
        return TrainConfig(**ft, lr=args.lr_lora, model_overrides=over, lora_rank=args.lora_rank,
                           lora_alpha=float(args.lora_rank), lora_targets=LORA_TARGETS)
    raise SystemExit(f"unknown run {run!r}: pretrain, {', '.join(FINETUNES)}")


def _curves(workdir: Path) -> dict:
    from k3_jax.training.plot import read_metrics

    rows = read_metrics(workdir)
    train = sorted({r["step"]: r["loss"] for r in rows if r.get("kind") == "train" and "loss" in r}.items())
    evals = sorted({r["step"]: r["eval_loss"] for r in rows if r.get("kind") == "eval"}.items())
    return {"train": [list(p) for p in train], "eval": [list(p) for p in evals]}


def child(args: argparse.Namespace, run: str) -> dict:
    """Run ``run`` in this process (see the module docstring); returns its curves and timings."""
    from benchmarks._lock import accelerator_lock
    from k3_jax import compile_cache
    from k3_jax.training import lora
    from k3_jax.training.loop import Trainer

    compile_cache.enable(min_compile_seconds=0.0)
    out = Path(args.out)
    base_dir = out / "base"
    tc = train_config(args, run)
    t0 = time.time()
    tr = Trainer(tc)
    pre = tr.precompile()  # fine-tunes: the same steps as from the base (its config.json is this config)
    info: dict = {"run": run}
    if run != "pretrain":
        while not (base_dir / "config.json").is_file():
            time.sleep(1.0)
        tr2 = Trainer(dataclasses.replace(tc, init_from=str(base_dir)))
        info["config_equal_to_base"] = tr2.cfg == tr.cfg  # else the cache misses and it compiles again
        tr = tr2
        pre = tr.precompile()
    info["compile_s"] = round(time.time() - t0, 1)
    with accelerator_lock():
        if run != "pretrain":
            state = tr.init_state()
            ev0 = tr.evaluate(tr.compiled_steps(state)[1], state["params"])
            del state
        t1 = time.time()
        res = tr.run()
        info["run_s"] = round(time.time() - t1, 1)
    info.update(_curves(Path(tc.workdir)))
    if run != "pretrain":
        info["eval"] = [[0, ev0["eval_loss"]], *info["eval"]]
    else:
        ex = lora.export(tr.cfg, res["state"]["params"], base_dir, experts="bf16")
        info["exported"] = ex["path"]
    if tr.trainable is not None:
        info["trainable"] = lora.count_trainable(res["state"]["params"], tr.trainable)
    del pre
    return info


def plot(curves: dict, png: str) -> str:
    """Held-out loss of each fine-tune over its steps (one line each) -> ``png``."""
    from benchmarks._plot import save_lines

    ft = {k: v for k, v in curves["runs"].items() if k != "pretrain"}
    series = {f"{k} (held-out)": [tuple(p) for p in v.get("eval", [])] for k, v in ft.items()}
    meta = curves.get("meta", {})
    title = (f"{Path(meta.get('config', '?')).stem}: fine-tuning on {meta.get('heldout_documents', '?')} held-out "
             f"docs after {meta.get('pretrain_steps', '?')} pre-training steps")
    return save_lines(png, series, title=title, xlabel="fine-tuning step", ylabel="held-out loss (nats/token)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/k3-small.json")
    ap.add_argument("--out", default=None, help="run directory (shards, workdirs, base checkpoint, curves.json)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--pretrain-steps", type=int, default=300)
    ap.add_argument("--finetune-steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--heldout-frac", type=float, default=0.5)
    ap.add_argument("--lr-pretrain", type=float, default=1e-3)
    ap.add_argument("--lr-full", type=float, default=3e-4)
    ap.add_argument("--lr-lora", type=float, default=2e-3)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="model-config override for every run (e.g. num_hidden_layers=2; repeatable)")
    ap.add_argument("--plot", default=None, metavar="PNG", help="draw the held-out curves to this PNG")
    ap.add_argument("--from-curves", default=None, metavar="JSON", help="only plot an existing curves.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.from_curves:
        if not args.plot:
            ap.error("--from-curves needs --plot PNG")
        print(plot(json.loads(Path(args.from_curves).read_text()), args.plot))
        return
    if not args.out:
        ap.error("--out DIR is required")
    if args.child:
        print(json.dumps(child(args, args.child)), flush=True)
        return
    out = Path(args.out)
    if (out / "base").exists():
        raise SystemExit(f"{out / 'base'} exists: give a fresh --out directory")
    out.mkdir(parents=True, exist_ok=True)
    *_, info = split_corpus(out, args.heldout_frac)
    env = dict(os.environ, K3_COMPILATION_CACHE=str(out / "xla-cache"))
    lock = env.setdefault("K3_BENCH_LOCK", os.path.join(tempfile.gettempdir(), f"k3-ftq-{os.getpid()}.lock"))
    Path(lock).touch()
    procs = {}
    for run in ("pretrain", *FINETUNES):  # each child's stdout (its metric lines, then one JSON line) to OUT/RUN.log
        with open(out / f"{run}.log", "w") as log:
            procs[run] = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--child", run], env=env,
                                          stdout=log, text=True)
    while procs["pretrain"].poll() is None:
        time.sleep(1.0)
    if procs["pretrain"].returncode != 0:  # the fine-tunes would wait for the base forever
        for run in FINETUNES:
            procs[run].terminate()
    runs = {}
    for run, proc in procs.items():
        proc.wait()
        lines = (out / f"{run}.log").read_text().strip().splitlines()
        runs[run] = (json.loads(lines[-1]) if proc.returncode == 0 and lines
                     else {"error": f"exit {proc.returncode} (see {out / run}.log)"})
    meta = {**info, "config": args.config, "batch": args.batch_size, "seq_len": args.seq_len,
            "pretrain_steps": args.pretrain_steps, "finetune_steps": args.finetune_steps,
            "lr": {"pretrain": args.lr_pretrain, "full": args.lr_full, "qat": args.lr_full, "lora": args.lr_lora},
            "lora_rank": args.lora_rank}
    curves = {"meta": meta, "runs": runs}
    (out / "curves.json").write_text(json.dumps(curves))
    final = {run: {"eval_first": r["eval"][0] if r.get("eval") else None,
                   "eval_last": r["eval"][-1] if r.get("eval") else None,
                   "eval_min": min((p[1] for p in r.get("eval", [])), default=None),
                   "compile_s": r.get("compile_s"), "run_s": r.get("run_s"), "error": r.get("error")}
             for run, r in runs.items()}
    print(json.dumps({"bench": "finetune_quality", **meta, "runs": final}), flush=True)
    if args.plot:
        print(plot(curves, args.plot))


if __name__ == "__main__":
    main()
