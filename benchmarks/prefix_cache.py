"""Long-context serving: prefix-cache TTFT (cold vs hit), multi-turn replay, and a chunked 1M-token prefill.

    python benchmarks/prefix_cache.py --config configs/k3-tiny.json                      # CPU smoke (small sizes)
    XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false" K3_COMPILATION_CACHE=off \
    python benchmarks/prefix_cache.py --config configs/k3-slice.json --dtype bfloat16 --cases long \
        --prompt 1048576 --prefill-chunk 8192 --page-size 6144 --block-size 512 --budget-s 170   # 1M prefill
    ... --cases multiturn --turns 8 --turn-tokens 4096 --gen 4 --prefill-chunk 8192 --page-size 6144 \
        --block-size 512                                                                        # multi-turn replay
    ... --cases prefix --prefix 131072 --suffix 2048 --prefill-chunk 8192 --page-size 6144 --block-size 512

One JSON line per case; the peer of every cache measurement is the same engine (same compiled functions, same
weights) with its prefix cache detached, in the same run. Random weights (``random_params``, bf16 experts).
Every line carries ``kernel_choices``: the registry choices made so far (which MLA prefill attention ran).

* ``prefix``: TTFT of ``prefix + suffix`` tokens served cold (cache off) vs from the cache (a request with the
  same prefix and another suffix ran before); target on the H200: hit <= 5% of cold. Also the cold TTFT with
  the cache on (the snapshot overhead of the first request).
* ``multiturn``: ``--turns`` turns of a conversation whose history grows by ``--turn-tokens`` per turn: the
  previous turn's ``--gen`` generated tokens plus new user tokens (so every prompt is a multiple of
  ``--turn-tokens`` and few prefill shapes compile); total prefill time (sum of TTFTs) with and without the
  cache, and per turn the TTFT and the share of the prompt served from the cache (hit rate).
* ``long`` (``--prompt N``, 0 = skipped): one N-token prompt, chunked prefill (``--prefill-chunk``), cache off:
  wall, tokens/s, peak device memory, the MLA attention FLOPs (causal, expanded form) and their rate over the
  whole prefill (a lower bound of the attention's own rate), then ``--decode-steps`` decode steps (ms per
  token); and the logits at the chunk ends within the first ``--check-tokens`` tokens vs one unchunked forward
  of those tokens. ``--budget-s`` stops the prefill early (``completed: false`` with the rate so far).

Every case runs once with other token values first, so compiles are outside the timings.

At long T the cached prefill's MLA attention dominates. On Hopper it runs in the expanded form through
``pallas_kernels.prefix_attention`` (cuDNN flash attention of the chunk against up-projected key blocks of the
cached prefix and causally against itself, merged by log-sum-exp: ``2·H·(Dqk + Dv)`` FLOP per query-key pair);
``--prefix-attention xla`` gives the absorbed form in XLA (``2·H·(2·C + Dr)``, ~3.4x).
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
from pallas_kernels.registry import selections

GB = 1e9


def emit(rec: dict[str, Any]) -> None:
    rec["kernel_choices"] = list(dict.fromkeys(sel.describe() for sel in selections()))
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


def _checked(events: list) -> list:
    """The step's events; a failed request stops the benchmark with its error."""
    for ev in events:
        if ev.finish_reason == "error":
            raise RuntimeError(f"request {ev.request_id} failed: {ev.error}")
    return events


def serve_one(engine: Engine, prompt: list[int], gen: int) -> tuple[float, list[int], list[float]]:
    """(TTFT seconds, generated tokens, seconds between consecutive tokens) of one greedy request run alone."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=gen, ignore_eos=True))
    times, toks = [], []
    while engine.has_work:
        for ev in _checked(engine.step()):
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
    def replay(seed: int, on: bool, turns: int) -> tuple[float, list[float], list[float]]:
        """(total TTFT, TTFT per turn, share of each turn's prompt served from the cache)."""
        rs = np.random.RandomState(seed)
        history: list[int] = []
        ttfts, hit_rates, out = [], [], []
        stats = engine.prefix.stats  # the cache's counters (engine.prefix is None while detached)
        ctx = contextlib.nullcontext(engine) if on else cache_off(engine)
        with ctx:
            for _ in range(turns):
                history += out + tokens(rs, vocab, args.turn_tokens - len(out))  # the reply + new user tokens
                before = stats["cached_tokens"]
                ttft, out, _ = serve_one(engine, history, args.gen)
                ttfts.append(ttft)
                hit_rates.append((stats["cached_tokens"] - before) / len(history))
        return sum(ttfts), ttfts, hit_rates

    replay(10, True, min(args.turns, 3))  # warm: compiles the piece shapes (cold, and after a hit) and decode
    engine.prefix.clear()
    on_total, on_ttfts, hit_rates = replay(12, True, args.turns)
    off_total, off_ttfts, _ = replay(13, False, args.turns)
    return {"case": "multiturn", "turns": args.turns, "turn_tokens": args.turn_tokens, "gen": args.gen,
            "prefill_total_s_cache_on": on_total, "prefill_total_s_cache_off": off_total,
            "on_over_off": on_total / off_total, "hit_rate_per_turn": hit_rates,
            "ttft_s_cache_on": on_ttfts, "ttft_s_cache_off": off_ttfts}


def case_long(engine: Engine, variables: Any, cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    n, check = args.prompt, min(args.check_tokens, args.prompt)
    prompt = tokens(np.random.RandomState(20), cfg.vocab_size, n)
    piece_logits: list[tuple[int, np.ndarray]] = []
    prefill = engine._prefill

    def recording_prefill(variables, cache, slot, toks, table, media=None):  # last logits of pieces in `check`
        logits, cache = prefill(variables, cache, slot, toks, table, media)
        end = int(cache["lengths"][slot])
        if end <= check:
            piece_logits.append((end, np.asarray(logits)))
        return logits, cache

    with cache_off(engine):
        serve_one(engine, tokens(np.random.RandomState(21), cfg.vocab_size, engine.prefill_chunk), 2)  # warm
        engine._prefill = recording_prefill
        t0 = time.perf_counter()
        rid = engine.add_request(prompt, SamplingParams(max_tokens=args.decode_steps + 1, ignore_eos=True))
        times, completed = [], True
        while engine.has_work:
            evs = _checked(engine.step())
            times += [time.perf_counter() for ev in evs if ev.request_id == rid]
            if not times and time.perf_counter() - t0 > args.budget_s:
                done = engine._by_id[rid].pos
                engine.abort(rid)
                completed = False
        engine._prefill = prefill
    wall = (times[0] if times else time.perf_counter()) - t0
    done = n if completed else done
    mla_layers = sum(m == "mla" for m, _ in cfg.layer_kinds())
    attn_flop = mla_layers * done * done / 2 * 2 * cfg.num_attention_heads * (cfg.q_head_dim + cfg.v_head_dim)
    rec = {"case": "long", "prompt_tokens": n, "completed": completed, "prefilled_tokens": done,
           "prefill_chunk": engine.prefill_chunk, "ttft_s": wall, "prefill_tokens_per_s": done / wall,
           "peak_device_bytes": peak_bytes(), "mla_attention_pflop": attn_flop / 1e15,
           "mla_attention_tflop_per_s_over_prefill": attn_flop / wall / 1e12,
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
    ap.add_argument("--prefix-attention", default="auto",
                    help="K3Config.mla_prefix_attention_implementation: auto | cudnn | xla (absorbed form)")
    a = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    dtype = a.dtype or ("bfloat16" if on_gpu else "float32")
    cfg = load_config(a.config).replace(expert_format="bf16", dtype=dtype,
                                        mla_prefix_attention_implementation=a.prefix_attention)
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
