"""Block Attention Residuals.

The depth sources of one token are kept in a fixed-size array so that layers can be scanned:

    sources[0]     = embedding e
    sources[m + 1] = S_m, the running sum of all sub-layer outputs of AttnRes block m

Layer ``l`` (block size ``bs``) writes its sub-layer outputs into slot ``l // bs + 1``; its attention side mixes
slots ``0 .. n_attn(l) - 1`` and its MLP side slots ``0 .. n_mlp(l) - 1`` with

    n_attn(l) = 1 if l == 0 else (l - 1) // bs + 2        (the bank plus the previous partial block)
    n_mlp(l)  = l // bs + 2                                (the bank plus the current partial block)

which is exactly the official bank/prefix schedule: at l = 0 the attention side is the identity on e, at a block
start the previous block is closed and a new, empty partial sum begins.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from k3_jax.config import K3Config
from k3_jax.layers.common import HIGHEST, Weight


def num_sources(cfg: K3Config) -> int:
    """Slots in the source array: embedding + one per AttnRes block."""
    return cfg.num_attn_res_blocks + 1


def _block_of(layer: jax.Array, block_size: int) -> jax.Array:
    """``layer // block_size`` for ``layer >= 0`` as one truncating division (``//`` on a traced int adds the
    sign corrections of floor division: a chain of scalar kernels per layer on GPU)."""
    return jax.lax.div(layer, jnp.asarray(block_size, layer.dtype))


def attn_sources_count(layer: jax.Array | int, block_size: int) -> jax.Array:
    layer = jnp.asarray(layer)
    return jnp.where(layer == 0, 1, _block_of(jnp.maximum(layer - 1, 0), block_size) + 2)


def mlp_sources_count(layer: jax.Array | int, block_size: int) -> jax.Array:
    return _block_of(jnp.asarray(layer), block_size) + 2


def output_slot(layer: jax.Array | int, block_size: int) -> jax.Array:
    """Slot that layer ``l``'s sub-layer outputs are added to."""
    return _block_of(jnp.asarray(layer), block_size) + 1


def attn_res_weights(sources: jax.Array, n_valid: jax.Array | int, query: jax.Array, eps: float) -> jax.Array:
    """Softmax mixing weights ``[R, B, T]`` f32 over the first ``n_valid`` slots (the rest get exactly 0).

    ``sources`` [R, B, T, D]; ``query`` [D] f32 = norm.weight ⊙ proj.weight.
    """
    v = sources.astype(jnp.float32)
    k = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    logits = jnp.einsum("rbtd,d->rbt", k, query, precision=HIGHEST)
    valid = (jnp.arange(sources.shape[0]) < n_valid)[:, None, None]
    logits = jnp.where(valid, logits, -jnp.inf)
    return jax.nn.softmax(logits, axis=0)


def attn_res_mix(sources: jax.Array, n_valid: jax.Array | int, query: jax.Array, eps: float,
                 out_dtype: jnp.dtype) -> jax.Array:
    """``Σ_r p_r V_r`` in fp32, cast to ``out_dtype``. ``sources`` [R, B, T, D] (storage dtype) -> [B, T, D].

    Like the release (``_apply_attn_res``: bf16 bank/prefix, ``v.float()`` inside), the sources stay in their
    storage dtype (cfg.dtype) and only the mix works in fp32. Under differentiation the mix is rematerialised:
    the backward pass keeps just its inputs (``sources`` in storage dtype, ``query`` [D] f32) and recomputes
    the fp32 upcast, RMS norms and weights, instead of saving three fp32 ``[R, B, T, D]`` residuals per mixing
    point. Forward values are unchanged.
    """
    return _attn_res_mix_remat(sources, jnp.asarray(n_valid), query, eps, jnp.dtype(out_dtype))


@functools.partial(jax.checkpoint, static_argnums=(3, 4))
def _attn_res_mix_remat(sources: jax.Array, n_valid: jax.Array, query: jax.Array, eps: float,
                        out_dtype: jnp.dtype) -> jax.Array:
    p = attn_res_weights(sources, n_valid, query, eps)
    out = jnp.einsum("rbt,rbtd->btd", p, sources.astype(jnp.float32), precision=HIGHEST)
    return out.astype(out_dtype)


def attn_res_point(parent_cfg: K3Config, prefix: str, sources: jax.Array, n_valid: jax.Array | int) -> jax.Array:
    """One mixing point, called inside a compact module: creates the sibling parameters
    ``{prefix}_norm.weight`` [D] and ``{prefix}_proj.weight`` [D] (the checkpoint's ``[1, D]`` projection,
    squeezed; prefix ``self_attention_res``, ``mlp_res`` or ``output_attn_res``) and mixes ``sources``
    [R, B, T, D] -> [B, T, D] (cfg.dtype)."""
    d = sources.shape[-1]
    pd = parent_cfg.param_dtype
    norm_w = Weight((d,), ("embed",), "ones", pd, name=f"{prefix}_norm")()
    proj_w = Weight((d,), ("embed",), "normal", pd, name=f"{prefix}_proj")()
    query = norm_w.astype(jnp.float32) * proj_w.astype(jnp.float32)
    return attn_res_mix(sources, n_valid, query, parent_cfg.rms_norm_eps, jnp.dtype(parent_cfg.dtype))
