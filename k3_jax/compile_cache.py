"""Persistent XLA compilation cache for the command-line entry points (``train.py``, ``serve.py``).

A second run with the same config, shapes and flags loads the compiled executables from the cache instead of
compiling them again. The directory is ``$K3_COMPILATION_CACHE`` if set, else
``$JAX_COMPILATION_CACHE_DIR`` if set (JAX's own variable), else ``~/.cache/k3_jax/xla``; set
``K3_COMPILATION_CACHE=off`` to disable it. Library code never turns it on by itself.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_DIR = Path.home() / ".cache" / "k3_jax" / "xla"


def cache_dir() -> Path | None:
    """The directory the entry points use, or ``None`` when disabled by ``K3_COMPILATION_CACHE=off``."""
    value = os.environ.get("K3_COMPILATION_CACHE") or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if value and value.lower() in ("off", "0", "none", "false"):
        return None
    return Path(value).expanduser() if value else DEFAULT_DIR


def enable(min_compile_seconds: float = 2.0) -> Path | None:
    """Point JAX's persistent cache at :func:`cache_dir` (executables that took ≥ ``min_compile_seconds``).

    Returns the directory, or ``None`` if disabled or the directory cannot be created (then nothing changes).
    """
    import jax

    path = cache_dir()
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
