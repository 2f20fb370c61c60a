"""KDA chunk backward through the UT transform on Mosaic GPU (sm_90): step 7 of :mod:`pallas_kernels.kda.gpu_bwd`,
its two Triton kernels ``_wy_dx_kernel`` and ``_wy_dl_kernel`` fused into one (``dX`` stays on chip: no
``[B*H, Tp, C]`` fp32 round trip through device memory, and no ``dxm`` / ``dbp`` intermediates).

One CTA (one warpgroup) per ``(chunk, sequence * H + head)``, all chunks in parallel. Per chunk of 64 tokens, with
``X`` the inverse ``(I + diag(beta) A_kk)^-1``, ``first`` the tokens of the document that entered the chunk
(``seg_col == 0``) and ``egk = [first] e^G k``:

* ``dA_qk = dO V~^T`` (causal, same document);
* ``dX = (dV~ v^T + dW egk^T) diag(beta)`` (``= dV~ B_v^T + dW B_k^T``);
* ``dL = -X^T dX X^T`` (strictly lower, same document), ``dA_kk = diag(beta) dL``;
* ``dB_v = X^T dV~`` -> ``dv = diag(beta) dB_v``; ``dB_k = X^T dW`` (written out);
* ``dbeta = rowsum(dB_v * v) + rowsum(dB_k * egk) + rowsum(dL * A_kk)``.

Contract (:func:`supports_reason`): bf16 ``k, v, do, vt, dvt``, ``K = V = 128``, chunk 64; ``xm, akk, gam, beta,
dw`` fp32. Arrays in and out are exactly those of the Triton kernels' calls in
:func:`pallas_kernels.kda.gpu_bwd.chunk_kda_bwd` (token tensors ``[B, Tp, H, D]``, intermediates ``[B*H, Tp, D]``;
``Tp`` a multiple of 64); ``beta`` / ``dbeta`` ``[B, Tp, H, 1]`` are transposed to / from ``[B*H * Tp]`` by XLA
around the kernel (a TMA box row must be at least 16 bytes). Every copy between device and shared memory has at
most one integer index (token tensors as ``[B * Tp, H, D]`` views, the rest flattened to ``[rows, D]`` / ``[rows]``).

Precision: every product runs on wgmma with **both operands in shared memory** (as
:mod:`.mosaic_gpu_intra`), bf16 operands, fp32 accumulation. The bf16 operands ``dV~, v, dO, V~`` enter as they are
(exact); every fp32 operand (``X``, ``dW``, ``egk``, ``dX`` and ``X^T dX``) is split into two bf16 terms
``hi + lo`` (together to ~2^-17 relative): a product with one split operand takes both its terms, one of two split
operands the three terms ``hi hi + hi lo + lo hi`` (``lo lo`` is below fp32 rounding). That is more precise than
the Triton kernels' one TF32 pass; tf32 wgmma exists but takes both operands K-major only, and ``X^T`` (A) and
``dV~`` / ``dW`` (B of ``X^T dV~``, ``X^T dW``) enter the other way round.
``beta`` scales in registers (fp32). Relative (Frobenius) errors against the fp32 math (``HIGHEST``) in the
Mosaic GPU interpreter (``tests/test_kda_mosaic_gpu_bwd_wy.py``): ``dbk`` 2.5e-6, ``dakk`` 3.5e-6, ``dbeta``
5e-7, ``daqk`` 0 (exact bf16 operands), ``dv`` (bf16, as the reference's) 4e-5; the Triton kernels' TF32 pass
on the same inputs: 2.1e-4, 3.6e-4, 4.2e-5, 0 and 2.5e-4.

Shared memory (181 KiB, one CTA per multiprocessor): the loaded tiles, the split operands written over the fp32
tiles they came from (``X``, ``G`` -> ``egk``, ``dW``), ``dX`` then ``X^T dX`` over ``k``, and the outputs staged
over inputs no longer read (``dA_qk`` over ``dO, V~``; ``dv`` over ``dV~``; ``dB_k`` over ``dW``; ``dA_kk`` over
``A_kk``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda import mosaic_gpu_common
from pallas_kernels.kda.mosaic_gpu_common import (
    BF16,
    CHUNK,
    F32,
    HEAD_DIM,
    bcast_cols,
    bcast_rows,
    load_f32,
    shape_reason,
    split_bf16,
    split_terms,
    tiled,
)

__all__ = ["wy_backward", "supports_reason", "KERNEL_NAME"]

KERNEL_NAME = "kda_bwd_wy_mosaic_gpu"
HALF = HEAD_DIM // 2
HALVES = (slice(0, HALF), slice(HALF, HEAD_DIM))


def supports_reason(*, dtype: str, k: int, v: int, chunk_size: int) -> str | None:
    """None when step 7 of a backward call fits this kernel, else why not. ``dtype``: the matmul dtype of the call
    (the promoted dtype of ``q, k, v``)."""
    return shape_reason(dtype=dtype, k=k, v=v, chunk_size=chunk_size)


@dataclasses.dataclass(frozen=True)
class _Smem:
    """Shared memory of one CTA (module docstring). ``[64, 64]`` / ``[64, 128]`` tiles, 128-byte swizzled."""

    x32: object  # [64, 64] f32: X (loaded)
    xhi: object  # [64, 64] bf16  } alias x32
    xlo: object  # [64, 64] bf16  }
    gam: object  # [64, 128] f32: G (loaded)
    ehi: object  # [64, 128] bf16: egk  } alias gam
    elo: object  # [64, 128] bf16       }
    dw: object  # [64, 128] f32: dW (loaded) -> dB_k (out)
    dwhi: object  # [64, 128] bf16  } alias dw
    dwlo: object  # [64, 128] bf16  }
    k: object  # [64, 128] bf16 (loaded)
    phi: object  # [64, 64] bf16: dX, then X^T dX  } alias k
    plo: object  # [64, 64] bf16                   }
    do: object  # [64, 128] bf16 (loaded)
    vt: object  # [64, 128] bf16 (loaded)
    daqk: object  # [64, 64] f32 (out), aliases do, vt
    akk: object  # [64, 64] f32: A_kk (loaded) -> dA_kk (out)
    v: object  # [64, 128] bf16 (loaded)
    dvt: object  # [64, 128] bf16: dV~ (loaded) -> dv (out)
    beta: object  # [64] f32
    seg: object  # [64] i32: document starts in the chunk up to each token
    dbeta: object  # [64] f32 (out)


def _products(terms, width: int):
    """``sum a @ b`` over ``terms`` (pairs of shared-memory operands) as a ``[64, width]`` f32 value."""

    def run(acc):
        for a, b in terms:
            plgpu.wgmma(acc, a, b)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC((CHUNK, width), F32))


def _split_in_place(read, dsts) -> None:
    """``read()`` (a list of f32 values) into registers, then each as ``hi + lo`` into its ``(hi, lo)`` refs of
    ``dsts``, which alias the tiles it was read from (every thread has read them first)."""
    values = read()
    plgpu.commit_smem()
    for value, (hi, lo) in zip(values, dsts, strict=True):
        split_bf16(value, hi, lo)


def _chunk(s: _Smem, dqk_out, rest_loaded, outs):
    """One chunk (module docstring). ``dqk_out()`` issues the store of ``dA_qk`` (staged in ``s.daqk``);
    ``rest_loaded()`` waits for every tile but ``dO, V~``; ``outs`` issues the other stores (name -> callable)."""
    wg = plgpu.Layout.WGMMA
    r = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=wg)
    c = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=wg)
    per_row = lambda ref, n: bcast_rows(plgpu.layout_cast(ref[...], wg.reduce(1)), n)
    per_col = lambda ref: bcast_cols(plgpu.layout_cast(ref[...], wg.reduce(0)))
    same = per_row(s.seg, CHUNK) == per_col(s.seg)

    # dA_qk = dO V~^T: causal, one document; staged over dO / V~ once every warp's wgmma has read them.
    daqk = _products(((s.do, s.vt.T),), CHUNK)
    plgpu.commit_smem()
    s.daqk[...] = jnp.where(same & (r >= c), daqk, 0.0)
    plgpu.commit_smem()
    dqk_out()

    rest_loaded()
    # fp32 operands -> hi + lo over the tiles they came from, one operand at a time (registers hold at most one
    # [64, 128] f32 value).
    first = per_row(s.seg, HALF) == 0
    egk = lambda cols: jnp.where(first, jnp.exp(load_f32(s.gam.at[:, cols])), 0.0) * load_f32(s.k.at[:, cols])
    _split_in_place(lambda: [load_f32(s.x32)], [(s.xhi, s.xlo)])
    _split_in_place(lambda: [load_f32(s.dw)], [(s.dwhi, s.dwlo)])
    _split_in_place(lambda: [egk(cols) for cols in HALVES], [(s.ehi.at[:, cols], s.elo.at[:, cols]) for cols in HALVES])
    plgpu.commit_smem()

    beta_col = per_col(s.beta)
    # dX = (dV~ v^T + dW egk^T) diag(beta), split over k (read above).
    dx = _products(((s.dvt, s.v.T), *split_terms(s.dwhi, s.dwlo, s.ehi.T, s.elo.T)), CHUNK) * beta_col
    split_bf16(dx, s.phi, s.plo)
    plgpu.commit_smem()
    # X^T dX, then dL = -(X^T dX) X^T, strictly lower and one document.
    p = _products(split_terms(s.xhi.T, s.xlo.T, s.phi, s.plo), CHUNK)
    plgpu.commit_smem()  # every warp's wgmma has read dX
    split_bf16(p, s.phi, s.plo)
    plgpu.commit_smem()
    dl = _products(split_terms(s.phi, s.plo, s.xhi.T, s.xlo.T), CHUNK)
    dl = jnp.where(same & (r > c), -dl, 0.0)
    beta_row = lambda n: per_row(s.beta, n)
    dbeta = jnp.sum(dl * load_f32(s.akk), axis=1)
    s.akk[...] = dl * beta_row(CHUNK)  # each thread writes the elements it read
    plgpu.commit_smem()
    outs["dakk"]()

    # dB_v = X^T dV~ -> dv = diag(beta) dB_v (over dV~ once every warp's wgmma has read it).
    dbv = _products(((s.xhi.T, s.dvt), (s.xlo.T, s.dvt)), HEAD_DIM)
    dbeta = dbeta + jnp.sum(dbv * load_f32(s.v), axis=1)
    plgpu.commit_smem()
    s.dvt[...] = (dbv * beta_row(HEAD_DIM)).astype(BF16)
    plgpu.commit_smem()
    outs["dv"]()

    # dB_k = X^T dW (over dW).
    dbk = _products(split_terms(s.xhi.T, s.xlo.T, s.dwhi, s.dwlo), HEAD_DIM)
    egk = load_f32(s.ehi) + load_f32(s.elo)
    dbeta = dbeta + jnp.sum(dbk * egk, axis=1)
    plgpu.commit_smem()
    s.dw[...] = dbk
    s.dbeta[...] = dbeta
    plgpu.commit_smem()
    outs["dbk"]()
    outs["dbeta"]()


def _check(xm, akk, k, v, gam, beta, seg_col, do, vt, dvt, dw) -> None:
    """Raise ValueError naming the first argument outside the contract (module docstring)."""
    B, Tp, H, K = k.shape
    BH = B * H
    name = "mosaic_gpu_bwd_wy.wy_backward"
    if Tp % CHUNK:
        raise ValueError(f"{name}: Tp={Tp} must be a multiple of {CHUNK}")
    D = HEAD_DIM
    want = dict(xm=((BH, Tp, CHUNK), F32), akk=((BH, Tp, CHUNK), F32), k=((B, Tp, H, D), BF16),
                v=((B, Tp, H, D), BF16), gam=((B, Tp, H, D), F32), beta=((B, Tp, H, 1), F32),
                seg_col=((B, Tp, 1), jnp.int32), do=((B, Tp, H, D), BF16), vt=((BH, Tp, D), BF16),
                dvt=((BH, Tp, D), BF16), dw=((BH, Tp, D), F32))
    got = dict(xm=xm, akk=akk, k=k, v=v, gam=gam, beta=beta, seg_col=seg_col, do=do, vt=vt, dvt=dvt, dw=dw)
    for nm, (shape, dtype) in want.items():
        x = got[nm]
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(f"{name}: {nm} must be {jnp.dtype(dtype).name}{list(shape)}, got "
                             f"{x.dtype.name}{list(x.shape)}")


def wy_backward(xm, akk, k, v, gam, beta, seg_col, do, vt, dvt, dw, *, interpret=None):
    """Step 7 of :mod:`pallas_kernels.kda.gpu_bwd` (its ``_wy_dx_kernel`` and ``_wy_dl_kernel``) for every chunk.

    Args (``B, Tp, H``: sequences, padded length (a multiple of 64), heads; ``N = Tp / 64``):
    ``xm [B*H, Tp, 64]`` f32 (``X``, row ``t`` = token ``t``'s row of its chunk's inverse), ``akk [B*H, Tp, 64]``
    f32 (``A_kk``, strictly lower, one document, no beta), ``k, v [B, Tp, H, 128]`` bf16, ``gam [B, Tp, H, 128]``
    f32 (``G``, the chunk-local cumsum of ``g``), ``beta [B, Tp, H, 1]`` f32, ``seg_col [B, Tp, 1]`` i32 (document
    starts inside the chunk up to each token; 0 = the document that entered it), ``do [B, Tp, H, 128]`` bf16,
    ``vt, dvt [B*H, Tp, 128]`` bf16 (``V~``, ``dV~``), ``dw [B*H, Tp, 128]`` f32 (``dW``). ``interpret``:
    None/False (compiled for sm_90), True or a ``plgpu.InterpretGPUParams`` (the Mosaic GPU interpreter).

    Returns ``(dv [B, Tp, H, 128] bf16, dbk [B*H, Tp, 128] f32, dakk [B*H, Tp, 64] f32, daqk [B*H, Tp, 64] f32,
    dbeta [B, Tp, H, 1] f32)``: ``dv``, ``dB_k``, ``dA_kk = diag(beta) dL``, ``dA_qk`` (masked) and the whole
    gradient of ``beta`` (its ``dB`` and ``dL`` parts).
    """
    _check(xm, akk, k, v, gam, beta, seg_col, do, vt, dvt, dw)
    B, Tp, H, K = k.shape
    BH, N = B * H, Tp // CHUNK
    interpret = mosaic_gpu_common.interpret_params(interpret)
    buf = lambda d, dt=BF16: plgpu.SMEM((CHUNK, d), dt, transforms=tiled(dt))
    smem = (
        plgpu.RefUnion((buf(CHUNK, F32),), (buf(CHUNK), buf(CHUNK))),  # x32 | xhi, xlo
        plgpu.RefUnion((buf(K, F32),), (buf(K), buf(K))),  # gam | ehi, elo
        plgpu.RefUnion((buf(K, F32),), (buf(K), buf(K))),  # dw | dwhi, dwlo
        plgpu.RefUnion((buf(K),), (buf(CHUNK), buf(CHUNK))),  # k | phi, plo
        plgpu.RefUnion((buf(K), buf(K)), (buf(CHUNK, F32),)),  # do, vt | daqk
        (buf(CHUNK, F32), buf(K), buf(K), plgpu.SMEM((CHUNK,), F32), plgpu.SMEM((CHUNK,), jnp.int32),
         plgpu.SMEM((CHUNK,), F32)),  # akk, v, dvt, beta, seg, dbeta
    )
    n_first, n_rest = 3, 8  # loads on each barrier

    def kda_bwd_wy_mosaic_gpu(x_ref, akk_ref, k_ref, v_ref, gam_ref, beta_ref, seg_ref, do_ref, vt_ref, dvt_ref,
                              dw_ref, dv_out, dbk_out, dakk_out, daqk_out, dbeta_out, smem_refs, bars):
        ((x32,), (xhi, xlo)), ((gam,), (ehi, elo)), ((dwr,), (dwhi, dwlo)), ((kr,), (phi, plo)), \
            ((dor, vtr), (daqk,)), (akk, v, dvt, beta, seg, dbeta) = smem_refs
        s = _Smem(x32=x32, xhi=xhi, xlo=xlo, gam=gam, ehi=ehi, elo=elo, dw=dwr, dwhi=dwhi, dwlo=dwlo, k=kr,
                  phi=phi, plo=plo, do=dor, vt=vtr, daqk=daqk, akk=akk, v=v, dvt=dvt, beta=beta, seg=seg,
                  dbeta=dbeta)
        first_bar, rest_bar = bars
        c, bh = lax.axis_index("c"), lax.axis_index("bh")
        h = lax.rem(bh, H)
        tok = pl.ds(lax.div(bh, H) * Tp + c * CHUNK, CHUNK)  # rows of the [B * Tp, H, D] views, of seg
        own = pl.ds(bh * Tp + c * CHUNK, CHUNK)  # rows of the [B*H * Tp, D] views, of beta / dbeta
        plgpu.copy_gmem_to_smem(do_ref.at[tok, h], s.do, first_bar)
        plgpu.copy_gmem_to_smem(vt_ref.at[own], s.vt, first_bar)
        plgpu.copy_gmem_to_smem(seg_ref.at[tok], s.seg, first_bar)
        for src, dst in ((x_ref, s.x32), (dvt_ref, s.dvt), (dw_ref, s.dw), (akk_ref, s.akk)):
            plgpu.copy_gmem_to_smem(src.at[own], dst, rest_bar)
        for src, dst in ((k_ref, s.k), (v_ref, s.v), (gam_ref, s.gam)):
            plgpu.copy_gmem_to_smem(src.at[tok, h], dst, rest_bar)
        plgpu.copy_gmem_to_smem(beta_ref.at[own], s.beta, rest_bar)
        plgpu.barrier_wait(first_bar)
        outs = {
            "dakk": lambda: plgpu.copy_smem_to_gmem(s.akk, dakk_out.at[own]),
            "dv": lambda: plgpu.copy_smem_to_gmem(s.dvt, dv_out.at[tok, h]),
            "dbk": lambda: plgpu.copy_smem_to_gmem(s.dw, dbk_out.at[own]),
            "dbeta": lambda: plgpu.copy_smem_to_gmem(s.dbeta, dbeta_out.at[own]),
        }
        _chunk(s, lambda: plgpu.copy_smem_to_gmem(s.daqk, daqk_out.at[own]), lambda: plgpu.barrier_wait(rest_bar),
               outs)
        plgpu.wait_smem_to_gmem(0)

    rows_view = lambda x: x.reshape(B * Tp, H, x.shape[-1])
    flat = lambda x: x.reshape(BH * Tp, x.shape[-1])
    sds = jax.ShapeDtypeStruct
    out_type = (sds((B * Tp, H, HEAD_DIM), BF16), sds((BH * Tp, K), F32), sds((BH * Tp, CHUNK), F32),
                sds((BH * Tp, CHUNK), F32), sds((BH * Tp,), F32))
    dv, dbk, dakk, daqk, dbeta = plgpu.kernel(
        kda_bwd_wy_mosaic_gpu,
        out_type=out_type,
        scratch_types=(smem, (plgpu.Barrier(num_arrivals=n_first), plgpu.Barrier(num_arrivals=n_rest))),
        grid=(N, BH),
        grid_names=("c", "bh"),
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(flat(xm), flat(akk), rows_view(k), rows_view(v), rows_view(gam),
      jnp.swapaxes(beta[..., 0], 1, 2).reshape(BH * Tp), seg_col.reshape(B * Tp), rows_view(do), flat(vt),
      flat(dvt), flat(dw))
    dbeta = jnp.swapaxes(dbeta.reshape(B, H, Tp), 1, 2)[..., None]
    return (dv.reshape(B, Tp, H, HEAD_DIM), dbk.reshape(BH, Tp, K), dakk.reshape(BH, Tp, CHUNK),
            daqk.reshape(BH, Tp, CHUNK), dbeta)
