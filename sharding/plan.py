"""``python -m sharding.plan``: the memory plan of a config file on a mesh, and optionally the TPU compiler's figure.

``python -m sharding.plan --config configs/k3.json --preset serve --mesh tensor=8 --seq-len 1048576
--latent-dtype float8_e4m3fn`` prints the table of :func:`sharding.memory.plan` (``--json``: one JSON line);
``--aot v5p:8x8x4`` also compiles the forward for that TPU topology on this host (:func:`aot_memory`).

This module is the command-line entry point and sits above the model in the import order: it builds the
model's abstract parameters (:func:`abstract_params`) and hands them to :mod:`sharding.memory`, whose analytic
plan needs no model code. ``import sharding`` does not import this module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

import pallas_kernels.moe.reference as moe_ref
from k3_jax.config import K3Config, load_config
from k3_jax.model import K3ForCausalLM
from sharding import rules
from sharding.memory import GB, plan, process_layout
from sharding.mesh import make_mesh


def abstract_params(cfg: K3Config) -> Any:
    """Boxed abstract parameters (``ShapeDtypeStruct`` leaves in ``nn.LogicallyPartitioned``) of the model."""
    model = K3ForCausalLM(cfg)
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(lambda t: model.init(jax.random.PRNGKey(0), t), tokens)["params"]


def aot_memory(cfg: K3Config, preset: str, mesh: str | dict[str, int], topology: str, tokens: int = 64,
               batch: int = 1) -> dict[str, Any]:
    """Compile the jitted forward (``[batch, tokens]`` → logits) ahead of time for a TPU ``topology`` (e.g.
    ``"v5p:8x8x4"`` = v5p-512) on this host and return the compiler's per-device memory analysis.

    Needs ``libtpu`` (extra ``aot``); no TPU is touched. Parameters are abstract (``ShapeDtypeStruct`` with the
    preset's shardings). The MoE reference's ``ragged_dot`` is lowered at default precision for bf16 operands
    during this call (``precision=HIGHEST`` with bf16 operands crashes Mosaic's ragged-dot lowering on TPU).
    """
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    m = make_mesh(mesh, devices=topo.devices)
    cfg = cfg.replace(moe_implementation="reference", kda_implementation="reference")
    model = K3ForCausalLM(cfg)
    boxed = abstract_params(cfg)
    shardings = rules.param_shardings({"params": boxed}, m, preset)
    params = jax.tree.map(lambda v, sh: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh),
                          nn.unbox({"params": boxed}), shardings)
    tok = jax.ShapeDtypeStruct((batch, tokens), jnp.int32, sharding=NamedSharding(m, PartitionSpec()))

    orig = moe_ref.grouped_matmul

    def gmm(lhs, rhs, group_sizes, *, preferred_element_type=None):
        prec = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
        return jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32), precision=prec,
                                  preferred_element_type=preferred_element_type or lhs.dtype)

    moe_ref.grouped_matmul = gmm
    try:
        with rules.activate(m, preset):
            compiled = jax.jit(model.apply).lower(params, tok).compile()
    finally:
        moe_ref.grouped_matmul = orig
    ma = compiled.memory_analysis()
    return {"topology": topology, "devices": len(topo.devices), "argument_bytes": ma.argument_size_in_bytes,
            "output_bytes": ma.output_size_in_bytes, "temp_bytes": ma.temp_size_in_bytes,
            "generated_code_bytes": ma.generated_code_size_in_bytes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3.json")
    ap.add_argument("--preset", default="serve")
    ap.add_argument("--mesh", default="tensor=8", help="e.g. expert=64,tensor=4 (one axis may be -1)")
    ap.add_argument("--devices", type=int, default=None, help="device count (needed when an axis is -1)")
    ap.add_argument("--experts", choices=["bf16", "mxfp4", "config"], default="config")
    ap.add_argument("--param-dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=1 << 20)
    ap.add_argument("--latent-dtype", default="float8_e4m3fn")
    ap.add_argument("--optimizer", choices=["none", "adamw", "muon"], default="none")
    ap.add_argument("--master-fp32", action="store_true")
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--prefix-kda-gb", type=float, default=0.0,
                    help="serving: prefix cache KDA snapshot budget (GB, PrefixCacheConfig.kda_budget_bytes)")
    ap.add_argument("--prefix-mla-gb", type=float, default=0.0,
                    help="serving: prefix cache MLA page budget (GB, PrefixCacheConfig.mla_budget_bytes)")
    ap.add_argument("--tokens-per-device", type=int, default=None,
                    help="training: tokens per device per micro-step (default batch*seq-len / accum / data axes)")
    ap.add_argument("--accum", type=int, default=1, help="training: gradient-accumulation micro-batches per step")
    ap.add_argument("--remat", choices=["none", "full", "dots"], default=None,
                    help="training: the model's remat policy (default: the config's)")
    ap.add_argument("--capacity-gib", type=float, default=None, help="per-device memory, e.g. 141 (H200), 95 (v5p)")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="LoRA fine-tuning: adapters of this rank (k3_jax.training.lora) are the only trained leaves")
    ap.add_argument("--lora-targets", default="attention,shared_experts,latent,experts",
                    help="comma-separated LoRA targets (see k3_jax.training.lora.TARGET_ALIASES)")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    ap.add_argument("--aot", default=None, metavar="TOPOLOGY",
                    help="also AOT-compile the forward for a TPU topology (e.g. v5p:8x8x4 = v5p-512; needs libtpu) "
                         "and print the compiler's per-device memory beside ours (minutes)")
    ap.add_argument("--aot-tokens", type=int, default=64)
    ap.add_argument("--processes", type=int, default=1,
                    help="hosts (JAX processes) the devices are spread over: per-host bytes and batch rows")
    a = ap.parse_args(argv)
    over: dict[str, Any] = {"param_dtype": a.param_dtype, "dtype": "bfloat16"}
    if a.experts != "config":
        over["expert_format"] = a.experts
    if a.remat is not None:
        over["remat"] = a.remat
    cfg = load_config(a.config, **over)
    boxed = abstract_params(cfg)
    if a.lora:
        from k3_jax.training import lora  # noqa: PLC0415

        lc = lora.LoraConfig(rank=a.lora, targets=tuple(t for t in a.lora_targets.split(",") if t))
        # f32 adapters, as the LoRA trainer holds them (k3_jax.training.loop), whatever the base's dtype
        boxed = lora.with_adapters(boxed, lora.adapter_shapes(boxed, lc, dtype=jnp.float32))
    res = plan(cfg, a.preset, a.mesh, num_devices=a.devices, batch=a.batch, seq_len=a.seq_len,
               latent_dtype=a.latent_dtype, optimizer=a.optimizer, master_fp32=a.master_fp32,
               prefill_chunk=a.prefill_chunk, train_tokens_per_device=a.tokens_per_device,
               prefix_kda_budget=a.prefix_kda_gb * GB, prefix_mla_budget=a.prefix_mla_gb * GB,
               boxed=boxed, lora=bool(a.lora), accum=a.accum)
    if a.aot:
        comp = aot_memory(cfg, a.preset, a.mesh, a.aot, tokens=a.aot_tokens)
        res.whole["aot_compiler_argument_bytes_per_device"] = comp["argument_bytes"]
        res.whole["aot_compiler_temp_bytes_per_device"] = comp["temp_bytes"]
        res.notes.append(f"AOT {a.aot} ({comp['devices']} devices, forward of {a.aot_tokens} tokens): compiler "
                         f"arguments {comp['argument_bytes'] / GB:.3f} GB vs our params "
                         f"{res.per_device['params'] / GB:.3f} GB per device; temporaries "
                         f"{comp['temp_bytes'] / GB:.3f} GB")
    if a.processes > 1:
        lay = process_layout(res.mesh, a.processes, a.batch, res.total)
        res.whole.update({"per_process_bytes": lay["per_process_bytes"]})
        res.notes.append(f"{a.processes} processes x {lay['devices_per_process']} devices: "
                         f"{lay['per_process_bytes'] / GB:.3f} GB per process, batch rows per process "
                         f"{lay['batch_rows_per_process']}, axes across processes {lay['axes_across_processes']}")
    if a.json:
        print(json.dumps(res.as_dict()))
    else:
        print(res.table(a.capacity_gib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
