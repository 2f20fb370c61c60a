"""What one speculative round asks the device for, against one plain decode step, counted on a CPU host.

    python benchmarks/speculative_ops.py --config configs/k3-small.json --ks 2,4,6 [--platform gpu]

Traces (no compile, no run) the engines' own jitted functions for ``--platform`` (the registries pick that
platform's kernels): the plain engine's one-token ``_decode`` and the speculative engine's ``_round`` (greedy, batch
``--batch``, random weights, ``DraftConfig.default_for``), and counts the jaxpr's equations with every ``scan`` body
times its length (``while`` bodies once): ``pallas_call`` s by kernel name (each is one launch that XLA cannot
fuse), the other primitives (an upper bound on the fused kernels XLA makes of them), and both by module
(``by_module``: the target's forward, the draft's layers, ``""`` for the round's own bookkeeping). Prints one JSON
line per program. A count, not a timing: the device call (``benchmarks/speculative_h200.sh``, ``--profile``) says
what the kernels cost, and ``benchmarks/speculative_aot.py`` the bytes XLA moves for a round and a step (compiled
for a TPU chip on this host).
"""

from __future__ import annotations

import argparse
import collections
import json


def count_eqns(jaxpr, mult: int, counts: collections.Counter, kernels: collections.Counter,
               scopes: collections.Counter, stack: str = "") -> None:
    """Add ``jaxpr``'s equations (times ``mult``) to ``counts`` by primitive, its Pallas kernels to ``kernels``,
    and both to ``scopes`` by the first two names of their module path (``K3ForCausalLM/model``,
    ``DraftModel/self_attn``, ...; ``""``: outside any module)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        path = "/".join(filter(None, (stack, str(eqn.source_info.name_stack))))
        scope = "/".join(path.split("/")[:2])
        if name == "pallas_call":
            kernels[str(eqn.params.get("name", "pallas_call"))] += mult
            scopes[scope] += mult
            continue
        sub_mult = mult * (eqn.params["length"] if name == "scan" else 1)
        subs = [v for v in eqn.params.values() if hasattr(v, "jaxpr") or hasattr(v, "eqns")]
        subs += [b for v in eqn.params.values() if isinstance(v, tuple) for b in v
                 if hasattr(b, "jaxpr") or hasattr(b, "eqns")]
        if subs:
            for s in subs:
                count_eqns(getattr(s, "jaxpr", s), sub_mult, counts, kernels, scopes, path)
        else:
            counts[name] += mult
            scopes[scope] += mult


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/k3-small.json")
    p.add_argument("--platform", default="gpu")
    p.add_argument("--ks", default="2,4,6")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-len", type=int, default=200)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from k3_jax.config import load_config
    from k3_jax.draft import DraftConfig, DraftModel, target_head
    from k3_jax.model import K3ForCausalLM
    from k3_jax.serving.engine import Engine
    from k3_jax.serving.sampling import SamplingArrays
    from k3_jax.serving.speculative import SpeculativeEngine

    cfg = load_config(args.config)
    abstract = jax.eval_shape(K3ForCausalLM(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), nn.unbox(abstract)["params"])
    dcfg = DraftConfig.default_for(cfg)
    emb, head = target_head(cfg, params)
    nf = cfg.hidden_size * len(dcfg.feature_layers)
    dabs = jax.eval_shape(DraftModel(cfg, dcfg).init, jax.random.PRNGKey(1), jnp.zeros((1, 2, nf), cfg.dtype),
                          jnp.zeros((1, 2), jnp.int32), emb, head)
    dparams = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), nn.unbox(dabs)["params"])
    traced = cfg.replace(platform=args.platform)
    b = args.batch
    samp = SamplingArrays(temperature=jnp.zeros((b,), jnp.float32), top_k=jnp.zeros((b,), jnp.int32),
                          top_p=jnp.ones((b,), jnp.float32), seed=jnp.zeros((b,), jnp.uint32),
                          step=jnp.zeros((b,), jnp.int32))
    active, last = jnp.ones((b,), bool), jnp.zeros((b,), jnp.int32)

    def report(what: str, jitted, *a, **kw) -> None:
        counts, kernels, scopes = collections.Counter(), collections.Counter(), collections.Counter()
        count_eqns(jitted.trace(*a, **kw).jaxpr.jaxpr, 1, counts, kernels, scopes)
        print(json.dumps({"program": what, "platform": args.platform, "batch": b,
                          "pallas_calls": sum(kernels.values()), "kernels": dict(kernels.most_common()),
                          "other_eqns": sum(counts.values()), "by_module": dict(scopes.most_common(args.top)),
                          "top": counts.most_common(args.top)}), flush=True)

    plain = Engine(traced, params, max_batch=b, max_len=args.max_len)
    report("plain step", plain._decode, plain.variables, plain.cache, last, active, samp, 0, None, sampling=False)
    for k in (int(x) for x in args.ks.split(",")):
        e = SpeculativeEngine(traced, params, dparams, dcfg, num_draft_tokens=k, max_batch=b, max_len=args.max_len)
        report(f"round k={k}", e._round, e.variables, e.draft_variables, e.cache, e.dcache, last, e._pend, active,
               jnp.full((b,), k, jnp.int32), samp, 0, False, None)


if __name__ == "__main__":
    main()
