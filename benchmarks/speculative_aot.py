"""A speculative round against one plain decode step, compiled ahead of time for a TPU chip on a CPU-only host:
XLA's bytes accessed and the copies of each program.

    python benchmarks/speculative_aot.py --target v5p --config configs/k3-small.json --ks 4 --batch 1

One JSON line per program, all compiled for one chip of the topology (``jax.experimental.topologies``; needs
``libtpu``, extra ``aot``) with the kernels the TPU gets (``platform="tpu"``), random-weight shapes only (nothing
runs), greedy, the cache donated as the engines donate it:

* ``plain step``: the plain engine's decode step (``model.apply`` on ``[B, 1]`` tokens, then
  :func:`k3_jax.serving.sampling.sample` greedy);
* ``verify k=K``: the target's verify pass of a round alone (``[B, K + 1]`` tokens under
  :func:`k3_jax.layers.kda.record_position_states`, the draft features collected);
* ``round k=K``: :func:`k3_jax.serving.speculative.speculative_round` (draft catch-up and chain, verify,
  acceptance, rollback; ``DraftConfig.default_for``);
* ``round k=K head=N`` (``--head-vocab N``): the same round with a pruned draft head over ``N`` ids
  (``DraftConfig.head_vocab``; the gathered ``[D, N]`` head and the ``[N]`` map are inputs, as the engine holds
  them), after the full-head round of the same ``k``.

Reported: ``bytes_accessed`` and ``flops`` (``compiled.cost_analysis()``), ``over_step`` (bytes over the plain
step's); ``must_bytes``: what the program's target forward must move (:func:`must_bytes`; for a round, its verify
pass's: the draft is not counted); ``model_bytes`` / ``model_over_step``: the same by ``benchmarks/hlo_bytes.py``'s
per-op model, without the ``AllocateBuffer`` custom calls (an uninitialised buffer, e.g. a scan's stacked outputs:
no traffic, which that model counts as a write of the buffer); ``copies`` / ``copy_bytes``: the optimised HLO's
``copy`` ops (layout changes and materialised slices) and their bytes by that model, ``async_copies`` /
``async_copy_bytes`` its ``copy-start`` ops (mostly moves between HBM and VMEM); the memory analysis
(``temp_bytes``, ``alias_bytes``), the Mosaic kernels' cost estimates and the largest ops outside them (``[bytes,
opcode, source]``). ``ops``: the HLO ops the program runs (``while`` bodies once; not bitcasts, tuples, parameters,
``-done`` halves or buffer allocations). A compile, not a timing.

XLA's cost analysis counts a ``while`` body once, not once per trip (a scanned segment's repeats: one repeat's
bytes), the same way for every program here; ``--layers`` (as ``benchmarks/decode_aot.py``) replaces the layer list.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes on the host may hold libtpu
REPO = Path(__file__).resolve().parents[1]


def must_bytes(cfg, params, cache, batch: int, tokens: int, prompt_len: int) -> int:
    """Bytes a cached forward of ``tokens`` tokens per row must move (``benchmarks/decode.py``'s ``step_bytes``
    model): the weights once with the routed experts ``batch · tokens`` tokens are expected to pick, the KDA states
    and conv tails read once and written once per token (the verify pass's traces; once for a step), the MLA
    latents read up to ``prompt_len`` and the new rows written."""
    from benchmarks.decode import step_bytes

    one, many = step_bytes(cfg, params, cache, batch, prompt_len), step_bytes(cfg, params, cache, batch * tokens,
                                                                              prompt_len)
    weights = many["dense_weights"] + many["embed_rows"] + many["routed_experts"]
    states = (one["kda_state_rw"] + one["kda_conv_rw"]) * (1 + tokens) // 2
    latents = one["mla_latent"] * (prompt_len + tokens) // (prompt_len + 1)
    return weights + states + latents


def compile_programs(target: str, cfg, ks: list[int], batch: int, max_len: int, prompt_len: int, top: int = 8,
                     hlo_out: str | None = None, head_vocab: int = 0) -> list[dict]:
    """The records of the plain step, then the verify pass and the round for each ``k`` (module docstring);
    ``hlo_out``: write each program's optimised HLO to ``PREFIX.<program>.hlo``."""
    import dataclasses

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    from benchmarks.decode_aot import TOPOLOGIES
    from benchmarks.hlo_bytes import FREE_OPS, _run_computations, op_bytes, parse_module, source_of
    from k3_jax.cache import init_cache
    from k3_jax.draft import DraftConfig, DraftModel, init_draft_cache, target_head
    from k3_jax.layers.kda import record_position_states
    from k3_jax.model import FEATURES, K3ForCausalLM
    from k3_jax.serving.sampling import SamplingArrays, sample
    from k3_jax.serving.speculative import speculative_round

    dev = SingleDeviceSharding(topologies.get_topology_desc(topology_name=TOPOLOGIES[target],
                                                            platform="tpu").devices[0])
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), tree)  # noqa: E731
    model = K3ForCausalLM(cfg)
    params = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32)))
    b, i32 = batch, jnp.int32
    samp = SamplingArrays(temperature=jnp.zeros((b,), jnp.float32), top_k=jnp.zeros((b,), i32),
                          top_p=jnp.ones((b,), jnp.float32), seed=jnp.zeros((b,), jnp.uint32),
                          step=jnp.zeros((b,), i32))
    dcfg = DraftConfig.default_for(cfg)
    draft = DraftModel(cfg, dcfg)
    nf = cfg.hidden_size * len(dcfg.feature_layers)
    emb, head = target_head(cfg, params["params"])
    dparams = nn.unbox(jax.eval_shape(draft.init, jax.random.PRNGKey(1), jnp.zeros((1, 2, nf), cfg.dtype),
                                      jnp.zeros((1, 2), i32), emb, head))
    records: list[dict] = []

    def record(program: str, fn, donate: tuple[int, ...], tokens: int, *args) -> None:
        t0 = time.perf_counter()
        compiled = jax.jit(fn, donate_argnums=donate).lower(*abstract(args)).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        ma = compiled.memory_analysis()
        text = compiled.as_text()
        if hlo_out:
            Path(f"{hlo_out}.{program.replace(' ', '_').replace('=', '')}.hlo").write_text(text)
        allocations = set(re.findall(r'%([\w.\-]+) = [^\n]*custom_call_target="AllocateBuffer"', text))
        rows = [r for r in op_bytes(text) if r["name"] not in allocations]
        comps, entry = parse_module(text)
        ops = sum(1 for comp in _run_computations(comps, entry) for ins in comps[comp]
                  if ins.opcode not in FREE_OPS and not ins.opcode.endswith("-done") and ins.name not in allocations)
        copies = [r for r in rows if r["opcode"] == "copy"]
        async_copies = [r for r in rows if r["opcode"] == "copy-start"]
        kernels: dict[str, int] = {}
        for r in rows:
            if r.get("estimated"):
                kernels[r["kernel"]] = kernels.get(r["kernel"], 0) + r["bytes"]
        accessed = float(cost.get("bytes accessed", float("nan")))
        model_bytes = sum(r["bytes"] for r in rows)
        step, model_step = ((records[0]["bytes_accessed"], records[0]["model_bytes"]) if records
                            else (accessed, model_bytes))
        records.append({
            "bench": "speculative_aot", "program": program, "target": target, "batch": batch, "max_len": max_len,
            "head_vocab": head_vocab if "head=" in program else None,
            "config_layers": [f"{m}+{f}" for m, f in cfg.layer_kinds()],
            "bytes_accessed": accessed, "over_step": round(accessed / step, 3),
            "model_bytes": model_bytes, "model_over_step": round(model_bytes / model_step, 3),
            "must_bytes": must_bytes(cfg, params["params"], args[2 if program.startswith("round") else 1], batch,
                                     tokens, prompt_len),
            "flops": float(cost.get("flops", float("nan"))), "ops": ops,
            "copies": len(copies), "copy_bytes": sum(r["bytes"] for r in copies),
            "async_copies": len(async_copies), "async_copy_bytes": sum(r["bytes"] for r in async_copies),
            "top_copies": [[r["bytes"], source_of(r["op_name"])] for r in copies[:top]],
            "temp_bytes": ma.temp_size_in_bytes, "alias_bytes": getattr(ma, "alias_size_in_bytes", None),
            "kernel_bytes": kernels, "outside_kernels_bytes": accessed - sum(kernels.values()),
            "top_ops": [[r["bytes"], r["opcode"], source_of(r["op_name"])] for r in rows if "kernel" not in r][:top],
            "compile_s": round(time.perf_counter() - t0, 1),
        })
        print(json.dumps(records[-1]), flush=True)

    def step(variables, cache, tokens):
        logits, cache = model.apply(variables, tokens[:, None], cache=cache)
        return sample(logits[:, 0], samp, num_top_logprobs=0, sampling=False), cache

    record("plain step", step, (1,), 1, params, init_cache(cfg, b, max_len), jnp.zeros((b,), i32))
    for k in ks:
        cache = init_cache(cfg, b, max_len + k)

        def verify(variables, cache, tokens):
            with record_position_states():
                (logits, cache), feats = model.apply(variables, tokens, cache=cache, mutable=[FEATURES])
            return jnp.argmax(logits, -1), cache, feats

        record(f"verify k={k}", verify, (1,), k + 1, params, cache, jnp.zeros((b, k + 1), i32))

        def round_fn(variables, dvars, cache, dcache, last, pend, k=k):
            return speculative_round(model, draft, dcfg, variables, dvars, cache, dcache, last, *pend,
                                     jnp.ones((b,), bool), jnp.full((b,), k, i32), samp, 0, False)

        pend = (jnp.zeros((b, k + 1, nf), cfg.dtype), jnp.zeros((b, k + 1), i32), jnp.ones((b,), i32))
        record(f"round k={k}", round_fn, (2, 3, 5), k + 1, params, dparams, cache,
               init_draft_cache(cfg, dcfg, b, max_len + k + 1), jnp.zeros((b,), i32), pend)
        if head_vocab:
            pcfg = dataclasses.replace(dcfg, head_vocab=head_vocab).validate(cfg)
            pruned = DraftModel(cfg, pcfg)
            pvars = {**dparams, "vocab_map": jnp.zeros((head_vocab,), i32),
                     "head": jnp.zeros((cfg.hidden_size, head_vocab), head.dtype)}

            def pruned_round(variables, dvars, cache, dcache, last, pend, k=k, pruned=pruned, pcfg=pcfg):
                return speculative_round(model, pruned, pcfg, variables, dvars, cache, dcache, last, *pend,
                                         jnp.ones((b,), bool), jnp.full((b,), k, i32), samp, 0, False)

            record(f"round k={k} head={head_vocab}", pruned_round, (2, 3, 5), k + 1, params, pvars,
                   init_cache(cfg, b, max_len + k), init_draft_cache(cfg, pcfg, b, max_len + k + 1),
                   jnp.zeros((b,), i32), pend)
    return records


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="v5p", choices=("v5p", "v6e", "v5e"))
    ap.add_argument("--config", default="configs/k3-small.json")
    ap.add_argument("--layers", default="", help="comma list of kda | mla replacing the config's ('' = keep)")
    ap.add_argument("--ks", default="4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=512, help="the plain engine's cache (the round's: + k)")
    ap.add_argument("--prompt-len", type=int, default=256, help="cached tokens per row for must_bytes")
    ap.add_argument("--head-vocab", type=int, default=0,
                    help="also compile each round with a pruned draft head over this many ids (0 = only the full head)")
    ap.add_argument("--hlo-out", default=None, help="write each program's optimised HLO to PREFIX.<program>.hlo")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from benchmarks.decode import layer_config
    from k3_jax.config import load_config

    cfg = load_config(args.config).replace(param_dtype="bfloat16", platform="tpu")
    if args.layers:
        cfg = layer_config(cfg, args.layers.split(","), None)
    compile_programs(args.target, cfg, [int(k) for k in args.ks.split(",")], args.batch, args.max_len,
                     args.prompt_len, hlo_out=args.hlo_out, head_vocab=args.head_vocab)


if __name__ == "__main__":
    main()
