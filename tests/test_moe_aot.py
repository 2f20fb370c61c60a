"""Ahead-of-time compile of the TPU MoE kernels for v5p and v6e on this CPU host (needs ``libtpu``).

K3 expert shapes: latent L = 3584, expert width I = 3072, a slice of E = 8 of the 896 experts (the kernels'
per-expert tiles do not depend on E), 1024 routed rows.
"""

import importlib.util
import os

import pytest

if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed (pip install -e '.[aot]')", allow_module_level=True)
# Several test processes may load libtpu at once for compile-only work; its lock file would refuse that.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from pallas_kernels.moe import ops, tpu  # noqa: E402

E, L, I, M = 8, 3584, 3072, 1024


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
    codes, scales = spec((E, L // 2, I), jnp.uint8), spec((E, L // 32, I), jnp.uint8)

    def train_ffn(x, w1, w3, w2, gs):
        def loss(x, w1, w3, w2):
            h = ops.tpu_glu_fn(4.0, 25.0, False)(x, w1, w3, gs)  # fused kernel, kernel backward
            return jnp.sum(tpu.gmm(h, w2, gs).astype(jnp.float32))

        # gmm forward + its kernel backward (transposed gmm, tgmm) on both expert matmul shapes
        return jax.grad(loss, argnums=(0, 1, 2, 3))(x, w1, w3, w2)

    def serve_mxfp4(x, c1, s1, c3, s3, gs):
        return tpu.gmm_mxfp4(x, [(c1, s1), (c3, s3)], gs, epilogue=tpu.situ_epilogue(4.0, 25.0, jnp.bfloat16))

    jax.jit(train_ffn).lower(x, w13, w13, w2, gs).compile()
    jax.jit(serve_mxfp4).lower(x, codes, scales, codes, scales, gs).compile()
