"""KDA chunked forward on Pallas Mosaic GPU (sm_90): two kernels, split the way the work parallelises.

1. :mod:`.mosaic_gpu_intra`: everything of a chunk that does not depend on the carried state (cumulative gate,
   the factored-decay ``A`` tiles on wgmma, the inverse, ``W``), one CTA per ``(chunk, sequence, head)``: all
   chunks at once.
2. :mod:`.mosaic_gpu_state`: the sequential pass over the chunks per ``(V-part, sequence, head)``, TMA-pipelined,
   the state in registers, ``o`` and the final state written.

Contract: bf16 ``q, k, v``, fp32 log-decay ``g`` with ``-5 <= g <= 0`` (the K3 gate bound), ``K = V = 128``,
chunk 64: :func:`supports_reason` says why a call does not fit. Packed sequences (``segment_ids``): the per-chunk
kernel masks its products to one document and its state operands to the documents entering and leaving the
chunk (:func:`.mosaic_gpu_intra.intra_chunks`); the state pass is the same.
Precision: the ``A`` products, the inverse, ``W`` and the state products take bf16 operands with fp32
accumulation (as fla's kernels); the carried state, decay factors and ``G`` are fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda import _layout
from pallas_kernels.kda import reference as ref
from pallas_kernels.kda.mosaic_gpu_common import BF16, CHUNK, F32, interpret_params, shape_reason
from pallas_kernels.kda.mosaic_gpu_intra import intra_chunks
from pallas_kernels.kda.mosaic_gpu_state import state_pass

DEFAULT_SMS = 132
"""Multiprocessors assumed when the device does not say (an H100 / H200 SXM)."""


def supports_reason(*, dtype: str, k: int, v: int, chunk_size: int) -> str | None:
    """None when a chunked call fits these kernels, else why not (the registry's reason)."""
    return shape_reason(dtype=dtype, k=k, v=v, chunk_size=chunk_size)


def default_v_split(batch: int, heads: int, sms: int | None = None) -> int:
    """V-parts per ``(sequence, head)`` of the state pass: 2 (one state warpgroup per CTA) when that still fits
    the GPU's multiprocessors in one wave, else 1 (two state warpgroups sharing one CTA's loads)."""
    if sms is None:
        sms = getattr(jax.devices()[0], "core_count", None) or DEFAULT_SMS
    return 2 if 2 * batch * heads <= sms else 1


def chunk_kda_fwd(q, k, v, g, beta, scale: float, initial_state=None, segment_ids=None, chunk_size: int = CHUNK,
                  interpret=False, v_split: int | None = None, residuals: bool = False):
    """Chunked KDA forward (module docstring). ``q, k, g [B, T, H, 128]``, ``v [B, T, H, 128]``, ``beta [B, T, H]``,
    ``initial_state [B, H, 128, 128] f32`` or None, ``segment_ids [B, T] int`` or None (packed sequences).
    Returns ``(o [B, T, H, 128] bf16, final_state f32)``. ``interpret``: False, True or a
    ``plgpu.InterpretGPUParams`` (CPU interpreter); ``v_split``: None
    (:func:`default_v_split`), 1 or 2. ``residuals``: also return the per-chunk results the GPU backward takes
    instead of recomputing them (:class:`pallas_kernels.kda._layout.ChunkResiduals`; the per-chunk kernel then
    also writes ``A_kk`` and ``X`` in fp32) as a third result."""
    ref._check_inputs(q, k, v, g, beta, initial_state, segment_ids, "mosaic_gpu.chunk_kda_fwd")
    B, T, H, K = q.shape
    reason = supports_reason(dtype=jnp.promote_types(q.dtype, v.dtype).name, k=K, v=v.shape[-1],
                             chunk_size=chunk_size)
    if reason is not None:
        raise ValueError(f"mosaic_gpu.chunk_kda_fwd: {reason}")
    pad = (-T) % CHUNK
    padt = lambda x: x if pad == 0 else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v = (padt(x.astype(BF16)) for x in (q, k, v))
    g = padt(g.astype(F32))
    beta_t = jnp.swapaxes(padt(beta.astype(F32)), 1, 2)  # [B, H, Tp]
    if initial_state is None:
        h0_t = jnp.zeros((B, H, K, K), F32)
    else:
        h0_t = jnp.swapaxes(initial_state.astype(F32), -1, -2)
    interpret = interpret_params(interpret)
    if v_split is None:
        v_split = default_v_split(B, H, DEFAULT_SMS if interpret is not None else None)
    seg = None if segment_ids is None else _layout.chunk_document_starts(segment_ids, B, T, CHUNK).reshape(B, -1)
    parts = intra_chunks(q, k, g, beta_t, scale=float(scale), seg=seg, interpret=interpret, residuals=residuals)
    o, ht_t = state_pass(*parts[:3], v, *parts[3:6], h0_t, v_split=v_split, interpret=interpret)
    out = o[:, :T], jnp.swapaxes(ht_t, -1, -2)
    if not residuals:
        return out
    return (*out, _layout.ChunkResiduals(*parts[:6], **{name: x.reshape(B * H, -1, CHUNK)
                                                         for name, x in parts[6].items()}))
