"""The KDA decode step from a layer's projections (``pallas_kernels.kda.ops.fused_decode_step``): the short conv,
SiLU, q / k L2 norm, gate and beta (``reference.decode_prologue``) then the decode update, on a stack of layers'
states and conv tails read at one layer.

On CPU every backend runs in interpret mode against the reference composition (the prologue, then the recurrent
reference on that layer's states): ``triton`` is the fused kernel (:mod:`pallas_kernels.kda.gpu_decode_fused`),
the others take the prologue in JAX. The prologue itself equals the layer's unfused path (``causal_depthwise_conv``
+ ``activate_conv_output`` + ``kda_gate``). The ``gpu`` test runs the compiled fused kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.layers.kda import activate_conv_output, causal_depthwise_conv
from pallas_kernels.kda import gpu_decode_fused, ops
from pallas_kernels.kda import reference as ref
from tests.test_kda_ops import rel
from tests.test_triton_lowering import _lower_for_cuda, verified_modules  # noqa: F401  (the fixture)

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def make_inputs(L=2, B=3, H=4, K=32, V=32, W=4, dtype=jnp.bfloat16, seed=0):
    """``(projections q, k, v, f, b; states [L, B, H, K, V]; conv tails [L, B, W-1, C]; conv weights, A_log,
    dt_bias stacked over L)``: raw gates wide enough to reach the gate's saturated ends."""
    ks = jax.random.split(jax.random.key(seed), 12)
    n = lambda key, shape, s=1.0: jax.random.normal(key, shape, jnp.float32) * s
    q, k = n(ks[0], (B, H * K)).astype(dtype), n(ks[1], (B, H * K)).astype(dtype)
    v = n(ks[2], (B, H * V)).astype(dtype)
    f, b = n(ks[3], (B, H * K), 4.0).astype(dtype), n(ks[4], (B, H)).astype(dtype)
    state = n(ks[5], (L, B, H, K, V), 0.3)
    conv = n(ks[6], (L, B, W - 1, 2 * H * K + H * V)).astype(dtype)
    weights = tuple(n(key, (L, W, H * d), 0.5) for key, d in zip(ks[7:10], (K, K, V), strict=True))
    a_log = jnp.log(jax.random.uniform(ks[10], (L, H), minval=1.0, maxval=16.0))
    dt_bias = n(ks[11], (L, H * K), 0.5)
    return (q, k, v, f, b), state, conv, weights, a_log, dt_bias


def reference_step(proj, state, conv, weights, a_log, dt_bias, layer: int):
    """The composition the op promises: the prologue on ``layer``'s slices, the recurrent reference on its states."""
    q, k, v, g, beta, tail = ref.decode_prologue(*proj, conv[layer], tuple(w[layer] for w in weights), a_log[layer],
                                                 dt_bias[layer])
    o, ht = ref.recurrent_kda(q, k, v, g, beta, None, state[layer], True)
    return o[:, 0], ht, tail


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu", "xla"])
def test_fused_decode_step_matches_the_reference_composition(backend):
    """Outputs, the layer's new states and conv tails as the reference composition; the other layer's states
    untouched."""
    proj, state, conv, weights, a_log, dt_bias = make_inputs()
    want_o, want_state, want_tail = reference_step(proj, state, conv, weights, a_log, dt_bias, 1)
    o, new_state, tail = jax.jit(lambda *a: ops.fused_decode_step(*a, implementation=backend, interpret=True))(
        *proj, state, conv, weights, a_log, dt_bias, jnp.int32(1))
    assert o.shape == want_o.shape and o.dtype == jnp.bfloat16
    assert rel(o, want_o) < 1e-5 and rel(new_state[1], want_state) < 1e-6, (rel(o, want_o), rel(new_state[1],
                                                                                                  want_state))
    np.testing.assert_array_equal(np.asarray(tail), np.asarray(want_tail))
    np.testing.assert_array_equal(np.asarray(new_state[0]), np.asarray(state[0]))


def test_triton_fused_decode_with_several_v_slices_and_k_not_v_interpret():
    """The fused kernel's flat grid with four V slices per state and V != K: the slice-0 program writes the head's
    q / k tail, every program its v columns; layer 0 of two."""
    proj, state, conv, weights, a_log, dt_bias = make_inputs(B=2, H=3, K=32, V=64, seed=1)
    want_o, want_state, want_tail = reference_step(proj, state, conv, weights, a_log, dt_bias, 0)
    o, new_state, tail = gpu_decode_fused.fused_decode_step(
        *proj, state, conv, weights, a_log, dt_bias, jnp.int32(0), scale=32**-0.5, lower_bound=-5.0, block_v=16,
        interpret=True)
    assert rel(o, want_o) < 1e-5 and rel(new_state[0], want_state) < 1e-6
    np.testing.assert_array_equal(np.asarray(tail), np.asarray(want_tail))
    np.testing.assert_array_equal(np.asarray(new_state[1]), np.asarray(state[1]))


def test_prologue_equals_the_layers_unfused_path():
    """``decode_prologue`` = the layer's one-token conv (``causal_depthwise_conv``), ``activate_conv_output``,
    ``kda_gate`` and the beta sigmoid, to the bit (bf16 projections, bf16 tails)."""
    (q, k, v, f, b), _, conv, weights, a_log, dt_bias = make_inputs(L=1, B=2, H=2, K=16, V=16)
    got = ref.decode_prologue(q, k, v, f, b, conv[0], tuple(w[0] for w in weights), a_log[0], dt_bias[0])
    hk = q.shape[-1]
    tails = jnp.split(conv[0], [hk, 2 * hk], axis=-1)
    for i, (u, tail, w, normalize) in enumerate(zip((q, k, v), tails, weights, (True, True, False), strict=True)):
        o, new = causal_depthwise_conv(u[:, None], w[0], tail, None)
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(activate_conv_output(o, 2, normalize,
                                                                                           jnp.bfloat16)))
        np.testing.assert_array_equal(np.asarray(jnp.split(got[5], [hk, 2 * hk], axis=-1)[i]), np.asarray(new))
    g = ref.kda_gate(f.reshape(2, 1, 2, 16), a_log[0], dt_bias[0])
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(g))
    np.testing.assert_array_equal(np.asarray(got[4]), np.asarray(jax.nn.sigmoid(b.astype(jnp.float32))[:, None]))


def test_fused_decode_step_names_a_misshapen_argument():
    proj, state, conv, weights, a_log, dt_bias = make_inputs()
    with pytest.raises(ValueError, match=r"wv must be \[2, 4, 128\]"):
        ops.fused_decode_step(*proj, state, conv, (*weights[:2], weights[2][:, :, :-1]), a_log, dt_bias,
                              jnp.int32(0), implementation="xla")
    with pytest.raises(ValueError, match="conv must be"):
        ops.fused_decode_step(*proj, state, conv[:, :, :, :-1], weights, a_log, dt_bias, jnp.int32(0),
                              implementation="xla")


def test_fused_decode_kernel_lowers(verified_modules):  # noqa: F811
    """The fused kernel at K3's head dims lowers to a verified Triton module for sm_90 (bf16 projections)."""
    proj, state, conv, weights, a_log, dt_bias = make_inputs(L=2, B=2, H=2, K=128, V=128)
    _lower_for_cuda(lambda *a: gpu_decode_fused.fused_decode_step(*a, scale=128**-0.5, lower_bound=-5.0),
                    *proj, state, conv, weights, a_log, dt_bias, jnp.int32(1))
    assert verified_modules == ["kda_fused_decode_gpu"], verified_modules


@pytest.mark.gpu
def test_fused_decode_on_gpu():
    """The compiled fused kernel (``auto`` picks ``triton`` on a GPU) against the reference composition at K3's head
    dims: bf16 outputs within bf16 rounding (its exp / sigmoid / rsqrt differ from XLA's in the last bits), tails
    exact."""
    proj, state, conv, weights, a_log, dt_bias = make_inputs(L=3, B=5, H=8, K=128, V=128, seed=2)
    want_o, want_state, want_tail = reference_step(proj, state, conv, weights, a_log, dt_bias, 2)
    o, new_state, tail = jax.jit(lambda *a: ops.fused_decode_step(*a), donate_argnums=(5,))(
        *proj, jnp.array(state), conv, weights, a_log, dt_bias, jnp.int32(2))
    assert rel(o, want_o) < 1e-2 and rel(new_state[2], want_state) < 1e-3
    np.testing.assert_array_equal(np.asarray(tail), np.asarray(want_tail))
    np.testing.assert_array_equal(np.asarray(new_state[:2]), np.asarray(state[:2]))
