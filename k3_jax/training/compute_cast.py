"""Which parameters the train step casts to the compute dtype once per step, instead of once per micro-batch.

Every leaf matched by :data:`COMPUTE_CAST_LEAVES` is read by the model only as a GEMM operand cast to
``cfg.dtype`` (``Linear``'s ``kernel.astype(dt)``, the expert FFN's ``dense_expert_weight(w, dt)``). Casting it
before the micro-batch loop gives the same forward values, and its gradient is the same bf16 GEMM output the
per-use cast's transpose would have widened to f32 (XLA emits weight-gradient GEMMs with bf16 outputs either
way): gradients are unchanged, but each micro-batch no longer re-reads the f32 masters (4 B/param), re-saves the
cast weights as backward residuals, and writes its weight gradients at 4 B/param before the f32 accumulation.

Under QAT (``qat="mxfp4"``) the routed experts stay in their master dtype too: QAT quantises the master weights,
as :func:`k3_jax.training.lora.export` packs them (a bf16 copy first would round twice: bf16, then MXFP4, which
changes some elements and, where an amax rounds up to a power of two, a group's scale), and the MXFP4 values it
produces are exact in bf16, so the expert GEMMs read the same bf16 operands.

Left in f32 on purpose: the router (``gate/kernel``, fp32 HIGHEST scores), the short-conv taps, norms,
AttnRes queries, ``A_log``/``dt_bias``, the embedding, ``kv_b_proj`` (sequence-parallel MLA uses it in fp32),
and ``lm_head`` (its gradient sums over loss chunks, which must happen in f32).
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp

COMPUTE_CAST_LEAVES: tuple[str, ...] = (
    r"self_attn/(q|k|v|g|o|b|f_a|f_b|q_a|q_b)_proj/kernel",  # KDA and MLA projections (Linear)
    r"self_attn/kv_a_proj_with_mqa/kernel",
    r"(mlp|shared_experts)/(gate|up|down)_proj/kernel",  # dense MLP and shared experts (Linear)
    r"block_sparse_moe/routed_expert_(down|up)_proj/kernel",  # latent projections (Linear)
    r"block_sparse_moe/experts/w[123]",  # routed experts, bf16 format (dense_expert_weight)
)
"""Regular expressions matched (``re.search``) against ``/``-joined parameter paths."""

_PATTERN = re.compile("|".join(f"(?:{p})$" for p in COMPUTE_CAST_LEAVES))


def _path(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


_EXPERTS = re.compile(r"block_sparse_moe/experts/w[123]$")


def compute_cast_mask(params: Any, qat: str = "none") -> Any:
    """Pytree of bools like ``params``: True where the leaf is cast to the compute dtype once per step (with
    ``qat="mxfp4"`` never the routed experts, see the module docstring)."""

    def cast(path: tuple, leaf: Any) -> bool:
        name = _path(path)
        if qat != "none" and _EXPERTS.search(name):
            return False
        return bool(_PATTERN.search(name)) and jnp.issubdtype(leaf.dtype, jnp.floating)

    return jax.tree_util.tree_map_with_path(cast, params)


def cast_for_compute(params: Any, mask: Any, dtype: jnp.dtype) -> Any:
    """``params`` with the masked leaves in ``dtype`` (the rest untouched); shapes and shardings are kept."""
    return jax.tree.map(lambda p, m: p.astype(dtype) if m else p, params, mask)
