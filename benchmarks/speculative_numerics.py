"""Is the speculative verify pass numerically the plain decode? Logits of the target over ``k + 1`` tokens in one
verify call (``record_position_states``, the speculative engine's form) against ``k + 1`` one-token decode calls
(the plain engine's form) from the same prefilled cache, and the plain decode of row 0 at batch ``B`` against
batch 1 (the same row alone), on random weights.

    python benchmarks/speculative_numerics.py                                  # micro config, bf16 and fp32
    python benchmarks/speculative_numerics.py --config configs/k3-small.json --dtypes bfloat16 --batches 1,4,16

One JSON line per (dtype, batch): ``verify_vs_decode`` and ``decode_vs_batch1`` (max |difference| of the logits
over every row and position, divided by the largest |logit|), ``verify_argmax_agree`` (fraction of positions
whose argmax agree), then a summary line. A difference of the same size as ``decode_vs_batch1`` (which changes
nothing but the batch's shape) is rounding from the kernels' shapes, not a difference of the computation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(cfg, batches: list[int], k: int, prompt_len: int, seed: int) -> list[dict]:
    """The records of one config (module docstring)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    from k3_jax.cache import init_cache
    from k3_jax.layers.kda import record_position_states
    from k3_jax.model import FEATURES, K3ForCausalLM

    t = k + 1
    model = K3ForCausalLM(cfg)
    params = nn.unbox(jax.jit(model.init)(jax.random.PRNGKey(seed), jnp.zeros((1, 4), jnp.int32)))
    rs = np.random.RandomState(seed)
    prompt = jnp.asarray(rs.randint(3, cfg.vocab_size, (max(batches), prompt_len)), jnp.int32)
    tokens = jnp.asarray(rs.randint(3, cfg.vocab_size, (max(batches), t)), jnp.int32)
    apply = jax.jit(model.apply)

    @jax.jit
    def verify(params, tokens, cache):
        with record_position_states():
            (logits, _), _ = model.apply(params, tokens, cache=cache, mutable=[FEATURES])
        return logits

    def decode(b: int) -> tuple[np.ndarray, np.ndarray]:
        cache = init_cache(cfg, b, prompt_len + t + 1)
        _, cache = apply(params, prompt[:b], cache=cache)
        ver = verify(params, tokens[:b], cache)
        steps = []
        for i in range(t):
            logits, cache = apply(params, tokens[:b, i:i + 1], cache=cache)
            steps.append(logits)
        return np.asarray(jnp.concatenate(steps, axis=1), np.float32), np.asarray(ver, np.float32)

    one = decode(1)[0]
    out = []
    for b in batches:
        dec, ver = decode(b)
        scale = float(np.abs(dec).max())
        out.append({"dtype": cfg.dtype, "batch": b, "k": k, "device": str(jax.devices()[0].device_kind),
                    "max_abs_logit": round(scale, 4),
                    "verify_vs_decode": float(np.abs(ver - dec).max()) / scale,
                    "verify_argmax_agree": float((ver.argmax(-1) == dec.argmax(-1)).mean()),
                    "decode_vs_batch1": float(np.abs(dec[:1] - one).max()) / scale})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="", help="target config (default: a micro config with MoE)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--k", type=int, default=4, help="drafts per round: the verify call covers k + 1 tokens")
    p.add_argument("--prompt-len", type=int, default=17)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from k3_jax.config import load_config

    micro = dict(num_hidden_layers=3, kda_layers=(0, 1), mla_layers=(2,), hidden_size=64, intermediate_size=128,
                 num_attention_heads=2, kda_num_heads=2, kda_head_dim=16, num_experts=4, num_experts_per_token=2,
                 num_shared_experts=1, moe_intermediate_size=32, routed_expert_hidden_size=32, q_lora_rank=32,
                 kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = args.dtypes.split(",")
    out = []
    for dtype in dtypes:
        cfg = load_config(args.config or REPO / "configs" / "k3-tiny.json", dtype=dtype,
                          **({} if args.config else micro))
        for rec in measure(cfg, batches, args.k, args.prompt_len, args.seed):
            print(json.dumps(rec), flush=True)
            out.append(rec)
    print(json.dumps({"summary": True, "config": args.config or "micro",
                      "worst_verify_vs_decode": {d: max(r["verify_vs_decode"] for r in out if r["dtype"] == d)
                                                 for d in dtypes},
                      "worst_decode_vs_batch1": {d: max(r["decode_vs_batch1"] for r in out if r["dtype"] == d)
                                                 for d in dtypes}}), flush=True)


if __name__ == "__main__":
    main()
