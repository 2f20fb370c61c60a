"""Run single-device kernels on a device mesh: one call per shard inside ``jax.shard_map``.

XLA cannot partition a Pallas call (Mosaic on TPU refuses: "Mosaic kernels cannot be automatically partitioned";
Triton on GPU is an opaque custom call too), so a kernel inside a jitted, GSPMD-sharded model needs its operands
split explicitly. :func:`per_shard` does that from logical axis names under the active rules
(:func:`sharding.rules.activate`): each argument is laid out by its names, ``fn`` runs on the local blocks, and the
results come back with the layouts their names give. The kernels' work must be independent along the split axes
(batch rows, heads) — true of KDA (per sequence and head) and of the routed-expert FFN on a shard's own tokens.

Without an active mesh of more than one device this is a plain ``fn(*args)``, so the single-device path is
unchanged. Arguments named ``None`` (and ``None`` values) are passed whole (replicated: XLA gathers FSDP shards at
the boundary, as it would for the unsharded op).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from sharding.rules import logical_to_pspec

Names = Sequence[str | None] | None


def active_mesh_size() -> int:
    """Number of devices of the mesh active in the current trace (1 when none)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else mesh.size


def per_shard(fn: Callable[..., Any], args: Sequence[Any], in_names: Sequence[Names],
              out_names: Sequence[Names]) -> Any:
    """``fn(*args)``, split over the active mesh by logical axis names.

    Args:
      fn: the per-shard computation (e.g. a Pallas kernel call); returns a tuple when ``len(out_names) > 1``.
      args: its positional arguments (arrays, pytrees or None).
      in_names: per argument, the logical name of each array dimension (``None`` entries: that dimension whole),
        or ``None`` for the whole argument (any pytree) replicated.
      out_names: the same for each output (one entry when ``fn`` returns a single array).
    Returns:
      ``fn``'s result, as if it had run on the whole arrays.
    """
    if active_mesh_size() == 1:
        return fn(*args)
    mesh = jax.sharding.get_abstract_mesh()
    rules = tuple(nn.get_logical_axis_rules())

    def spec(names: Names, x: Any) -> P:
        if names is None or x is None or not rules:
            return P()
        if len(names) != x.ndim:
            raise ValueError(f"per_shard: names {tuple(names)} do not match an array of shape {x.shape}")
        return logical_to_pspec(names, rules, mesh, shape=x.shape)

    if len(in_names) != len(args):
        raise ValueError(f"per_shard: {len(args)} arguments but {len(in_names)} in_names")
    in_specs = tuple(spec(n, a) for n, a in zip(in_names, args, strict=True))
    shapes = jax.eval_shape(fn, *args)
    single = len(out_names) == 1
    outs = (shapes,) if single else tuple(shapes)
    if len(outs) != len(out_names):
        raise ValueError(f"per_shard: fn returns {len(outs)} outputs but {len(out_names)} out_names")
    out_specs = tuple(spec(n, o) for n, o in zip(out_names, outs, strict=True))
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs[0] if single else out_specs,
                           check_vma=False)
    return mapped(*args)
