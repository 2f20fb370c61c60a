"""Optimisers (optax): Muon with per-head Newton–Schulz for Q/K/V, AdamW for the rest, QB bias excluded.

Parameter groups (:func:`param_labels`, decided from the tree path and shape):
  * ``"frozen"``   ``e_score_correction_bias`` (updated by Quantile Balancing outside the optimizer) and
                   any non-float leaf (MXFP4 codes);
  * ``"muon_h{H}"`` per-head Muon: KDA ``q_proj``/``k_proj``/``v_proj`` (H = ``kda_num_heads``) and MLA
                   ``q_b_proj``/``kv_b_proj`` (H = ``num_attention_heads``): the output axis ``H·d`` is split
                   into H blocks ``[in, d]``, each orthogonalised on its own (K3 report: per-head NS so a head
                   with large gradients cannot dominate the spectrum of the whole projection);
  * ``"muon"``     every other matrix inside the layers (``kernel`` of the projections, the router ``gate``,
                   routed experts ``w1/w3/w2`` — one matrix per expert; leading stacked/expert axes
                   are batch);
  * ``"adamw"``    embedding and ``lm_head`` (decayed); ``"adamw_nowd"``: norms, scalars, ``A_log``,
                   ``dt_bias``, depthwise conv kernels, AttnRes projections (not decayed).

Muon update for a matrix block ``G [m, n]`` (momentum μ, Nesterov)::

    M ← μ·M + G;   U = G + μ·M;   O = NS5(U / ‖U‖_F) ≈ U_polar;   W ← W − lr·(0.2·sqrt(max(m, n))·O + wd·W)

The 0.2·sqrt(max(m, n)) factor matches AdamW's update RMS so both groups share one learning-rate schedule
(Moonlight's rule). NS5 is the quintic iteration (a, b, c) = (3.4445, −4.7750, 2.0315), run on the wide
orientation; :data:`NS_CUBIC` (1.5, −0.5, 0) converges to the exact polar factor (used by the SVD test).

Weight clipping (:func:`clip_weights`): after each update, every Muon block (each head for Q/K/V) whose RMS
singular value ``‖W‖_F / sqrt(min(m, n))`` exceeds ``weight_clip`` is rescaled onto it — a per-head bound
in the spirit of K2's QK-clip that needs no attention logits (the report names "weight clipping" without
the rule; this is our choice, off when ``weight_clip`` is None).

Schedule: linear warmup over ``warmup_frac`` (1%) of the steps to ``lr``, cosine decay to
``lr·min_lr_ratio``; global-norm gradient clipping first; decoupled weight decay 0.1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

NS_QUINTIC = (3.4445, -4.7750, 2.0315)
NS_CUBIC = (1.5, -0.5, 0.0)

_HEAD_PROJ_KDA = ("q_proj", "k_proj", "v_proj")
_HEAD_PROJ_MLA = ("q_b_proj", "kv_b_proj")
_ADAMW_DECAY = ("embed_tokens", "lm_head")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: str = "muon"  # "muon" (Muon + AdamW groups) or "adamw" (AdamW everywhere but frozen)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.01
    total_steps: int = 1000
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    clip_norm: float | None = 1.0
    weight_clip: float | None = 8.0
    muon_dtype: str = "float32"  # NS iteration dtype ("bfloat16" on accelerators is fine)


# ----------------------------------------------------------------------------------------- labels
def _path_names(path) -> list[str]:
    out = []
    for k in path:
        out.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
    return out


def param_labels(params: Any, cfg: Any, optim: str = "muon") -> Any:
    """Pytree of group labels (see module doc) with the structure of ``params`` (plain arrays)."""

    def label(path, leaf) -> str:
        names = _path_names(path)
        leafname = names[-1]
        if leafname == "e_score_correction_bias" or not jnp.issubdtype(leaf.dtype, jnp.floating):
            return "frozen"
        in_layers = any(n.startswith("segment_") or n.startswith("layers") for n in names)
        stacked = 1 if any(n.startswith("segment_") for n in names) else 0
        is_expert = "experts" in names and leafname in ("w1", "w2", "w3")
        matrix = (leafname == "kernel" or is_expert) and leaf.ndim - stacked >= 2
        if any(n in _ADAMW_DECAY for n in names):
            return "adamw"
        if not in_layers or not matrix or "conv1d" in "".join(names):
            return "adamw_nowd"
        if optim != "muon":
            return "adamw"
        parent = names[-2] if len(names) >= 2 else ""
        if parent in _HEAD_PROJ_KDA and "self_attn" in names:
            return f"muon_h{cfg.kda_num_heads}"
        if parent in _HEAD_PROJ_MLA:
            return f"muon_h{cfg.num_attention_heads}"
        return "muon"

    return jax.tree_util.tree_map_with_path(label, params)


# ----------------------------------------------------------------------------------------- Newton–Schulz
def newton_schulz(g: jax.Array, steps: int = 5, coeffs: tuple[float, float, float] = NS_QUINTIC,
                  eps: float = 1e-7) -> jax.Array:
    """Approximate polar factor of the last two dims of ``g [..., m, n]`` (leading dims are batch)."""
    a, b, c = coeffs
    transpose = g.shape[-2] > g.shape[-1]
    x = jnp.swapaxes(g, -1, -2) if transpose else g
    x = x / (jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=(-2, -1), keepdims=True)) + eps
             ).astype(x.dtype)
    # fp32 blocks: exact fp32 products; bf16 blocks: bf16 tensor-core products with fp32 accumulation
    hi = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else jax.lax.Precision.DEFAULT

    def body(x, _):
        s = jnp.einsum("...ij,...kj->...ik", x, x, precision=hi)
        poly = b * s + c * jnp.einsum("...ij,...jk->...ik", s, s, precision=hi)
        return a * x + jnp.einsum("...ij,...jk->...ik", poly, x, precision=hi), None

    x, _ = jax.lax.scan(body, x, None, length=steps)
    return jnp.swapaxes(x, -1, -2) if transpose else x


def orthogonalize(u: jax.Array, num_heads: int = 0, steps: int = 5,
                  coeffs: tuple[float, float, float] = NS_QUINTIC) -> jax.Array:
    """NS on ``u [..., in, out]``; ``num_heads`` H splits the out axis into H blocks ``[in, out/H]``."""
    if not num_heads:
        return newton_schulz(u, steps, coeffs)
    *lead, m, n = u.shape
    if n % num_heads:
        raise ValueError(f"out dim {n} of a per-head Muon matrix is not divisible by num_heads={num_heads}")
    d = n // num_heads
    blocks = jnp.moveaxis(u.reshape(*lead, m, num_heads, d), -2, -3)  # [..., H, m, d]
    o = newton_schulz(blocks, steps, coeffs)
    return jnp.moveaxis(o, -3, -2).reshape(*lead, m, n)


def orthogonalize_many(us: list[jax.Array], num_heads: int = 0, steps: int = 5,
                       coeffs: tuple[float, float, float] = NS_QUINTIC,
                       batch_below_bytes: int = 1 << 26) -> list[jax.Array]:
    """:func:`orthogonalize` of every array in ``us``, with the arrays of one shape and dtype stacked into one
    batched Newton–Schulz call (NS acts on each matrix alone, so each result is the same as on its own).

    A model has many matrices of a few shapes (k3-small: 92 Muon leaves, 34 shapes); one batched call per shape
    replaces a handful of small GEMM launches per leaf and iteration with the same number per shape. Only
    identical shapes are stacked (along a new leading axis), so arrays laid out alike on a mesh stay so; arrays
    of ``batch_below_bytes`` or more (e.g. stacked experts, whose GEMMs are large anyway) stay alone, so the
    stacking copy never doubles a big group's memory.
    """
    groups: dict[tuple, list[int]] = {}
    for i, u in enumerate(us):
        big = u.size * jnp.dtype(u.dtype).itemsize >= batch_below_bytes
        groups.setdefault((i,) if big else (u.shape, jnp.dtype(u.dtype)), []).append(i)
    out: list[jax.Array | None] = [None] * len(us)
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = orthogonalize(us[idx[0]], num_heads, steps, coeffs)
            continue
        o = orthogonalize(jnp.stack([us[i] for i in idx]), num_heads, steps, coeffs)
        for j, i in enumerate(idx):
            out[i] = o[j]
    return out


def muon_heads(label: str) -> int:
    """Heads H of a ``"muon_h{H}"`` label (per-head blocks), 0 for ``"muon"`` (whole matrices)."""
    return int(label[len("muon_h"):]) if label.startswith("muon_h") else 0


def block_shape(shape: tuple[int, ...], num_heads: int) -> tuple[int, int]:
    """``(rows, cols)`` of one Newton–Schulz block of a ``[..., in, out]`` leaf (``out / H`` per head)."""
    m, n = shape[-2], shape[-1]
    return (m, n // num_heads) if num_heads else (m, n)


class MuonState(NamedTuple):
    count: jax.Array
    mu: Any


def muon(learning_rate: optax.ScalarOrSchedule, *, num_heads: int = 0, momentum: float = 0.95,
         nesterov: bool = True, ns_steps: int = 5, weight_decay: float = 0.0,
         coeffs: tuple[float, float, float] = NS_QUINTIC, dtype: str = "float32"
         ) -> optax.GradientTransformation:
    """Muon as an optax transformation over a tree of matrices ``[..., in, out]`` (returns final updates)."""

    def init(params):
        return MuonState(jnp.zeros([], jnp.int32),
                         jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def update(grads, state, params=None):
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        mu = jax.tree.map(lambda m, g: momentum * m + g.astype(jnp.float32), state.mu, grads)

        if params is None:
            raise ValueError("muon.update needs params (weight decay and update dtype)")
        treedef = jax.tree.structure(grads)
        gs, ms, ps = jax.tree.leaves(grads), jax.tree.leaves(mu), jax.tree.leaves(params)
        us = [(g.astype(jnp.float32) + momentum * m if nesterov else m).astype(dtype)
              for g, m in zip(gs, ms, strict=True)]
        os_ = orthogonalize_many(us, num_heads, ns_steps, coeffs)

        def finish(o, p):
            bm, bn = block_shape(p.shape, num_heads)
            step = 0.2 * math.sqrt(max(bm, bn)) * o.astype(jnp.float32)
            if weight_decay:
                step = step + weight_decay * p.astype(jnp.float32)
            return (-lr * step).astype(p.dtype)

        updates = jax.tree.unflatten(treedef, [finish(o, p) for o, p in zip(os_, ps, strict=True)])
        return updates, MuonState(optax.safe_int32_increment(state.count), mu)

    return optax.GradientTransformation(init, update)


# ----------------------------------------------------------------------------------------- build
def lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    warmup = max(1, int(round(cfg.warmup_frac * cfg.total_steps)))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(cfg.total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def build_optimizer(cfg: OptimConfig, labels: Any) -> optax.GradientTransformation:
    """Global-norm clip, then Muon / AdamW / frozen groups keyed by :func:`param_labels`'s labels."""
    sched = lr_schedule(cfg)
    used = sorted(set(jax.tree.leaves(labels)))  # sorted: the same HLO (and compile-cache key) every run
    txs: dict[str, optax.GradientTransformation] = {
        "adamw": optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay),
        "adamw_nowd": optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=0.0),
        "frozen": optax.set_to_zero(),
    }
    for lab in used:
        if lab.startswith("muon"):
            heads = muon_heads(lab)
            txs[lab] = muon(sched, num_heads=heads, momentum=cfg.momentum, nesterov=cfg.nesterov,
                            ns_steps=cfg.ns_steps, weight_decay=cfg.weight_decay, dtype=cfg.muon_dtype)
    txs = {k: v for k, v in txs.items() if k in used}
    chain = [optax.clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm else []
    return optax.chain(*chain, optax.multi_transform(txs, labels))


def clip_weights(params: Any, labels: Any, max_rms_sv: float | None) -> Any:
    """Rescale Muon blocks (per head for ``muon_h*``) whose RMS singular value exceeds ``max_rms_sv``."""
    if max_rms_sv is None:
        return params

    def clip(p, lab):
        if not lab.startswith("muon"):
            return p
        heads = muon_heads(lab)
        *lead, m, n = p.shape
        blocks = p.reshape(*lead, m, heads, n // heads) if heads else p[..., None, :]
        bm, bn = block_shape(p.shape, heads)
        norm = jnp.sqrt(jnp.sum(jnp.square(blocks.astype(jnp.float32)), axis=(-3, -1), keepdims=True))
        scale = jnp.minimum(1.0, max_rms_sv * math.sqrt(min(bm, bn)) / jnp.maximum(norm, 1e-12))
        return (blocks * scale).reshape(p.shape).astype(p.dtype)

    return jax.tree.map(clip, params, labels)


def count_groups(labels: Any, params: Any) -> dict[str, int]:
    """Parameter count per group label (for logs)."""
    out: dict[str, int] = {}
    for lab, p in zip(jax.tree.leaves(labels), jax.tree.leaves(params), strict=True):
        key = "muon" if lab.startswith("muon") else lab
        out[key] = out.get(key, 0) + int(p.size)
    return out

