"""Ahead-of-time compile of the full train step for a TPU slice, on a host without TPUs (needs ``libtpu``).

    python -m k3_jax.training.aot --config configs/k3-small.json --topology v5p:2x2x1 --mesh fsdp=2,expert=2 \\
        --batch-size 8 --seq-len 1024

Builds the same step as ``train.py`` (model, Muon/AdamW, chunked loss, Quantile Balancing, weight clipping) with
abstract parameters laid out by the sharding preset on the topology's devices and lowers it under that mesh, so
every kernel choice sees the target platform (TPU) from the mesh's devices: ``"auto"`` takes the Mosaic TPU
kernels and the TPU code paths (bf16 matmuls with fp32 accumulation), exactly as on the slice. Compiles it with
XLA:TPU and prints one JSON line: per-device argument / temp bytes from the compiler's memory analysis, the
number of Mosaic kernels in the program, the lowered dot products by operand/result dtypes, lower and compile
seconds — so a config, mesh and batch can be checked for "does it lower, partition and fit in HBM" before a
slice is rented.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from typing import Any

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes on the host may hold libtpu


def compile_train_step(config: str, topology: str, mesh: str, batch_size: int, seq_len: int, *,
                       implementation: str = "auto", preset: str = "train", accum: int = 1,
                       muon_dtype: str = "bfloat16", overrides: dict[str, Any] | None = None,
                       train_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Lower and compile ``train_step(state, batch)`` for ``topology`` (e.g. ``"v5p:2x2x1"``) on ``mesh``.

    ``implementation``: ``kda_implementation`` and ``moe_implementation`` (``"auto"``, ``"mosaic_tpu"`` or
    ``"xla"``). ``overrides``: model-config fields; ``train_overrides``: :class:`TrainConfig` fields (e.g.
    ``{"optimizer": "adamw", "lora_rank": 64, "lora_targets": (...)}``: the LoRA step, gradients and optimizer
    state for the adapters alone, as ``train.py --lora`` builds it). Returns ``{"topology", "devices", "mesh",
    "processes" (hosts of the slice: each runs ``train.py``), "batch_rows_per_process", "argument_bytes",
    "temp_bytes", "output_bytes", "mosaic_kernels", "dots", "lower_s", "compile_s"}`` (bytes per device;
    ``dots``: count of lowered ``dot_general`` s per ``"lhs x rhs -> out"`` element types, e.g.
    ``"bf16 x bf16 -> f32"``).
    """
    import jax
    import jax.numpy as jnp
    from flax import linen as nn
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from k3_jax.training import lora
    from k3_jax.training.loop import TrainConfig, Trainer, batch_sharding
    from k3_jax.training.step import make_train_step
    from sharding.mesh import make_mesh
    from sharding.rules import activate, param_shardings, state_shardings

    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    m = make_mesh(mesh, devices=topo.devices)
    # platform="tpu": the single-device Trainer below traces the model (init shapes) outside the mesh too
    model_overrides = {"kda_implementation": implementation, "moe_implementation": implementation,
                       "platform": "tpu", **(overrides or {})}
    tc = TrainConfig(config=config, model_overrides=model_overrides, workdir="/tmp/k3-aot", seq_len=seq_len,
                     batch_size=batch_size, accum=accum, eval_every=0, tensorboard=False, resume=False,
                     mesh="none", preset=preset, muon_dtype=muon_dtype, **(train_overrides or {}))
    tr = Trainer(tc)  # single-device trainer: only its model, optimizer, labels and step config are used
    boxed = tr.abstract_params_boxed

    def abstract(tree: Any, shardings: Any) -> Any:
        return jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s), tree, shardings)

    shardings = param_shardings(boxed, m, preset)
    params = abstract(nn.unbox(boxed), shardings)
    rep = NamedSharding(m, PartitionSpec())
    with activate(m, preset):
        trained, trained_shardings = ((params, shardings) if tr.trainable is None else
                                      (lora.split(params, tr.trainable)[0], lora.split(shardings, tr.trainable)[0]))
        opt_abstract = jax.eval_shape(tr.tx.init, trained)
        opt_state = abstract(opt_abstract, state_shardings(opt_abstract, trained, trained_shardings, m))
        state = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), "params": params,
                 "opt_state": opt_state, "rng": jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)}
        batch = {k: jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32, sharding=batch_sharding(m))
                 for k in ("tokens", "segment_ids")}
        step = make_train_step(tr.model, tr.tx, tr.labels, tr.cfg, tr.step_cfg, tr.trainable)
        t0 = time.perf_counter()
        lowered = jax.jit(step, donate_argnums=0).lower(state, batch)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
    ma = compiled.memory_analysis()
    processes = len({getattr(d, "process_index", 0) for d in topo.devices})
    if batch_size % processes:
        raise ValueError(f"batch_size {batch_size} does not split over the {processes} hosts of {topology}")
    return {"config": config, "topology": topology, "devices": len(topo.devices), "mesh": dict(m.shape),
            "processes": processes, "batch_rows_per_process": batch_size // processes,
            "batch": batch_size, "seq_len": seq_len, "implementation": implementation,
            "argument_bytes": ma.argument_size_in_bytes, "temp_bytes": ma.temp_size_in_bytes,
            "output_bytes": ma.output_size_in_bytes,
            "mosaic_kernels": compiled.as_text().count('custom_call_target="tpu_custom_call"'),
            "dots": dot_types(lowered.as_text()),
            "lower_s": round(t1 - t0, 1), "compile_s": round(t2 - t1, 1)}


_TENSOR = r"tensor<(?:[^>]*x)?(\w+)>"  # element type of a ranked tensor type
_DOT = re.compile(rf"stablehlo\.dot_general .*: \({_TENSOR}, {_TENSOR}\) -> {_TENSOR}")


def dot_types(stablehlo: str) -> dict[str, int]:
    """``{"lhs x rhs -> out": count}`` over the ``stablehlo.dot_general`` ops of a lowered module's text."""
    counts: dict[str, int] = {}
    for line in stablehlo.splitlines():
        m = _DOT.search(line)
        if m:
            key = f"{m.group(1)} x {m.group(2)} -> {m.group(3)}"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/k3-small.json")
    ap.add_argument("--topology", default="v5p:2x2x1", help="libtpu topology name, e.g. v5p:2x2x1, v6e:2x2")
    ap.add_argument("--mesh", default="fsdp=-1", help="mesh axes over the topology's devices, e.g. fsdp=2,expert=2")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--preset", default="train")
    ap.add_argument("--implementation", default="auto", choices=("auto", "mosaic_tpu", "xla"))
    args = ap.parse_args(argv)
    print(json.dumps(compile_train_step(args.config, args.topology, args.mesh, args.batch_size, args.seq_len,
                                        implementation=args.implementation, preset=args.preset,
                                        accum=args.accum)))


if __name__ == "__main__":
    main()
