"""Multi-process helpers of the training loop: a coordination-service barrier, and compile-then-wait steps.

With several processes, every jitted program that communicates sets up its collectives (gloo on CPU) at its
first execution, and that set-up waits only a fixed time (30 s for gloo) for the other processes. Processes
reach the first execution at different times when one loads the executable from the persistent compilation
cache (only process 0 writes it) while another compiles, or when hosts compile at different speeds. So the
train and eval steps compile ahead of time on first use and all processes meet at a barrier of the
``jax.distributed`` coordination service (no device collective, so no such limit) before running it, and the
small exchanges of the loop (preemption flags, data-iterator states) and the placement of replicated values go
through the coordination service's key-value store or need no exchange at all, instead of compiled collectives.
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
    _client().wait_at_barrier(f"k3/{name}/{next(_counter)}", int(timeout_s * 1000))


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialised but process_count() > 1")
    return client


def allgather_text(name: str, text: str, timeout_s: float = BARRIER_TIMEOUT_S) -> list[str]:
    """Every process's ``text``, in process order, on every process (coordination-service key-value store).

    Call in the same order on all processes. Each call's keys are deleted by their writer one call later (when
    everyone has read them), so a long run leaves at most two calls' keys per process in the store.
    """
    if jax.process_count() == 1:
        return [text]
    client, me, n = _client(), jax.process_index(), next(_counter)
    client.key_value_set(f"k3/{name}/{n}/{me}", text)
    out = [client.blocking_key_value_get(f"k3/{name}/{n}/{p}", int(timeout_s * 1000))
           for p in range(jax.process_count())]
    previous = _written.pop(name, None)
    if previous is not None:
        client.key_value_delete(previous)
    _written[name] = f"k3/{name}/{n}/{me}"
    return out


_written: dict[str, str] = {}


def replicated(x: Any, sharding: Any) -> Any:
    """``x`` (the same host value on every process) as a global array on ``sharding``, without the
    cross-process equality check (a device collective) that ``jax.device_put`` makes in that case."""
    import numpy as np

    if getattr(x, "is_fully_addressable", True) is False:
        return jax.device_put(x, sharding)
    host = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


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
