"""The speculative verify pass's KDA on TPU (``mosaic_tpu`` of ``pallas_kernels.kda.verify.VERIFY``,
``pallas_kernels.kda.verify_tpu``): the Mosaic kernel in the TPU interpreter against the reference and against T
steps of the TPU decode kernel (outputs and every state), the registry's choices on a TPU target (auto takes it and
logs so; a T whose states do not fit VMEM is refused with the reason), the KDA layer's verify pass traced for a TPU
(one kernel, no decode steps) and the AOT compile for v5p and v6e at K3's shapes (needs libtpu)."""

from __future__ import annotations

import importlib.util
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import ops, verify, verify_tpu
from pallas_kernels.registry import KernelUnavailable, clear_selections
from tests._jaxpr_walk import iter_eqns
from tests.test_speculative_kda_verify import _decode_steps, _inputs


@pytest.mark.parametrize("dtype, shape", [(jnp.float32, (2, 3, 2, 128, 128)), (jnp.bfloat16, (1, 3, 16, 32, 128))],
                         ids=["fp32-K128", "bf16-H16"])
def test_kernel_equals_decode_kernel_steps_and_reference_interpret(dtype, shape):
    """Outputs and the state after every token equal T steps of the Mosaic TPU decode kernel (the same per-token
    arithmetic) and the reference steps; H = 16 runs two head blocks of 8."""
    b, t, h, k, v = shape
    args = _inputs(4, b, t, h, k, v, dtype=dtype)
    o, states = verify.recurrent_kda_states(*args, implementation="mosaic_tpu", interpret=True)
    assert o.shape == (b, t, h, v) and o.dtype == dtype
    assert states.shape == (b, t, h, k, v) and states.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(o, np.float32))) and np.all(np.isfinite(np.asarray(states)))
    o_dec, st_dec = _decode_steps(*args, "mosaic_tpu", True)
    np.testing.assert_allclose(np.asarray(states), np.asarray(st_dec), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_dec, np.float32), rtol=0,
                               atol=1e-6 if dtype == jnp.float32 else 2e-2)
    o_ref, st_ref = verify.recurrent_kda_states(*args, implementation="xla")
    np.testing.assert_allclose(np.asarray(states), np.asarray(st_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), rtol=1e-5,
                               atol=1e-5 if dtype == jnp.float32 else 2e-2)


def test_registry_on_a_tpu_target(caplog):
    """``auto`` takes the kernel on a TPU and logs the choice; a T whose states overflow the scoped VMEM is passed
    over for ``xla`` (logged as a fallback) and an explicit ``mosaic_tpu`` raises naming VMEM."""
    q = jnp.zeros((4, 5, 96, 128), jnp.bfloat16)
    call = ops.make_call(q, q, 64, None, False, "tpu")
    assert verify_tpu.vmem_bytes(5, 96, 128, 128, 2) < verify_tpu.VMEM_LIMIT
    clear_selections()
    with caplog.at_level(logging.INFO, logger="pallas_kernels"):
        assert verify.VERIFY.select("auto", call).backend == "mosaic_tpu"
    assert "kda.verify: mosaic_tpu (auto" in caplog.text
    long_q = jnp.zeros((1, 32, 96, 128), jnp.bfloat16)
    long_call = ops.make_call(long_q, long_q, 64, None, False, "tpu")
    with caplog.at_level(logging.INFO, logger="pallas_kernels"):
        sel = verify.VERIFY.select("auto", long_call)
    assert sel.backend == "xla" and "VMEM" in dict(sel.passed_over)["mosaic_tpu"]
    assert any(r.levelno == logging.WARNING and "kda.verify: xla" in r.getMessage() for r in caplog.records)
    with pytest.raises(KernelUnavailable, match="mosaic_tpu.*T=32 tokens.*VMEM"):
        verify.VERIFY.select("mosaic_tpu", long_call, record=False)


def test_layer_verify_pass_is_one_kernel_per_layer_on_tpu():
    """Traced for a TPU target, the KDA layer's verify pass (record_position_states, T = 5) calls the verify kernel
    once and no decode step."""
    from tests._model_fixtures import kda_verify_pass

    verify_pass, params, x, cache, _ = kda_verify_pass("tpu")
    names = [e.params["name"] for e in iter_eqns(verify_pass, params, x, cache) if e.primitive.name == "pallas_call"]
    assert names == [verify_tpu.KERNEL_NAME], names


@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2"])
def test_aot_compile_k3_shapes(topology):
    """K3's verify call (B = 4, k + 1 = 5 tokens, H = 96, K = V = 128, bf16 vectors, f32 gate and beta) compiles
    for the chip with libtpu: one Mosaic kernel and nothing else of size (XLA's bytes within 1 % of the floor: the
    states read once, the five states written, the vectors read and the outputs written once; no stacked per-token
    states in temp memory)."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install -e '.[aot]')")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    try:
        dev = topologies.get_topology_desc(topology, platform="tpu").devices[0]
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"libtpu cannot describe topology {topology}: {type(exc).__name__}: {exc}")
    sh = SingleDeviceSharding(dev)
    B, T, H, K, V = 4, 5, 96, 128, 128
    bf, f32 = jnp.bfloat16, jnp.float32
    shapes = [((B, T, H, K), bf), ((B, T, H, K), bf), ((B, T, H, V), bf), ((B, T, H, K), f32), ((B, T, H), f32),
              ((B, H, K, V), f32)]
    args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in shapes]
    fn = jax.jit(lambda *a: verify.recurrent_kda_states(*a, platform="tpu"))
    compiled = fn.lower(*args).compile()
    text = compiled.as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == 1 and verify_tpu.KERNEL_NAME in text
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    states = B * H * K * V * 4
    floor = (1 + T) * states + sum(a.size * a.dtype.itemsize for a in args[:5]) + B * T * H * V * 2  # + o
    assert floor <= cost["bytes accessed"] < 1.01 * floor, (cost["bytes accessed"], floor)
    assert compiled.memory_analysis().temp_size_in_bytes < states // 8

