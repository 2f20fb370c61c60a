"""Ahead-of-time compile of the TPU MoE kernels for v5p and v6e on this CPU host (needs ``libtpu``).

K3 expert shapes: latent L = 3584, expert width I = 3072, a slice of E = 8 of the 896 experts (the kernels'
per-expert tiles do not depend on E), 1024 routed rows. The MXFP4 serving kernels read a stack of two layers'
HF-layout weights at a traced layer: the compiled program copies none of the weights (no transpose, no layer
slice), and XLA's cost analysis counts the kernels' own estimates.
"""

import importlib.util
import os
import re

import pytest

if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed (pip install -e '.[aot]')", allow_module_level=True)
# Several test processes may load libtpu at once for compile-only work; its lock file would refuse that.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from benchmarks.hlo_bytes import op_bytes  # noqa: E402
from pallas_kernels.moe import ops, tpu  # noqa: E402

E, L, I, M, LAYERS = 8, 3584, 3072, 1024, 2


def _device(topology: str):
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(topology, platform="tpu").devices[0]
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"libtpu cannot describe topology {topology}: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2"])
def test_tpu_moe_kernels_compile_aot(topology):
    dev = _device(topology)
    s = SingleDeviceSharding(dev)
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=s)
    x, gs = spec((M, L), jnp.bfloat16), spec((E,), jnp.int32)
    w13, w2 = spec((E, L, I), jnp.bfloat16), spec((E, I, L), jnp.bfloat16)
    c13, s13 = spec((LAYERS, E, I, L // 2), jnp.uint8), spec((LAYERS, E, I, L // 32), jnp.uint8)  # HF [out, in]
    c2, s2 = spec((LAYERS, E, L, I // 2), jnp.uint8), spec((LAYERS, E, L, I // 32), jnp.uint8)

    def train_ffn(x, w1, w3, w2, gs):
        def loss(x, w1, w3, w2):
            h = ops.fused_glu_fn("mosaic_tpu", 4.0, 25.0, False)(x, w1, w3, gs)  # fused kernel, kernel backward
            return jnp.sum(tpu.gmm(h, w2, gs).astype(jnp.float32))

        # gmm forward + its kernel backward (transposed gmm, tgmm) on both expert matmul shapes
        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, w1, w3, w2)

    def serve_mxfp4(x, c1, s1, c3, s3, c2, s2, gs, layer):
        h = tpu.gmm_mxfp4(x, [(c1, s1), (c3, s3)], gs, epilogue=tpu.situ_epilogue(4.0, 25.0, jnp.bfloat16),
                          layer=layer)
        return tpu.gmm_mxfp4(h, [(c2, s2)], gs, out_dtype=jnp.float32, layer=layer)

    jax.jit(train_ffn).lower(x, w13, w13, w2, gs).compile()
    served = jax.jit(serve_mxfp4).lower(x, c13, s13, c13, s13, c2, s2, gs, spec((), jnp.int32)).compile()
    rows = op_bytes(served.as_text())
    one_layer = 3 * E * I * (L // 2 + L // 32)  # w1, w3, w2 codes + scales
    weight_like = [r for r in rows if "kernel" not in r and any(
        dt == "u8" and np.prod([int(d) for d in dims.split(",") if d]) >= E * L * (I // 32)
        for dt, dims in re.findall(r"\b([a-z]\w*)\[([0-9,]*)\]", r["type"]))]
    assert not weight_like, weight_like[:3]  # no copy, transpose or layer slice of codes or scales
    kernels = sum(r["bytes"] for r in rows if r.get("kernel") == "moe_gmm_mxfp4")
    assert all(r["estimated"] for r in rows if "kernel" in r)
    assert one_layer <= kernels < one_layer + 0.5e9, kernels  # one layer's weights + x swept per column tile
    cost = served.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    assert cost["bytes accessed"] >= kernels
