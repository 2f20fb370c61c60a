"""The released model's decode step on the memory plan's GPU meshes, projected from measured layers (arithmetic).

    python benchmarks/decode_projection.py --measured RUN.jsonl [--meshes "tensor=8;expert=2,tensor=8"] \
        [--experts-hit measured|uniform]

Not a measurement: one JSON line per mesh and batch, from

* ``--measured``: :mod:`benchmarks.decode` JSON lines of the release's layer cuts on one GPU
  (``--config configs/k3.json --layers kda`` and ``--layers mla``, MXFP4 experts): per layer kind and batch its
  ``ms_per_step``, must-read ``bytes.total`` (from the experts its routing really hit, ``experts_hit``; lines
  written before decode.py counted them hold the uniform expectation there: ``bytes_source``), its
  ``experts_hit.mean`` and the ``copy_gbps`` of that run;
* the memory plan's sharding (:mod:`sharding.rules` preset ``serve``) of the 93-layer model
  (``configs/k3.json``, MXFP4 experts, abstract shapes): per chip, every weight's local bytes (routed experts: the
  fraction ``h / E`` of them, ``h`` the distinct experts per MoE layer and step of ``--experts-hit``), the
  embedding's batch rows, the KDA states and conv tails read and written and the MLA latents read up to the prompt
  (:func:`sharding.memory.plan`, bf16 caches as the engine holds them).

``--experts-hit measured`` (default): ``h`` = the measured layers' counts at the batch, weighted by the number
of layers of each kind (the routing the timed layers had; every measured line must carry a count);
``uniform``: ``h = E·(1-(1-k/E)^B)``, uniform top-k routing of ``B`` tokens (a router that spreads tokens evenly,
streamed at the measured fraction). Each line says which (``experts_hit``).

Two projections of one step on each chip (the same work on every chip, so also the mesh's step):

* ``same_fraction_ms`` = per-chip must-read / (copy bandwidth x the roofline fraction the measured layers reach on
  one GPU at that batch, 69 KDA + 24 MLA layers): the chips stream their smaller share as well as one GPU streams
  a whole layer (an upper bound on speed: per-layer launch costs do not shrink with the bytes);
* ``two_term_ms`` = 93 x a per-layer fixed time + per-chip must-read / (copy bandwidth x f). The fixed time of a
  layer kind is the part of its batch-1 time the bytes do not explain (``t_1 - m_1 / bw``: launches and small
  kernels, which no mesh divides); f is the bandwidth fraction of the rest at the batch
  (``m_B / bw / (t_B - fixed)``), kept for the chip's share. Needs batch-1 lines of both kinds.

Communication (the tensor-parallel all-reduces, the expert-parallel exchange) is not included in either.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def measured_layers(path: str) -> dict[tuple[str, int], dict]:
    """``{(kind, batch): {"ms", "bytes", "bytes_source", "experts_hit", "gbps"}}`` from decode.py JSON lines of
    single-layer cuts (``experts_hit``: the line's mean count, None on lines without one)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if rec.get("bench") != "decode" or "ms_per_step" not in rec or not rec.get("layers"):
            continue
        if rec["layers"] not in ("kda", "mla"):
            raise ValueError(f"{path}: a measured line of layers {rec['layers']!r}; expected a one-layer cut "
                             "(--layers kda or --layers mla)")
        hit = rec.get("experts_hit")
        if hit is not None and "error" in hit:
            raise ValueError(f"{path}: the {rec['layers']} line of batch {rec['batch']} has no must-read (its "
                             f"expert count failed: {hit['error']})")
        out[(rec["layers"], rec["batch"])] = {
            "ms": rec["ms_per_step"], "bytes": rec["bytes"]["total"], "gbps": rec["copy_gbps"],
            "bytes_source": "measured" if hit is not None else "uniform",
            "experts_hit": None if hit is None else hit["mean"]}
    return out


def chip_must_read(cfg, boxed, sizes: dict[str, int], batch: int, prompt_len: int,
                   experts_hit: float) -> dict[str, float]:
    """Per-chip bytes one decode step must move on a ``serve`` mesh of ``sizes`` with ``experts_hit`` distinct
    routed experts per MoE layer (see the module doc)."""
    import flax.linen as nn
    import jax

    from sharding import rules
    from sharding.memory import _local_elems, plan

    if not 0 < experts_hit <= cfg.num_experts:
        raise ValueError(f"chip_must_read: experts_hit must be in (0, {cfg.num_experts}], got {experts_hit}")
    hit = experts_hit / cfg.num_experts
    specs = jax.tree_util.tree_flatten_with_path(nn.get_partition_spec(boxed),
                                                 is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
    values = jax.tree.leaves(nn.unbox(boxed))
    dense = experts = embed = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rules.ShardingFallbackWarning)
        for (path, names), v in zip(specs, values, strict=True):
            local = _local_elems(tuple(v.shape), rules.logical_to_pspec(tuple(names), "serve", sizes, shape=v.shape),
                                 sizes) * v.dtype.itemsize
            keys = [str(getattr(p, "key", p)) for p in path]
            if "embed_tokens" in keys:
                embed += local * batch / cfg.vocab_size
            elif "experts" in keys and "shared_experts" not in keys:
                experts += local * hit
            else:
                dense += local
    caches = plan(cfg, "serve", sizes, batch=batch, seq_len=prompt_len + 1, latent_dtype="bfloat16",
                  conv_dtype="bfloat16", boxed=boxed).per_device
    out = {"dense_weights": dense, "routed_experts": experts, "embed_rows": embed,
           "kda_state_rw": 2 * caches["kda_state"], "kda_conv_rw": 2 * caches["kda_conv_state"],
           "mla_latent": caches["mla_latent_cache"]}
    out["total"] = sum(out.values())
    return out


def experts_hit_per_layer(cfg, meas: dict[str, dict], n: dict[str, int], batch: int, source: str) -> float:
    """Distinct routed experts per MoE layer and step for the projection (``source``: see the module doc)."""
    from benchmarks.decode import expected_distinct_experts

    if source == "uniform":
        return expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_token, batch)
    if source != "measured":
        raise ValueError(f"experts_hit source must be 'measured' or 'uniform', got {source!r}")
    missing = [kind for kind in n if meas[kind]["experts_hit"] is None]
    if missing:
        raise ValueError(f"the measured {missing} line(s) of batch {batch} carry no experts_hit count (written "
                         "before benchmarks/decode.py counted the routed experts): re-measure, or project with "
                         "--experts-hit uniform")
    return sum(n[k] * meas[k]["experts_hit"] for k in n) / sum(n.values())


def project(cfg, boxed, layers: dict, mesh: str, batch: int, prompt_len: int, experts_hit: str = "measured") -> dict:
    """One JSON record: the projections of ``mesh`` at ``batch`` (see the module doc)."""
    from benchmarks.decode import expected_distinct_experts
    from sharding.mesh import parse_axes, resolve_axes

    n = {"kda": len(cfg.kda_layers), "mla": len(cfg.mla_layers)}
    meas = {kind: layers[(kind, batch)] for kind in n}
    hit = experts_hit_per_layer(cfg, meas, n, batch, experts_hit)
    bw = 1e9 * sum(m["gbps"] for m in meas.values()) / len(meas)
    roof = lambda m: m["bytes"] / bw * 1e3  # ms
    one_gpu_ms = sum(n[k] * meas[k]["ms"] for k in n)
    fraction = sum(n[k] * roof(meas[k]) for k in n) / one_gpu_ms
    sizes = resolve_axes(mesh, math.prod(parse_axes(mesh).values()))
    chip = chip_must_read(cfg, boxed, sizes, batch, prompt_len, hit)
    chip_roof = chip["total"] / bw * 1e3
    rec = {
        "bench": "decode_projection", "projection": True, "mesh": mesh, "gpus": math.prod(sizes.values()),
        "batch": batch, "prompt_len": prompt_len, "layers": n, "measured": meas, "copy_gbps": round(bw / 1e9, 1),
        "experts_hit": {"source": experts_hit, "per_moe_layer": round(hit, 2),
                        "uniform_expected": round(expected_distinct_experts(cfg.num_experts,
                                                                            cfg.num_experts_per_token, batch), 2)},
        "one_gpu_93_layers_ms": round(one_gpu_ms, 2), "one_gpu_fraction": round(fraction, 3),
        "chip_bytes": {k: round(v) for k, v in chip.items()}, "chip_roofline_ms": round(chip_roof, 3),
        "same_fraction_ms": round(chip_roof / fraction, 3),
        "same_fraction_tokens_per_s": round(batch * 1e3 * fraction / chip_roof, 1),
        "communication": "not included",
    }
    if all((k, 1) in layers for k in n):
        fixed = {k: layers[(k, 1)]["ms"] - roof(layers[(k, 1)]) for k in n}
        streamed = sum(n[k] * roof(meas[k]) for k in n) / sum(n[k] * (meas[k]["ms"] - fixed[k]) for k in n)
        two = sum(n[k] * fixed[k] for k in n) + chip_roof / streamed
        rec.update(fixed_ms_per_layer={k: round(v, 4) for k, v in fixed.items()},
                   streamed_fraction=round(streamed, 3), two_term_ms=round(two, 3),
                   two_term_tokens_per_s=round(batch * 1e3 / two, 1))
    return rec


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", required=True, help="decode.py JSON lines of the kda and mla layer cuts")
    ap.add_argument("--config", default="configs/k3.json")
    ap.add_argument("--meshes", default="tensor=8;expert=2,tensor=8", help="';'-separated serve meshes")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--experts-hit", choices=("measured", "uniform"), default="measured",
                    help="distinct routed experts per layer on each chip: the measured lines' counts or the "
                         "uniform-routing expectation")
    args = ap.parse_args(argv)
    from k3_jax.config import load_config
    from sharding.plan import abstract_params

    layers = measured_layers(args.measured)
    batches = sorted({b for (kind, b) in layers if ("kda", b) in layers and ("mla", b) in layers})
    if not batches:
        raise SystemExit(f"{args.measured}: no batch with both a kda and an mla layer line")
    cfg = load_config(REPO / args.config if not Path(args.config).is_absolute() else args.config,
                      param_dtype="bfloat16", dtype="bfloat16").replace(expert_format="mxfp4")
    boxed = abstract_params(cfg)
    for mesh in args.meshes.split(";"):
        for batch in batches:
            print(json.dumps(project(cfg, boxed, layers, mesh, batch, args.prompt_len, args.experts_hit)),
                  flush=True)


if __name__ == "__main__":
    main()
