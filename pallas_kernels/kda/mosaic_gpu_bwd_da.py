"""KDA chunk backward, steps 8 and 9 on Mosaic GPU (sm_90): the decay-product gradients of
:mod:`pallas_kernels.kda.gpu_bwd`'s ``_da_tile_kernel`` and the in-chunk reverse cumsum of its ``_dg_cumsum_kernel``,
fused into one kernel (``dG`` stays on chip), one for one in place of the two Triton calls (same arrays in, the
same ``dq, dk, dg`` out).

Per chunk of one ``(sequence, head)``, with ``G`` the chunk-local cumsum of ``g``, ``dA_qk`` / ``dA_kk`` masked
(causal / strictly lower, one document) and, for 16-token tile ``a`` (rows ``16 a .. 16 a + 15``), ``m_a`` = ``G``
at the token before the tile (0 for tile 0) and ``mb_a`` = ``G`` at its last token:

* row part: ``rq_i = e^{G_i - m_a} sum_j dA_qk[i, j] k_j e^{min(m_a - G_j, 80)}``, ``rk`` the same with ``dA_kk``;
* column part: ``c_i = e^{mb_a - G_i} sum_j (dA_qk[j, i] q_j scale + dA_kk[j, i] k_j) e^{min(G_j - mb_a, 80)}``
  (``= cq + ck`` of the Triton kernel: only their sum enters);
* with ``beg = beta [first] e^G`` (``first``: tokens of the document that entered the chunk):
  ``dq = (dqp + rq) scale``, ``dk = dkp + dbk beg + rk + c``, ``dG = dgp + dbk beg k + q scale rq + k (rk - c)``;
* ``dg_i = sum_{t >= i} dG_t`` inside the chunk.

Every exponent is clamped at 80 (``EXP_CLAMP``, as the Triton kernel). Under the K3 gate bound ``g >= -5`` the
entries the masks keep stay at most 80 (16 tokens), so the clamp only bounds the masked ones (exact zeros of ``dA``
times a finite factor) and the rows of other tiles, which are discarded.

Contract (:func:`supports_reason`): bf16 ``q, k`` (so ``dqp, dkp``), ``K = 128``, chunk 64; ``g``'s dtype (the
dtype of ``dg``) fp32 or bf16. Inputs in the layouts ``chunk_kda_bwd`` hands the Triton kernels:
``q, k [B, Tp, H, 128]``, ``gam [B, Tp, H, 128]`` f32 (``G``), ``beta [B, Tp, H, 1]`` f32, ``seg_col [B, Tp, 1]``
i32 (document starts inside the chunk up to each token), ``dakk, daqk [B*H, Tp, 64]`` f32, ``dqp, dkp
[B*H, Tp, 128]`` bf16, ``dgp, dbk [B*H, Tp, 128]`` f32 (``Tp = 64 N``); outputs ``dq, dk [B, Tp, H, 128]`` in
``q``'s / ``k``'s dtype and ``dg [B, Tp, H, 128]`` in ``g_dtype``. ``beta`` is transposed to ``[B*H * Tp]`` by XLA
around the kernel (a TMA box row must be at least 16 bytes).

Layout: grid ``(2, N, B*H)``, one CTA (one warpgroup) per ``(half of K, chunk, sequence * H + head)``: every result
is per K column, so the halves are independent; the two CTAs of a chunk launch next to each other and read its
``dA`` tiles through L2. 16-row tiles do not fit wgmma's M of 64, so each tile's part is a full ``[64, 64] x
[64, 64]`` product whose rows of that tile are kept (selected in registers): the row part of tile ``a`` multiplies
``dA_qk`` / ``dA_kk`` by ``k e^{min(m_a - G, 80)}``, the column part ``dA_qk^T`` / ``dA_kk^T`` (transposed shared
memory views) by ``q scale e^{min(G - mb_a, 80)}`` / ``k e^{min(G - mb_a, 80)}``: 6.4x the multiply-adds of the ten
16x16 tiles on or below the diagonal, all on tensor cores. The reverse cumsum is one more product: ``dg = U dG``
with ``U[i, t] = [t >= i]`` (exact in bf16).

Precision: every product runs on wgmma with **both operands in shared memory** (bf16, fp32 accumulation; see
:mod:`.mosaic_gpu_intra`); every fp32 operand (``dA_qk``, ``dA_kk``, the decayed ``k`` / ``q`` operands and ``dG``)
is split into two bf16 terms ``hi + lo`` (together ~2^-17 relative); a product of two split operands takes the three
terms ``hi hi + hi lo + lo hi``, the cumsum (``U`` exact) the two ``U hi + U lo``. That is more precise than the
Triton kernel's one TF32 pass (``dG = x dx - y dy`` cancels: bf16 operands gave ``dg`` 5.6% off the fp32 VJP).
Gate factors and sums in registers in fp32 (``approx_math``: ``exp`` to a few ulp). Relative (Frobenius) errors
against the fp32 math (``HIGHEST``, exact pairwise decays) in the Mosaic GPU interpreter
(``tests/test_kda_mosaic_gpu_bwd_da.py``: two chunks, packed documents, gates at the bound), on the decay products
alone (partials zero): ``dq`` 8.9e-5, ``dk`` 1.3e-4 (both bf16, as the reference's), ``dg`` 2.6e-5 (fp32;
2.1e-4 in bf16); the Triton kernels' TF32 pass on the same inputs: 1.1e-3, 1.1e-3, 1.2e-3 (1.9e-3).

Shared memory (99 KiB, so two CTAs fit one multiprocessor):
``dA_qk``, ``dA_kk`` f32 split in place into their bf16 ``hi`` / ``lo``, ``q``, ``k``, ``G`` and the rows ``mb_a``
(TMA-loaded, the rows as four 256-byte copies), two bf16 operand buffers (the decayed operands, then ``dG``'s
``hi`` / ``lo``), ``beta``, ``dqp``, ``dkp`` (``dq``, ``dk`` staged over them). ``dgp`` and ``dbk`` are loaded once
the products are done, over ``dA_qk`` and ``dA_kk`` (then ``dg`` is staged over ``dgp``, ``U`` over ``dbk``).
Every copy between device and shared memory has at most one integer index (token tensors as ``[B * Tp, H, D]``
views, the rest flattened to ``[rows, D]`` / ``[rows]``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu_common import (
    BF16,
    CHUNK,
    F32,
    HEAD_DIM,
    SUB,
    bcast_cols,
    bcast_rows,
    interpret_params,
    load_f32,
    shape_reason,
    split_bf16,
    split_terms,
    tiled,
)

__all__ = ["da_backward", "supports_reason", "KERNEL_NAME", "EXP_CLAMP"]

KERNEL_NAME = "kda_bwd_da_mosaic_gpu"
EXP_CLAMP = 80.0
"""Upper clamp of the decay exponents (gpu_bwd's): the kept entries reach at most 80 (16 tokens at ``g >= -5``)."""
HALF = HEAD_DIM // 2
TILES = CHUNK // SUB
I32 = jnp.int32
G_DTYPES = ("float32", "bfloat16")


def supports_reason(*, dtype: str, k: int, chunk_size: int, g_dtype: str = "float32") -> str | None:
    """None when steps 8-9 of a backward call fit :func:`da_backward`, else why not. ``dtype``: the matmul dtype of
    the call (the promoted dtype of ``q, k, v``; ``dqp`` / ``dkp`` are stored in it); ``g_dtype``: the dtype of ``g``
    (of ``dg``)."""
    reason = shape_reason(dtype=dtype, k=k, v=None, chunk_size=chunk_size)
    if reason is not None:
        return reason
    if g_dtype not in G_DTYPES:
        return f"writes dg as float32 or bfloat16, got g dtype {g_dtype}"
    return None


@dataclasses.dataclass(frozen=True)
class _Smem:
    """Shared memory of one CTA (module docstring); ``[64, 64]`` tiles, 128-byte swizzled, one half of K."""

    aq32: object  # dA_qk f32 (loaded)
    aqh: object  # } bf16 hi / lo of dA_qk, alias aq32
    aql: object  # }
    dgp: object  # f32 (loaded after the products), the same buffer as aq32
    dg: object  # g_dtype (out), aliases aq32 / dgp
    ak32: object  # dA_kk f32 (loaded)
    akh: object  # } alias ak32
    akl: object  # }
    dbk: object  # f32 (loaded after the products), the same buffer as ak32
    uni: object  # U (bf16 0 / 1), aliases akh (written once dbk was read)
    q: object  # bf16
    k: object  # bf16
    g: object  # f32: G
    rows: object  # [4 * 64] f32: G at tokens 15, 31, 47, 63 (mb_a)
    ohi: object  # bf16 operand, hi term
    olo: object  # bf16 operand, lo term
    seg: object  # [64] i32
    beta: object  # [64] f32
    dqp: object  # bf16 (loaded) -> dq (out)
    dkp: object  # bf16 (loaded) -> dk (out)


def _products(groups):
    """``[sum a @ b over terms for terms in groups]``: one ``[64, 64]`` f32 accumulator per group of
    ``(a, b)`` shared-memory operand pairs."""

    def run(*accs):
        for acc, terms in zip(accs, groups, strict=True):
            for a, b in terms:
                plgpu.wgmma(acc, a, b)
        return tuple(acc[...] for acc in accs)

    return pl.run_scoped(run, *(plgpu.ACC((CHUNK, HALF), F32) for _ in groups))


def _stage(s: _Smem, value) -> None:
    """``value`` (f32 ``[64, 64]``) into the operand buffers as ``hi + lo``, committed for wgmma."""
    split_bf16(value, s.ohi, s.olo)
    plgpu.commit_smem()


def _chunk(s: _Smem, scale: float, loads, store):
    """One chunk, one half of K, once the first tiles landed (module docstring). ``loads``: name -> callable:
    ``"mid"`` waits for ``beta, dqp, dkp``; ``"late"`` issues the loads of ``dgp``, ``dbk`` (over the ``dA`` tiles,
    once the products are done with them), ``"late_wait"`` waits for them. ``store(name)`` issues the store of
    ``dq`` / ``dk`` / ``dg`` from its staging buffer."""
    wg = plgpu.Layout.WGMMA
    tile = lax.div(plgpu.broadcasted_iota(I32, (CHUNK, HALF), 0, layout=wg), SUB)
    # dA_qk, dA_kk -> hi + lo over the f32 tiles they came from (each read whole first).
    aq, ak = load_f32(s.aq32), load_f32(s.ak32)
    plgpu.commit_smem()
    split_bf16(aq, s.aqh, s.aql)
    split_bf16(ak, s.akh, s.akl)
    del aq, ak
    gam = load_f32(s.g)
    mb = [bcast_cols(plgpu.layout_cast(s.rows[pl.ds(a * HALF, HALF)], wg.reduce(0))) for a in range(TILES)]
    clamp = lambda x: jnp.exp(jnp.minimum(x, EXP_CLAMP))

    # Row part: tile a's rows of dA (k e^{m_a - G}); m_0 = 0, m_a = mb_{a-1}.
    rq = rk = jnp.zeros((CHUNK, HALF), F32)
    for a in range(TILES):
        _stage(s, load_f32(s.k) * clamp(-gam if a == 0 else mb[a - 1] - gam))
        pq, pk = _products((split_terms(s.aqh, s.aql, s.ohi, s.olo), split_terms(s.akh, s.akl, s.ohi, s.olo)))
        plgpu.commit_smem()  # every warp's wgmma has read the operand before the next one is written
        rq = jnp.where(tile == a, pq, rq)
        rk = jnp.where(tile == a, pk, rk)
    m_rows = sum(jnp.where(tile == a, mb[a - 1], 0.0) for a in range(1, TILES))
    left = jnp.exp(gam - m_rows)  # <= 1
    rq, rk = rq * left, rk * left

    # Column part: tile a's columns of dA (rows of dA^T) with q scale / k at e^{G - mb_a}.
    col = jnp.zeros((CHUNK, HALF), F32)
    aqt, aqlt, akt, aklt = s.aqh.T, s.aql.T, s.akh.T, s.akl.T
    for a in range(TILES):
        up = clamp(gam - mb[a])
        _stage(s, load_f32(s.q) * (up * scale))
        (cq,) = _products((split_terms(aqt, aqlt, s.ohi, s.olo),))
        plgpu.commit_smem()
        _stage(s, load_f32(s.k) * up)
        (ck,) = _products((split_terms(akt, aklt, s.ohi, s.olo),))
        plgpu.commit_smem()
        col = jnp.where(tile == a, cq + ck, col)
    mb_rows = sum(jnp.where(tile == a, mb[a], 0.0) for a in range(TILES))
    col = col * jnp.exp(mb_rows - gam)  # <= 1

    # The tile terms with step 6/7's partials; dgp, dbk land over the dA tiles (every wgmma has read those).
    loads["late"]()
    loads["mid"]()
    seg = bcast_rows(plgpu.layout_cast(s.seg[...], wg.reduce(1)), HALF)
    beta = bcast_rows(plgpu.layout_cast(s.beta[...], wg.reduce(1)), HALF)
    beg = beta * jnp.where(seg == 0, jnp.exp(gam), 0.0)
    kf, qs = load_f32(s.k), load_f32(s.q) * scale
    dq = (load_f32(s.dqp) + rq) * scale
    dk = load_f32(s.dkp) + rk + col
    dgt = qs * rq + kf * (rk - col)
    plgpu.commit_smem()  # every thread's reads of dqp / dkp are done before dq / dk land over them
    s.dqp[...] = dq.astype(s.dqp.dtype)
    loads["late_wait"]()
    dbk = load_f32(s.dbk) * beg
    dk = dk + dbk
    dgt = dgt + load_f32(s.dgp) + dbk * kf
    plgpu.commit_smem()  # every thread's reads of dbk / dgp are done before U / dg land over them
    s.dkp[...] = dk.astype(s.dkp.dtype)
    r = plgpu.broadcasted_iota(I32, (CHUNK, CHUNK), 0, layout=wg)
    c = plgpu.broadcasted_iota(I32, (CHUNK, CHUNK), 1, layout=wg)
    s.uni[...] = jnp.where(c >= r, 1.0, 0.0).astype(BF16)
    _stage(s, dgt)
    store("dq")
    store("dk")
    # dg = U dG: the reverse cumsum inside the chunk.
    (dg,) = _products((((s.uni, s.ohi), (s.uni, s.olo)),))
    s.dg[...] = dg.astype(s.dg.dtype)
    plgpu.commit_smem()
    store("dg")


def _check(q, k, gam, beta, seg_col, dakk, daqk, dqp, dkp, dgp, dbk, g_dtype) -> None:
    """Raise ValueError naming the first argument outside the contract (module docstring)."""
    name = "mosaic_gpu_bwd_da.da_backward"
    B, Tp, H, _ = q.shape
    if Tp % CHUNK:
        raise ValueError(f"{name}: Tp={Tp} must be a multiple of {CHUNK}")
    if jnp.dtype(g_dtype).name not in G_DTYPES:
        raise ValueError(f"{name}: g_dtype must be float32 or bfloat16, got {jnp.dtype(g_dtype).name}")
    BH, D = B * H, HEAD_DIM
    want = dict(q=((B, Tp, H, D), BF16), k=((B, Tp, H, D), BF16), gam=((B, Tp, H, D), F32),
                beta=((B, Tp, H, 1), F32), seg_col=((B, Tp, 1), I32), dakk=((BH, Tp, CHUNK), F32),
                daqk=((BH, Tp, CHUNK), F32), dqp=((BH, Tp, D), BF16), dkp=((BH, Tp, D), BF16),
                dgp=((BH, Tp, D), F32), dbk=((BH, Tp, D), F32))
    got = dict(q=q, k=k, gam=gam, beta=beta, seg_col=seg_col, dakk=dakk, daqk=daqk, dqp=dqp, dkp=dkp, dgp=dgp,
               dbk=dbk)
    for nm, (shape, dtype) in want.items():
        x = got[nm]
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(f"{name}: {nm} must be {jnp.dtype(dtype).name}{list(shape)}, got "
                             f"{x.dtype.name}{list(x.shape)}")


def da_backward(q, k, gam, beta, seg_col, dakk, daqk, dqp, dkp, dgp, dbk, *, scale: float, g_dtype=jnp.float32,
                interpret=False):
    """Steps 8-9 of :mod:`pallas_kernels.kda.gpu_bwd` (its ``_da_tile_kernel`` and ``_dg_cumsum_kernel``) at
    ``K = 128``, chunk 64, every chunk.

    Args (the arrays ``chunk_kda_bwd`` passes the Triton ``_da_tile_kernel``, in its order; ``B, Tp, H``:
    sequences, padded length (a multiple of 64), heads): ``q, k [B, Tp, H, 128]`` bf16, ``gam [B, Tp, H, 128]`` f32
    (``G``, the chunk-local cumsum of ``g``), ``beta [B, Tp, H, 1]`` f32, ``seg_col [B, Tp, 1]`` i32 (document
    starts inside the chunk up to each token; 0 = the document that entered it), ``dakk, daqk [B*H, Tp, 64]`` f32
    (step 7's ``dA_kk``, ``dA_qk``, masked), ``dqp, dkp [B*H, Tp, 128]`` bf16 and ``dgp [B*H, Tp, 128]`` f32 (step
    6's partial dq, dk, dG), ``dbk [B*H, Tp, 128]`` f32 (step 7's ``dB_k``). ``scale``: the query scale;
    ``g_dtype``: the dtype of ``g`` (float32 or bfloat16), that of ``dg``. ``interpret``: False/None (compiled for
    sm_90), True or a ``plgpu.InterpretGPUParams`` (the Mosaic GPU interpreter).

    Returns ``(dq, dk, dg)``, each ``[B, Tp, H, 128]``: ``dq``, ``dk`` in ``q``'s / ``k``'s dtype (bf16), ``dg`` in
    ``g_dtype`` (module docstring).
    """
    _check(q, k, gam, beta, seg_col, dakk, daqk, dqp, dkp, dgp, dbk, g_dtype)
    g_dtype = jnp.dtype(g_dtype)
    B, Tp, H, K = q.shape
    BH, N = B * H, Tp // CHUNK
    interpret = interpret_params(interpret)
    scale = float(scale)
    buf = lambda dt=BF16: plgpu.SMEM((CHUNK, HALF), dt, transforms=tiled(dt))
    smem = (
        plgpu.RefUnion((buf(F32),), (buf(), buf()), (buf(g_dtype),)),  # aq32 = dgp | aqh, aql | dg
        plgpu.RefUnion((buf(F32),), (buf(), buf())),  # ak32 = dbk | akh (then U), akl
        (buf(), buf(), buf(F32), plgpu.SMEM((TILES * HALF,), F32), buf(), buf(), plgpu.SMEM((CHUNK,), I32),
         plgpu.SMEM((CHUNK,), F32), buf(), buf()),  # q, k, g, rows, ohi, olo, seg, beta, dqp, dkp
    )
    n_loads = (6 + TILES, 3, 2)  # loads on each barrier: before the products, dq / dk partials, dgp / dbk

    def kda_bwd_da_mosaic_gpu(q_ref, k_ref, g_ref, grow_ref, beta_ref, seg_ref, dakk_ref, daqk_ref, dqp_ref, dkp_ref,
                              dgp_ref, dbk_ref, dq_out, dk_out, dg_out, smem_refs, bars):
        ((aq32,), (aqh, aql), (dg,)), ((ak32,), (akh, akl)), \
            (qs, ks, gs, rows, ohi, olo, seg, beta, dqp, dkp) = smem_refs
        s = _Smem(aq32=aq32, aqh=aqh, aql=aql, dgp=aq32, dg=dg, ak32=ak32, akh=akh, akl=akl, dbk=ak32, uni=akh,
                  q=qs, k=ks, g=gs, rows=rows, ohi=ohi, olo=olo, seg=seg, beta=beta, dqp=dqp, dkp=dkp)
        first_bar, mid_bar, late_bar = bars
        half, c, bh = lax.axis_index("half"), lax.axis_index("c"), lax.axis_index("bh")
        h = lax.rem(bh, H)
        tok0 = lax.div(bh, H) * Tp + c * CHUNK
        tok = pl.ds(tok0, CHUNK)  # rows of the [B * Tp, H, D] views, of seg
        own = pl.ds(bh * Tp + c * CHUNK, CHUNK)  # rows of the [B*H * Tp, D] views, of beta
        cols = pl.ds(half * HALF, HALF)
        plgpu.copy_gmem_to_smem(daqk_ref.at[own], s.aq32, first_bar)
        plgpu.copy_gmem_to_smem(dakk_ref.at[own], s.ak32, first_bar)
        for src, dst in ((q_ref, s.q), (k_ref, s.k), (g_ref, s.g)):
            plgpu.copy_gmem_to_smem(src.at[tok, h, cols], dst, first_bar)
        for a in range(TILES):  # G at each tile's last token, rows of the [B * Tp * H, D] view
            plgpu.copy_gmem_to_smem(grow_ref.at[(tok0 + SUB * a + SUB - 1) * H + h, cols],
                                    s.rows.at[pl.ds(a * HALF, HALF)], first_bar)
        plgpu.copy_gmem_to_smem(seg_ref.at[tok], s.seg, first_bar)
        plgpu.copy_gmem_to_smem(beta_ref.at[own], s.beta, mid_bar)
        plgpu.copy_gmem_to_smem(dqp_ref.at[own, cols], s.dqp, mid_bar)
        plgpu.copy_gmem_to_smem(dkp_ref.at[own, cols], s.dkp, mid_bar)
        plgpu.barrier_wait(first_bar)

        def late():
            plgpu.copy_gmem_to_smem(dgp_ref.at[own, cols], s.dgp, late_bar)
            plgpu.copy_gmem_to_smem(dbk_ref.at[own, cols], s.dbk, late_bar)

        loads = {"mid": lambda: plgpu.barrier_wait(mid_bar), "late": late,
                 "late_wait": lambda: plgpu.barrier_wait(late_bar)}
        outs = {"dq": (s.dqp, dq_out), "dk": (s.dkp, dk_out), "dg": (s.dg, dg_out)}

        def store(name):
            src, dst = outs[name]
            plgpu.copy_smem_to_gmem(src, dst.at[tok, h, cols])

        _chunk(s, scale, loads, store)
        plgpu.wait_smem_to_gmem(0)

    rows_view = lambda x: x.reshape(B * Tp, H, x.shape[-1])
    flat = lambda x: x.reshape(BH * Tp, x.shape[-1])
    sds = jax.ShapeDtypeStruct
    dq, dk, dg = plgpu.kernel(
        kda_bwd_da_mosaic_gpu,
        out_type=(sds((B * Tp, H, K), q.dtype), sds((B * Tp, H, K), k.dtype), sds((B * Tp, H, K), g_dtype)),
        scratch_types=(smem, tuple(plgpu.Barrier(num_arrivals=n) for n in n_loads)),
        grid=(2, N, BH),
        grid_names=("half", "c", "bh"),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(rows_view(q), rows_view(k), rows_view(gam), gam.reshape(B * Tp * H, K),
      jnp.swapaxes(beta[..., 0], 1, 2).reshape(BH * Tp), seg_col.reshape(B * Tp), flat(dakk), flat(daqk),
      flat(dqp), flat(dkp), flat(dgp), flat(dbk))
    return tuple(x.reshape(B, Tp, H, K) for x in (dq, dk, dg))
