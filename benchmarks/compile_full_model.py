"""Compile time of the full K3 forward (configs/k3.json) from abstract, shape-only parameters on this host.

Nothing of the 2.78T parameters is allocated: ``jax.eval_shape`` gives the parameter shapes and the jitted forward
is lowered and compiled against ``jax.ShapeDtypeStruct`` inputs. Prints one JSON line, e.g.::

    python benchmarks/compile_full_model.py --tokens 1x64

Peer in the same run: the same forward with the 93 layers unrolled is not built (it is what the scan avoids);
instead the tiny config's compile time is printed beside it to show compile cost does not grow with depth.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3_jax.config import load_config
from k3_jax.model import K3ForCausalLM, layer_plan

REPO = pathlib.Path(__file__).resolve().parents[1]


def compile_seconds(config: str, batch: int, length: int, **overrides) -> dict:
    cfg = load_config(REPO / "configs" / f"{config}.json", **overrides)
    model = K3ForCausalLM(cfg)
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    t0 = time.perf_counter()
    abstract = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens))
    t_shapes = time.perf_counter() - t0
    t0 = time.perf_counter()
    lowered = jax.jit(model.apply).lower(abstract, tokens)
    t_lower = time.perf_counter() - t0
    t0 = time.perf_counter()
    lowered.compile()
    t_compile = time.perf_counter() - t0
    return {"config": config, "layers": cfg.num_hidden_layers, "segments": len(layer_plan(cfg)),
            "expert_format": cfg.expert_format, "tokens": [batch, length], "eval_shape_s": round(t_shapes, 2),
            "lower_s": round(t_lower, 2), "compile_s": round(t_compile, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1x64", help="BxT of the abstract input")
    args = parser.parse_args()
    b, t = (int(x) for x in args.tokens.split("x"))
    full = compile_seconds("k3", b, t)
    tiny = compile_seconds("k3-tiny", b, t)
    print(json.dumps({"bench": "compile_full_model", "backend": jax.default_backend(), "k3": full,
                      "k3_tiny": tiny}))


if __name__ == "__main__":
    main()
