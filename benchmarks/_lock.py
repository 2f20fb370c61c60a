"""``accelerator_lock()``: the file lock that lets benchmarks sharing one accelerator compile in parallel but
time one at a time. The lock file is the path in ``$K3_BENCH_LOCK``; unset, the lock is a no-op. No JAX import,
so a benchmark can take it before it sets ``XLA_FLAGS``."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator


@contextlib.contextmanager
def accelerator_lock() -> Iterator[None]:
    """Hold ``$K3_BENCH_LOCK`` exclusively (``flock``) for the block, if that variable is set."""
    path = os.environ.get("K3_BENCH_LOCK")
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
