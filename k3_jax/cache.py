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


_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


def cache_bytes_per_sequence(
    cfg: K3Config,
    length: int,
    latent_dtype: str = "bfloat16",
    conv_dtype: str = "float32",
    fp8_scale_bytes: int = 4,
) -> dict[str, int]:
    """Analytic decode-cache bytes of one sequence of ``length`` tokens.

    ``kda_state = L_kda·H·K·V·4`` (69·96·128·128·4 = 434 MB for K3),
    ``kda_conv = L_kda·(W-1)·3·H·Dk·bytes``,
    ``mla_latent = L_mla·(kv_lora+rope)·bytes·length`` (24·576·bytes per token for K3) + fp8 scales.
    """
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    hk = cfg.kda_num_heads * cfg.kda_head_dim
    lat = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    out = {
        "kda_state": n_kda * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim * 4,
        "kda_conv": n_kda * (cfg.short_conv_kernel_size - 1) * 3 * hk * _BYTES[conv_dtype],
        "mla_latent": n_mla * lat * _BYTES[latent_dtype] * length,
    }
    if latent_dtype == "float8_e4m3fn":
        out["mla_latent"] += n_mla * fp8_scale_bytes * length
    out["mla_latent_per_token"] = out["mla_latent"] // max(length, 1)
    out["total"] = out["kda_state"] + out["kda_conv"] + out["mla_latent"]
    return out
