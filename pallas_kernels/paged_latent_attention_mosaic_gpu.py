"""MLA decode attention over a paged latent cache on Pallas Mosaic GPU (sm_90): the ``mosaic_gpu`` backend of
:data:`pallas_kernels.paged_latent_attention.PAGED_DECODE` (its module docstring has the math and the page layout).

Split-K flash decoding with wgmma. One CTA per ``(block of 64 query rows, split, row)``; the query rows are the
``T·H`` (query, head) pairs, padded to a multiple of 64. Each row's visited positions
(:func:`pallas_kernels.paged_latent_attention.visited_pages`) are cut into ``splits`` equal runs of
:data:`STEP`-position steps. Three warpgroups: a memory warpgroup TMA-loads the block's queries ``[64, C + Dr]``
once and, per step, the step's pages (read in place through the page table: ``STEP / S`` copies of ``[S, C + Dr]``)
into one of two slots; two compute warpgroups each compute the step's scores ``s = q · k^T`` (``[64, STEP]``,
the same in both), mask them (positions past a query, past the row's last query, on unmapped pages), run the
online softmax, stage the probabilities (bf16) in shared memory and accumulate their half of ``o = p · ĉ``
(``[64, C / 2]`` fp32 in registers), then release the slot. Each CTA writes its partial (max, denominator, fp32
output); XLA merges the splits by log-sum-exp, as for the Triton kernel.

The page table enters as one i32 row per ``(row, split)`` built by XLA: the row's first query position, the split's
first step and step count, then per page of the split ``2 · page + ok``, where ``ok`` says the page is mapped and
visited and ``page`` is a page to read (an unmapped entry reads the row's first mapped page instead, so the null
page's garbage never enters shared memory; its positions are masked). Every copy between device and shared memory
has at most one integer index (the pool as ``[(R ·) P · S, C + Dr]`` rows, the queries as ``[B · T·H, C + Dr]``).

Contract: bf16 queries and pages, ``C`` a multiple of 128 up to 512 (two warpgroups of ``C / 2 <= 256`` output
columns), ``C + Dr`` a multiple of 64, page size dividing :data:`STEP`, one device. Forward only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mosaic_gpu_common import BF16, F32, accumulate, copy_row_to_smem, row_pieces, tiled

ROWS = 64
"""Query rows per CTA (the wgmma M)."""
STEP = 32
"""Cached positions per step (the scores' width; two pages of 16)."""
SLOTS = 2
HEADER = 32
"""i32 header of each table row: first query position, first step, step count, then padding."""
CTAS_TARGET = 132
"""At least about this many CTAs run when the table allows (one wave on the H200's 132 SMs: a CTA's ~160 KB of
shared memory leaves room for one per SM)."""
SPLIT_STEPS = 64
"""Splits are chosen so that the table's longest row gives each split about this many steps: the longest CTA bounds
the kernel, and each split costs a ``[T·H, C]`` fp32 partial written and merged (benchmarks/RESULTS.md has the
split sweep this value comes from)."""
MAX_SPLITS = 64
MAX_SPLIT_PAGES = 2048
"""Pages per split at most (each CTA holds its split's table row in shared memory: 8 KB)."""
NEG_INF = -1e30
REGISTERS = {"memory": 40, "compute": 232}
"""Per-thread registers (``setmaxnreg``): the three warpgroups share 504 per lane; a compute warpgroup holds its
``[64, C / 2]`` fp32 output (128 per thread at C = 512) and the step's scores."""


def supports_reason(*, dtype: str, page_dtype: str, c: int, dr: int, page_size: int) -> str | None:
    """None when a paged decode call fits this kernel, else why not (the registry's reason)."""
    if dtype != "bfloat16" or page_dtype != "bfloat16":
        return f"takes bfloat16 queries and pages, got {dtype} queries, {page_dtype} pages"
    if c % 128 or c > 512:
        return f"needs C a multiple of 128 up to 512 (two warpgroups of C / 2 <= 256 columns), got {c}"
    if (c + dr) % 64:
        return f"needs C + Dr a multiple of 64, got {c} + {dr}"
    if STEP % page_size or page_size % 8:
        return f"needs the page size to divide {STEP} and be a multiple of 8, got {page_size}"
    return None


def num_splits(b: int, head_blocks: int, max_steps: int, pages_per_step: int) -> int:
    """Splits per row: :data:`SPLIT_STEPS` steps each over the table's ``max_steps``, or more for about
    :data:`CTAS_TARGET` CTAs; at most :data:`MAX_SPLITS` and one per step, at least enough that a split spans no
    more than :data:`MAX_SPLIT_PAGES` pages."""
    want = min(MAX_SPLITS, max(-(-max_steps // SPLIT_STEPS), CTAS_TARGET // (b * head_blocks)))
    floor = -(-max_steps * pages_per_step // MAX_SPLIT_PAGES)
    return max(1, min(want, max_steps), floor)


def _split_table(table, pos, last, page_size: int, splits: int, base) -> tuple[jax.Array, int]:
    """``([B * splits, HEADER + split_pages] i32, split_pages)``: the per-(row, split) rows of the module docstring.
    ``last [B]``: visited pages; ``base``: the layer's first page in the flattened pool."""
    b, max_pages = table.shape
    pps = STEP // page_size
    n_steps = -(-last * page_size // STEP)  # [B] steps of each row
    max_steps = -(-max_pages // pps)
    chunk = -(-n_steps // splits)  # [B] steps per split of each row
    step0 = jnp.arange(splits, dtype=jnp.int32)[None, :] * chunk[:, None]  # [B, splits]
    count = jnp.clip(n_steps[:, None] - step0, 0, chunk[:, None])
    split_pages = -(-max_steps // splits) * pps
    split_pages += -split_pages % 32  # a multiple of 128 bytes
    page = step0[..., None] * pps + jnp.arange(split_pages, dtype=jnp.int32)  # [B, splits, split_pages]
    entry = jnp.take_along_axis(table[:, None, :], jnp.minimum(page, max_pages - 1), axis=2)
    ok = (page < last[:, None, None]) & (page < max_pages) & (entry != 0)
    first_mapped = jnp.take_along_axis(table, jnp.argmax(table != 0, axis=1)[:, None], axis=1)  # [B, 1]
    safe = jnp.where(ok, entry, first_mapped[:, :, None]) + base
    codes = safe * 2 + ok.astype(jnp.int32)
    header = jnp.zeros((b, splits, HEADER), jnp.int32)
    header = header.at[..., 0].set(pos[:, None]).at[..., 1].set(step0).at[..., 2].set(count)
    rows = jnp.concatenate([header, codes], axis=2).reshape(b * splits, HEADER + split_pages)
    return rows, split_pages


def paged_attention_mosaic_gpu(q_lat: jax.Array, q_rot: jax.Array, pages: jax.Array, table: jax.Array,
                               pos: jax.Array, last: jax.Array, scale: float, layer: jax.Array | None = None, *,
                               splits: int | None = None, page_offset: int = 0,
                               interpret=False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel (module docstring): ``q_lat [B, T, H, C]``, ``q_rot [B, T, H, Dr]`` bf16, ``pages [(R,) P, S, C +
    Dr]`` bf16 (a stack read at ``layer``, clamped), ``table [B, max_pages]`` i32, ``pos [B]``, ``last [B]`` the
    visited pages; a table entry ``e`` reads page ``e + page_offset`` of the layer (-1: a dense cache viewed as
    pages, its entries 1-based so that none is the null page). Returns the splits' partials ``(m [B, splits, T·H],
    l [B, splits, T·H], acc [B, splits, T·H, C])`` f32 (merge:
    :func:`pallas_kernels.paged_latent_attention.merge_splits`). ``interpret``: False, True or a
    ``plgpu.InterpretGPUParams``."""
    from pallas_kernels.kda.mosaic_gpu_common import interpret_params  # noqa: PLC0415

    b, t, h, c = q_lat.shape
    s_len, width = pages.shape[-2], pages.shape[-1]
    dr = width - c
    reason = supports_reason(dtype=jnp.dtype(q_lat.dtype).name, page_dtype=jnp.dtype(pages.dtype).name, c=c, dr=dr,
                             page_size=s_len)
    if reason is not None:
        raise ValueError(f"paged_attention_mosaic_gpu: {reason}")
    th = t * h
    thp = -(-th // ROWS) * ROWS
    n_hb = thp // ROWS
    max_pages = table.shape[1]
    pps = STEP // s_len
    ns = splits or num_splits(b, n_hb, -(-max_pages // pps), pps)
    n_pool = pages.shape[-3]
    base = jnp.int32(page_offset) if layer is None else (
        jnp.clip(jnp.asarray(layer, jnp.int32), 0, pages.shape[0] - 1) * n_pool + page_offset)
    meta, split_pages = _split_table(table.astype(jnp.int32), pos.astype(jnp.int32), last.astype(jnp.int32), s_len,
                                     ns, base)
    q = jnp.concatenate([q_lat.reshape(b, th, c), q_rot.reshape(b, th, dr)], axis=2)
    q = jnp.pad(q, ((0, 0), (0, thp - th), (0, 0))).reshape(b * thp, width)
    rows = pages.reshape(-1, width)
    half = c // 2
    last_q = t - 1

    # one swizzle for every wgmma operand (wgmma needs both sides' to match), the 64-byte one of p's STEP columns
    sw = (plgpu.TilingTransform((8, STEP)), plgpu.SwizzleTransform(2 * STEP))
    loop_smem = (
        plgpu.SMEM((ROWS, width), BF16, transforms=sw),  # queries
        plgpu.SMEM((SLOTS, STEP, width), BF16, transforms=sw),  # pages of a step
        plgpu.SMEM((2, ROWS, STEP), BF16, transforms=sw),  # p of each warpgroup
    )
    out_smem = (plgpu.SMEM((2, ROWS, half), F32, transforms=tiled(F32)),)  # output staging, once the loop is done
    scratch = (plgpu.RefUnion(loop_smem, out_smem),
               plgpu.SMEM((HEADER + split_pages,), jnp.int32),  # this CTA's table row
               plgpu.SMEM((2, ROWS), F32))  # m, l staging
    table_copies = row_pieces(HEADER + split_pages)
    bars = (plgpu.Barrier(num_arrivals=1 + len(table_copies)),  # table row and queries landed
            plgpu.Barrier(num_arrivals=pps, num_barriers=SLOTS),  # a slot's pages landed
            plgpu.Barrier(num_arrivals=2, num_barriers=SLOTS),  # both compute warpgroups done with a slot
            plgpu.Barrier(num_arrivals=2))  # both left the loop: the output staging may overwrite the loop buffers

    def mla_paged_decode_mosaic_gpu(meta_ref, q_ref, rows_ref, m_ref, l_ref, acc_ref, smem, bar):
        ((q_s, k_s, p_s), (o_s,)), tab_s, ml_s = smem
        ready, loaded, free, done = bar
        hb, sp, row, wg = (lax.axis_index(n) for n in ("h", "s", "b", "wg"))
        cta = row * ns + sp

        @pl.when(wg == 2)
        def _memory():
            if not interpret:
                plgpu.set_max_registers(REGISTERS["memory"], action="decrease")
            copy_row_to_smem(meta_ref, cta, tab_s, ready, table_copies)
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row * thp + hb * ROWS, ROWS)], q_s, ready)
            plgpu.barrier_wait(ready)
            n = tab_s[2]

            @pl.loop(0, n)
            def _(i):
                slot = lax.rem(i, SLOTS)

                @pl.when(i >= SLOTS)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                for p in range(pps):
                    page = lax.shift_right_logical(tab_s[HEADER + i * pps + p], 1)
                    plgpu.copy_gmem_to_smem(rows_ref.at[pl.ds(page * s_len, s_len)],
                                            k_s.at[slot].at[pl.ds(p * s_len, s_len)], loaded.at[slot])

            @pl.loop(jnp.maximum(n - SLOTS, 0), n)  # observe every phase of `free`
            def _(i):
                plgpu.barrier_wait(free.at[lax.rem(i, SLOTS)])

        for j in range(2):

            @pl.when(wg == j)
            def _compute(j=j):
                if not interpret:
                    plgpu.set_max_registers(REGISTERS["compute"], action="increase")
                plgpu.barrier_wait(ready)
                q_pos, step0, n = tab_s[0], tab_s[1], tab_s[2]
                cols = plgpu.broadcasted_iota(jnp.int32, (ROWS, STEP), 1, layout=plgpu.Layout.WGMMA)
                qrow = hb * ROWS + plgpu.broadcasted_iota(jnp.int32, (ROWS, STEP), 0, layout=plgpu.Layout.WGMMA)
                q_at = q_pos + lax.div(qrow, jnp.int32(h))  # [ROWS, STEP] position of each query row
                last_pos = q_pos + last_q

                def step(i, carry):
                    m, l, acc = carry
                    slot = lax.rem(i, SLOTS)
                    plgpu.barrier_wait(loaded.at[slot])

                    def scores(acc_s):
                        plgpu.wgmma(acc_s, q_s, k_s.at[slot].T)
                        return acc_s[...]

                    s = pl.run_scoped(scores, plgpu.ACC((ROWS, STEP), F32))
                    keys = (step0 + i) * STEP + cols
                    ok = jnp.zeros((ROWS, STEP), jnp.bool_)
                    for p in range(pps):
                        page_ok = lax.bitwise_and(tab_s[HEADER + i * pps + p], 1) == 1
                        ok = ok | ((lax.div(cols, jnp.int32(s_len)) == p) & page_ok)
                    vis = ok & (keys <= q_at) & (keys <= last_pos)
                    s = jnp.where(vis, s * scale, NEG_INF)
                    m_new = jnp.maximum(m, jnp.max(s, axis=1))
                    alpha = jnp.exp(m - m_new)
                    p_val = jnp.where(vis, jnp.exp(s - lax.broadcast_in_dim(m_new, (ROWS, STEP), [0])), 0.0)
                    l = alpha * l + jnp.sum(p_val, axis=1)
                    p_s.at[j][...] = p_val.astype(BF16)
                    plgpu.commit_smem()
                    v = k_s.at[slot].at[:, pl.ds(j * half, half)]

                    (acc,) = accumulate(lambda acc_o: plgpu.wgmma(acc_o, p_s.at[j], v),
                                        (acc * lax.broadcast_in_dim(alpha, (ROWS, half), [0]),), bool(interpret))
                    plgpu.barrier_arrive(free.at[slot])
                    return m_new, l, acc

                row_vec = lambda x: plgpu.layout_cast(jnp.full((ROWS,), x, F32), plgpu.Layout.WGMMA.reduce(1))
                init = (row_vec(NEG_INF), row_vec(0.0),
                        plgpu.layout_cast(jnp.zeros((ROWS, half), F32), plgpu.Layout.WGMMA))
                m, l, acc = lax.fori_loop(0, n, step, init)
                plgpu.barrier_arrive(done)
                plgpu.barrier_wait(done)
                o_s.at[j][...] = acc
                if j == 0:
                    ml_s.at[0][...] = m
                    ml_s.at[1][...] = l
                plgpu.commit_smem()
                out_rows = pl.ds(cta * thp + hb * ROWS, ROWS)
                plgpu.copy_smem_to_gmem(o_s.at[j], acc_ref.at[out_rows, pl.ds(j * half, half)])
                if j == 0:
                    ml_row = cta * n_hb + hb
                    plgpu.copy_smem_to_gmem(ml_s.at[0], m_ref.at[ml_row])
                    plgpu.copy_smem_to_gmem(ml_s.at[1], l_ref.at[ml_row])
                plgpu.wait_smem_to_gmem(0)

    m, l, acc = plgpu.kernel(
        mla_paged_decode_mosaic_gpu,
        out_type=(jax.ShapeDtypeStruct((b * ns * n_hb, ROWS), F32), jax.ShapeDtypeStruct((b * ns * n_hb, ROWS), F32),
                  jax.ShapeDtypeStruct((b * ns * thp, c), F32)),
        scratch_types=(scratch, bars),
        grid=(n_hb, ns, b),
        grid_names=("h", "s", "b"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret_params(interpret),
    )(meta, q, rows)
    m = m.reshape(b, ns, thp)[:, :, :th]
    l = l.reshape(b, ns, thp)[:, :, :th]
    acc = acc.reshape(b, ns, thp, c)[:, :, :th]
    return m, l, acc
