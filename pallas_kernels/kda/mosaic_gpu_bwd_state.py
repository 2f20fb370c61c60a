"""KDA chunk backward, the reverse sequential state pass on Mosaic GPU (sm_90): the state cotangent ``dS`` carried
backwards through the chunks, from the per-chunk tensors of :mod:`.mosaic_gpu_intra` and the output cotangent.

One CTA per ``(V-part, sequence * H + head)`` as in :mod:`.mosaic_gpu_state`: ``v_split`` V-parts of
``128 / v_split`` columns, one state warpgroup per 64 columns, plus one memory warpgroup that TMA-loads chunk ``c``'s
``qg, kd, wn, aqk, decay`` and this part's columns of ``do`` into slot ``i % 2`` (``i`` = steps taken, chunks
``n - 1, n - 2, ..., 0``). Each state warpgroup keeps its transposed fp32 cotangent ``dS^T [64, K]`` (of the state
leaving the chunk) in registers and runs per chunk (wgmma, bf16 operands, fp32 accumulation):

``dh_c = dS^T`` (written, bf16), ``dV~^T = dO^T A_qk + dS^T kd^T``,
``dS^T <- dS^T diag(e^{G_C}) + dO^T qg + dV~^T (-W)``.

Forward (per chunk, :mod:`.mosaic_gpu_state`): ``V~ = X' v + (-W) S``, ``O = qg S + A_qk V~``,
``S' = diag(e^{G_C}) S + kd^T V~``; the pass needs neither ``S`` nor ``V~``. Every copy between device and shared
memory has at most one integer index: the token tensors as ``[B * Tp, H, D]`` views, ``decay`` as
``[B * H * n_chunks, 128]``, the per-chunk cotangents as ``[B * H * n_chunks * V, K]``, the end states as
``[B * H * V, K]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu_common import BF16, CHUNK, F32, HEAD_DIM, VTILE, accumulate, bcast_cols, mma, tiled

SLOTS = 2
REGISTERS = {"memory": 40, "state": 232}
"""Per-thread registers (``setmaxnreg``) with two state warpgroups; with one the compiler's own allocation stands."""


@dataclasses.dataclass(frozen=True)
class _Slots:
    """The slot buffers (``[SLOTS, ...]``) and the output staging of one CTA."""

    qg: object  # [S, 64, 128] bf16
    kd: object  # [S, 64, 128] bf16
    wn: object  # [S, 64, 128] bf16
    do: object  # [S, 64, VC] bf16: this CTA's columns of do
    aqk: object  # [S, 64, 64] bf16
    decay: object  # [S, 128] f32
    dvstage: object  # [n_state, 64, 64] bf16: dV~ tile of each state warpgroup
    dhstage: object  # [n_state, 64, 128] bf16: dh_c^T rows of each state warpgroup


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where one CTA's ``(sequence, head, V-part)`` lives in the flattened views."""

    bh: object  # sequence * H + head
    h: object
    row0: object  # the sequence's first row of the token views
    v0: object  # first V column of this CTA's part
    n_chunks: int

    def rows(self, c):
        return pl.ds(self.row0 + c * CHUNK, CHUNK)

    def dh_rows(self, c, j: int):
        """Rows of state warpgroup ``j``'s ``dh_c^T`` in the ``[B * H * n_chunks * V, K]`` view."""
        return pl.ds((self.bh * self.n_chunks + c) * HEAD_DIM + self.v0 + VTILE * j, VTILE)


@dataclasses.dataclass(frozen=True)
class _Bars:
    loaded: object  # [S]: a slot's six tensors landed
    free: object  # [S]: every state warpgroup done with the slot
    h_loaded: object  # the final-state cotangent landed
    h_free: object  # every state warpgroup read it (the slots may be filled)
    done: object  # every state warpgroup left the chunk loop (dh0 may overwrite the slots)


def _chunk_of(i, at: _Where):
    return at.n_chunks - 1 - i


def _load_chunk(i, s: _Slots, bars: _Bars, ins, at: _Where, vc: int):
    qg_ref, kd_ref, wn_ref, do_ref, aqk_ref, decay_ref = ins
    c = _chunk_of(i, at)
    slot = lax.rem(i, SLOTS)
    rows = at.rows(c)
    bar = bars.loaded.at[slot]
    for src, dst in ((qg_ref, s.qg), (kd_ref, s.kd), (wn_ref, s.wn), (aqk_ref, s.aqk)):
        plgpu.copy_gmem_to_smem(src.at[rows, at.h], dst.at[slot], bar)
    plgpu.copy_gmem_to_smem(do_ref.at[rows, at.h, pl.ds(at.v0, vc)], s.do.at[slot], bar)
    plgpu.copy_gmem_to_smem(decay_ref.at[at.bh * at.n_chunks + c], s.decay.at[slot], bar)


def _grad_step(i, ds_t, j: int, s: _Slots, bars: _Bars, stage, outs, at: _Where):
    """Step ``i`` (chunk ``n - 1 - i``) for the state warpgroup ``j`` (``ds_t`` = its ``dS^T [64, 128]`` f32, the
    cotangent of the state leaving the chunk); returns the cotangent of the state entering it."""
    dv_ref, dh_ref = outs
    c = _chunk_of(i, at)
    slot = lax.rem(i, SLOTS)
    ds16 = ds_t.astype(BF16)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous step's dh / dV~ stores have read the stages
    s.dhstage.at[j][...] = ds16
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s.dhstage.at[j], dh_ref.at[at.dh_rows(c, j)])
    plgpu.barrier_wait(bars.loaded.at[slot])
    do_t = s.do.at[slot].at[:, VTILE * j:VTILE * (j + 1)].T  # dO_j^T [64, 64]

    def first(acc_dv):
        plgpu.wgmma(acc_dv, do_t, s.aqk.at[slot])
        mma(acc_dv, ds16, s.kd.at[slot].T, stage)
        return acc_dv[...]

    dvt16 = pl.run_scoped(first, plgpu.ACC((VTILE, CHUNK), F32)).astype(BF16)
    decay = plgpu.layout_cast(s.decay.at[slot][...], plgpu.Layout.WGMMA.reduce(0))

    def second(acc_s):
        plgpu.wgmma(acc_s, do_t, s.qg.at[slot])
        mma(acc_s, dvt16, s.wn.at[slot], stage)

    (ds_t,) = accumulate(second, (ds_t * bcast_cols(decay, VTILE),), stage is not None)
    plgpu.barrier_arrive(bars.free.at[slot])
    s.dvstage.at[j].T[...] = dvt16
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s.dvstage.at[j], dv_ref.at[at.rows(c), at.h, pl.ds(at.v0 + VTILE * j, VTILE)])
    return ds_t


def state_grad_pass(qg, kd, wn, aqk, decay, do, dht_t, *, v_split: int, interpret=None):
    """The reverse pass (module docstring). ``qg, kd, wn [B, Tp, H, 128]`` bf16, ``aqk [B, Tp, H, 64]`` bf16,
    ``decay [B, H, Tp / 64, 128]`` f32 (as :func:`.mosaic_gpu_intra.intra_chunks` returns them), ``do [B, Tp, H,
    128]`` bf16, ``dht_t [B, H, V, K]`` f32 (the transposed final-state cotangent); ``v_split`` in (1, 2).
    Returns ``(dvt [B, Tp, H, 128] bf16 = dV~, dh_t [B, H, n_chunks, V, K] bf16 = the transposed cotangent of the
    state leaving each chunk, dh0_t [B, H, V, K] f32)``. ``interpret``: None or a ``plgpu.InterpretGPUParams``."""
    B, Tp, H, K = qg.shape
    if v_split not in (1, 2):
        raise ValueError(f"mosaic_gpu_bwd_state.state_grad_pass: v_split must be 1 or 2, got {v_split}")
    n_chunks = Tp // CHUNK
    n_state = HEAD_DIM // VTILE // v_split
    vc = VTILE * n_state
    chunk_buf = lambda d, dt=BF16: plgpu.SMEM((SLOTS, CHUNK, d), dt, transforms=tiled(dt))
    slots = _Slots(qg=chunk_buf(K), kd=chunk_buf(K), wn=chunk_buf(K), do=chunk_buf(vc), aqk=chunk_buf(CHUNK),
                   decay=plgpu.SMEM((SLOTS, K), F32),
                   dvstage=plgpu.SMEM((n_state, CHUNK, VTILE), BF16, transforms=tiled()),
                   dhstage=plgpu.SMEM((n_state, VTILE, K), BF16, transforms=tiled()))
    fields = lambda d: tuple(getattr(d, f.name) for f in dataclasses.fields(d))
    smem = plgpu.RefUnion(fields(slots), (plgpu.SMEM((vc, K), F32, transforms=tiled(F32)),))
    bars = _Bars(loaded=plgpu.Barrier(num_arrivals=6, num_barriers=SLOTS),
                 free=plgpu.Barrier(num_arrivals=n_state, num_barriers=SLOTS),
                 h_loaded=plgpu.Barrier(num_arrivals=1), h_free=plgpu.Barrier(num_arrivals=n_state),
                 done=plgpu.Barrier(num_arrivals=n_state))
    stages = ()
    if interpret is not None:
        stages = (plgpu.SMEM((n_state, CHUNK, CHUNK), BF16, transforms=tiled()),
                  plgpu.SMEM((n_state, CHUNK, K), BF16, transforms=tiled()))

    def kda_chunk_state_bwd_mosaic_gpu(qg_ref, kd_ref, wn_ref, do_ref, aqk_ref, decay_ref, dht_ref, dv_ref, dh_ref,
                                       dh0_ref, smem_refs, bar_refs, stage_refs):
        main, (hbuf,) = smem_refs
        s, bs = _Slots(*main), _Bars(*bar_refs)
        part, bh, wg = (lax.axis_index(n) for n in ("s", "bh", "wg"))
        at = _Where(bh=bh, h=lax.rem(bh, H), row0=lax.div(bh, H) * Tp, v0=part * vc, n_chunks=n_chunks)
        state_rows = lambda j0, n: pl.ds(bh * HEAD_DIM + at.v0 + j0, n)  # rows of the [B * H * V, K] views
        ins = (qg_ref, kd_ref, wn_ref, do_ref, aqk_ref, decay_ref)

        @pl.when(wg == n_state)
        def _memory_wg():
            if interpret is None and n_state == 2:
                plgpu.set_max_registers(REGISTERS["memory"], action="decrease")
            plgpu.copy_gmem_to_smem(dht_ref.at[state_rows(0, vc)], hbuf, bs.h_loaded)
            plgpu.barrier_wait(bs.h_free)

            @pl.loop(0, n_chunks)
            def _(i):
                @pl.when(i >= SLOTS)
                def _():
                    plgpu.barrier_wait(bs.free.at[lax.rem(i, SLOTS)])

                _load_chunk(i, s, bs, ins, at, vc)

            for i in range(max(n_chunks - SLOTS, 0), n_chunks):  # observe every phase of `free`
                plgpu.barrier_wait(bs.free.at[i % SLOTS])

        for j in range(n_state):

            @pl.when(wg == j)
            def _state_wg(j=j):
                if interpret is None and n_state == 2:
                    plgpu.set_max_registers(REGISTERS["state"], action="increase")
                stage = None if interpret is None else {CHUNK: stage_refs[0].at[j], HEAD_DIM: stage_refs[1].at[j]}
                plgpu.barrier_wait(bs.h_loaded)
                ds_t = plgpu.layout_cast(hbuf[VTILE * j:VTILE * (j + 1), :], plgpu.Layout.WGMMA)
                plgpu.barrier_arrive(bs.h_free)
                ds_t = lax.fori_loop(
                    0, n_chunks, lambda i, d: _grad_step(i, d, j, s, bs, stage, (dv_ref, dh_ref), at), ds_t)
                plgpu.wait_smem_to_gmem(0)
                plgpu.barrier_arrive(bs.done)
                plgpu.barrier_wait(bs.done)
                hbuf[VTILE * j:VTILE * (j + 1), :] = ds_t
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(hbuf.at[VTILE * j:VTILE * (j + 1)], dh0_ref.at[state_rows(VTILE * j, VTILE)])
                plgpu.wait_smem_to_gmem(0)

    rows_view = lambda x: x.reshape(B * Tp, H, x.shape[-1])
    dv, dh_t, dh0_t = plgpu.kernel(
        kda_chunk_state_bwd_mosaic_gpu,
        out_type=(jax.ShapeDtypeStruct((B * Tp, H, HEAD_DIM), BF16),
                  jax.ShapeDtypeStruct((B * H * n_chunks * HEAD_DIM, K), BF16),
                  jax.ShapeDtypeStruct((B * H * HEAD_DIM, K), F32)),
        scratch_types=(smem, fields(bars), stages),
        grid=(v_split, B * H),
        grid_names=("s", "bh"),
        num_threads=n_state + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(*(rows_view(t) for t in (qg, kd, wn, do, aqk)), decay.reshape(B * H * n_chunks, K),
      dht_t.reshape(B * H * HEAD_DIM, K))
    return (dv.reshape(B, Tp, H, HEAD_DIM), dh_t.reshape(B, H, n_chunks, HEAD_DIM, K),
            dh0_t.reshape(B, H, HEAD_DIM, K))


def state_grad_pass_reference(qg, kd, wn, aqk, decay, do, dht_t):
    """Plain-JAX fp32 (``precision=HIGHEST``) reference of :func:`state_grad_pass`: the same three outputs in the
    same dtypes and layouts (a ``lax.scan`` over the chunks in reverse)."""
    B, Tp, H, K = qg.shape
    n = Tp // CHUNK
    hp = lax.Precision.HIGHEST
    split = lambda x: jnp.moveaxis(x.astype(F32).reshape(B, n, CHUNK, H, -1), (1, 3), (0, 2))  # [n, B, H, C, D]
    xs = (split(qg), split(kd), split(wn), split(aqk), split(do), jnp.moveaxis(decay, 2, 0))

    def step(ds_t, x):
        qg_c, kd_c, wn_c, aqk_c, do_c, dec = x
        dvt = (jnp.einsum("bhiv,bhij->bhvj", do_c, aqk_c, precision=hp)
               + jnp.einsum("bhvk,bhik->bhvi", ds_t, kd_c, precision=hp))
        new = (ds_t * dec[:, :, None, :] + jnp.einsum("bhiv,bhik->bhvk", do_c, qg_c, precision=hp)
               + jnp.einsum("bhvi,bhik->bhvk", dvt, wn_c, precision=hp))
        return new, (jnp.swapaxes(dvt, -1, -2), ds_t)

    dh0_t, (dv, dh_t) = lax.scan(step, dht_t.astype(F32), xs, reverse=True)
    dv = jnp.moveaxis(dv, (0, 2), (1, 3)).reshape(B, Tp, H, HEAD_DIM)
    return dv.astype(BF16), jnp.moveaxis(dh_t, 0, 2).astype(BF16), dh0_t
