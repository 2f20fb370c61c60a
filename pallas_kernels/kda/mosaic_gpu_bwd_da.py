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
``dA`` tiles through L2. 16-row tiles do not fit wgmma's M of 64, so each tile's part is a full
``[64, 64] x [64, 64]`` product whose rows of that tile are kept (selected into shared memory): the row part of tile
``a`` multiplies ``dA_qk`` / ``dA_kk`` by ``k e^{min(m_a - G, 80)}``, the column part ``dA_qk^T`` / ``dA_kk^T``
(transposed shared memory views) by ``q scale e^{min(G - mb_a, 80)}`` / ``k e^{min(G - mb_a, 80)}``: 6.4x the
multiply-adds of the ten 16x16 tiles on or below the diagonal, all on tensor cores. The reverse cumsum is one more
product: ``dg = U dG`` with ``U[i, t] = [t >= i]`` (exact in bf16).

Order (each wgmma accumulator ``[64, 64]`` f32 is 32 registers a thread; the results live in shared memory between
products so that ptxas needs no spills and keeps the wgmma pipeline): the row part, tile by tile, its rows into two
f32 partials (``rq``, ``rk``); ``dq`` from ``rq`` and ``dqp`` (stored at once), the partials become ``q scale rq +
k rk`` (towards ``dG``) and ``rk`` (towards ``dk``); the column part, tile by tile in one accumulator (the ``k``
operand staged once the ``q`` products have read theirs), folded into the partials (``- k c``, ``+ c``); then the
step 6/7 terms, ``dk`` and ``dG``, and the cumsum.

Precision: every product runs on wgmma with **both operands in shared memory** (bf16, fp32 accumulation; see
:mod:`.mosaic_gpu_intra`); every fp32 operand (``dA_qk``, ``dA_kk``, the decayed ``k`` / ``q`` operands and ``dG``)
is split into two bf16 terms ``hi + lo`` (together ~2^-17 relative); a product of two split operands takes the three
terms ``hi hi + hi lo + lo hi``, the cumsum (``U`` exact) the two ``U hi + U lo``. That is more precise than the
Triton kernel's one TF32 pass (``dG = x dx - y dy`` cancels: bf16 operands gave ``dg`` 5.6% off the fp32 VJP). Gate
factors and sums in fp32, in registers and the f32 partials (``approx_math``: ``exp`` to a few ulp). Relative
(Frobenius) errors against the fp32 math (``HIGHEST``, exact pairwise decays) in the Mosaic GPU interpreter
(``tests/test_kda_mosaic_gpu_bwd_da.py``: two chunks, packed documents, gates at the bound), on the decay products
alone (partials zero): ``dq`` 8.9e-5, ``dk`` 1.2e-4 (both bf16, as the reference's), ``dg`` 2.6e-5 (fp32; 2.1e-4 in
bf16); the Triton kernels' TF32 pass on the same inputs: 1.1e-3, 1.1e-3, 1.2e-3 (1.9e-3).

Shared memory (107 KiB, so two CTAs fit one multiprocessor; buffers take their roles in turn): ``dA_qk``, ``dA_kk``
f32 split in place into their bf16 ``hi`` / ``lo``, then ``dgp``, ``dbk`` (loaded once the products are done; ``dg``
staged over ``dgp``); ``k`` (then ``U``), ``G``, the rows ``mb_a`` (four 256-byte copies), ``seg``, ``beta``; two
bf16 operand buffers (the decayed operands; ``dqp`` lands in the first after the row part and ``dq`` is staged over
it, ``dkp`` in the second after the column part, ``dk`` over it); two f32 partials (``q`` is loaded into the first
and read into registers before the row part writes it; ``dG``'s ``hi`` / ``lo`` end there). Every copy between
device and shared memory has at most one integer index (token tensors as ``[B * Tp, H, D]`` views, the rest
flattened to ``[rows, D]`` / ``[rows]``).
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
    """Shared memory of one CTA (module docstring); ``[64, 64]`` tiles, 128-byte swizzled, one half of K. Fields
    that name the same buffer hold it in turn, in the order listed."""

    aq32: object  # dA_qk f32 (loaded) -> bf16 hi / lo (aqh, aql) -> dgp f32 (late load) -> dg (g_dtype, out)
    aqh: object
    aql: object
    dgp: object
    dg: object
    ak32: object  # dA_kk f32 (loaded) -> akh, akl -> dbk f32 (late load)
    akh: object
    akl: object
    dbk: object
    q: object  # bf16 (loaded; read into registers before gpart lands) -> gpart f32 -> dG hi (bf16)
    gpart: object
    dgh: object
    kpart: object  # f32 -> dG lo (bf16)
    dgl: object
    k: object  # bf16 -> U (bf16 0 / 1)
    uni: object
    g: object  # f32: G
    rows: object  # [4 * 64] f32: G at tokens 15, 31, 47, 63 (mb_a)
    ohi: object  # bf16 operand, hi term; dqp (loaded after the row part) -> dq (out)
    olo: object  # bf16 operand, lo term; dkp (late load) -> dk (out)
    dqp: object
    dkp: object
    seg: object  # [64] i32
    beta: object  # [64] f32


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


def _decay(x):
    """``e^{min(x, 80)}`` (:data:`EXP_CLAMP`)."""
    return jnp.exp(jnp.minimum(x, EXP_CLAMP))


def _mb(s: _Smem, a: int):
    """``mb_a`` (``G`` at tile ``a``'s last token), the same in every row of a ``[64, 64]`` value; read from shared
    memory at each use (no per-tile row stays in registers)."""
    return bcast_cols(plgpu.layout_cast(s.rows[pl.ds(a * HALF, HALF)], plgpu.Layout.WGMMA.reduce(0)))


def _row_refs(s: _Smem, tile):
    """``[64, 64]``: ``m_a`` in the rows of tile ``a`` (``m_0 = 0``, ``m_a = mb_{a-1}``)."""
    out = jnp.zeros((CHUNK, HALF), F32)
    for a in range(1, TILES):
        out = jnp.where(tile == a, _mb(s, a - 1), out)
    return out


def _set_rows(ref, rows, value) -> None:
    """``value`` into the f32 ``ref`` where ``rows`` (bool, WGMMA layout) holds; ``rows=None``: everywhere. Every
    thread reads and writes only its own elements (the WGMMA layout both ways), so no barrier is needed around it."""
    ref[...] = value if rows is None else jnp.where(rows, value, load_f32(ref))


def _row_part(s: _Smem, tile) -> None:
    """The row part (module docstring) before the rows' ``e^{G - m_a}``: per tile ``a``, ``dA_qk`` and ``dA_kk``
    times the staged ``k e^{min(m_a - G, 80)}`` (``m_0 = 0``, ``m_a = mb_{a-1}``), tile ``a``'s rows kept in
    ``s.gpart`` / ``s.kpart``. Leaves the operand buffers free (every warp's wgmma has read them)."""
    for a in range(TILES):
        ref = 0.0 if a == 0 else _mb(s, a - 1)
        _stage(s, load_f32(s.k) * _decay(ref - load_f32(s.g)))
        pq, pk = _products((split_terms(s.aqh, s.aql, s.ohi, s.olo), split_terms(s.akh, s.akl, s.ohi, s.olo)))
        plgpu.commit_smem()  # every warp's wgmma has read the operand before the next one is written
        rows = None if a == 0 else tile == a  # tile 0 comes first: all rows
        _set_rows(s.gpart, rows, pq)
        _set_rows(s.kpart, rows, pk)


def _fold_rows(s: _Smem, qs, scale: float, tile) -> None:
    """Once :func:`_row_part` is done and ``dqp`` landed: ``rq`` / ``rk`` are ``s.gpart`` / ``s.kpart`` times the
    rows' ``e^{G - m_a}`` (<= 1); ``dq = (dqp + rq) scale`` over ``dqp``, ``s.gpart = qs rq + k rk``, ``s.kpart =
    rk`` (``qs = q scale``, f32). In place: every thread writes only the elements it read."""
    left = jnp.exp(load_f32(s.g) - _row_refs(s, tile))
    rq = load_f32(s.gpart) * left
    s.dqp[...] = ((load_f32(s.dqp) + rq) * scale).astype(s.dqp.dtype)
    rk = load_f32(s.kpart) * left
    s.kpart[...] = rk
    s.gpart[...] = qs * rq + load_f32(s.k) * rk


def _col_tile(s: _Smem, qs, a: int):
    """``dA_qk^T qs e^{min(G - mb_a, 80)} + dA_kk^T k e^{min(G - mb_a, 80)}`` (``[64, 64]`` f32; ``qs = q scale``):
    the column part of tile ``a`` before its rows' ``e^{mb_a - G}``, in one accumulator. The ``k`` operand is
    computed while the ``q`` products run and staged over the ``q`` operand once every warp's wgmma has read it.
    Leaves the operand buffers free."""

    def run(acc):
        up = _decay(load_f32(s.g) - _mb(s, a))
        _stage(s, qs * up)
        for x, y in split_terms(s.aqh.T, s.aql.T, s.ohi, s.olo):
            plgpu.wgmma(acc, x, y)
        k_op = load_f32(s.k) * up
        plgpu.wgmma_wait(0)
        plgpu.commit_smem()  # every warp's wgmma has read the q operand before the k operand lands over it
        _stage(s, k_op)
        for x, y in split_terms(s.akh.T, s.akl.T, s.ohi, s.olo):
            plgpu.wgmma(acc, x, y)
        return acc[...]

    out = pl.run_scoped(run, plgpu.ACC((CHUNK, HALF), F32))
    plgpu.commit_smem()  # every warp's wgmma has read the operand (and dA) before anything lands over them
    return out


def _col_part(s: _Smem, qs, tile) -> None:
    """The column part ``c`` (module docstring) folded into the partials tile by tile: in tile ``a``'s rows,
    ``c = e^{mb_a - G}`` :func:`_col_tile` ``(a)`` (<= 1), ``s.kpart += c``, ``s.gpart -= k c`` (in place, each
    thread its own elements; the factor overflows only in rows the select drops)."""
    for a in range(TILES):
        c = _col_tile(s, qs, a) * jnp.exp(_mb(s, a) - load_f32(s.g))
        _set_rows(s.kpart, tile == a, load_f32(s.kpart) + c)
        _set_rows(s.gpart, tile == a, load_f32(s.gpart) - load_f32(s.k) * c)


def _finish(s: _Smem):
    """Once the late loads landed: ``dk = dkp + kpart + dB_k beta [first] e^G`` over ``dkp`` (each thread writes
    only the elements it read); returns ``dG = gpart + dgp + dB_k beta [first] e^G k`` (f32)."""
    wg = plgpu.Layout.WGMMA
    seg = bcast_rows(plgpu.layout_cast(s.seg[...], wg.reduce(1)), HALF)
    beta = bcast_rows(plgpu.layout_cast(s.beta[...], wg.reduce(1)), HALF)
    dbk = load_f32(s.dbk) * beta * jnp.where(seg == 0, jnp.exp(load_f32(s.g)), 0.0)
    s.dkp[...] = (load_f32(s.dkp) + load_f32(s.kpart) + dbk).astype(s.dkp.dtype)
    return load_f32(s.gpart) + load_f32(s.dgp) + dbk * load_f32(s.k)


def _chunk(s: _Smem, scale: float, loads, store):
    """One chunk, one half of K, once the first loads landed (module docstring). ``loads[name]()`` issues
    (``"dqp"``: into the operand buffers, free after the row part; ``"late"``: ``dkp, dgp, dbk, beta`` over the
    operand and ``dA`` buffers once the products are done with them) or waits for (``"dqp_wait"``,
    ``"late_wait"``) loads. ``store(name)`` issues the store of ``dq`` / ``dk`` / ``dg`` from its staging buffer.

    Registers hold ``q`` and at most a few ``[64, 64]`` f32 values at a time: the row part's results go to
    shared memory tile by tile, ``dq`` is finished right after it (so two f32 partials cover ``dk`` and ``dG``),
    and the column part is folded into those partials tile by tile."""
    wg = plgpu.Layout.WGMMA
    tile = lax.div(plgpu.broadcasted_iota(I32, (CHUNK, HALF), 0, layout=wg), SUB)
    # dA_qk, dA_kk -> hi + lo over the f32 tiles they came from (each read whole first); q into registers before
    # gpart lands over it.
    aq, ak = load_f32(s.aq32), load_f32(s.ak32)
    qs = plgpu.layout_cast(s.q[...], wg).astype(F32) * scale
    plgpu.commit_smem()
    split_bf16(aq, s.aqh, s.aql)
    split_bf16(ak, s.akh, s.akl)
    del aq, ak

    _row_part(s, tile)
    loads["dqp"]()
    loads["dqp_wait"]()
    _fold_rows(s, qs, scale, tile)
    plgpu.commit_smem()
    store("dq")
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # dq read out before the operands land over it
    _col_part(s, qs, tile)
    del qs
    loads["late"]()
    loads["late_wait"]()
    dgt = _finish(s)
    plgpu.commit_smem()  # every thread's reads of k, gpart, kpart are done before U, dG land over them
    r = plgpu.broadcasted_iota(I32, (CHUNK, CHUNK), 0, layout=wg)
    c = plgpu.broadcasted_iota(I32, (CHUNK, CHUNK), 1, layout=wg)
    s.uni[...] = jnp.where(c >= r, 1.0, 0.0).astype(BF16)
    split_bf16(dgt, s.dgh, s.dgl)
    plgpu.commit_smem()
    store("dk")
    # dg = U dG: the reverse cumsum inside the chunk.
    (dg,) = _products((((s.uni, s.dgh), (s.uni, s.dgl)),))
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
        plgpu.RefUnion((buf(F32),), (buf(), buf())),  # ak32 = dbk | akh, akl
        plgpu.RefUnion((buf(F32),), (buf(),)),  # gpart | q = dG hi
        plgpu.RefUnion((buf(F32),), (buf(),)),  # kpart | dG lo
        (buf(), buf(F32), plgpu.SMEM((TILES * HALF,), F32), buf(), buf(), plgpu.SMEM((CHUNK,), I32),
         plgpu.SMEM((CHUNK,), F32)),  # k = U, g, rows, ohi = dqp, olo = dkp, seg, beta
    )
    n_loads = (6 + TILES, 1, 4)  # loads on each barrier: before the products, dqp, the late ones

    def kda_bwd_da_mosaic_gpu(q_ref, k_ref, g_ref, grow_ref, beta_ref, seg_ref, dakk_ref, daqk_ref, dqp_ref, dkp_ref,
                              dgp_ref, dbk_ref, dq_out, dk_out, dg_out, smem_refs, bars):
        (((aq32,), (aqh, aql), (dg,)), ((ak32,), (akh, akl)), ((gpart,), (qb,)), ((kpart,), (dgl,)),
         (ks, gs, rows, ohi, olo, seg, beta)) = smem_refs
        s = _Smem(aq32=aq32, aqh=aqh, aql=aql, dgp=aq32, dg=dg, ak32=ak32, akh=akh, akl=akl, dbk=ak32, q=qb,
                  gpart=gpart, dgh=qb, kpart=kpart, dgl=dgl, k=ks, uni=ks, g=gs, rows=rows, ohi=ohi, olo=olo, dqp=ohi,
                  dkp=olo, seg=seg, beta=beta)
        first_bar, dqp_bar, late_bar = bars
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
        plgpu.barrier_wait(first_bar)

        def late():
            plgpu.copy_gmem_to_smem(beta_ref.at[own], s.beta, late_bar)
            for src, dst in ((dkp_ref, s.dkp), (dgp_ref, s.dgp), (dbk_ref, s.dbk)):
                plgpu.copy_gmem_to_smem(src.at[own, cols], dst, late_bar)

        loads = {"dqp": lambda: plgpu.copy_gmem_to_smem(dqp_ref.at[own, cols], s.dqp, dqp_bar),
                 "dqp_wait": lambda: plgpu.barrier_wait(dqp_bar), "late": late,
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
