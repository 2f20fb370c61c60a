"""Restore a converted orbax checkpoint onto a mesh over all processes and save the logits of fixed tokens.

    python -m k3_jax.launch --processes 2 --devices-per-process 4 -- tests/multihost/converted_logits.py \
        CKPT_DIR OUT.npz --mesh expert=8

Test support for tests/test_multihost.py: every process reads only its shards (``restore_params_on_mesh``),
the forward runs on the global mesh under the ``serve`` preset in float32, and process 0 writes the replicated
``[2, 16, V]`` logits of the tokens ``(7 * i + 3) % vocab``.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--mesh", default="expert=8")
    a = ap.parse_args()
    from sharding.mesh import initialize_distributed

    initialize_distributed()
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from k3_jax.convert.orbax_io import restore_params_on_mesh
    from k3_jax.model import K3ForCausalLM
    from k3_jax.training.multihost import synced_when_multiprocess
    from sharding.mesh import make_mesh
    from sharding.rules import activate

    mesh = make_mesh(a.mesh)
    cfg, params = restore_params_on_mesh(a.checkpoint, mesh, "serve", dtype="float32")
    tokens_np = ((7 * np.arange(2 * 16) + 3) % cfg.vocab_size).astype(np.int32).reshape(2, 16)
    tokens = jax.make_array_from_callback(tokens_np.shape, NamedSharding(mesh, PartitionSpec()),
                                          lambda idx: tokens_np[idx])
    forward = jax.jit(lambda p, t: K3ForCausalLM(cfg).apply({"params": p}, t),
                      out_shardings=NamedSharding(mesh, PartitionSpec()))  # replicated: every process has it all
    with activate(mesh, "serve"):
        logits = synced_when_multiprocess(forward, "logits")(params, tokens)
    out = np.asarray(logits.addressable_data(0))
    leaf = jax.tree.leaves(params)[0]
    print(f"process {jax.process_index()}/{jax.process_count()}: {len(leaf.addressable_shards)} local shards "
          f"of a leaf over {len(leaf.sharding.device_set)} devices; logits {out.shape}", flush=True)
    if jax.process_index() == 0:
        np.savez(a.out, logits=out)


if __name__ == "__main__":
    main()
