"""Packed, non-causal self-attention for the vision tower: a patch attends to every patch of its own media item.

Block-diagonal by construction: queries are cut into blocks of ``Bq`` rows and block ``b`` attends only to a key
*window* ``[kv_start[b], kv_start[b] + W)`` that covers every item its queries belong to (host-computed by
:func:`attention_windows`, carried in the media plan; ``Bq`` and ``W`` are the shapes of its arrays, so they are
static). Inside the window the same-item mask is exact. Work is ``N * W`` instead of ``N^2``: for a batch of many
small images ``W`` is about one item, for one large image it is the whole sequence.

Backends (:data:`VISION_ATTENTION`, a :class:`pallas_kernels.registry.Registry`; ``VisionConfig.attention``
picks one, ``"auto"`` takes the first that can run, in this order):

- ``"mosaic_tpu"`` — JAX's Pallas TPU flash attention (``jax.experimental.pallas.ops.tpu.flash_attention``) with
  ``segment_ids`` as the packing mask, over the whole sequence padded to a multiple of 128 (padding: segment -1);
  its own Pallas backward. Target platform TPU; head dim <= 128 or a multiple of 128. It does not skip blocks of
  other items: work is ``N^2``, not ``N * W``;
- ``"cudnn"`` — cuDNN's fused flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``) on the
  windows batched over blocks, the same-item mask as its boolean mask ``[nb, 1, Bq, W]`` (``N * W`` bytes; at most
  :data:`MAX_CUDNN_MASK_BYTES`); bf16/fp16, a GPU of compute capability >= 9.0;
- ``"xla"`` — the reference: ``lax.map`` over query blocks, fp32 scores and softmax (the release's
  ``softmax(dtype=float32)``), probabilities in the value dtype, fp32 accumulation; ``[H, Bq, W]`` scores live at
  once. Runs everywhere.

An explicit choice that cannot run raises :class:`~pallas_kernels.registry.KernelUnavailable` with the reason;
the choice is logged once per call shape (``pallas_kernels`` logger), :func:`attention_choice` returns it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.layers.common import einsum_f32
from pallas_kernels.attention import cudnn_platform_reason
from pallas_kernels.registry import Backend, Registry, target_compute_capability, target_platform

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


@dataclasses.dataclass(frozen=True)
class VisionAttentionCall:
    """What the backends look at: target ``platform``, ``dtype``, padded rows ``n_rows``, key ``window``,
    ``head_dim``, and the target GPU's ``compute_capability`` (None if unknown / not a GPU)."""

    platform: str
    dtype: str
    n_rows: int
    window: int
    head_dim: int
    compute_capability: float | None = None


def _mosaic_reason(call: VisionAttentionCall) -> str | None:
    if call.platform != "tpu":
        return f"needs target platform tpu, target is {call.platform}"
    if call.head_dim > 128 and call.head_dim % 128:
        return f"head dim must be <= 128 or a multiple of 128, got {call.head_dim}"
    return None


def _cudnn_reason(call: VisionAttentionCall) -> str | None:
    reason = cudnn_platform_reason(call.platform, call.compute_capability)
    if reason is not None:
        return reason
    if call.dtype not in ("bfloat16", "float16"):
        return f"takes bfloat16/float16, got {call.dtype}"
    if call.n_rows * call.window > MAX_CUDNN_MASK_BYTES:
        return f"mask {call.n_rows}x{call.window} > {MAX_CUDNN_MASK_BYTES} bytes"
    return None


VISION_ATTENTION = Registry("vision.attention", (
    Backend("mosaic_tpu", "Pallas TPU flash attention, segment ids = media items", _mosaic_reason),
    Backend("cudnn", "cuDNN flash attention on key windows, same-item boolean mask", _cudnn_reason),
    Backend("xla", "windowed pure-JAX attention in query blocks (the reference)", lambda call: None),
))


def attention_choice(implementation: str, dtype: jnp.dtype, n_rows: int, window: int, head_dim: int = 128,
                     platform: str | None = None) -> tuple[str, str]:
    """``(backend, reason)`` for ``implementation`` (``"auto"`` or a :data:`VISION_ATTENTION` name) on the target
    platform; an explicit choice that cannot run raises ``KernelUnavailable`` (a ``ValueError``)."""
    target = target_platform(platform)
    cc = target_compute_capability(target)
    call = VisionAttentionCall(target, jnp.dtype(dtype).name, n_rows, window, head_dim, cc)
    sel = VISION_ATTENTION.select(implementation, call)
    if implementation != "auto":
        return sel.backend, "requested"
    why = "; ".join(f"{n}: {r}" for n, r in sel.passed_over)
    return sel.backend, "auto" + (f" (passed over {why})" if why else "")


def _mosaic_flash(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, scale: float) -> jax.Array:
    """``[N, H, Dh]`` x3 + ``seg [N]`` -> ``[N, H, Dh]`` through the Pallas TPU flash attention (rows padded to a
    multiple of 128 with segment -1)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa  # noqa: PLC0415

    n = q.shape[0]
    m = -(-n // 128) * 128
    blk = next(b for b in (512, 256, 128) if m % b == 0)
    pad = ((0, m - n), (0, 0), (0, 0))
    qt, kt, vt = (jnp.pad(x, pad).transpose(1, 0, 2)[None] for x in (q, k, v))  # [1, H, M, Dh]
    sp = jnp.pad(seg, (0, m - n), constant_values=-1)[None]
    sizes = fa.BlockSizes(block_q=blk, block_k_major=blk, block_k=blk, block_b=1, block_q_major_dkv=blk,
                          block_k_major_dkv=blk, block_k_dkv=blk, block_q_dkv=blk, block_k_major_dq=blk,
                          block_k_dq=blk, block_q_dq=blk)
    out = fa.flash_attention(qt, kt, vt, segment_ids=fa.SegmentIds(sp, sp), sm_scale=scale, block_sizes=sizes)
    return out[0].transpose(1, 0, 2)[:n]


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, seg_q: jax.Array, seg_k: jax.Array, scale: float) -> jax.Array:
    s = einsum_f32("qhd,khd->hqk", q, k) * scale
    same = seg_q[:, None] == seg_k[None, :]
    s = jnp.where(same[None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return einsum_f32("hqk,khd->qhd", p, v).astype(v.dtype)


def packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, kv_start: jax.Array,
                     q_offsets: jax.Array, kv_offsets: jax.Array, implementation: str = "auto",
                     platform: str | None = None) -> jax.Array:
    """``q, k, v [N, H, Dh]``, ``segment_ids [N]`` (item index; equal ids attend), and from
    :func:`attention_windows`: ``kv_start [nb]``, ``q_offsets [Bq]`` / ``kv_offsets [W]`` (``arange``; their
    lengths are the static block and window sizes) -> ``[N, H, Dh]``; scale ``Dh ** -0.5``. ``platform``: the
    target (default :func:`~pallas_kernels.registry.target_platform`'s answer)."""
    n, h, dh = q.shape
    nb, block, w = kv_start.shape[0], q_offsets.shape[0], kv_offsets.shape[0]
    total = nb * block
    if total < n:
        raise ValueError(f"attention blocks {nb}x{block} do not cover {n} rows")
    if w > total:
        raise ValueError(f"attention window {w} > padded length {total}")
    impl, _ = attention_choice(implementation, q.dtype, total, w, dh, platform)
    scale = dh ** -0.5
    if impl == "mosaic_tpu":
        return _mosaic_flash(q, k, v, segment_ids.astype(jnp.int32), scale)
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
