"""Step 6 of the KDA chunk backward on Mosaic GPU (:mod:`pallas_kernels.kda.mosaic_gpu_bwd_dqkw`): the kernel in the
Mosaic GPU interpreter against a plain-JAX restatement of gpu_bwd's ``_dqkw_kernel`` and against that Triton kernel
itself (Pallas interpret mode), packed documents across a chunk boundary; the contract checks; the lowering for
sm_90 at K3's shape from this CPU host (jax 0.12 and the H200's 0.11.2); on a GPU (``-m gpu``) the compiled kernel
against the reference at K3's shape."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.kda import gpu_bwd
from pallas_kernels.kda import mosaic_gpu_bwd_dqkw as dqkw_mod
from tests._gpu import skip_unless_hopper
from tests._mosaic_gpu_lowering import JAX_0112_PYTHON, lower_for_sm90, run_under_jax_0112

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
C, D = 64, 128
SCALE = D**-0.5
NAMES = ("dw", "dqp", "dkp", "dgp")


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(B, T, H, starts=(), seed=0):
    """The step's arguments at magnitudes like the real ones (``G`` the chunk-local cumsum of a mild gate in
    ``[-0.05, 0]``, states ~0.1); ``starts``: per sequence, the tokens where a document starts (``seg_col`` as
    :func:`pallas_kernels.kda._layout.chunk_document_starts` gives it)."""
    N, ks = T // C, jax.random.split(jax.random.PRNGKey(seed), 8)
    tok = lambda i, shape, s=1.0: (s * jax.random.normal(ks[i], shape, F32)).astype(BF16)
    g = -jax.random.uniform(ks[2], (B, N, C, H, D), F32, 0.0, 0.05)
    resets = jnp.zeros((B, T), I32)
    for b, at in enumerate(starts):
        if at:
            resets = resets.at[b, jnp.array(at)].set(1)
    seg = jnp.cumsum(resets.reshape(B, N, C), axis=-1).reshape(B, T, 1)
    return (tok(0, (B, T, H, D)), tok(1, (B, T, H, D), 0.1), jnp.cumsum(g, axis=2).reshape(B, T, H, D), seg,
            tok(3, (B, T, H, D)), tok(4, (B * H, T, D)), tok(5, (B * H, T, D)), tok(6, (B * H, N, D, D), 0.1),
            tok(7, (B * H, N, D, D), 0.1))


def _reference(q, k, gam, seg_col, do, vt, dvt, h, dh, scale=SCALE):
    """gpu_bwd's ``_dqkw_kernel`` restated in plain JAX, fp32 ``HIGHEST``, vmapped over the ``B*H*N`` chunks; the
    outputs in the kernel's dtypes and ``[B*H, Tp, K]`` layout."""
    B, Tp, H, K = q.shape
    BH, N = B * H, Tp // C
    hp = jax.lax.Precision.HIGHEST
    f = lambda x: x.astype(F32)
    per_chunk = lambda x: jnp.moveaxis(f(x).reshape(B, N, C, H, -1), 3, 1).reshape(BH * N, C, -1)
    tok = lambda x: f(x).reshape(BH * N, C, -1)
    segc = jnp.broadcast_to(seg_col.reshape(B, 1, N, C, 1), (B, H, N, C, 1)).reshape(BH * N, C, 1)

    def chunk(qc, kc, gc, sc, doc, vtc, dvtc, st, dst):
        dqe, dkd = jnp.dot(doc, st, precision=hp), jnp.dot(vtc, dst, precision=hp)
        dw = -jnp.dot(dvtc, st, precision=hp)
        seg_last, g_last = sc[-1, 0], gc[-1]
        eg = jnp.where(sc == 0, jnp.exp(gc), 0.0)  # the document entering the chunk
        ekl = jnp.where(sc == seg_last, jnp.exp(g_last - gc), 0.0)  # the chunk's last document
        kdec = kc * ekl
        dl = jnp.where(seg_last == 0, jnp.exp(g_last), 0.0)
        dglast = jnp.sum(dkd * kdec, axis=0) + jnp.sum(st * dst, axis=0) * dl
        dgp = (dqe * qc * eg * scale - dkd * kdec).at[-1].add(dglast)
        return dw, (dqe * eg).astype(BF16), (dkd * ekl).astype(BF16), dgp

    state = lambda x: f(x).reshape(BH * N, *x.shape[2:])
    outs = jax.vmap(chunk)(per_chunk(q), per_chunk(k), per_chunk(gam), segc, per_chunk(do), tok(vt), tok(dvt),
                           state(h), state(dh))
    return tuple(x.reshape(BH, Tp, -1) for x in outs)


def _triton(q, k, gam, seg_col, do, vt, dvt, h, dh, scale=SCALE):
    """gpu_bwd's Triton ``_dqkw_kernel`` in Pallas interpret mode, its ``pallas_call`` built as ``chunk_kda_bwd``
    builds it for bf16 inputs (``block_k`` 128: one K block, a V loop of one block)."""
    B, Tp, H, K = q.shape
    V, BH, N, BK = do.shape[-1], B * H, Tp // C, 128
    bi, hi = (lambda bh: jax.lax.div(bh, H)), (lambda bh: jax.lax.rem(bh, H))
    kin = lambda: pl.BlockSpec((None, C, None, BK), lambda kb, bh, c: (bi(bh), c, hi(bh), kb))
    kout = lambda: pl.BlockSpec((None, C, BK), lambda kb, bh, c: (bh, c, kb))
    st_spec = pl.BlockSpec((None, None, V, BK), lambda kb, bh, c: (bh, c, 0, kb))
    tok3 = lambda d: pl.BlockSpec((None, C, d), lambda kb, bh, c: (bh, c, 0))
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(gpu_bwd._dqkw_kernel, scale=scale, block_v=min(BK, V), mm_dtype=BF16, interpret=True),
        grid=(K // BK, BH, N),
        in_specs=[kin(), kin(), kin(), pl.BlockSpec((None, C, 1), lambda kb, bh, c: (bi(bh), c, 0)),
                  pl.BlockSpec((None, C, None, V), lambda kb, bh, c: (bi(bh), c, hi(bh), 0)), tok3(V), tok3(V),
                  st_spec, st_spec],
        out_specs=[kout(), kout(), kout(), kout()],
        out_shape=[sds((BH, Tp, K), F32), sds((BH, Tp, K), BF16), sds((BH, Tp, K), BF16), sds((BH, Tp, K), F32)],
        interpret=True,
    )(q, k, gam, seg_col, do, vt, dvt, h, dh)


def _assert_close(got, want, tol_f32, tol_bf16, what):
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name, a.shape, a.dtype, b.shape, b.dtype)
        assert np.isfinite(np.asarray(a, np.float32)).all(), (what, name)
        err = _rel(a, b)
        assert err < (tol_bf16 if a.dtype == BF16 else tol_f32), (what, name, err)


def test_interpreter_matches_the_reference_with_documents_across_a_chunk():
    """One sequence of two heads, two chunks; documents start at tokens 20 and 50 (chunk 0: the gate factors of
    its first and last documents masked, its decay 0) and the one from 50 runs on through chunk 1 (no start there:
    its decay and every row kept). The kernel matches the fp32 restatement to summation order (the column sums'
    bf16 ``hi + lo`` split ~2^-17), and the masks matter: the unpacked reference is far off in chunk 0 only."""
    args = _inputs(1, 2 * C, 2, starts=[(20, 50)], seed=1)
    got = dqkw_mod.dqkw(*args, scale=SCALE, interpret=True)
    want = _reference(*args)
    _assert_close(got, want, 1e-5, 2e-3, "reference")
    unpacked = _reference(*args[:3], jnp.zeros_like(args[3]), *args[4:])
    for name, a, b in zip(NAMES[1:], got[1:], unpacked[1:], strict=True):
        assert _rel(a[:, :C], b[:, :C]) > 0.1 and _rel(a[:, C:], b[:, C:]) < 2e-3, name
    # the last row of each chunk carries sum_C(dkd kd) + ddl dl; dl = 0 in chunk 0 only
    dgl = np.asarray(got[3])[:, C - 1::C]
    assert np.abs(dgl - np.asarray(want[3])[:, C - 1::C]).max() < 1e-4 * np.abs(dgl).max()


def test_interpreter_matches_the_triton_kernel():
    """Two sequences of one head, two chunks (the sequence offset of every copy), a document starting at the chunk
    boundary in sequence 0 (chunk 1 keeps no row of ``e^G`` and has decay 0) and at token 100 in sequence 1: the
    kernel against gpu_bwd's Triton ``_dqkw_kernel`` (interpreted, bf16 operands): the same arrays in, the same
    arrays out."""
    args = _inputs(2, 2 * C, 1, starts=[(64,), (100,)], seed=2)
    got = dqkw_mod.dqkw(*args, scale=SCALE, interpret=True)
    want = _triton(*args)
    _assert_close(got, want, 1e-5, 2e-3, "triton")
    assert float(jnp.abs(got[1][0, C:].astype(F32)).max()) == 0.0  # dqp: no token of chunk 1 sees the state


def test_contract():
    """:func:`supports_reason` names what does not fit; :func:`dqkw` rejects arguments outside the contract."""
    ok = dict(dtype="bfloat16", k=128, v=128, chunk_size=64)
    assert dqkw_mod.supports_reason(**ok) is None
    for change, match in ((dict(dtype="float32"), "bfloat16"), (dict(k=64), "K = V = 128"),
                          (dict(v=256), "K = V = 128"), (dict(chunk_size=32), "chunk_size 64"),
                          (dict(state_dtype="float32"), "h / dh in bfloat16")):
        assert match in dqkw_mod.supports_reason(**ok | change), change
    s = jax.ShapeDtypeStruct
    args = [s(x.shape, x.dtype) for x in _inputs(1, C, 1)]
    for i, bad, match in ((0, s((1, C, 1, D), F32), "q must be bfloat16"), (7, s((1, 1, D, D), F32), "h must be"),
                          (3, s((1, C, 1), F32), "seg_col must be int32")):
        wrong = list(args)
        wrong[i] = bad
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(lambda *a: dqkw_mod.dqkw(*a, scale=SCALE), *wrong)


def _k3_args(B=1, T=8192, H=96):
    s = jax.ShapeDtypeStruct
    tok = s((B, T, H, D), BF16)
    return (tok, tok, s((B, T, H, D), F32), s((B, T, 1), I32), tok, s((B * H, T, D), BF16), s((B * H, T, D), BF16),
            s((B * H, T // C, D, D), BF16), s((B * H, T // C, D, D), BF16))


N_COPIES = 23
"""Copies between device and shared memory of one CTA: warpgroup 0 loads the 5 shared tiles, each warpgroup its 5
and stores its 4."""


def test_lowers_for_sm90_at_the_k3_shape():
    """One Mosaic GPU kernel with wgmma at B=1, T=8192, H=96, every copy with at most one integer index."""
    text, ints = lower_for_sm90(lambda *a: dqkw_mod.dqkw(*a, scale=SCALE), *_k3_args())
    assert text.count("custom_call @mosaic_gpu") == 1 and "wgmma.mma_async" in text
    assert len(ints) == N_COPIES and max(ints) <= 1, ints


def test_lowers_under_jax_0112():
    """The same under the H200's JAX (0.11.2)."""
    if not os.path.exists(JAX_0112_PYTHON):
        pytest.skip(f"no jax 0.11.2 environment at {JAX_0112_PYTHON} (K3_JAX_0112_PYTHON)")
    out = run_under_jax_0112(f"""
        import jax, jax.numpy as jnp
        from pallas_kernels.kda import mosaic_gpu_bwd_dqkw as m
        from tests._mosaic_gpu_lowering import lower_for_sm90
        s, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
        tok, st = s((1, 8192, 96, 128), bf16), s((96, 128, 128, 128), bf16)
        args = (tok, tok, s((1, 8192, 96, 128), jnp.float32), s((1, 8192, 1), jnp.int32), tok,
                s((96, 8192, 128), bf16), s((96, 8192, 128), bf16), st, st)
        text, ints = lower_for_sm90(lambda *a: m.dqkw(*a, scale=128**-0.5), *args)
        assert text.count("custom_call @mosaic_gpu") == 1 and "wgmma.mma_async" in text
        assert len(ints) == {N_COPIES} and max(ints) <= 1, ints
    """)
    assert out.returncode == 0 and "ok 0.11.2" in out.stdout, out.stderr[-3000:]


@pytest.mark.gpu
def test_gpu_matches_the_reference_at_the_k3_shape():
    """Compiled on sm_90 at B=1, T=8192, H=96 with packed documents (starts inside chunks, at a chunk boundary,
    documents across chunks) against the fp32 restatement."""
    skip_unless_hopper()
    args = _inputs(1, 8192, 96, starts=[(20, 50, 64, 1000, 4096, 8000)], seed=3)
    got = jax.jit(functools.partial(dqkw_mod.dqkw, scale=SCALE))(*args)
    want = jax.jit(_reference)(*args)
    _assert_close(got, want, 1e-4, 2e-3, "gpu")
