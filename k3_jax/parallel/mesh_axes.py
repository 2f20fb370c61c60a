"""Mesh helpers shared by the multi-device layer forms: axis sizes, the mesh in use, mesh axes for a dimension."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh


def axis_sizes(mesh: Any) -> dict[str, int]:
    """``{axis name: size}`` of a :class:`~jax.sharding.Mesh` or :class:`~jax.sharding.AbstractMesh`."""
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def mesh_or_active(mesh: Mesh | None, who: str) -> Any:
    """``mesh`` if given, else the active (abstract) mesh; raises naming ``who`` when neither exists."""
    if mesh is not None:
        return mesh
    active = jax.sharding.get_abstract_mesh()
    if active.empty:
        raise ValueError(f"{who}: no mesh given and none active (jax.set_mesh / sharding.rules.activate)")
    return active


def split_axes(axes: Sequence[str] | str | None, sizes: dict[str, int], dim: int | None = None) -> Any:
    """The mesh axes of size > 1 among ``axes`` (trailing ones dropped until their product divides ``dim``), as
    one ``PartitionSpec`` entry: ``None``, an axis name, or a tuple of names."""
    if axes is None:
        return None
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    axes = tuple(a for a in axes if sizes.get(a, 1) > 1)
    if dim is not None:
        while axes and dim % math.prod(sizes[a] for a in axes):
            axes = axes[:-1]
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes
