"""Paged MLA decode reading the pages in place vs gathering every row's page view, rows of very different lengths.

    python benchmarks/paged_decode.py --config configs/k3-slice.json --what attention,step [--lengths 1024,...]

One JSON line per case, both paths timed in the same process on the same inputs:

* ``attention``: the MLA latent attention alone at the config's widths (``H`` heads, ``C = kv_lora``, ``Dr``) over
  a page pool of ``--page-size`` tokens per page (pages of each row scattered over the pool in random order):
  ``gather`` = :func:`pallas_kernels.paged_latent_attention.paged_attention_reference` (the whole table of every
  row gathered into a dense view, one masked softmax: what the engine's gather path computes), and per
  ``--impls`` name :func:`~pallas_kernels.paged_latent_attention.paged_attention` with that implementation
  (``kernel``: the registry's choices). ``bytes`` = the latents the step must read, ``Σ_b (len_b + 1) · (C + Dr)
  · 2``; ``max_abs_diff`` against the gather path.
* ``step``: the paged engine's decode step (one token per row, greedy argmax) on a model of the config with random
  weights (:func:`benchmarks.decode.init_params`): ``apply_on_cache`` with the pages read in place (``in_place_<impl>``
  per ``--impls`` name, the first timed first) vs ``gather_view=True`` (``gather``: each MLA layer's view ``[B,
  max_pages · S, C + Dr]`` gathered, the dense layer, the new token scattered back). Every path starts from a copy
  of the same random cache; lengths are reset every call (every call decodes at the same positions). ``bytes`` as
  in ``benchmarks/decode.py`` with the MLA latents read up to each row's own length; ``tokens_equal_gather``: the
  greedy tokens of the path's first call equal to the gather path's, of ``batch``.

``copy_gbps``: device copy bandwidth in the same process (``benchmarks.decode.copy_bandwidth_gbps``);
``roofline_ms = bytes / copy_gbps``, ``roofline_fraction = roofline_ms / ms``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LENGTHS = "1024,32768,2048,16384,4096,24576,1024,8192,3072,32000,6144,12288,1536,20480,2560,28672"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3-slice.json")
    ap.add_argument("--what", default="attention,step", help="comma list of attention | step")
    ap.add_argument("--lengths", default=LENGTHS, help="cached tokens of each row (the batch is their count)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--gen", type=int, default=128, help="pages mapped beyond each row's length (its max_tokens)")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--impls", default="auto,mosaic_gpu,xla",
                    help="paged-attention implementations timed (registry names; one that cannot run is reported)")
    ap.add_argument("--mosaic-gpu-splits", default="",
                    help="comma list of split counts to time the mosaic_gpu kernel at too (attention case)")
    ap.add_argument("--label", default="")
    return ap.parse_args(argv)


def emit(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


def page_table(lengths: list[int], page_size: int, gen: int, seed: int = 0):
    """``(table [B, max_pages] i32, num_pages)``: each row maps ``ceil((len + gen) / S)`` pages of a shuffled
    pool (page 0 null)."""
    import numpy as np

    need = [-(-(n + gen) // page_size) for n in lengths]
    max_pages = -(-(max(lengths) + gen) // page_size)
    num_pages = sum(need) + 1
    perm = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
    table = np.zeros((len(lengths), max_pages), np.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n]
        at += n
    return table, num_pages


def attention_inputs(lengths: list[int], heads: int, c: int, dr: int, page_size: int, gen: int) -> tuple:
    """``(q_lat, q_rot, pages, None, table, pos)`` of the attention case: bf16 normal queries (one per row) and a
    page pool from :func:`page_table`, each row at its length."""
    import jax
    import jax.numpy as jnp

    b = len(lengths)
    table, num_pages = page_table(lengths, page_size, gen)
    k = jax.random.split(jax.random.key(0), 3)
    pages = jax.random.normal(k[0], (num_pages, page_size, c + dr), jnp.bfloat16)
    q_lat = jax.random.normal(k[1], (b, 1, heads, c), jnp.bfloat16)
    q_rot = jax.random.normal(k[2], (b, 1, heads, dr), jnp.bfloat16)
    return q_lat, q_rot, pages, None, jnp.asarray(table), jnp.asarray(lengths, jnp.int32)


def timed(fn, calls: int) -> float:
    """ms per call of ``fn()`` over ``calls`` back-to-back calls (after the caller's warm-up)."""
    import jax

    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return 1000 * (time.perf_counter() - t0) / calls


def attention_case(cfg, lengths: list[int], args, gbps: float) -> dict:
    import jax
    import numpy as np

    from pallas_kernels import paged_latent_attention as pla
    from pallas_kernels.registry import selections

    b, h, c, dr = len(lengths), cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    args_ = attention_inputs(lengths, h, c, dr, args.page_size, args.gen)
    table = args_[4]
    scale = (cfg.qk_nope_head_dim + dr) ** -0.5
    gather = jax.jit(lambda *a: pla.paged_attention_reference(*a[:6], scale))
    want = np.asarray(jax.block_until_ready(gather(*args_)), np.float32)
    nbytes = sum(n + 1 for n in lengths) * (c + dr) * 2
    roof = nbytes / (gbps * 1e9) * 1000
    rec = {"bench": "paged_decode", "case": "attention", "label": args.label, "batch": b, "heads": h,
           "lengths": lengths, "page_size": args.page_size, "max_pages": int(table.shape[1]), "bytes": nbytes,
           "roofline_ms": round(roof, 4), "max_abs": float(np.max(np.abs(want))), "copy_gbps": round(gbps, 1),
           "device": jax.devices()[0].device_kind}
    rec["gather_ms"] = round(timed(lambda: gather(*args_), args.calls), 4)
    rec["gather_roofline_fraction"] = round(roof / rec["gather_ms"], 3)
    def time_path(name: str, fn, relative: bool) -> None:  # fills rec[name]; a path that cannot run is reported
        try:
            got = np.asarray(jax.block_until_ready(fn(*args_)), np.float32)
            ms = timed(lambda: fn(*args_), args.calls)
            rec[name] = {"ms": round(ms, 4), "roofline_fraction": round(roof / ms, 3),
                         "max_abs_diff": float(np.max(np.abs(got - want)))}
            if relative:
                rec[name]["speedup_vs_gather"] = round(rec["gather_ms"] / ms, 2)
        except Exception as e:  # noqa: BLE001 - report the backend and go on
            rec[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}

    for impl in args.impls.split(","):
        time_path(impl, jax.jit(lambda *a, impl=impl: pla.paged_attention(impl, *a[:6], scale)), True)
    for ns in (int(x) for x in args.mosaic_gpu_splits.split(",") if x):
        time_path(f"mosaic_gpu_splits{ns}", jax.jit(lambda *a, ns=ns: pla.paged_attention_mgpu(*a[:6], scale,
                                                                                               splits=ns)), False)
    rec["kernel"] = [s.describe() for s in selections() if s.op == pla.PAGED_DECODE.op]
    return rec


def step_case(cfg, lengths: list[int], args, gbps: float) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.decode import init_params, step_bytes
    from k3_jax.model import K3ForCausalLM
    from k3_jax.serving.engine import Engine, apply_on_cache

    b = len(lengths)
    t0 = time.perf_counter()
    params = init_params(cfg)
    init_s = time.perf_counter() - t0
    table, num_pages = page_table(lengths, args.page_size, args.gen)
    eng = Engine(cfg, params, max_batch=b, max_len=max(lengths) + args.gen, page_size=args.page_size, paged=True,
                 num_pages=num_pages, eos_ids=())
    del params

    def fill(cache):  # random states, conv tails and pages (never time on zeros), every row at its length
        leaves, tree = jax.tree.flatten(cache)
        keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
        leaves = [(0.05 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
                  if jnp.issubdtype(x.dtype, jnp.floating) else x for k, x in zip(keys, leaves, strict=True)]
        return {**jax.tree.unflatten(tree, leaves), "lengths": jnp.asarray(lengths, jnp.int32)}

    start = jax.block_until_ready(jax.jit(fill, donate_argnums=(0,))(eng.cache))  # each path starts from a copy
    state = {}
    kda_only = {**start, "segments": [{k: e for k, e in seg.items() if "state" in e} for seg in start["segments"]]}
    nbytes = step_bytes(cfg, eng.variables["params"], kda_only, b, 0)
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    itemsize = jnp.dtype(eng.page_spec.latent_dtype).itemsize
    nbytes["mla_latent"] = len(cfg.mla_layers) * sum(n + 1 for n in lengths) * width * itemsize
    nbytes["total"] += nbytes["mla_latent"]
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, cfg.vocab_size, b), jnp.int32)
    active, table = jnp.ones((b,), bool), jnp.asarray(table)

    def make(gather_view: bool, impl: str):
        model = K3ForCausalLM(cfg.replace(mla_paged_decode_implementation=impl))

        def step(variables, cache, toks):
            logits, new = apply_on_cache(model, variables, toks[:, None], cache, table, eng.compute_dtype,
                                         active, gather_view=gather_view)
            return jnp.argmax(logits[:, 0], axis=-1), {**new, "lengths": cache["lengths"]}
        return jax.jit(step, donate_argnums=(1,), compiler_options=eng.model_compiler_options)

    rec = {"bench": "paged_decode", "case": "step", "label": args.label, "config": args.config, "batch": b,
           "lengths": lengths, "page_size": args.page_size, "init_s": round(init_s, 1)}
    firsts = {}
    roof = nbytes["total"] / (gbps * 1e9) * 1000
    rec.update({"bytes": nbytes, "roofline_ms": round(roof, 3), "copy_gbps": round(gbps, 1),
                "device": jax.devices()[0].device_kind})
    impls = args.impls.split(",")
    paths = [(f"in_place_{impls[0]}", False, impls[0]), ("gather", True, "xla")]
    paths += [(f"in_place_{i}", False, i) for i in impls[1:]]
    for name, gather_view, impl in paths:  # the gather path's MLA layers run the dense decode (no page reads)
        try:
            state["cache"] = jax.tree.map(jnp.copy, start)
            t0 = time.perf_counter()
            fn = make(gather_view, impl).lower(eng.variables, state["cache"], tokens).compile()
            compile_s = time.perf_counter() - t0

            def call(fn=fn):
                out, state["cache"] = fn(eng.variables, state["cache"], tokens)
                return out

            firsts[name] = np.asarray(jax.block_until_ready(call()))
            call()
            ms = timed(call, args.calls)
            rec[name] = {"ms": round(ms, 3), "tokens_per_s": round(b * 1000 / ms, 1),
                         "roofline_fraction": round(roof / ms, 3), "compile_s": round(compile_s, 1)}
        except Exception as e:  # noqa: BLE001 - report the path and go on
            rec[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        emit({**rec, "partial": True})
    for name, _, _ in paths:
        if name != "gather" and "ms" in rec.get(name, {}) and "ms" in rec.get("gather", {}):
            rec[name]["speedup_vs_gather"] = round(rec["gather"]["ms"] / rec[name]["ms"], 3)
            rec[name]["tokens_equal_gather"] = int(np.sum(firsts[name] == firsts["gather"]))
    return rec


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import jax

    from benchmarks.decode import copy_bandwidth_gbps
    from k3_jax.config import load_config

    gbps = copy_bandwidth_gbps()
    cfg = load_config(args.config).replace(param_dtype="bfloat16")
    lengths = [int(v) for v in args.lengths.split(",")]
    emit({"bench": "paged_decode", "copy_gbps": round(gbps, 1), "device": jax.devices()[0].device_kind})
    for what in args.what.split(","):
        try:
            emit(attention_case(cfg, lengths, args, gbps) if what == "attention" else
                 step_case(cfg, lengths, args, gbps))
        except Exception as e:  # noqa: BLE001 - report the case and go on with the next
            emit({"bench": "paged_decode", "case": what, "error": f"{type(e).__name__}: {str(e)[:600]}"})


if __name__ == "__main__":
    main()
