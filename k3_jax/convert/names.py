"""The checkpoint name table: HF tensor name pattern -> k3-jax parameter path + transform.

Everything the converter knows about names, shapes and dtypes is the data in :data:`TEXT_RULES` and
:data:`VISION_RULES`. A pattern is the tensor name with the checkpoint prefix removed and every numeric
path component replaced by ``{l}`` (layer) or ``{e}`` (expert) in order of appearance. Accepted prefixes:
``language_model.model.`` (released index), ``language_model.`` (the SGLang-mapped variant
``language_model.layers.*``), ``model.`` and none (Kimi-Linear style). ``lm_head`` sits beside ``model``.

Shapes are the **HF** shapes written as dimension symbols (see :func:`dims`); ``scope`` says which layers
carry the tensor (``top``, ``layer`` = every layer, ``kda``/``mla`` mixers, ``dense``/``moe`` FFNs,
``expert`` = per routed expert) and ``fmt`` which expert format (``bf16`` / ``mxfp4``) it belongs to.

Transforms (HF -> Flax; :mod:`k3_jax.convert.transforms` has both directions):

- ``identity``; ``transpose`` (Linear ``[out, in]`` -> kernel ``[in, out]``);
- ``row`` (AttnRes ``proj.weight [1, D]`` -> ``[D]``);
- ``conv`` (depthwise ``[C, 1, W]`` -> ``[W, C]``, tap W-1 = current token);
- ``a_log`` (stored ``[A]`` zero-padded to a multiple of 128 -> ``[:H]``);
- ``expert_t`` (one bf16 expert ``[out, in]`` -> slot ``e`` of ``[E, in, out]``);
- ``expert`` (one MXFP4 ``weight_packed``/``weight_scale`` -> slot ``e`` of ``[E, out, in/2 | in/32]``);
- ``patch`` (the vision patch conv ``[D, 3, P, P]`` -> linear kernel ``[3*P*P, D]``, input flattened (c, y, x)).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from k3_jax.config import K3Config

__all__ = [
    "Rule",
    "TEXT_RULES",
    "VISION_RULES",
    "Resolved",
    "NameError_",
    "dims",
    "vision_dims",
    "resolve",
    "hf_shape",
    "flax_shape",
    "expected_text_names",
    "rule_applies",
    "CANONICAL_PREFIX",
]

CANONICAL_PREFIX = "language_model."


@dataclass(frozen=True)
class Rule:
    pattern: str
    param: tuple[str, ...]
    transform: str
    shape: tuple[str, ...]
    dtype: str
    scope: str
    fmt: str = "any"


def _r(pattern, param, transform, shape, dtype, scope, fmt="any") -> Rule:
    return Rule(pattern, tuple(param.split("/")), transform, tuple(shape.split(",")), dtype, scope, fmt)


_L = "model.layers.{l}."
_A = _L + "self_attn."
_M = _L + "block_sparse_moe."
_X = _M + "experts.{e}."

# fmt: off
TEXT_RULES: tuple[Rule, ...] = (
    # --- top level                                                                    HF shape   dtype  scope
    _r("model.embed_tokens.weight", "model/embed_tokens/embedding", "identity", "V,D", "BF16", "top"),
    _r("model.norm.weight", "model/norm/weight", "identity", "D", "BF16", "top"),
    _r("model.output_attn_res_norm.weight", "model/output_attn_res_norm/weight", "identity", "D", "BF16", "top"),
    _r("model.output_attn_res_proj.weight", "model/output_attn_res_proj/weight", "row", "1,D", "BF16", "top"),
    _r("lm_head.weight", "lm_head/kernel", "transpose", "V,D", "BF16", "top"),
    # --- every layer: norms and AttnRes pseudo-queries
    _r(_L + "input_layernorm.weight", "input_layernorm/weight", "identity", "D", "BF16", "layer"),
    _r(_L + "post_attention_layernorm.weight", "post_attention_layernorm/weight", "identity", "D", "BF16", "layer"),
    _r(_L + "self_attention_res_norm.weight", "self_attention_res_norm/weight", "identity", "D", "BF16", "layer"),
    _r(_L + "mlp_res_norm.weight", "mlp_res_norm/weight", "identity", "D", "BF16", "layer"),
    _r(_L + "self_attention_res_proj.weight", "self_attention_res_proj/weight", "row", "1,D", "BF16", "layer"),
    _r(_L + "mlp_res_proj.weight", "mlp_res_proj/weight", "row", "1,D", "BF16", "layer"),
    # --- KDA mixer
    _r(_A + "q_proj.weight", "self_attn/q_proj/kernel", "transpose", "P,D", "BF16", "kda"),
    _r(_A + "k_proj.weight", "self_attn/k_proj/kernel", "transpose", "P,D", "BF16", "kda"),
    _r(_A + "v_proj.weight", "self_attn/v_proj/kernel", "transpose", "P,D", "BF16", "kda"),
    _r(_A + "q_conv1d.weight", "self_attn/q_conv1d/kernel", "conv", "P,1,W", "F32", "kda"),
    _r(_A + "k_conv1d.weight", "self_attn/k_conv1d/kernel", "conv", "P,1,W", "F32", "kda"),
    _r(_A + "v_conv1d.weight", "self_attn/v_conv1d/kernel", "conv", "P,1,W", "F32", "kda"),
    _r(_A + "f_a_proj.weight", "self_attn/f_a_proj/kernel", "transpose", "K,D", "BF16", "kda"),
    _r(_A + "f_b_proj.weight", "self_attn/f_b_proj/kernel", "transpose", "P,K", "BF16", "kda"),
    _r(_A + "b_proj.weight", "self_attn/b_proj/kernel", "transpose", "H,D", "BF16", "kda"),
    _r(_A + "g_proj.weight", "self_attn/g_proj/kernel", "transpose", "P,D", "BF16", "kda"),
    _r(_A + "o_proj.weight", "self_attn/o_proj/kernel", "transpose", "D,P", "BF16", "kda"),
    _r(_A + "A_log", "self_attn/A_log", "a_log", "AP", "F32", "kda"),
    _r(_A + "dt_bias", "self_attn/dt_bias", "identity", "P", "F32", "kda"),
    _r(_A + "o_norm.weight", "self_attn/o_norm/weight", "identity", "K", "F32", "kda"),
    # --- gated MLA with NoPE
    _r(_A + "q_a_proj.weight", "self_attn/q_a_proj/kernel", "transpose", "QL,D", "BF16", "mla"),
    _r(_A + "q_a_layernorm.weight", "self_attn/q_a_layernorm/weight", "identity", "QL", "BF16", "mla"),
    _r(_A + "q_b_proj.weight", "self_attn/q_b_proj/kernel", "transpose", "QB,QL", "BF16", "mla"),
    _r(_A + "kv_a_proj_with_mqa.weight", "self_attn/kv_a_proj_with_mqa/kernel", "transpose", "KVA,D", "BF16",
       "mla"),
    _r(_A + "kv_a_layernorm.weight", "self_attn/kv_a_layernorm/weight", "identity", "KVL", "BF16", "mla"),
    _r(_A + "kv_b_proj.weight", "self_attn/kv_b_proj/kernel", "transpose", "KVB,KVL", "BF16", "mla"),
    _r(_A + "g_proj.weight", "self_attn/g_proj/kernel", "transpose", "MO,D", "BF16", "mla"),
    _r(_A + "o_proj.weight", "self_attn/o_proj/kernel", "transpose", "D,MO", "BF16", "mla"),
    # --- dense SiTU MLP (layer 0)
    _r(_L + "mlp.gate_proj.weight", "mlp/gate_proj/kernel", "transpose", "I,D", "BF16", "dense"),
    _r(_L + "mlp.up_proj.weight", "mlp/up_proj/kernel", "transpose", "I,D", "BF16", "dense"),
    _r(_L + "mlp.down_proj.weight", "mlp/down_proj/kernel", "transpose", "D,I", "BF16", "dense"),
    # --- Stable LatentMoE
    _r(_M + "gate.weight", "block_sparse_moe/gate/kernel", "transpose", "E,D", "BF16", "moe"),
    _r(_M + "gate.e_score_correction_bias", "block_sparse_moe/gate/e_score_correction_bias", "identity", "E",
       "F32", "moe"),
    _r(_M + "routed_expert_down_proj.weight", "block_sparse_moe/routed_expert_down_proj/kernel", "transpose",
       "LAT,D", "BF16", "moe"),
    _r(_M + "routed_expert_norm.weight", "block_sparse_moe/routed_expert_norm/weight", "identity", "LAT",
       "BF16", "moe"),
    _r(_M + "routed_expert_up_proj.weight", "block_sparse_moe/routed_expert_up_proj/kernel", "transpose",
       "D,LAT", "BF16", "moe"),
    _r(_M + "shared_experts.gate_proj.weight", "block_sparse_moe/shared_experts/gate_proj/kernel", "transpose",
       "S,D", "BF16", "moe"),
    _r(_M + "shared_experts.up_proj.weight", "block_sparse_moe/shared_experts/up_proj/kernel", "transpose",
       "S,D", "BF16", "moe"),
    _r(_M + "shared_experts.down_proj.weight", "block_sparse_moe/shared_experts/down_proj/kernel", "transpose",
       "D,S", "BF16", "moe"),
    # --- routed experts, bf16 checkpoint (w1 = gate, w3 = up, w2 = down)
    _r(_X + "w1.weight", "block_sparse_moe/experts/w1", "expert_t", "EI,LAT", "BF16", "expert", "bf16"),
    _r(_X + "w3.weight", "block_sparse_moe/experts/w3", "expert_t", "EI,LAT", "BF16", "expert", "bf16"),
    _r(_X + "w2.weight", "block_sparse_moe/experts/w2", "expert_t", "LAT,EI", "BF16", "expert", "bf16"),
    # --- routed experts, MXFP4 checkpoint (compressed-tensors mxfp4-pack-quantized)
    _r(_X + "w1.weight_packed", "block_sparse_moe/experts/w1/weight_packed", "expert", "EI,LAT2", "U8", "expert",
       "mxfp4"),
    _r(_X + "w1.weight_scale", "block_sparse_moe/experts/w1/weight_scale", "expert", "EI,LAT32", "U8", "expert",
       "mxfp4"),
    _r(_X + "w3.weight_packed", "block_sparse_moe/experts/w3/weight_packed", "expert", "EI,LAT2", "U8", "expert",
       "mxfp4"),
    _r(_X + "w3.weight_scale", "block_sparse_moe/experts/w3/weight_scale", "expert", "EI,LAT32", "U8", "expert",
       "mxfp4"),
    _r(_X + "w2.weight_packed", "block_sparse_moe/experts/w2/weight_packed", "expert", "LAT,EI2", "U8", "expert",
       "mxfp4"),
    _r(_X + "w2.weight_scale", "block_sparse_moe/experts/w2/weight_scale", "expert", "LAT,EI32", "U8", "expert",
       "mxfp4"),
)

# MoonViT3d + PatchMergerMLPV2 -> the multimodal parameter tree of k3_jax.vision.tower (paths from the
# root of K3ForConditionalGeneration's params; ``blocks.{l}`` tensors stack into the scanned ``[L, ...]`` leaves,
# ``proj_{l}`` takes the Sequential index 0 / 2). Scope ``vision`` / ``vision_block`` (one per encoder block).
_V = "vision_tower.encoder.blocks.{l}."
_VP = "vision_tower/encoder/blocks/"
VISION_RULES: tuple[Rule, ...] = (
    _r("vision_tower.patch_embed.proj.weight", "vision_tower/patch_embed/proj/kernel", "patch", "VH,3,PS,PS",
       "BF16", "vision"),
    _r("vision_tower.patch_embed.pos_emb.weight", "vision_tower/patch_embed/pos_emb/weight", "identity",
       "PH,PW,VH", "BF16", "vision"),
    _r(_V + "wqkv.weight", _VP + "wqkv/kernel", "transpose", "QKV3,VH", "BF16", "vision_block"),
    _r(_V + "wo.weight", _VP + "wo/kernel", "transpose", "VH,QKV", "BF16", "vision_block"),
    _r(_V + "mlp.fc0.weight", _VP + "mlp/fc0/kernel", "transpose", "VI,VH", "BF16", "vision_block"),
    _r(_V + "mlp.fc1.weight", _VP + "mlp/fc1/kernel", "transpose", "VH,VI", "BF16", "vision_block"),
    _r(_V + "norm0.weight", _VP + "norm0/weight", "identity", "VH", "BF16", "vision_block"),
    _r(_V + "norm1.weight", _VP + "norm1/weight", "identity", "VH", "BF16", "vision_block"),
    _r("vision_tower.encoder.final_layernorm.weight", "vision_tower/encoder/final_layernorm/weight", "identity",
       "VH", "BF16", "vision"),
    _r("mm_projector.proj.{l}.weight", "mm_projector/proj_{l}/kernel", "transpose", "MMO,MM", "BF16",
       "vision"),  # proj.0 [MM, MM] / proj.2 [TD, MM] (see hf_shape)
    _r("mm_projector.post_norm.weight", "mm_projector/post_norm/weight", "identity", "TD", "BF16", "vision"),
)
# fmt: on


def dims(cfg: K3Config) -> dict[str, int]:
    """Dimension symbols used by the table's HF shapes, from a text config."""
    h = cfg.kda_num_heads
    d = {
        "V": cfg.vocab_size,
        "D": cfg.hidden_size,
        "1": 1,
        "P": cfg.kda_proj_size,
        "H": h,
        "K": cfg.kda_head_dim,
        "W": cfg.short_conv_kernel_size,
        "AP": -(-h // 128) * 128,  # A_log stored zero-padded to a multiple of 128 (the release's [128] for 96 heads)
        "QL": cfg.q_lora_rank,
        "QB": cfg.num_attention_heads * cfg.q_head_dim,
        "KVA": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
        "KVL": cfg.kv_lora_rank,
        "KVB": cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
        "MO": cfg.num_attention_heads * cfg.v_head_dim,
        "I": cfg.intermediate_size,
        "E": cfg.num_experts,
        "LAT": cfg.routed_expert_hidden_size,
        "S": cfg.num_shared_experts * cfg.moe_intermediate_size,
        "EI": cfg.moe_intermediate_size,
        "LAT2": cfg.routed_expert_hidden_size // 2,
        "LAT32": cfg.routed_expert_hidden_size // 32,
        "EI2": cfg.moe_intermediate_size // 2,
        "EI32": cfg.moe_intermediate_size // 32,
    }
    return d


def vision_dims(vision_config: Mapping[str, Any] | None, text_hidden: int) -> dict[str, int]:
    """Vision symbols from the published ``vision_config`` (defaults = the released K3 values)."""
    v = dict(vision_config or {})
    vh = int(v.get("vt_hidden_size", 1024))
    qkv = int(v.get("qkv_hidden_size", 1536))
    mk = v.get("merge_kernel_size", [2, 2])
    mm = int(v.get("mm_hidden_size", vh)) * int(mk[0]) * int(mk[1])
    return {
        "VH": vh,
        "3": 3,
        "PS": int(v.get("patch_size", 14)),
        "PH": int(v.get("init_pos_emb_height", 64)),
        "PW": int(v.get("init_pos_emb_width", 64)),
        "QKV": qkv,
        "QKV3": 3 * qkv,
        "VI": int(v.get("vt_intermediate_size", 4096)),
        "MM": mm,
        "MMO": mm,  # proj.0; proj.2 maps to the text width (handled in hf_shape)
        "TD": int(v.get("text_hidden_size", text_hidden)),
        "1": 1,
    }


class NameError_(ValueError):
    """A tensor name that no rule maps (or that maps to a tensor this config does not have)."""


@dataclass(frozen=True)
class Resolved:
    """A name matched to a rule. ``layer``/``expert`` are the numeric components (None when absent)."""

    name: str
    rule: Rule
    layer: int | None
    expert: int | None


def _compile(rules: tuple[Rule, ...]) -> dict[str, list[Rule]]:
    table: dict[str, list[Rule]] = {}
    for r in rules:
        table.setdefault(r.pattern, []).append(r)
    return table


_TEXT = _compile(TEXT_RULES)
_VISION = _compile(VISION_RULES)
_SLOTS = ("{l}", "{e}", "{x}", "{x}")


def _template(body: str) -> tuple[str, list[int]]:
    """``a.3.b.17.c`` -> (``a.{l}.b.{e}.c``, [3, 17]): numeric inner components become placeholders."""
    parts = body.split(".")
    nums: list[int] = []
    for i in range(1, len(parts) - 1):
        if parts[i].isdigit():
            nums.append(int(parts[i]))
            parts[i] = _SLOTS[min(len(nums) - 1, 3)]
    return ".".join(parts), nums


def rule_applies(rule: Rule, cfg: K3Config, layer: int | None, fmt: str) -> bool:
    """Whether ``rule`` exists for ``layer`` of ``cfg`` in checkpoint expert format ``fmt``."""
    s = rule.scope
    if s == "top":
        return layer is None
    if layer is None or not 0 <= layer < cfg.num_hidden_layers:
        return False
    if s == "layer":
        return True
    if s in ("kda", "mla"):
        return cfg.mixer_kind(layer) == s
    if s in ("dense", "moe"):
        return cfg.ffn_kind(layer) == s
    if s == "expert":
        return cfg.ffn_kind(layer) == "moe" and rule.fmt == fmt
    return False


def resolve(name: str, cfg: K3Config | None = None, fmt: str | None = None) -> Resolved | str | None:
    """Map one checkpoint name.

    Returns a :class:`Resolved` for a text tensor, the string ``"vision"`` for a recognised vision tensor, or
    ``None`` when no pattern matches. With ``cfg``/``fmt`` given, a text pattern that exists but not for that
    layer (e.g. a KDA tensor on an MLA layer, an expert index >= num_experts) also returns ``None``.
    """
    if name.startswith(("vision_tower.", "mm_projector.")):
        tmpl, _ = _template(name)
        return "vision" if tmpl in _VISION else None
    body = name[len(CANONICAL_PREFIX) :] if name.startswith(CANONICAL_PREFIX) else name
    if not body.startswith(("model.", "lm_head.")):
        body = "model." + body  # language_model.layers.* (SGLang-mapped variant)
    tmpl, nums = _template(body)
    rules = _TEXT.get(tmpl)
    if not rules:
        return None
    layer = nums[0] if len(nums) >= 1 else None
    expert = nums[1] if len(nums) >= 2 else None
    if len(nums) > 2:
        return None
    if cfg is None:
        return Resolved(name, rules[0], layer, expert)
    for r in rules:
        if rule_applies(r, cfg, layer, fmt or "bf16"):
            if r.scope == "expert" and not (expert is not None and 0 <= expert < cfg.num_experts):
                return None
            if r.scope != "expert" and expert is not None:
                return None
            return Resolved(name, r, layer, expert)
    return None


def hf_shape(rule: Rule, sym: Mapping[str, int], layer: int | None = None) -> tuple[int, ...]:
    """The HF shape of ``rule``'s tensor (``layer`` disambiguates ``mm_projector.proj.{0,2}``)."""
    if rule.pattern == "mm_projector.proj.{l}.weight" and layer == 2:
        return (sym["TD"], sym["MM"])
    return tuple(sym[s] for s in rule.shape)


def flax_shape(rule: Rule, sym: Mapping[str, int]) -> tuple[int, ...]:
    """Per-layer shape of the Flax parameter ``rule`` fills (experts stacked over E in front)."""
    s = hf_shape(rule, sym)
    t = rule.transform
    if t == "identity":
        return s
    if t == "transpose":
        return s[::-1]
    if t == "row":
        return s[1:]
    if t == "conv":
        return (s[2], s[0])
    if t == "a_log":
        return (sym["H"],)
    if t == "expert_t":
        return (sym["E"], *s[::-1])
    if t == "expert":
        return (sym["E"], *s)
    if t == "patch":
        return (s[1] * s[2] * s[3], s[0])
    raise ValueError(f"rule {rule.pattern!r}: no Flax shape for transform {t!r}")


def hf_name(rule: Rule, layer: int | None = None, expert: int | None = None) -> str:
    """Canonical checkpoint name (``language_model.model.…``)."""
    body = rule.pattern.replace("{l}", str(layer)).replace("{e}", str(expert))
    return CANONICAL_PREFIX + body


def expected_text_names(cfg: K3Config, fmt: str) -> Iterator[tuple[str, Resolved]]:
    """Every text tensor a checkpoint of ``cfg`` in expert format ``fmt`` holds, in canonical names.

    Order: layer by layer (layer rules in table order, experts by index), then the top-level tensors.
    """
    for layer in range(cfg.num_hidden_layers):
        for r in TEXT_RULES:
            if r.scope == "top" or not rule_applies(r, cfg, layer, fmt):
                continue
            if r.scope == "expert":
                continue
            n = hf_name(r, layer)
            yield n, Resolved(n, r, layer, None)
        if cfg.ffn_kind(layer) == "moe":
            xr = [r for r in TEXT_RULES if r.scope == "expert" and r.fmt == fmt]
            for e in range(cfg.num_experts):
                for r in xr:
                    n = hf_name(r, layer, e)
                    yield n, Resolved(n, r, layer, e)
    for r in TEXT_RULES:
        if r.scope == "top":
            n = hf_name(r)
            yield n, Resolved(n, r, None, None)
