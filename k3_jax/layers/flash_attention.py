"""Causal, same-document self-attention through cuDNN's fused (flash) attention on XLA:GPU, for MLA training.

The MLA training path (no cache) attends ``q, k [B, T, H, 192]`` against ``v [B, T, H, 128]`` under a causal
mask restricted to each packed document (``segment_ids``). The pure-XLA path
(:func:`k3_jax.layers.mla.blocked_causal_attention`) writes fp32 scores ``[B, H, blk, T]`` to HBM and runs the
softmax and its backward as separate fusions; cuDNN's flash attention keeps them on chip (fp32 softmax
statistics, bf16 operands) and takes ``Dqk != Dv`` on Hopper with cuDNN >= 9.10.

Documents enter as cuDNN's additive bias: a same-document mask ``[B, 1, T, T]`` (bf16 0 / -large, broadcast
over heads) on top of its causal mask, so any packing is exact. That mask costs ``2·B·T²`` bytes per MLA layer
(kept for the backward): :data:`MAX_MASKED_LENGTH` bounds T, longer sequences take the blocked XLA path.
cuDNN's packed-document layout (``q_offsets``/``q_seqlen``) is not used (an illegal memory access at these
shapes), nor a data-dependent ``lax.cond`` between the kernel and the XLA path (a host synchronisation per call).

Uses ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` (the kernel ``jax.nn`` wraps, called
directly for its ``qkv_layout`` and mask-type arguments); :func:`cudnn_attention_available` says whether it can
run here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.cache
def cudnn_attention_available() -> bool:
    """True on an NVIDIA GPU of compute capability >= 9.0 whose jaxlib has the cuDNN attention lowering."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo  # noqa: F401, PLC0415
    except ImportError:
        return False
    if jax.default_backend() != "gpu":
        return False
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return cc is not None and float(cc) >= 9.0
    except (TypeError, ValueError):
        return False


MAX_MASKED_LENGTH = 16384
"""Longest T the cuDNN path takes with a document mask (``2·B·T²`` bytes per MLA layer: 512 MiB at B=1)."""


def cudnn_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                           segment_ids: jax.Array | None = None) -> jax.Array:
    """cuDNN flash attention, causal within each document. q, k ``[B, T, H, Dqk]``, v ``[B, T, H, Dv]``
    bf16/fp16, segment_ids ``[B, T]`` int or None (one document per row) -> ``[B, T, H, Dv]``."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention  # noqa: PLC0415

    mask = None
    if segment_ids is not None:
        seg = segment_ids.astype(jnp.int32)
        mask = seg[:, None, :, None] == seg[:, None, None, :]  # [B, 1, T, T], True = same document
    return dot_product_attention(q, k, v, mask=mask, scale=scale, mask_type=MaskType.CAUSAL, qkv_layout="BTNH")


def cudnn_supports(q: jax.Array, segment_ids: jax.Array | None) -> bool:
    """Static check: the cuDNN path takes these shapes (bf16/fp16; with documents, even T <= the mask bound)."""
    t = q.shape[1]
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    return segment_ids is None or (t % 2 == 0 and t <= MAX_MASKED_LENGTH)
