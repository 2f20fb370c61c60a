"""Device mesh, logical-axis sharding rules and presets, the per-shard kernel wrapper, and the memory plan.

Modules: :mod:`sharding.mesh` (the five named axes), :mod:`sharding.rules` (logical names → mesh axes, presets,
activation constraints), :mod:`sharding.local_kernels` (single-device kernels run per shard),
:mod:`sharding.memory` (per-device bytes from abstract parameters) and the command line :mod:`sharding.plan`.
This package imports nothing from the layers or the model (only :mod:`sharding.plan`, the command line, builds a
model); the layers' multi-device forms are in :mod:`k3_jax.parallel`.

Typical use::

    from sharding import make_mesh, rules
    mesh = make_mesh("fsdp=-1,expert=8,tensor=4")
    params = rules.shard_params(boxed_params, mesh, "train")
    with rules.activate(mesh, "train"):
        logits = jax.jit(model.apply)(params, tokens)
"""

from sharding import rules
from sharding.mesh import AXES, initialize_distributed, make_mesh

__all__ = ["AXES", "initialize_distributed", "make_mesh", "rules"]
