"""Device mesh with the five named k3-jax axes, and multi-process initialisation.

Axes, outermost (slowest interconnect) to innermost (fastest):

* ``data``     — pure data parallelism; the only axis that spans TPU slices (DCN) in a multi-slice job.
* ``fsdp``     — data parallelism with parameters / optimizer state sharded (ZeRO-3).
* ``expert``   — expert parallelism for the routed experts (tokens are also split over it).
* ``sequence`` — sequence (context) parallelism for long inputs (KDA state-map scan, MLA latent gather).
* ``tensor``   — tensor parallelism (heads, MLP width, vocabulary); innermost, so it rides the fastest links.

``make_mesh({"fsdp": -1, "tensor": 4})`` builds a :class:`jax.sharding.Mesh` with all five axes (absent ones get
size 1, one ``-1`` absorbs the remaining devices). Axis types are ``Auto`` so GSPMD propagation and
``flax.linen`` logical constraints work unchanged.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES: tuple[str, ...] = ("data", "fsdp", "expert", "sequence", "tensor")

log = logging.getLogger(__name__)


class MeshError(ValueError):
    """A mesh specification cannot be realised on the available devices."""


def parse_axes(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """``"expert=64,tensor=4"`` or a mapping → ``{axis: size}`` over all five axes (missing axes: 1).

    An empty spec means ``{"fsdp": -1}`` (everything on FSDP).
    """
    if spec is None or spec == "" or spec == {}:
        raw: dict[str, Any] = {"fsdp": -1}
    elif isinstance(spec, str):
        raw = {}
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise MeshError(f"mesh spec {spec!r}: item {part!r} is not of the form axis=size")
            k, v = part.split("=", 1)
            try:
                raw[k.strip()] = int(v)
            except ValueError:
                raise MeshError(f"mesh spec {spec!r}: size of axis {k.strip()!r} is {v!r}, not an int") from None
    else:
        raw = dict(spec)
    unknown = sorted(set(raw) - set(AXES))
    if unknown:
        raise MeshError(f"unknown mesh axes {unknown}; valid axes are {list(AXES)}")
    out = {a: int(raw.get(a, 1)) for a in AXES}
    bad = {a: s for a, s in out.items() if s == 0 or s < -1}
    if bad:
        raise MeshError(f"mesh axis sizes must be positive or -1, got {bad}")
    if sum(s == -1 for s in out.values()) > 1:
        raise MeshError(f"at most one mesh axis may be -1, got {[a for a, s in out.items() if s == -1]}")
    return out


def resolve_axes(spec: str | Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """Sizes of all five axes for ``num_devices`` devices (the ``-1`` axis absorbs the rest)."""
    sizes = parse_axes(spec)
    fixed = math.prod(s for s in sizes.values() if s != -1)
    free = [a for a, s in sizes.items() if s == -1]
    if free:
        if num_devices % fixed:
            raise MeshError(f"mesh {sizes}: the fixed axes use {fixed} devices, which does not divide the "
                            f"{num_devices} available devices, so axis {free[0]!r}=-1 cannot absorb the rest")
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise MeshError(f"mesh {sizes} needs {fixed} devices but {num_devices} are available; "
                        "set one axis to -1 to absorb the rest")
    return sizes


def _num_slices(devices: Sequence[Any]) -> int:
    ids = {getattr(d, "slice_index", 0) for d in devices}
    return len(ids)


def _device_array(sizes: dict[str, int], devices: Sequence[Any]) -> np.ndarray:
    shape = [sizes[a] for a in AXES]
    platform = devices[0].platform
    n_slices = _num_slices(devices)
    if n_slices > 1:
        # Multi-slice: the ``data`` axis spans slices over DCN; every other axis stays inside a slice (ICI).
        if sizes["data"] % n_slices:
            raise MeshError(f"{n_slices} slices: mesh axis 'data'={sizes['data']} must be a multiple of the "
                            "slice count (only 'data' crosses slices)")
        from jax.experimental import mesh_utils

        ici = [sizes["data"] // n_slices] + shape[1:]
        dcn = [n_slices] + [1] * (len(AXES) - 1)
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices)
    if platform in ("tpu", "gpu", "cuda", "rocm"):
        from jax.experimental import mesh_utils

        try:
            return mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
        except (AssertionError, NotImplementedError, ValueError) as e:  # odd topologies: plain order
            log.warning("mesh_utils.create_device_mesh(%s) failed (%s); using device order", shape, e)
    return np.asarray(devices, dtype=object).reshape(shape)


def make_mesh(axes: str | Mapping[str, int] | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """A :class:`Mesh` with axes :data:`AXES` (all five, size-1 where not given).

    Args:
      axes: ``{"data": 1, "fsdp": -1, "expert": 1, "tensor": 1, "sequence": 1}``-like mapping or the CLI
        form ``"expert=64,tensor=4"``; at most one size may be ``-1`` (absorbs the remaining devices).
      devices: devices to use (default: all of ``jax.devices()``).
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise MeshError("make_mesh: no devices")
    sizes = resolve_axes(axes, len(devices))
    arr = _device_array(sizes, devices)
    return Mesh(arr, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """``{axis: size}`` of a mesh (works for abstract meshes too)."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes if hasattr(mesh, "axis_sizes") else mesh.devices.shape,
                    strict=True))


_initialized = False


def _looks_multiprocess() -> bool:
    if os.environ.get("TPU_WORKER_HOSTNAMES"):
        return len(os.environ["TPU_WORKER_HOSTNAMES"].split(",")) > 1
    if os.environ.get("SLURM_NTASKS"):
        return int(os.environ["SLURM_NTASKS"]) > 1
    if os.environ.get("OMPI_COMM_WORLD_SIZE"):
        return int(os.environ["OMPI_COMM_WORLD_SIZE"]) > 1
    if os.environ.get("JAX_NUM_PROCESSES"):
        return int(os.environ["JAX_NUM_PROCESSES"]) > 1
    return any(os.environ.get(k) for k in ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS",
                                           "MEGASCALE_COORDINATOR_ADDRESS"))


def initialize_distributed(force: bool = False, **kwargs: Any) -> bool:
    """Start ``jax.distributed`` on multi-process TPU pods / multi-GPU hosts; a no-op on one process.

    Call before anything touches devices. Detection uses the usual launcher variables (TPU pod / multi-slice
    metadata, SLURM, Open MPI, ``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID``);
    ``kwargs`` go to :func:`jax.distributed.initialize` (``coordinator_address``, ``num_processes``,
    ``process_id`` …) and ``force=True`` initialises even when nothing suggests several processes.

    Returns True when ``jax.distributed`` was initialised by this call (or an earlier one).
    """
    global _initialized
    if _initialized:
        return True
    if not (force or kwargs or _looks_multiprocess()):
        return False
    env_kwargs: dict[str, Any] = {}
    if os.environ.get("JAX_COORDINATOR_ADDRESS") and "coordinator_address" not in kwargs:
        env_kwargs["coordinator_address"] = os.environ["JAX_COORDINATOR_ADDRESS"]
    if os.environ.get("JAX_NUM_PROCESSES") and "num_processes" not in kwargs:
        env_kwargs["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
    if os.environ.get("JAX_PROCESS_ID") and "process_id" not in kwargs:
        env_kwargs["process_id"] = int(os.environ["JAX_PROCESS_ID"])
    jax.distributed.initialize(**{**env_kwargs, **kwargs})
    _initialized = True
    log.info("jax.distributed initialised: process %d of %d, %d global devices",
             jax.process_index(), jax.process_count(), jax.device_count())
    return True
