"""Checkpoints with orbax ``CheckpointManager``: async saves, keep-N, exact resume, save on SIGTERM.

A checkpoint at step s holds these items:
  * ``state``: the train state pytree (step, f32 params incl. the QB router biases, optimizer state, RNG key
    data) — saved with ``StandardSave``; restored with ``StandardRestore`` against the abstract state of a
    freshly built trainer, so every array comes back with the shardings of the current mesh;
  * ``data``: the grain iterator state (JSON), so the next batch after resume is the one that would have come;
  * ``run`` (when :attr:`Checkpointer.run_config` is set): the run's config (model config + the training
    options exact resume depends on, JSON; see ``k3_jax/training/resume.py``), committed with the rest.
Together they make ``N/2 steps + save + restore + N/2 steps`` reproduce the straight run's losses exactly.

orbax writes a step into a temporary directory and renames it when every item is complete, so a step
directory that exists was committed; temporary directories of killed saves are removed when a Checkpointer
opens the directory. A save never skips silently: :meth:`Checkpointer.save` raises if the step is already on
disk or orbax declines it, and :meth:`Checkpointer.confirm_written` checks a finished save on disk.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read as asked; the message names the step and the directory."""


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` for the train state + data-iterator state (+ run config)."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, save_every: int = 0,
                 async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.save_every = save_every
        self.run_config: dict | None = None  # saved as the "run" item of every checkpoint when set
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True, cleanup_tmp_directories=True)
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "run"))

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mgr.all_steps())

    def should_save(self, step: int) -> bool:
        return self.save_every > 0 and step % self.save_every == 0

    def save(self, step: int, state: Any, data_state: dict | None, *, force: bool = False) -> bool:
        """Start an (async) save of ``state`` + ``data_state`` at ``step``; returns True (it started).

        Raises :class:`CheckpointError` if ``step`` is already on disk or orbax declines to save it: a save
        that does not happen is never reported as done.
        """
        if step in self.all_steps():
            raise CheckpointError(f"checkpoint step {step} already exists in {self.directory}; refusing to "
                                  "overwrite it or to count it as this run's save")
        items = {"state": ocp.args.StandardSave(state), "data": ocp.args.JsonSave(data_state or {})}
        if self.run_config is not None:
            items["run"] = ocp.args.JsonSave(self.run_config)
        if not self._mgr.save(step, args=ocp.args.Composite(**items), force=force):
            raise CheckpointError(f"orbax did not save step {step} in {self.directory} (steps on disk: "
                                  f"{self.all_steps()})")
        return True

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, int]:
        """``(state, data_state, step)`` of ``step`` (default: latest) restored into ``abstract_state``'s
        structure and shardings (a tree of arrays or ``jax.ShapeDtypeStruct`` with ``sharding``)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = jax.tree.map(_abstract, abstract_state)
        out = self._mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                              data=ocp.args.JsonRestore()))
        return out["state"], dict(out["data"] or {}), step

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def reload(self) -> None:
        """Re-read the steps on disk (after step directories were moved by someone else)."""
        self._mgr.reload()

    def saved_run_config(self, step: int) -> dict | None:
        """The ``run`` item of ``step`` (None for a checkpoint written without one); raises
        :class:`CheckpointError` naming the file when it cannot be read."""
        path = self.step_dir(step) / "run" / "metadata"
        if not (self.step_dir(step) / "run").exists():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint step {step}: cannot read {path}: {e}") from None

    def state_shapes(self, step: int) -> dict[str, tuple[int, ...]]:
        """``{"params/model/...": shape}`` of the ``state`` item of ``step``, from its metadata (no array read);
        raises :class:`CheckpointError` naming the step directory when the metadata cannot be read."""
        try:
            meta = ocp.StandardCheckpointHandler().metadata(self._mgr.directory / str(step) / "state")
            flat = jax.tree_util.tree_flatten_with_path(getattr(meta, "tree", meta))[0]
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for a damaged directory
            raise CheckpointError(f"checkpoint step {step}: cannot read the state metadata in "
                                  f"{self.step_dir(step)}: {type(e).__name__}: {e}") from None
        if not flat:
            raise CheckpointError(f"checkpoint step {step}: no state item in {self.step_dir(step)}")
        return {tree_path(p): tuple(leaf.shape) for p, leaf in flat}

    def confirm_written(self, step: int) -> None:
        """Raise :class:`CheckpointError` unless ``step`` is committed on disk (call after :meth:`wait`)."""
        d = self.step_dir(step)
        if not ((d / "state").is_dir() and (d / "data").is_dir() and (d / "_CHECKPOINT_METADATA").is_file()):
            raise CheckpointError(f"checkpoint step {step} was saved but {d} is missing or incomplete")

    def wait(self) -> None:
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()


def tree_path(path: tuple) -> str:
    """A pytree key path as ``"params/model/embed/embedding"``."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


class PreemptionFlag:
    """Set when SIGTERM (or SIGINT if ``catch_int``) arrives; the loop saves and exits at the next step end."""

    def __init__(self, catch_int: bool = False):
        self.triggered = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        sigs = [signal.SIGTERM] + ([signal.SIGINT] if catch_int else [])
        for s in sigs:
            try:
                self._previous[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread
                pass

    def _handle(self, signum, frame) -> None:
        self.triggered, self.signum = True, signum

    def restore_handlers(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
