"""Memory plan: per-device bytes of a K3 model for a sharding preset and mesh, from the model's abstract shapes.

:func:`plan` takes the configuration and the boxed abstract parameters (``jax.eval_shape`` of the model's
``init``, leaves in ``nn.LogicallyPartitioned``), so this module needs no model code; the command line
``python -m sharding.plan ...`` (:mod:`sharding.plan`) builds those shapes from a config file and prints, per
device:

* **params** — every leaf of the abstract parameters (bf16 weights, the six fp32
  kinds, MXFP4 ``u8`` experts when ``--experts mxfp4``), sharded by the preset's rules (mesh axes a dimension is
  not divisible by are dropped, as :mod:`sharding.rules` does). ``checkpoint_bytes`` adds the release's A_log
  zero padding (stored ``[128]`` per KDA layer, held as ``[H]``); ``checkpoint_bytes_with_vision`` adds
  the vision tower + projector (``vision_tower.*``, ``mm_projector.*``; not part of the text model) and
  equals the index's ``total_size``.
* **optimizer** (``--optimizer adamw|muon|none``) — fp32 moments (2 for AdamW, 1 for Muon) per trainable
  element (MXFP4 experts count their dequantized elements; scales are not trained) plus an fp32 master copy
  with ``--master-fp32``, sharded like the parameters.
* **KDA state / conv / MLA latent cache** (serving, i.e. ``--optimizer none``) for ``--batch`` sequences of
  ``--seq-len`` tokens (state f32
  ``[B, H, K, V]`` sharded over ``kda_heads``; latent ``[B, S, 576]`` in ``--latent-dtype``, sharded over
  ``batch``/``length`` only — tensor parallelism replicates it, as MLA TP does).
* **prefix cache** (serving, ``--prefix-kda-gb`` / ``--prefix-mla-gb``: the budgets of
  :class:`k3_jax.serving.prefix_cache.PrefixCacheConfig`, in bytes of whole arrays as the engine counts them):
  the KDA snapshots that fit (each ``L_kda·(H·K·V·4 + conv)``, sharded like the KDA state) and the MLA page
  tokens that fit (``L_mla·((C + Dr)·bytes + 4)`` per token with the per-token scale, sharded like the latent).
* **activations** (estimate) — the AttnRes source bank ``[blocks, tokens, D]`` plus the largest per-layer
  working set of one layer (``--prefill-chunk`` tokens for serving; the whole local batch for training).

The figures are analytical (no compiler): communication buffers, grouped-GEMM workspaces, allocator
fragmentation and XLA temporaries are not included.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.config import K3Config
from sharding import rules
from sharding.mesh import parse_axes, resolve_axes

GB = 1e9
GIB = 1 << 30

CACHE_NAMES = {
    "kda_state": ("batch", "kda_heads", None, None),  # [B, H, K, V]
    "conv": ("batch", None, "kda_heads"),  # [B, W-1, 3·H·K]
    "mla_latent": ("batch", "length", "kv_lora"),  # [B, S, C + Dr]
}


@dataclass
class MemoryPlan:
    """Per-device bytes by category (plus totals and a few whole-model figures)."""

    mesh: dict[str, int]
    preset: str
    per_device: dict[str, float] = field(default_factory=dict)
    whole: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return float(sum(self.per_device.values()))

    @property
    def loaded(self) -> float:
        """Parameters + caches/states (what a server loads before running anything), per device."""
        return float(sum(v for k, v in self.per_device.items() if k not in ("activations_est", "optimizer")))

    def as_dict(self) -> dict[str, Any]:
        return {"mesh": self.mesh, "preset": self.preset, "per_device_bytes": self.per_device,
                "per_device_total_bytes": self.total,
                "per_device_loaded_bytes": self.loaded, "whole_model": self.whole, "notes": self.notes}

    def table(self, capacity_gib: float | None = None) -> str:
        lines = [f"K3 memory plan — preset {self.preset!r}, mesh "
                 + ",".join(f"{k}={v}" for k, v in self.mesh.items() if v > 1)
                 + f" ({math.prod(self.mesh.values())} devices)",
                 f"{'category':<28}{'per device (GB)':>16}{'per device (GiB)':>18}"]
        for k, v in self.per_device.items():
            lines.append(f"{k:<28}{v / GB:>16.3f}{v / GIB:>18.3f}")
        lines.append(f"{'loaded (params+states)':<28}{self.loaded / GB:>16.3f}{self.loaded / GIB:>18.3f}")
        lines.append(f"{'total':<28}{self.total / GB:>16.3f}{self.total / GIB:>18.3f}")
        if capacity_gib:
            lines.append(f"{'capacity':<28}{capacity_gib * GIB / GB:>16.3f}{capacity_gib:>18.3f}"
                         f"   -> {'fits' if self.total <= capacity_gib * GIB else 'DOES NOT FIT'}"
                         f" ({100 * self.total / (capacity_gib * GIB):.1f}% used)")
        lines.append("whole model / per sequence:")
        for k, v in self.whole.items():
            lines.append(f"  {k:<26}{v / GB:>16.3f} GB")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _local_elems(shape: tuple[int, ...], spec: jax.sharding.PartitionSpec, sizes: dict[str, int]) -> int:
    n = 1
    for i, d in enumerate(shape):
        axes = spec[i] if i < len(spec) else None
        f = 1 if axes is None else math.prod(sizes[a] for a in ((axes,) if isinstance(axes, str) else axes))
        n *= -(-d // f)
    return n


def param_bytes(boxed: Any, sizes: dict[str, int], preset: str, lora: bool = False) -> dict[str, float]:
    """Whole-model and per-device parameter bytes, and trainable elements (MXFP4 counted dequantized; with
    ``lora`` only the ``lora_a``/``lora_b`` adapter leaves are trainable, everything else is frozen)."""
    specs = nn.get_partition_spec(boxed)
    values = nn.unbox(boxed)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    flat_specs = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    flat_vals = jax.tree.leaves(values)
    r = rules.get_preset(preset)
    out = {"total": 0.0, "local": 0.0, "train_elems_total": 0.0, "train_elems_local": 0.0, "replicated_big": 0.0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rules.ShardingFallbackWarning)
        for (path, names), v in zip(flat_specs, flat_vals, strict=True):
            pspec = rules.logical_to_pspec(tuple(names), r, sizes, shape=v.shape)
            item = np.dtype(v.dtype).itemsize
            n_all = math.prod(v.shape)
            n_loc = _local_elems(tuple(v.shape), pspec, sizes)
            out["total"] += n_all * item
            out["local"] += n_loc * item
            key = jax.tree_util.keystr(path)
            if "weight_scale" in key or (lora and not any(f"lora_{x}'" in key for x in "ab")):
                continue
            mult = 2 if "weight_packed" in key else 1
            out["train_elems_total"] += n_all * mult
            out["train_elems_local"] += n_loc * mult
    return out


def vision_tower_bytes() -> int:
    """bf16 bytes of the release's MoonViT3d tower + projector (``vision_tower.*``, ``mm_projector.*``), which
    the text model does not hold.

    patch_embed 1024·3·14·14 + pos_emb 64·64·1024 + 27 blocks × (wqkv 4608·1024 + wo 1024·1536 + fc0/fc1
    2·4096·1024 + 2 norms·1024) + final norm 1024 + projector 4096·4096 + 7168·4096 + 7168.
    """
    block = 4608 * 1024 + 1024 * 1536 + 2 * 4096 * 1024 + 2 * 1024
    n = 1024 * 3 * 14 * 14 + 64 * 64 * 1024 + 27 * block + 1024 + 4096 * 4096 + 7168 * 4096 + 7168
    return 2 * n


def a_log_padding_bytes(cfg: K3Config) -> int:
    """The release stores A_log as ``[ceil(H/128)·128]`` f32 per KDA layer; the model holds ``[H]``."""
    padded = -(-cfg.kda_num_heads // 128) * 128
    return len(cfg.kda_layers) * (padded - cfg.kda_num_heads) * 4


def _cache_local(kind: str, shape: tuple[int, ...], item: float, sizes: dict[str, int], preset: str) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rules.ShardingFallbackWarning)
        spec = rules.logical_to_pspec(CACHE_NAMES[kind], preset, sizes, shape=shape)
    return _local_elems(shape, spec, sizes) * item


def plan(cfg: K3Config, preset: str, mesh: str | dict[str, int], *, num_devices: int | None = None,
         batch: int = 1, seq_len: int = 1 << 20, latent_dtype: str = "float8_e4m3fn",
         conv_dtype: str = "bfloat16", optimizer: str = "none", master_fp32: bool = False,
         prefill_chunk: int = 8192, train_tokens_per_device: int | None = None,
         prefix_kda_budget: float = 0, prefix_mla_budget: float = 0, boxed: Any,
         lora: bool = False, accum: int = 1) -> MemoryPlan:
    """Memory plan of ``cfg`` whose boxed abstract parameters are ``boxed`` (their dtypes follow the config's
    ``param_dtype`` and ``expert_format``). ``lora``: ``boxed`` holds LoRA adapters
    (:mod:`k3_jax.training.lora`) and only they are trained (optimizer and gradient bytes for them alone)."""
    if num_devices is None:
        parsed = parse_axes(mesh)
        if any(v == -1 for v in parsed.values()):
            raise ValueError("plan: a mesh axis of -1 needs num_devices")
        num_devices = math.prod(parsed.values())
    sizes = resolve_axes(mesh, num_devices)
    p = param_bytes(boxed, sizes, preset, lora)
    res = MemoryPlan(mesh=sizes, preset=preset)
    res.per_device["params"] = p["local"]
    res.whole["params"] = p["total"]
    res.whole["text_checkpoint_bytes"] = p["total"] + a_log_padding_bytes(cfg)
    res.whole["checkpoint_bytes_with_vision"] = res.whole["text_checkpoint_bytes"] + vision_tower_bytes()
    if optimizer != "none":
        moments = {"adamw": 2, "muon": 1, "sgd": 0}[optimizer]
        per_elem = 4 * moments + (4 if master_fp32 else 0)
        res.per_device["optimizer"] = p["train_elems_local"] * per_elem
        res.whole["optimizer"] = p["train_elems_total"] * per_elem
        res.whole["trainable_elements"] = p["train_elems_total"]

    n_kda = len(cfg.kda_layers)
    n_mla = len(cfg.mla_layers)
    h, dk = cfg.kda_num_heads, cfg.kda_head_dim
    latent_item = np.dtype(jnp.dtype(latent_dtype)).itemsize
    conv_item = np.dtype(jnp.dtype(conv_dtype)).itemsize
    if optimizer == "none" and seq_len > 0 and batch > 0:  # decode caches: serving only
        state_shape = (batch, h, dk, dk)
        conv_shape = (batch, cfg.short_conv_kernel_size - 1, 3 * h * dk)
        lat_shape = (batch, seq_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        res.per_device["kda_state"] = n_kda * _cache_local("kda_state", state_shape, 4, sizes, preset)
        res.per_device["kda_conv_state"] = n_kda * _cache_local("conv", conv_shape, conv_item, sizes, preset)
        res.per_device["mla_latent_cache"] = n_mla * _cache_local("mla_latent", lat_shape, latent_item, sizes,
                                                                  preset)
        res.whole["kda_state_per_sequence"] = n_kda * h * dk * dk * 4
        res.whole["kda_conv_per_sequence"] = n_kda * math.prod(conv_shape[1:]) * conv_item
        res.whole["mla_latent_per_sequence"] = n_mla * math.prod(lat_shape[1:]) * latent_item
    if optimizer == "none" and (prefix_kda_budget > 0 or prefix_mla_budget > 0):
        lat = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        snap = n_kda * (h * dk * dk * 4 + (cfg.short_conv_kernel_size - 1) * 3 * h * dk * conv_item)
        n_snap = int(prefix_kda_budget // snap)
        tok_bytes = n_mla * (lat * latent_item + 4)
        n_tok = int(prefix_mla_budget // tok_bytes)
        res.whole["prefix_kda_snapshot_bytes_each"] = snap
        res.whole["prefix_kda_snapshots_in_budget"] = n_snap
        res.whole["prefix_mla_tokens_in_budget"] = n_tok
        conv_shape = (n_snap, cfg.short_conv_kernel_size - 1, 3 * h * dk)
        res.per_device["prefix_kda_snapshots"] = n_kda * (
            _cache_local("kda_state", (n_snap, h, dk, dk), 4, sizes, preset)
            + _cache_local("conv", conv_shape, conv_item, sizes, preset)) if n_snap else 0.0
        res.per_device["prefix_mla_pages"] = n_mla * _cache_local(
            "mla_latent", (1, n_tok, lat), latent_item + 4 / lat, sizes, preset) if n_tok else 0.0

    # activations (estimate)
    d = cfg.hidden_size
    act_item = np.dtype(jnp.dtype(cfg.dtype)).itemsize
    tok_div = math.prod(sizes[a] for a in ("data", "fsdp", "expert", "sequence") if sizes[a] > 1) or 1
    bank = cfg.num_attn_res_blocks * (prefill_chunk // max(sizes["sequence"], 1)) * d * act_item
    if optimizer == "none":  # serving: one prefill chunk, batch replicated over tensor/expert
        tokens_local = prefill_chunk // max(sizes["sequence"], 1)
        res.notes.append(f"activations: one prefill chunk of {prefill_chunk} tokens")
        widest = max(3 * h * dk, cfg.intermediate_size // max(sizes["tensor"], 1),
                     cfg.num_experts_per_token * cfg.routed_expert_hidden_size,
                     cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) // max(sizes["tensor"], 1))
        res.per_device["activations_est"] = bank + tokens_local * (4 * d + 3 * widest) * act_item
    else:
        tokens_local = train_tokens_per_device or max(batch * seq_len // accum // tok_div, 1)
        terms = train_activation_terms(cfg, sizes, tokens_local, lora=lora,
                                       expert_adapters=lora and _has_expert_adapters(boxed))
        res.per_device["activations_est"] = terms["total"]
        res.whole.update({f"activation_{k}_per_device": v for k, v in terms.items() if k != "total"})
        res.notes.append(f"activations: {tokens_local} tokens per device per micro-batch, remat={cfg.remat!r} "
                         "(train_activation_terms)")
        res.per_device["gradients"] = p["train_elems_local"] * 4  # the f32 gradient accumulator of the step
        bank = terms["bank_per_layer"]
    res.whole["attn_res_bank_per_chunk"] = bank * max(sizes["sequence"], 1)
    res.notes.append("not included: communication buffers, GEMM workspaces, allocator fragmentation")
    return res


def _has_expert_adapters(boxed: Any) -> bool:
    """Whether ``boxed`` holds LoRA adapters of routed experts (``.../experts/w1_lora_a`` ...)."""
    paths = jax.tree_util.tree_flatten_with_path(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
    return any("'experts'" in (key := jax.tree_util.keystr(p)) and "_lora_a'" in key for p, _ in paths)


def train_activation_terms(cfg: K3Config, sizes: dict[str, int], tokens: int, *, lora: bool = False,
                           expert_adapters: bool = False, loss_chunk: int = 1024) -> dict[str, float]:
    """Per-device bytes of a train step's activations for ``tokens`` tokens per device (one micro-batch), by term.

    What the compiled step keeps (read off XLA:TPU buffer assignments of LoRA step cuts, see
    ``benchmarks/finetune_aot.py``): every layer saves its inputs for the backward — with ``remat="full"`` only
    that, the AttnRes source bank ``[S, T, D]`` (S = blocks + 1, the whole bank, since it is the layer's input);
    with ``remat="none"`` (and ``"dots"``, counted the same: an upper bound) also its residuals: two banks (the
    two AttnRes mixes save theirs), ~5 ``[T, D]`` and the mixer's projections (KDA ~10 ``[T, H·K/t]`` bf16 + one
    f32; MLA its q / k / v heads), and the MoE's expert-parallel dispatch: ``A = T·n_e·k`` assignment rows
    (all-gather over the ``expert`` axis of size ``n_e``) with the sorted expert inputs ``[A, Lat]`` (bf16) and the
    combine's f32 operand ``[A, Lat]`` — 6 bytes per row and latent unit, the dominant term at K3's widths. (That
    is the expert-parallel kernel path; ``moe_implementation="xla"`` leaves the MoE to XLA's partitioner, whose
    buffers this does not model.)
    On top, the larger of the loss phase and one layer's backward (the loss's buffers are gone before the layers'
    backward starts): under remat the layer's residuals again (recomputed, with the recomputed dispatch's bf16 rows
    before the sort and at the combine), plus the MoE backward's buffers
    (cotangents ~12 bytes per ``A·Lat`` element, and the local experts once more in bf16: decoded from MXFP4 for the
    tokens' gradient, or their weight gradients when they train); the loss phase holds a chunk's logits and their
    gradient (f32 ``[chunk, V/t]``). ``lora``: only adapters train (frozen bf16 experts get no weight gradient).
    ``expert_adapters``: LoRA adapters on MXFP4 routed experts, whose w1/w3 products run unfused (the base products
    and the low-rank terms, each f32 ``[A, I/t]``, before the rounding): one such f32 product, 4 bytes per ``A·I/t``
    element, more in the layer's backward (what a compiled K3 cut adds with the adapters sharded over ``fsdp``,
    RESULTS.md; the adapters' per-layer gathers at the expert-parallel boundary fit in it).
    """
    a = np.dtype(jnp.dtype(cfg.dtype)).itemsize
    t = max(sizes.get("tensor", 1), 1)
    d, s = cfg.hidden_size, cfg.num_attn_res_blocks + 1
    bank = s * tokens * d * a
    n_e = sizes.get("expert", 1)
    no_ep = cfg.moe_expert_parallel == "none" or (cfg.moe_expert_parallel == "auto" and cfg.moe_implementation == "xla")
    if n_e <= 1 or cfg.num_experts % n_e or no_ep:  # as k3_jax.layers.moe.expert_parallel_strategy decides
        n_e = 1
    rows = tokens * n_e * cfg.num_experts_per_token  # A: assignment rows one device's local experts may get
    lat, inter = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    inter_t = inter // t if inter % t == 0 else inter
    shared_t = cfg.num_shared_experts * inter // t
    hk_t = cfg.kda_num_heads * cfg.kda_head_dim // t
    heads_t = max(cfg.num_attention_heads // t, 1)
    common = 2 * bank + 5 * tokens * d * a
    mixer = {"kda": tokens * hk_t * (10 * a + 4),
             "mla": tokens * heads_t * (3 * cfg.q_head_dim + 2 * cfg.v_head_dim) * a
             + tokens * (cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim) * a}
    ffn = {"dense": 3 * tokens * (cfg.intermediate_size // t) * a,
           "moe": rows * lat * (a + 4) + tokens * (2 * lat + 3 * shared_t) * a + tokens * cfg.num_experts * 4}
    # local experts in bf16 once more: decoded from MXFP4 for the tokens' gradient, or their weight gradients
    expert_bwd = 3 * (cfg.num_experts // n_e) * lat * inter_t * a if cfg.expert_format == "mxfp4" or not lora else 0
    unfused = 4 * rows * inter_t if expert_adapters and cfg.expert_format == "mxfp4" else 0
    bwd = {"dense": 2 * ffn["dense"], "moe": rows * lat * 12 + 3 * rows * inter_t * a + expert_bwd + unfused}
    kinds = [(cfg.mixer_kind(i), cfg.ffn_kind(i)) for i in range(cfg.num_hidden_layers)]
    saved_none = [common + mixer[m] + ffn[f] for m, f in kinds]
    remat = cfg.remat == "full"
    per_layer = [bank] * len(kinds) if remat else saved_none
    # a layer's backward: its transients, plus, where remat recomputes the layer, its residuals again and the
    # recomputed dispatch's bf16 rows (the gathered rows before the sort, the combine's input: 4 bytes per A·Lat)
    recompute = {"dense": 0, "moe": rows * lat * 2 * a}
    one_layer = max(bwd[f] + ((sn + recompute[f]) if remat else 0) for sn, (_, f) in zip(saved_none, kinds,
                                                                                          strict=True))
    loss = 2 * loss_chunk * (cfg.vocab_size // t) * 4
    out = {"bank_per_layer": float(bank), "saved_layers": float(sum(per_layer)), "one_layer_backward": float(one_layer),
           "loss_chunk": float(loss), "moe_rows": float(rows)}
    out["total"] = out["saved_layers"] + max(out["one_layer_backward"], out["loss_chunk"])  # loss first, then layers
    return out


def process_layout(sizes: dict[str, int], processes: int, batch: int, per_device_total: float) -> dict[str, Any]:
    """How a mesh of ``sizes`` falls on ``processes`` hosts (equal devices each, process-major device order as in
    ``jax.devices()`` and :func:`sharding.mesh.make_mesh`): devices and bytes per process, the training batch
    rows each process feeds, and the mesh axes whose groups cross processes (their collectives leave the host).
    """
    devices = math.prod(sizes.values())
    if processes < 1 or devices % processes:
        raise ValueError(f"{devices} devices do not split over {processes} processes")
    per_process = devices // processes
    crossing, inner = [], 1
    for axis in reversed(list(sizes)):  # innermost axis first: it varies fastest over the device order
        if sizes[axis] > 1 and inner * sizes[axis] > per_process:
            crossing.append(axis)
        inner *= sizes[axis]
    rows = batch // processes if batch % processes == 0 else None
    return {"processes": processes, "devices_per_process": per_process,
            "per_process_bytes": per_device_total * per_process, "batch_rows_per_process": rows,
            "axes_across_processes": crossing[::-1]}
