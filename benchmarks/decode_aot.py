"""The engine's one-token decode step compiled ahead of time for a TPU chip or an H200, on a CPU-only host: XLA's
bytes accessed per step against the bytes the step must read and the chip's HBM roofline, and its kernel launches.

    python benchmarks/decode_aot.py --targets v5p,v6e --config configs/k3.json --layers kda,mla --vocab 1024 \
        --experts mxfp4 --batch 64 --prompt-len 1024

One JSON line per target. The program is the model step the engine's decode runs (``model.apply`` on a
``[B, 1]`` token batch with the cache donated, greedy argmax; the engine's sampling is left out), compiled for
one chip of the topology (``jax.experimental.topologies``; needs ``libtpu``, extra ``aot``) with the kernels the
TPU gets (``platform="tpu"``: ``auto`` picks the Mosaic TPU kernels). ``h200``: an H200 without a GPU
(``benchmarks/gpu_aot.py``; needs JAX's CUDA plugin) with the kernels ``auto`` picks on sm_90 and the serving
engine's XLA:GPU options (:func:`k3_jax.xla_flags.serving_compiler_options`); ``launches`` counts the kernels one
step launches (a scanned segment's body times its trips; on the H200 the device trace of the same step has within
a few of them), ``launch_kinds`` groups them by kind and ``launch_scopes`` by source scope (the layers of a
segment together). Reported: ``bytes_accessed`` and ``flops``
from ``compiled.cost_analysis()``, the memory analysis, ``must_bytes`` (``benchmarks/decode.py``'s count of
the weights, states and latents the step must move), their ratio, and ``roofline_ms = must_bytes / HBM`` /
``xla_bytes_ms = bytes_accessed / HBM`` at the chip's datasheet HBM bandwidth (:data:`HBM_GBPS`).

XLA counts a Mosaic kernel by the cost estimate the kernel hands it (none: 0 bytes). ``kernel_bytes`` lists those
estimates per kernel (from the optimised HLO; the MoE kernels' is an upper bound: every expert of the layer read
once, where ``must_bytes`` counts the expected distinct experts), ``outside_kernels_bytes = bytes_accessed -
sum(kernel_bytes)`` is what XLA's own ops move, and ``top_ops`` the largest of those ops by
``benchmarks/hlo_bytes.py``'s per-op model (``[bytes, opcode, source]``). ``--hlo-out PREFIX`` writes each target's
optimised HLO to ``PREFIX.<target>.hlo`` (``python benchmarks/hlo_bytes.py FILE`` lists every op).

XLA's cost analysis counts a ``while`` body once, not once per trip: use a config whose segments do not repeat
(``--layers kda,mla``: one layer of each at the config's widths) for per-layer figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes on the host may hold libtpu
REPO = Path(__file__).resolve().parents[1]

TOPOLOGIES = {"v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "v5e": "v5e:2x2", "h200": "1x1x1"}
HBM_GBPS = {"v5p": 2765.0, "v6e": 1640.0, "v5e": 819.0, "h200": 4800.0}
"""Datasheet HBM bandwidth per chip (GB/s): TPU v5p 2,765; Trillium (v6e) 1,640; v5e 819; H200 4,800."""
GPU_TARGETS = ("h200",)
GPU_XLA_FLAGS = ("--xla_gpu_enable_triton_gemm=false", "--xla_gpu_autotune_level=0")
"""What the H200 runs of ``benchmarks/decode.py`` set (no GEMM autotuning is possible without a GPU anyway)."""


def compile_decode(target: str, cfg, batch: int, prompt_len: int, max_len: int, hlo_out: str | None = None,
                   top: int = 12, cache_layout: str = "default") -> dict:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.experimental.layout import Format, Layout
    from jax.sharding import SingleDeviceSharding

    from benchmarks.decode import step_bytes
    from benchmarks.gpu_aot import kernel_launches, launches_by_scope
    from benchmarks.hlo_bytes import op_bytes, source_of
    from k3_jax.cache import init_cache
    from k3_jax.model import K3ForCausalLM

    gpu = target in GPU_TARGETS
    if gpu:
        from benchmarks.gpu_aot import h200_device, on_h200
        from k3_jax.xla_flags import serving_compiler_options

        device, options, scope = h200_device(), serving_compiler_options("gpu"), on_h200
    else:
        device = topologies.get_topology_desc(topology_name=TOPOLOGIES[target], platform="tpu").devices[0]
        options, scope = None, (lambda fn: fn)
    cfg = cfg.replace(platform="gpu" if gpu else "tpu")
    dev = SingleDeviceSharding(device)
    model = K3ForCausalLM(cfg)
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), tree)
    params = nn.unbox(jax.eval_shape(K3ForCausalLM(cfg.replace(platform="cpu")).init, jax.random.PRNGKey(0),
                                     jnp.zeros((1, 1), jnp.int32)))  # shapes only: the same on every platform
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, max_len))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=dev)
    cache_in, cache_out = abstract(cache), dev
    if cache_layout == "row-major":  # the cache held in row-major layouts instead of XLA:TPU's defaults
        formats = jax.tree.map(lambda x: Format(Layout(tuple(range(x.ndim))), dev), cache)
        cache_in = jax.tree.map(lambda x, f: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=f), cache, formats)
        cache_out = formats
    elif cache_layout != "default":
        raise ValueError(f"decode_aot: cache_layout must be 'default' or 'row-major', got {cache_layout!r}")

    def decode(variables, cache, tokens):
        logits, cache = model.apply(variables, tokens[:, None], cache=cache)
        return jnp.argmax(logits[:, 0], -1).astype(jnp.int32), cache

    t0 = time.perf_counter()
    # Pallas Triton reads the target GPU's architecture from the default device
    with jax.default_device(device) if gpu else contextlib.nullcontext():
        lowered = jax.jit(scope(decode), donate_argnums=(1,), out_shardings=(dev, cache_out),
                          compiler_options=options).lower(abstract(params), cache_in, tokens)
        compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}  # XLA:GPU without a device: none
    ma = compiled.memory_analysis()
    text = compiled.as_text()
    if hlo_out:
        Path(hlo_out).write_text(text)
    must = step_bytes(cfg, params["params"], cache, batch, prompt_len)
    accessed = float(cost.get("bytes accessed", float("nan")))
    hbm = HBM_GBPS[target] * 1e9
    rows = op_bytes(text)
    kernels: dict[str, int] = {}
    for r in rows:
        if r.get("estimated"):
            kernels[r["kernel"]] = kernels.get(r["kernel"], 0) + r["bytes"]
    outside = [r for r in rows if "kernel" not in r]
    launches = kernel_launches(text) if gpu else None
    return {
        "bench": "decode_aot", "target": target, "topology": TOPOLOGIES[target], "batch": batch,
        "prompt_len": prompt_len, "max_len": max_len, "experts": cfg.expert_format, "cache_layout": cache_layout,
        "layers": [f"{m}+{f}" for m, f in cfg.layer_kinds()],
        "bytes_accessed": accessed, "flops": float(cost.get("flops", float("nan"))), "must_bytes": must,
        "accessed_over_must": round(accessed / must["total"], 3),
        "roofline_ms": round(must["total"] / hbm * 1e3, 3), "xla_bytes_ms": round(accessed / hbm * 1e3, 3),
        "hbm_gbps": HBM_GBPS[target], "argument_bytes": ma.argument_size_in_bytes,
        "temp_bytes": ma.temp_size_in_bytes, "output_bytes": ma.output_size_in_bytes,
        "alias_bytes": getattr(ma, "alias_size_in_bytes", None),
        "kernel_bytes": kernels, "outside_kernels_bytes": accessed - sum(kernels.values()),
        "unestimated_kernels": sorted({r["kernel"] for r in rows if "kernel" in r and not r["estimated"]}),
        "top_ops": [[r["bytes"], r["opcode"], source_of(r["op_name"])] for r in outside[:top]],
        "mosaic_kernels": text.count('custom_call_target="tpu_custom_call"'),
        **({"launches": sum(launches.values()), "launch_kinds": dict(launches.most_common(top)),
            "launch_scopes": dict(launches_by_scope(text).most_common(top))} if gpu else {}),
        "compile_s": round(compile_s, 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="v5p,v6e")
    ap.add_argument("--config", default="configs/k3.json")
    ap.add_argument("--layers", default="kda,mla", help="comma list of kda | mla ('' = the config's layers)")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary size (per-layer figures: keep it small)")
    ap.add_argument("--experts", default="mxfp4", help="bf16 | mxfp4")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=1024, help="cache room beyond the prompt")
    ap.add_argument("--hlo-out", default=None, help="write each target's optimised HLO to PREFIX.<target>.hlo")
    ap.add_argument("--top", type=int, default=12, help="how many of the largest ops outside the kernels to list")
    ap.add_argument("--cache-layout", default="default", choices=("default", "row-major"),
                    help="the cache's layouts: XLA:TPU's defaults for its shapes (what a jitted cache init gets), "
                         "or row-major (minor dim last) pinned on the cache input and output")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from benchmarks.decode import layer_config
    from k3_jax.config import load_config

    targets = args.targets.split(",")
    if any(t in GPU_TARGETS for t in targets):
        from k3_jax.xla_flags import apply_defaults

        apply_defaults(GPU_XLA_FLAGS)  # before JAX creates a backend
    cfg = load_config(args.config).replace(expert_format=args.experts, param_dtype="bfloat16")
    if args.layers:
        cfg = layer_config(cfg, args.layers.split(","), args.vocab)
    for target in targets:
        try:
            hlo = f"{args.hlo_out}.{target}.hlo" if args.hlo_out else None
            rec = compile_decode(target, cfg, args.batch, args.prompt_len, args.prompt_len + args.gen, hlo,
                                 args.top, args.cache_layout)
        except Exception as e:  # noqa: BLE001 - report the target and go on with the next
            rec = {"bench": "decode_aot", "target": target, "error": f"{type(e).__name__}: {str(e)[:600]}"}
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
