"""Forward-only (inference) Pallas kernels as pure, dead-code-eliminable operations.

JAX never removes a ``pallas_call`` in dead-code elimination: its DCE rule marks every input as used even
when no output is (``jax._src.pallas.pallas_call._pallas_call_dce_rule``; a kernel may alias buffers). Flax's
``nn.scan`` (``k3_jax.model`` scans the layer segments) checks that the scan's broadcast values do not depend
on the scan body by tracing the body and DCE-ing it down to those values; a bare ``pallas_call`` fed by the
carry survives that DCE, so the check fails with
``ValueError: broadcasted variable has a data dependency on the scan body`` (e.g. the GPU KDA decode step in
``serving.Engine``). Kernels that already sit inside a ``jax.custom_vjp`` (the chunked KDA
forward, the bf16 grouped matmul) were unaffected, because ``custom_vjp_call`` is dropped when its outputs are
unused and it has no effects.

:func:`forward_only` gives the forward-only kernels (KDA decode step, MXFP4 grouped matmuls) the same wrapper:
they compute the same values, are removed when unused, and differentiating them raises a clear error instead
of JAX's generic "pallas_call has no JVP rule".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def forward_only(call: Callable[..., Any], *args: Any, name: str) -> Any:
    """``call(*args)`` as a pure operation that JAX's DCE can remove; not differentiable.

    Args:
      call: the kernel, e.g. ``pl.pallas_call(kernel, ...)``; bind any static (non-array) arguments first.
      *args: its array arguments (any dtype; integer index arrays are fine).
      name: the kernel's name for the error raised when something differentiates through it.
    Returns:
      whatever ``call(*args)`` returns (arrays or a list/tuple of arrays).
    """
    fn = jax.custom_vjp(lambda *a: call(*a))

    def fwd(*a: Any) -> Any:
        raise NotImplementedError(
            f"{name} is a forward-only (inference) kernel and cannot be differentiated; use "
            f"implementation='reference' for gradients"
        )

    def bwd(res: Any, ct: Any) -> Any:  # pragma: no cover - fwd never returns
        raise AssertionError(name)

    fn.defvjp(fwd, bwd)
    return fn(*args)
