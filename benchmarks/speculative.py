"""Speculative decoding: the engine with a draft against the same engine without one, same weights, same run.

    python benchmarks/speculative.py                                   # CPU smoke: micro target, random draft
    python benchmarks/speculative.py --target runs/ks --config configs/k3-small.json \
        --drafts lk=runs/ks-lk/draft,ce=runs/ks-ce/draft --batches 1,4,16 --ks 2,4,6 --new-tokens 128
    bash benchmarks/speculative_h200.sh   # issue 21's pipeline: train the target and an LK and a CE draft, then this

Prompts are held-out documents of the bundled corpus (``--prompt-len`` tokens each), so a target trained on it
is predictable. Per batch size the peer (``Engine``, no draft) and, for every ``k`` and draft, the
``SpeculativeEngine`` generate ``--new-tokens`` tokens per row from the same prompts.

Measured per case (one JSON line each, then a summary line):
  * ``decode_tokens_per_s``: tokens emitted by decode steps / wall time of those steps (the engine's
    ``_decode_step``: host work, the jitted call and the sync on its result; the prefill and its first token are
    left out), mean of ``--repeats`` greedy runs after a warm run; ``speedup`` = that over the peer's.
  * ``acceptance_length``: tokens emitted per row per round (1 + accepted drafts), greedy; with
    ``--sample-batches`` also at temperature 1 (``sampled_*``: the acceptance rule the LK loss targets).
  * ``step_ms`` / ``round_ms``: wall time per decode step / round in the engine; ``pipelined_ms``: per call of the
    same jitted step fed its own outputs ``--pipelined-calls`` times with one sync at the end (no host
    bookkeeping, launches overlap the device), so ``round_ms - pipelined_ms`` is the engine's per-call host cost.
  * ``greedy_equal`` / ``rows_equal`` / ``common_prefix``: the greedy outputs against the peer's.

``--wait-s S`` (the pipeline): the target and drafts may still be training when this starts. Every case is
first built and compiled (``--compile-threads`` at a time) on random weights of the same shapes (``--config``,
``DraftConfig.default_for``); once every draft directory exists (at most ``S`` seconds) the trained weights are
swapped in, each engine runs a short warm generate (it recompiles only if the trained trees differ from the
init: ``warm_s`` shows it) and the timed runs follow, with no compile running beside them.
``--deadline-s``: cases that would start after this many seconds are skipped (reported as skipped).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
T0 = time.perf_counter()


COMPILES = [0]  # XLA backend compiles so far (jax.monitoring), to show that no timed run compiled


def count_compiles(event: str, duration: float, **kwargs) -> None:
    if "backend_compile" in event:
        COMPILES[0] += 1


def emit(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


def elapsed() -> float:
    return time.perf_counter() - T0


def corpus_prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    """``batch`` held-out corpus documents cut to ``length`` tokens (ids folded into ``[3, vocab)`` when the
    vocabulary is smaller than the corpus's)."""
    from k3_jax.training.corpus import TOKENS_FILE, load_token_shard

    tokens, offsets = load_token_shard(TOKENS_FILE)
    out = []
    for d in range(0, len(offsets) - 1, 50):  # the eval split's documents (every 50th)
        doc = tokens[offsets[d]:offsets[d + 1]].astype(np.int64)
        if len(doc) >= length:
            ids = doc[:length] if vocab >= 1024 else 3 + doc[:length] % (vocab - 3)
            out.append([1] + ids[:length - 1].tolist())
        if len(out) == batch:
            return out
    raise SystemExit(f"the corpus has fewer than {batch} held-out documents of {length} tokens")


def timed_generate(engine, prompts, new_tokens: int, temperature: float = 0.0) -> tuple[list[list[int]], dict]:
    """Generate, timing the engine's decode steps; returns ``(outputs, {"tokens", "seconds", "steps"})``."""
    spent = [0.0]
    inner = engine._decode_step

    def decode_step():
        t = time.perf_counter()
        try:
            return inner()
        finally:
            spent[0] += time.perf_counter() - t

    engine._decode_step = decode_step
    n0, s0 = engine.stats["decode_tokens"], engine.stats["decode_steps"]
    try:
        outs = engine.generate(prompts, max_new_tokens=new_tokens, temperature=temperature, seed=7,
                               stop_token_ids=[])
    finally:
        del engine._decode_step  # the class's method again
    return outs, {"tokens": engine.stats["decode_tokens"] - n0, "seconds": spent[0],
                  "steps": engine.stats["decode_steps"] - s0}


def pipelined_ms(engine, prompts, new_tokens: int, calls: int) -> float:
    """Milliseconds per call of the engine's jitted decode step (or speculative round) over the prompts' rows,
    ``calls`` calls each fed the previous one's outputs, one sync at the end (one untimed call first)."""
    import jax
    import jax.numpy as jnp

    from k3_jax.serving.sampling import SamplingArrays
    from k3_jax.serving.speculative import SpeculativeEngine

    gen = engine.generate_stream(prompts, max_new_tokens=new_tokens, stop_token_ids=[])
    started: set[str] = set()
    for ev in gen:  # until every row has its first token and none is prefilling
        started.add(ev.request_id)
        if len(started) == len(prompts) and not any(r is not None and r.prefilling for r in engine._slots):
            break
    b = engine.max_batch
    active = jnp.asarray(np.asarray([r is not None and not r.prefilling for r in engine._slots]))
    samp = SamplingArrays(temperature=jnp.zeros((b,), jnp.float32), top_k=jnp.zeros((b,), jnp.int32),
                          top_p=jnp.ones((b,), jnp.float32), seed=jnp.zeros((b,), jnp.uint32),
                          step=jnp.zeros((b,), jnp.int32))
    last = jnp.asarray(engine._last_token)
    try:
        if isinstance(engine, SpeculativeEngine):
            rows = jnp.arange(b)
            drafts = jnp.asarray(engine._draft_len)
            state = (engine.cache, engine.dcache, engine._pend)

            def call(state, last):
                out, cache, dcache, pend = engine._round(engine.variables, engine.draft_variables, state[0],
                                                         state[1], last, state[2], active, drafts, samp,
                                                         engine.max_logprobs, False)
                return (cache, dcache, pend), out.tokens[rows, out.emitted - 1]
        else:
            state = engine.cache

            def call(state, last):
                out, cache = engine._decode(engine.variables, state, last, active, samp, engine.max_logprobs,
                                            engine._table)
                return cache, out.tokens

        for _ in range(2):  # the second call sees its own outputs' placement (the first, the engine's)
            state, last = call(state, last)
        jax.block_until_ready((state, last))
        t0 = time.perf_counter()
        for _ in range(calls):
            state, last = call(state, last)
        jax.block_until_ready((state, last))
        ms = (time.perf_counter() - t0) / calls * 1e3
    finally:
        if isinstance(engine, SpeculativeEngine):
            engine.cache, engine.dcache, engine._pend = state
        else:
            engine.cache = state
        gen.close()  # aborts the requests; their rows are reset when reused
    return ms


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tree_mismatch(trained, init) -> str | None:
    """``None`` when ``trained`` has ``init``'s tree, shapes and dtypes, else the first difference."""
    import jax

    ta, tb = jax.tree_util.tree_structure(trained), jax.tree_util.tree_structure(init)
    if ta != tb:
        return f"tree structure differs ({ta.num_leaves} vs {tb.num_leaves} leaves)"
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(trained)[0], jax.tree.leaves(init), strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{jax.tree_util.keystr(path)}: trained {x.shape} {x.dtype}, init {y.shape} {y.dtype}"
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="", help="target config (default: a micro CPU config)")
    p.add_argument("--target", default="", help="train.py workdir or converted orbax dir (default: random)")
    p.add_argument("--drafts", default="", help="name=DIR,... drafts from k3_jax.training.draft (default: random)")
    p.add_argument("--batches", default="1,2")
    p.add_argument("--ks", default="2,4")
    p.add_argument("--prompt-len", type=int, default=33, help="prompt tokens (chunk·n + 1: one draft-prefill shape)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="timed greedy runs per case")
    p.add_argument("--sample-batches", default="", help="batch sizes also measured at temperature 1")
    p.add_argument("--pipelined-calls", type=int, default=8)
    p.add_argument("--dtype", default="")
    p.add_argument("--wait-s", type=float, default=0.0, help="compile on random weights, wait for the trained ones")
    p.add_argument("--deadline-s", type=float, default=0.0, help="skip cases that would start after this (0: none)")
    p.add_argument("--compile-threads", type=int, default=1)
    p.add_argument("--compile-cache", default="", help="persistent XLA cache dir shared by identical programs")
    args = p.parse_args()

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    jax.monitoring.register_event_duration_secs_listener(count_compiles)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    from k3_jax.config import load_config
    from k3_jax.draft import DraftConfig, DraftModel, target_head
    from k3_jax.model import K3ForCausalLM
    from k3_jax.serving.engine import Engine
    from k3_jax.serving.speculative import SpeculativeEngine, load_draft
    from k3_jax.training.draft import DraftTrainConfig, load_target

    def random_target(cfg):
        v = jax.jit(K3ForCausalLM(cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
        return nn.unbox(v)["params"]

    if args.config or args.target:
        dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "")
        cfg = load_config(args.config or "configs/k3-tiny.json", **({"dtype": dtype} if dtype else {}))
    else:  # micro CPU smoke target
        cfg = load_config(REPO / "configs" / "k3-tiny.json", dtype="float32", num_hidden_layers=3,
                          kda_layers=(0, 1), mla_layers=(2,), hidden_size=64, intermediate_size=128,
                          num_attention_heads=2, kda_num_heads=2, kda_head_dim=16, num_experts=4,
                          num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
                          routed_expert_hidden_size=32, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                          qk_rope_head_dim=8, v_head_dim=16)
    draft_dirs = dict(item.partition("=")[::2] for item in filter(None, args.drafts.split(",")))
    dcfg = DraftConfig.default_for(cfg)

    def random_draft(params, seed: int):
        emb, head = target_head(cfg, params)
        nf = cfg.hidden_size * len(dcfg.feature_layers)
        v = jax.jit(DraftModel(cfg, dcfg).init)(jax.random.PRNGKey(seed), jnp.zeros((1, 2, nf), cfg.dtype),
                                                jnp.zeros((1, 2), jnp.int32), emb, head)
        return nn.unbox(v)["params"]

    def uncommitted(tree):
        """Leaves placed like a jit's outputs from uncommitted inputs: restored (committed) arrays would make
        every program compiled on the random weights compile again (jit keys on committed placement)."""
        return jax.tree.map(lambda x: jax.device_put(np.asarray(x)), tree)

    waiting = bool(args.wait_s) and bool(args.target or draft_dirs)
    params = uncommitted(random_target(cfg))
    drafts = {name: (dcfg, uncommitted(random_draft(params, i + 1)))
              for i, name in enumerate(draft_dirs or ["random"])}
    if args.target and not waiting:
        params = uncommitted(load_target(DraftTrainConfig(target=args.target, config=args.config,
                                                          dtype=cfg.dtype))[1])
    if draft_dirs and not waiting:
        drafts = {name: (dc, uncommitted(dp)) for name, (dc, dp) in
                  ((name, load_draft(path, cfg)) for name, path in draft_dirs.items())}

    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    sample_batches = {int(b) for b in filter(None, args.sample_batches.split(","))}
    max_len = args.prompt_len + args.new_tokens + 1
    chunk = 1 << max(0, min(64, args.prompt_len).bit_length() - 1)
    prompts = {b: corpus_prompts(b, args.prompt_len, cfg.vocab_size) for b in batches}
    # every speculative engine of a batch size has the same target cache length (max_len + max k), so its
    # prefill is one program for all k (shared through --compile-cache)
    kmax = max(ks)
    cases = [(b, k) for b in batches for k in [0, *ks]]  # k = 0: the peer
    engines: dict[tuple[int, int], object] = {}
    warm_tokens = 4

    def build(case):
        b, k = case
        dc0, dp0 = next(iter(drafts.values()))
        if k == 0:
            e = Engine(cfg, params, max_batch=b, max_len=max_len + kmax, prefill_chunk=chunk)
        else:
            e = SpeculativeEngine(cfg, params, dp0, dc0, num_draft_tokens=k, max_batch=b,
                                  max_len=max_len + kmax - k, prefill_chunk=chunk)
        t = time.perf_counter()
        e.generate(prompts[b], max_new_tokens=warm_tokens, stop_token_ids=[])
        if b in sample_batches:
            e.generate(prompts[b], max_new_tokens=warm_tokens, temperature=1.0, stop_token_ids=[])
        engines[case] = e
        return time.perf_counter() - t

    def draft_ready() -> bool:
        return all((Path(d) / "params").is_dir() and (Path(d) / "draft_config.json").is_file()
                   for d in draft_dirs.values())

    if waiting:  # compile on random weights while the models train
        with concurrent.futures.ThreadPoolExecutor(max(1, args.compile_threads)) as pool:
            futs = {pool.submit(build, c): c for c in cases}
            while not all(f.done() for f in futs) and not draft_ready() and elapsed() < args.wait_s:
                time.sleep(1.0)
            for f in futs:
                f.cancel()  # not started yet: built after the swap, one at a time
        for f, c in futs.items():
            if f.done() and not f.cancelled():
                if f.exception() is not None:  # built again (one at a time) when its turn comes
                    traceback.print_exception(f.exception())
                    emit({"case": list(c), "error": f"build: {type(f.exception()).__name__}: {f.exception()}"[:2000]})
                else:
                    emit({"compiled": list(c), "compile_s": round(f.result(), 1), "at_s": round(elapsed(), 1)})
        while not draft_ready() and elapsed() < args.wait_s:
            time.sleep(1.0)
        if not draft_ready():
            raise SystemExit(f"drafts {draft_dirs} not ready after {args.wait_s:.0f} s")
        trained = load_target(DraftTrainConfig(target=args.target, config=args.config, dtype=cfg.dtype))
        diff = [f.name for f in dataclasses.fields(cfg) if getattr(trained[0], f.name) != getattr(cfg, f.name)]
        if diff:
            emit({"note": f"the target checkpoint's config differs from --config in {diff}; the engines use --config"})
        for what, new, old in [("target", trained[1], params)]:
            bad = tree_mismatch(new, old)
            if bad:
                emit({"note": f"{what} params differ from the init ({bad}): the warm runs recompile"})
        params = uncommitted(trained[1])
        drafts_new = {name: load_draft(path, cfg) for name, path in draft_dirs.items()}
        for name, (dc, dp) in drafts_new.items():
            bad = tree_mismatch(dp, drafts[name][1]) if dc == dcfg else f"draft config {dc} != {dcfg}"
            if bad:
                emit({"note": f"draft {name} differs from the init ({bad}): the warm runs recompile"})
        drafts = {name: (dc, uncommitted(dp)) for name, (dc, dp) in drafts_new.items()}
        emit({"weights_ready_at_s": round(elapsed(), 1)})

    rows, peers = [], {}

    def measure(case):
        b, k = case
        if case not in engines:
            emit({"compiled": list(case), "compile_s": round(build(case), 1), "at_s": round(elapsed(), 1)})
        e = engines.pop(case)
        e.variables = {"params": params}
        names = ["peer"] if k == 0 else list(drafts)
        for name in names:
            if k:
                if e.dcfg != drafts[name][0]:
                    raise ValueError(f"draft {name}: config {drafts[name][0]} differs from the engine's {e.dcfg}")
                e.draft_variables = {"params": drafts[name][1]}
            t, c0 = time.perf_counter(), COMPILES[0]
            e.generate(prompts[b], max_new_tokens=warm_tokens, stop_token_ids=[])
            warm_s, warm_compiles, c0 = time.perf_counter() - t, COMPILES[0] - c0, COMPILES[0]
            runs, outs = [], None
            for _ in range(args.repeats):
                if k:
                    e.spec = type(e.spec)()
                outs, m = timed_generate(e, prompts[b], args.new_tokens)
                runs.append(m["tokens"] / m["seconds"])
            row = {"side": "peer" if k == 0 else "speculative", "batch": b, "k": k,
                   "decode_tokens_per_s": round(float(np.mean(runs)), 2), "runs": [round(r, 2) for r in runs],
                   ("step_ms" if k == 0 else "round_ms"): round(m["seconds"] / m["steps"] * 1e3, 3),
                   "warm_s": round(warm_s, 2), "warm_compiles": warm_compiles}
            if k:
                st = e.spec
                peer = peers[b]
                row.update({"draft": name, "mixer": e.dcfg.mixer,
                            "peer_decode_tokens_per_s": peer["decode_tokens_per_s"],
                            "speedup": round(row["decode_tokens_per_s"] / peer["decode_tokens_per_s"], 3),
                            "acceptance_length": round(st.acceptance_length, 3),
                            "acceptance_rate": round(st.acceptance_rate, 3),
                            "accepted_hist": dict(sorted(st.accepted_hist.items())),
                            "greedy_equal": outs == peer["outs"],
                            "rows_equal": sum(a == c for a, c in zip(outs, peer["outs"], strict=True)),
                            "common_prefix": round(float(np.mean([common_prefix(a, c) for a, c in
                                                                  zip(outs, peer["outs"], strict=True)])), 1)})
            if b in sample_batches:
                if k:
                    e.spec = type(e.spec)()
                _, m = timed_generate(e, prompts[b], args.new_tokens, temperature=1.0)
                row["sampled_decode_tokens_per_s"] = round(m["tokens"] / m["seconds"], 2)
                if k:
                    row["sampled_acceptance_length"] = round(e.spec.acceptance_length, 3)
                    row["sampled_speedup"] = round(row["sampled_decode_tokens_per_s"]
                                                   / peers[b]["sampled_decode_tokens_per_s"], 3)
            row["pipelined_ms"] = round(pipelined_ms(e, prompts[b], args.new_tokens, args.pipelined_calls), 3)
            row["timed_compiles"] = COMPILES[0] - c0  # compiles during the timed runs (0: clean timings)
            if k == 0:
                peers[b] = {**row, "outs": outs}
            emit(row)
            rows.append(row)

    last_case_s = 0.0
    for case in cases:
        b, k = case
        if k and b not in peers:  # the peer of this batch size failed or was skipped: nothing to compare with
            emit({"skipped": list(case), "reason": f"no peer row for batch {b}"})
            continue
        if args.deadline_s and elapsed() + last_case_s > args.deadline_s:
            emit({"skipped": list(case), "reason": f"--deadline-s {args.deadline_s:g}", "at_s": round(elapsed(), 1)})
            continue
        t_case = time.perf_counter()
        try:
            measure(case)
        except Exception as ex:  # noqa: BLE001 - one failed case is reported; the others still run
            traceback.print_exc()
            emit({"case": list(case), "error": f"{type(ex).__name__}: {ex}"[:2000]})
        engines.pop(case, None)
        last_case_s = time.perf_counter() - t_case

    spec_rows = [r for r in rows if r["side"] == "speculative"]
    by = {(r["draft"], r["batch"], r["k"]): r for r in spec_rows}
    lk_vs_ce = [{"batch": b, "k": k, "lk": by[("lk", b, k)]["acceptance_length"],
                 "ce": by[("ce", b, k)]["acceptance_length"],
                 "lk_sampled": by[("lk", b, k)].get("sampled_acceptance_length"),
                 "ce_sampled": by[("ce", b, k)].get("sampled_acceptance_length")}
                for (d, b, k) in by if d == "lk" and ("ce", b, k) in by]
    best1 = max((r for r in spec_rows if r["batch"] == 1), key=lambda r: r["speedup"], default=None)
    emit({"summary": True, "device": str(jax.devices()[0].device_kind), "target": args.target or "random",
          "config": args.config or "micro", "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
          "best_batch1": None if best1 is None else {x: best1[x] for x in ("draft", "k", "speedup",
                                                                           "acceptance_length")},
          "lk_vs_ce": lk_vs_ce, "all_greedy_equal": all(r["greedy_equal"] for r in spec_rows),
          "wall_s": round(elapsed(), 1)})


if __name__ == "__main__":
    main()
