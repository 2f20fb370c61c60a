"""The verification step's KDA over T tokens with every state (pallas_kernels.kda.verify): the Triton kernel (Pallas
interpreter on CPU, compiled on a GPU) against T one-token decode steps of the decode kernel and of the reference,
and the registry's choices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import ops, verify
from pallas_kernels.kda import reference as ref
from pallas_kernels.registry import KernelUnavailable


def _inputs(seed: int, b: int = 2, t: int = 3, h: int = 2, k: int = 32, v: int = 128, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (b, t, h, k)).astype(dtype)
    kk = ref.l2norm(jax.random.normal(ks[1], (b, t, h, k))).astype(dtype)
    vv = jax.random.normal(ks[2], (b, t, h, v)).astype(dtype)
    g = -jax.random.uniform(ks[3], (b, t, h, k), minval=0.0, maxval=3.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
    s0 = jax.random.normal(ks[5], (b, h, k, v))
    return q, kk, vv, g, beta, s0


def _decode_steps(q, k, v, g, beta, s0, implementation: str, interpret: bool):
    """T one-token decode steps (``ops.recurrent_kda``, the DECODE registry): outputs and the state after each."""
    outs, states, s = [], [], s0
    for t in range(q.shape[1]):
        o, s = ops.recurrent_kda(*(a[:, t:t + 1] for a in (q, k, v, g, beta)), initial_state=s,
                                 output_final_state=True, implementation=implementation, interpret=interpret)
        outs.append(o)
        states.append(s)
    return jnp.concatenate(outs, axis=1), jnp.stack(states, axis=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_triton_kernel_equals_decode_steps_interpret(dtype):
    """The kernel's outputs and per-token states equal T decode-kernel steps (same arithmetic per token) and
    the reference steps; every output element is written."""
    args = _inputs(0, dtype=dtype)
    o, states = verify.recurrent_kda_states(*args, implementation="triton", interpret=True)
    o_dec, st_dec = _decode_steps(*args, "triton", True)
    o_ref, st_ref = verify.recurrent_kda_states(*args, implementation="xla")
    assert o.shape == o_ref.shape and o.dtype == args[2].dtype and states.shape == (2, 3, 2, 32, 128)
    assert states.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(o, np.float32))) and np.all(np.isfinite(np.asarray(states)))
    np.testing.assert_allclose(np.asarray(states), np.asarray(st_dec), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_dec, np.float32), rtol=0,
                               atol=1e-6 if dtype == jnp.float32 else 2e-2)
    np.testing.assert_allclose(np.asarray(states), np.asarray(st_ref), rtol=1e-5, atol=1e-5)


def test_triton_kernel_at_both_slice_widths_interpret():
    """Both V slice widths the kernel takes (32 and 64 columns: four and two programs per state on the flat grid)
    give the reference's outputs and states; the width follows the program count."""
    args = _inputs(4, b=3, t=2, h=3, k=16, v=128)
    o_ref, st_ref = verify.recurrent_kda_states(*args, implementation="xla")
    for bv in (32, 64):
        o, states = verify.triton_states(*args[:5], 16**-0.5, args[5], block_v=bv, interpret=True)
        np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-5, atol=1e-5, err_msg=f"block_v={bv}")
        np.testing.assert_allclose(np.asarray(states), np.asarray(st_ref), rtol=1e-5, atol=1e-5,
                                   err_msg=f"block_v={bv}")
    assert verify.slice_width(1, 96, 128) == 32 and verify.slice_width(16, 96, 128) == 64
    assert verify.slice_width(64, 96, 32) == 32 and verify.slice_width(1, 2, 16) == 16


def test_reference_states_equal_the_scan():
    """The ``xla`` backend's last state and outputs are the reference recurrence's over the T tokens."""
    args = _inputs(1, t=4)
    o, states = verify.recurrent_kda_states(*args, implementation="xla")
    o_scan, s_scan = ref.recurrent_kda(*args[:5], None, args[5], True)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_scan), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(states[:, -1]), np.asarray(s_scan), rtol=1e-5, atol=1e-5)
    _, s2 = ref.recurrent_kda(*(a[:, :2] for a in args[:5]), None, args[5], True)
    np.testing.assert_allclose(np.asarray(states[:, 1]), np.asarray(s2), rtol=1e-5, atol=1e-5)


def test_registry_choices():
    args = _inputs(2)
    call = ops.make_call(args[0], args[2], 64, None, False, "cpu")
    assert verify.VERIFY.select("auto", call, record=False).backend == "xla"
    with pytest.raises(KernelUnavailable, match="triton.*needs target platform gpu"):
        verify.recurrent_kda_states(*args, implementation="triton", platform="cpu")
    with pytest.raises(ValueError, match="initial_state"):
        verify.recurrent_kda_states(*args[:5], None)
    with pytest.raises(ValueError, match="beta must be"):
        verify.recurrent_kda_states(*args[:4], args[4][:, :2], args[5])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 5, 8, 128, 128), (4, 7, 3, 128, 128)])
def test_gpu_kernel_equals_decode_kernel_steps(shape):
    """On the GPU: the kernel's states equal T steps of the Triton decode kernel (the plain engine's decode)."""
    b, t, h, k, v = shape
    args = _inputs(3, b, t, h, k, v, dtype=jnp.bfloat16)
    o, states = jax.jit(lambda *a: verify.recurrent_kda_states(*a, implementation="triton"))(*args)
    o_dec, st_dec = jax.jit(lambda *a: _decode_steps(*a, "triton", False))(*args)
    np.testing.assert_allclose(np.asarray(states), np.asarray(st_dec), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_dec, np.float32), rtol=0, atol=1e-2)
    o_ref, st_ref = _decode_steps(*(np.asarray(a, np.float32) for a in args), "xla", False)
    rel = np.linalg.norm(np.asarray(states) - np.asarray(st_ref)) / np.linalg.norm(np.asarray(st_ref))
    assert rel < 1e-3, rel


def test_layer_verify_pass_is_one_kernel_per_layer_on_gpu():
    """Traced for a GPU target, the KDA layer's verify pass (record_position_states, T = 5) calls the verify
    kernel once and no decode step; its cache entry carries the per-token state and conv traces."""
    from tests._jaxpr_walk import iter_eqns
    from tests._model_fixtures import kda_verify_pass

    verify_pass, params, x, cache, cfg = kda_verify_pass("gpu", "bfloat16")
    h, dk, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    names = [e.params["name"] for e in iter_eqns(verify_pass, params, x, cache) if e.primitive.name == "pallas_call"]
    assert names == ["kda_verify_gpu"], names
    _, entry = jax.eval_shape(verify_pass, params, x, cache)
    assert entry["state_trace"].shape == (2, 5, h, dk, dk) and entry["conv_trace"].shape == (2, w - 1 + 5, 3 * h * dk)
