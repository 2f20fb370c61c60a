"""The Mosaic GPU sweeps of the KDA chunk backward (:mod:`pallas_kernels.kda.mosaic_gpu_bwd_sweeps`): each sweep in
the Mosaic GPU interpreter against a plain-JAX recurrence of gpu_bwd's formulas, the whole backward with
``mosaic_gpu_steps`` (the sweeps, and with them steps 6-9) against the Triton kernels (both interpreted), the
contract checks, the lowering for sm_90 from this CPU host (jax 0.12 and the H200's 0.11.2) and, on a GPU
(``-m gpu``), the compiled sweeps against the recurrences and the backward against the Triton one at K3's shape."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import gpu_bwd, mosaic_gpu
from pallas_kernels.kda import mosaic_gpu_bwd_sweeps as sweeps
from pallas_kernels.kda import reference as ref
from tests._gpu import skip_unless_hopper
from tests._mosaic_gpu_lowering import JAX_0112_PYTHON, lower_for_sm90, run_under_jax_0112

BF16, F32 = jnp.bfloat16, jnp.float32
C, D = 64, 128


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _per_chunk(B, n, H, seed=0):
    """Random per-chunk tensors in the sweeps' layouts at magnitudes like the real ones (``kd, qg, wn`` of
    normalised keys / queries, a causal ``A_qk``, chunk decays in (0.6, 1))."""
    Tp, ks = n * C, jax.random.split(jax.random.PRNGKey(seed), 9)
    tok = lambda i, d, s=1.0: (s * jax.random.normal(ks[i], (B, Tp, H, d), F32)).astype(BF16)
    causal = jnp.tril(jnp.ones((C, C), F32))
    aqk = (tok(0, C, 0.1).astype(F32).reshape(B, n, C, H, C) * causal[None, None, :, None]).reshape(B, Tp, H, C)
    return dict(
        wn=tok(1, D, 0.1), xb=tok(2, C, 0.2), v=tok(3, D), kd=tok(4, D, 0.1), qg=tok(5, D, 0.1),
        aqk=aqk.astype(BF16), do=tok(6, D),
        dl=jax.random.uniform(ks[7], (B * H, n, 1, D), F32, 0.6, 1.0),
        state=jax.random.normal(ks[8], (B * H, D, D), F32))


def _by_chunk(x):
    """``[B, Tp, H, d]`` -> ``[N, B*H, C, d]``."""
    B, Tp, H, d = x.shape
    return jnp.transpose(x.reshape(B, Tp // C, C, H, d), (1, 0, 3, 2, 4)).reshape(Tp // C, B * H, C, d)


def _mm(a, b, eq):
    """gpu_bwd's bf16 matmul: bf16 operands, fp32 accumulation."""
    return jnp.einsum(eq, a.astype(BF16), b.astype(BF16), preferred_element_type=F32)


def _tokens(x):
    """``[N, B*H, C, V]`` -> ``[B*H, Tp, V]``."""
    N, BH, _, V = x.shape
    return jnp.moveaxis(x, 0, 1).reshape(BH, N * C, V)


@jax.jit
def _h_reference(wn, xb, v, kd, dl, h0t):
    """gpu_bwd's ``_h_kernel`` as a plain-JAX recurrence over the chunks (``S^T [B*H, V, K]``)."""

    def step(st, xs):
        wn_c, xb_c, v_c, kd_c, dl_c = xs
        vt = _mm(xb_c, v_c, "bts,bsv->btv") + _mm(wn_c, st, "btk,bvk->btv")
        return st * dl_c + _mm(vt, kd_c, "btv,btk->bvk"), (st.astype(BF16), vt.astype(BF16))

    _, (hs, vts) = jax.lax.scan(step, h0t, (*map(_by_chunk, (wn, xb, v, kd)), jnp.moveaxis(dl, 1, 0)))
    return jnp.moveaxis(hs, 0, 1), _tokens(vts)


@jax.jit
def _ds_reference(aqk, qg, kd, wn, dl, do, dhtt):
    """gpu_bwd's ``_ds_kernel`` as a plain-JAX recurrence over the chunks in reverse (``dS'^T [B*H, V, K]``)."""

    def step(dst, xs):
        aqk_c, qg_c, kd_c, wn_c, dl_c, do_c = xs
        dvt = _mm(aqk_c, do_c, "bts,btv->bsv") + _mm(kd_c, dst, "btk,bvk->btv")
        nxt = dst * dl_c + _mm(do_c, qg_c, "btv,btk->bvk") + _mm(dvt, wn_c, "btv,btk->bvk")
        return nxt, (dst.astype(BF16), dvt.astype(BF16))

    xs = (*map(_by_chunk, (aqk, qg, kd, wn)), jnp.moveaxis(dl, 1, 0), _by_chunk(do))
    dh0t, (dhs, dvts) = jax.lax.scan(step, dhtt, xs, reverse=True)
    return jnp.moveaxis(dhs, 0, 1), _tokens(dvts), dh0t


@pytest.mark.parametrize("v_split", [1, 2])
def test_interpreter_h_sweep_matches_the_recurrence(v_split):
    """Two sequences of one head (sequence / head addressing), three chunks (both slots, a reused slot): ``h`` and
    ``V~`` at the bf16-storage level. ``v_split=1``: two state warpgroups in one CTA; 2: one per CTA."""
    x = _per_chunk(2, 3, 1, seed=1)
    args = (x["wn"], x["xb"], x["v"], x["kd"], x["dl"], x["state"])
    h, vt = sweeps.h_sweep(*args, v_split=v_split, interpret=True)
    rh, rvt = _h_reference(*args)
    assert h.shape == (2, 3, D, D) and h.dtype == BF16 and vt.shape == (2, 3 * C, D) and vt.dtype == BF16
    assert _rel(h, rh) < 5e-3 and _rel(vt, rvt) < 5e-3, (_rel(h, rh), _rel(vt, rvt))
    assert _rel(h[:, 1:], rh[:, :-1]) > 0.1  # the chunks' states differ: each lands in its own place


def test_interpreter_ds_sweep_matches_the_recurrence():
    """One sequence of two heads, three chunks in reverse: ``dh``, ``dV~`` and ``dh0``."""
    x = _per_chunk(1, 3, 2, seed=2)
    args = (x["aqk"], x["qg"], x["kd"], x["wn"], x["dl"], x["do"], x["state"])
    dh, dvt, dh0t = sweeps.ds_sweep(*args, v_split=1, interpret=True)
    rdh, rdvt, rdh0t = _ds_reference(*args)
    assert dh.shape == (2, 3, D, D) and dh.dtype == BF16 and dvt.dtype == BF16 and dh0t.dtype == F32
    for name, a, b in (("dh", dh, rdh), ("dvt", dvt, rdvt), ("dh0t", dh0t, rdh0t)):
        assert a.shape == b.shape and _rel(a, b) < 5e-3, (name, _rel(a, b))


def _inputs(B, T, H, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    q = ref.l2norm(jax.random.normal(ks[0], (B, T, H, D), F32)).astype(BF16)
    k = ref.l2norm(jax.random.normal(ks[1], (B, T, H, D), F32)).astype(BF16)
    v = jax.random.normal(ks[2], (B, T, H, D), F32).astype(BF16)
    g = ref.kda_gate(jax.random.normal(ks[3], (B, T, H, D), F32), jnp.zeros((H,), F32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), F32))
    h0 = 0.1 * jax.random.normal(ks[5], (B, H, D, D), F32)
    do = jax.random.normal(ks[6], (B, T, H, D), F32).astype(BF16)
    return q, k, v, g, beta, h0, do


def test_interpreter_backward_with_mosaic_gpu_steps_matches_the_triton_kernels():
    """``chunk_kda_bwd(mosaic_gpu_steps=MOSAIC_GPU_STEPS)`` with the Mosaic GPU forward's per-chunk results (all in
    the Mosaic GPU interpreter) against the all-Triton backward recomputing them (Pallas interpreter): T = 130 padded
    to 192, an initial state and a final-state cotangent; no Triton kernel is in the first one's program."""
    q, k, v, g, beta, h0, do = _inputs(1, 130, 1, seed=3)
    dht = jax.random.normal(jax.random.PRNGKey(8), h0.shape, F32)
    chunks = mosaic_gpu.chunk_kda_fwd(q, k, v, g, beta, D**-0.5, h0, interpret=True, residuals=True)[2]
    run = lambda steps, res: gpu_bwd.chunk_kda_bwd(q, k, v, g, beta, D**-0.5, h0, None, do, dht, interpret=True,
                                                   mosaic_gpu_steps=steps, residuals=res)
    program = str(jax.make_jaxpr(lambda: run(gpu_bwd.MOSAIC_GPU_STEPS, chunks))())
    assert "kda_bwd_h_mosaic_gpu" in program and "kda_bwd_da_mosaic_gpu" in program
    for triton_kernel in gpu_bwd.KERNEL_NAMES:
        assert triton_kernel not in program, triton_kernel
    got, triton = run(gpu_bwd.MOSAIC_GPU_STEPS, chunks), run((), None)
    _, vjp = jax.vjp(lambda *a: ref.chunk_kda(*a, D**-0.5, h0, True), *(x.astype(F32) for x in (q, k, v, g, beta)))
    with jax.default_matmul_precision("highest"):
        exact = (*vjp((do.astype(F32), dht)), None)
    for name, a, b, c in zip("dq dk dv dg dbeta dh0".split(), got, triton, exact, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        # the two differ by the precision of their products (the Mosaic GPU steps split fp32 operands into bf16
        # pairs where the Triton ones take TF32), each ~3e-3 from the fp32 VJP: no further from it than Triton
        assert bool(jnp.isfinite(a).all()) and _rel(a, b) < 5e-3, (name, _rel(a, b))
        if c is not None:
            assert _rel(a, c) <= 1.1 * _rel(b, c) + 1e-4, (name, _rel(a, c), _rel(b, c))


@pytest.mark.parametrize("kwargs, match", [
    (dict(mosaic_gpu_steps=("cuda",)), "mosaic_gpu_steps must be among"),
    (dict(mosaic_gpu_steps=("sweeps",), dtype=F32), "step 'sweeps'.*bfloat16"),
    (dict(mosaic_gpu_steps=("wy",), dtype=F32), "step 'wy'.*bfloat16"),
    (dict(mosaic_gpu_steps=("sweeps",), chunk_size=32), "chunk_size 64"),
    (dict(mosaic_gpu_steps=("dqkw",), state_dtype=F32), "step 'dqkw'"),
])
def test_backward_rejects_an_impossible_mosaic_gpu_step(kwargs, match):
    dtype = kwargs.pop("dtype", BF16)
    q, k, v, g, beta, _, do = _inputs(1, 64, 1)
    q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda: gpu_bwd.chunk_kda_bwd(q, k, v, g, beta, D**-0.5, do=do, interpret=True, **kwargs))


def test_sweeps_name_an_argument_outside_their_contract():
    """An array of the wrong shape or dtype is named with what the sweep expects."""
    x = _per_chunk(1, 1, 1)
    with pytest.raises(ValueError, match=r"xb must be bfloat16\[1, 64, 1, 64\], got bfloat16\[1, 64, 1, 128\]"):
        sweeps.h_sweep(x["wn"], x["wn"], x["v"], x["kd"], x["dl"], x["state"], interpret=True)
    with pytest.raises(ValueError, match=r"dl must be float32"):
        sweeps.ds_sweep(x["aqk"], x["qg"], x["kd"], x["wn"], x["dl"].astype(BF16), x["do"], x["state"], interpret=True)


def _k3_args(B=1, T=8192, H=96):
    s = jax.ShapeDtypeStruct
    tok = lambda d: s((B, T, H, d), BF16)
    st, dl = s((B * H, D, D), F32), s((B * H, T // C, 1, D), F32)
    return (tok(D), tok(C), tok(D), tok(D), dl, st), (tok(C), tok(D), tok(D), tok(D), dl, tok(D), st)


@pytest.mark.parametrize("v_split", [1, 2])
def test_sweeps_lower_for_sm90_at_the_k3_shape(v_split):
    """Both sweeps lower for sm_90 at B=1, T=8192, H=96 (one Mosaic GPU kernel each, wgmma), every copy between
    device and shared memory with at most one integer index."""
    h_args, ds_args = _k3_args()
    for fn, args, n_copies in ((sweeps.h_sweep, h_args, 5), (sweeps.ds_sweep, ds_args, 6)):
        text, ints = lower_for_sm90(lambda *a, fn=fn: fn(*a, v_split=v_split), *args)
        assert text.count("custom_call @mosaic_gpu") == 1 and "wgmma.mma_async" in text
        assert len(ints) >= n_copies and max(ints) <= 1, ints


def test_sweeps_lower_under_jax_0112():
    """Both sweeps also lower under the H200's JAX (0.11.2) at the K3 shape."""
    if not os.path.exists(JAX_0112_PYTHON):
        pytest.skip(f"no jax 0.11.2 environment at {JAX_0112_PYTHON} (K3_JAX_0112_PYTHON)")
    out = run_under_jax_0112("""
        import jax, jax.numpy as jnp
        from pallas_kernels.kda import mosaic_gpu_bwd_sweeps as sweeps
        from tests._mosaic_gpu_lowering import lower_for_sm90
        s, bf16, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
        tok = lambda d: s((1, 8192, 96, d), bf16)
        st, dl = s((96, 128, 128), f32), s((96, 128, 1, 128), f32)
        h_args = (tok(128), tok(64), tok(128), tok(128), dl, st)
        ds_args = (tok(64), tok(128), tok(128), tok(128), dl, tok(128), st)
        for fn, args, v_split in ((f, a, n) for f, a in ((sweeps.h_sweep, h_args), (sweeps.ds_sweep, ds_args))
                                  for n in (1, 2)):
            text, ints = lower_for_sm90(lambda *a, fn=fn, n=v_split: fn(*a, v_split=n), *args)
            assert text.count("custom_call @mosaic_gpu") == 1 and "wgmma.mma_async" in text, fn
            assert max(ints) <= 1, ints
    """)
    assert out.returncode == 0 and "ok 0.11.2" in out.stdout, out.stderr[-3000:]


def _assert_sweeps_match_the_recurrences(B, T, H, interpret=False):
    """Both sweeps (``v_split`` 1 and 2) on the Mosaic GPU forward's per-chunk results for real inputs (T padded to
    the chunk, an initial state, a final-state cotangent) against :func:`_h_reference` / :func:`_ds_reference`."""
    q, k, v, g, beta, h0, do = _inputs(B, T, H, seed=T)
    _, _, res = mosaic_gpu.chunk_kda_fwd(q, k, v, g, beta, D**-0.5, h0, residuals=True, interpret=interpret)
    Tp = res.qg.shape[1]
    pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T), (0, 0), (0, 0)])
    dl = res.decay.reshape(B * H, Tp // C, 1, D)
    h0t = jnp.swapaxes(h0, -1, -2).reshape(B * H, D, D)
    dhtt = jax.random.normal(jax.random.PRNGKey(8), (B * H, D, D), F32)
    h_args = (res.wn, res.xb, pad(v), res.kd, dl, h0t)
    ds_args = (res.aqk, res.qg, res.kd, res.wn, dl, pad(do), dhtt)
    want = (*_h_reference(*h_args), *_ds_reference(*ds_args))
    for v_split in (1, 2):
        got = (*sweeps.h_sweep(*h_args, v_split=v_split, interpret=interpret),
               *sweeps.ds_sweep(*ds_args, v_split=v_split, interpret=interpret))
        for name, a, b in zip("h vt dh dvt dh0t".split(), got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype, name
            assert bool(jnp.isfinite(a).all()) and _rel(a, b) < 1e-2, (name, v_split, _rel(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H", [(1, 8192, 96), (2, 300, 3)])
def test_gpu_sweeps_match_the_recurrences(B, T, H):
    """On the H200: the compiled sweeps at K3's shape (and several sequences of several heads with a padded tail)
    against the plain-JAX recurrences of the Triton kernels' formulas."""
    skip_unless_hopper()
    _assert_sweeps_match_the_recurrences(B, T, H)


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H", [(1, 8192, 96), (2, 300, 3)])
def test_gpu_backward_with_mosaic_gpu_steps_matches_the_triton_kernels(B, T, H):
    """On the H200: the compiled backward with steps 4-9 on Mosaic GPU against the all-Triton one (K3's shape, and
    several sequences of several heads with a padded tail)."""
    skip_unless_hopper()
    q, k, v, g, beta, h0, do = _inputs(B, T, H, seed=T)
    dht = jax.random.normal(jax.random.PRNGKey(8), h0.shape, F32)
    run = jax.jit(lambda steps, *a: gpu_bwd.chunk_kda_bwd(*a, D**-0.5, h0, None, do, dht, mosaic_gpu_steps=steps),
                  static_argnums=0)
    got, want = run(gpu_bwd.MOSAIC_GPU_STEPS, q, k, v, g, beta), run((), q, k, v, g, beta)
    for name, a, b in zip("dq dk dv dg dbeta dh0".split(), got, want, strict=True):
        assert bool(jnp.isfinite(a).all()) and _rel(a, b) < 1e-2, (name, _rel(a, b))
