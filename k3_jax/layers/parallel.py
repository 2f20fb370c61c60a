"""How layers see the active device mesh: axis sizes and sharding-aware activation constraints.

The model never names mesh axes itself except through these helpers, which read the mesh and logical-axis rules
activated by :func:`sharding.rules.activate` (``jax.set_mesh`` + flax rules). Without an active mesh every helper
is a no-op and the layers run their single-device code.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from sharding.rules import with_logical_constraint


def axis_size(name: str) -> int:
    """Size of mesh axis ``name`` in the active (abstract) mesh; 1 when there is no mesh or no such axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)).get(name, 1)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint from logical ``names`` under the active rules (axes that don't divide are dropped)."""
    return with_logical_constraint(x, names)
