"""Walk a jaxpr and every sub-jaxpr (pjit, scan, custom_vjp, checkpoint bodies) for tests that inspect traces."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.extend.core


def iter_eqns(fn, *args) -> Iterator[jax.extend.core.JaxprEqn]:
    """Every equation of ``jax.make_jaxpr(fn)(*args)``, nested ones included, in program order."""

    def walk(jaxpr):
        for e in jaxpr.eqns:
            yield e
            for v in e.params.values():
                for sub in v if isinstance(v, list | tuple) else [v]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        yield from walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        yield from walk(sub)

    yield from walk(jax.make_jaxpr(fn)(*args).jaxpr)
