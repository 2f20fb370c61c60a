"""Long-context serving: prefix-cache TTFT (cold vs hit), multi-turn replay, and a chunked 1M-token prefill.

    python benchmarks/prefix_cache.py --config configs/k3-tiny.json                      # CPU smoke (small sizes)
    python benchmarks/prefix_cache.py --config configs/k3-slice.json --dtype bfloat16 \\
        --prefix 131072 --suffix 2048 --turns 10 --turn-tokens 4096 --prompt 1048576 --prefill-chunk 8192

One JSON line per case; the peer of every cache measurement is the same engine (same compiled functions, same
weights) with its prefix cache detached, in the same run. Random weights (``random_params``, bf16 experts).

* ``prefix``: TTFT of ``prefix + suffix`` tokens served cold (cache off) vs from the cache (a request with the
  same prefix and another suffix ran before); target on the H200: hit <= 5% of cold. Also the cold TTFT with
  the cache on (the snapshot overhead of the first request).
* ``multiturn``: ``--turns`` turns, each adding ``--turn-tokens`` tokens to the history and generating
  ``--gen`` tokens (appended to the history); total prefill time (sum of TTFTs) with and without the cache.
* ``long`` (``--prompt N``, 0 = skipped): one N-token prompt, chunked prefill (``--prefill-chunk``), cache off:
  wall, tokens/s, peak device memory, then ``--decode-steps`` decode steps (ms per token); and the logits at
  the chunk ends within the first ``--check-tokens`` tokens vs one unchunked forward of those tokens.
  ``--budget-s`` stops the prefill early (``completed: false`` with the rate so far).

Every case runs once with other token values first, so compiles are outside the timings.

At long T the cached prefill's MLA attention dominates: it runs in the absorbed form (scores and values over
the 512-wide latent for each of the 96 heads: ~2·96·(2·512 + 64) FLOP per query-key pair, ~3.4x the expanded
form's 2·96·(192 + 128)) in XLA's key-blocked online softmax. ``pallas_kernels.attention.ATTENTION`` (cuDNN
flash attention) takes the expanded form with ``T_q == T_kv`` under a causal mask; jax's cuDNN call also has
``NO_MASK`` with ``T_q != T_kv``, padding lengths and ``return_residual`` (the softmax statistics), which is
what a chunk against a cached prefix needs: expand the cached latent's K/V per chunk (``kv_b_proj``), attend
chunk-vs-prefix unmasked and chunk-vs-itself causally, and merge the two by their log-sum-exp.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.config import load_config
from k3_jax.convert.fixture import random_params
from k3_jax.model import K3ForCausalLM
from k3_jax.serving.engine import Engine
from k3_jax.serving.prefix_cache import PrefixCacheConfig
from k3_jax.serving.sampling import SamplingParams

GB = 1e9


def emit(rec: dict[str, Any]) -> None:
    print(json.dumps(rec), flush=True)


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


@contextlib.contextmanager
def cache_off(engine: Engine):
    """The same engine with its prefix cache detached (no lookup, no snapshot)."""
    prefix, engine.prefix = engine.prefix, None
    try:
        yield engine
    finally:
        engine.prefix = prefix


def serve_one(engine: Engine, prompt: list[int], gen: int) -> tuple[float, list[int], list[float]]:
    """(TTFT seconds, generated tokens, seconds between consecutive tokens) of one greedy request run alone."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=gen, ignore_eos=True))
    times, toks = [], []
    while engine.has_work:
        for ev in engine.step():
            if ev.request_id == rid:
                times.append(time.perf_counter())
                toks.append(ev.token)
    return times[0] - t0, toks, list(np.diff(times))


def tokens(rs: np.random.RandomState, vocab: int, n: int) -> list[int]:
    return rs.randint(3, vocab, n).tolist()


def case_prefix(engine: Engine, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rs = np.random.RandomState(1)
    for rep in ("warm", "measure"):  # the warm pass compiles every piece shape of both paths
        prefix = tokens(rs, vocab, args.prefix)
        suffixes = [tokens(rs, vocab, args.suffix) for _ in range(3)]
        with cache_off(engine):
            cold, cold_out, _ = serve_one(engine, prefix + suffixes[0], args.gen)
        first, _, _ = serve_one(engine, prefix + suffixes[1], args.gen)  # fills the cache
        before = engine.prefix.stats["cached_tokens"]
        hit, hit_out, _ = serve_one(engine, prefix + suffixes[2], args.gen)
        cached = engine.prefix.stats["cached_tokens"] - before
        if rep == "measure":
            return {"case": "prefix", "prefix_tokens": args.prefix, "suffix_tokens": args.suffix,
                    "ttft_cold_s": cold, "ttft_cold_with_snapshots_s": first, "ttft_hit_s": hit,
                    "hit_over_cold": hit / cold, "cached_tokens": cached,
                    "snapshot_bytes": engine.prefix.snapshot_bytes, "mla_cache_bytes": engine.prefix.mla_bytes}
    raise AssertionError


def case_multiturn(engine: Engine, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    def replay(seed: int, on: bool) -> tuple[float, list[float], int]:
        rs = np.random.RandomState(seed)
        history: list[int] = []
        ttfts, cached0 = [], engine.prefix.stats["cached_tokens"]
        ctx = contextlib.nullcontext(engine) if on else cache_off(engine)
        with ctx:
            for _ in range(args.turns):
                history += tokens(rs, vocab, args.turn_tokens)
                ttft, out, _ = serve_one(engine, history, args.gen)
                ttfts.append(ttft)
                history += out
        return sum(ttfts), ttfts, engine.prefix.stats["cached_tokens"] - cached0

    replay(10, True)  # warm: compiles the piece shapes of both paths
    replay(11, False)
    engine.prefix.clear()
    on_total, on_ttfts, cached = replay(12, True)
    off_total, off_ttfts, _ = replay(13, False)
    return {"case": "multiturn", "turns": args.turns, "turn_tokens": args.turn_tokens, "gen": args.gen,
            "prefill_total_s_cache_on": on_total, "prefill_total_s_cache_off": off_total,
            "on_over_off": on_total / off_total, "cached_tokens": cached,
            "ttft_s_cache_on": on_ttfts, "ttft_s_cache_off": off_ttfts}


def case_long(engine: Engine, variables: Any, cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    n, check = args.prompt, min(args.check_tokens, args.prompt)
    prompt = tokens(np.random.RandomState(20), cfg.vocab_size, n)
    piece_logits: list[tuple[int, np.ndarray]] = []
    prefill = engine._prefill

    def recording_prefill(variables, cache, slot, toks, table):  # last logits of every piece within `check`
        logits, cache = prefill(variables, cache, slot, toks, table)
        end = int(cache["lengths"][slot])
        if end <= check:
            piece_logits.append((end, np.asarray(logits)))
        return logits, cache

    with cache_off(engine):
        serve_one(engine, tokens(np.random.RandomState(21), cfg.vocab_size, engine.prefill_chunk + 1), 2)  # warm
        engine._prefill = recording_prefill
        t0 = time.perf_counter()
        rid = engine.add_request(prompt, SamplingParams(max_tokens=args.decode_steps + 1, ignore_eos=True))
        times, completed = [], True
        while engine.has_work:
            evs = engine.step()
            times += [time.perf_counter() for ev in evs if ev.request_id == rid]
            if not times and time.perf_counter() - t0 > args.budget_s:
                done = engine._by_id[rid].pos
                engine.abort(rid)
                completed = False
        engine._prefill = prefill
    wall = (times[0] if times else time.perf_counter()) - t0
    done = n if completed else done
    rec = {"case": "long", "prompt_tokens": n, "completed": completed, "prefilled_tokens": done,
           "prefill_chunk": engine.prefill_chunk, "ttft_s": wall, "prefill_tokens_per_s": done / wall,
           "peak_device_bytes": peak_bytes(),
           "decode_ms_per_token": float(np.mean(np.diff(times)) * 1e3) if len(times) > 1 else None}
    if piece_logits:  # unchunked forward of the first `check` tokens (no cache)
        fwd = jax.jit(lambda v, x: K3ForCausalLM(cfg).apply(v, x))
        full = np.asarray(fwd(variables, jnp.asarray([prompt[:check]], jnp.int32))[0], np.float32)
        diffs = [float(np.abs(full[end - 1] - lg).max()) for end, lg in piece_logits]
        agree = [int(full[end - 1].argmax() == lg.argmax()) for end, lg in piece_logits]
        rec.update({"check_tokens": check, "check_positions": [e for e, _ in piece_logits],
                    "max_abs_logit_diff_vs_unchunked": max(diffs),
                    "median_abs_logit_diff_vs_unchunked": float(np.median(diffs)),
                    "argmax_agree": f"{sum(agree)}/{len(agree)}",
                    "max_abs_logit": float(np.abs(full).max())})
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/k3-tiny.json")
    ap.add_argument("--dtype", default=None, help="compute dtype (default bf16 on GPU, f32 on CPU)")
    ap.add_argument("--cases", default="prefix,multiturn,long")
    ap.add_argument("--prefix", type=int, default=192)
    ap.add_argument("--suffix", type=int, default=24)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=40)
    ap.add_argument("--gen", type=int, default=8, help="tokens generated per request (greedy)")
    ap.add_argument("--prompt", type=int, default=256, help="long case prompt tokens (0: skip)")
    ap.add_argument("--check-tokens", type=int, default=32768, help="long case: logits checked vs unchunked")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=540.0, help="long case: prefill wall budget")
    ap.add_argument("--prefill-chunk", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=48, help="MLA page (the report's example: 6144)")
    ap.add_argument("--block-size", type=int, default=16, help="hash block (the report's example: 512)")
    ap.add_argument("--stride", type=int, default=None, help="KDA snapshot stride (default: the prefill chunk)")
    ap.add_argument("--kda-budget-gb", type=float, default=8.0)
    ap.add_argument("--mla-budget-gb", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    dtype = a.dtype or ("bfloat16" if on_gpu else "float32")
    cfg = load_config(a.config).replace(expert_format="bf16", dtype=dtype)
    params = jax.device_put(random_params(cfg, seed=a.seed, experts="bf16"))
    variables = {"params": params}
    cases = a.cases.split(",")
    pc = PrefixCacheConfig(page_size=a.page_size, block_size=a.block_size, stride=a.stride or a.prefill_chunk,
                           mla_budget_bytes=int(a.mla_budget_gb * GB), kda_budget_bytes=int(a.kda_budget_gb * GB))
    common = dict(max_batch=1, prefill_chunk=a.prefill_chunk, paged=True, eos_ids=())
    env = {"config": a.config, "dtype": dtype, "device": jax.devices()[0].device_kind, "page_size": a.page_size,
           "block_size": a.block_size, "stride": pc.stride, "prefill_chunk": a.prefill_chunk}
    need = max(a.prefix + a.suffix if "prefix" in cases else 0,
               a.turns * (a.turn_tokens + a.gen) if "multiturn" in cases else 0) + a.gen + 1
    if "prefix" in cases or "multiturn" in cases:
        engine = Engine(cfg, params, max_len=-(-need // a.page_size) * a.page_size, prefix_cache=pc, **common)
        if "prefix" in cases:
            emit({**env, **case_prefix(engine, a, cfg.vocab_size)})
        if "multiturn" in cases:
            emit({**env, **case_multiturn(engine, a, cfg.vocab_size)})
        del engine
    if "long" in cases and a.prompt > 0:
        engine = Engine(cfg, params, max_len=a.prompt + a.decode_steps + 2, page_size=a.page_size, **common)
        emit({**env, **case_long(engine, variables, cfg, a)})


if __name__ == "__main__":
    main()
