"""Decode step at the memory roofline: the engine's jitted decode step timed against the bytes it must read.

    python benchmarks/decode.py --config configs/k3-slice.json --cases 64:128,1:128,256:128,16:32768 \
        --experts bf16,mxfp4 --decode-block 8 [--profile-dir DIR] [--xla-flags="--xla_..."]

One JSON line per case (``batch:prompt_len``, expert format, steps per call):

* ``ms_per_step`` / ``tokens_per_s``: wall time of ``--calls`` calls of the engine's own jitted decode function
  (``Engine._decode``, or ``Engine._decode_multi`` with ``--decode-block n``: n steps per call), cache donated,
  every slot active at ``prompt_len`` cached tokens (cache contents random), after a warm-up call.
* ``experts_hit``: the distinct routed experts each MoE layer's router really selects in the first timed call,
  counted outside the timing (:func:`routing_probe`): the cache as that call received it is copied before the
  timed calls, and after them the same model step is run on the copy, ``n`` steps fed the call's own greedy
  tokens, with ``mutable=["intermediates"]`` (the ``expert_ids`` each :class:`~k3_jax.layers.moe.LatentMoE`
  sows). ``per_step`` lists each layer's count at each of the ``n`` steps, ``per_layer`` its mean, ``mean`` the
  mean over layers; ``uniform_expected`` is ``E·(1-(1-k/E)^B)``, the count of uniform top-k routing of ``B``
  tokens; ``greedy_agree`` the fraction of the probe's greedy tokens equal to the timed call's (1.0: the probe
  computed the timed step's routing; below 1.0 the separately compiled step rounded differently at a near-tie).
* ``bytes``: what one step must read (and write), from the parameter and cache arrays the engine holds: every
  weight once, except the embedding table (``batch`` rows) and the routed experts (per MoE layer the
  ``experts_hit`` of that layer, mean over the steps); the KDA states read and written, the conv tails read and
  written, the MLA latents read up to ``prompt_len`` (+ the new row). ``bytes_uniform``: the same with the
  routed experts at ``uniform_expected`` per layer (what the rows before the count reported).
* ``copy_gbps``: device copy bandwidth measured in the same process (``x * 2`` on a 2 GiB f32 array: read +
  write bytes / best time); ``roofline_ms = bytes / copy_gbps`` and ``roofline_fraction = roofline_ms /
  ms_per_step``; ``roofline_ms_uniform`` / ``roofline_fraction_uniform`` from ``bytes_uniform``. When the count
  fails, ``experts_hit`` holds its ``error`` and ``bytes`` / ``roofline_*`` are null (never the uniform ones).
* ``--profile-dir``: also the device-trace breakdown (``benchmarks._profile``) of ``--profile-calls`` calls of
  the first case of each batch size in ``--profile-batches`` (default: the first case), first expert format:
  device busy time per step, host gap (wall − device), kernel launches and copies per step, the top ops, the
  time of the ops named like concatenations and sorts, and the device timeline (``device_timeline``: span and
  idle time per step, idle gaps over 20 µs, device-to-host copies).
* ``tokens``: the greedy tokens ``[n, B]`` of the first (warm-up) call, also as ``tokens_sha1`` and
  ``tokens_row0`` (row 0's ``n`` tokens): the same parameters, cache and inputs in two trees give the same tokens
  when their decode steps compute the same numbers.
  (XLA runs op by op while a profile is active: command buffers are off in the profiled calls.)
* ``--hlo-out FILE``: the first case's optimised HLO (``compiled.as_text()``) written to FILE.

Every row is greedy: the step is compiled as the engine compiles it for an all-greedy batch (``sampling=False``).

``--xla-flags`` is appended to ``XLA_FLAGS`` before JAX starts (compare XLA options in separate processes); pass it
as ``--xla-flags=--xla_...``: argparse reads a separate value that starts with ``--`` as an option.
``--layers kda,mla`` builds a config of those layers at the config's widths (e.g. the release's exact shapes
from ``configs/k3.json``: one KDA and one MLA layer, 896 experts top-16) instead of the config's own layers.

Parameters (:func:`init_params`): the model's own init of a copy of the config with ``num_experts`` cut to the
top-k (the release's 896-expert init would need hundreds of GB of temporaries), then the router and the routed
experts at full size filled with random values leaf by leaf (router ``normal(0.02)``, correction bias 0; bf16
experts random signs and mantissas in ``[2^-7, 2^-6)``; MXFP4 random codes, scales ``2^-5``).

Several processes may share the GPU (e.g. two trees, or two configs, compiling in parallel): with
``K3_BENCH_LOCK=FILE`` each holds that file lock for all its device work (copy bandwidth, init, warm-up,
timing, profile) and releases it only to compile, so no two processes time at once.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._lock import accelerator_lock  # noqa: E402


def overrides(items: list[str]) -> dict:
    """``["field=value", ...]`` -> config fields (ints and floats parsed, the rest strings)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set wants FIELD=VALUE, got {item!r}")
        for cast in (int, float):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3-slice.json")
    ap.add_argument("--cases", default="64:128,1:128",
                    help="comma list of batch:prompt_len[:steps per call] (default steps: --decode-block)")
    ap.add_argument("--experts", default="bf16", help="comma list of bf16 | mxfp4")
    ap.add_argument("--decode-block", type=int, default=1, help="decode steps per device call")
    ap.add_argument("--calls", type=int, default=8, help="timed calls per case")
    ap.add_argument("--gen", type=int, default=128, help="cache room beyond the prompt (max_len = prompt + gen)")
    ap.add_argument("--layers", default=None, help="comma list of kda | mla: a config of those layers instead")
    ap.add_argument("--vocab", type=int, default=None, help="override the vocabulary size (with --layers)")
    ap.add_argument("--profile-dir", default=None)
    ap.add_argument("--profile-calls", type=int, default=2)
    ap.add_argument("--profile-batches", default=None,
                    help="comma list of batch sizes whose first case is profiled (default: the first case)")
    ap.add_argument("--hlo-out", default=None, help="write the first case's optimised HLO text here")
    ap.add_argument("--xla-flags", default="", help="appended to XLA_FLAGS before JAX starts (--xla-flags=--xla_...)")
    ap.add_argument("--label", default="", help="free text copied into every line (e.g. the tree measured)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a config field for every case, e.g. --set kda_decode_implementation=mosaic_gpu (repeatable)")
    return ap.parse_args(argv)


def emit(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


def init_params(cfg, seed: int = 0, device_lock=contextlib.nullcontext):
    """Random parameters of ``K3ForCausalLM(cfg)`` without the full-size expert init (see the module doc).

    Every program is compiled first; only their runs hold ``device_lock()`` (the accelerator lock), so processes
    sharing the GPU do not wait for each other's init compiles."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from k3_jax.model import K3ForCausalLM

    key, tokens = jax.random.PRNGKey(seed), jnp.zeros((1, 1), jnp.int32)
    full = jax.eval_shape(lambda: nn.unbox(K3ForCausalLM(cfg).init(key, tokens)))
    small = cfg.replace(num_experts=cfg.num_experts_per_token)
    init_small = jax.jit(K3ForCausalLM(small).init).lower(key, tokens).compile()

    def fill(k, shape, dtype, name):
        if name == "e_score_correction_bias":
            return jnp.zeros(shape, dtype)
        if name == "weight_packed":
            return jax.random.bits(k, shape, jnp.uint8)
        if name == "weight_scale":
            return jnp.full(shape, 122, jnp.uint8)
        if name == "kernel":  # the router
            return (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
        bits = jax.random.bits(k, shape, jnp.uint16) & 0x807F | 0x3C00  # +-[2^-7, 2^-6) in bf16
        return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(dtype)

    small_leaves = jax.tree.leaves(jax.eval_shape(lambda: nn.unbox(K3ForCausalLM(small).init(key, tokens))))
    flat_full = jax.tree_util.tree_flatten_with_path(full)[0]
    fills, compiled = [], {}
    for i, ((path, want), have) in enumerate(zip(flat_full, small_leaves, strict=True)):
        if want.shape == have.shape:
            fills.append(None)
            continue
        sig = (tuple(want.shape), jnp.dtype(want.dtype), str(getattr(path[-1], "key", path[-1])))
        if sig not in compiled:
            one = functools.partial(fill, shape=sig[0], dtype=sig[1], name=sig[2])
            compiled[sig] = jax.jit(one).lower(key).compile()
        fills.append((compiled[sig], i))
    with device_lock():
        leaves, tree = jax.tree.flatten(nn.unbox(init_small(key, tokens)))
        out = []
        for have, f in zip(leaves, fills, strict=True):
            out.append(have if f is None else f[0](jax.random.fold_in(key, f[1])))
            del have
        return jax.block_until_ready(jax.tree.unflatten(tree, out))


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts hit by ``tokens`` tokens of uniform top-k routing."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def segment_layers(cfg, names: list[str]) -> list[int]:
    """Model layer index of each scan repeat of the stacked leaf at ``names`` (a parameter or ``intermediates``
    path through ``segment_S`` / ``layer_J``)."""
    from k3_jax.model import layer_plan

    seg = next((n for n in names if n.startswith("segment_")), None)
    pos = next((n for n in names if n.startswith("layer_")), None)
    if seg is None or pos is None:
        raise ValueError(f"segment_layers: path {'/'.join(names)} names no segment_S/layer_J")
    segment = layer_plan(cfg)[int(seg.removeprefix("segment_"))]
    return [segment.layer(r, int(pos.removeprefix("layer_"))) for r in range(segment.repeats)]


def expert_ids_by_layer(cfg, intermediates) -> dict[int, object]:
    """``{model layer: expert_ids [..., N, k] i32}`` of every MoE layer, from the collections a
    ``mutable=["intermediates"]`` apply returns (each segment's sown ``[R, N, k]`` stack split by repeat)."""
    import jax

    out = {}
    for path, ids in jax.tree_util.tree_flatten_with_path(intermediates)[0]:
        names = [str(getattr(p, "key", p)) for p in path]
        if "expert_ids" not in names:
            continue
        for r, layer in enumerate(segment_layers(cfg, names)):
            out[layer] = ids[r]
    return out


def distinct_experts(ids) -> int:
    """Number of distinct expert ids in ``ids`` (any shape; a host or device int array)."""
    import numpy as np

    return int(np.unique(np.asarray(ids)).size)


def step_bytes(cfg, params, cache, batch: int, prompt_len: int,
               experts_hit: dict[int, float] | None = None) -> dict[str, int]:
    """Bytes one decode step must move: weights read once (embedding rows, the routed experts hit), KDA states +
    conv tails read and written, MLA latents read up to ``prompt_len`` plus the new row written.

    ``experts_hit``: ``{model layer: distinct experts its router selects in the step}`` for every MoE layer (e.g.
    :func:`distinct_experts` of a step's ids, or a mean over steps); None: the expected count of uniform top-k
    routing of ``batch`` tokens (:func:`expected_distinct_experts`) in every MoE layer."""
    import jax

    weights = embed = experts = 0
    uniform = expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_token, batch)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(getattr(p, "key", p)) for p in path]
        n = x.size * x.dtype.itemsize
        if "embed_tokens" in names:
            embed += batch * n // cfg.vocab_size
        elif "experts" in names and "shared_experts" not in names:
            if experts_hit is None:
                experts += int(n * uniform / cfg.num_experts)
                continue
            layers = segment_layers(cfg, names)
            missing = [layer for layer in layers if layer not in experts_hit]
            if missing:
                raise ValueError(f"step_bytes: experts_hit has no count for MoE layer(s) {missing} "
                                 f"(of {'/'.join(names)}); it has layers {sorted(experts_hit)}")
            experts += int(sum(n / len(layers) * experts_hit[layer] / cfg.num_experts for layer in layers))
        else:
            weights += n
    kda_state = kda_conv = mla = 0
    for seg in cache["segments"]:
        for entry in seg.values():
            if "state" in entry:
                kda_state += 2 * entry["state"].size * entry["state"].dtype.itemsize
                kda_conv += 2 * entry["conv"].size * entry["conv"].dtype.itemsize
            else:
                lat = entry["latent"]  # [R, B, S, D]
                row = lat.shape[0] * lat.shape[1] * lat.shape[3] * lat.dtype.itemsize
                mla += row * (prompt_len + 1)
    total = weights + embed + experts + kda_state + kda_conv + mla
    return {"dense_weights": weights, "embed_rows": embed, "routed_experts": experts, "kda_state_rw": kda_state,
            "kda_conv_rw": kda_conv, "mla_latent": mla, "total": total}


def copy_bandwidth_gbps(nbytes: int = 2 << 30, rounds: int = 5, calls: int = 5) -> float:
    """Device copy bandwidth (read + write bytes / s) of ``x * 2`` on a ``nbytes`` f32 array, GB/s: the best of
    ``rounds`` rounds of ``calls`` back-to-back calls (the form of ``benchmarks/moe.py``'s HBM copy)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 2.0)
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            y = f(x)
        jax.block_until_ready(y)
        best = min(best, (time.perf_counter() - t0) / calls)
    return 2 * nbytes / best / 1e9


def layer_config(cfg, layers: list[str], vocab: int | None):
    """``cfg`` with its layer list replaced by ``layers`` (kda | mla), every width kept."""
    kda = [i for i, k in enumerate(layers) if k == "kda"]
    mla = [i for i, k in enumerate(layers) if k == "mla"]
    kw = {"num_hidden_layers": len(layers), "kda_layers": tuple(kda), "mla_layers": tuple(mla),
          "first_k_dense_replace": 0}
    if vocab is not None:
        kw["vocab_size"] = vocab
    return cfg.replace(**kw)


def profile_breakdown(fn, args_fn, calls: int, steps_per_call: int, out_dir: str) -> dict:
    """Device-trace breakdown of ``calls`` calls: busy ms, launches and copies per step, host gap, top ops."""
    import glob

    import jax

    from benchmarks._profile import device_timeline, summarize_trace

    os.makedirs(out_dir, exist_ok=True)
    jax.profiler.start_trace(out_dir, create_perfetto_trace=True)
    t0 = time.perf_counter()
    try:
        out = None
        for _ in range(calls):
            out = fn(*args_fn())
        jax.block_until_ready(out)
    finally:
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
    traces = sorted(glob.glob(os.path.join(out_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                    key=os.path.getmtime)
    if not traces:
        return {"error": f"no perfetto_trace.json.gz under {out_dir}"}
    steps = calls * steps_per_call
    s = summarize_trace(traces[-1], top=400, divide_by=steps)
    copies = [(n, ms, c) for n, ms, c in s["top"] if "copy" in n.lower() or "memcpy" in n.lower()]
    dus = [(n, ms, c) for n, ms, c in s["top"] if "dynamic" in n.lower() and "slice" in n.lower()]
    concat = [(n, ms, c) for n, ms, c in s["top"] if "concatenate" in n.lower()]
    sorts = [(n, ms, c) for n, ms, c in s["top"] if "sort" in n.lower()]
    wall_ms = 1000 * wall / steps
    return {
        "device_events": s["device_events"],
        "wall_ms_per_step_profiled": round(wall_ms, 3),
        "device_busy_ms_per_step": s["total_ms"],
        "host_gap_ms_per_step": round(wall_ms - s["total_ms"], 3),
        "events_per_step": s["n_events"],
        "copy_ms_per_step": round(sum(ms for _, ms, _ in copies), 4),
        "copies_per_step": sum(c for _, _, c in copies),
        "dynamic_slice_ms_per_step": round(sum(ms for _, ms, _ in dus), 4),
        "concatenate_ms_per_step": round(sum(ms for _, ms, _ in concat), 4),
        "concatenates_per_step": sum(c for _, _, c in concat),
        "sort_ms_per_step": round(sum(ms for _, ms, _ in sorts), 4),
        "sorts_per_step": sum(c for _, _, c in sorts),
        "timeline": device_timeline(traces[-1], divide_by=steps),
        "top": s["top"][:30],
    }


def routing_probe(eng, batch: int):
    """The engine's model step as a counter of its routing: a jitted ``probe(variables, cache, tokens [n, B])`` ->
    ``({model layer: expert_ids [n, B, k] i32}, greedy tokens [n, B] i32, cache after the n steps)``.

    Runs ``n`` one-token steps of ``eng``'s model on ``cache`` (donated) with every row active, as the engine's
    decode does (``apply_on_cache`` on its table and compute dtype, its XLA options), step ``i`` fed
    ``tokens[i]``, each with ``mutable=["intermediates"]`` (the ``expert_ids`` every MoE layer sows); the greedy
    tokens are each step's argmax. Fed a decode call's input tokens and that call's own greedy tokens (shifted by
    one step), from the cache the call received, it recomputes the call's routing. The engine's own decode
    function is left as it is."""
    import jax
    import jax.numpy as jnp

    from k3_jax.serving.engine import apply_on_cache

    active = jnp.ones((batch,), bool)

    def probe(variables, cache, tokens):
        def body(cache, toks):
            (logits, new), inter = apply_on_cache(eng.model, variables, toks[:, None], cache, eng._table,
                                                  eng.compute_dtype, active, mutable=["intermediates"])
            greedy = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            return new, (expert_ids_by_layer(eng.cfg, inter), greedy)

        cache, (ids, greedy) = jax.lax.scan(body, cache, tokens)
        return ids, greedy, cache  # the cache returned only so that the donated one is reused

    return jax.jit(probe, donate_argnums=(1,), compiler_options=eng.model_compiler_options)


def count_experts(cfg, probe, variables, cache, first_tokens, call_tokens) -> dict:
    """The ``experts_hit`` record (see the module doc) of one decode call of ``n`` steps: ``probe``
    (:func:`routing_probe`, compiled) run on ``cache`` (the cache the call received; donated) with the call's
    input tokens ``first_tokens [B]`` and its greedy tokens ``call_tokens [n, B]``."""
    import jax.numpy as jnp
    import numpy as np

    call_tokens = np.asarray(call_tokens, np.int32)
    n, batch = call_tokens.shape
    fed = jnp.concatenate([jnp.asarray(first_tokens, jnp.int32)[None], jnp.asarray(call_tokens[:-1])], axis=0)
    ids, greedy, _ = probe(variables, cache, fed)
    ids = {layer: np.asarray(v) for layer, v in sorted(ids.items())}
    per_step = {layer: [distinct_experts(v[i]) for i in range(n)] for layer, v in ids.items()}
    per_layer = {layer: float(np.mean(c)) for layer, c in per_step.items()}
    return {
        "per_layer": {str(k): v for k, v in per_layer.items()},
        "per_step": {str(k): v for k, v in per_step.items()},
        "mean": round(float(np.mean(list(per_layer.values()))), 3) if per_layer else None,
        "uniform_expected": round(expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_token, batch), 3),
        "num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_token, "tokens_per_step": batch,
        "greedy_agree": round(float(np.mean(np.asarray(greedy) == call_tokens)), 4),
    }


def run_case(cfg, params, batch: int, prompt_len: int, n: int, args: argparse.Namespace, gbps: float,
             first: bool, profile: bool = False) -> dict:
    """One ``batch:prompt_len`` case at ``n`` steps per call: set up and time under the device lock, compile
    without it; returns its JSON record."""
    import jax
    import jax.numpy as jnp

    max_len = prompt_len + args.gen
    with accelerator_lock():
        eng, state, inputs, nbytes = _prepare_case(cfg, params, batch, prompt_len, max_len, n)
    t0 = time.perf_counter()
    lowered = (eng._decode.lower(eng.variables, state["cache"], *inputs, 5, None, sampling=False) if n == 1 else
               eng._decode_multi.lower(eng.variables, state["cache"], *inputs, 5, None, n, sampling=False))
    compiled = lowered.compile()  # static arguments (top logprobs, steps per call) are baked in
    compile_s = time.perf_counter() - t0
    if args.hlo_out and first:
        Path(args.hlo_out).write_text(compiled.as_text())
    t0 = time.perf_counter()
    probe = routing_probe(eng, batch).lower(eng.variables, state["cache"],
                                            jax.ShapeDtypeStruct((n, batch), jnp.int32)).compile()
    probe_compile_s = time.perf_counter() - t0

    def call():
        out, state["cache"] = compiled(eng.variables, state["cache"], *inputs, None)
        return out

    def count(cache, call_tokens):
        rec = count_experts(cfg, probe, eng.variables, cache, inputs[0], call_tokens)
        return {**rec, "probe_compile_s": round(probe_compile_s, 1)}

    with accelerator_lock():
        return _time_case(cfg, args, state, call, count, eng.variables["params"], nbytes, batch, prompt_len,
                          max_len, n, gbps, compile_s, profile)


def _prepare_case(cfg, params, batch: int, prompt_len: int, max_len: int, n: int):
    """``(engine, {"cache": filled cache}, (tokens, active, sampling arrays), bytes per step at the uniform
    routing expectation)``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from k3_jax.serving.engine import Engine
    from k3_jax.serving.sampling import SamplingArrays

    eng = Engine(cfg, params, max_batch=batch, max_len=max_len, eos_ids=(), max_logprobs=5, decode_block=n)

    def fill(cache):  # random states, conv tails and latents (never time on zeros), every row at prompt_len
        leaves, tree = jax.tree.flatten(cache)
        keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
        leaves = [(0.05 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
                  if jnp.issubdtype(x.dtype, jnp.floating) else x for k, x in zip(keys, leaves, strict=True)]
        return {**jax.tree.unflatten(tree, leaves), "lengths": jnp.full((batch,), prompt_len, jnp.int32)}

    eng.cache = jax.block_until_ready(jax.jit(fill, donate_argnums=(0,))(eng.cache))
    nbytes = step_bytes(cfg, eng.variables["params"], eng.cache, batch, prompt_len)
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, cfg.vocab_size, batch), jnp.int32)
    active = jnp.ones((batch,), bool)
    samp = SamplingArrays(temperature=jnp.zeros(batch), top_k=jnp.zeros(batch, jnp.int32),
                          top_p=jnp.ones(batch), seed=jnp.zeros(batch, jnp.uint32),
                          step=jnp.zeros(batch, jnp.int32))
    return eng, {"cache": eng.cache}, (tokens, active, samp), nbytes


def _time_case(cfg, args, state, call, count, params, nbytes_uniform, batch, prompt_len, max_len, n, gbps,
               compile_s, profile):
    """Warm-up, timed calls, the routing count of the first timed call (``count(cache, tokens [n, B])``, after
    the timing, on a copy of the cache that call received) and (``profile``) the profile of one compiled case;
    returns its JSON record."""
    import hashlib

    import jax
    import jax.numpy as jnp
    import numpy as np

    first_out = jax.block_until_ready(call())
    toks = np.asarray(first_out.tokens, np.int32).reshape(n, batch)
    jax.block_until_ready(call())
    # lengths grow by n per call: keep every call at ~prompt_len by resetting them (a device scalar op)
    reset = jax.jit(lambda c: {**c, "lengths": jnp.full((batch,), prompt_len, jnp.int32)}, donate_argnums=(0,))
    state["cache"] = reset(state["cache"])
    received = jax.block_until_ready(jax.tree.map(jnp.copy, state["cache"]))  # for the count, after the timing
    first_timed = None
    t0 = time.perf_counter()
    for _ in range(args.calls):
        out = call()
        first_timed = out if first_timed is None else first_timed
    jax.block_until_ready(out)
    wall = time.perf_counter() - t0
    ms = 1000 * wall / (args.calls * n)
    timed_tokens = np.asarray(first_timed.tokens, np.int32).reshape(n, batch)
    del first_timed, out
    try:
        hit = count(received, timed_tokens)
        per_layer = {int(k): v for k, v in hit["per_layer"].items()}
        nbytes = step_bytes(cfg, params, state["cache"], batch, prompt_len, experts_hit=per_layer)
    except Exception as e:  # noqa: BLE001 - the timing stands; the must-read it needs is reported as unknown
        hit, nbytes = {"error": f"{type(e).__name__}: {str(e)[:400]}"}, None
    del received
    roof = lambda b: None if b is None else b["total"] / (gbps * 1e9) * 1000
    ratio = lambda r: None if r is None else round(r / ms, 3)
    rnd = lambda r: None if r is None else round(r, 3)
    roof_ms, roof_uniform_ms = roof(nbytes), roof(nbytes_uniform)
    rec = {
        "bench": "decode", "label": args.label, "config": args.config, "layers": args.layers, "set": args.set,
        "experts": cfg.expert_format, "batch": batch, "prompt_len": prompt_len, "max_len": max_len,
        "decode_block": n, "calls": args.calls, "ms_per_step": round(ms, 3),
        "tokens_per_s": round(batch * 1000 / ms, 1), "experts_hit": hit, "bytes": nbytes,
        "bytes_uniform": nbytes_uniform, "copy_gbps": round(gbps, 1),
        "roofline_ms": rnd(roof_ms), "roofline_fraction": ratio(roof_ms),
        "roofline_ms_uniform": rnd(roof_uniform_ms), "roofline_fraction_uniform": ratio(roof_uniform_ms),
        "compile_s": round(compile_s, 1), "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "tokens_sha1": hashlib.sha1(toks.tobytes()).hexdigest()[:16], "tokens_row0": toks[:, 0].tolist(),
        "tokens": toks.tolist(),
        "device": str(jax.devices()[0].device_kind),
    }
    if args.profile_dir and profile:
        state["cache"] = reset(state["cache"])
        where = os.path.join(args.profile_dir, f"b{batch}_p{prompt_len}_n{n}_{cfg.expert_format}")
        rec["profile"] = profile_breakdown(call, lambda: (), args.profile_calls, n, where)
    return rec


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
    import jax

    from k3_jax.config import load_config

    with accelerator_lock():
        gbps = copy_bandwidth_gbps()
    emit({"bench": "decode", "label": args.label, "copy_gbps": round(gbps, 1), "device": jax.devices()[0].device_kind})
    cases = [[int(v) for v in c.split(":")] for c in args.cases.split(",") if c]
    cases = [(c[0], c[1], c[2] if len(c) > 2 else args.decode_block) for c in cases]
    expert_list = args.experts.split(",")
    for experts in expert_list:
        cfg = load_config(args.config).replace(expert_format=experts, param_dtype="bfloat16", **overrides(args.set))
        if args.layers:
            cfg = layer_config(cfg, args.layers.split(","), args.vocab)
        t0 = time.perf_counter()
        params = init_params(cfg, device_lock=accelerator_lock)
        emit({"bench": "decode", "label": args.label, "event": "init", "experts": experts,
              "param_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)),
              "init_s": round(time.perf_counter() - t0, 1)})
        profiled: set[int] = set()
        for i, (batch, prompt_len, n) in enumerate(cases):
            try:
                first = i == 0 and experts == expert_list[0]
                wanted = [int(b) for b in args.profile_batches.split(",")] if args.profile_batches else [cases[0][0]]
                profile = experts == expert_list[0] and batch in wanted and batch not in profiled
                if profile:
                    profiled.add(batch)
                emit(run_case(cfg, params, batch, prompt_len, n, args, gbps, first, profile))
            except Exception as e:  # noqa: BLE001 - report the case and go on with the next
                emit({"bench": "decode", "label": args.label, "experts": experts, "batch": batch,
                      "prompt_len": prompt_len, "decode_block": n, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        del params


if __name__ == "__main__":
    main()
