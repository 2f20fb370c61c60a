"""K3Config: the architecture of a Kimi K3 text model, loaded from the published ``config.json`` format.

The published file nests the text model under ``text_config`` (top level ``model_type: kimi_k3``) and lists
KDA / MLA layers **1-based** in ``linear_attn_config``. :func:`load_config` converts those lists to 0-based
once; everything else in k3-jax uses 0-based layer indices.

Runtime knobs (compute dtype, scan, remat, kernel choice) live beside the architecture in the same frozen
dataclass so a module needs only one hashable config object; change them with :meth:`K3Config.replace`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import numbers
import os
import types
import typing
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from k3_jax.errors import ConfigError
from k3_jax.vision.config import VisionConfig, vision_config_from_dict

MixerKind = Literal["kda", "mla"]
FfnKind = Literal["dense", "moe"]


class ConfigWarning(UserWarning):
    """A config file holds keys k3-jax does not know (they are ignored); the message lists them."""


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
    mla_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm KimiRMSNorm's default (the release passes no eps)
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
    param_dtype: str = "float32"  # dtype at init of the parameters the release does not store in fp32
    remat: Literal["none", "full", "dots"] = "none"
    # "mxfp4": the release's quantisation boundary in the routed experts: MXFP4 weights (bf16/f32 masters are
    # fake-quantised per 32 along the input dim, straight-through gradients; packed weights as they are) and
    # MXFP8 inputs (E4M3, per 32) to every expert matmul. Attention, shared experts, router, latent projections
    # stay high precision. "none": experts run on their weights as held.
    qat: Literal["none", "mxfp4"] = "none"
    kda_chunk_size: int = 64
    # Kernel choices: "auto" (the first backend of the op's registry that supports the call; logged) or a backend
    # name, which raises with the reason when it cannot run. `python -m k3_jax.kernels CONFIG` explains them.
    # KDA, one field per op: the chunked form (training, prefill): pallas_kernels.kda.ops.CHUNK; the one-token
    # decode step on the state pool: kda.ops.DECODE; the speculative verify pass (T tokens, every state kept):
    # kda.verify.VERIFY
    kda_implementation: str = "auto"  # mosaic_tpu | mosaic_gpu | triton | xla
    kda_decode_implementation: str = "auto"  # mosaic_tpu | triton | mosaic_gpu | xla
    kda_verify_implementation: str = "auto"  # mosaic_tpu | triton | xla
    moe_implementation: str = "auto"  # pallas_kernels.moe.ops.EXPERT_FFN: mosaic_tpu | triton | mosaic_gpu | xla
    # expert parallelism over the `expert` mesh axis: "auto" = "allgather" when that axis has size > 1 and the
    # expert FFN is not explicitly "xla" (then XLA partitions the pure-JAX MoE), "none" otherwise
    moe_expert_parallel: str = "auto"  # auto | none | allgather | all_to_all
    # MLA attention without a cache (training, prefill from scratch): pallas_kernels.attention.ATTENTION
    mla_attention_implementation: str = "auto"  # cudnn | xla
    # MLA attention of a prefill chunk (>= 256 queries) against a cached prefix:
    # pallas_kernels.prefix_attention.PREFIX_ATTENTION (cudnn = expanded form, xla = absorbed form)
    mla_prefix_attention_implementation: str = "auto"  # cudnn | xla
    # MLA attention of the decode step over the contiguous latent cache: pallas_kernels.mla_decode.DECODE
    mla_decode_attention_implementation: str = "auto"  # mosaic_tpu | mosaic_gpu | xla
    # MLA attention of the decode step over a paged latent cache (the server's): pallas_kernels.paged_latent_attention
    # .PAGED_DECODE
    mla_paged_decode_implementation: str = "auto"  # mosaic_tpu | triton | mosaic_gpu | xla
    # where the kernels will run: "auto" = the active mesh's devices, else the default device; set it to lower
    # for another platform without a mesh of its devices (ahead-of-time compiles)
    platform: str = "auto"  # auto | cpu | gpu | tpu

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
        """A copy with ``changes`` applied and validated; :class:`ConfigError` naming keys that are not fields."""
        unknown = unknown_fields(changes)
        if unknown:
            raise ConfigError(f"config keys {unknown} are not K3Config fields")
        return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        _check_field_types(self)
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


def _validate_kernel_choices(c: K3Config) -> None:
    """The kernel fields name backends of their registries (imported here: the registries import jax)."""
    from pallas_kernels.attention import ATTENTION  # noqa: PLC0415
    from pallas_kernels.kda.ops import CHUNK  # noqa: PLC0415
    from pallas_kernels.kda.ops import DECODE as KDA_DECODE  # noqa: PLC0415
    from pallas_kernels.kda.verify import VERIFY  # noqa: PLC0415
    from pallas_kernels.mla_decode import DECODE as MLA_DECODE  # noqa: PLC0415
    from pallas_kernels.moe.ops import EXPERT_FFN  # noqa: PLC0415
    from pallas_kernels.paged_latent_attention import PAGED_DECODE  # noqa: PLC0415
    from pallas_kernels.prefix_attention import PREFIX_ATTENTION  # noqa: PLC0415

    for key, reg in (("kda_implementation", CHUNK), ("kda_decode_implementation", KDA_DECODE),
                     ("kda_verify_implementation", VERIFY), ("moe_implementation", EXPERT_FFN),
                     ("mla_attention_implementation", ATTENTION),
                     ("mla_prefix_attention_implementation", PREFIX_ATTENTION),
                     ("mla_decode_attention_implementation", MLA_DECODE),
                     ("mla_paged_decode_implementation", PAGED_DECODE)):
        _check(getattr(c, key) in reg.choices, key, f"one of {reg.choices}", getattr(c, key))
    _check(c.moe_expert_parallel in EXPERT_PARALLEL, "moe_expert_parallel", f"one of {EXPERT_PARALLEL}",
           c.moe_expert_parallel)
    _check(c.platform in ("auto", "cpu", "gpu", "tpu"), "platform", "one of ('auto', 'cpu', 'gpu', 'tpu')",
           c.platform)


EXPERT_PARALLEL = ("auto", "none", "allgather", "all_to_all")


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
    _check(c.qat in ("none", "mxfp4"), "qat", "'none' or 'mxfp4'", c.qat)
    if c.qat == "mxfp4":
        for key in ("routed_expert_hidden_size", "moe_intermediate_size"):
            _check(getattr(c, key) % 32 == 0, key, "a multiple of 32 for qat='mxfp4'", getattr(c, key))
    _validate_kernel_choices(c)
    for key in ("dtype", "param_dtype"):
        _check(getattr(c, key) in ("float32", "bfloat16", "float16"), key,
               "'float32', 'bfloat16' or 'float16'", getattr(c, key))


@functools.cache
def _field_hints() -> dict[str, Any]:
    return typing.get_type_hints(K3Config)


def _type_matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return isinstance(value, str)  # the allowed values are checked by _validate
    if origin in (typing.Union, types.UnionType):
        return any(_type_matches(value, arg) for arg in typing.get_args(hint))
    if origin is tuple:
        return isinstance(value, tuple) and all(_type_matches(v, typing.get_args(hint)[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "a string"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(hint)[0])}s"
    return {type(None): "null", bool: "true/false", int: "an int", float: "a number", str: "a string"}.get(
        hint, str(hint))


def _check_field_types(c: K3Config) -> None:
    """Every field holds its annotated type (lists for tuple fields become tuples, so the config hashes)."""
    for name, hint in _field_hints().items():
        value = getattr(c, name)
        if typing.get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)
            object.__setattr__(c, name, value)
        _check(_type_matches(value, hint), name, _describe(hint), value)


# ---------------------------------------------------------------------------- loading
def _require(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"config key {where}{key!r} is missing")
    return d[key]


_MISSING = object()


def _typed(d: Mapping[str, Any], key: str, where: str, kind: type, default: Any = _MISSING) -> Any:
    """``d[key]`` as ``kind`` (int, float or bool); missing (or null, when a default is given) -> ``default``.

    A value of another type raises :class:`ConfigError` naming the key, the expected type and the value
    (an integral float such as ``256.0`` counts as an int; strings are never converted).
    """
    if key not in d or (d[key] is None and default is not _MISSING):
        if default is _MISSING:
            raise ConfigError(f"config key {where}{key!r} is missing")
        return default
    value = d[key]
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        expected = {bool: "true/false", int: "an int", float: "a number"}[kind]
        raise ConfigError(f"config key {where}{key!r}: expected {expected}, got {value!r}")
    return kind(value)


# keys of the published config.json (and of transformers' PretrainedConfig) that k3-jax reads nowhere: known, so
# they do not warn. Keys in none of these sets and not read by config_from_dict warn as unknown.
_HF_GENERIC_KEYS = frozenset({
    "_name_or_path", "add_cross_attention", "architectures", "auto_map", "bad_words_ids",
    "begin_suppress_tokens", "chunk_size_feed_forward", "cross_attention_hidden_size", "decoder_start_token_id",
    "diversity_penalty", "do_sample", "dtype", "early_stopping", "encoder_no_repeat_ngram_size",
    "exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id", "forced_eos_token_id",
    "id2label", "initializer_range", "is_decoder", "is_encoder_decoder", "label2id", "length_penalty",
    "max_length", "min_length", "model_type", "no_repeat_ngram_size", "num_beam_groups", "num_beams",
    "num_return_sequences", "output_attentions", "output_hidden_states", "output_scores", "prefix",
    "problem_type", "pruned_heads", "remove_invalid_values", "repetition_penalty", "return_dict",
    "return_dict_in_generate", "sep_token_id", "suppress_tokens", "task_specific_params", "temperature",
    "tf_legacy_loss", "tie_encoder_decoder", "tokenizer_class", "top_k", "top_p", "torch_dtype", "torchscript",
    "transformers_version", "typical_p", "use_bfloat16", "use_cache",
})
_TEXT_KEYS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_nope", "mla_use_output_gate",
    "linear_attn_config", "intermediate_size", "first_k_dense_replace", "moe_layer_freq", "num_experts",
    "num_experts_per_token", "num_shared_experts", "moe_intermediate_size", "routed_expert_hidden_size",
    "latent_moe_use_norm", "moe_router_activation_func", "topk_method", "use_grouped_topk", "num_expert_group",
    "topk_group", "moe_renormalize", "routed_scaling_factor", "hidden_act", "activation_situ_beta",
    "activation_situ_linear_beta", "attn_res_block_size", "rms_norm_eps", "max_position_embeddings",
    "num_nextn_predict_layers", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    "quantization_config",
}) | _HF_GENERIC_KEYS
_LINEAR_ATTN_KEYS = frozenset({"num_heads", "head_dim", "short_conv_kernel_size", "kda_layers", "full_attn_layers",
                               "use_full_rank_gate", "gate_lower_bound"})
_TOP_KEYS = frozenset({"text_config", "vision_config", "k3_jax", "bos_token_id", "eos_token_id", "pad_token_id",
                       "tie_word_embeddings", "ignore_index", "image_placeholder", "media_placeholder_token_id",
                       }) | _HF_GENERIC_KEYS


def unknown_keys(raw: Mapping[str, Any]) -> list[str]:
    """Dotted names of the keys of a config dict that k3-jax neither reads nor knows to ignore."""
    text = raw.get("text_config", raw)
    where = "text_config." if "text_config" in raw else ""
    found = [f"{where}{k}" for k in text if k not in _TEXT_KEYS and not (text is raw and k in _TOP_KEYS)]
    if text is not raw:
        found += [k for k in raw if k not in _TOP_KEYS]
    lin = text.get("linear_attn_config")
    if isinstance(lin, Mapping):
        found += [f"{where}linear_attn_config.{k}" for k in lin if k not in _LINEAR_ATTN_KEYS]
    return sorted(found)


def _warn_unknown(raw: Mapping[str, Any], source: str | None) -> None:
    unknown = unknown_keys(raw)
    if unknown:
        prefix = f"{source}: " if source else ""
        warnings.warn(f"{prefix}config keys unknown to k3-jax, ignored: {', '.join(unknown)}", ConfigWarning,
                      stacklevel=4)


def unknown_fields(keys: Iterable[str]) -> list[str]:
    """The sorted ``keys`` that are not :class:`K3Config` fields."""
    return sorted(set(keys) - {f.name for f in dataclasses.fields(K3Config)})


def parse_overrides(items: Iterable[str], flag: str = "--set") -> dict[str, Any]:
    """Command-line ``KEY=VALUE`` items -> config overrides: each value as JSON where it parses (``1e-3``,
    ``[0, 2]`` as a tuple), else the text itself (``triton``). :class:`ConfigError` naming an item without ``=``
    or with an empty key. Whether the keys are fields is checked where they are applied."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} expects KEY=VALUE, got {item!r}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        out[key.strip()] = tuple(value) if isinstance(value, list) else value
    return out


def config_from_dict(raw: Mapping[str, Any], **overrides: Any) -> K3Config:
    """Build a K3Config from the published layout (``{"text_config": {...}}``) or a bare text config.

    ``overrides`` set runtime fields (``dtype``, ``remat`` …) or architecture fields after loading.
    A wrongly typed value raises :class:`ConfigError` naming the key; keys k3-jax does not know are ignored
    with one :class:`ConfigWarning` listing them (the published file's unused keys are known and do not warn).
    """
    return _from_dict(raw, None, overrides)


def _from_dict(raw: Mapping[str, Any], source: str | None, overrides: Mapping[str, Any]) -> K3Config:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config: expected a JSON object, got {type(raw).__name__}")
    text = raw.get("text_config", raw)
    where = "text_config." if "text_config" in raw else ""
    lin = _require(text, "linear_attn_config", where)
    lwhere = f"{where}linear_attn_config."
    if not isinstance(lin, Mapping):
        raise ConfigError(f"config key {where}'linear_attn_config': expected an object, got {lin!r}")
    n = _typed(text, "num_hidden_layers", where, int)

    def zero_based(key: str) -> tuple[int, ...]:
        vals = _require(lin, key, lwhere)
        if not isinstance(vals, list | tuple) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                          for v in vals):
            raise ConfigError(f"config key {lwhere}{key!r}: expected a list of ints, got {vals!r}")
        bad = [v for v in vals if not 1 <= v <= n]
        if bad:
            raise ConfigError(f"config key {lwhere}{key!r}: expected 1-based layer numbers in 1..{n}, got {bad}")
        return tuple(sorted(v - 1 for v in vals))

    n_heads = _typed(text, "num_attention_heads", where, int)
    n_kv = _typed(text, "num_key_value_heads", where, int, n_heads)
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
        if not isinstance(qc, Mapping):
            raise ConfigError(f"config key {where}'quantization_config': expected an object, got {qc!r}")
        fmt = qc.get("format")
        if fmt != "mxfp4-pack-quantized":
            raise ConfigError(f"config key {where}'quantization_config.format': expected "
                              f"'mxfp4-pack-quantized', got {fmt!r}")
        expert_format = "mxfp4"

    def top(key: str) -> int | None:
        d = text if key in text else raw
        return _typed(d, key, where if d is text else "", int, None)

    fields: dict[str, Any] = dict(
        vocab_size=_typed(text, "vocab_size", where, int),
        hidden_size=_typed(text, "hidden_size", where, int),
        num_hidden_layers=n,
        num_attention_heads=n_heads,
        q_lora_rank=_typed(text, "q_lora_rank", where, int),
        kv_lora_rank=_typed(text, "kv_lora_rank", where, int),
        qk_nope_head_dim=_typed(text, "qk_nope_head_dim", where, int),
        qk_rope_head_dim=_typed(text, "qk_rope_head_dim", where, int),
        v_head_dim=_typed(text, "v_head_dim", where, int),
        kda_num_heads=_typed(lin, "num_heads", lwhere, int),
        kda_head_dim=_typed(lin, "head_dim", lwhere, int),
        kda_layers=zero_based("kda_layers"),
        mla_layers=zero_based("full_attn_layers"),
        short_conv_kernel_size=_typed(lin, "short_conv_kernel_size", lwhere, int, 4),
        gate_lower_bound=_typed(lin, "gate_lower_bound", lwhere, float, -5.0),
        intermediate_size=_typed(text, "intermediate_size", where, int, 0),
        first_k_dense_replace=_typed(text, "first_k_dense_replace", where, int, 1),
        moe_layer_freq=_typed(text, "moe_layer_freq", where, int, 1),
        num_experts=_typed(text, "num_experts", where, int, 0),
        num_experts_per_token=_typed(text, "num_experts_per_token", where, int, 0),
        num_shared_experts=_typed(text, "num_shared_experts", where, int, 0),
        moe_intermediate_size=_typed(text, "moe_intermediate_size", where, int, 0),
        routed_expert_hidden_size=_typed(text, "routed_expert_hidden_size", where, int, 0),
        latent_moe_use_norm=_typed(text, "latent_moe_use_norm", where, bool, True),
        moe_renormalize=_typed(text, "moe_renormalize", where, bool, True),
        routed_scaling_factor=_typed(text, "routed_scaling_factor", where, float, 1.0),
        situ_beta=_typed(text, "activation_situ_beta", where, float, 4.0),
        situ_linear_beta=_typed(text, "activation_situ_linear_beta", where, float, 25.0),
        attn_res_block_size=_typed(text, "attn_res_block_size", where, int),
        rms_norm_eps=_typed(text, "rms_norm_eps", where, float, 1e-5),
        max_position_embeddings=_typed(text, "max_position_embeddings", where, int, 1 << 20),
        num_nextn_predict_layers=_typed(text, "num_nextn_predict_layers", where, int, 0),
        tie_word_embeddings=_typed(raw, "tie_word_embeddings", "", bool,
                                   _typed(text, "tie_word_embeddings", where, bool, False)),
        bos_token_id=top("bos_token_id"),
        eos_token_id=top("eos_token_id"),
        pad_token_id=top("pad_token_id"),
        expert_format=expert_format,
        vision=vision_config_from_dict(raw["vision_config"]) if raw.get("vision_config") else None,
        media_placeholder_token_id=raw.get("media_placeholder_token_id"),
    )
    runtime = raw.get("k3_jax", {})  # optional block of runtime defaults in our own configs
    if not isinstance(runtime, Mapping):
        raise ConfigError(f"config key 'k3_jax': expected an object, got {runtime!r}")
    fields.update(runtime)
    fields.update(overrides)
    vision_attention = fields.pop("vision_attention", None)  # runtime key: the tower's VisionConfig.attention
    if vision_attention is not None:
        if fields.get("vision") is None:
            raise ConfigError("'vision_attention' is set but the config has no vision_config")
        fields["vision"] = dataclasses.replace(fields["vision"], attention=vision_attention)
    unknown = unknown_fields(fields)
    if unknown:
        raise ConfigError(f"config keys {unknown} are not K3Config fields")
    _warn_unknown(raw, source)
    return K3Config(**fields)


def bundled_config_dirs() -> list[str]:
    """Directories holding the project's ``configs/*.json`` (and ``configs/sharding/``): ``k3_jax/configs``, a
    link to the repository's top-level ``configs/`` in a checkout, the copied files in an installed wheel
    (package data). Only existing directories."""
    d = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
    return [d] if os.path.isdir(d) else []


def load_config(path: str | os.PathLike[str], **overrides: Any) -> K3Config:
    """Load ``configs/*.json`` or a checkpoint's published ``config.json`` (a directory is accepted too)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path) and not os.path.isabs(path):
        # "configs/k3-tiny.json" or "k3-tiny" from any working directory: the bundled configs
        for d in bundled_config_dirs():
            candidate = next((c for c in (os.path.join(d, os.path.basename(path)), os.path.join(d, f"{path}.json"))
                              if os.path.exists(c)), None)
            if candidate:
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
        return _from_dict(raw, path, overrides)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def config_path(name: str) -> str:
    """Path of a bundled config by short name (``"k3"``, ``"k3-tiny"``, ``"k3-small"``) or a file path."""
    if os.path.exists(name):
        return name
    candidates = [os.path.join(d, f"{name}.json") for d in bundled_config_dirs()]
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
