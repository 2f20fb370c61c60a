"""K3-routing MXFP4 decode (64 tokens, top-16 of 896 experts): nothing materialises beyond the packed weights.

Regression for ``benchmarks/moe.py --parts decode`` dying with ``RESOURCE_EXHAUSTED`` on the H200: drawing the
random ``[896, 3072, 1792]`` codes in one ``jax.random.bits`` call held u32 threefry temporaries of that shape
(73.5 GiB as compiled, for a 4.6 GiB result). Both checks run on CPU from abstract shapes (nothing allocated).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.extend as jex
import jax.numpy as jnp
import pytest

from pallas_kernels.moe import ops

E, TOPK, T, LAT, INTER = 896, 16, 64, 3584, 3072
GIB = 2**30


def _bench_module():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "moe.py"
    spec = importlib.util.spec_from_file_location("_bench_moe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mx(e: int, n: int, k: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {"weight_packed": jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8),
            "weight_scale": jax.ShapeDtypeStruct((e, n, k // 32), jnp.uint8)}


def _largest_intermediate(jaxpr: jex.core.Jaxpr) -> tuple[int, str]:
    """``(bytes, description)`` of the largest value any equation (nested jaxprs included) produces."""
    best = (0, "")
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            aval = v.aval
            if hasattr(aval, "shape"):
                nbytes = aval.size * aval.dtype.itemsize
                best = max(best, (nbytes, f"{eqn.primitive} {aval.shape} {aval.dtype}"))
        for p in eqn.params.values():
            sub = p.jaxpr if isinstance(p, jex.core.ClosedJaxpr) else p
            if isinstance(sub, jex.core.Jaxpr):
                best = max(best, _largest_intermediate(sub))
    return best


def test_k3_routing_weight_generator_temporaries_are_small():
    """The benchmark's weight generator at K3 shapes: temporaries well under the 4.6 GiB of codes it returns."""
    gen = _bench_module().random_mxfp4
    mem = gen.lower(jax.random.key(0), E, INTER, LAT).compile().memory_analysis()
    codes_bytes = E * INTER * LAT // 2
    assert mem.output_size_in_bytes >= codes_bytes
    assert mem.temp_size_in_bytes < GIB, f"temporaries {mem.temp_size_in_bytes / GIB:.1f} GiB"


@pytest.mark.parametrize("layers", [None, 3], ids=["one_layer", "stacked"])
def test_k3_routing_triton_dispatch_materialises_no_weight_copy(layers):
    """Dispatch + fused MXFP4 FFN + combine traced for the GPU kernels: no value of the program is larger than
    64 MiB (the packed weights are arguments; a dequantised or widened copy of one expert tensor is >= 4.6 GiB).
    ``stacked``: the weights of 3 layers ``[3, E, ...]`` read at a layer index, with no slice of one layer."""
    stack = (lambda d: d) if layers is None else (
        lambda d: {k: jax.ShapeDtypeStruct((layers, *v.shape), v.dtype) for k, v in d.items()})
    args = (jax.ShapeDtypeStruct((T, LAT), jnp.bfloat16), jax.ShapeDtypeStruct((T, TOPK), jnp.int32),
            jax.ShapeDtypeStruct((T, TOPK), jnp.float32),
            {"w1": stack(_mx(E, INTER, LAT)), "w3": stack(_mx(E, INTER, LAT)), "w2": stack(_mx(E, LAT, INTER))})
    layer = None if layers is None else jnp.int32(1)
    fn = lambda z, ids, w, ex: ops.moe_dispatch_combine(z, ids, w, ex, implementation="triton", platform="gpu",
                                                        layer=layer)
    nbytes, what = _largest_intermediate(jax.make_jaxpr(fn)(*args).jaxpr)
    assert nbytes <= 64 * 2**20, what
