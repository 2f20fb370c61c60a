"""KDA chunk backward, the two sequential sweeps over chunks on Mosaic GPU (sm_90): steps 4 and 5 of
:mod:`pallas_kernels.kda.gpu_bwd`, one for one in place of its Triton ``_h_kernel`` and ``_ds_kernel`` (same
arrays in, same arrays out; :func:`pallas_kernels.kda.gpu_bwd.chunk_kda_bwd` picks them with
``sweeps="mosaic_gpu"``).

Contract (:func:`supports_reason`): bf16 per-chunk tensors, ``K = V = 128``, chunk 64, ``h`` / ``dh`` stored in
bf16. The per-chunk inputs are in :class:`pallas_kernels.kda._layout.ChunkResiduals`' layouts (``[B, Tp, H, D]``
token tensors, the chunk decay ``dl [B*H, N, 1, K]`` fp32); the outputs in gpu_bwd's intermediate layouts
(``[B*H, N, V, K]`` per-chunk states, ``[B*H, Tp, V]`` token tensors, ``[B*H, V, K]`` fp32 transposed states).

Layout of both kernels (as :mod:`.mosaic_gpu_state`): one CTA per ``(V-part, sequence * H + head)``; the V-part
(``v_split`` of them) holds ``128 / v_split`` columns of V, one state warpgroup per 64 columns, plus one memory
warpgroup that TMA-loads chunk ``c``'s tensors into slot ``i % 2`` (``i`` the step: ``c`` forward, ``N - 1 - c``
in reverse) once the state warpgroups released it. Each state warpgroup keeps its fp32 ``[64, K]`` slice of the
transposed state (:func:`h_sweep`) or state cotangent (:func:`ds_sweep`) in registers for the whole sequence; every
product runs on wgmma with the register operand the transposed state (or ``V~^T`` / ``dV~^T``), bf16 operands and
fp32 accumulation, as the Triton kernels (which round the same operands to bf16). Per chunk a state warpgroup
stores its state slice (bf16) and its transposed ``V~`` / ``dV~`` tile through shared memory by TMA. The initial
state enters, and in the reverse sweep the final cotangent leaves, through a buffer that aliases the slots. Every
copy has at most one integer index (token tensors as ``[B * Tp, H, D]`` views, the rest flattened to 2-D).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu import DEFAULT_SMS, default_v_split
from pallas_kernels.kda.mosaic_gpu_common import (
    BF16,
    CHUNK,
    F32,
    HEAD_DIM,
    VTILE,
    accumulate,
    bcast_cols,
    interpret_params,
    mma,
    shape_reason,
    tiled,
)

__all__ = ["h_sweep", "ds_sweep", "supports_reason", "KERNEL_NAMES"]

SLOTS = 2
REGISTERS = {"memory": 40, "state": 232}
"""Per-thread registers (``setmaxnreg``) with two state warpgroups; with one the compiler's allocation stands."""
KERNEL_NAMES = ("kda_bwd_h_mosaic_gpu", "kda_bwd_ds_mosaic_gpu")


def supports_reason(*, dtype: str, k: int, v: int, chunk_size: int, state_dtype: str = "bfloat16") -> str | None:
    """None when the sweeps of a backward call fit these kernels, else why not. ``dtype``: the matmul dtype of the
    call (the promoted dtype of ``q, k, v``); ``state_dtype``: the storage dtype of ``h`` / ``dh``. Compiled, the
    kernels also need an sm_90+ GPU (not checked here; the interpreter runs anywhere)."""
    return shape_reason(dtype=dtype, k=k, v=v, chunk_size=chunk_size, state_dtype=state_dtype)


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where one CTA's ``(sequence, head, V-part)`` lives in the flattened views: token inputs ``[B * Tp, H, D]``,
    token outputs ``[B * H * Tp, V]``, ``dl`` ``[B * H * N, K]``, per-chunk states ``[B * H * N * V, K]``, single
    states ``[B * H * V, K]``."""

    bh: object  # sequence * H + head
    h: object
    row0: object  # the sequence's first row of the token input views
    v0: object  # first V column of this CTA's part
    tp: int
    n_chunks: int

    def rows(self, c):
        return pl.ds(self.row0 + c * CHUNK, CHUNK)

    def out_rows(self, c):
        return pl.ds(self.bh * self.tp + c * CHUNK, CHUNK)

    def state_rows(self, c, j: int):
        return pl.ds((self.bh * self.n_chunks + c) * HEAD_DIM + self.v0 + VTILE * j, VTILE)

    def single_rows(self, j0: int, n: int):
        return pl.ds(self.bh * HEAD_DIM + self.v0 + j0, n)


@dataclasses.dataclass(frozen=True)
class _Bars:
    loaded: object  # [S]: a slot's tensors landed
    free: object  # [S]: every state warpgroup done with the slot
    h_loaded: object  # the initial state (cotangent) landed
    h_free: object  # every state warpgroup read it (the slots may be filled)
    done: object  # every state warpgroup left the chunk loop (the final state may overwrite the slots)


class _Sweep:
    """What one state warpgroup needs per step: the slot refs by name (``[SLOTS, 64, D]``, ``part``: this CTA's V
    columns, ``dl``: ``[SLOTS, K]``), its staging tiles, the barriers, the output refs and the CTA's place."""

    def __init__(self, slots: dict, hstage, vstage, bars: _Bars, outs, at: _Where, stage):
        self.slots, self.hstage, self.vstage, self.bars, self.outs, self.at, self.stage = (
            slots, hstage, vstage, bars, outs, at, stage)

    def begin(self, i, st, j: int, c):
        """Wait for step ``i``'s slot and store ``st`` (bf16) as chunk ``c``'s state slice of warpgroup ``j``."""
        slot = lax.rem(i, SLOTS)
        plgpu.barrier_wait(self.bars.loaded.at[slot])
        s16 = st.astype(BF16)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous step's two stores have read their tiles
        self.hstage.at[j][...] = s16
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(self.hstage.at[j], self.outs[0].at[self.at.state_rows(c, j)])
        return slot, s16

    def decay(self, slot):
        return bcast_cols(plgpu.layout_cast(self.slots["dl"].at[slot][...], plgpu.Layout.WGMMA.reduce(0)), VTILE)

    def part(self, slot, j: int):
        """This warpgroup's 64 columns of the V-sliced token tensor, transposed: ``[64 (V), 64 (tokens)]``."""
        return self.slots["part"].at[slot].at[:, VTILE * j:VTILE * (j + 1)].T

    def end(self, slot, tile_t, j: int, c):
        """Release the slot and store ``tile_t`` (``[64 (V), 64 (tokens)]`` bf16) transposed as chunk ``c``'s rows
        of the token output."""
        plgpu.barrier_arrive(self.bars.free.at[slot])
        self.vstage.at[j].T[...] = tile_t
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(self.vstage.at[j],
                                self.outs[1].at[self.at.out_rows(c), pl.ds(self.at.v0 + VTILE * j, VTILE)])


def _h_step(i, s_t, j: int, sw: _Sweep):
    """Chunk ``c = i`` forward: ``h[c] = S_in^T``, ``V~^T = v^T X'^T + S_in^T wn^T``, ``S_out^T = S_in^T diag(dl) +
    V~^T kd``."""
    slot, s16 = sw.begin(i, s_t, j, i)
    sl = sw.slots

    def first(acc_v):
        plgpu.wgmma(acc_v, sw.part(slot, j), sl["xb"].at[slot].T)
        mma(acc_v, s16, sl["wn"].at[slot].T, sw.stage)
        return acc_v[...]

    vt16 = pl.run_scoped(first, plgpu.ACC((VTILE, CHUNK), F32)).astype(BF16)
    (s_t,) = accumulate(lambda acc_s: mma(acc_s, vt16, sl["kd"].at[slot], sw.stage), (s_t * sw.decay(slot),),
                        sw.stage is not None)
    sw.end(slot, vt16, j, i)
    return s_t


def _ds_step(i, d_t, j: int, sw: _Sweep):
    """Chunk ``c = N - 1 - i`` in reverse, ``d_t = dS'^T`` (cotangent of the state leaving it): ``dh[c] = dS'^T``,
    ``dV~^T = dO^T A_qk + dS'^T kd^T``, ``dS^T = dS'^T diag(dl) + dO^T qg + dV~^T wn``."""
    c = sw.at.n_chunks - 1 - i
    slot, d16 = sw.begin(i, d_t, j, c)
    sl = sw.slots
    do_t = sw.part(slot, j)

    def first(acc_v):
        plgpu.wgmma(acc_v, do_t, sl["aqk"].at[slot])
        mma(acc_v, d16, sl["kd"].at[slot].T, sw.stage)
        return acc_v[...]

    dvt16 = pl.run_scoped(first, plgpu.ACC((VTILE, CHUNK), F32)).astype(BF16)

    def second(acc_s):
        plgpu.wgmma(acc_s, do_t, sl["qg"].at[slot])
        mma(acc_s, dvt16, sl["wn"].at[slot], sw.stage)

    (d_t,) = accumulate(second, (d_t * sw.decay(slot),), sw.stage is not None)
    sw.end(slot, dvt16, j, c)
    return d_t


def _sweep(name: str, step, reverse: bool, tok_ins: dict, part, dl, state0, v_split, interpret):
    """The shared kernel: ``tok_ins`` ``{name: [B, Tp, H, D] bf16}`` loaded whole per chunk, ``part [B, Tp, H, V]``
    loaded by V-part, ``dl [B*H, N, 1, K]`` f32, ``state0 [B*H, V, K]`` f32 the state entering the sweep.
    Returns ``(states [B*H, N, V, K] bf16, tokens [B*H, Tp, V] bf16)`` plus, in reverse, the final state
    ``[B*H, V, K]`` f32."""
    B, Tp, H, V = part.shape
    K = HEAD_DIM
    BH, N = B * H, Tp // CHUNK
    interpret = interpret_params(interpret)
    if v_split is None:
        v_split = default_v_split(B, H, DEFAULT_SMS if interpret is not None else None)
    if v_split not in (1, 2):
        raise ValueError(f"mosaic_gpu_bwd_sweeps.{name}: v_split must be 1 or 2, got {v_split}")
    n_state = HEAD_DIM // VTILE // v_split
    vc = VTILE * n_state
    names = tuple(tok_ins)
    chunk_buf = lambda d, dt=BF16: plgpu.SMEM((SLOTS, CHUNK, d), dt, transforms=tiled(dt))
    slot_types = tuple(chunk_buf(x.shape[-1]) for x in tok_ins.values()) + (
        chunk_buf(vc), plgpu.SMEM((SLOTS, K), F32),
        plgpu.SMEM((n_state, VTILE, K), BF16, transforms=tiled()),  # state slices out
        plgpu.SMEM((n_state, CHUNK, VTILE), BF16, transforms=tiled()))  # token tiles out
    smem = plgpu.RefUnion(slot_types, (plgpu.SMEM((vc, K), F32, transforms=tiled(F32)),))
    n_loads = len(names) + 2
    bar_types = (plgpu.Barrier(num_arrivals=n_loads, num_barriers=SLOTS),
                 plgpu.Barrier(num_arrivals=n_state, num_barriers=SLOTS), plgpu.Barrier(num_arrivals=1),
                 plgpu.Barrier(num_arrivals=n_state), plgpu.Barrier(num_arrivals=n_state))
    stages = ()
    if interpret is not None:  # register wgmma operands staged for the interpreter
        stages = (plgpu.SMEM((n_state, CHUNK, CHUNK), BF16, transforms=tiled()),
                  plgpu.SMEM((n_state, CHUNK, K), BF16, transforms=tiled()))
    n_in = len(names) + 3

    def body(*refs):
        ins, outs, (smem_refs, bar_refs, stage_refs) = refs[:n_in], refs[n_in:-3], refs[-3:]
        tok_refs, part_ref, dl_ref, state0_ref = ins[:-3], *ins[-3:]
        main, (sbuf,) = smem_refs
        slots = dict(zip(names, main[:len(names)], strict=True)) | {"part": main[-4], "dl": main[-3]}
        bs = _Bars(*bar_refs)
        vpart, bh, wg = (lax.axis_index(n) for n in ("s", "bh", "wg"))
        at = _Where(bh=bh, h=lax.rem(bh, H), row0=lax.div(bh, H) * Tp, v0=vpart * vc, tp=Tp, n_chunks=N)

        @pl.when(wg == n_state)
        def _memory_wg():
            if interpret is None and n_state == 2:
                plgpu.set_max_registers(REGISTERS["memory"], action="decrease")
            plgpu.copy_gmem_to_smem(state0_ref.at[at.single_rows(0, vc)], sbuf, bs.h_loaded)
            plgpu.barrier_wait(bs.h_free)

            @pl.loop(0, N)
            def _(i):
                slot = lax.rem(i, SLOTS)

                @pl.when(i >= SLOTS)
                def _():
                    plgpu.barrier_wait(bs.free.at[slot])

                c = N - 1 - i if reverse else i
                rows, bar = at.rows(c), bs.loaded.at[slot]
                for src, nm in zip(tok_refs, names, strict=True):
                    plgpu.copy_gmem_to_smem(src.at[rows, at.h], slots[nm].at[slot], bar)
                plgpu.copy_gmem_to_smem(part_ref.at[rows, at.h, pl.ds(at.v0, vc)], slots["part"].at[slot], bar)
                plgpu.copy_gmem_to_smem(dl_ref.at[bh * N + c], slots["dl"].at[slot], bar)

            for i in range(max(N - SLOTS, 0), N):  # observe every phase of `free`
                plgpu.barrier_wait(bs.free.at[i % SLOTS])

        for j in range(n_state):

            @pl.when(wg == j)
            def _state_wg(j=j):
                if interpret is None and n_state == 2:
                    plgpu.set_max_registers(REGISTERS["state"], action="increase")
                stage = None if interpret is None else {CHUNK: stage_refs[0].at[j], K: stage_refs[1].at[j]}
                sw = _Sweep(slots, main[-2], main[-1], bs, outs, at, stage)
                plgpu.barrier_wait(bs.h_loaded)
                st = plgpu.layout_cast(sbuf[VTILE * j:VTILE * (j + 1), :], plgpu.Layout.WGMMA)
                plgpu.barrier_arrive(bs.h_free)
                st = lax.fori_loop(0, N, lambda i, s: step(i, s, j, sw), st)
                plgpu.wait_smem_to_gmem(0)
                if reverse:
                    plgpu.barrier_arrive(bs.done)
                    plgpu.barrier_wait(bs.done)
                    sbuf[VTILE * j:VTILE * (j + 1), :] = st
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(sbuf.at[VTILE * j:VTILE * (j + 1)],
                                            outs[2].at[at.single_rows(VTILE * j, VTILE)])
                    plgpu.wait_smem_to_gmem(0)

    body.__name__ = name
    out_type = (jax.ShapeDtypeStruct((BH * N * V, K), BF16), jax.ShapeDtypeStruct((BH * Tp, V), BF16))
    if reverse:
        out_type += (jax.ShapeDtypeStruct((BH * V, K), F32),)
    rows_view = lambda x: x.reshape(B * Tp, H, x.shape[-1])
    outs = plgpu.kernel(
        body, out_type=out_type, scratch_types=(smem, bar_types, stages), grid=(v_split, BH),
        grid_names=("s", "bh"), num_threads=n_state + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(*(rows_view(t) for t in tok_ins.values()), rows_view(part), dl.reshape(BH * N, K), state0.reshape(BH * V, K))
    res = (outs[0].reshape(BH, N, V, K), outs[1].reshape(BH, Tp, V))
    return res + ((outs[2].reshape(BH, V, K),) if reverse else ())


def _check(name: str, tok_ins: dict, part, dl, state0) -> None:
    """Raise ValueError naming the first argument outside the contract (module docstring)."""
    B, Tp, H, V = part.shape
    BH, N = B * H, Tp // CHUNK
    want = {nm: ((B, Tp, H, CHUNK if nm in ("xb", "aqk") else HEAD_DIM), BF16) for nm in tok_ins}
    want |= {"part": ((B, Tp, H, HEAD_DIM), BF16), "dl": ((BH, N, 1, HEAD_DIM), F32),
             "state": ((BH, HEAD_DIM, HEAD_DIM), F32)}
    got = tok_ins | {"part": part, "dl": dl, "state": state0}
    if Tp % CHUNK:
        raise ValueError(f"mosaic_gpu_bwd_sweeps.{name}: Tp={Tp} must be a multiple of {CHUNK}")
    for nm, (shape, dtype) in want.items():
        x = got[nm]
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(f"mosaic_gpu_bwd_sweeps.{name}: {nm} must be {jnp.dtype(dtype).name}{list(shape)}, got "
                             f"{x.dtype.name}{list(x.shape)}")


def h_sweep(wn, xb, v, kd, dl, h0t, *, v_split: int | None = None, interpret=None):
    """Step 4 of :mod:`pallas_kernels.kda.gpu_bwd` (its ``_h_kernel``), forward over the chunks: per chunk ``c``
    ``h[c] = S_in^T``, ``V~ = X' v + wn S_in`` (``wn = -W``), ``S_out = diag(dl) S_in + kd^T V~``.

    Args: ``wn [B, Tp, H, 128]``, ``xb [B, Tp, H, 64]`` (``X'``), ``v [B, Tp, H, 128]``, ``kd [B, Tp, H, 128]``, all
    bf16; ``dl [B*H, N, 1, 128]`` f32 (chunk decay ``e^{G_C}``); ``h0t [B*H, V, K]`` f32 (initial state,
    transposed). ``Tp = 64 N``. ``v_split``: 1, 2 or None (as the forward's state pass:
    :func:`pallas_kernels.kda.mosaic_gpu.default_v_split`); ``interpret``: None/False (compiled for sm_90), True or
    a ``plgpu.InterpretGPUParams`` (the Mosaic GPU interpreter).
    Returns ``(h [B*H, N, V, K] bf16, vt [B*H, Tp, V] bf16)``: the transposed state entering each chunk and ``V~``.
    """
    ins = {"wn": wn, "xb": xb, "kd": kd}
    _check("h_sweep", ins, v, dl, h0t)
    return _sweep("kda_bwd_h_mosaic_gpu", _h_step, False, ins, v, dl, h0t, v_split, interpret)


def ds_sweep(aqk, qg, kd, wn, dl, do, dhtt, *, v_split: int | None = None, interpret=None):
    """Step 5 of :mod:`pallas_kernels.kda.gpu_bwd` (its ``_ds_kernel``), backward over the chunks from the
    final-state cotangent: per chunk ``c`` with ``dS'`` the cotangent of the state leaving it, ``dh[c] = dS'^T``,
    ``dV~ = A_qk^T dO + kd dS'``, ``dS = (q e^G)^T dO + diag(dl) dS' + wn^T dV~`` (``wn = -W``).

    Args: ``aqk [B, Tp, H, 64]``, ``qg, kd, wn [B, Tp, H, 128]``, ``do [B, Tp, H, 128]``, all bf16;
    ``dl [B*H, N, 1, 128]`` f32; ``dhtt [B*H, V, K]`` f32 (final-state cotangent, transposed). ``v_split`` and
    ``interpret`` as :func:`h_sweep`.
    Returns ``(dh [B*H, N, V, K] bf16, dvt [B*H, Tp, V] bf16, dh0t [B*H, V, K] f32)``: the transposed cotangent of
    the state leaving each chunk, ``dV~`` and the transposed initial-state cotangent.
    """
    ins = {"aqk": aqk, "qg": qg, "kd": kd, "wn": wn}
    _check("ds_sweep", ins, do, dl, dhtt)
    return _sweep("kda_bwd_ds_mosaic_gpu", _ds_step, True, ins, do, dl, dhtt, v_split, interpret)
