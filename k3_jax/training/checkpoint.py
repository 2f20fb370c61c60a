"""Checkpoints with orbax ``CheckpointManager``: async saves, keep-N, exact resume, save on SIGTERM.

A checkpoint at step s holds two items:
  * ``state``: the train state pytree (step, f32 params incl. the QB router biases, optimizer state, RNG key
    data) — saved with ``StandardSave``; restored with ``StandardRestore`` against the abstract state of a
    freshly built trainer, so every array comes back with the shardings of the current mesh;
  * ``data``: the grain iterator state (JSON), so the next batch after resume is the one that would have come.
Together they make ``N/2 steps + save + restore + N/2 steps`` reproduce the straight run's losses exactly.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` for the train state + data-iterator state."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, save_every: int = 0,
                 async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mgr.all_steps())

    def should_save(self, step: int) -> bool:
        return self.save_every > 0 and step % self.save_every == 0

    def save(self, step: int, state: Any, data_state: dict | None, *, force: bool = False) -> bool:
        """Start an (async) save of ``state`` + ``data_state`` at ``step``; returns whether one started."""
        if step in self.all_steps():
            return False
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(data_state or {}))
        return self._mgr.save(step, args=args, force=force)

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

    def wait(self) -> None:
        self._mgr.wait_until_finished()

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()


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
