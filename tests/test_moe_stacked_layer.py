"""Expert kernels reading one layer of a stacked ``[L, E, ...]`` weight in place (``layer=``, the one-token decode
path of a scanned layer segment): the same outputs as the kernel on that layer's slice (GPU Triton and Mosaic TPU
kernels in their interpreters on CPU), and which experts dicts the model hands over stacked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.config import load_config
from k3_jax.layers.moe import stacked_routed_experts
from k3_jax.quant import pack_mxfp4
from pallas_kernels import moe
from pallas_kernels.moe import gpu, tpu

L, E, LAT, INTER, M = 3, 4, 64, 32, 24
SIZES = jnp.array([5, 0, 12, 3], jnp.int32)  # an empty expert and trailing rows


def _stacks(key, mxfp4: bool) -> dict:
    """Stacked ``w1, w3 [L, E, LAT, INTER]``, ``w2 [L, E, INTER, LAT]`` (f32), or their MXFP4 dicts (HF layout)."""
    ks = jax.random.split(key, 3)
    shapes = {"w1": (LAT, INTER), "w3": (LAT, INTER), "w2": (INTER, LAT)}
    out = {}
    for k, (w, (din, dout)) in zip(ks, shapes.items(), strict=True):
        dense = 0.1 * jax.random.normal(k, (L, E, din, dout))
        if mxfp4:
            packed, scale = pack_mxfp4(jnp.swapaxes(dense, -1, -2))
            out[w] = {"weight_packed": packed, "weight_scale": scale}
        else:
            out[w] = dense
    return out


@pytest.mark.parametrize("impl", ["triton", "mosaic_tpu"])
@pytest.mark.parametrize("mxfp4", [False, True], ids=["f32", "mxfp4"])
def test_stacked_expert_ffn_equals_the_layer_slice(mxfp4, impl):
    if impl == "mosaic_tpu" and jax.default_backend() != "cpu":
        pytest.skip("mosaic_tpu runs in interpret mode on a CPU target only (the registry refuses a GPU target)")
    x = jax.random.normal(jax.random.key(0), (M, LAT))
    w = _stacks(jax.random.key(1), mxfp4)

    ffn = lambda w1, w3, w2, layer=None: moe.expert_ffn(x, SIZES, w1, w3, w2, implementation=impl,
                                                        interpret=True, layer=layer)

    @jax.jit
    def both(layer):  # one compile: the stack read at a traced layer, and the kernel on that layer's slice
        one = jax.tree.map(lambda a: a[L - 1], w)
        return ffn(w["w1"], w["w3"], w["w2"], layer), ffn(one["w1"], one["w3"], one["w2"])

    got, want = both(jnp.int32(L - 1))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.abs(np.asarray(got[: int(SIZES.sum())])).max() > 0


def test_stacked_gmm_checks_the_stack_and_is_forward_only():
    x = jnp.ones((8, LAT))
    w = _stacks(jax.random.key(2), False)["w1"]
    gs = jnp.array([8, 0, 0, 0], jnp.int32)
    with pytest.raises(ValueError, match=r"stacked \[L, \.\.\.\] with 4 dims, got shape \(4, 64, 32\)"):
        gpu.gmm(x, w[0], gs, interpret=True, layer=jnp.int32(0))
    with pytest.raises(NotImplementedError, match="forward-only"):
        jax.grad(lambda a: gpu.gmm(a, w, gs, interpret=True, layer=jnp.int32(1)).sum())(x)


def test_tpu_stacked_kernels_check_the_stack_and_are_forward_only():
    x = jnp.ones((8, LAT))
    w = _stacks(jax.random.key(3), False)["w1"]
    q = _stacks(jax.random.key(3), True)["w1"]
    gs = jnp.array([8, 0, 0, 0], jnp.int32)
    with pytest.raises(ValueError, match=r"tpu.gmm: expert weight of shape \(4, 64, 32\) must have 4 dims"):
        tpu.gmm(x, w[0], gs, interpret=True, layer=jnp.int32(0))
    with pytest.raises(ValueError, match=r"tpu.gmm_mxfp4: expert weight of shape \(3, 4, 32, 32\) must have 3 dims"):
        tpu.gmm_mxfp4(x, [(q["weight_packed"], q["weight_scale"])], gs, interpret=True)
    with pytest.raises(NotImplementedError, match="forward-only"):
        jax.grad(lambda a: tpu.gmm(a, w, gs, interpret=True, layer=jnp.int32(1)).sum())(x)


def test_which_experts_are_handed_over_stacked():
    cfg = load_config("configs/k3-tiny.json")
    bf16 = {"w1": jnp.zeros((2, 1)), "w2": jnp.zeros((2, 1)), "w3": jnp.zeros((2, 1))}
    assert stacked_routed_experts(cfg, bf16) is not None
    assert stacked_routed_experts(cfg, {**bf16, "w1_lora_a": jnp.zeros(1)}) is None  # adapters merged per layer
    assert stacked_routed_experts(cfg.replace(qat="mxfp4"), bf16) is None  # fake quantised per layer
    assert stacked_routed_experts(cfg, None) is None


@pytest.mark.gpu
@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
def test_stacked_expert_ffn_compiled_on_gpu(mxfp4):
    """The compiled Triton kernels (bf16 activations) on the stack at a traced layer equal them on its slice."""
    x = jax.random.normal(jax.random.key(5), (64, LAT), jnp.bfloat16)
    w = jax.tree.map(lambda a: a if a.dtype == jnp.uint8 else a.astype(jnp.bfloat16), _stacks(jax.random.key(6), mxfp4))
    gs = jnp.array([20, 0, 30, 10], jnp.int32)
    ffn = lambda w1, w3, w2, layer=None: moe.expert_ffn(x, gs, w1, w3, w2, implementation="triton", layer=layer)

    @jax.jit
    def both(layer):
        one = jax.tree.map(lambda a: a[1], w)
        return ffn(w["w1"], w["w3"], w["w2"], layer), ffn(one["w1"], one["w3"], one["w2"])

    got, want = both(jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert np.abs(np.asarray(got[:60], np.float32)).max() > 0
