"""Packed, non-causal self-attention for the vision tower: a patch attends to every patch of its own media item.

Block-diagonal by construction: queries are cut into blocks of ``Bq`` rows and block ``b`` attends only to a key
*window* ``[kv_start[b], kv_start[b] + W)`` that covers every item its queries belong to (host-computed by
:func:`attention_windows`, carried in the media plan; ``Bq`` and ``W`` are the shapes of its arrays, so they are
static). Inside the window the same-item mask is exact. Work is ``N * W`` instead of ``N^2``: for a batch of many
small images ``W`` is about one item, for one large image it is the whole sequence.

Two implementations (:func:`attention_choice`):

- ``"xla"`` — the reference: ``lax.map`` over query blocks, fp32 scores and softmax (the release's
  ``softmax(dtype=float32)``), probabilities in the value dtype, fp32 accumulation; ``[H, Bq, W]`` scores live at once;
- ``"cudnn"`` — cuDNN's fused flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``) on the
  windows batched over blocks, the same-item mask as its boolean mask ``[nb, 1, Bq, W]`` (``N * W`` bytes; at most
  :data:`MAX_CUDNN_MASK_BYTES`); bf16/fp16, Hopper or newer.

``"auto"`` takes cuDNN when it can run (GPU of compute capability >= 9.0, half-precision inputs, mask within the
limit) and XLA otherwise; :func:`attention_choice` returns the choice and its reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.layers.common import einsum_f32
from pallas_kernels.attention import cudnn_attention_available

QUERY_BLOCK = 512
WINDOW_ALIGN = 128
MAX_CUDNN_MASK_BYTES = 1 << 30


def attention_windows(segment_ids: np.ndarray, block: int = QUERY_BLOCK,
                      align: int = WINDOW_ALIGN) -> tuple[np.ndarray, int, int]:
    """Host side: ``(kv_start [nb] i32, Bq, W)`` for queries cut in blocks of ``Bq = min(block, N)`` rows (rows
    padded to ``nb*Bq`` with segment -1 join the trailing padding group). ``W`` is a multiple of ``align`` (or
    the padded length, if smaller) and every block's items lie inside its window."""
    seg = np.asarray(segment_ids)
    n = seg.shape[0]
    block = min(block, n)
    nb = -(-n // block)
    total = nb * block
    seg = np.concatenate([seg, np.full((total - n,), -1, seg.dtype)])
    change = np.flatnonzero(np.diff(seg)) + 1  # runs of equal ids = items (padding: one run at the end)
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [total]])
    run = np.repeat(np.arange(len(starts)), ends - starts)
    lo = starts[run[np.arange(nb) * block]]
    hi = ends[run[np.arange(nb) * block + block - 1]]
    w = int(np.max(hi - lo))
    w = min(-(-w // align) * align, total)
    kv_start = np.clip(lo, 0, total - w).astype(np.int32)
    return kv_start, block, w


def attention_choice(implementation: str, dtype: jnp.dtype, n_rows: int, window: int) -> tuple[str, str]:
    """``(implementation, reason)`` for a requested ``"auto" | "xla" | "cudnn"``; ``"cudnn"`` that cannot run raises."""
    if implementation not in ("auto", "xla", "cudnn"):
        raise ValueError(f"vision attention implementation must be 'auto', 'xla' or 'cudnn', got {implementation!r}")
    if implementation == "xla":
        return "xla", "requested"
    problems = []
    if not cudnn_attention_available():
        problems.append("no cuDNN-capable GPU (compute capability >= 9.0)")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        problems.append(f"dtype {jnp.dtype(dtype).name} (cuDNN flash attention takes bf16/fp16)")
    if n_rows * window > MAX_CUDNN_MASK_BYTES:
        problems.append(f"mask {n_rows}x{window} > {MAX_CUDNN_MASK_BYTES} bytes")
    if not problems:
        return "cudnn", "auto: cuDNN flash attention available" if implementation == "auto" else "requested"
    if implementation == "cudnn":
        raise ValueError("vision attention 'cudnn' cannot run: " + "; ".join(problems))
    return "xla", "auto: " + "; ".join(problems)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, seg_q: jax.Array, seg_k: jax.Array, scale: float) -> jax.Array:
    s = einsum_f32("qhd,khd->hqk", q, k) * scale
    same = seg_q[:, None] == seg_k[None, :]
    s = jnp.where(same[None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return einsum_f32("hqk,khd->qhd", p, v).astype(v.dtype)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, kv_start: jax.Array,
                     q_offsets: jax.Array, kv_offsets: jax.Array, implementation: str = "auto") -> jax.Array:
    """``q, k, v [N, H, Dh]``, ``segment_ids [N]`` (item index; equal ids attend), and from
    :func:`attention_windows`: ``kv_start [nb]``, ``q_offsets [Bq]`` / ``kv_offsets [W]`` (``arange``; their
    lengths are the static block and window sizes) -> ``[N, H, Dh]``; scale ``Dh ** -0.5``."""
    n, h, dh = q.shape
    nb, block, w = kv_start.shape[0], q_offsets.shape[0], kv_offsets.shape[0]
    total = nb * block
    if total < n:
        raise ValueError(f"attention blocks {nb}x{block} do not cover {n} rows")
    if w > total:
        raise ValueError(f"attention window {w} > padded length {total}")
    impl, _ = attention_choice(implementation, q.dtype, total, w)
    scale = dh ** -0.5
    pad = total - n
    seg = jnp.pad(segment_ids.astype(jnp.int32), (0, pad), constant_values=-1)
    qp, kp, vp = (jnp.pad(x, ((0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    qb, sb = qp.reshape(nb, block, h, dh), seg.reshape(nb, block)
    if impl == "cudnn":
        idx = kv_start[:, None] + kv_offsets[None, :]  # [nb, W]
        kw, vw, sw = kp[idx], vp[idx], seg[idx]
        mask = (sb[:, :, None] == sw[:, None, :])[:, None]  # [nb, 1, Bq, W]
        out = jax.nn.dot_product_attention(qb, kw, vw, mask=mask, scale=scale, implementation="cudnn")
    else:
        def one(args: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
            qi, si, start = args
            ki = jax.lax.dynamic_slice_in_dim(kp, start, w)
            vi = jax.lax.dynamic_slice_in_dim(vp, start, w)
            s_k = jax.lax.dynamic_slice_in_dim(seg, start, w)
            return _attend(qi, ki, vi, si, s_k, scale)

        out = jax.lax.map(one, (qb, sb, kv_start)) if nb > 1 else one((qb[0], sb[0], kv_start[0]))[None]
    return out.reshape(total, h, dh)[:n]
