"""Device mesh, logical-axis sharding rules, expert / sequence / vocab parallelism and the memory plan.

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
