"""Speculative decoding: the engine with a draft against the same engine without one, same weights, same run.

    python benchmarks/speculative.py                                   # CPU smoke: micro target, random draft
    python benchmarks/speculative.py --target runs/ks --config configs/k3-small.json \
        --drafts lk=runs/ks-lk/draft,ce=runs/ks-ce/draft --cases 1:4,1:6,4:4,16:6 --block 8 --new-tokens 128
    bash benchmarks/speculative_h200.sh   # issue 21's pipeline: train the target and an LK and a CE draft, then this

Prompts are held-out documents of the bundled corpus (``--prompt-len`` tokens each), so a target trained on it
is predictable. Cases are ``batch:k`` pairs (``--cases``, or every ``--batches`` x ``--ks``), measured in that
order; per batch size the peer (``Engine``, no draft) and, for every case and draft, the ``SpeculativeEngine``
generate ``--new-tokens`` tokens per row from the same prompts (a batch-1 engine serves ``--batch1-prompts`` of
them one after another, so its figures rest on more than one document).

Measured per case (one JSON line each, then a summary line):
  * ``decode_tokens_per_s``: tokens emitted by decode calls / wall time of those calls (the engine's
    ``_decode_step``: host work, the jitted call and the sync on its result; the prefill and its first token are
    left out), mean of ``--repeats`` greedy runs after a warm run, with one step (peer) or round (speculative)
    per device call; ``block_tokens_per_s`` (batches in ``--block-batches``): the same with ``--block`` steps or
    rounds per call (``decode_block``: the host syncs once per block). ``speedup_vs_step`` / ``speedup_vs_block``
    = a speculative figure over the peer's with one step / ``--block`` steps per call, and ``speedup_vs_best``
    = the speculative engine's best figure over the peer's best.
  * ``acceptance_length``: tokens emitted per row per round (1 + accepted drafts), greedy; for ``--sample-cases``
    also at ``--sample-temperature`` (default 1; ``sampled_*``: the acceptance rule the LK loss targets), one round
    per call.
  * ``step_ms`` / ``round_ms`` (and ``block_*``): wall time per decode step / round in the engine; ``pipelined_ms``:
    per call of the one-step/one-round jitted function fed its own outputs ``--pipelined-calls`` times with one
    sync at the end (no host bookkeeping, launches overlap the device).
  * ``distinct_tokens`` / ``head_tokens``: distinct ids over the greedy outputs, the first 12 of row 0; the peer's
    ``nonfinite_margins``: generated positions whose top-2 log-probabilities are not finite (a broken forward).
  * ``rows_equal`` / ``common_prefix``: the greedy outputs against the peer's (one step per call);
    ``diverge_margins``: for each row that differs, the peer's top-1 minus top-2 log-probability at the first
    differing position (a near-tie there means a rounding difference flipped the argmax). The summary's
    ``peer_batch_invariance`` compares the peer's own greedy outputs for the prompts that two batch sizes share,
    and ``peer_block_equal`` the peer's outputs with one step and with ``--block`` steps per call.

``--wait-s S`` (the pipeline): the target and drafts may still be training when this starts. Every case is
first built and compiled (``--compile-threads`` at a time) on random weights of the same shapes (``--config``,
``DraftConfig.default_for``); once every draft directory exists (at most ``S`` seconds) the trained weights are
swapped in, each engine runs short warm generates (they recompile only if the trained trees differ from the
init: ``warm_compiles`` shows it) and the timed runs follow, with no compile running beside them.
``--deadline-s``: cases that would start after this many seconds are skipped (reported as skipped).
``--page-size N``: every engine (peer and speculative) runs on the paged latent cache with pages of ``N`` tokens.
``--profile``: at the end, the device-op breakdown (``benchmarks/_profile.py``) of the batch-1 peer step and of
the batch-1 round of the first case's ``k`` (``--profile-dir`` keeps the traces).
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


def device_loop(engine, prompts, new_tokens: int):
    """``(call, finish)``: ``call()`` runs the engine's one-step decode (or one-round speculative) jitted function
    over the prompts' rows, fed its previous outputs, without syncing; ``finish()`` gives the engine its state
    back and aborts the requests (their rows are reset when reused)."""
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
    spec = isinstance(engine, SpeculativeEngine)
    box = [(engine.cache, engine.dcache, engine._pend) if spec else engine.cache, jnp.asarray(engine._last_token)]
    drafts = jnp.asarray(engine._draft_len) if spec else None
    last_of = jax.jit(lambda tokens, emitted: tokens[jnp.arange(b), emitted - 1])  # each row's last emitted token

    def call():
        state, last = box
        if spec:
            out, cache, dcache, pend = engine._round(engine.variables, engine.draft_variables, state[0], state[1],
                                                     last, state[2], active, drafts, samp, engine.max_logprobs, False,
                                                     engine._table)
            box[:] = [(cache, dcache, pend), last_of(out.tokens, out.emitted)]
        else:
            out, cache = engine._decode(engine.variables, state, last, active, samp, engine.max_logprobs,
                                        engine._table, sampling=False)  # greedy, as the timed runs
            box[:] = [cache, out.tokens]
        return box

    def finish():
        if spec:
            engine.cache, engine.dcache, engine._pend = box[0]
        else:
            engine.cache = box[0]
        gen.close()

    return call, finish


def pipelined_ms(engine, prompts, new_tokens: int, calls: int) -> float:
    """Milliseconds per call of :func:`device_loop`'s ``call`` over ``calls`` calls with one sync at the end (two
    untimed calls first: the second sees its own outputs' placement)."""
    import jax

    call, finish = device_loop(engine, prompts, new_tokens)
    try:
        for _ in range(2):
            jax.block_until_ready(call())
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        jax.block_until_ready(call())
        return (time.perf_counter() - t0) / (calls + 1) * 1e3
    finally:
        finish()


def peer_margins(engine, prompts, new_tokens: int) -> list[list[float]]:
    """Per row, per generated token of a greedy run: the top-1 minus top-2 log-probability of the model."""
    margins: list[list[float]] = [[] for _ in prompts]
    for ev in engine.generate_stream(prompts, max_new_tokens=new_tokens, stop_token_ids=[], logprobs=2):
        top = ev.top_logprobs or []
        margins[int(ev.request_id.split("-")[1])].append(top[0][1] - top[1][1] if len(top) > 1 else float("nan"))
    return margins


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
    p.add_argument("--cases", default="", help="batch:k,... measured in this order (default: --batches x --ks)")
    p.add_argument("--block", type=int, default=4, help="steps / rounds per device call of the block variants")
    p.add_argument("--block-batches", default="1", help="batch sizes also measured with --block per call")
    p.add_argument("--prompt-len", type=int, default=33, help="prompt tokens (chunk·n + 1: one draft-prefill shape)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--batch1-prompts", type=int, default=1,
                   help="prompts a batch-1 case generates for, one after another through its one slot")
    p.add_argument("--repeats", type=int, default=2, help="timed greedy runs per case")
    p.add_argument("--sample-cases", default="", help="batch:k,... also measured at --sample-temperature")
    p.add_argument("--sample-temperature", type=float, default=1.0,
                   help="the sampling temperature of the --sample-cases runs (> 0)")
    p.add_argument("--pipelined-calls", type=int, default=8)
    p.add_argument("--dtype", default="")
    p.add_argument("--kda-implementation", default="",
                   help="the engines' K3Config.kda_implementation: the chunked form of prefill "
                        "(default: the config's, auto)")
    p.add_argument("--kda-decode-implementation", default="",
                   help="the engines' K3Config.kda_decode_implementation: the one-token step (default: the config's)")
    p.add_argument("--kda-verify-implementation", default="",
                   help="the engines' K3Config.kda_verify_implementation: the speculative verify pass's KDA over "
                        "the k + 1 tokens (default: the config's)")
    p.add_argument("--moe-implementation", default="",
                   help="the engines' K3Config.moe_implementation (default: the config's, auto)")
    p.add_argument("--head-vocab", type=int, default=0,
                   help="drafts with a pruned head over this many ids (DraftConfig.head_vocab; 0 = the full head)")
    p.add_argument("--pruned-drafts", default="",
                   help="name=DIR,... more drafts, with a head of --pruned-head-vocab ids, measured at --pruned-cases "
                        "beside the --drafts (default with --pruned-head-vocab: one random draft)")
    p.add_argument("--pruned-head-vocab", type=int, default=0, help="the --pruned-drafts' head_vocab")
    p.add_argument("--pruned-cases", default="", help="batch:k,... of --cases where the pruned drafts run too")
    p.add_argument("--page-size", type=int, default=0,
                   help="run the peer and the speculative engines on the paged latent cache with pages of this many "
                        "tokens (0: the contiguous cache)")
    p.add_argument("--wait-s", type=float, default=0.0, help="compile on random weights, wait for the trained ones")
    p.add_argument("--deadline-s", type=float, default=0.0, help="skip cases that would start after this (0: none)")
    p.add_argument("--compile-threads", type=int, default=1)
    p.add_argument("--compile-cache", default="", help="persistent XLA cache dir shared by identical programs")
    p.add_argument("--profile", action="store_true", help="device-op breakdown of the batch-1 step and round")
    p.add_argument("--profile-dir", default="/tmp/spec_profile")
    args = p.parse_args()
    if not args.sample_temperature > 0:
        p.error(f"--sample-temperature must be > 0 (the plain cases are greedy), got {args.sample_temperature}")

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    jax.monitoring.register_event_duration_secs_listener(count_compiles)
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

    from k3_jax.config import load_config
    from k3_jax.draft import DraftConfig, DraftModel, head_variables, load_vocab_map, target_head
    from k3_jax.model import K3ForCausalLM
    from k3_jax.serving.engine import Engine
    from k3_jax.serving.speculative import SpeculativeEngine, load_draft
    from k3_jax.training.draft import DraftTrainConfig, load_target

    def random_target(cfg):
        v = jax.jit(K3ForCausalLM(cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
        return nn.unbox(v)["params"]

    overrides = {f"{op}_implementation": name for op, name in (
        ("kda", args.kda_implementation), ("kda_decode", args.kda_decode_implementation),
        ("kda_verify", args.kda_verify_implementation), ("moe", args.moe_implementation)) if name}
    if args.config or args.target:
        dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "")
        cfg = load_config(args.config or "configs/k3-tiny.json", **({"dtype": dtype} if dtype else {}), **overrides)
    else:  # micro CPU smoke target
        cfg = load_config(REPO / "configs" / "k3-tiny.json", dtype="float32", num_hidden_layers=3,
                          kda_layers=(0, 1), mla_layers=(2,), hidden_size=64, intermediate_size=128,
                          num_attention_heads=2, kda_num_heads=2, kda_head_dim=16, num_experts=4,
                          num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
                          routed_expert_hidden_size=32, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                          qk_rope_head_dim=8, v_head_dim=16, **overrides)

    def named_dirs(text: str) -> dict[str, str]:
        return dict(item.partition("=")[::2] for item in filter(None, text.split(",")))

    draft_dirs, pruned_dirs = named_dirs(args.drafts), named_dirs(args.pruned_drafts)
    if (pruned_dirs or args.pruned_cases) and not args.pruned_head_vocab:
        raise SystemExit("--pruned-drafts / --pruned-cases need --pruned-head-vocab N")
    if args.pruned_head_vocab and args.pruned_head_vocab == args.head_vocab:
        raise SystemExit(f"--pruned-head-vocab {args.pruned_head_vocab} equals --head-vocab: nothing to compare")
    both = sorted(set(draft_dirs) & set(pruned_dirs))
    if both:
        raise SystemExit(f"draft names in both --drafts and --pruned-drafts: {both}")
    # each draft's head_vocab (0: full); an engine serves the drafts of one head_vocab (its programs' shapes)
    head_of = {name: args.head_vocab for name in draft_dirs or ["random"]}
    if args.pruned_head_vocab:
        head_of |= {name: args.pruned_head_vocab for name in pruned_dirs or [f"random_p{args.pruned_head_vocab}"]}
    all_dirs = {**draft_dirs, **pruned_dirs}
    dcfgs = {hv: dataclasses.replace(DraftConfig.default_for(cfg), head_vocab=hv or None).validate(cfg)
             for hv in dict.fromkeys(head_of.values())}
    # a pruned draft's map: a placeholder until its directory is loaded (the programs depend on its shape only)
    maps = {name: None if not hv else np.arange(hv, dtype=np.int32) for name, hv in head_of.items()}

    def random_draft(params, seed: int, dcfg: DraftConfig):
        emb, head = target_head(cfg, params)
        nf = cfg.hidden_size * len(dcfg.feature_layers)
        v = jax.jit(DraftModel(cfg, dcfg).init)(jax.random.PRNGKey(seed), jnp.zeros((1, 2, nf), cfg.dtype),
                                                jnp.zeros((1, 2), jnp.int32), emb, head)
        return nn.unbox(v)["params"]

    def uncommitted(tree):
        """Leaves placed like a jit's outputs from uncommitted inputs: restored (committed) arrays would make
        every program compiled on the random weights compile again (jit keys on committed placement)."""
        return jax.tree.map(lambda x: jax.device_put(np.asarray(x)), tree)

    waiting = bool(args.wait_s) and bool(args.target or all_dirs)
    params = uncommitted(random_target(cfg))
    drafts = {name: (dcfgs[hv], uncommitted(random_draft(params, i + 1, dcfgs[hv])))
              for i, (name, hv) in enumerate(head_of.items())}
    if args.target and not waiting:
        params = uncommitted(load_target(DraftTrainConfig(target=args.target, config=args.config,
                                                          dtype=cfg.dtype))[1])
    if all_dirs and not waiting:
        drafts = {name: (dc, uncommitted(dp)) for name, (dc, dp) in
                  ((name, load_draft(path, cfg)) for name, path in all_dirs.items())}
        maps = {name: load_vocab_map(all_dirs[name], dc, cfg.vocab_size) for name, (dc, _) in drafts.items()}
        for name, (dc, _) in drafts.items():
            if dc != dcfgs[head_of[name]]:
                raise SystemExit(f"draft {name}: config {dc} differs from the benchmark's {dcfgs[head_of[name]]}")

    def draft_variables(name: str) -> dict:
        """The engine's draft variables of draft ``name`` (its params; a pruned head's map and gathered head)."""
        return {"params": drafts[name][1],
                **uncommitted(head_variables(cfg, drafts[name][0], params, maps[name]))}

    def pairs(text: str) -> list[tuple[int, int]]:
        return [(int(b), int(k)) for b, k in (c.split(":") for c in filter(None, text.split(",")))]

    spec_cases = pairs(args.cases) or [(int(b), int(k)) for b in args.batches.split(",") for k in args.ks.split(",")]
    batches = list(dict.fromkeys(b for b, _ in spec_cases))
    block_batches = {int(b) for b in filter(None, args.block_batches.split(","))}
    sample_cases = set(pairs(args.sample_cases))
    sample_batches = {b for b, _ in sample_cases}
    max_len = args.prompt_len + args.new_tokens + 1
    chunk = 1 << max(0, min(64, args.prompt_len).bit_length() - 1)
    prompts = {b: corpus_prompts(b if b > 1 else max(1, args.batch1_prompts), args.prompt_len, cfg.vocab_size)
               for b in batches}  # a batch-1 engine serves its prompts one after another
    # every engine of a batch size has the same target cache length (max_len + max k), so its prefill is one
    # program for all k (shared through --compile-cache)
    kmax = max(k for _, k in spec_cases)
    pruned_cases = pairs(args.pruned_cases)
    if not set(pruned_cases) <= set(spec_cases):
        raise SystemExit(f"--pruned-cases {sorted(set(pruned_cases) - set(spec_cases))} are not in --cases")
    # a case is (batch, k, head_vocab of its drafts): the peer of a batch size first (k = 0), then its speculative
    # cases in --cases order; the pruned drafts' cases last
    cases: list[tuple[int, int, int]] = []
    for b, k in spec_cases:
        if (b, 0, 0) not in cases:
            cases.append((b, 0, 0))
        cases.append((b, k, args.head_vocab))
    cases += [(b, k, args.pruned_head_vocab) for b, k in pruned_cases]
    engines: dict[tuple[int, int, int], object] = {}
    keep: dict[tuple[int, int, int], object] = {}  # batch-1 engines kept for --profile
    warm_tokens = 4

    def warm(e, case) -> None:
        """Run every program a case's timed runs use once (one step/round per call, a block, sampling)."""
        b, k, _ = case
        e.decode_block = 1
        e.generate(prompts[b][:b], max_new_tokens=warm_tokens, stop_token_ids=[])
        if b in block_batches:
            e.decode_block = args.block
            e.generate(prompts[b][:b], max_new_tokens=args.block + 2, stop_token_ids=[])
            e.decode_block = 1
        if (b, k) in sample_cases or (k == 0 and b in sample_batches):
            e.generate(prompts[b][:b], max_new_tokens=warm_tokens, temperature=args.sample_temperature,
                       stop_token_ids=[])

    def names_of(head_vocab: int) -> list[str]:
        return [name for name in drafts if head_of[name] == head_vocab]

    def build(case):
        b, k, hv = case
        paged = dict(paged=True, page_size=args.page_size) if args.page_size else {}
        if k == 0:
            e = Engine(cfg, params, max_batch=b, max_len=max_len + kmax, prefill_chunk=chunk, **paged)
        else:
            first = names_of(hv)[0]
            dc0, dp0 = drafts[first]
            e = SpeculativeEngine(cfg, params, dp0, dc0, num_draft_tokens=k, max_batch=b,
                                  max_len=max_len + kmax - k, prefill_chunk=chunk,
                                  vocab_map=maps[first], **paged)
        t = time.perf_counter()
        warm(e, case)
        engines[case] = e
        return time.perf_counter() - t

    def draft_ready() -> bool:
        return all((Path(d) / "params").is_dir() and (Path(d) / "draft_config.json").is_file()
                   for d in all_dirs.values())

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
            raise SystemExit(f"drafts {all_dirs} not ready after {args.wait_s:.0f} s")
        trained = load_target(DraftTrainConfig(target=args.target, config=args.config, dtype=cfg.dtype))
        diff = [f.name for f in dataclasses.fields(cfg) if getattr(trained[0], f.name) != getattr(cfg, f.name)]
        if diff:
            emit({"note": f"the target checkpoint's config differs from --config in {diff}; the engines use --config"})
        for what, new, old in [("target", trained[1], params)]:
            bad = tree_mismatch(new, old)
            if bad:
                emit({"note": f"{what} params differ from the init ({bad}): the warm runs recompile"})
        params = uncommitted(trained[1])
        drafts_new = {name: load_draft(path, cfg) for name, path in all_dirs.items()}
        for name, (dc, dp) in drafts_new.items():
            want = dcfgs[head_of[name]]
            bad = tree_mismatch(dp, drafts[name][1]) if dc == want else f"draft config {dc} != {want}"
            if bad:
                emit({"note": f"draft {name} differs from the init ({bad}): the warm runs recompile"})
        drafts = {name: (dc, uncommitted(dp)) for name, (dc, dp) in drafts_new.items()}
        maps = {name: load_vocab_map(all_dirs[name], dc, cfg.vocab_size) for name, (dc, _) in drafts.items()}
        emit({"weights_ready_at_s": round(elapsed(), 1)})

    rows, peers = [], {}

    def timed(e, b, block: int, temperature: float = 0.0):
        """``(outputs, tokens/s of each run, ms per call, SpecStats of the last run)`` of ``--repeats`` runs."""
        e.decode_block = block
        runs, outs, m = [], None, None
        try:
            for _ in range(args.repeats if temperature == 0 else 1):
                if hasattr(e, "spec"):
                    e.spec = type(e.spec)()
                outs, m = timed_generate(e, prompts[b], args.new_tokens, temperature)
                runs.append(m["tokens"] / m["seconds"])
        finally:
            e.decode_block = 1
        return outs, runs, m["seconds"] / m["steps"] * 1e3, getattr(e, "spec", None)

    def measure(case):
        b, k, hv = case
        if case not in engines:
            emit({"compiled": list(case), "compile_s": round(build(case), 1), "at_s": round(elapsed(), 1)})
        e = engines.pop(case)
        e.variables = {"params": params}
        names = ["peer"] if k == 0 else names_of(hv)
        for name in names:
            if k:
                if e.dcfg != drafts[name][0]:
                    raise ValueError(f"draft {name}: config {drafts[name][0]} differs from the engine's {e.dcfg}")
                e.draft_variables = draft_variables(name)
            t, c0 = time.perf_counter(), COMPILES[0]
            warm(e, case)
            warm_s, warm_compiles, c0 = time.perf_counter() - t, COMPILES[0] - c0, COMPILES[0]
            outs, runs, ms, st = timed(e, b, 1)
            unit = "step" if k == 0 else "round"
            row = {"side": "peer" if k == 0 else "speculative", "batch": b, "k": k, "prompts": len(prompts[b]),
                   "page_size": args.page_size,
                   "decode_tokens_per_s": round(float(np.mean(runs)), 2), "runs": [round(r, 2) for r in runs],
                   f"{unit}_ms": round(ms, 3), "warm_s": round(warm_s, 2), "warm_compiles": warm_compiles}
            if b in block_batches:
                block_outs, block_runs, block_ms, _ = timed(e, b, args.block)
                row.update({"block": args.block, "block_tokens_per_s": round(float(np.mean(block_runs)), 2),
                            "block_runs": [round(r, 2) for r in block_runs], f"block_{unit}_ms": round(block_ms, 3),
                            "block_equal": block_outs == outs})
            best = max(row["decode_tokens_per_s"], row.get("block_tokens_per_s", 0.0))
            if k:
                peer = peers[b]
                div = [peer["margins"][i][common_prefix(a, c)] for i, (a, c) in enumerate(zip(outs, peer["outs"],
                                                                                              strict=True)) if a != c]
                row.update({"draft": name, "mixer": e.dcfg.mixer, "head_vocab": e.dcfg.head_vocab,
                            "peer_decode_tokens_per_s": peer["decode_tokens_per_s"],
                            "speedup_vs_step": round(row["decode_tokens_per_s"] / peer["decode_tokens_per_s"], 3),
                            "speedup_vs_best": round(best / peer["best"], 3),
                            "acceptance_length": round(st.acceptance_length, 3),
                            "acceptance_rate": round(st.acceptance_rate, 3),
                            "accepted_hist": dict(sorted(st.accepted_hist.items())),
                            "rows_equal": sum(a == c for a, c in zip(outs, peer["outs"], strict=True)),
                            "common_prefix": round(float(np.mean([common_prefix(a, c) for a, c in
                                                                  zip(outs, peer["outs"], strict=True)])), 1),
                            "diverge_margins": [round(x, 4) for x in div]})
                if maps[name] is not None:  # a pruned draft never proposes a token outside its map
                    row["peer_tokens_in_map"] = round(float(np.mean(np.isin(np.concatenate(peer["outs"]),
                                                                            maps[name]))), 4)
                if "block_tokens_per_s" in row and "block_tokens_per_s" in peer:
                    row["peer_block_tokens_per_s"] = peer["block_tokens_per_s"]
                    row["speedup_vs_block"] = round(row["block_tokens_per_s"] / peer["block_tokens_per_s"], 3)
            if (b, k) in sample_cases or (k == 0 and b in sample_batches):
                _, sruns, _, sst = timed(e, b, 1, temperature=args.sample_temperature)
                row["sampled_decode_tokens_per_s"] = round(sruns[0], 2)
                if k:
                    row["sampled_acceptance_length"] = round(sst.acceptance_length, 3)
                    row["sampled_accepted_hist"] = dict(sorted(sst.accepted_hist.items()))
                    if "sampled_decode_tokens_per_s" in peers[b]:
                        row["sampled_speedup_vs_step"] = round(sruns[0] / peers[b]["sampled_decode_tokens_per_s"], 3)
            row["timed_compiles"] = COMPILES[0] - c0  # compiles during the timed runs (0: clean timings)
            row["pipelined_ms"] = round(pipelined_ms(e, prompts[b][:b], args.new_tokens, args.pipelined_calls), 3)
            # what the greedy outputs look like: a broken forward shows as few distinct tokens (an all-NaN row's
            # argmax is id 0) and non-finite log-probabilities
            row["distinct_tokens"] = len({t for o in outs for t in o})
            row["head_tokens"] = outs[0][:12]
            if k == 0:
                peer_margin = peer_margins(e, prompts[b], args.new_tokens)
                row["nonfinite_margins"] = int(sum(not np.isfinite(x) for m in peer_margin for x in m))
                peers[b] = {**row, "outs": outs, "margins": peer_margin, "best": best,
                            "block_outs": block_outs if b in block_batches else None}
            emit(row)
            rows.append(row)
        if b == 1 and (k == 0 or not any(c[0] == 1 and c[1] for c in keep)) and hv == args.head_vocab:
            keep[case] = e  # the batch-1 peer and first speculative engine, for --profile

    last_case_s = 0.0
    for case in cases:
        b, k, _ = case
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

    if args.profile and keep and (not args.deadline_s or elapsed() + 15 < args.deadline_s):
        import sys

        sys.path.insert(0, str(REPO))
        from benchmarks._profile import device_op_times

        for (b, k, hv), e in keep.items():
            if k:
                e.draft_variables = draft_variables(names_of(hv)[0])
            call, finish = device_loop(e, prompts[b][:b], args.new_tokens)
            try:
                prof = device_op_times(call, out_dir=f"{args.profile_dir}/b{b}k{k}", iters=4, top=15)
            except Exception as ex:  # noqa: BLE001 - the profile is optional
                prof = {"error": f"{type(ex).__name__}: {ex}"[:500]}
            finally:
                finish()
            emit({"profile": "peer step" if k == 0 else f"round k={k} ({names_of(hv)[0]})", "batch": b, **prof})

    spec_rows = [r for r in rows if r["side"] == "speculative"]
    by = {(r["draft"], r["batch"], r["k"]): r for r in spec_rows}
    lk_vs_ce = [{"batch": b, "k": k, "lk": by[("lk", b, k)]["acceptance_length"],
                 "ce": by[("ce", b, k)]["acceptance_length"],
                 "lk_sampled": by[("lk", b, k)].get("sampled_acceptance_length"),
                 "ce_sampled": by[("ce", b, k)].get("sampled_acceptance_length")}
                for (d, b, k) in by if d == "lk" and ("ce", b, k) in by]
    heads = []  # the pruned drafts against the full-head ones, case by case
    for b, k in pruned_cases:
        at = {r["draft"]: r for r in spec_rows if (r["batch"], r["k"]) == (b, k)}
        heads.append({"batch": b, "k": k, **{field: {d: r.get(field) for d, r in at.items()} for field in (
            "head_vocab", "acceptance_length", "sampled_acceptance_length", "decode_tokens_per_s",
            "block_tokens_per_s", "round_ms", "block_round_ms", "pipelined_ms", "peer_tokens_in_map")}})
    invariance = []
    for i, b1 in enumerate(sorted(peers)):
        for b2 in sorted(peers)[i + 1:]:
            n = min(len(peers[b1]["outs"]), len(peers[b2]["outs"]))  # the prompts both served
            a, c = peers[b1]["outs"][:n], peers[b2]["outs"][:n]
            invariance.append({"batches": [b1, b2], "rows_equal": sum(x == y for x, y in zip(a, c, strict=True)),
                               "rows": n, "common_prefix": [common_prefix(x, y) for x, y in zip(a, c, strict=True)]})
    best1 = max((r for r in spec_rows if r["batch"] == 1), key=lambda r: r["speedup_vs_best"], default=None)
    emit({"summary": True, "device": str(jax.devices()[0].device_kind), "target": args.target or "random",
          "config": args.config or "micro", "kda_implementation": cfg.kda_implementation,
          "kda_decode_implementation": cfg.kda_decode_implementation,
          "kda_verify_implementation": cfg.kda_verify_implementation,
          "moe_implementation": cfg.moe_implementation, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
          "block": args.block,
          "best_batch1": None if best1 is None else {x: best1.get(x) for x in (
              "draft", "k", "speedup_vs_best", "speedup_vs_step", "speedup_vs_block", "acceptance_length")},
          "lk_vs_ce": lk_vs_ce, "pruned_vs_full": heads, "peer_batch_invariance": invariance,
          "peer_block_equal": {b: p["block_outs"] == p["outs"] for b, p in peers.items() if p["block_outs"]},
          "wall_s": round(elapsed(), 1)})


if __name__ == "__main__":
    main()
