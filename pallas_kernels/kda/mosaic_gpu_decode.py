"""KDA decode (one token per sequence) on Pallas Mosaic GPU (sm_90), in place on a state pool.

The step's work is ``B * H * (V / block_v)`` tiles, one per ``(sequence, head, V slice)``; each is the ``[K,
block_v]`` fp32 slice of one state and the sequence's token vectors. A fixed number of CTAs (one warpgroup each,
``num_ctas``, by default two per SM) share them round robin: CTA ``c`` takes tiles ``c, c + num_ctas, ...``. Each
CTA streams its tiles through a ring of ``stages`` shared-memory buffers, TMA-loading tile ``i + lookahead`` while
it computes tile ``i`` (so the state reads stay in flight between tiles) and TMA-writing each tile's new state and
``o`` back as it finishes; a buffer is reloaded only once the copy out of it has read it. Per tile, in fp32
registers, the step of :func:`pallas_kernels.kda.reference.recurrent_kda`:

``S <- diag(exp g) S``, ``S <- S + (beta k) (v - S^T k)^T``, ``o = S^T (scale q)``.

The pool enters the kernel as a mutable ref (``jax.new_ref``), so the custom call aliases it (in place when the
caller donates it). Every copy between device and shared memory has at most one integer index: the pool as a ``[P
* H * K, V]`` view, the token vectors as ``[B * H, D]`` views, the pool row of each tile from a ``[num_ctas,
tiles per CTA]`` i32 table built by XLA beside the kernel (copied into each CTA at its start, in pieces within a
TMA box), as is the fp32 ``[B * H * 4, K]`` pack of the per-token vectors (``scale q``, ``k``, ``exp g``,
``beta k``).

Contract: bf16 or fp32 ``q, k, v``, ``K = V = 128``, distinct slots. Any ``g <= 0`` (no gate bound needed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu_common import F32, HEAD_DIM, copy_row_to_smem, interpret_params, row_pieces, tiled

BLOCK_V = 64
"""Columns of V per tile (its state slice is ``[K, BLOCK_V]`` fp32 in shared memory and registers)."""
STAGES = 3
"""Shared-memory buffers per CTA (tiles in its ring): 3 x ~34.5 KB at ``BLOCK_V``, two CTAs per SM."""
LOOKAHEAD = 1
"""Tiles a CTA loads ahead of the one it computes (< ``stages``: the buffer it loads into was last used
``stages - lookahead`` tiles earlier, whose copy out must have read it)."""
CTAS_PER_SM = 2
ROW_PAD = 32
"""Table rows are padded to a multiple of this many i32 (copies move multiples of 128 bytes)."""


def supports_reason(*, dtype: str, k: int, v: int) -> str | None:
    """None when a decode call fits this kernel, else why not (the registry's reason)."""
    if dtype not in ("bfloat16", "float32"):
        return f"takes bfloat16 or float32 inputs, got {dtype}"
    if k != HEAD_DIM or v != HEAD_DIM:
        return f"needs K = V = {HEAD_DIM}, got K={k}, V={v}"
    return None


def _decode_kernel(rows_ref, vecs_ref, v_ref, pool_ref, o_ref, rows_s, vec_s, v_s, s_s, o_s, bar_rows, bar_in, *,
                   block_v: int, n_v: int, n_tiles: int, n_ctas: int, per_cta: int, stages: int, lookahead: int,
                   row_copies: tuple[tuple[int, int], ...]):
    c = lax.axis_index("c")
    copy_row_to_smem(rows_ref, c, rows_s, bar_rows, row_copies)
    plgpu.barrier_wait(bar_rows)
    n_mine = (n_tiles - c + n_ctas - 1) // n_ctas

    def where(i):  # this CTA's tile i: (pool rows, its V columns, sequence * H + head)
        t = c + i * n_ctas
        return pl.ds(rows_s[i], HEAD_DIM), pl.ds((t % n_v) * block_v, block_v), t // n_v

    def load(i, st: int):
        @pl.when(i < n_mine)
        def _():
            rows, cols, bh = where(i)
            plgpu.copy_gmem_to_smem(pool_ref.at[rows, cols], s_s.at[st], bar_in.at[st])
            plgpu.copy_gmem_to_smem(vecs_ref.at[pl.ds(bh * 4, 4)], vec_s.at[st], bar_in.at[st])
            plgpu.copy_gmem_to_smem(v_ref.at[bh, cols], v_s.at[st], bar_in.at[st])

    def step(i, st: int):
        @pl.when(i < n_mine)
        def _():
            rows, cols, bh = where(i)
            plgpu.barrier_wait(bar_in.at[st])
            per_row = lambda r: lax.broadcast_in_dim(  # [K] -> [K, block_v]
                plgpu.load(vec_s.at[st, r], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False),
                (HEAD_DIM, block_v), [0])
            per_col = lambda x: lax.broadcast_in_dim(x, (HEAD_DIM, block_v), [1])  # [block_v] -> [K, block_v]
            v = plgpu.load(v_s.at[st], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False).astype(F32)
            s = plgpu.layout_cast(s_s[st], plgpu.Layout.WGMMA) * per_row(2)
            pred = jnp.sum(per_row(1) * s, axis=0)
            s = s + per_row(3) * per_col(v - pred)
            o = jnp.sum(per_row(0) * s, axis=0)
            s_s[st] = s
            o_s[st] = o.astype(o_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(s_s.at[st], pool_ref.at[rows, cols], commit_group=False)
            plgpu.copy_smem_to_gmem(o_s.at[st], o_ref.at[bh, cols])  # one group per tile, both copies

    for i in range(lookahead):
        load(i, i % stages)

    def ring(it, carry):  # `stages` tiles per iteration: every buffer index static
        for u in range(stages):
            i = it * stages + u
            # the buffer of tile i + lookahead last held tile i + lookahead - stages; the tiles after it committed
            # one group each (all of them below n_mine whenever that load is issued)
            plgpu.wait_smem_to_gmem(stages - lookahead - 1, wait_read_only=True)
            load(i + lookahead, (u + lookahead) % stages)
            step(i, u)
        return carry

    lax.fori_loop(0, pl.cdiv(per_cta, stages), ring, None)
    plgpu.wait_smem_to_gmem(0)


def default_num_ctas(interpret=False) -> int:
    """:data:`CTAS_PER_SM` per SM of the first device; 4 in the interpreter; where the SM count is unknown, as many
    as there are tiles (one tile per CTA: no ring, but every tile in flight at once)."""
    if interpret:
        return 4
    sms = getattr(jax.devices()[0], "core_count", None)
    return CTAS_PER_SM * sms if sms else 1 << 30


def decode_step(q, k, v, g, beta, scale: float, state_pool, state_slots, block_v: int = BLOCK_V, interpret=False,
                *, stages: int = STAGES, lookahead: int = LOOKAHEAD, num_ctas: int | None = None):
    """One recurrent KDA step in place on a state pool (the contract of :func:`pallas_kernels.kda.gpu.decode_step`).

    ``q, k, g [B, H, K]``, ``v [B, H, V]``, ``beta [B, H]``, ``state_pool [P, H, K, V] f32``, ``state_slots [B]
    i32`` (distinct). Returns ``(o [B, H, V] in v.dtype, new_pool)``; the pool buffer is aliased (donate it).
    ``block_v`` in (64, 128); ``stages`` >= 2 shared-memory buffers per CTA, ``lookahead`` in ``[1, stages)``
    tiles loaded ahead, ``num_ctas`` CTAs (default :func:`default_num_ctas`); ``interpret``: False, True or a
    ``plgpu.InterpretGPUParams`` (CPU interpreter).
    """
    B, H, K = q.shape
    V = v.shape[-1]
    reason = supports_reason(dtype=jnp.promote_types(q.dtype, v.dtype).name, k=K, v=V)
    if reason is not None:
        raise ValueError(f"mosaic_gpu_decode.decode_step: {reason}")
    if block_v not in (64, 128):
        raise ValueError(f"mosaic_gpu_decode.decode_step: block_v must be 64 or 128, got {block_v}")
    if not 1 <= lookahead < stages:
        raise ValueError(f"mosaic_gpu_decode.decode_step: need 1 <= lookahead < stages, got lookahead={lookahead}, "
                         f"stages={stages}")
    if state_pool.ndim != 4 or state_pool.shape[1:] != (H, K, V) or state_pool.dtype != F32:
        raise ValueError(f"mosaic_gpu_decode.decode_step: state_pool must be [P, {H}, {K}, {V}] float32, got "
                         f"{state_pool.shape} {state_pool.dtype}")
    P = state_pool.shape[0]
    n_v = V // block_v
    n_tiles = B * H * n_v
    n_ctas = min(num_ctas or default_num_ctas(interpret), n_tiles)
    per_cta = -(-n_tiles // n_ctas)
    f = lambda x: x.astype(F32)
    kf = f(k)
    vecs = jnp.stack([f(q) * scale, kf, jnp.exp(f(g)), f(beta)[..., None] * kf], axis=2).reshape(B * H * 4, K)
    bh_rows = ((state_slots.astype(jnp.int32)[:, None] * H + jnp.arange(H, dtype=jnp.int32)) * K).reshape(B * H)
    padded = -(-per_cta // ROW_PAD) * ROW_PAD
    tiles = jnp.arange(n_ctas, dtype=jnp.int32)[:, None] + jnp.arange(padded, dtype=jnp.int32)[None, :] * n_ctas
    rows = bh_rows[jnp.minimum(tiles, n_tiles - 1) // n_v]  # [n_ctas, padded]; entries past n_tiles unused
    vb = v.reshape(B * H, V)
    row_copies = row_pieces(padded)
    scratch = [
        plgpu.SMEM((padded,), jnp.int32),
        plgpu.SMEM((stages, 4, K), F32),
        plgpu.SMEM((stages, block_v), vb.dtype),
        plgpu.SMEM((stages, K, block_v), F32, transforms=tiled(F32)),
        plgpu.SMEM((stages, block_v), vb.dtype),
        plgpu.Barrier(num_arrivals=len(row_copies)),
        plgpu.Barrier(num_arrivals=3, num_barriers=stages),
    ]
    pool = jax.new_ref(state_pool.reshape(P * H * K, V))
    o = plgpu.kernel(
        lambda *refs: _decode_kernel(*refs, block_v=block_v, n_v=n_v, n_tiles=n_tiles, n_ctas=n_ctas,
                                     per_cta=per_cta, stages=stages, lookahead=lookahead, row_copies=row_copies),
        out_type=jax.ShapeDtypeStruct((B * H, V), vb.dtype),
        scratch_types=scratch,
        grid=(n_ctas,),
        grid_names=("c",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret_params(interpret),
    )(rows, vecs, vb, pool)
    pool = jax.freeze(pool)
    return o.reshape(B, H, V), pool.reshape(P, H, K, V)
