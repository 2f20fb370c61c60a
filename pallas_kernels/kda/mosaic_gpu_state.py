"""KDA chunk forward, part 2 of 2 on Mosaic GPU (sm_90): the sequential pass over the chunks that carries the state
and writes ``o``, from the per-chunk tensors of :mod:`.mosaic_gpu_intra`.

One CTA per ``(V-part, sequence * H + head)``; the V-part (``v_split`` of them) holds ``128 / v_split`` columns of V,
one state warpgroup per 64 columns, plus one memory warpgroup. The memory warpgroup TMA-loads chunk ``c``'s
``qg, kd, wn, v, x, aqk, decay`` into slot ``c % 2`` once the state warpgroups released it (barrier ``free``);
each state warpgroup keeps its transposed fp32 state ``S^T [64, K]`` in registers for the whole sequence and runs,
per chunk (every product on wgmma with ``S^T`` / ``V~^T`` as the register operand, bf16 operands, fp32 accumulation):

``V~^T = v^T X'^T + S^T (-W)^T``, ``O^T = S^T qg^T + V~^T A_qk^T``, ``S^T <- S^T diag(e^{G_C}) + V~^T kd``.

``O^T`` is stored transposed into shared memory and TMA-written to ``o``. The initial state enters and the final
state leaves through a buffer that aliases the slots. Every copy has at most one integer index (:class:`_Where`:
the token tensors as ``[B * Tp, H, D]`` views, ``decay`` as ``[B * H * n_chunks, 128]``, the states as
``[B * H * V, K]``).
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu_common import BF16, CHUNK, F32, HEAD_DIM, VTILE, accumulate, bcast_cols, mma, tiled

SLOTS = 2
REGISTERS = {"memory": 40, "state": 232}
"""Per-thread registers (``setmaxnreg``) with two state warpgroups (the three share 504 per lane); with one state
warpgroup the compiler's own allocation stands."""


@dataclasses.dataclass(frozen=True)
class _Slots:
    """The slot buffers (``[SLOTS, ...]``) and the output staging of one CTA."""

    qg: object  # [S, 64, 128] bf16
    kd: object  # [S, 64, 128] bf16
    wn: object  # [S, 64, 128] bf16
    v: object  # [S, 64, VC] bf16: this CTA's columns of v
    x: object  # [S, 64, 64] bf16
    aqk: object  # [S, 64, 64] bf16
    decay: object  # [S, 128] f32
    ostage: object  # [n_state, 64, 64] bf16: o tile of each state warpgroup


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where one CTA's ``(sequence, head, V-part)`` lives in the flattened views: the token tensors as
    ``[B * Tp, H, D]``, ``decay`` as ``[B * H * n_chunks, 128]``, the states as ``[B * H * V, K]``."""

    bh: object  # sequence * H + head
    h: object
    row0: object  # the sequence's first row of the token views
    v0: object  # first V column of this CTA's part
    n_chunks: int

    def rows(self, c):
        return pl.ds(self.row0 + c * CHUNK, CHUNK)


@dataclasses.dataclass(frozen=True)
class _Bars:
    loaded: object  # [S]: a slot's seven tensors landed
    free: object  # [S]: every state warpgroup done with the slot
    h_loaded: object  # the initial state landed
    h_free: object  # every state warpgroup read it (the slots may be filled)
    done: object  # every state warpgroup left the chunk loop (the final state may overwrite the slots)


def _load_chunk(c, s: _Slots, bars: _Bars, ins, at: _Where, vc: int):
    qg_ref, kd_ref, wn_ref, v_ref, x_ref, aqk_ref, decay_ref = ins
    slot = lax.rem(c, SLOTS)
    rows = at.rows(c)
    bar = bars.loaded.at[slot]
    for src, dst in ((qg_ref, s.qg), (kd_ref, s.kd), (wn_ref, s.wn), (x_ref, s.x), (aqk_ref, s.aqk)):
        plgpu.copy_gmem_to_smem(src.at[rows, at.h], dst.at[slot], bar)
    plgpu.copy_gmem_to_smem(v_ref.at[rows, at.h, pl.ds(at.v0, vc)], s.v.at[slot], bar)
    plgpu.copy_gmem_to_smem(decay_ref.at[at.bh * at.n_chunks + c], s.decay.at[slot], bar)


def _state_step(c, s_t, j: int, s: _Slots, bars: _Bars, stage, o_ref, at: _Where):
    """Chunk ``c`` for the state warpgroup ``j`` (``s_t`` = its ``S^T [64, 128]`` f32); returns the next."""
    slot = lax.rem(c, SLOTS)
    plgpu.barrier_wait(bars.loaded.at[slot])
    s16 = s_t.astype(BF16)
    vj = s.v.at[slot].at[:, VTILE * j:VTILE * (j + 1)].T  # v_j^T [64, 64]

    def first(acc_v, acc_o):
        plgpu.wgmma(acc_v, vj, s.x.at[slot].T)
        mma(acc_v, s16, s.wn.at[slot].T, stage)
        mma(acc_o, s16, s.qg.at[slot].T, stage)
        return acc_v[...], acc_o[...]

    vt, o_part = pl.run_scoped(first, plgpu.ACC((VTILE, CHUNK), F32), plgpu.ACC((VTILE, CHUNK), F32))
    vt16 = vt.astype(BF16)
    decay = plgpu.layout_cast(s.decay.at[slot][...], plgpu.Layout.WGMMA.reduce(0))

    def second(acc_o, acc_s):
        mma(acc_o, vt16, s.aqk.at[slot].T, stage)
        mma(acc_s, vt16, s.kd.at[slot], stage)

    o_t, s_t = accumulate(second, (o_part, s_t * bcast_cols(decay, VTILE)), stage is not None)
    plgpu.barrier_arrive(bars.free.at[slot])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    s.ostage.at[j].T[...] = o_t.astype(BF16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s.ostage.at[j], o_ref.at[at.rows(c), at.h, pl.ds(at.v0 + VTILE * j, VTILE)])
    return s_t


def state_pass(qg, kd, wn, v, x, aqk, decay, h0_t, *, v_split: int, interpret=None):
    """Part 2 (module docstring). Inputs as :func:`.mosaic_gpu_intra.intra_chunks` returns them, ``v [B, Tp, H,
    128]`` bf16, ``h0_t [B, H, V, K]`` f32 (the transposed initial state); ``v_split`` in (1, 2). Returns ``(o [B,
    Tp, H, 128] bf16, ht_t [B, H, V, K] f32)``. ``interpret``: None or a ``plgpu.InterpretGPUParams``."""
    B, Tp, H, K = qg.shape
    if v_split not in (1, 2):
        raise ValueError(f"mosaic_gpu_state.state_pass: v_split must be 1 or 2, got {v_split}")
    n_chunks = Tp // CHUNK
    n_state = HEAD_DIM // VTILE // v_split
    vc = VTILE * n_state
    chunk_buf = lambda d, dt=BF16: plgpu.SMEM((SLOTS, CHUNK, d), dt, transforms=tiled(dt))
    slots = _Slots(qg=chunk_buf(K), kd=chunk_buf(K), wn=chunk_buf(K), v=chunk_buf(vc), x=chunk_buf(CHUNK),
                   aqk=chunk_buf(CHUNK), decay=plgpu.SMEM((SLOTS, K), F32),
                   ostage=plgpu.SMEM((n_state, CHUNK, VTILE), BF16, transforms=tiled()))
    fields = lambda d: tuple(getattr(d, f.name) for f in dataclasses.fields(d))
    smem = plgpu.RefUnion(fields(slots), (plgpu.SMEM((vc, K), F32, transforms=tiled(F32)),))
    bars = _Bars(loaded=plgpu.Barrier(num_arrivals=7, num_barriers=SLOTS),
                 free=plgpu.Barrier(num_arrivals=n_state, num_barriers=SLOTS),
                 h_loaded=plgpu.Barrier(num_arrivals=1), h_free=plgpu.Barrier(num_arrivals=n_state),
                 done=plgpu.Barrier(num_arrivals=n_state))
    stages = ()
    if interpret is not None:
        stages = (plgpu.SMEM((n_state, CHUNK, CHUNK), BF16, transforms=tiled()),
                  plgpu.SMEM((n_state, CHUNK, K), BF16, transforms=tiled()))

    def kda_chunk_state_mosaic_gpu(qg_ref, kd_ref, wn_ref, v_ref, x_ref, aqk_ref, decay_ref, h0_ref, o_ref, ht_ref,
                                   smem_refs, bar_refs, stage_refs):
        main, (hbuf,) = smem_refs
        s, bs = _Slots(*main), _Bars(*bar_refs)
        part, bh, wg = (lax.axis_index(n) for n in ("s", "bh", "wg"))
        at = _Where(bh=bh, h=lax.rem(bh, H), row0=lax.div(bh, H) * Tp, v0=part * vc, n_chunks=n_chunks)
        state_rows = lambda j0, n: pl.ds(bh * HEAD_DIM + at.v0 + j0, n)  # rows of the [B * H * V, K] views
        ins = (qg_ref, kd_ref, wn_ref, v_ref, x_ref, aqk_ref, decay_ref)

        @pl.when(wg == n_state)
        def _memory_wg():
            if interpret is None and n_state == 2:
                plgpu.set_max_registers(REGISTERS["memory"], action="decrease")
            plgpu.copy_gmem_to_smem(h0_ref.at[state_rows(0, vc)], hbuf, bs.h_loaded)
            plgpu.barrier_wait(bs.h_free)

            @pl.loop(0, n_chunks)
            def _(c):
                @pl.when(c >= SLOTS)
                def _():
                    plgpu.barrier_wait(bs.free.at[lax.rem(c, SLOTS)])

                _load_chunk(c, s, bs, ins, at, vc)

            for c in range(max(n_chunks - SLOTS, 0), n_chunks):  # observe every phase of `free`
                plgpu.barrier_wait(bs.free.at[c % SLOTS])

        for j in range(n_state):

            @pl.when(wg == j)
            def _state_wg(j=j):
                if interpret is None and n_state == 2:
                    plgpu.set_max_registers(REGISTERS["state"], action="increase")
                stage = None if interpret is None else {CHUNK: stage_refs[0].at[j], HEAD_DIM: stage_refs[1].at[j]}
                plgpu.barrier_wait(bs.h_loaded)
                s_t = plgpu.layout_cast(hbuf[VTILE * j:VTILE * (j + 1), :], plgpu.Layout.WGMMA)
                plgpu.barrier_arrive(bs.h_free)
                s_t = lax.fori_loop(0, n_chunks, lambda c, st: _state_step(c, st, j, s, bs, stage, o_ref, at), s_t)
                plgpu.wait_smem_to_gmem(0)
                plgpu.barrier_arrive(bs.done)
                plgpu.barrier_wait(bs.done)
                hbuf[VTILE * j:VTILE * (j + 1), :] = s_t
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(hbuf.at[VTILE * j:VTILE * (j + 1)], ht_ref.at[state_rows(VTILE * j, VTILE)])
                plgpu.wait_smem_to_gmem(0)

    rows_view = lambda x: x.reshape(B * Tp, H, x.shape[-1])
    o, ht_t = plgpu.kernel(
        kda_chunk_state_mosaic_gpu,
        out_type=(jax.ShapeDtypeStruct((B * Tp, H, HEAD_DIM), BF16), jax.ShapeDtypeStruct((B * H * HEAD_DIM, K), F32)),
        scratch_types=(smem, fields(bars), stages),
        grid=(v_split, B * H),
        grid_names=("s", "bh"),
        num_threads=n_state + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(*(rows_view(t) for t in (qg, kd, wn, v, x, aqk)), decay.reshape(B * H * n_chunks, K),
      h0_t.reshape(B * H * HEAD_DIM, K))
    return o.reshape(B, Tp, H, HEAD_DIM), ht_t.reshape(B, H, HEAD_DIM, K)
