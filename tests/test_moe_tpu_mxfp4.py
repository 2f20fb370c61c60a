"""The Mosaic TPU MXFP4 grouped matmul (Pallas interpreter on CPU) reads the HF layout as stored (codes
``[E, N, K/2]``, scales ``[E, N, K/32]``) and decodes it exactly: f32 activations give the dequantised reference's
products up to summation order, with a different E8M0 scale in every 32-element block of every row."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe import reference as ref
from pallas_kernels.moe import tpu

E, K, N, M = 3, 256, 256, 40
SIZES = jnp.array([9, 0, 23], jnp.int32)  # an empty expert and 8 trailing rows


def _weight(key):
    """Random MXFP4 ``{"weight_packed": u8 [E, N, K/2], "weight_scale": u8 [E, N, K/32]}`` (scales 2^-6..2^3)."""
    kc, ks = jax.random.split(key)
    codes = jax.random.bits(kc, (E, N, K // 2), jnp.uint8)
    scales = jax.random.randint(ks, (E, N, K // 32), 121, 131).astype(jnp.uint8)
    return {"weight_packed": codes, "weight_scale": scales}


def _reference(x, w, sizes):
    return ref.grouped_matmul(x, ref.dense_expert_weight(w, jnp.float32), sizes)


def test_gmm_mxfp4_reads_the_hf_layout_exactly():
    x = jax.random.normal(jax.random.key(0), (M, K))
    w = _weight(jax.random.key(1))
    got = tpu.gmm_mxfp4(x, [(w["weight_packed"], w["weight_scale"])], SIZES, tn=128, interpret=True)
    want = _reference(x, w, SIZES)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6 * scale)
    assert np.all(np.asarray(got[int(SIZES.sum()):]) == 0)


def test_gmm_mxfp4_two_weights_with_epilogue():
    x = jax.random.normal(jax.random.key(2), (M, K))
    w1, w3 = _weight(jax.random.key(3)), _weight(jax.random.key(4))
    epi = ref.situ_epilogue(4.0, 25.0, jnp.float32)
    got = tpu.gmm_mxfp4(x, [(w["weight_packed"], w["weight_scale"]) for w in (w1, w3)], SIZES, epilogue=epi,
                        interpret=True)
    rows = int(SIZES.sum())
    want = epi(_reference(x, w1, SIZES), _reference(x, w3, SIZES))[:rows]
    # products of two accumulators of magnitude ~100 in the epilogue: relative, not absolute, agreement
    np.testing.assert_allclose(np.asarray(got[:rows]), np.asarray(want), rtol=2e-4, atol=1e-5 * float(
        jnp.max(jnp.abs(want))))
