"""Chunked cross-entropy equals the unchunked reference (value and gradients) with masking and padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.training.loss import chunked_cross_entropy, reference_cross_entropy


@pytest.mark.parametrize("chunk", [7, 16, 1000])
def test_chunked_matches_reference(chunk):
    rng = np.random.default_rng(0)
    b, t, d, v = 2, 12, 8, 50
    h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)) * 0.3, jnp.float32)
    y = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
    mask = jnp.asarray(rng.random((b, t)) > 0.3)

    def f(h, w):
        return chunked_cross_entropy(h, w, y, mask, chunk_size=chunk, compute_dtype=jnp.float32)[0]

    def g(h, w):
        return reference_cross_entropy(h, w, y, mask)[0]

    np.testing.assert_allclose(f(h, w), g(h, w), rtol=1e-5)
    gf, gg = jax.grad(f, argnums=(0, 1))(h, w), jax.grad(g, argnums=(0, 1))(h, w)
    for a, b_ in zip(gf, gg, strict=True):
        np.testing.assert_allclose(a, b_, rtol=1e-4, atol=1e-6)
    _, n, correct = chunked_cross_entropy(h, w, y, mask, chunk_size=chunk)
    assert float(n) == float(mask.sum()) and 0 <= float(correct) <= float(n)


def test_chunked_never_builds_full_logits():
    """The jaxpr of the chunked loss holds no [N, V] f32 array (N = all tokens)."""
    b, t, d, v = 4, 64, 8, 512
    h = jnp.zeros((b, t, d), jnp.bfloat16)
    w = jnp.zeros((d, v), jnp.float32)
    y = jnp.zeros((b, t), jnp.int32)
    m = jnp.ones((b, t), bool)
    jaxpr = jax.make_jaxpr(jax.grad(lambda h, w: chunked_cross_entropy(h, w, y, m, chunk_size=32)[0],
                                    argnums=(0, 1)))(h, w)
    shapes = {tuple(getattr(x.aval, "shape", ())) for eqn in jaxpr.jaxpr.eqns for x in eqn.outvars}
    assert all(s[-1:] != (v,) or np.prod(s) <= 32 * v for s in shapes)  # at most one chunk of logits
    assert not any(s in ((b * t, v), (b, t, v)) for s in shapes)


def test_chunked_bf16_matches_reference_and_keeps_f32_lm_head_gradient():
    """bf16 hidden with f32 master lm_head: bf16 GEMMs (both directions), the kernel's gradient in f32."""
    rng = np.random.default_rng(1)
    b, t, d, v = 2, 40, 32, 96
    h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(d, v)) * 0.2, jnp.float32)
    y = jnp.asarray(rng.integers(0, v, size=(b, t)), jnp.int32)
    mask = jnp.ones((b, t), bool)

    def f(h, w):
        return chunked_cross_entropy(h, w, y, mask, chunk_size=16)[0]

    def g(h, w):  # the same bf16-rounded operands, all in f32
        return reference_cross_entropy(h.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32),
                                       y, mask)[0]

    np.testing.assert_allclose(f(h, w), g(h, w), rtol=1e-4)
    (gh, gw), (rh, rw) = jax.grad(f, argnums=(0, 1))(h, w), jax.grad(g, argnums=(0, 1))(h, w)
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.float32
    for a, r in ((gh, rh), (gw, rw)):
        err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
        assert err < 2e-2, err
