"""KDA chunk backward, the two sequential passes on Mosaic GPU (sm_90), from the per-chunk tensors of
:mod:`.mosaic_gpu_intra`:

* :func:`state_sweep` (forward, chunks ``0 .. n - 1``): the state ``S`` carried as in :mod:`.mosaic_gpu_state`,
  writing the state entering each chunk ``h_c`` (bf16) and ``V~ = X' v + (-W) S`` instead of ``o``.
* :func:`state_grad_pass` (reverse, chunks ``n - 1 .. 0``): the cotangent ``dS`` of the state leaving each chunk,
  writing it (``dh_c``, bf16) and ``dV~ = A_qk^T dO + kd dS``, ending with the initial state's cotangent.

Forward per chunk: ``V~ = X' v + (-W) S``, ``O = qg S + A_qk V~``, ``S' = diag(e^{G_C}) S + kd^T V~``; so
``dS <- diag(e^{G_C}) dS + qg^T dO + (-W)^T dV~`` (the reverse pass needs neither ``S`` nor ``V~``).

Both are one kernel shape (:class:`_Sweep`): one CTA per ``(V-part, sequence * H + head)``, ``v_split`` V-parts of
``128 / v_split`` columns, one state warpgroup per 64 columns holding its transposed fp32 ``S^T [64, K]`` in
registers, plus one memory warpgroup TMA-loading the chunk inputs into slot ``step % 2``. Per chunk, transposed,
every product on wgmma (bf16 operands, fp32 accumulation; ``P_j`` = the warpgroup's 64 columns of ``v`` / ``dO``):

``out^T = P_j^T M1 + S^T M2``, ``S^T <- S^T diag(e^{G_C}) + P_j^T M3 + out^T M4``

forward ``(M1, M2, M3, M4) = (X'^T, (-W)^T, -, kd)``, reverse ``(A_qk, kd^T, qg, -W)``. Every copy between device
and shared memory has at most one integer index: the token tensors as ``[B * Tp, H, D]`` views, ``decay`` as
``[B * H * n_chunks, 128]``, the per-chunk states as ``[B * H * n_chunks * V, K]``, the end states as
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
class _Sweep:
    """One sweep's per-chunk products (module docstring): ``out^T = P_j^T M1 + S^T M2``, ``S^T <- S^T diag(decay) +
    P_j^T M3 + out^T M4`` with ``P_j`` this state warpgroup's 64 columns of the token input ``part``; an ``M`` is
    ``(name of a [64, D] chunk input, transposed)``, ``M3`` may be None."""

    name: str
    reverse: bool
    inputs: tuple[tuple[str, int], ...]  # (name, width) of the chunk inputs loaded whole
    part: str
    m1: tuple[str, bool]
    m2: tuple[str, bool]
    m3: tuple[str, bool] | None
    m4: tuple[str, bool]


FORWARD = _Sweep("kda_chunk_states_mosaic_gpu", reverse=False, inputs=(("kd", 128), ("wn", 128), ("x", 64)),
                 part="v", m1=("x", True), m2=("wn", True), m3=None, m4=("kd", False))
REVERSE = _Sweep("kda_chunk_state_bwd_mosaic_gpu", reverse=True,
                 inputs=(("qg", 128), ("kd", 128), ("wn", 128), ("aqk", 64)),
                 part="do", m1=("aqk", False), m2=("kd", True), m3=("qg", False), m4=("wn", False))


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where one CTA's ``(sequence, head, V-part)`` lives in the flattened views."""

    bh: object  # sequence * H + head
    h: object
    row0: object  # the sequence's first row of the token views
    v0: object  # first V column of this CTA's part
    n_chunks: int
    reverse: bool

    def chunk(self, i):
        """The chunk of step ``i``."""
        return self.n_chunks - 1 - i if self.reverse else i

    def rows(self, c):
        return pl.ds(self.row0 + c * CHUNK, CHUNK)

    def state_rows(self, c, j: int):
        """Rows of state warpgroup ``j``'s chunk-``c`` state in the ``[B * H * n_chunks * V, K]`` view."""
        return pl.ds((self.bh * self.n_chunks + c) * HEAD_DIM + self.v0 + VTILE * j, VTILE)


@dataclasses.dataclass(frozen=True)
class _Bars:
    loaded: object  # [S]: a slot's tensors landed
    free: object  # [S]: every state warpgroup done with the slot
    h_loaded: object  # the starting state landed
    h_free: object  # every state warpgroup read it (the slots may be filled)
    done: object  # every state warpgroup left the chunk loop (the end state may overwrite the slots)


def _load_chunk(i, sw: _Sweep, bufs: dict, bars: _Bars, ins: dict, at: _Where, vc: int):
    c = at.chunk(i)
    slot = lax.rem(i, SLOTS)
    rows = at.rows(c)
    bar = bars.loaded.at[slot]
    for name, _ in sw.inputs:
        plgpu.copy_gmem_to_smem(ins[name].at[rows, at.h], bufs[name].at[slot], bar)
    plgpu.copy_gmem_to_smem(ins[sw.part].at[rows, at.h, pl.ds(at.v0, vc)], bufs[sw.part].at[slot], bar)
    plgpu.copy_gmem_to_smem(ins["decay"].at[at.bh * at.n_chunks + c], bufs["decay"].at[slot], bar)


def _operand(bufs: dict, slot, m: tuple[str, bool]):
    ref = bufs[m[0]].at[slot]
    return ref.T if m[1] else ref


def _step(i, s_t, j: int, sw: _Sweep, bufs: dict, bars: _Bars, stage, outs, at: _Where):
    """Step ``i`` for the state warpgroup ``j`` (``s_t`` = its ``S^T [64, 128]`` f32): writes ``S^T`` (bf16) as the
    chunk's state and ``out`` (``[64, 64]`` of the token output), returns the next ``S^T``."""
    tok_ref, states_ref = outs
    c = at.chunk(i)
    slot = lax.rem(i, SLOTS)
    s16 = s_t.astype(BF16)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous step's stores have read the stages
    bufs["sstage"].at[j][...] = s16
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(bufs["sstage"].at[j], states_ref.at[at.state_rows(c, j)])
    plgpu.barrier_wait(bars.loaded.at[slot])
    p_t = bufs[sw.part].at[slot].at[:, VTILE * j:VTILE * (j + 1)].T  # P_j^T [64, 64]

    def first(acc):
        plgpu.wgmma(acc, p_t, _operand(bufs, slot, sw.m1))
        mma(acc, s16, _operand(bufs, slot, sw.m2), stage)
        return acc[...]

    out16 = pl.run_scoped(first, plgpu.ACC((VTILE, CHUNK), F32)).astype(BF16)
    decay = plgpu.layout_cast(bufs["decay"].at[slot][...], plgpu.Layout.WGMMA.reduce(0))

    def second(acc_s):
        if sw.m3 is not None:
            plgpu.wgmma(acc_s, p_t, _operand(bufs, slot, sw.m3))
        mma(acc_s, out16, _operand(bufs, slot, sw.m4), stage)

    (s_t,) = accumulate(second, (s_t * bcast_cols(decay, VTILE),), stage is not None)
    plgpu.barrier_arrive(bars.free.at[slot])
    bufs["ostage"].at[j].T[...] = out16
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(bufs["ostage"].at[j], tok_ref.at[at.rows(c), at.h, pl.ds(at.v0 + VTILE * j, VTILE)])
    return s_t


def _sweep(sw: _Sweep, ins: dict, s0_t, *, v_split: int, interpret):
    """Run ``sw`` over ``ins`` (token inputs ``[B, Tp, H, D]`` bf16 by name, ``decay [B, H, n, 128]`` f32) from
    the transposed starting state ``s0_t [B, H, V, K]`` f32. Returns ``(out [B, Tp, H, 128] bf16, states [B, H,
    n, V, K] bf16 (each chunk's ``S^T`` before its step), end state [B, H, V, K] f32)``."""
    B, Tp, H, K = ins[sw.part].shape
    if v_split not in (1, 2):
        raise ValueError(f"mosaic_gpu_bwd_state: v_split must be 1 or 2, got {v_split}")
    n_chunks = Tp // CHUNK
    n_state = HEAD_DIM // VTILE // v_split
    vc = VTILE * n_state
    chunk_buf = lambda d, dt=BF16: plgpu.SMEM((SLOTS, CHUNK, d), dt, transforms=tiled(dt))
    names = (*(n for n, _ in sw.inputs), sw.part, "decay", "ostage", "sstage")
    bufs = (*(chunk_buf(w) for _, w in sw.inputs), chunk_buf(vc), plgpu.SMEM((SLOTS, K), F32),
            plgpu.SMEM((n_state, CHUNK, VTILE), BF16, transforms=tiled()),
            plgpu.SMEM((n_state, VTILE, K), BF16, transforms=tiled()))
    smem = plgpu.RefUnion(bufs, (plgpu.SMEM((vc, K), F32, transforms=tiled(F32)),))
    bars = _Bars(loaded=plgpu.Barrier(num_arrivals=len(sw.inputs) + 2, num_barriers=SLOTS),
                 free=plgpu.Barrier(num_arrivals=n_state, num_barriers=SLOTS),
                 h_loaded=plgpu.Barrier(num_arrivals=1), h_free=plgpu.Barrier(num_arrivals=n_state),
                 done=plgpu.Barrier(num_arrivals=n_state))
    stages = ()
    if interpret is not None:
        stages = (plgpu.SMEM((n_state, CHUNK, CHUNK), BF16, transforms=tiled()),
                  plgpu.SMEM((n_state, CHUNK, K), BF16, transforms=tiled()))
    in_names = (*(n for n, _ in sw.inputs), sw.part, "decay")

    def kernel(*refs):
        in_refs = dict(zip(in_names, refs[:len(in_names)], strict=True))
        s0_ref, tok_ref, states_ref, end_ref, smem_refs, bar_refs, stage_refs = refs[len(in_names):]
        main, (hbuf,) = smem_refs
        b, bs = dict(zip(names, main, strict=True)), _Bars(*bar_refs)
        part, bh, wg = (lax.axis_index(n) for n in ("s", "bh", "wg"))
        at = _Where(bh=bh, h=lax.rem(bh, H), row0=lax.div(bh, H) * Tp, v0=part * vc, n_chunks=n_chunks,
                    reverse=sw.reverse)
        end_rows = lambda j0, n: pl.ds(bh * HEAD_DIM + at.v0 + j0, n)  # rows of the [B * H * V, K] views

        @pl.when(wg == n_state)
        def _memory_wg():
            if interpret is None and n_state == 2:
                plgpu.set_max_registers(REGISTERS["memory"], action="decrease")
            plgpu.copy_gmem_to_smem(s0_ref.at[end_rows(0, vc)], hbuf, bs.h_loaded)
            plgpu.barrier_wait(bs.h_free)

            @pl.loop(0, n_chunks)
            def _(i):
                @pl.when(i >= SLOTS)
                def _():
                    plgpu.barrier_wait(bs.free.at[lax.rem(i, SLOTS)])

                _load_chunk(i, sw, b, bs, in_refs, at, vc)

            for i in range(max(n_chunks - SLOTS, 0), n_chunks):  # observe every phase of `free`
                plgpu.barrier_wait(bs.free.at[i % SLOTS])

        for j in range(n_state):

            @pl.when(wg == j)
            def _state_wg(j=j):
                if interpret is None and n_state == 2:
                    plgpu.set_max_registers(REGISTERS["state"], action="increase")
                stage = None if interpret is None else {CHUNK: stage_refs[0].at[j], HEAD_DIM: stage_refs[1].at[j]}
                plgpu.barrier_wait(bs.h_loaded)
                s_t = plgpu.layout_cast(hbuf[VTILE * j:VTILE * (j + 1), :], plgpu.Layout.WGMMA)
                plgpu.barrier_arrive(bs.h_free)
                s_t = lax.fori_loop(
                    0, n_chunks, lambda i, st: _step(i, st, j, sw, b, bs, stage, (tok_ref, states_ref), at), s_t)
                plgpu.wait_smem_to_gmem(0)
                plgpu.barrier_arrive(bs.done)
                plgpu.barrier_wait(bs.done)
                hbuf[VTILE * j:VTILE * (j + 1), :] = s_t
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(hbuf.at[VTILE * j:VTILE * (j + 1)], end_ref.at[end_rows(VTILE * j, VTILE)])
                plgpu.wait_smem_to_gmem(0)

    kernel.__name__ = sw.name
    rows_view = lambda x: x.reshape(B * Tp, H, x.shape[-1])
    tok, states, end = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((B * Tp, H, HEAD_DIM), BF16),
                  jax.ShapeDtypeStruct((B * H * n_chunks * HEAD_DIM, K), BF16),
                  jax.ShapeDtypeStruct((B * H * HEAD_DIM, K), F32)),
        scratch_types=(smem, tuple(getattr(bars, f.name) for f in dataclasses.fields(bars)), stages),
        grid=(v_split, B * H),
        grid_names=("s", "bh"),
        num_threads=n_state + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret,
    )(*(rows_view(ins[n]) for n in in_names[:-1]), ins["decay"].reshape(B * H * n_chunks, K),
      s0_t.reshape(B * H * HEAD_DIM, K))
    return (tok.reshape(B, Tp, H, HEAD_DIM), states.reshape(B, H, n_chunks, HEAD_DIM, K),
            end.reshape(B, H, HEAD_DIM, K))


def state_sweep(kd, wn, x, v, decay, h0_t, *, v_split: int, interpret=None):
    """The forward sweep that keeps what the backward needs. ``kd, wn [B, Tp, H, 128]``, ``x [B, Tp, H, 64]``
    bf16, ``decay [B, H, Tp / 64, 128]`` f32 (as :func:`.mosaic_gpu_intra.intra_chunks` returns them), ``v [B, Tp,
    H, 128]`` bf16, ``h0_t [B, H, V, K]`` f32 (the transposed initial state); ``v_split`` in (1, 2). Returns
    ``(vt [B, Tp, H, 128] bf16 = V~, h_t [B, H, n_chunks, V, K] bf16 = the transposed state entering each chunk,
    ht_t [B, H, V, K] f32)``. ``interpret``: None or a ``plgpu.InterpretGPUParams``."""
    return _sweep(FORWARD, dict(kd=kd, wn=wn, x=x, v=v, decay=decay), h0_t, v_split=v_split, interpret=interpret)


def state_grad_pass(qg, kd, wn, aqk, decay, do, dht_t, *, v_split: int, interpret=None):
    """The reverse pass (module docstring). ``qg, kd, wn [B, Tp, H, 128]`` bf16, ``aqk [B, Tp, H, 64]`` bf16,
    ``decay [B, H, Tp / 64, 128]`` f32 (as :func:`.mosaic_gpu_intra.intra_chunks` returns them), ``do [B, Tp, H,
    128]`` bf16, ``dht_t [B, H, V, K]`` f32 (the transposed final-state cotangent); ``v_split`` in (1, 2).
    Returns ``(dvt [B, Tp, H, 128] bf16 = dV~, dh_t [B, H, n_chunks, V, K] bf16 = the transposed cotangent of the
    state leaving each chunk, dh0_t [B, H, V, K] f32)``. ``interpret``: None or a ``plgpu.InterpretGPUParams``."""
    return _sweep(REVERSE, dict(qg=qg, kd=kd, wn=wn, aqk=aqk, do=do, decay=decay), dht_t, v_split=v_split,
                  interpret=interpret)


def state_sweep_reference(kd, wn, x, v, decay, h0_t):
    """Plain-JAX fp32 (``precision=HIGHEST``) reference of :func:`state_sweep` (same outputs, dtypes, layouts)."""
    B, Tp, H, K = kd.shape
    n = Tp // CHUNK
    hp = lax.Precision.HIGHEST
    split = lambda t: jnp.moveaxis(t.astype(F32).reshape(B, n, CHUNK, H, -1), (1, 3), (0, 2))  # [n, B, H, C, D]
    xs = (split(kd), split(wn), split(x), split(v), jnp.moveaxis(decay, 2, 0))

    def step(s_t, xs):
        kd_c, wn_c, x_c, v_c, dec = xs
        vt = (jnp.einsum("bhiv,bhji->bhvj", v_c, x_c, precision=hp)
              + jnp.einsum("bhvk,bhik->bhvi", s_t, wn_c, precision=hp))
        new = s_t * dec[:, :, None, :] + jnp.einsum("bhvi,bhik->bhvk", vt, kd_c, precision=hp)
        return new, (jnp.swapaxes(vt, -1, -2), s_t)

    ht_t, (vt, h_t) = lax.scan(step, h0_t.astype(F32), xs)
    vt = jnp.moveaxis(vt, (0, 2), (1, 3)).reshape(B, Tp, H, HEAD_DIM)
    return vt.astype(BF16), jnp.moveaxis(h_t, 0, 2).astype(BF16), ht_t


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
