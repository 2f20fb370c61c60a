"""Decode cache of the K3 model: fixed-size KDA states + conv tails, and the MLA latent (never per-head K/V).

Layout (mirrors :func:`k3_jax.model.layer_plan`; leaves of a segment are stacked over its repeats)::

    {"lengths": [B] i32,                                    # tokens already cached per row
     "segments": [ {"layer_{j}": entry, ...} per segment ]}
    KDA entry: {"state": [R, B, H, K, V] f32, "conv": [R, B, W-1, 3·H·K]}
    MLA entry: {"latent": [R, B, max_len, kv_lora + rope]}   # ĉ (normalised latent) | k_rot

Per sequence this is 69 × 96·128·128·4 B (KDA state) + 69 × 3·3·12288 conv values + 24 × 576 values per token
for the full model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3_jax.config import K3Config
from k3_jax.model import layer_plan


def _entry(cfg: K3Config, kind: str, batch: int, max_len: int, dtype: jnp.dtype, repeats: int) -> dict:
    if kind == "kda":
        h, d = cfg.kda_num_heads, cfg.kda_head_dim
        return {
            "state": jnp.zeros((repeats, batch, h, d, d), jnp.float32),
            "conv": jnp.zeros((repeats, batch, cfg.short_conv_kernel_size - 1, 3 * h * d), dtype),
        }
    return {"latent": jnp.zeros((repeats, batch, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim), dtype)}


def init_cache(cfg: K3Config, batch: int, max_len: int, dtype: str | jnp.dtype | None = None) -> dict:
    """An empty cache for ``batch`` rows of up to ``max_len`` tokens (``dtype`` defaults to ``cfg.dtype``)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    segments = []
    for seg in layer_plan(cfg):
        segments.append({f"layer_{j}": _entry(cfg, mixer, batch, max_len, dtype, seg.repeats)
                         for j, (mixer, _) in enumerate(seg.kinds)})
    return {"lengths": jnp.zeros((batch,), jnp.int32), "segments": segments}


def cache_bytes_per_sequence(cfg: K3Config, length: int, latent_bytes: int = 2) -> dict[str, int]:
    """Bytes one sequence of ``length`` tokens occupies: KDA states (fp32), conv tails, MLA latents."""
    n_kda = sum(1 for i in range(cfg.num_hidden_layers) if cfg.mixer_kind(i) == "kda")
    n_mla = cfg.num_hidden_layers - n_kda
    state = n_kda * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4
    conv = n_kda * (cfg.short_conv_kernel_size - 1) * 3 * cfg.kda_proj_size * latent_bytes
    latent = n_mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * length * latent_bytes
    return {"kda_state": state, "conv": conv, "mla_latent": latent, "total": state + conv + latent}


def reset_rows(cache: dict, rows: jax.Array) -> dict:
    """Zero the cache rows where ``rows`` [B] bool is True (a freed decode slot) and their lengths."""

    def zero(x: jax.Array, batch_axis: int) -> jax.Array:
        shape = [1] * x.ndim
        shape[batch_axis] = x.shape[batch_axis]
        return jnp.where(rows.reshape(shape), jnp.zeros((), x.dtype), x)

    segments = jax.tree.map(lambda x: zero(x, 1), cache["segments"])
    return {"lengths": jnp.where(rows, 0, cache["lengths"]), "segments": segments}
