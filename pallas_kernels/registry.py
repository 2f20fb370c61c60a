"""Kernel registries: one ordered table of named backends per op, and the rule that picks one.

Each op (KDA chunk, KDA decode, expert FFN / grouped matmul, MLA attention) has a :class:`Registry`: an ordered
tuple of :class:`Backend` s, each with a ``supports(call) -> None | reason`` predicate over a small frozen
description of the call (target platform, dtype, head dims, gate bound, ...). Selection:

* ``"auto"``: the first backend in table order whose ``supports`` returns None. The reasons of the backends
  passed over travel with the choice; the choice is logged once per (op, call, choice) on the
  ``pallas_kernels`` logger, at WARNING when a platform with kernels ends up on the XLA reference (a fallback
  is never silent), else at INFO; :func:`selections` lists every choice made in this process (benchmark output).
* a backend name: that backend, or :class:`KernelUnavailable` with its reason.

Backend names say what runs: ``xla`` (the plain-JAX reference, compiled by XLA), ``mosaic_tpu`` (Pallas on
Mosaic TPU), ``triton`` (Pallas on Triton, GPU), ``mosaic_gpu`` (Pallas on Mosaic GPU, sm_90: the MoE grouped
matmul, the KDA chunk forward), ``cudnn`` (cuDNN fused attention). The Triton backends exist only while this JAX
ships the (deprecated) Pallas Triton backend: :data:`TRITON_SHIPPED`, :func:`triton_missing_reason`.

The target platform (``"cpu" | "gpu" | "tpu"``) is where the program will run, never the host that traces it:
:func:`target_platform`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.util
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

logger = logging.getLogger("pallas_kernels")

TRITON_SHIPPED = importlib.util.find_spec("jax.experimental.pallas.triton") is not None
"""Whether this JAX still ships the (deprecated) Pallas Triton backend."""


def triton_missing_reason() -> str | None:
    """None while :data:`TRITON_SHIPPED`, else the reason every ``triton`` backend gives."""
    return None if TRITON_SHIPPED else "this JAX no longer ships the Pallas Triton backend"

PLATFORMS = ("cpu", "gpu", "tpu")
KERNEL_PLATFORMS = ("gpu", "tpu")
"""Platforms that have kernels: landing on the XLA reference there is a fallback and says so."""


def platform_reason(call: Any, platform: str, interpreter: str = "") -> str | None:
    """None when ``call.platform`` is ``platform``, or ``"cpu"`` with ``call.interpret`` (the kernel's interpreter
    runs it on the host), else the reason a backend of ``platform`` gives; ``interpreter`` names that interpreter in
    the reason (e.g. ``"the Mosaic GPU interpreter"``)."""
    if call.platform == platform or (getattr(call, "interpret", False) and call.platform == "cpu"):
        return None
    which = f": {interpreter}" if interpreter else ""
    return f"needs target platform {platform} (or cpu with interpret=True{which}), target is {call.platform}"


def sm90_reason(call: Any, needs: str) -> str | None:
    """None when ``call.compute_capability`` (the target GPU's) is 9.0 or more or the call runs in the Mosaic GPU
    interpreter (``call.interpret``), else why not; ``needs`` names what the backend takes from sm_90."""
    cc = call.compute_capability
    if call.interpret or (cc is not None and cc >= 9.0):
        return None
    return f"needs compute capability >= 9.0 ({needs}), the target GPU's is {cc or 'unknown'}"


class KernelUnavailable(ValueError):
    """An explicitly chosen backend cannot run this call; the message names the op, backend and reason."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of an op: ``supports(call)`` is None when it can run ``call``, else the reason."""

    name: str
    summary: str
    supports: Callable[[Any], str | None]


@dataclasses.dataclass(frozen=True)
class Selection:
    """The backend chosen for one call, and why the backends ahead of it in the table were passed over."""

    op: str
    requested: str
    backend: str
    call: Any
    passed_over: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        why = "; ".join(f"{n}: {r}" for n, r in self.passed_over)
        how = "auto" if self.requested == "auto" else "explicit"
        return f"{self.op}: {self.backend} ({how}{'; passed over ' + why if why else ''})"


_SELECTIONS: dict[tuple[str, str, Any], Selection] = {}


def selections() -> list[Selection]:
    """Every distinct (op, requested, call) selection made in this process, in order (benchmark output)."""
    return list(_SELECTIONS.values())


def clear_selections() -> None:
    """Forget the recorded selections (the next selection of each call is logged again)."""
    _SELECTIONS.clear()


class Registry:
    """Ordered backends of one op (first = preferred), plus accepted aliases of their names."""

    def __init__(self, op: str, backends: tuple[Backend, ...], aliases: Mapping[str, str] | None = None):
        self.op = op
        self.backends = backends
        self.aliases = dict(aliases or {})
        self._by_name = {b.name: b for b in backends}
        bad = {a: t for a, t in self.aliases.items() if t not in self._by_name}
        if bad or len(self._by_name) != len(backends):
            raise ValueError(f"{op}: duplicate backend names or aliases to unknown backends {bad}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.backends)

    @property
    def choices(self) -> tuple[str, ...]:
        """Every accepted value of an implementation argument: ``"auto"``, the names, the aliases."""
        return ("auto", *self.names, *self.aliases)

    def canonical(self, choice: str) -> str:
        """``choice`` with aliases resolved; ValueError naming the accepted values if unknown."""
        if choice == "auto" or choice in self._by_name:
            return choice
        if choice in self.aliases:
            return self.aliases[choice]
        raise ValueError(f"{self.op}: implementation must be one of {self.choices}, got {choice!r}")

    def explain(self, call: Any) -> list[tuple[str, str | None]]:
        """``[(backend, None | reason it cannot run call)]`` in table order."""
        return [(b.name, b.supports(call)) for b in self.backends]

    def select(self, choice: str, call: Any, record: bool = True) -> Selection:
        """The backend for ``call`` (see the module docstring); raises :class:`KernelUnavailable` for an
        explicit choice that cannot run it. ``record=False``: neither logged nor listed in :func:`selections`."""
        sel = self._select(choice, call)
        return self._record(sel) if record else sel

    def _select(self, choice: str, call: Any) -> Selection:
        name = self.canonical(choice)
        if name != "auto":
            reason = self._by_name[name].supports(call)
            if reason is not None:
                raise KernelUnavailable(f"{self.op}: implementation={choice!r} cannot run this call: {reason} "
                                        f"(call: {call}); use 'auto' or one of {self.names}")
            return Selection(self.op, choice, name, call)
        passed: list[tuple[str, str]] = []
        for b in self.backends:
            reason = b.supports(call)
            if reason is None:
                return Selection(self.op, "auto", b.name, call, tuple(passed))
            passed.append((b.name, reason))
        raise KernelUnavailable(f"{self.op}: no backend can run {call}: {dict(passed)}")

    def _record(self, sel: Selection) -> Selection:
        key = (sel.op, sel.requested, sel.call)
        if key not in _SELECTIONS:
            _SELECTIONS[key] = sel
            platform = getattr(sel.call, "platform", None)
            fallback = sel.backend == "xla" and sel.requested == "auto" and platform in KERNEL_PLATFORMS
            logger.log(logging.WARNING if fallback else logging.INFO, "kernel choice %s", sel.describe())
        return sel


def normalize_platform(platform: str) -> str:
    """``"cuda"``/``"rocm"``/``"gpu"`` -> ``"gpu"``; ``"cpu"``, ``"tpu"`` unchanged; anything else raises."""
    p = platform.lower()
    p = "gpu" if p in ("cuda", "rocm", "gpu") else p
    if p not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS} (or cuda/rocm), got {platform!r}")
    return p


_SCOPE: contextvars.ContextVar[str | None] = contextvars.ContextVar("pallas_kernels_platform", default=None)
_CC_SCOPE: contextvars.ContextVar[float | None] = contextvars.ContextVar("pallas_kernels_compute_capability",
                                                                         default=None)


@contextlib.contextmanager
def platform_scope(platform: str | None, compute_capability: float | None = None) -> Iterator[None]:
    """Within the block, :func:`target_platform` without an explicit platform answers ``platform``
    (``None`` / ``"auto"``: no change) and :func:`target_compute_capability` answers ``compute_capability`` for a
    GPU target (``None``: no change). For tracing a program for another platform without a mesh of its devices
    (e.g. a GPU program's residuals on a CPU host, or a compile for a GPU this host does not have). JAX's trace
    caches do not see the scope: enter it inside the traced function (as the MLA layer does for ``cfg.platform``)
    or trace a new function under it. Code whose trace depends on the platform passes it on as a static argument
    (``einsum_f32``)."""
    token = _SCOPE.set(_SCOPE.get() if platform in (None, "auto") else normalize_platform(platform))
    cc_token = _CC_SCOPE.set(_CC_SCOPE.get() if compute_capability is None else float(compute_capability))
    try:
        yield
    finally:
        _CC_SCOPE.reset(cc_token)
        _SCOPE.reset(token)


@functools.cache
def visible_gpu_compute_capability() -> float | None:
    """Compute capability of the first GPU this process sees, None without one."""
    try:
        cc = getattr(jax.devices("gpu")[0], "compute_capability", None)
        return None if cc is None else float(cc)
    except (RuntimeError, TypeError, ValueError):
        return None


def target_compute_capability(platform: str) -> float | None:
    """The compute capability of the GPU the program being traced will run on when ``platform`` (the target
    platform) is ``"gpu"``, else None: that of an enclosing :func:`platform_scope` if it names one (a GPU this
    host does not have), else the first visible GPU's, else None (unknown)."""
    if platform != "gpu":
        return None
    scoped = _CC_SCOPE.get()
    return scoped if scoped is not None else visible_gpu_compute_capability()


def target_platform(explicit: str | None = None) -> str:
    """The platform the program being traced will run on: ``explicit`` when given (not ``"auto"``), else that
    of an enclosing :func:`platform_scope`, else the platform of the active mesh's devices (``jax.set_mesh`` /
    ``sharding.rules.activate``: an AOT mesh over TPU topology devices says ``"tpu"`` on a CPU host), else that
    of the default device (where an unsharded ``jit`` places the computation). Never the host's backend as such."""
    if explicit is not None and explicit != "auto":
        return normalize_platform(explicit)
    if _SCOPE.get() is not None:
        return _SCOPE.get()
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    if device is not None and getattr(device, "platform", None):
        return normalize_platform(device.platform)
    return normalize_platform(jax.devices()[0].platform)
