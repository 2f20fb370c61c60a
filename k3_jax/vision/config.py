"""VisionConfig: the MoonViT3d tower + ``patchmergerv2`` projector, from the published ``vision_config``.

Only the variant the K3 release ships is implemented (``norm_type rmsnorm``, ``mlp_type mlp2``,
``pos_emb_type divided_fixed``, ``merge_type sd2_tpool``, ``mm_projector_type patchmergerv2``, no biases,
``gelu_pytorch_tanh`` in the tower and exact GELU in the projector); any other value raises
:class:`k3_jax.config.ConfigError` naming the key, instead of silently computing something else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from k3_jax.errors import ConfigError

#: ``vision_config`` keys whose value is fixed for the implemented variant (key -> the only accepted value).
_FIXED: dict[str, Any] = {
    "norm_type": "rmsnorm",
    "mlp_type": "mlp2",
    "pos_emb_type": "divided_fixed",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2",
    "activation_func": "gelu_pytorch_tanh",
    "projector_hidden_act": "gelu",
    "attn_bias": False,
    "linear_bias": False,
    "patch_embed_proj_bias": False,
    "pos_emb_interpolation_mode": "bilinear",
}


#: accepted ``VisionConfig.attention`` values: "auto" + the backends of ``k3_jax.vision.attention.VISION_ATTENTION``
ATTENTION_CHOICES = ("auto", "mosaic_tpu", "cudnn", "xla")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Architecture of the vision tower and projector (field names follow ``vision_config``)."""

    patch_size: int = 14
    init_pos_emb_height: int = 64
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4
    vt_hidden_size: int = 1024
    vt_intermediate_size: int = 4096
    vt_num_attention_heads: int = 12
    vt_num_hidden_layers: int = 27
    qkv_hidden_size: int = 1536
    merge_kernel_size: tuple[int, int] = (2, 2)
    mm_hidden_size: int = 1024
    text_hidden_size: int = 7168
    projector_ln_eps: float = 1e-5
    rope_max_height: int = 512  # Rope2DPosEmbRepeated(head_dim, 512, 512) in the release
    rope_max_width: int = 512
    rope_theta: float = 10000.0
    # runtime (not in the checkpoint): the tower's attention, "auto" or a backend of
    # k3_jax.vision.attention.VISION_ATTENTION (ATTENTION_CHOICES)
    attention: str = "auto"

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merged_size(self) -> int:
        """Width of one merged token (``mm_hidden_size * kh * kw``), the projector's input."""
        return self.mm_hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]

    def __post_init__(self) -> None:
        def check(cond: bool, key: str, expected: str, actual: Any) -> None:
            if not cond:
                raise ConfigError(f"config key 'vision_config.{key}': expected {expected}, got {actual!r}")

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int":
                check(isinstance(v, int) and v > 0, f.name, "a positive int", v)
        check(self.qkv_hidden_size % self.vt_num_attention_heads == 0, "qkv_hidden_size",
              f"a multiple of vt_num_attention_heads={self.vt_num_attention_heads}", self.qkv_hidden_size)
        check(self.head_dim % 4 == 0, "qkv_hidden_size", "heads of a width divisible by 4 (2-D RoPE)",
              self.qkv_hidden_size)
        check(self.vt_hidden_size % 2 == 0, "vt_hidden_size", "even (sin-cos time embedding)",
              self.vt_hidden_size)
        check(len(self.merge_kernel_size) == 2 and all(isinstance(k, int) and k > 0 for k in self.merge_kernel_size),
              "merge_kernel_size", "two positive ints", self.merge_kernel_size)
        check(self.mm_hidden_size == self.vt_hidden_size, "mm_hidden_size",
              f"== vt_hidden_size ({self.vt_hidden_size})", self.mm_hidden_size)
        check(self.projector_ln_eps > 0, "projector_ln_eps", "> 0", self.projector_ln_eps)
        check(self.attention in ATTENTION_CHOICES, "attention", f"one of {ATTENTION_CHOICES}", self.attention)

    def to_hf_dict(self) -> dict[str, Any]:
        """The published ``vision_config`` block."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                               if not f.name.startswith("rope_") and f.name != "attention"}
        out["merge_kernel_size"] = list(self.merge_kernel_size)
        out.update(_FIXED)
        return out


def vision_config_from_dict(raw: Mapping[str, Any]) -> VisionConfig:
    """Parse the published ``vision_config`` block; unknown keys are ignored (``_attn_implementation`` …)."""
    for key, expected in _FIXED.items():
        if key in raw and raw[key] != expected:
            raise ConfigError(f"config key 'vision_config.{key}': expected {expected!r} (the variant K3 ships), "
                              f"got {raw[key]!r}")
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(VisionConfig):
        if f.name in raw and f.name != "attention":
            v = raw[f.name]
            kw[f.name] = tuple(v) if f.name == "merge_kernel_size" else v
    if "mm_hidden_size" not in kw and "vt_hidden_size" in kw:
        kw["mm_hidden_size"] = kw["vt_hidden_size"]
    return VisionConfig(**kw)


def count_vision_params(v: VisionConfig) -> dict[str, int]:
    """Analytic parameter counts: ``tower`` (MoonViT3d), ``projector`` (PatchMergerMLPV2) and ``total``."""
    d, i, q, p = v.vt_hidden_size, v.vt_intermediate_size, v.qkv_hidden_size, v.patch_size
    block = d * 3 * q + q * d + d * i + i * d + 2 * d
    tower = (3 * p * p * d + v.init_pos_emb_height * v.init_pos_emb_width * d
             + v.vt_num_hidden_layers * block + d)
    m = v.merged_size
    projector = m * m + m * v.text_hidden_size + v.text_hidden_size
    return {"tower": tower, "projector": projector, "total": tower + projector}
