"""Multi-process helpers of the training loop: a coordination-service barrier, and compile-then-wait steps.

With several processes, every jitted program that communicates sets up its collectives (gloo on CPU) at its
first execution, and that set-up waits only a fixed time (30 s for gloo) for the other processes. Processes
reach the first execution at different times when one loads the executable from the persistent compilation
cache (only process 0 writes it) while another compiles, or when hosts compile at different speeds. So the
train and eval steps compile ahead of time on first use and all processes meet at a barrier of the
``jax.distributed`` coordination service (no device collective, so no such limit) before running it.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax

BARRIER_TIMEOUT_S = 3600.0
_counter = itertools.count()


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Every process waits here until all have arrived (a no-op with one process). Call in the same order on all."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("barrier: jax.distributed is not initialised but process_count() > 1")
    client.wait_at_barrier(f"k3/{name}/{next(_counter)}", int(timeout_s * 1000))


def _signature(args: tuple) -> tuple:
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))), getattr(x, "sharding", None))
                       for x in leaves)


class CompiledThenSynced:
    """``jitted(*args)``, except that the first call per argument signature lowers and compiles ahead of time
    and then waits at :func:`barrier` for all processes; later calls run the compiled executable directly.
    ``lower`` passes through to the jitted function."""

    def __init__(self, jitted: Any, name: str):
        self._jitted = jitted
        self._name = name
        self._compiled: dict[tuple, Any] = {}

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.lower(*args, **kwargs)

    def __call__(self, *args: Any) -> Any:
        key = _signature(args)
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._jitted.lower(*args).compile()
            barrier(f"compiled/{self._name}")
            self._compiled[key] = fn
        return fn(*args)


def synced_when_multiprocess(jitted: Any, name: str) -> Any:
    """``jitted`` itself with one process; :class:`CompiledThenSynced` with several."""
    return jitted if jax.process_count() == 1 else CompiledThenSynced(jitted, name)
