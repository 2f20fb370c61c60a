"""Speculative decoding: the engine with a draft against the same engine without one, same weights, same run.

    python benchmarks/speculative.py                                   # CPU smoke: micro target, random draft
    python benchmarks/speculative.py --target runs/ks --config configs/k3-small.json \
        --drafts lk=runs/ks-lk/draft,ce=runs/ks-ce/draft --batches 1,4,16 --ks 2,4,6 --new-tokens 128

Prompts are held-out documents of the bundled corpus (``--prompt-len`` tokens each), so a target trained on it
is predictable. Per batch size the peer (``Engine``, no draft) generates ``--new-tokens`` greedy tokens per row;
then for every draft and ``k`` the ``SpeculativeEngine`` does the same. Each side runs once to compile and once
timed; tokens/s = generated tokens / wall time of the timed ``generate`` (prefill included, the same prompts on
both sides). One JSON line per measurement (``greedy_equal``: the outputs equal the peer's), then a summary line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def emit(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


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


def timed_generate(engine, prompts, new_tokens: int) -> tuple[list[list[int]], float]:
    engine.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])  # compile
    t0 = time.perf_counter()
    outs = engine.generate(prompts, max_new_tokens=new_tokens, stop_token_ids=[])
    return outs, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="", help="target config (default: a micro CPU config)")
    p.add_argument("--target", default="", help="train.py workdir or converted orbax dir (default: random)")
    p.add_argument("--drafts", default="", help="name=DIR,... drafts from k3_jax.training.draft (default: random)")
    p.add_argument("--batches", default="1,2")
    p.add_argument("--ks", default="2,4")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--dtype", default="")
    args = p.parse_args()

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from k3_jax.config import load_config
    from k3_jax.draft import DraftConfig, DraftModel, target_head
    from k3_jax.serving.engine import Engine
    from k3_jax.serving.speculative import SpeculativeEngine, load_draft
    from k3_jax.training.draft import DraftTrainConfig, load_target

    if args.config or args.target:
        cfg, params = load_target(DraftTrainConfig(target=args.target, config=args.config or "configs/k3-tiny.json",
                                                   dtype=args.dtype))
    else:  # micro CPU smoke target
        from k3_jax.model import K3ForCausalLM

        cfg = load_config(REPO / "configs" / "k3-tiny.json", dtype="float32", num_hidden_layers=3,
                          kda_layers=(0, 1), mla_layers=(2,), hidden_size=64, intermediate_size=128,
                          num_attention_heads=2, kda_num_heads=2, kda_head_dim=16, num_experts=4,
                          num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
                          routed_expert_hidden_size=32, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                          qk_rope_head_dim=8, v_head_dim=16)
        params = nn.unbox(jax.jit(K3ForCausalLM(cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)))
        params = params["params"]
    drafts: dict[str, tuple] = {}
    for item in filter(None, args.drafts.split(",")):
        name, _, path = item.partition("=")
        drafts[name] = load_draft(path, cfg)
    if not drafts:
        dcfg = DraftConfig.default_for(cfg)
        emb, head = target_head(cfg, params)
        nf = cfg.hidden_size * len(dcfg.feature_layers)
        v = jax.jit(DraftModel(cfg, dcfg).init)(jax.random.PRNGKey(1), jnp.zeros((1, 2, nf), cfg.dtype),
                                                jnp.zeros((1, 2), jnp.int32), emb, head)
        drafts["random"] = (dcfg, nn.unbox(v)["params"])
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    max_len = args.prompt_len + args.new_tokens + 1
    chunk = 1 << max(0, min(64, args.prompt_len).bit_length() - 1)
    rows = []
    for b in batches:
        prompts = corpus_prompts(b, args.prompt_len, cfg.vocab_size)
        peer = Engine(cfg, params, max_batch=b, max_len=max_len, prefill_chunk=chunk)
        want, peer_s = timed_generate(peer, prompts, args.new_tokens)
        peer_tps = b * args.new_tokens / peer_s
        emit({"side": "peer", "batch": b, "tokens_per_s": round(peer_tps, 2), "seconds": round(peer_s, 3)})
        del peer
        for name, (dcfg, dparams) in drafts.items():
            for k in ks:
                spec = SpeculativeEngine(cfg, params, dparams, dcfg, num_draft_tokens=k, max_batch=b,
                                         max_len=max_len, prefill_chunk=chunk)
                spec.generate(prompts, max_new_tokens=args.new_tokens, stop_token_ids=[])  # compile
                spec.spec = type(spec.spec)()
                t0 = time.perf_counter()
                got = spec.generate(prompts, max_new_tokens=args.new_tokens, stop_token_ids=[])
                s = time.perf_counter() - t0
                tps = b * args.new_tokens / s
                row = {"side": "speculative", "draft": name, "mixer": dcfg.mixer, "batch": b, "k": k,
                       "tokens_per_s": round(tps, 2), "peer_tokens_per_s": round(peer_tps, 2),
                       "speedup": round(tps / peer_tps, 3), "greedy_equal": got == want,
                       "acceptance_length": round(spec.spec.acceptance_length, 3),
                       "acceptance_rate": round(spec.spec.acceptance_rate, 3),
                       "accepted_hist": spec.spec.accepted_hist}
                emit(row)
                rows.append(row)
                del spec
    emit({"summary": True, "device": str(jax.devices()[0].device_kind), "target": args.target or "random",
          "config": args.config or "micro", "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
          "best": max(rows, key=lambda r: r["speedup"]) if rows else None,
          "all_greedy_equal": all(r["greedy_equal"] for r in rows)})


if __name__ == "__main__":
    main()
