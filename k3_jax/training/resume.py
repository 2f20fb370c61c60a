"""Which checkpoint a run continues from, checked: the stored run config, damaged checkpoints, foreign runs.

* :func:`run_config` is the run's config stored in every checkpoint's ``run`` item: every
  :class:`~k3_jax.config.K3Config` field and the ``TrainConfig`` options the exact loss trajectory depends on
  (:data:`EXACT_RESUME_FIELDS`; the mesh and sharding preset are not among them: a checkpoint restores onto
  any mesh).
* :func:`resume` restores the latest checkpoint (or the asked-for step) into a fresh train state. Before it
  reads any array it checks the checkpoint's parameter shapes against the model (a mismatch names the
  parameter path and both shapes; always refused) and its run config against this run's (a change is refused,
  naming each field with its old and new value, unless ``allow_config_change``). A checkpoint whose metadata
  or arrays cannot be read is damaged: it is reported (step and directory) and the previous one is tried.
  Once a step is restored, every later step on disk (damaged ones, or those after an asked-for step) is moved
  aside, so the saves of the continued run never meet steps of another trajectory.
* :func:`start_new_run` (``resume=False``) refuses a checkpoint directory that already holds steps, naming
  them, or with ``start_over`` moves them (and ``metrics.jsonl``, ``tb/``) aside first.

Things are moved, never deleted, to ``<workdir>/set-aside/<UTC time>-<reason>/``; every message says where.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from k3_jax.config import K3Config
from k3_jax.training.checkpoint import Checkpointer, CheckpointError, tree_path

# TrainConfig fields that change the loss trajectory of the steps after a resume
EXACT_RESUME_FIELDS = ("steps", "seq_len", "batch_size", "accum", "seed", "data", "optimizer", "lr",
                       "min_lr_ratio", "warmup_frac", "weight_decay", "clip_norm", "weight_clip", "muon_dtype",
                       "loss_chunk", "qb", "qb_method")
RUN_CONFIG_FORMAT = 1
_SHOWN = 8  # mismatching parameter shapes named in one message


class ResumeError(RuntimeError):
    """A run cannot start or continue as asked; the message says why and how to proceed."""


def run_config(tc: Any, cfg: K3Config, *, muon_dtype: str) -> dict:
    """``{"format", "model": {K3Config fields}, "train": {EXACT_RESUME_FIELDS}}`` as JSON values
    (``muon_dtype`` is the resolved one, so "auto" on another backend is a change)."""
    train = {name: getattr(tc, name) for name in EXACT_RESUME_FIELDS}
    train["muon_dtype"] = muon_dtype
    return _json({"format": RUN_CONFIG_FORMAT, "model": dataclasses.asdict(cfg), "train": train})


def _json(x: Any) -> Any:
    return json.loads(json.dumps(x))


def config_changes(saved: dict, current: dict) -> list[str]:
    """``"section.field: old -> new"`` for every field whose value differs between two :func:`run_config`s."""
    changes = []
    for section in ("model", "train"):
        old, new = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(old) | set(new)):
            if old.get(key, "(absent)") != new.get(key, "(absent)"):
                changes.append(f"{section}.{key}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}")
    return changes


def shape_mismatches(saved: dict[str, tuple[int, ...]], state: Any) -> list[str]:
    """Differences between a checkpoint's ``{path: shape}`` and the tree ``state`` (parameters listed first)."""
    current = {tree_path(p): tuple(leaf.shape) for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
    out = []
    for path in sorted(set(saved) | set(current), key=lambda p: (not p.startswith("params"), p)):
        if path not in saved:
            out.append(f"{path}: not in the checkpoint (model {current[path]})")
        elif path not in current:
            out.append(f"{path}: in the checkpoint {saved[path]}, not in the model")
        elif saved[path] != current[path]:
            out.append(f"{path}: checkpoint {saved[path]}, model {current[path]}")
    return out


def set_aside(workdir: Path, paths: list[Path], reason: str) -> Path:
    """Move ``paths`` (those that exist) into ``<workdir>/set-aside/<UTC time>-<reason>/``; returns that folder.

    Only process 0 moves; every process waits for it.
    """
    dest = workdir / "set-aside" / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{reason}"
    if jax.process_index() == 0:
        n = 1
        while dest.exists():
            n += 1
            dest = dest.with_name(f"{dest.name.split('~')[0]}~{n}")
        dest.mkdir(parents=True)
        for p in paths:
            if p.exists():
                shutil.move(str(p), str(dest / p.name))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"k3_set_aside_{reason}")
    return dest


def start_new_run(ckpt: Checkpointer, *, start_over: bool, say: Callable[[str], None] = print) -> list[str]:
    """For a run that must not resume: refuse if ``ckpt`` already holds steps, or (``start_over``) move them,
    ``metrics.jsonl`` and ``tb/`` aside. Returns the notes said."""
    steps = sorted(ckpt.all_steps())
    if not steps:
        return []
    workdir = ckpt.directory.parent
    if not start_over:
        raise ResumeError(
            f"--no-resume: {ckpt.directory} already holds checkpoints of steps {steps}; a new run there would "
            "mix with them. Use another --workdir, resume that run (drop --no-resume), or pass --start-over to "
            f"move its checkpoints and metrics aside (to {workdir / 'set-aside'}/) and start from step 0.")
    dest = set_aside(workdir, [ckpt.step_dir(s) for s in steps] + [workdir / "metrics.jsonl", workdir / "tb"],
                     "start-over")
    ckpt.reload()
    note = f"--start-over: moved checkpoints of steps {steps} and the metrics of the previous run to {dest}"
    say(note)
    return [note]


def resume(ckpt: Checkpointer, state: Any, current: dict, *, step: int | None = None,
           allow_config_change: bool = False, say: Callable[[str], None] = print) -> tuple[Any, dict, int, list[str]]:
    """Restore ``step`` (default: the latest good checkpoint) into ``state``'s structure and shardings.

    Returns ``(state, data_state, step, notes)``; ``notes`` are the messages said (damaged checkpoints
    skipped, steps moved aside, an allowed config change). Raises :class:`ResumeError` for a parameter-shape
    mismatch, a refused config change, an asked-for step that is absent or damaged, or when no checkpoint
    can be read.
    """
    steps = sorted(ckpt.all_steps(), reverse=True)
    if step is not None and step not in steps:
        raise ResumeError(f"--resume-step {step}: no checkpoint of that step in {ckpt.directory} "
                          f"(steps there: {sorted(steps)})")
    notes: list[str] = []

    def note(text: str) -> None:
        notes.append(text)
        say(text)

    damaged: list[str] = []
    for s in [step] if step is not None else steps:
        try:
            shapes = ckpt.state_shapes(s)
            saved = ckpt.saved_run_config(s)
        except CheckpointError as e:
            damaged.append(str(e))
            if step is not None:
                raise ResumeError(f"--resume-step {step}: the checkpoint is damaged: {e}") from None
            note(f"checkpoint step {s} in {ckpt.step_dir(s)} is damaged ({e}); trying the previous checkpoint")
            continue
        _check_compatible(s, ckpt, shapes, saved, state, current, allow_config_change, note)
        try:
            restored, data_state, _ = ckpt.restore(state, s)
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for truncated files
            damaged.append(f"checkpoint step {s}: {type(e).__name__}: {e}")
            if step is not None:
                raise ResumeError(f"--resume-step {step}: the checkpoint in {ckpt.step_dir(s)} cannot be read: "
                                  f"{type(e).__name__}: {e}") from None
            note(f"checkpoint step {s} in {ckpt.step_dir(s)} is damaged (restoring it raised "
                 f"{type(e).__name__}: {str(e)[:300]}); trying the previous checkpoint")
            continue
        later = sorted(t for t in steps if t > s)
        if later:
            dest = set_aside(ckpt.directory.parent, [ckpt.step_dir(t) for t in later], f"after-step-{s}")
            ckpt.reload()
            note(f"resuming from step {s}: moved the later checkpoints {later} to {dest}")
        return restored, data_state, s, notes
    raise ResumeError(f"no checkpoint in {ckpt.directory} can be restored:\n  " + "\n  ".join(damaged)
                      + "\nUse another --workdir, or --start-over to move them aside and train from step 0.")


def _check_compatible(step: int, ckpt: Checkpointer, shapes: dict, saved: dict | None, state: Any, current: dict,
                      allow_config_change: bool, note: Callable[[str], None]) -> None:
    changes = config_changes(saved, current) if saved is not None else []
    mismatched = shape_mismatches(shapes, state)
    if mismatched:
        more = f"\n  ... and {len(mismatched) - _SHOWN} more" if len(mismatched) > _SHOWN else ""
        hint = ("\nchanged config fields: " + "; ".join(changes)) if changes else ""
        raise ResumeError(f"checkpoint step {step} in {ckpt.directory} does not fit this model "
                          f"({len(mismatched)} arrays differ):\n  " + "\n  ".join(mismatched[:_SHOWN]) + more
                          + hint + "\nUse the checkpoint's model config, or another --workdir.")
    if saved is None:
        note(f"checkpoint step {step} stores no run config (written by an older k3-jax): its config is not checked")
        return
    if not changes:
        return
    listed = "\n  ".join(changes)
    if not allow_config_change:
        raise ResumeError(f"this run's config differs from the one checkpoint step {step} in {ckpt.directory} was "
                          f"trained with, so it would not continue that run exactly:\n  {listed}\n"
                          "Pass --allow-config-change to resume anyway, use the old values, or use another "
                          "--workdir.")
    note(f"--allow-config-change: resuming step {step} with a changed config:\n  {listed}")
