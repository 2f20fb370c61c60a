"""Causal, same-document self-attention through cuDNN's fused (flash) attention on XLA:GPU, for MLA training.

The MLA training path (no cache) attends ``q, k [B, T, H, 192]`` against ``v [B, T, H, 128]`` under a causal
mask restricted to each packed document (``segment_ids``). The pure-XLA path
(:func:`k3_jax.layers.mla.blocked_causal_attention`) writes fp32 scores ``[B, H, blk, T]`` to HBM and runs the
softmax and its backward as separate fusions; cuDNN's flash attention keeps them on chip (fp32 softmax
statistics, bf16 operands) and takes ``Dqk != Dv`` on Hopper with cuDNN >= 9.10.

Documents enter as cuDNN's additive bias: a same-document mask ``[B, 1, T, T]`` (bf16 0 / -large, broadcast
over heads) on top of its causal mask, so any packing is exact. That mask costs ``2·B·T²`` bytes per MLA layer
(kept for the backward): :data:`MAX_MASKED_LENGTH` bounds T, longer sequences take the blocked XLA path.
cuDNN's packed-document layout (``q_offsets``/``q_seqlen``) and a data-dependent ``lax.cond`` between the kernel
and the XLA path are not used (the first faulted at these shapes, the second syncs with the host per call).

Uses ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` (the kernel ``jax.nn`` wraps, called
directly for its ``qkv_layout`` and mask-type arguments).

:data:`ATTENTION` is the op's registry: ``cudnn`` (this kernel), then ``xla`` (the blocked pure-JAX attention of
:mod:`k3_jax.layers.mla`); ``cudnn`` needs a target GPU of compute capability >= 9.0 (the visible GPU's), a
jaxlib with the lowering, bf16/fp16 and, with documents, an even T <= :data:`MAX_MASKED_LENGTH`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.registry import (
    Backend,
    Registry,
    target_compute_capability,
    target_platform,
    visible_gpu_compute_capability,
)


@functools.cache
def _has_cudnn_lowering() -> bool:
    try:
        from jax._src.cudnn import fused_attention_stablehlo  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def cudnn_attention_available(platform: str | None = None) -> bool:
    """True when the target platform is a GPU of compute capability >= 9.0 and jaxlib has the cuDNN lowering."""
    cc = visible_gpu_compute_capability()
    return _has_cudnn_lowering() and target_platform(platform) == "gpu" and cc is not None and cc >= 9.0


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
    return _shape_reason(jnp.dtype(q.dtype).name, q.shape[1], segment_ids is not None) is None


def _shape_reason(dtype: str, t: int, documents: bool) -> str | None:
    if dtype not in ("bfloat16", "float16"):
        return f"takes bfloat16/float16, got {dtype}"
    if documents and (t % 2 or t > MAX_MASKED_LENGTH):
        return f"with segment ids needs an even T <= {MAX_MASKED_LENGTH}, got T={t}"
    return None


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """What the attention backends look at: ``shape = (B, T, H, Dqk, Dv)``, ``documents``: segment ids given;
    ``compute_capability`` of the target GPU (None if unknown)."""

    platform: str
    dtype: str
    shape: tuple[int, int, int, int, int]
    documents: bool
    compute_capability: float | None


def cudnn_platform_reason(platform: str, compute_capability: float | None) -> str | None:
    """Why cuDNN fused attention cannot run on this target (None: it can): a GPU target, a jaxlib with the
    cuDNN lowering, compute capability >= 9.0 (Hopper; the MLA head dims Dqk != Dv need it too)."""
    if platform != "gpu":
        return f"needs target platform gpu, target is {platform}"
    if not _has_cudnn_lowering():
        return "this jaxlib has no cuDNN fused-attention lowering"
    if compute_capability is None or compute_capability < 9.0:
        return f"needs compute capability >= 9.0, the target GPU has {compute_capability}"
    return None


def _cudnn_reason(call: AttentionCall) -> str | None:
    return cudnn_platform_reason(call.platform, call.compute_capability) or _shape_reason(
        call.dtype, call.shape[1], call.documents)


ATTENTION = Registry("mla.attention", (
    Backend("cudnn", "cuDNN flash attention, causal + same-document bias", _cudnn_reason),
    Backend("xla", "blocked pure-JAX attention in query blocks (k3_jax.layers.mla)", lambda call: None),
))


def make_call(q: jax.Array, v: jax.Array, segment_ids: jax.Array | None, platform: str | None) -> AttentionCall:
    b, t, h, dqk = q.shape
    target = target_platform(platform)
    cc = target_compute_capability(target)
    return AttentionCall(target, jnp.dtype(q.dtype).name, (b, t, h, dqk, v.shape[-1]), segment_ids is not None, cc)
