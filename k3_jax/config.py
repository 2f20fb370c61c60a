"""K3Config: the architecture of a Kimi K3 text model, loaded from the published ``config.json`` format.

The published file nests the text model under ``text_config`` (top level ``model_type: kimi_k3``) and lists
KDA / MLA layers **1-based** in ``linear_attn_config``. :func:`load_config` converts those lists to 0-based
once; everything else in k3-jax uses 0-based layer indices.

Runtime knobs (compute dtype, scan, remat, kernel choice) live beside the architecture in the same frozen
dataclass so a module needs only one hashable config object; change them with :meth:`K3Config.replace`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from k3_jax.vision.config import VisionConfig, vision_config_from_dict

MixerKind = Literal["kda", "mla"]
FfnKind = Literal["dense", "moe"]


class ConfigError(ValueError):
    """A config file or value is invalid; the message names the key, the expected and the actual value."""


@dataclasses.dataclass(frozen=True)
class K3Config:
    """Architecture + runtime options of a K3 text model (all layer indices 0-based)."""

    # --- vocabulary / width / depth
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    # --- MLA (gated, NoPE)
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # --- KDA
    kda_num_heads: int
    kda_head_dim: int
    kda_layers: tuple[int, ...]
    mla_layers: tuple[int, ...]
    short_conv_kernel_size: int = 4
    gate_lower_bound: float = -5.0
    # --- FFN / LatentMoE
    intermediate_size: int = 0
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_experts: int = 0
    num_experts_per_token: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    routed_expert_hidden_size: int = 0
    latent_moe_use_norm: bool = True
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # --- residuals / norms
    attn_res_block_size: int = 12
    rms_norm_eps: float = 1e-5
    mla_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm use KimiRMSNorm's default (spec a.1, d.5)
    # --- misc architecture
    max_position_embeddings: int = 1 << 20
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    expert_format: Literal["bf16", "mxfp4"] = "bf16"  # how routed-expert weights are held as parameters
    # --- vision (the published top-level vision_config / media_placeholder_token_id; None = text only)
    vision: VisionConfig | None = None
    media_placeholder_token_id: int | None = None
    # --- runtime (not part of the checkpoint)
    dtype: str = "bfloat16"  # activation / matmul compute dtype
    param_dtype: str = "float32"  # dtype of non-fp32-by-spec parameters at init
    remat: Literal["none", "full", "dots"] = "none"
    kda_chunk_size: int = 64
    kda_implementation: str = "auto"
    moe_implementation: str = "auto"
    # MLA attention without a cache (training, prefill from scratch): "auto" = cuDNN flash attention on a
    # Hopper+ GPU (bf16, T <= 16384 with segment ids), the blocked XLA path elsewhere; "xla" / "cudnn" force
    # one (k3_jax/layers/flash_attention.py)
    mla_attention_implementation: str = "auto"

    # ----------------------------------------------------------------- derived
    @property
    def kda_proj_size(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_attn_res_blocks(self) -> int:
        """Number of AttnRes blocks (the last may be partial)."""
        return -(-self.num_hidden_layers // self.attn_res_block_size)

    def mixer_kind(self, layer: int) -> MixerKind:
        return "kda" if layer in self.kda_layers else "mla"

    def ffn_kind(self, layer: int) -> FfnKind:
        is_moe = (
            self.num_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )
        return "moe" if is_moe else "dense"

    def layer_kinds(self) -> tuple[tuple[MixerKind, FfnKind], ...]:
        return tuple((self.mixer_kind(i), self.ffn_kind(i)) for i in range(self.num_hidden_layers))

    def replace(self, **changes: Any) -> K3Config:
        """A copy with ``changes`` applied and validated."""
        return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        _validate(self)

    # ------------------------------------------------------------ HF round trip
    def to_hf_dict(self) -> dict[str, Any]:
        """The published ``config.json`` layout (top level ``kimi_k3`` + ``text_config``), 1-based lists."""
        text: dict[str, Any] = {
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "mla_use_output_gate": True,
            "linear_attn_config": {
                "num_heads": self.kda_num_heads,
                "head_dim": self.kda_head_dim,
                "short_conv_kernel_size": self.short_conv_kernel_size,
                "kda_layers": [i + 1 for i in self.kda_layers],
                "full_attn_layers": [i + 1 for i in self.mla_layers],
                "use_full_rank_gate": True,
                "gate_lower_bound": self.gate_lower_bound,
            },
            "intermediate_size": self.intermediate_size,
            "first_k_dense_replace": self.first_k_dense_replace,
            "moe_layer_freq": self.moe_layer_freq,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
            "latent_moe_use_norm": self.latent_moe_use_norm,
            "moe_router_activation_func": "sigmoid",
            "topk_method": "noaux_tc",
            "use_grouped_topk": True,
            "num_expert_group": 1,
            "topk_group": 1,
            "moe_renormalize": self.moe_renormalize,
            "routed_scaling_factor": self.routed_scaling_factor,
            "hidden_act": "situ",
            "activation_situ_beta": self.situ_beta,
            "activation_situ_linear_beta": self.situ_linear_beta,
            "attn_res_block_size": self.attn_res_block_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": "bfloat16",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.expert_format == "mxfp4":
            text["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
        out = {
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
        }
        if self.vision is not None:
            out["vision_config"] = self.vision.to_hf_dict()
        if self.media_placeholder_token_id is not None:
            out["media_placeholder_token_id"] = self.media_placeholder_token_id
        return out


MXFP4_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "group_size": 32,
                "strategy": "group",
                "symmetric": True,
                "dynamic": False,
                "observer": "minmax",
                "scale_dtype": "torch.uint8",
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
}


# ---------------------------------------------------------------------------- validation
def _check(cond: bool, key: str, expected: str, actual: Any) -> None:
    if not cond:
        raise ConfigError(f"config key {key!r}: expected {expected}, got {actual!r}")


def _validate(c: K3Config) -> None:
    positive = [
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
        "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim",
        "short_conv_kernel_size", "attn_res_block_size", "kda_chunk_size",
    ]
    for key in positive:
        _check(isinstance(getattr(c, key), int) and getattr(c, key) > 0, key, "a positive int", getattr(c, key))
    _check(c.qk_rope_head_dim >= 0, "qk_rope_head_dim", ">= 0", c.qk_rope_head_dim)
    n = c.num_hidden_layers
    kda, mla = set(c.kda_layers), set(c.mla_layers)
    _check(not (kda & mla), "linear_attn_config.kda_layers/full_attn_layers", "disjoint lists",
           sorted(kda & mla))
    _check(kda | mla == set(range(n)), "linear_attn_config.kda_layers/full_attn_layers",
           f"together exactly the layers 1..{n} (1-based)", sorted(i + 1 for i in kda | mla))
    _check(c.gate_lower_bound < 0, "linear_attn_config.gate_lower_bound", "< 0", c.gate_lower_bound)
    _check(c.rms_norm_eps > 0, "rms_norm_eps", "> 0", c.rms_norm_eps)
    _check(c.moe_layer_freq >= 1, "moe_layer_freq", ">= 1", c.moe_layer_freq)
    has_dense = any(c.ffn_kind(i) == "dense" for i in range(n))
    if has_dense:
        _check(c.intermediate_size > 0, "intermediate_size", "> 0 (a dense MLP layer exists)",
               c.intermediate_size)
    if c.num_experts > 0:
        _check(0 < c.num_experts_per_token <= c.num_experts, "num_experts_per_token",
               f"in 1..num_experts={c.num_experts}", c.num_experts_per_token)
        _check(c.moe_intermediate_size > 0, "moe_intermediate_size", "> 0", c.moe_intermediate_size)
        _check(c.routed_expert_hidden_size > 0, "routed_expert_hidden_size",
               "> 0 (Stable LatentMoE needs a latent width)", c.routed_expert_hidden_size)
        _check(c.num_shared_experts >= 0, "num_shared_experts", ">= 0", c.num_shared_experts)
    _check(c.expert_format in ("bf16", "mxfp4"), "expert_format", "'bf16' or 'mxfp4'", c.expert_format)
    if c.expert_format == "mxfp4":
        for key in ("routed_expert_hidden_size", "moe_intermediate_size"):
            _check(getattr(c, key) % 32 == 0, key, "a multiple of 32 for MXFP4 experts", getattr(c, key))
    _check(c.remat in ("none", "full", "dots"), "remat", "'none', 'full' or 'dots'", c.remat)
    _check(c.mla_attention_implementation in ("auto", "xla", "cudnn"), "mla_attention_implementation",
           "'auto', 'xla' or 'cudnn'", c.mla_attention_implementation)
    for key in ("dtype", "param_dtype"):
        _check(getattr(c, key) in ("float32", "bfloat16", "float16"), key,
               "'float32', 'bfloat16' or 'float16'", getattr(c, key))


# ---------------------------------------------------------------------------- loading
def _require(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"config key {where}{key!r} is missing")
    return d[key]


def config_from_dict(raw: Mapping[str, Any], **overrides: Any) -> K3Config:
    """Build a K3Config from the published layout (``{"text_config": {...}}``) or a bare text config.

    ``overrides`` set runtime fields (``dtype``, ``scan_layers`` …) or architecture fields after loading.
    """
    text = raw.get("text_config", raw)
    where = "text_config." if "text_config" in raw else ""
    lin = _require(text, "linear_attn_config", where)
    lwhere = f"{where}linear_attn_config."
    n = int(_require(text, "num_hidden_layers", where))

    def zero_based(key: str) -> tuple[int, ...]:
        vals = _require(lin, key, lwhere)
        if not isinstance(vals, list | tuple) or not all(isinstance(v, int) for v in vals):
            raise ConfigError(f"config key {lwhere}{key!r}: expected a list of ints, got {vals!r}")
        bad = [v for v in vals if not 1 <= v <= n]
        if bad:
            raise ConfigError(f"config key {lwhere}{key!r}: expected 1-based layer numbers in 1..{n}, got {bad}")
        return tuple(sorted(v - 1 for v in vals))

    n_heads = int(_require(text, "num_attention_heads", where))
    n_kv = int(text.get("num_key_value_heads", n_heads))
    if n_kv != n_heads:
        raise ConfigError(f"config key {where}'num_key_value_heads': expected == num_attention_heads "
                          f"({n_heads}) for MLA, got {n_kv}")
    if not lin.get("use_full_rank_gate", True):
        raise ConfigError(f"config key {lwhere}'use_full_rank_gate': expected true (K3), got false; "
                          "the low-rank Kimi-Linear gate is not supported by the model")
    if text.get("hidden_act", "situ") != "situ":
        raise ConfigError(f"config key {where}'hidden_act': expected 'situ', got {text.get('hidden_act')!r}")
    if text.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"config key {where}'moe_router_activation_func': expected 'sigmoid', "
                          f"got {text.get('moe_router_activation_func')!r}")
    qc = text.get("quantization_config")
    expert_format = "bf16"
    if qc:
        fmt = qc.get("format")
        if fmt != "mxfp4-pack-quantized":
            raise ConfigError(f"config key {where}'quantization_config.format': expected "
                              f"'mxfp4-pack-quantized', got {fmt!r}")
        expert_format = "mxfp4"

    def top(key: str) -> Any:
        return text.get(key, raw.get(key))

    fields: dict[str, Any] = dict(
        vocab_size=int(_require(text, "vocab_size", where)),
        hidden_size=int(_require(text, "hidden_size", where)),
        num_hidden_layers=n,
        num_attention_heads=n_heads,
        q_lora_rank=int(_require(text, "q_lora_rank", where)),
        kv_lora_rank=int(_require(text, "kv_lora_rank", where)),
        qk_nope_head_dim=int(_require(text, "qk_nope_head_dim", where)),
        qk_rope_head_dim=int(_require(text, "qk_rope_head_dim", where)),
        v_head_dim=int(_require(text, "v_head_dim", where)),
        kda_num_heads=int(_require(lin, "num_heads", lwhere)),
        kda_head_dim=int(_require(lin, "head_dim", lwhere)),
        kda_layers=zero_based("kda_layers"),
        mla_layers=zero_based("full_attn_layers"),
        short_conv_kernel_size=int(lin.get("short_conv_kernel_size", 4)),
        gate_lower_bound=float(lin.get("gate_lower_bound", -5.0)),
        intermediate_size=int(text.get("intermediate_size", 0)),
        first_k_dense_replace=int(text.get("first_k_dense_replace", 1)),
        moe_layer_freq=int(text.get("moe_layer_freq", 1)),
        num_experts=int(text.get("num_experts", 0) or 0),
        num_experts_per_token=int(text.get("num_experts_per_token", 0) or 0),
        num_shared_experts=int(text.get("num_shared_experts", 0) or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0),
        routed_expert_hidden_size=int(text.get("routed_expert_hidden_size", 0) or 0),
        latent_moe_use_norm=bool(text.get("latent_moe_use_norm", True)),
        moe_renormalize=bool(text.get("moe_renormalize", True)),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        situ_beta=float(text.get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(text.get("activation_situ_linear_beta", 25.0)),
        attn_res_block_size=int(_require(text, "attn_res_block_size", where)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(text.get("max_position_embeddings", 1 << 20)),
        num_nextn_predict_layers=int(text.get("num_nextn_predict_layers", 0) or 0),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        bos_token_id=top("bos_token_id"),
        eos_token_id=top("eos_token_id"),
        pad_token_id=top("pad_token_id"),
        expert_format=expert_format,
        vision=vision_config_from_dict(raw["vision_config"]) if raw.get("vision_config") else None,
        media_placeholder_token_id=raw.get("media_placeholder_token_id"),
    )
    runtime = raw.get("k3_jax", {})  # optional block of runtime defaults in our own configs
    fields.update(runtime)
    fields.update(overrides)
    known = {f.name for f in dataclasses.fields(K3Config)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(f"config keys {unknown} are not K3Config fields")
    return K3Config(**fields)


def load_config(path: str | os.PathLike[str], **overrides: Any) -> K3Config:
    """Load ``configs/*.json`` or a checkpoint's published ``config.json`` (a directory is accepted too)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path) and not os.path.isabs(path):
        # "configs/k3-tiny.json" or "k3-tiny" from any working directory: the repository's configs/
        repo_configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
        for candidate in (os.path.join(repo_configs, os.path.basename(path)),
                          os.path.join(repo_configs, f"{path}.json")):
            if os.path.exists(candidate):
                path = candidate
                break
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid JSON: {e}") from None
    try:
        return config_from_dict(raw, **overrides)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def config_path(name: str) -> str:
    """Path of a bundled config by short name (``"k3"``, ``"k3-tiny"``, ``"k3-small"``) or a file path."""
    if os.path.exists(name):
        return name
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    candidates = [os.path.join(here, f"{name}.json"), os.path.join(os.path.dirname(__file__), "data",
                                                                   "configs", f"{name}.json")]
    for c in candidates:
        if os.path.exists(c):
            return c
    raise ConfigError(f"no config named {name!r} (looked for {candidates})")


# ---------------------------------------------------------------------------- parameter count
def _mixer_params(c: K3Config, kind: MixerKind) -> int:
    d = c.hidden_size
    if kind == "kda":
        hk, h, dk, w = c.kda_proj_size, c.kda_num_heads, c.kda_head_dim, c.short_conv_kernel_size
        return (3 * d * hk + 3 * hk * w + d * dk + dk * hk + d * h + hk + h + d * hk + dk + hk * d)
    h = c.num_attention_heads
    return (d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * c.q_head_dim
            + d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
            + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim)
            + d * h * c.v_head_dim + h * c.v_head_dim * d)


def _ffn_params(c: K3Config, kind: FfnKind) -> tuple[int, int]:
    """(total, routed-experts-not-active) parameters of one FFN."""
    d = c.hidden_size
    if kind == "dense":
        return 3 * d * c.intermediate_size, 0
    e, lat, im = c.num_experts, c.routed_expert_hidden_size, c.moe_intermediate_size
    per_expert = 3 * lat * im
    total = (d * e + e + 2 * d * lat + lat + 3 * d * c.num_shared_experts * im + e * per_expert)
    return total, (e - c.num_experts_per_token) * per_expert


def count_params(c: K3Config) -> dict[str, int]:
    """Analytic parameter counts: ``total`` and per-token ``active`` (embedding excluded, only top-k experts).

    Counts the parameters k3-jax holds (A_log per head, not the checkpoint's zero padding).
    """
    d = c.hidden_size
    total = 2 * c.vocab_size * d if not c.tie_word_embeddings else c.vocab_size * d
    total += 3 * d  # final norm + output AttnRes norm/proj
    inactive = c.vocab_size * d  # the embedding lookup is not a matmul
    for i in range(c.num_hidden_layers):
        total += 6 * d  # 4 norms + 2 AttnRes projections
        total += _mixer_params(c, c.mixer_kind(i))
        ffn_total, ffn_inactive = _ffn_params(c, c.ffn_kind(i))
        total += ffn_total
        inactive += ffn_inactive
    if c.tie_word_embeddings:
        inactive -= 0  # lm_head reuses the embedding and is active
    return {"total": total, "active": total - inactive}
