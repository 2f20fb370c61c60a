"""MoonViT3d vision tower and the ``patchmergerv2`` projector, Flax linen.

Inputs are *packed*: ``pixel_values [Np, 3, P, P]`` holds the patches of every media item of the batch back
to back (NaViT style, no padding to a square), and a :class:`~k3_jax.vision.plan.MediaPlan` (host-side
indices from ``grid_thws``) says which item, grid position and frame each patch is. Attention never crosses
items. Output of :class:`MediaEncoder`: ``[Nt, text_hidden]``, the projected merged tokens of all items in
order, ready to replace the ``<|media_pad|>`` positions of the prompt.

Math (release ``modeling_kimi_k3.py``):

- patch embedding: a P×P stride-P conv without bias == ``flatten(patch) @ kernel [3*P*P, D]``; plus the
  learned ``pos_emb [PH, PW, D]`` bilinearly resized to the item's (h, w) (``align_corners=False``, no
  antialias; identity at 64×64), repeated over frames, plus a fixed sin-cos time embedding per frame when
  ``t > 1``;
- ``vt_num_hidden_layers`` pre-norm blocks ``x + wo(attn(norm0(x)))``, ``x + fc1(gelu_tanh(fc0(norm1(x))))``
  with a fused ``wqkv`` (q, k, v, then heads), 2-D RoPE on q and k, softmax in fp32, RMSNorm with the fp32
  machine epsilon (``nn.RMSNorm(eps=None)`` in torch 2.x uses the opmath type's epsilon); final RMSNorm;
- ``sd2_tpool`` merge: each kh×kw block of patches concatenated (row-major in the kernel), averaged over frames;
- projector: ``Linear(4D, 4D) -> GELU (exact) -> Linear(4D, text_hidden) -> RMSNorm(projector_ln_eps)``.

Parameter tree (names follow the checkpoint; ``blocks`` are scanned, leading axis = block)::

    vision_tower/patch_embed/proj/kernel        [3*P*P, D]     (HF proj.weight [D, 3, P, P])
    vision_tower/patch_embed/pos_emb/weight     [PH, PW, D]
    vision_tower/encoder/blocks/{wqkv,wo,mlp/fc0,mlp/fc1}/kernel   [L, in, out]
    vision_tower/encoder/blocks/{norm0,norm1}/weight               [L, D]
    vision_tower/encoder/final_layernorm/weight [D]
    mm_projector/proj_0/kernel [4D, 4D], mm_projector/proj_2/kernel [4D, TD], mm_projector/post_norm/weight [TD]

Logical axis names (``sharding/rules.py``): ``vision_embed`` (the tower width: FSDP-sharded in training, replicated
for serving); replicated everywhere: ``vision_mlp`` (MLP / attention / projector hidden widths), ``vision_in``
(flattened patch, merged token), ``vision_out`` (projector output = text width), ``vision_pos_h`` /
``vision_pos_w`` (the learned position grid). Never ``experts``.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.config import K3Config
from k3_jax.layers.common import logical, matmul_precision, param_dtype, rms_norm
from k3_jax.vision.attention import packed_attention
from k3_jax.vision.config import VisionConfig

#: ``nn.RMSNorm(dim)`` without eps in the release: torch uses the fp32 machine epsilon for fp32/bf16 inputs.
TOWER_NORM_EPS = float(np.finfo(np.float32).eps)


def _vcfg(cfg: K3Config) -> VisionConfig:
    if cfg.vision is None:
        raise ValueError("this config has no vision_config (cfg.vision is None): the vision tower needs one")
    return cfg.vision


def sincos_time_table(dim: int, frames: int) -> np.ndarray:
    """Fixed time embedding ``[frames, dim]`` f32: ``sin(t * w_i)`` then ``cos(t * w_i)``, ``w_i = 10000^(-2i/dim)``.

    Computed in fp32 numpy in the release's order of operations (so it is bit-identical to its buffer).
    """
    omega = np.arange(dim // 2, dtype=np.float32) / np.float32(dim / 2.0)
    omega = (1.0 / np.float32(10000) ** omega).astype(np.float32)
    pos = np.arange(frames, dtype=np.float32)
    out = np.einsum("m,d->md", pos, omega).astype(np.float32)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1).astype(np.float32)


def rope_2d(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """2-D RoPE on ``x [N, H, Dh]`` (consecutive channel pairs rotated), ``pos [N, 2]`` = (row, column).

    Pair ``2i`` turns by ``column * f_i``, pair ``2i + 1`` by ``row * f_i``, ``f_i = theta^(-4i/Dh)``,
    ``i < Dh/4``. Computed in fp32, returned in ``x.dtype``.
    """
    dh = x.shape[-1]
    freqs = 1.0 / (theta ** (jnp.arange(0, dh, 4, dtype=jnp.float32)[: dh // 4] / dh))  # [Dh/4]
    col = pos[:, 1:2].astype(jnp.float32) * freqs  # [N, Dh/4]
    row = pos[:, 0:1].astype(jnp.float32) * freqs
    ang = jnp.stack([col, row], axis=-1).reshape(pos.shape[0], 1, dh // 2)  # pair order: col, row, col, ...
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], dh // 2, 2)
    re, im = xf[..., 0], xf[..., 1]
    out = jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


class VLinear(nn.Module):
    """Bias-free ``y = x @ kernel`` (``kernel [in, out]`` with logical names), output in ``cfg.dtype``."""

    features: int
    names: tuple[str, str]
    cfg: K3Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        std = math.sqrt(2.0 / x.shape[-1])  # the release's trunc_normal(std=sqrt(2/in)) scale
        kernel = self.param("kernel", logical(nn.initializers.truncated_normal(std), self.names),
                            (x.shape[-1], self.features), param_dtype(self.cfg))
        dt = jnp.dtype(self.cfg.dtype)
        return jnp.matmul(x.astype(dt), kernel.astype(dt), precision=matmul_precision(self.cfg))


class VNorm(nn.Module):
    """RMSNorm (fp32 statistics) with a ``weight`` [D] initialised to ones."""

    eps: float
    names: tuple[str] = ("vision_embed",)
    cfg: K3Config | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        pd = jnp.float32 if self.cfg is None else param_dtype(self.cfg)
        w = self.param("weight", logical(nn.initializers.ones, self.names), (x.shape[-1],), pd)
        return rms_norm(x, w, self.eps)


class PatchEmbed(nn.Module):
    """``pixel_values [Np, 3, P, P]`` -> ``[Np, D]``: linear patch projection + resized position + time."""

    cfg: K3Config

    @nn.compact
    def __call__(self, pixel_values: jax.Array, plan: dict[str, jax.Array]) -> jax.Array:
        v = _vcfg(self.cfg)
        d, p = v.vt_hidden_size, v.patch_size
        if pixel_values.ndim != 4 or pixel_values.shape[1:] != (3, p, p):
            raise ValueError(f"pixel_values must be [N_patches, 3, {p}, {p}], got {pixel_values.shape}")
        dt = jnp.dtype(self.cfg.dtype)
        x = pixel_values.reshape(pixel_values.shape[0], 3 * p * p)
        x = VLinear(d, ("vision_in", "vision_embed"), self.cfg, name="proj")(x)
        grid = self.param("pos_emb", _pos_emb_init(self.cfg), v)["weight"]
        table = grid.reshape(-1, d).astype(jnp.float32)
        pos = jnp.einsum("nk,nkd->nd", plan["pos_weight"], jnp.take(table, plan["pos_index"], axis=0),
                         precision=jax.lax.Precision.HIGHEST)
        time = jnp.asarray(sincos_time_table(d, v.init_pos_emb_time))
        fi = plan["frame_index"]
        pos = pos + jnp.where((fi >= 0)[:, None], jnp.take(time, jnp.maximum(fi, 0), axis=0), 0.0)
        return (x.astype(jnp.float32) + pos).astype(dt)


def _pos_emb_init(cfg: K3Config):
    def init(key: jax.Array, v: VisionConfig) -> dict:
        shape = (v.init_pos_emb_height, v.init_pos_emb_width, v.vt_hidden_size)
        return {"weight": logical(nn.initializers.normal(1.0), ("vision_pos_h", "vision_pos_w", "vision_embed"))(
            key, shape, param_dtype(cfg))}

    return init


class EncoderBlock(nn.Module):
    """One pre-norm MoonViT block on the packed sequence ``x [Np, D]`` (a scan body: returns ``(x, None)``)."""

    cfg: K3Config

    @nn.compact
    def __call__(self, x: jax.Array, plan: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        v = _vcfg(self.cfg)
        h, dh = v.vt_num_attention_heads, v.head_dim
        n = x.shape[0]
        y = VNorm(TOWER_NORM_EPS, cfg=self.cfg, name="norm0")(x)
        qkv = VLinear(3 * v.qkv_hidden_size, ("vision_embed", "vision_mlp"), self.cfg, name="wqkv")(y)
        qkv = qkv.reshape(n, 3, h, dh)
        q = rope_2d(qkv[:, 0], plan["rope_pos"], v.rope_theta)
        k = rope_2d(qkv[:, 1], plan["rope_pos"], v.rope_theta)
        a = packed_attention(q, k, qkv[:, 2], plan["segment_ids"], plan["kv_start"], plan["q_offsets"],
                             plan["kv_offsets"], v.attention, self.cfg.platform)
        x = x + VLinear(v.vt_hidden_size, ("vision_mlp", "vision_embed"), self.cfg, name="wo")(a.reshape(n, h * dh))
        y = VNorm(TOWER_NORM_EPS, cfg=self.cfg, name="norm1")(x)
        y = _Mlp2(self.cfg, name="mlp")(y)
        return (x + y).astype(x.dtype), None


class _Mlp2(nn.Module):
    cfg: K3Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        v = _vcfg(self.cfg)
        y = VLinear(v.vt_intermediate_size, ("vision_embed", "vision_mlp"), self.cfg, name="fc0")(x)
        y = jax.nn.gelu(y.astype(jnp.float32), approximate=True).astype(y.dtype)
        return VLinear(v.vt_hidden_size, ("vision_mlp", "vision_embed"), self.cfg, name="fc1")(y)


class Encoder(nn.Module):
    """The scanned blocks + final norm: ``[Np, D] -> [Np, D]``."""

    cfg: K3Config

    @nn.compact
    def __call__(self, x: jax.Array, plan: dict[str, jax.Array]) -> jax.Array:
        v = _vcfg(self.cfg)
        block = EncoderBlock
        if self.cfg.remat != "none":
            policy = None if self.cfg.remat == "full" else jax.checkpoint_policies.checkpoint_dots
            block = nn.remat(EncoderBlock, policy=policy, prevent_cse=False)
        blocks = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast,),
            length=v.vt_num_hidden_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, _ = blocks(self.cfg, name="blocks")(x, plan)
        return VNorm(TOWER_NORM_EPS, cfg=self.cfg, name="final_layernorm")(x)


def tpool_merge(x: jax.Array, plan: dict[str, jax.Array]) -> jax.Array:
    """``sd2_tpool``: ``[Np, D] -> [Nt, K*D]``, sub-patches concatenated, frames averaged (fp32 sum)."""
    g = jnp.take(x, plan["merge_index"], axis=0).astype(jnp.float32)  # [Nt, K, F, D]
    m = jnp.einsum("nkfd,nf->nkd", g, plan["merge_weight"], precision=jax.lax.Precision.HIGHEST)
    return m.reshape(m.shape[0], -1).astype(x.dtype)


class MoonViT3d(nn.Module):
    """``(pixel_values [Np, 3, P, P], plan) -> merged tokens [Nt, kh*kw*D]`` (before the projector)."""

    cfg: K3Config

    @nn.compact
    def __call__(self, pixel_values: jax.Array, plan: dict[str, jax.Array]) -> jax.Array:
        x = PatchEmbed(self.cfg, name="patch_embed")(pixel_values, plan)
        x = Encoder(self.cfg, name="encoder")(x, plan)
        return tpool_merge(x, plan)


class PatchMergerMLPV2(nn.Module):
    """``[Nt, 4D] -> [Nt, text_hidden]``: Linear -> exact GELU -> Linear -> RMSNorm(projector_ln_eps)."""

    cfg: K3Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        v = _vcfg(self.cfg)
        y = VLinear(v.merged_size, ("vision_in", "vision_mlp"), self.cfg, name="proj_0")(x)
        y = jax.nn.gelu(y.astype(jnp.float32), approximate=False).astype(y.dtype)
        y = VLinear(v.text_hidden_size, ("vision_mlp", "vision_out"), self.cfg, name="proj_2")(y)
        return VNorm(v.projector_ln_eps, ("vision_out",), cfg=self.cfg, name="post_norm")(y)


class MediaEncoder(nn.Module):
    """Tower + projector under the checkpoint's names: ``vision_tower`` and ``mm_projector``.

    ``(pixel_values [Np, 3, P, P], plan arrays) -> [Nt, text_hidden]`` in ``cfg.dtype``.
    """

    cfg: K3Config

    @nn.compact
    def __call__(self, pixel_values: jax.Array, plan: dict[str, jax.Array]) -> jax.Array:
        merged = MoonViT3d(self.cfg, name="vision_tower")(pixel_values, plan)
        return PatchMergerMLPV2(self.cfg, name="mm_projector")(merged)
