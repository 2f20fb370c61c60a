"""KDA chunk backward with Mosaic GPU kernels (:mod:`pallas_kernels.kda.mosaic_gpu_bwd`): gradients in the Mosaic
GPU interpreter against the VJP of the fp32 reference, the kernels' lowering for sm_90 from this CPU host (one
integer index per copy, wgmma; under this JAX and under jax 0.11.2, the H200's, when that environment is present),
and on a GPU (``-m gpu``: also the two sweeps alone against their references)."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kda import reference as ref
from pallas_kernels.kda.mosaic_gpu_bwd import chunk_kda_bwd, transpose_chunks
from pallas_kernels.kda.mosaic_gpu_bwd_intra import chunk_intra_grads, chunk_intra_grads_reference
from pallas_kernels.kda.mosaic_gpu_bwd_state import (
    state_grad_pass,
    state_grad_pass_reference,
    state_sweep,
    state_sweep_reference,
)
from tests._mosaic_gpu_lowering import JAX_0112_PYTHON, lower_backward, run_under_jax_0112
from tests.test_kda_mosaic_gpu import _hopper, _inputs, _rel


def _cotangents(B, T, H):
    do = jax.random.normal(jax.random.PRNGKey(9), (B, T, H, 128), jnp.float32).astype(jnp.bfloat16)
    dht = jax.random.normal(jax.random.PRNGKey(8), (B, H, 128, 128), jnp.float32) * 0.1
    return do, dht


def _reference_grads(q, k, v, g, beta, h0, do, dht):
    """The fp32 VJP of the token-by-token reference (compiles in a tenth of the chunked one's time; the two agree
    to ~1e-6 here)."""
    f = lambda x: x.astype(jnp.float32)

    def loss(q, k, v, g, beta, h0):
        o, ht = ref.recurrent_kda(q, k, v, g, beta, None, h0, True)
        return jnp.sum(o * f(do)) + jnp.sum(ht * dht)

    return jax.jit(jax.grad(loss, argnums=range(6)))(f(q), f(k), f(v), g, f(beta), h0)


def test_interpreter_gradients_match_the_reference_vjp():
    """All five kernels in the interpreter at two sequences of three heads, T = 130 (three chunks, the last padded),
    with an initial state and a final-state cotangent; the sweeps with two state warpgroups per CTA (``v_split=1``,
    the K3 shape's). Every gradient, the initial state's included, within bf16-operand error of the fp32
    reference's VJP (``dg`` too: the per-chunk VJP's cancelling terms, module docstring of ``mosaic_gpu_bwd_intra``)."""
    B, T, H = 2, 130, 3
    q, k, v, g, beta, h0 = _inputs(B, T, H, seed=2)
    do, dht = _cotangents(B, T, H)
    bwd = jax.jit(functools.partial(chunk_kda_bwd, scale=128**-0.5, interpret=True, v_split=1))
    got = bwd(q, k, v, g, beta, initial_state=h0, do=do, dht=dht)
    want = _reference_grads(q, k, v, g, beta, h0, do, dht)
    for name, a, b, x in zip("q k v g beta h0".split(), got, want, (q, k, v, g, beta, h0), strict=True):
        assert a.shape == x.shape and a.dtype == x.dtype, name
        assert _rel(a, b) < 1e-2, name


def _state_pass_inputs(B, Tp, H):
    ks = jax.random.split(jax.random.PRNGKey(0), 7)
    tok = lambda key, d: (0.1 * jax.random.normal(key, (B, Tp, H, d), jnp.float32)).astype(jnp.bfloat16)
    aqk = tok(ks[3], 64).reshape(B, Tp // 64, 64, H, 64)
    aqk = jnp.where(jnp.tril(jnp.ones((64, 64), bool))[:, None, :], aqk, 0).reshape(B, Tp, H, 64)
    decay = jax.random.uniform(ks[4], (B, H, Tp // 64, 128), jnp.float32, 0.5, 1.0)
    dht = jax.random.normal(ks[6], (B, H, 128, 128), jnp.float32)
    return tok(ks[0], 128), tok(ks[1], 128), tok(ks[2], 128), aqk, decay, tok(ks[5], 128), dht


def _sweeps(args, v_split: int, interpret=None):
    """Both sweeps on the :func:`_state_pass_inputs` (``aqk`` also standing in for ``x``, ``do`` for ``v``) and their
    references: ``{name: (got, want)}``."""
    qg, kd, wn, aqk, decay, do, dht = args
    fwd = state_sweep(kd, wn, aqk, do, decay, dht, v_split=v_split, interpret=interpret)
    rev = state_grad_pass(*args, v_split=v_split, interpret=interpret)
    names = ("vt", "h", "ht", "dv", "dh", "dh0")
    want = (*state_sweep_reference(kd, wn, aqk, do, decay, dht), *state_grad_pass_reference(*args))
    return dict(zip(names, zip((*fwd, *rev), want, strict=True), strict=True))


def test_backward_lowers_with_wgmma_and_one_integer_index_per_copy():
    """The backward's five kernels (the forward's per-chunk kernel, two sweeps, the per-chunk products, the
    per-chunk VJP) lower for sm_90 on this CPU host, every
    copy between device and shared memory addressed with at most one integer index (the addressing that the
    interpreter does not exercise and the H200 got wrong at ``B > 1`` with several, tests/test_kda_mosaic_gpu.py)."""
    calls, wgmma, int_indices = lower_backward(1)
    assert calls == 5 and wgmma
    assert len(int_indices) >= 55 and max(int_indices) == 1, int_indices


def test_backward_lowers_under_jax_0112():
    """The same lowering under jax 0.11.2 (the H200's JAX; CI installs the newest 0.12), with the sweeps' other
    V split (one state warpgroup per CTA)."""
    if not os.path.exists(JAX_0112_PYTHON):
        pytest.skip(f"no jax 0.11.2 environment at {JAX_0112_PYTHON} (K3_JAX_0112_PYTHON)")
    out = run_under_jax_0112("""
        from tests._mosaic_gpu_lowering import lower_backward
        calls, wgmma, ints = lower_backward(2)
        assert calls == 5 and wgmma and max(ints) == 1, (calls, wgmma, ints)
    """)
    assert out.returncode == 0 and "ok 0.11.2" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("kwargs, match", [
    (dict(do=jnp.zeros((1, 64, 1, 64))), "do must be"),
    (dict(dht=jnp.zeros((1, 1, 128, 64))), "dht must be"),
    (dict(segment_ids=jnp.zeros((1, 64), jnp.int32)), "packed sequences"),
])
def test_backward_rejects_calls_outside_its_contract(kwargs, match):
    q, k, v, g, beta, _ = _inputs(1, 64, 1)
    kwargs = {"do": jnp.zeros_like(v), **kwargs}
    with pytest.raises(ValueError, match=match):
        chunk_kda_bwd(q, k, v, g, beta, 128**-0.5, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H, v_split", [(1, 256, 2, 2), (2, 300, 3, 1), (2, 300, 3, 2)])
def test_gpu_gradients_match_the_reference_vjp(B, T, H, v_split):
    if not _hopper():
        pytest.skip("needs an sm_90+ GPU")
    q, k, v, g, beta, h0 = _inputs(B, T, H, seed=T)
    do, dht = _cotangents(B, T, H)
    got = chunk_kda_bwd(q, k, v, g, beta, 128**-0.5, h0, do=do, dht=dht, v_split=v_split)
    want = _reference_grads(q, k, v, g, beta, h0, do, dht)
    for name, a, b in zip("q k v g beta h0".split(), got, want, strict=True):
        assert _rel(a, b) < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("v_split", [1, 2])
def test_gpu_sweeps_match_their_references(v_split):
    if not _hopper():
        pytest.skip("needs an sm_90+ GPU")
    for name, (a, b) in _sweeps(_state_pass_inputs(2, 256, 3), v_split).items():
        assert _rel(a, b) < 1e-2, name


@pytest.mark.gpu
def test_gpu_per_chunk_vjp_matches_its_reference():
    if not _hopper():
        pytest.skip("needs an sm_90+ GPU")
    B, Tp, H = 2, 256, 3
    q, k, _, g, beta, _ = _inputs(B, Tp, H, seed=5)
    ks = jax.random.split(jax.random.PRNGKey(6), 6)
    tok = lambda key, d: (0.1 * jax.random.normal(key, (B, Tp, H, d), jnp.float32)).astype(jnp.bfloat16)
    lower = jnp.tril(jnp.ones((64, 64), bool))[:, None, :]
    tril = lambda t: jnp.where(lower, t.reshape(B, Tp // 64, 64, H, 64), 0).reshape(t.shape)
    cts = (tok(ks[0], 128), tok(ks[1], 128), tok(ks[2], 128), tril(tok(ks[3], 64)),
           transpose_chunks(tril(tok(ks[4], 64))), 0.1 * jax.random.normal(ks[5], (B, H, Tp // 64, 128)))
    beta_t = jnp.swapaxes(beta, 1, 2)
    got = chunk_intra_grads(q, k, g, beta_t, *cts, scale=128**-0.5)
    want = chunk_intra_grads_reference(q, k, g, beta_t, *cts, scale=128**-0.5)
    for name, a, b in zip(("dq", "dk", "dg", "dbeta"), got, want, strict=True):
        assert _rel(a, b) < 1e-2, name
