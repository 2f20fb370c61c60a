"""Output directories of the converter: checked before any heavy work, written under a temporary sibling,
published by renames only, and the leftovers of killed runs cleaned up by the next run.

A run writing ``OUT`` owns two sibling names:

* ``OUT.partial-<pid>``: the directory being written (never complete-looking: it is renamed to ``OUT`` only
  after verification); its ``.k3-convert-owner.json`` names the host and pid of the writer;
* ``OUT.old-<pid>``: during :func:`publish_dir` over an existing ``OUT``, the previous ``OUT``, for the two
  renames it takes.

:func:`sweep_stale` (called by :func:`check_output`, so by every writer before it starts) looks at these names
next to ``OUT``: a leftover whose writer is dead (same host, pid not running) is removed -- an ``.old-`` one is
renamed back to ``OUT`` instead when ``OUT`` is missing (it is the last complete output); a leftover of a live
process, or written on another host (its pid cannot be checked from here), is left alone and named in a
warning. Every action is logged on ``k3_jax.convert``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket

log = logging.getLogger("k3_jax.convert")

OWNER_FILE = ".k3-convert-owner.json"


class OutputError(OSError):
    """The output path cannot be written; the message names the path and the reason."""


def partial_path(out_dir: str) -> str:
    return f"{out_dir}.partial-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _owner(path: str, pid_from_name: int) -> tuple[str, int]:
    """(host, pid) of the writer of a leftover: its owner file, else this host and the pid in its name."""
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            rec = json.load(f)
        return str(rec["host"]), int(rec["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return socket.gethostname(), pid_from_name


def sweep_stale(out_dir: str) -> list[str]:
    """Deal with ``OUT.partial-*`` / ``OUT.old-*`` leftovers of dead runs (see the module docstring).

    Returns one message per leftover found (also logged): what was done with it and why.
    """
    out_dir = os.path.abspath(out_dir)
    parent, base = os.path.split(out_dir)
    pat = re.compile(re.escape(base) + r"\.(partial|old)-(\d+)$")
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    host = socket.gethostname()
    msgs = []
    for name in names:
        m = pat.match(name)
        if m is None:
            continue
        path = os.path.join(parent, name)
        kind, pid_name = m.group(1), int(m.group(2))
        owner_host, pid = _owner(path, pid_name)
        if owner_host != host:
            msg = (f"left alone: {path} was written by pid {pid} on host {owner_host!r}, which cannot be checked "
                   "from here; remove it by hand once that run is gone")
            log.warning(msg)
        elif pid != os.getpid() and _pid_alive(pid):
            msg = f"left alone: {path} belongs to a running process (pid {pid}), maybe another conversion"
            log.warning(msg)
        elif kind == "old" and not os.path.exists(out_dir):
            os.rename(path, out_dir)
            msg = (f"restored {out_dir} from {path}: a run (pid {pid}) was killed while replacing it; "
                   "this is the last complete output")
            log.warning(msg)
        else:
            what = "an incomplete output" if kind == "partial" else "a replaced output"
            shutil.rmtree(path, ignore_errors=True)
            msg = f"removed stale {path}: {what} of a run (pid {pid}) that is no longer running"
            log.warning(msg)
        msgs.append(msg)
    return msgs


def check_output(out_dir: str | os.PathLike[str], overwrite: bool = False) -> str:
    """Check that ``out_dir`` can be written (cheap: before any input is read) and sweep stale leftovers.

    Raises ``FileExistsError`` when it exists (and not ``overwrite``), :class:`OutputError` when it or an
    ancestor is a regular file or its temporary sibling cannot be created (permissions, read-only file
    system ...). Missing parent directories are created. Returns the absolute ``out_dir``.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise OutputError(f"output {out_dir} exists and is not a directory")
        if not overwrite:
            raise FileExistsError(f"output {out_dir} exists (pass --overwrite / overwrite=True to replace it)")
    anc = os.path.dirname(out_dir)
    while not os.path.exists(anc):
        anc = os.path.dirname(anc)
    if not os.path.isdir(anc):
        raise OutputError(f"cannot create output {out_dir}: {anc} is a file, not a directory")
    sweep_stale(out_dir)
    tmp = partial_path(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        os.rmdir(tmp)
    except OSError as e:
        raise OutputError(f"cannot create output {out_dir}: creating {tmp} failed: {e.strerror or e}") from None
    return out_dir


def claim(out_dir: str | os.PathLike[str], overwrite: bool = False) -> tuple[str, str]:
    """:func:`check_output`, then create and own the temporary directory: returns ``(out_dir, tmp)``."""
    out_dir = check_output(out_dir, overwrite)
    tmp = partial_path(out_dir)
    os.makedirs(tmp)
    with open(os.path.join(tmp, OWNER_FILE), "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid()}, f)
    return out_dir, tmp


def publish_dir(tmp: str, out_dir: str) -> None:
    """Move the completed, verified directory ``tmp`` to ``out_dir`` (replacing an old one) by renames only, so
    a reader never sees a half-written ``out_dir``."""
    try:
        os.remove(os.path.join(tmp, OWNER_FILE))
    except FileNotFoundError:
        pass
    if os.path.exists(out_dir):
        old = f"{out_dir}.old-{os.getpid()}"
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out_dir)
