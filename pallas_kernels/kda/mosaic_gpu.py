"""KDA chunked forward on Pallas Mosaic GPU (sm_90): one fused, warp-specialised kernel per (sequence, head).

One CTA per ``(b, h)`` walks the chunks of 64 tokens in order; nothing but the inputs, ``o`` and the states
touches HBM. Four warpgroups share two shared-memory slots (chunk ``c`` uses slot ``c % 2``):

* **memory** (WG 3): TMA loads of ``q, k, v, beta`` into the slot once both state warpgroups released it, and of
  the log-decay ``g`` into its own buffer once the intra warpgroup has read the previous chunk's.
* **intra** (WG 0), everything of chunk ``c`` that does not depend on the carried state, on wgmma:
  ``G = L g`` (the chunk-local cumulative decay as a product with the lower-triangular ones matrix; ``g`` is
  split into two bf16 terms, ``g_hi + g_lo``, so ``G`` is exact to ~2^-17 relative), then the 16-token tiles of
  ``A_kk`` and ``A_qk`` with factored decay: column tile ``b`` takes the reference point ``m_b = G`` at the
  token before the tile, rows ``k_i e^{G_i - m_b}`` (exponent ``<= 0``) meet columns ``k_j e^{m_b - G_j}``
  (exponent ``<= 80`` because ``g >= -5``) in one ``[64, 128] x [128, 16]`` product each. The row operand is
  ``k e^{G - M}`` (``M`` = the row's own tile reference) times the per-key factor ``e^{m_a - m_b} <= 1``, so
  only two ``[64, 128]`` exponentials are taken per operand. ``X = (I + diag(beta) A_kk)^-1`` by the
  Neumann product ``(I - N)(I + N^2)(I + N^4)...(I + N^32)`` (bf16 wgmma, the running product kept in fp32),
  then ``-W = -X (beta e^G k)``. Writes, in place in the slot: ``q e^G scale``, ``e^{G_C - G} k``,
  ``beta v``, ``-W``, ``X``, masked ``A_qk`` (bf16) and ``e^{G_C}`` (fp32).
* **state** (WG 1 and 2, one per half of V): the transposed fp32 state ``S^T [64, K]`` lives in registers
  for the whole sequence and every product takes it as the register operand:
  ``V~^T = (beta v)^T X^T + S^T (-W)^T``, ``O^T = S^T (q e^G)^T + V~^T A_qk^T``,
  ``S^T <- S^T diag(e^{G_C}) + V~^T (e^{G_C - G} k)``; ``O^T`` is stored transposed into shared memory and
  TMA-written to ``o``.

Contract: bf16 ``q, k, v``, fp32 log-decay ``g`` with ``-5 <= g <= 0`` (the K3 gate bound), ``K = V = 128``,
chunk 64, no packed sequences (``segment_ids``): :func:`supports_reason` says why a call does not fit.
Precision: the ``A`` products, the inverse, ``W`` and the state products take bf16 operands with fp32
accumulation (as fla's kernels); the carried state, decay factors and ``G`` are fp32.

In ``interpret`` mode (CPU, ``plgpu.InterpretGPUParams``) the register operands of wgmma are staged through
shared memory, which the Mosaic GPU interpreter needs (it reads every wgmma operand from memory).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda import reference as ref

CHUNK = 64
SUB = 16
HEAD_DIM = 128
VHALF = HEAD_DIM // 2
NEUMANN_STEPS = 5
"""``(I + N)^-1 = (I - N)(I + N^2)...(I + N^32)`` for a strictly lower ``64 x 64`` N: five multiply steps."""
REGISTERS = {"intra": 184, "state": 160}
"""Per-thread registers of each warpgroup (``setmaxnreg``); the 3 warpgroups share 512 per lane."""

_F32, _BF16 = jnp.float32, jnp.bfloat16


def _tiled(dtype=_BF16):
    """128-byte swizzled tiles: the layout wgmma and conflict-free register loads / stores need."""
    return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128))


def supports_reason(*, dtype: str, k: int, v: int, chunk_size: int, packed: bool) -> str | None:
    """None when a chunked call fits this kernel, else why not (the registry's reason)."""
    if dtype != "bfloat16":
        return f"takes bfloat16 q/k/v, got {dtype}"
    if k != HEAD_DIM or v != HEAD_DIM:
        return f"needs K = V = {HEAD_DIM}, got K={k}, V={v}"
    if chunk_size != CHUNK:
        return f"needs chunk_size {CHUNK}, got {chunk_size}"
    if packed:
        return "packed sequences (segment_ids) are not implemented"
    return None


@dataclasses.dataclass(frozen=True)
class _Refs:
    """Shared-memory buffers and barriers of one CTA; slot buffers are ``[2, ...]`` (see the module docstring).
    Buffer reuse within a chunk (intra warpgroup), in order: ``w``: ``g_hi`` -> column operand of ``A`` ->
    ``beta e^G k`` -> ``-W``; ``x``, ``aqk``: the two column halves of ``g_lo``, then ``x``: the Neumann powers
    -> ``X``, ``aqk``: masked ``A_qk``; ``g``: ``g`` -> ``G``."""

    q: object  # [2, 64, 128] bf16: q, then q e^G scale
    k: object  # [2, 64, 128] bf16: k, then e^{G_C - G} k
    v: object  # [2, 64, 128] bf16: v, then beta v
    w: object  # [2, 64, 128] bf16
    x: object  # [2, 64, 64] bf16
    aqk: object  # [2, 64, 64] bf16
    beta: object  # [2, 64] f32
    decay: object  # [2, 128] f32: e^{G_C}
    g: object  # [64, 128] f32
    ostage: object  # [2, 64, 64] bf16: o tile of each state warpgroup
    hbuf: object  # [128, 128] f32: initial / final state (V-first); aliases all of the above
    loaded: object  # barrier [2]: q, k, v, beta of the slot landed
    g_loaded: object
    ready: object  # barrier [2]: intra outputs of the slot written
    free: object  # barrier [2]: both state warpgroups done with the slot
    h_loaded: object
    h_free: object
    done: object  # both state warpgroups left the chunk loop


def _mma(acc, a, b, stage):
    """``acc += a @ b`` for a register operand ``a`` (bf16 value). In interpret mode ``a`` is staged in ``stage``
    (the interpreter reads every wgmma operand from memory)."""
    if stage is not None:
        st = stage[a.shape[1]]
        st[...] = a
        a = st
    plgpu.wgmma(acc, a, b)


def _accumulate(products, inits, interpret: bool):
    """Run ``products(*acc_refs)`` (wgmma into accumulators starting at ``inits``) and return the accumulators.
    The interpreter has no pre-initialised accumulators: there they start at zero and ``inits`` are added."""
    if not interpret:
        return pl.run_state(lambda refs: products(*refs))(tuple(plgpu.ACC.init(x) for x in inits))

    def run(*accs):
        products(*accs)
        return tuple(a[...] for a in accs)

    outs = pl.run_scoped(run, *(plgpu.ACC(x.shape, x.dtype) for x in inits))
    return tuple(x + o for x, o in zip(inits, outs, strict=True))


def _bcast_cols(vec):
    """``[n]`` per-key vector -> ``[64, n]`` (the same in every row)."""
    return lax.broadcast_in_dim(vec, (CHUNK, vec.shape[0]), [1])


def _bcast_rows(vec, n):
    """``[64]`` per-token vector -> ``[64, n]``."""
    return lax.broadcast_in_dim(vec, (CHUNK, n), [0])


def _load_slot(c, r: _Refs, io):
    """TMA of chunk ``c``'s ``q, k, v, beta`` into slot ``c % 2`` (barrier ``loaded``)."""
    q_ref, k_ref, v_ref, beta_ref, b, h = io
    slot = lax.rem(c, 2)
    rows = pl.ds(c * CHUNK, CHUNK)
    bar = r.loaded.at[slot]
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], r.q.at[slot], bar)
    plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], r.k.at[slot], bar)
    plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h], r.v.at[slot], bar)
    plgpu.copy_gmem_to_smem(beta_ref.at[b, h, rows], r.beta.at[slot], bar)


def _neumann_step(x16, p16, p_ref, stage, *, last: bool):
    """``(x P, P P)`` with ``P`` in ``p_ref`` (and as ``p16``); the last step skips the square."""

    def run(acc_x, acc_p):
        _mma(acc_x, x16, p_ref, stage)
        if not last:
            _mma(acc_p, p16, p_ref, stage)
        return acc_x[...], acc_p[...]

    return run


def _intra(c, r: _Refs, stage, scale: float, g_ref, b, h, n_chunks: int):
    """Chunk ``c``'s state-independent part (intra warpgroup); see the module docstring and :class:`_Refs`."""
    wg = plgpu.Layout.WGMMA
    row_vec = wg.reduce(1)
    slot = lax.rem(c, 2)
    w, xs, aq = r.w.at[slot], r.x.at[slot], r.aqk.at[slot]
    tile = plgpu.broadcasted_iota(jnp.int32, (CHUNK, HEAD_DIM), 0, layout=wg) // SUB
    r64 = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=wg)
    c64 = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=wg)
    ones_lower = jnp.where(c64 <= r64, 1.0, 0.0).astype(_BF16)
    half = (slice(0, VHALF), slice(VHALF, HEAD_DIM))

    plgpu.barrier_wait(r.loaded.at[slot])
    plgpu.barrier_wait(r.g_loaded)
    for i, lo_ref in enumerate((xs, aq)):
        gi = plgpu.layout_cast(r.g[:, half[i]], wg)
        hi = gi.astype(_BF16)
        w[:, half[i]] = hi
        lo_ref[...] = (gi - hi.astype(_F32)).astype(_BF16)
    plgpu.commit_smem()

    def cumsum(acc):
        for i, lo_ref in enumerate((xs, aq)):
            _mma(acc.at[:, half[i]], ones_lower, w.at[:, half[i]], stage)
            _mma(acc.at[:, half[i]], ones_lower, lo_ref, stage)
        return acc[...]

    gc = pl.run_scoped(cumsum, plgpu.ACC((CHUNK, HEAD_DIM), _F32))  # G [64, 128]
    r.g[...] = gc
    g_rows = plgpu.broadcasted_iota(jnp.int32, (CHUNK, HEAD_DIM), 0, layout=wg)
    row_of = lambda i: jnp.sum(jnp.where(g_rows == i, gc, 0.0), axis=0)  # G[i] as a [128] vector
    m = [None] + [row_of(SUB * a - 1) for a in range(1, CHUNK // SUB)]
    g_last = row_of(CHUNK - 1)
    r.decay.at[slot][...] = jnp.exp(g_last)
    m_row = jnp.zeros((CHUNK, HEAD_DIM), _F32)
    for a in range(1, CHUNK // SUB):
        m_row = jnp.where(tile == a, _bcast_cols(m[a]), m_row)
    kf = plgpu.layout_cast(r.k.at[slot][...], wg).astype(_F32)
    qf = plgpu.layout_cast(r.q.at[slot][...], wg).astype(_F32)
    w[...] = (kf * jnp.exp(m_row - gc)).astype(_BF16)  # column operand of A
    base = jnp.exp(gc - m_row)
    k_rows = (kf * base).astype(_BF16)
    q_rows = (qf * (base * scale)).astype(_BF16)
    plgpu.commit_smem()

    def tile_factor(b):
        """Rows of tile ``a``: ``e^{m_a - m_b}`` for ``a > b``, 1 for ``a = b``, 0 above (masked anyway)."""
        f = jnp.where(tile == b, 1.0, 0.0)
        for a in range(b + 1, CHUNK // SUB):
            ratio = jnp.exp(m[a]) if b == 0 else jnp.exp(m[a] - m[b])
            f = jnp.where(tile == a, _bcast_cols(ratio), f)
        return f.astype(_BF16)

    def products(rows16):
        def run(acc):
            for b in range(CHUNK // SUB):
                cols = w.at[SUB * b:SUB * (b + 1)].T
                _mma(acc.at[:, SUB * b:SUB * (b + 1)], rows16 * tile_factor(b), cols, stage)
            return acc[...]

        return pl.run_scoped(run, plgpu.ACC((CHUNK, CHUNK), _F32))

    akk = products(k_rows)
    aqk = products(q_rows)
    beta = plgpu.layout_cast(r.beta.at[slot][...], row_vec)
    n = jnp.where(r64 > c64, akk * _bcast_rows(beta, CHUNK), 0.0)
    aq[...] = jnp.where(r64 >= c64, aqk, 0.0).astype(_BF16)

    gc = plgpu.layout_cast(r.g[...], wg)
    e_g = jnp.exp(gc)
    beta_t = _bcast_rows(beta, HEAD_DIM)
    kf = plgpu.layout_cast(r.k.at[slot][...], wg).astype(_F32)
    r.k.at[slot][...] = (kf * jnp.exp(_bcast_cols(g_last) - gc)).astype(_BF16)
    w[...] = (kf * (e_g * beta_t)).astype(_BF16)
    qf = plgpu.layout_cast(r.q.at[slot][...], wg).astype(_F32)
    r.q.at[slot][...] = (qf * (e_g * scale)).astype(_BF16)
    vf = plgpu.layout_cast(r.v.at[slot][...], wg).astype(_F32)
    r.v.at[slot][...] = (vf * beta_t).astype(_BF16)

    plgpu.commit_smem()

    @pl.when(c + 1 < n_chunks)
    def _():
        plgpu.copy_gmem_to_smem(g_ref.at[b, pl.ds((c + 1) * CHUNK, CHUNK), h], r.g, r.g_loaded)

    def square(acc, a16):
        _mma(acc, a16, xs, stage)
        return acc[...]

    x = jnp.where(r64 == c64, 1.0, 0.0) - n
    xs[...] = n.astype(_BF16)
    plgpu.commit_smem()
    p = pl.run_scoped(lambda acc: square(acc, n.astype(_BF16)), plgpu.ACC((CHUNK, CHUNK), _F32))
    for step in range(NEUMANN_STEPS):
        p16 = p.astype(_BF16)
        xs[...] = p16
        plgpu.commit_smem()
        dx, p = pl.run_scoped(
            _neumann_step(x.astype(_BF16), p16, xs, stage, last=step == NEUMANN_STEPS - 1),
            plgpu.ACC((CHUNK, CHUNK), _F32), plgpu.ACC((CHUNK, CHUNK), _F32))
        x = x + dx
    x16 = x.astype(_BF16)
    xs[...] = x16

    def solve_w(acc):
        _mma(acc, x16, w, stage)
        return acc[...]

    wm = pl.run_scoped(solve_w, plgpu.ACC((CHUNK, HEAD_DIM), _F32))
    w[...] = (-wm).astype(_BF16)
    plgpu.commit_smem()
    plgpu.barrier_arrive(r.ready.at[slot])


def _state_step(c, s_t, j: int, r: _Refs, stage, o_ref, io, n_chunks: int):
    """Chunk ``c`` for V half ``j`` (state warpgroup): ``s_t`` is ``S^T [64, 128]`` f32; returns the next.
    Warpgroup ``j = 0`` also issues the TMA of chunk ``c + 2`` into the slot once both halves released it."""
    col_vec = plgpu.Layout.WGMMA.reduce(0)
    slot = lax.rem(c, 2)
    b, h = io[-2:]
    plgpu.barrier_wait(r.ready.at[slot])
    s16 = s_t.astype(_BF16)
    vj = r.v.at[slot].at[:, VHALF * j:VHALF * (j + 1)].T  # (beta v_j)^T [64, 64]

    def first(acc_v, acc_o):
        plgpu.wgmma(acc_v, vj, r.x.at[slot].T)
        _mma(acc_v, s16, r.w.at[slot].T, stage)
        _mma(acc_o, s16, r.q.at[slot].T, stage)
        return acc_v[...], acc_o[...]

    vt, o_part = pl.run_scoped(first, plgpu.ACC((VHALF, CHUNK), _F32), plgpu.ACC((VHALF, CHUNK), _F32))
    vt16 = vt.astype(_BF16)
    decay = plgpu.layout_cast(r.decay.at[slot][...], col_vec)

    def second(acc_o, acc_s):
        _mma(acc_o, vt16, r.aqk.at[slot].T, stage)
        _mma(acc_s, vt16, r.k.at[slot], stage)

    o_t, s_t = _accumulate(second, (o_part, s_t * _bcast_cols(decay)), stage is not None)
    plgpu.barrier_arrive(r.free.at[slot])
    if j == 0:  # waits on every phase (the interpreter checks that no phase goes unobserved)
        plgpu.barrier_wait(r.free.at[slot])

        @pl.when(c + 2 < n_chunks)
        def _():
            _load_slot(c + 2, r, io)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    r.ostage.at[j].T[...] = o_t.astype(_BF16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(r.ostage.at[j], o_ref.at[b, pl.ds(c * CHUNK, CHUNK), h, pl.ds(VHALF * j, VHALF)])
    return s_t


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, h0_ref, o_ref, ht_ref, smem, bars, stages, *, scale: float,
            n_chunks: int, interpret: bool):
    main, edge = smem
    q, k, v, w, x, aqk, beta, decay, g, ostage = main
    (hbuf,) = edge
    r = _Refs(q=q, k=k, v=v, w=w, x=x, aqk=aqk, beta=beta, decay=decay, g=g, ostage=ostage, hbuf=hbuf, **bars)
    h = lax.axis_index("h")
    b = lax.axis_index("b")
    wg = lax.axis_index("wg")
    io = (q_ref, k_ref, v_ref, beta_ref, b, h)

    def stage_of(i):
        return None if not interpret else {CHUNK: stages[0].at[i], HEAD_DIM: stages[1].at[i]}

    @pl.when(wg == 0)
    def _intra_wg():
        if not interpret:
            plgpu.set_max_registers(REGISTERS["intra"], action="increase")
        plgpu.copy_gmem_to_smem(h0_ref.at[b, h], r.hbuf, r.h_loaded)
        plgpu.barrier_wait(r.h_free)
        plgpu.copy_gmem_to_smem(g_ref.at[b, pl.ds(0, CHUNK), h], r.g, r.g_loaded)
        for c in range(min(2, n_chunks)):
            _load_slot(c, r, io)

        @pl.loop(0, n_chunks)
        def _(c):
            _intra(c, r, stage_of(0), scale, g_ref, b, h, n_chunks)

    for j in range(2):

        @pl.when(wg == 1 + j)
        def _state_wg(j=j):
            if not interpret:
                plgpu.set_max_registers(REGISTERS["state"], action="decrease")
            plgpu.barrier_wait(r.h_loaded)
            s_t = plgpu.layout_cast(r.hbuf[VHALF * j:VHALF * (j + 1), :], plgpu.Layout.WGMMA)
            plgpu.barrier_arrive(r.h_free)
            s_t = lax.fori_loop(
                0, n_chunks, lambda c, s: _state_step(c, s, j, r, stage_of(1 + j), o_ref, io, n_chunks), s_t)
            plgpu.wait_smem_to_gmem(0)
            plgpu.barrier_arrive(r.done)
            plgpu.barrier_wait(r.done)
            r.hbuf[VHALF * j:VHALF * (j + 1), :] = s_t
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(r.hbuf.at[VHALF * j:VHALF * (j + 1)], ht_ref.at[b, h, pl.ds(VHALF * j, VHALF)])
            plgpu.wait_smem_to_gmem(0)


def _fused_forward(q, k, v, g, beta_t, h0_t, *, scale: float, interpret):
    B, Tp, H, K = q.shape
    n_chunks = Tp // CHUNK
    smem = plgpu.RefUnion(
        (  # the chunk loop
            plgpu.SMEM((2, CHUNK, K), _BF16, transforms=_tiled()),  # q
            plgpu.SMEM((2, CHUNK, K), _BF16, transforms=_tiled()),  # k
            plgpu.SMEM((2, CHUNK, K), _BF16, transforms=_tiled()),  # v
            plgpu.SMEM((2, CHUNK, K), _BF16, transforms=_tiled()),  # w
            plgpu.SMEM((2, CHUNK, CHUNK), _BF16, transforms=_tiled()),  # x
            plgpu.SMEM((2, CHUNK, CHUNK), _BF16, transforms=_tiled()),  # aqk
            plgpu.SMEM((2, CHUNK), _F32),  # beta
            plgpu.SMEM((2, K), _F32),  # decay
            plgpu.SMEM((CHUNK, K), _F32, transforms=_tiled(_F32)),  # g
            plgpu.SMEM((2, CHUNK, VHALF), _BF16, transforms=_tiled()),  # o tiles
        ),
        (plgpu.SMEM((K, K), _F32, transforms=_tiled(_F32)),),  # initial / final state, V-first
    )
    bars = dict(
        loaded=plgpu.Barrier(num_arrivals=4, num_barriers=2),
        g_loaded=plgpu.Barrier(num_arrivals=1),
        ready=plgpu.Barrier(num_arrivals=1, num_barriers=2),
        free=plgpu.Barrier(num_arrivals=2, num_barriers=2),
        h_loaded=plgpu.Barrier(num_arrivals=1),
        h_free=plgpu.Barrier(num_arrivals=2),
        done=plgpu.Barrier(num_arrivals=2),
    )
    stages = ()
    if interpret:
        stages = (plgpu.SMEM((3, CHUNK, CHUNK), _BF16, transforms=_tiled()),
                  plgpu.SMEM((3, CHUNK, K), _BF16, transforms=_tiled()))

    def kda_chunk_fwd_mosaic_gpu(*refs):
        *io, smem_ref, bar_refs, stage_refs = refs
        _kernel(*io, smem_ref, bar_refs, stage_refs, scale=scale, n_chunks=n_chunks, interpret=bool(interpret))

    return plgpu.kernel(
        kda_chunk_fwd_mosaic_gpu,
        out_type=(jax.ShapeDtypeStruct((B, Tp, H, K), _BF16), jax.ShapeDtypeStruct((B, H, K, K), _F32)),
        scratch_types=(smem, bars, stages),
        grid=(H, B),
        grid_names=("h", "b"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret if interpret else None,
    )(q, k, v, g, beta_t, h0_t)


def chunk_kda_fwd(q, k, v, g, beta, scale: float, initial_state=None, segment_ids=None, chunk_size: int = CHUNK,
                  interpret=False):
    """Chunked KDA forward (module docstring). ``q, k, g [B, T, H, 128]``, ``v [B, T, H, 128]``, ``beta [B, T, H]``,
    ``initial_state [B, H, 128, 128] f32`` or None. Returns ``(o [B, T, H, 128] bf16, final_state f32)``.
    ``interpret``: False, True or a ``plgpu.InterpretGPUParams`` (CPU interpreter)."""
    ref._check_inputs(q, k, v, g, beta, initial_state, segment_ids, "mosaic_gpu.chunk_kda_fwd")
    B, T, H, K = q.shape
    reason = supports_reason(dtype=jnp.promote_types(q.dtype, v.dtype).name, k=K, v=v.shape[-1],
                             chunk_size=chunk_size, packed=segment_ids is not None)
    if reason is not None:
        raise ValueError(f"mosaic_gpu.chunk_kda_fwd: {reason}")
    pad = (-T) % CHUNK
    padt = lambda x: x if pad == 0 else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v = (padt(x.astype(_BF16)) for x in (q, k, v))
    g = padt(g.astype(_F32))
    beta_t = jnp.swapaxes(padt(beta.astype(_F32)), 1, 2)  # [B, H, Tp]
    if initial_state is None:
        h0_t = jnp.zeros((B, H, K, K), _F32)
    else:
        h0_t = jnp.swapaxes(initial_state.astype(_F32), -1, -2)
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    o, ht_t = _fused_forward(q, k, v, g, beta_t, h0_t, scale=float(scale), interpret=interpret)
    return o[:, :T], jnp.swapaxes(ht_t, -1, -2)
