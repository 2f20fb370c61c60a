"""Steps 8-9 of the KDA chunk backward on Mosaic GPU (:mod:`pallas_kernels.kda.mosaic_gpu_bwd_da`): the kernel in the
Mosaic GPU interpreter against a plain-JAX fp32 restatement of gpu_bwd's ``_da_tile_kernel`` + ``_dg_cumsum_kernel``
(pairwise decays, no factoring) and against those Triton kernels themselves (Pallas interpret mode), with packed
documents across a chunk and gates at the bound -5; the contract checks; the lowering for sm_90 at K3's shape from
this CPU host (jax 0.12 and the H200's 0.11.2); on a GPU (``-m gpu``) the compiled kernel against the reference at
K3's shape."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.kda import gpu_bwd
from pallas_kernels.kda import mosaic_gpu_bwd_da as da_mod
from tests._gpu import skip_unless_hopper
from tests._mosaic_gpu_lowering import JAX_0112_PYTHON, lower_for_sm90, run_under_jax_0112

BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
C, D = 64, 128
SCALE = D**-0.5
NAMES = ("dq", "dk", "dg")
HP = jax.lax.Precision.HIGHEST


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(B, T, H, starts=(), seed=0, strong=True):
    """The step's arguments in the Triton call's layouts at ``K = 128``. The gate: mild (``[-0.3, 0]``) with, when
    ``strong``, tokens 8-40 of every chunk at ``[-5, -4.9]`` (the bound: a 16-token tile spans exponents up to ~80,
    and the masked entries' unclamped exponents reach hundreds); ``dA_qk`` / ``dA_kk`` causal / strictly lower
    within one document, as step 7 writes them; ``starts``: per sequence, the tokens where a document starts."""
    N, ks = T // C, jax.random.split(jax.random.PRNGKey(seed), 12)
    normal = lambda i, shape, s=1.0: s * jax.random.normal(ks[i], shape, F32)
    g = -jax.random.uniform(ks[0], (B, N, C, H, D), F32, 0.0, 0.3)
    if strong:
        t = jnp.arange(C)[None, None, :, None, None]
        g = jnp.where((t >= 8) & (t < 40), -jax.random.uniform(ks[1], g.shape, F32, 4.9, 5.0), g)
    gam = jnp.cumsum(g, axis=2).reshape(B, T, H, D)
    resets = jnp.zeros((B, T), I32)
    for b, at in enumerate(starts):
        if at:
            resets = resets.at[b, jnp.array(at)].set(1)
    seg = jnp.cumsum(resets.reshape(B, N, C), axis=-1)  # [B, N, C]
    seg_col = seg.reshape(B, T, 1)
    sc = jnp.broadcast_to(seg[:, None], (B, H, N, C)).reshape(B * H, N, C)
    same = sc[..., :, None] == sc[..., None, :]
    row, col = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    tri = lambda i, keep: jnp.where(keep, normal(i, (B * H, N, C, C)), 0.0).reshape(B * H, T, C)
    dakk, daqk = tri(2, same & (row > col)), tri(3, same & (row >= col))
    tok = lambda i, s=1.0: normal(i, (B, T, H, D), s).astype(BF16)
    beta = jax.nn.sigmoid(normal(4, (B, T, H, 1)))
    part = lambda i, dt: normal(i, (B * H, T, D)).astype(dt)
    return (tok(5), tok(6, 0.1), gam, beta, seg_col, dakk, daqk, part(7, BF16), part(8, BF16), part(9, F32),
            part(10, F32))


def _reference(q, k, gam, beta, seg_col, dakk, daqk, dqp, dkp, dgp, dbk, scale=SCALE, g_dtype=F32):
    """gpu_bwd's ``_da_tile_kernel`` then ``_dg_cumsum_kernel`` restated per chunk in fp32 (``HIGHEST``) with the
    exact pairwise decays ``e^{G_i - G_j}`` (no reference points, no clamp: the masked entries take ``e^{-inf}``),
    mapped over ``B*H`` (memory ``O(T C K)`` per head); the outputs in the kernel's dtypes and layouts."""
    B, Tp, H, K = q.shape
    BH, N = B * H, Tp // C
    f = lambda x: x.astype(F32)
    heads = lambda x: jnp.swapaxes(f(x), 1, 2).reshape(BH, N, C, -1)  # [B, T, H, D] -> [BH, N, C, D]
    chunks = lambda x: f(x).reshape(BH, N, C, -1)  # [BH, T, D] -> [BH, N, C, D]
    sc = jnp.broadcast_to(seg_col.reshape(B, 1, N, C, 1), (B, H, N, C, 1)).reshape(BH, N, C, 1)
    lower = jnp.tril(jnp.ones((C, C), bool))

    def head(qc, kc, gc, bc, segc, akk, aqk, dqpc, dkpc, dgpc, dbkc):  # one head: [N, C, D] / [N, C, C]
        diff = jnp.where(lower[None, :, :, None], gc[:, :, None, :] - gc[:, None, :, :], -jnp.inf)  # [N, i, j, K]
        e = jnp.exp(diff)
        qs = qc * scale
        rq = jnp.einsum("nij,njd,nijd->nid", aqk, kc, e, precision=HP)
        rk = jnp.einsum("nij,njd,nijd->nid", akk, kc, e, precision=HP)
        cq = jnp.einsum("nji,njd,njid->nid", aqk, qs, e, precision=HP)
        ck = jnp.einsum("nji,njd,njid->nid", akk, kc, e, precision=HP)
        beg = bc * jnp.where(segc == 0, jnp.exp(gc), 0.0)
        dq = (dqpc + rq) * scale
        dk = dkpc + dbkc * beg + rk + cq + ck
        dgt = dgpc + dbkc * beg * kc + qs * rq + kc * (rk - cq - ck)
        dg = jnp.flip(jnp.cumsum(jnp.flip(dgt, 1), axis=1), 1)
        return dq, dk, dg

    outs = jax.lax.map(lambda xs: head(*xs), (heads(q), heads(k), heads(gam), heads(beta), sc, chunks(dakk),
                                              chunks(daqk), chunks(dqp), chunks(dkp), chunks(dgp), chunks(dbk)))
    tokens = lambda x: jnp.swapaxes(x.reshape(B, H, Tp, K), 1, 2)
    return tuple(tokens(x).astype(dt) for x, dt in zip(outs, (q.dtype, k.dtype, g_dtype), strict=True))


def _triton(q, k, gam, beta, seg_col, dakk, daqk, dqp, dkp, dgp, dbk, scale=SCALE, g_dtype=F32, da_block_k=32):
    """gpu_bwd's Triton ``_da_tile_kernel`` and ``_dg_cumsum_kernel`` in Pallas interpret mode (TF32 operands
    emulated by rounding), their ``pallas_call`` built as ``chunk_kda_bwd`` builds them for bf16 inputs."""
    B, Tp, H, K = q.shape
    BH, N, nt, BKD = B * H, Tp // C, C // 16, da_block_k
    bi, hi = (lambda bh: jax.lax.div(bh, H)), (lambda bh: jax.lax.rem(bh, H))
    kb_of, tile_of = (lambda i: i // nt), (lambda i: i % nt)
    t_in = lambda d, kb: pl.BlockSpec((None, C, None, d), lambda i, bh, c: (bi(bh), c, hi(bh), kb(i)))
    t_tok = lambda: pl.BlockSpec((None, C, C), lambda i, bh, c: (bh, c, 0))
    t_part = lambda: pl.BlockSpec((None, C, BKD), lambda i, bh, c: (bh, c, kb_of(i)))
    t_out = lambda: pl.BlockSpec((None, 16, None, BKD),
                                 lambda i, bh, c: (bi(bh), c * nt + tile_of(i), hi(bh), kb_of(i)))
    sds = jax.ShapeDtypeStruct
    dq, dk, dgt = pl.pallas_call(
        functools.partial(gpu_bwd._da_tile_kernel, scale=scale, mm_dtype=gpu_bwd.TF32, interpret=True),
        grid=(K // BKD * nt, BH, N),
        in_specs=[t_in(BKD, kb_of), t_in(BKD, kb_of), t_in(BKD, kb_of), t_in(1, lambda i: 0),
                  pl.BlockSpec((None, C, 1), lambda i, bh, c: (bi(bh), c, 0)), t_tok(), t_tok(), t_part(), t_part(),
                  t_part(), t_part()],
        out_specs=[t_out(), t_out(),
                   pl.BlockSpec((None, 16, BKD), lambda i, bh, c: (bh, c * nt + tile_of(i), kb_of(i)))],
        out_shape=[sds((B, Tp, H, K), q.dtype), sds((B, Tp, H, K), k.dtype), sds((BH, Tp, K), F32)],
        interpret=True,
    )(q, k, gam, beta, seg_col, dakk, daqk, dqp, dkp, dgp, dbk)
    dg = pl.pallas_call(
        gpu_bwd._dg_cumsum_kernel, grid=(K // BKD, BH, N),
        in_specs=[pl.BlockSpec((None, C, BKD), lambda kb, bh, c: (bh, c, kb))],
        out_specs=pl.BlockSpec((None, C, None, BKD), lambda kb, bh, c: (bi(bh), c, hi(bh), kb)),
        out_shape=sds((B, Tp, H, K), g_dtype), interpret=True,
    )(dgt)
    return dq, dk, dg


TOLERANCE = dict(dq=2e-3, dk=2e-3, dg=1e-4)
"""Relative (Frobenius) error bounds against the fp32 restatement. ``dq``, ``dk`` are bf16 in both (last-bit
differences; interpreter ~1e-4); ``dg`` (fp32) takes split-bf16 products (interpreter ~3e-5 on the decay products
alone, where the Triton kernel's TF32 pass gives ~1.2e-3)."""


def _assert_close(got, want, what, tolerance=TOLERANCE):
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name, a.shape, a.dtype, b.shape, b.dtype)
        assert np.isfinite(np.asarray(a, np.float32)).all(), (what, name)
        err = _rel(a, b)
        assert err < tolerance[name], (what, name, err)


def _decay_only(args):
    """``args`` with step 6/7's partials (``dqp, dkp, dgp, dbk``) zero: the outputs are the decay products alone."""
    return (*args[:7], *(jnp.zeros_like(x) for x in args[7:]))


def test_interpreter_matches_the_reference_with_documents_and_gates_at_the_bound():
    """Two sequences of one head, two chunks; documents start at tokens 20 and 100 (sequence 0) and at the chunk
    boundary 64 (sequence 1: chunk 1 keeps no row of ``e^G``); tokens 8-40 of each chunk gate at ~-5, so a tile's
    exponents reach ~80 and the masked entries' would pass fp32's range without the clamp. Every output against
    the fp32 restatement, with the partials and on the decay products alone (where the split-bf16 products are
    ~40x closer to the fp32 math than one TF32 pass); the documents matter (``beta e^G`` of a chunk's first
    document only)."""
    args = _inputs(2, 2 * C, 1, starts=[(20, 100), (64,)], seed=1)
    got = da_mod.da_backward(*args, scale=SCALE, interpret=True)
    _assert_close(got, _reference(*args), "reference")
    bare = _decay_only(args)
    _assert_close(da_mod.da_backward(*bare, scale=SCALE, interpret=True), _reference(*bare), "decay products")
    # sequence 1, chunk 1 (a document starts at its first token): no beta e^G there, where the unpacked math has it
    unpacked = _reference(*args[:4], jnp.zeros_like(args[4]), *args[5:])
    for name, a, b, bound in zip(NAMES[1:], got[1:], unpacked[1:], (0.1, 2e-3), strict=True):
        assert _rel(a[1, C:C + 8], b[1, C:C + 8]) > bound, name


def test_interpreter_matches_the_triton_kernels():
    """One sequence of two heads (the head offset of every copy), two chunks, a document from token 40 on through
    chunk 1, ``dg`` in bf16: the kernel against gpu_bwd's Triton ``_da_tile_kernel`` + ``_dg_cumsum_kernel``
    (interpreted, TF32 operands emulated): the same arrays in, the same arrays out, within the TF32 pass's error."""
    args = _inputs(1, 2 * C, 2, starts=[(40,)], seed=2)
    got = da_mod.da_backward(*args, scale=SCALE, g_dtype=BF16, interpret=True)
    want = _triton(*args, g_dtype=BF16)
    _assert_close(got, want, "triton", dict(dq=3e-3, dk=3e-3, dg=3e-3))


def _k3_arg_shapes(B=1, T=8192, H=96):
    """``(shape, dtype name)`` of each argument of :func:`da_backward` (default: K3); plain data, so the jax 0.11.2
    subprocess (no pytest there) takes them as a literal."""
    tok, part = (B, T, H, D), (B * H, T, D)
    return [(tok, "bfloat16"), (tok, "bfloat16"), (tok, "float32"), ((B, T, H, 1), "float32"), ((B, T, 1), "int32"),
            ((B * H, T, C), "float32"), ((B * H, T, C), "float32"), (part, "bfloat16"), (part, "bfloat16"),
            (part, "float32"), (part, "float32")]


def _k3_args(B=1, T=8192, H=96):
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in _k3_arg_shapes(B, T, H)]


N_COPIES = 18
"""Copies between device and shared memory of one CTA: 10 loads for the products (``dA_qk, dA_kk, q, k, G``, four
rows of ``G``, ``seg``), ``dqp`` after the row part, ``dkp, dgp, dbk, beta`` for the last step, and 3 stores."""


def test_lowers_for_sm90_at_the_k3_shape_and_rejects_calls_outside_its_contract():
    """One Mosaic GPU kernel with wgmma at B=1, T=8192, H=96 (``dg`` in fp32 and in bf16), every copy with at most
    one integer index. :func:`supports_reason` names what does not fit; :func:`da_backward` rejects arguments
    outside the contract."""
    for g_dtype in (F32, BF16):
        text, ints = lower_for_sm90(lambda *a, g_dtype=g_dtype: da_mod.da_backward(*a, scale=SCALE, g_dtype=g_dtype),
                                    *_k3_args())
        assert text.count("custom_call @mosaic_gpu") == 1 and "wgmma.mma_async" in text
        assert len(ints) == N_COPIES and max(ints) <= 1, ints
    ok = dict(dtype="bfloat16", k=128, chunk_size=64)
    assert da_mod.supports_reason(**ok) is None
    assert da_mod.supports_reason(**ok, g_dtype="bfloat16") is None
    for change, match in ((dict(dtype="float32"), "bfloat16"), (dict(k=64), "K = V = 128"),
                          (dict(chunk_size=32), "chunk_size 64"), (dict(g_dtype="float16"), "float32 or bfloat16")):
        assert match in da_mod.supports_reason(**ok | change), change
    s = jax.ShapeDtypeStruct
    args = _k3_args(1, C, 1)
    for i, bad, match in ((0, s((1, C, 1, D), F32), "q must be bfloat16"), (5, s((1, C, C), BF16), "dakk must be"),
                          (4, s((1, C, 1), F32), "seg_col must be int32"), (10, s((1, C, D), BF16), "dbk must be")):
        wrong = list(args)
        wrong[i] = bad
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(lambda *a: da_mod.da_backward(*a, scale=SCALE), *wrong)
    with pytest.raises(ValueError, match="g_dtype must be"):
        jax.eval_shape(lambda *a: da_mod.da_backward(*a, scale=SCALE, g_dtype=jnp.float16), *args)


def test_lowers_under_jax_0112():
    """The same lowering under the H200's JAX (0.11.2)."""
    if not os.path.exists(JAX_0112_PYTHON):
        pytest.skip(f"no jax 0.11.2 environment at {JAX_0112_PYTHON} (K3_JAX_0112_PYTHON)")
    out = run_under_jax_0112(f"""
        import jax, jax.numpy as jnp
        from pallas_kernels.kda import mosaic_gpu_bwd_da as m
        from tests._mosaic_gpu_lowering import lower_for_sm90
        args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in {_k3_arg_shapes()!r}]
        for g_dtype in (jnp.float32, jnp.bfloat16):
            text, ints = lower_for_sm90(lambda *a: m.da_backward(*a, scale={SCALE!r}, g_dtype=g_dtype), *args)
            assert text.count("custom_call @mosaic_gpu") == 1 and "wgmma.mma_async" in text
            assert len(ints) == {N_COPIES} and max(ints) <= 1, ints
    """)
    assert out.returncode == 0 and "ok 0.11.2" in out.stdout, out.stderr[-3000:]


@pytest.mark.gpu
def test_gpu_matches_the_reference_at_the_k3_shape():
    """Compiled on sm_90 at B=1, T=8192, H=96 with packed documents (starts inside chunks, at a chunk boundary,
    documents across chunks) and gates at the bound, against the fp32 restatement (``dg`` in fp32 and bf16)."""
    skip_unless_hopper()
    args = _inputs(1, 8192, 96, starts=[(20, 50, 64, 1000, 4096, 8000)], seed=3)
    for g_dtype, tol in ((F32, TOLERANCE), (BF16, TOLERANCE | dict(dg=3e-3))):
        got = jax.jit(functools.partial(da_mod.da_backward, scale=SCALE, g_dtype=g_dtype))(*args)
        want = jax.jit(functools.partial(_reference, g_dtype=g_dtype))(*args)
        _assert_close(got, want, f"gpu {jnp.dtype(g_dtype).name}", tol)
