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
once from shapes (:meth:`Trainer.precompile`; a fine-tune's init step takes the base's shapes, so nothing is
compiled once the base exists) and take turns on the accelerator (``benchmarks/_lock.accelerator_lock``; the
pre-training first in practice, the others wait for its base). No run writes a checkpoint.
``--curves`` (default ``OUT/curves.json``: ``{"meta": ..., "runs": {run: {"train": [[step, loss]...],
"eval": [[step, loss]...], ...}}}``) is rewritten as the runs progress (a run still going is marked
``"partial"``) and as each ends, so an interrupted call still leaves the curves so far; the last line printed is
one JSON line with the final held-out losses. ``--plot PNG`` draws the held-out curves side by side as each run
ends (also from an existing file: ``--from-curves curves.json --plot PNG``, no accelerator).

    python benchmarks/finetune_quality.py --out /tmp/ftq --pretrain-steps 150 --finetune-steps 60    # H200
    python benchmarks/finetune_quality.py --config configs/k3-tiny.json --batch-size 2 --seq-len 64 \\
        --pretrain-steps 4 --finetune-steps 2 --eval-every 1 --out /tmp/ftq                          # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
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
              "workdir": str(out / run), "save_every": 0, "save_final": False}
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
    """``{"train": [[step, loss]...], "eval": [[step, loss]...]}`` from a run's metrics so far (empty before it
    logs), with the step-0 held-out loss of a fine-tune (``eval0.json``, written before its first step)."""
    from k3_jax.training.plot import read_metrics

    rows = read_metrics(workdir) if (workdir / "metrics.jsonl").is_file() else []
    train = sorted({r["step"]: r["loss"] for r in rows if r.get("kind") == "train" and "loss" in r}.items())
    evals = dict(r for r in ((r["step"], r["eval_loss"]) for r in rows if r.get("kind") == "eval"))
    if (workdir / "eval0.json").is_file():
        evals[0] = json.loads((workdir / "eval0.json").read_text())["eval_loss"]
    return {"train": [list(p) for p in train], "eval": [list(p) for p in sorted(evals.items())]}


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _stop_on_term() -> threading.Event:
    """An event set by SIGTERM (instead of the default exit), so a parent can stop its children and report."""
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    return stopped


def child(args: argparse.Namespace, run: str) -> dict:
    """Run ``run`` in this process (see the module docstring); returns its curves and timings.

    A fine-tune compiles its steps from shapes before the base exists: its trainer is built from ``--config``
    (what the base's ``config.json`` will say; checked once the base is written) with ``init_from`` set to the
    base directory, which is only read by ``init_state``.
    """
    from benchmarks._lock import accelerator_lock
    from k3_jax.config import load_config
    from k3_jax.training import lora
    from k3_jax.training.loop import Trainer

    out = Path(args.out)
    base_dir = out / "base"
    tc = train_config(args, run)
    t0 = time.time()
    tr = Trainer(tc)
    if run != "pretrain":
        tr.tc = dataclasses.replace(tc, init_from=str(base_dir))
    pre = tr.precompile()
    info: dict = {"run": run, "compile_s": round(time.time() - t0, 1)}
    if run != "pretrain":
        t1 = time.time()
        while not (base_dir / "config.json").is_file():
            time.sleep(0.5)
        info["base_wait_s"] = round(time.time() - t1, 1)
        base_cfg = load_config(base_dir / "config.json", **tc.model_overrides)
        if base_cfg != tr.cfg:
            raise SystemExit(f"{base_dir}/config.json differs from {tc.config} with --set overrides: the steps "
                             "compiled from shapes do not fit the base")
    t1 = time.time()
    with accelerator_lock():
        info["lock_wait_s"] = round(time.time() - t1, 1)
        t1 = time.time()
        if run != "pretrain":
            state = tr.init_state()
            _write_json(Path(tc.workdir) / "eval0.json", tr.evaluate(tr.compiled_steps(state)[1], state["params"]))
            del state
        res = tr.run()
        info["run_s"] = round(time.time() - t1, 1)
    info.update(_curves(Path(tc.workdir)))
    if run == "pretrain":
        t1 = time.time()
        ex = lora.export(tr.cfg, res["state"]["params"], base_dir, experts="bf16")
        info["exported"] = ex["path"]
        info["export_s"] = round(time.time() - t1, 1)
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
    ap.add_argument("--curves", default=None, metavar="JSON",
                    help="where curves.json goes (default OUT/curves.json); rewritten as the runs progress")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="draw the held-out curves to this PNG (redrawn as each run ends)")
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
    curves_path = Path(args.curves) if args.curves else out / "curves.json"
    *_, info = split_corpus(out, args.heldout_frac)
    env = dict(os.environ)
    lock = env.setdefault("K3_BENCH_LOCK", os.path.join(tempfile.gettempdir(), f"k3-ftq-{os.getpid()}.lock"))
    Path(lock).touch()
    meta = {**info, "config": args.config, "batch": args.batch_size, "seq_len": args.seq_len,
            "pretrain_steps": args.pretrain_steps, "finetune_steps": args.finetune_steps,
            "lr": {"pretrain": args.lr_pretrain, "full": args.lr_full, "qat": args.lr_full, "lora": args.lr_lora},
            "lora_rank": args.lora_rank}
    procs = {}
    for run in ("pretrain", *FINETUNES):  # each child's stdout (its metric lines, then one JSON line) to OUT/RUN.log
        with open(out / f"{run}.log", "w") as log:
            procs[run] = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--child", run], env=env,
                                          stdout=log, text=True)
    runs: dict[str, dict] = {}
    stopped = _stop_on_term()
    last_write = 0.0
    while len(runs) < len(procs):
        ended = False
        for run, proc in procs.items():
            if run in runs or proc.poll() is None:
                continue
            lines = (out / f"{run}.log").read_text().strip().splitlines()
            runs[run] = (json.loads(lines[-1]) if proc.returncode == 0 and lines
                         else {"error": f"exit {proc.returncode} (see {out / run}.log)", **_curves(out / run)})
            ended = True
            print(json.dumps({"ended": run, **{k: v for k, v in runs[run].items() if k not in ("train", "eval")},
                              "eval": runs[run].get("eval")}), flush=True)
            if run == "pretrain" and proc.returncode != 0:  # the fine-tunes would wait for the base forever
                for other in FINETUNES:
                    procs[other].terminate()
        if stopped.is_set():  # SIGTERM: the runs still going end here, with their curves so far
            for run, proc in procs.items():
                if run not in runs:
                    proc.kill()
                    proc.wait()
                    runs[run] = {"error": "stopped by SIGTERM", **_curves(out / run)}
            ended = True
        if ended or time.time() - last_write > 10.0:  # running children's curves so far, marked partial
            partial = {r: {"partial": True, **_curves(out / r)} for r in procs if r not in runs}
            _write_json(curves_path, {"meta": meta, "runs": {**partial, **runs}})
            last_write = time.time()
            if ended and args.plot:
                plot(json.loads(curves_path.read_text()), args.plot)
        time.sleep(1.0)
    final = {run: {"eval_first": r["eval"][0] if r.get("eval") else None,
                   "eval_last": r["eval"][-1] if r.get("eval") else None,
                   "eval_min": min((p[1] for p in r.get("eval", [])), default=None),
                   "compile_s": r.get("compile_s"), "run_s": r.get("run_s"), "error": r.get("error")}
             for run, r in runs.items()}
    print(json.dumps({"bench": "finetune_quality", **meta, "runs": final}), flush=True)
    if args.plot:
        print(plot(json.loads(curves_path.read_text()), args.plot))


if __name__ == "__main__":
    main()
