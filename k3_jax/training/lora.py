"""LoRA fine-tuning: low-rank adapters beside frozen base weights, merge, and export to the release layout.

Adapters are extra leaves of the params tree, beside the weight they adapt (the layers read them, see
:func:`k3_jax.layers.common.lora_adapter`; ``model.init`` never creates them)::

    .../self_attn/q_proj/{kernel, lora_a [.., in, r], lora_b [.., r, out], lora_scale [..]}       (Linear)
    .../block_sparse_moe/experts/{w1, w1_lora_a, w1_lora_b, w1_lora_scale, ...}          (routed experts)

``..`` are the weight's stacked axes (``layers`` of a scanned segment). Linear layers add the low-rank path on
the activations (``x W + s·(x a) b``); MLA's ``kv_b_proj`` and bf16-held routed experts use ``W + s·a b``;
routed experts held in MXFP4 (``w1/{weight_packed, weight_scale}``, frozen and packed) take the low-rank path on
the activations beside the MXFP4 products (:func:`pallas_kernels.moe.ops.expert_ffn`). Routed experts take a
shared ``a [.., in, r]`` with per-expert ``b [.., E, r, out]`` (``experts="shared_a"``) or per-expert
``a [.., E, in, r]`` and ``b`` (``experts="per_expert"``), in the ``[in, out]`` orientation of the bf16 layout
whatever the base's format. ``a`` is normal(1/sqrt(in)), ``b`` zeros (a fresh adapter changes nothing);
``s = alpha / rank``. Each adapter's axes carry the logical names of the weight's (``lora_rank`` for the rank),
so :func:`sharding.rules.param_shardings` lays adapters out by the same table as their base; in training the
rank takes the FSDP (or tensor) axis the adapter's other dimension left free, so no adapter, gradient or AdamW
moment is replicated over ``fsdp`` (a routed expert's B ``[.., E, r, I]`` over expert × fsdp × tensor). The
layers read adapters as they are: the expert-parallel MoE's ``shard_map`` takes B gathered over the rank
(:func:`k3_jax.parallel.expert.moe_dispatch_combine_ep`'s in_specs; XLA gathers at the boundary, one layer at a
time, and reduces B's gradient back to its shards).

Training (:func:`trainable_mask`, :func:`split`, :func:`join`): only ``lora_a``/``lora_b`` leaves are
differentiated and given optimizer state; the base (MXFP4 experts stay packed u8) and ``lora_scale`` are
frozen. :func:`merge` folds adapters into the base weights (MXFP4 experts: decoded, then folded, held dense);
:func:`export` writes the merged model in the release layout with routed experts re-quantised to MXFP4 and
reports the rounding error.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.layers.common import LORA_LEAVES, lora_delta
from pallas_kernels.moe.reference import dense_expert_weight
from pallas_kernels.mxfp4 import is_mxfp4

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_proj", "o_proj", "q_a_proj",
               "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj",
               "routed_expert_down_proj", "routed_expert_up_proj")
"""Modules whose ``kernel`` may take an adapter (router, convs and ``lm_head`` never do)."""
EXPERT_WEIGHTS = ("w1", "w3", "w2")

TARGET_ALIASES: dict[str, str] = {
    "attention": r"/self_attn/[a-z_]+$",  # MLA q/kv/o/gate and KDA q/k/v/f/b/g/o projections
    "mlp": r"/mlp/(gate|up|down)_proj$",  # the dense layers' SiTU MLP
    "shared_experts": r"/shared_experts/(gate|up|down)_proj$",
    "latent": r"/routed_expert_(down|up)_proj$",  # LatentMoE's latent down / up projections
    "experts": r"/experts/w[123]$",  # routed experts
}
"""Names usable in ``LoraConfig.targets``; any other target is a regular expression searched in the weight's
``/``-joined path without its leaf (``model/segment_1/layer_0/self_attn/q_proj``, ``.../experts/w1``)."""


class LoraError(ValueError):
    """A LoRA configuration that cannot be applied to the given params (names the target / weight)."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 16.0  # scale = alpha / rank
    targets: tuple[str, ...] = ("attention", "shared_experts", "latent", "experts")
    experts: str = "shared_a"  # routed experts: "shared_a" (a shared, b per expert) | "per_expert"

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise LoraError(f"LoRA rank must be > 0, got {self.rank}")
        if self.experts not in ("shared_a", "per_expert"):
            raise LoraError(f"LoRA experts mode must be 'shared_a' or 'per_expert', got {self.experts!r}")
        if not self.targets:
            raise LoraError("LoRA needs at least one target")
        for t in self.targets:
            if t not in TARGET_ALIASES:
                try:
                    re.compile(t)
                except re.error as e:
                    raise LoraError(f"LoRA target {t!r} is neither one of {sorted(TARGET_ALIASES)} nor a "
                                    f"regular expression: {e}") from e

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def pattern(self) -> re.Pattern[str]:
        return re.compile("|".join(f"(?:{TARGET_ALIASES.get(t, t)})" for t in self.targets))


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """One adapted weight: where its adapter leaves go, their shapes and logical names."""

    parent: tuple[str, ...]  # the dict holding the adapter leaves
    prefix: str  # "" (beside ``kernel``) or "w1_" (routed experts)
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    a_names: tuple[str | None, ...]
    b_names: tuple[str | None, ...]
    lead_shape: tuple[int, ...]  # stacked axes (the scale's shape)
    lead_names: tuple[str | None, ...]
    in_dim: int


# ------------------------------------------------------------------------------------------ discovery
def _walk(tree: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _walk(v, path + (str(k),))
    else:
        yield path, tree


def _names_of(leaf: Any, ndim: int) -> tuple[str | None, ...]:
    names = getattr(leaf, "names", None)
    return tuple(names) if names is not None else (None,) * ndim


def _shape_of(leaf: Any) -> tuple[int, ...]:
    return tuple(nn.unbox(leaf).shape) if isinstance(leaf, nn.Partitioned) else tuple(leaf.shape)


def adapter_specs(params: Any, lc: LoraConfig) -> list[AdapterSpec]:
    """The adapters ``lc`` selects in ``params`` (boxed abstract params give logical names; plain arrays or
    shapes give ``None`` names). Routed experts held in MXFP4 (``{weight_packed u8 [.., E, out, in/2],
    weight_scale}``) get the adapters of the same weight in the bf16 layout ``[.., E, in, out]``. Raises
    :class:`LoraError` when a target matches nothing."""
    pat = lc.pattern()
    specs: list[AdapterSpec] = []
    matched: set[str] = set()
    for path, leaf in _walk(params, ()):
        if path[-1] in LORA_LEAVES or any(path[-1].endswith("_" + n) for n in LORA_LEAVES):
            continue
        where = "/".join(path[:-1])
        if path[-1] == "kernel" and len(path) >= 2 and path[-2] in PROJECTIONS:
            target = "/" + where
            if not pat.search(target):
                continue
            shape, names = _shape_of(leaf), _names_of(leaf, len(_shape_of(leaf)))
            lead, (din, dout) = shape[:-2], shape[-2:]
            ln, (n_in, n_out) = names[:-2], names[-2:]
            specs.append(AdapterSpec(path[:-1], "", (*lead, din, lc.rank), (*lead, lc.rank, dout),
                                     (*ln, n_in, "lora_rank"), (*ln, "lora_rank", n_out), lead, ln, din))
            matched.add(target)
            continue
        if path[-1] == "weight_scale":
            continue  # a packed expert weight is read at its weight_packed leaf
        exp_path = path[:-1] if path[-1] == "weight_packed" else path
        if len(exp_path) >= 2 and exp_path[-2] == "experts" and exp_path[-1] in EXPERT_WEIGHTS:
            target = "/" + "/".join(exp_path)
            if not pat.search(target):
                continue
            shape, names = _shape_of(leaf), _names_of(leaf, len(_shape_of(leaf)))
            lead, ln = shape[:-3], names[:-3]
            if exp_path != path:  # MXFP4 [.., E, out, in/2]
                (e, dout, din), (n_e, n_out, n_in) = (shape[-3], shape[-2], 2 * shape[-1]), names[-3:]
            else:  # bf16 layout [.., E, in, out]
                (e, din, dout), (n_e, n_in, n_out) = shape[-3:], names[-3:]
            if lc.experts == "shared_a":
                a_shape, a_names = (*lead, din, lc.rank), (*ln, n_in, "lora_rank")
            else:
                a_shape, a_names = (*lead, e, din, lc.rank), (*ln, n_e, n_in, "lora_rank")
            specs.append(AdapterSpec(exp_path[:-1], exp_path[-1] + "_", a_shape, (*lead, e, lc.rank, dout),
                                     a_names, (*ln, n_e, "lora_rank", n_out), lead, ln, din))
            matched.add(target)
    pat_by_target = {t: re.compile(TARGET_ALIASES.get(t, t)) for t in lc.targets}
    for t, p in pat_by_target.items():
        if not any(p.search(m) for m in matched):
            raise LoraError(f"LoRA target {t!r} matches no adaptable weight (candidates: the `kernel` of "
                            f"{', '.join(PROJECTIONS)} and routed experts w1/w3/w2)")
    return specs


# ------------------------------------------------------------------------------------------ adapters
def _set_in(tree: dict, path: tuple[str, ...], key: str, value: Any) -> None:
    node = tree
    for k in path:
        node = node.setdefault(k, {})
    node[key] = value


def init_adapters(params: Any, lc: LoraConfig, rng: jax.Array, *, boxed: bool = False,
                  dtype: Any = jnp.float32) -> dict:
    """Fresh adapters (nested dicts mirroring ``params``, only adapter leaves): ``a`` normal(1/sqrt(in)),
    ``b`` zeros, ``scale`` ``alpha/rank`` per stacked index. ``boxed=True`` wraps each leaf in
    ``nn.LogicallyPartitioned`` with its logical names (for :func:`sharding.rules.param_shardings`)."""
    out: dict = {}
    specs = adapter_specs(params, lc)
    keys = jax.random.split(rng, max(len(specs), 1))
    for spec, key in zip(specs, keys, strict=False):
        a = jax.random.normal(key, spec.a_shape, dtype) * (1.0 / np.sqrt(spec.in_dim))
        b = jnp.zeros(spec.b_shape, dtype)
        s = jnp.full(spec.lead_shape, lc.scale, jnp.float32)
        leaves = {"lora_a": (a, spec.a_names), "lora_b": (b, spec.b_names), "lora_scale": (s, spec.lead_names)}
        for name, (value, names) in leaves.items():
            _set_in(out, spec.parent, spec.prefix + name,
                    nn.LogicallyPartitioned(value, names) if boxed else value)
    return out


def adapter_shapes(params: Any, lc: LoraConfig, *, dtype: Any = jnp.float32) -> dict:
    """Boxed ``ShapeDtypeStruct`` adapters (shapes + logical names) without allocating anything."""
    return jax.eval_shape(lambda: init_adapters(params, lc, jax.random.key(0), boxed=True, dtype=dtype))


def with_adapters(params: Any, adapters: Any) -> dict:
    """``params`` with the adapter leaves inserted (dicts copied along the way; nothing else changes)."""
    if not isinstance(adapters, Mapping):
        return adapters
    out = dict(params)
    for k, v in adapters.items():
        out[k] = with_adapters(params[k], v) if k in params else v
    return out


def is_adapter_path(path: Sequence[str]) -> bool:
    leaf = path[-1]
    return any(leaf == n or leaf.endswith("_" + n) for n in LORA_LEAVES)


def _is_trainable(path: Sequence[str]) -> bool:
    leaf = path[-1]
    return any(leaf == n or leaf.endswith("_" + n) for n in ("lora_a", "lora_b"))


def _path_keys(path: Any) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def trainable_mask(params: Any) -> Any:
    """Bool pytree like ``params``: True exactly at ``lora_a`` / ``lora_b`` leaves."""
    return jax.tree_util.tree_map_with_path(lambda p, _: _is_trainable(_path_keys(p)), params)


def split(params: Any, mask: Any) -> tuple[Any, Any]:
    """``(trainable, frozen)``: two trees shaped like ``params`` with ``None`` where the other has the leaf."""
    trainable = jax.tree.map(lambda p, m: p if m else None, params, mask)
    frozen = jax.tree.map(lambda p, m: None if m else p, params, mask)
    return trainable, frozen


def join(trainable: Any, frozen: Any) -> Any:
    """Inverse of :func:`split`."""
    return jax.tree.map(lambda t, f: f if t is None else t, trainable, frozen, is_leaf=lambda x: x is None)


def labels(params: Any, mask: Any) -> Any:
    """Optimizer group labels for the trainable subtree: ``"adamw_nowd"`` at adapters, ``None`` elsewhere
    (frozen leaves are not in the optimizer at all: no state, no update)."""
    return jax.tree.map(lambda _, m: "adamw_nowd" if m else None, params, mask)


def tree_bytes(tree: Any) -> int:
    """Bytes of all array leaves of ``tree`` (optimizer states, gradients)."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
               if hasattr(x, "shape") and hasattr(x, "dtype"))


# ------------------------------------------------------------------------------------------ merge / export
def merge(params: Any, *, dense_dtype: Any = jnp.float32) -> dict:
    """The base params with every adapter folded in (``W + s·a b`` in f32, cast to ``W``'s dtype) and the
    adapter leaves removed. Raises :class:`LoraError` for an adapter whose weight is missing.

    Routed experts held in MXFP4 with adapters are decoded and folded, ``W_deq + s·a b``, into dense
    ``[.., E, in, out]`` arrays of ``dense_dtype`` (the bf16 layout). Then every other MXFP4 expert weight of the
    tree is decoded too (exact), so the merged model holds all its experts dense and runs with
    ``expert_format="bf16"``; a tree without adapters on packed experts keeps its packed weights as they are.
    """
    decode = dense_dtype if _has_packed_adapter(params) else None
    return _merge(params, decode)


def _has_packed_adapter(tree: Any) -> bool:
    if not isinstance(tree, Mapping):
        return False
    for k, v in tree.items():
        if (k == "lora_a" or k.endswith("_lora_a")) and is_mxfp4(tree.get(k[: -len("lora_a")][:-1])):
            return True
        if _has_packed_adapter(v):
            return True
    return False


def _merge(params: Any, decode: Any) -> Any:
    if not isinstance(params, Mapping):
        return params
    out: dict = {}
    for k, v in params.items():
        if is_adapter_path([k]):
            continue
        if decode is not None and k in EXPERT_WEIGHTS and is_mxfp4(v):
            out[k] = dense_expert_weight(v, jnp.float32).astype(decode)
        else:
            out[k] = _merge(v, decode)
    for k in params:
        if k in ("lora_a",) or k.endswith("_lora_a"):
            prefix = k[: -len("lora_a")]
            weight = "kernel" if prefix == "" else prefix[:-1]
            if weight not in out or isinstance(out[weight], Mapping):
                raise LoraError(f"adapter {k!r} has no dense weight {weight!r} beside it to merge into")
            a, b, s = (params[prefix + n] for n in LORA_LEAVES)
            w = out[weight]
            lead = len(np.shape(s))
            delta = lora_delta
            for _ in range(lead):
                delta = jax.vmap(delta)
            out[weight] = (jnp.asarray(w, jnp.float32) + delta(jnp.asarray(a), jnp.asarray(b),
                                                                jnp.asarray(s))).astype(w.dtype)
    return out


def expert_rounding_error(params: Any) -> dict[str, float]:
    """MXFP4 re-quantisation error of the (bf16-held) routed experts of ``params``: ``rel_rms`` =
    ``‖W - Q(W)‖ / ‖W‖`` over all experts, ``max_abs`` and the number of weights (``count``)."""
    from k3_jax.quant.mxfp4 import fake_quant_mxfp4  # noqa: PLC0415

    err2 = ref2 = 0.0
    max_abs, count = 0.0, 0
    for path, leaf in _walk(params):
        if len(path) >= 2 and path[-2] == "experts" and path[-1] in EXPERT_WEIGHTS:
            w = jnp.asarray(leaf, jnp.float32)
            d = w - fake_quant_mxfp4(w, -2)
            err2 += float(jnp.sum(d * d))
            ref2 += float(jnp.sum(w * w))
            max_abs = max(max_abs, float(jnp.max(jnp.abs(d))))
            count += int(w.size)
    return {"rel_rms": float(np.sqrt(err2 / ref2)) if ref2 else 0.0, "max_abs": max_abs, "count": count}


def export(cfg: Any, params: Any, out_dir: str | os.PathLike[str], *, experts: str = "mxfp4",
           **save_kwargs: Any) -> dict[str, Any]:
    """Merge the adapters and write the release layout (:func:`k3_jax.convert.hf.save_checkpoint`) with routed
    experts re-quantised to ``experts`` (``"mxfp4"``: per 32 along the input dim, E8M0 scales).

    Returns ``{"path": out_dir, "expert_rounding": expert_rounding_error(merged)}`` (zeros when ``experts`` is
    ``"bf16"`` or the experts are packed without adapters). Over MXFP4 experts with adapters, :func:`merge` holds
    every expert dense (adapted ones ``W_deq + s·a b`` in f32) and all are re-quantised; a decoded expert without
    adapter re-quantises to the same values, so its rounding error is 0 (it still counts in ``count``).
    """
    from k3_jax.convert.hf import save_checkpoint  # noqa: PLC0415

    merged = jax.tree.map(np.asarray, merge(params))
    rounding = (expert_rounding_error(merged) if experts == "mxfp4"
                else {"rel_rms": 0.0, "max_abs": 0.0, "count": 0})
    path = save_checkpoint(cfg.replace(qat="none"), merged, out_dir, experts=experts, **save_kwargs)
    return {"path": path, "expert_rounding": rounding}


def value_and_grad_trainable(loss_fn: Any, mask: Any) -> Any:
    """``f(params, *args) -> (loss_fn(params, *args), grads)`` with ``grads`` only for the leaves ``mask`` marks
    (``None`` elsewhere: frozen weights are closed over, never differentiated). ``loss_fn`` may have aux
    (``has_aux=True`` semantics)."""

    def of_trainable(trainable, frozen, *args):
        return loss_fn(join(trainable, frozen), *args)

    vg = jax.value_and_grad(of_trainable, has_aux=True)

    def f(params, *args):
        trainable, frozen = split(params, mask)
        return vg(trainable, frozen, *args)

    return f


def count_trainable(params: Any, mask: Any) -> dict[str, int]:
    """``{"lora": adapter weights, "frozen": everything else}`` parameter counts (for logs)."""
    out = {"lora": 0, "frozen": 0}
    for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(mask), strict=True):
        out["lora" if m else "frozen"] += int(np.prod(p.shape))
    return out
