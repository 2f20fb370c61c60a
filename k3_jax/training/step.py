"""The jit-able train and eval steps: loss, gradient accumulation, optimizer, weight clipping, Quantile Balancing.

Train state (a plain dict pytree, what checkpoints hold)::

    {"step": i32[], "params": {...} (f32 master weights), "opt_state": optax state, "rng": u32[2] key data}

One :func:`train_step` on a batch ``{"tokens": [B, T+1] i32, "segment_ids": [B, T+1] i32}``:
  1. the batch is split into ``accum`` micro-batches (rows ``i::accum``, so each keeps the batch sharding);
     for each, ``model.apply(..., return_hidden=True, mutable=["intermediates"])`` gives the hidden states
     and the sown router scores, and :func:`~k3_jax.training.loss.chunked_cross_entropy` the summed loss;
     gradients of the summed loss accumulate in f32 and are divided by the number of target tokens (weights
     the model only reads as bf16 GEMM operands are cast once before the loop, :mod:`compute_cast`);
  2. optax (global-norm clip, Muon/AdamW groups, frozen router bias) updates the params, then
     :func:`~k3_jax.training.optim.clip_weights`;
  3. Quantile Balancing: for every MoE layer, the router scores of all micro-batches and the bias that routed
     them give the new ``e_score_correction_bias`` (used from the next step). Expert loads under the bias in
     effect this step are returned as metrics (max/mean load over layers, dead experts; per MoE layer in
     model layer order: ``load_max_mean_per_layer`` f32[L_moe], ``dead_experts_per_layer`` i32[L_moe]), plus
     ``load_max_mean_nobias``: the same scores routed without any bias (what an unbalanced router does).
:func:`eval_step` computes the loss only; the bias stays frozen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from k3_jax.training import quantile_balancing as qb
from k3_jax.training.compute_cast import cast_for_compute, compute_cast_mask
from k3_jax.training.data import loss_mask
from k3_jax.training.loss import chunked_cross_entropy
from k3_jax.training.optim import clip_weights
from sharding.rules import on_input_mesh

_MOE = "block_sparse_moe"


@dataclasses.dataclass(frozen=True)
class StepConfig:
    accum: int = 1  # gradient accumulation micro-batches per step
    loss_chunk: int = 1024  # tokens per cross-entropy chunk
    qb: bool = True  # Quantile Balancing of the router bias
    qb_method: str = "histogram"  # "histogram" (1000 bins, psum-able) or "exact"
    qb_bins: int = 1000
    weight_clip: float | None = 8.0
    pad_id: int | None = 0
    cast_params_once: bool = True  # GEMM-only weights cast to the compute dtype once per step (compute_cast)
    preset: str = "train"  # sharding rules a step traced outside any mesh context uses (see _on_input_mesh)


# ------------------------------------------------------------------------------------ router scores
def _find_moe(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """``{path_to_block_sparse_moe: subtree}`` for every MoE block in a nested dict."""
    out: dict[tuple[str, ...], Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k == _MOE:
                out[prefix + (k,)] = v
            else:
                out.update(_find_moe(v, prefix + (k,)))
    return out


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> dict:
    """Functional update of a nested dict (copies the dicts on the path)."""
    if not path:
        return value
    new = dict(tree)
    new[path[0]] = _set(tree[path[0]], path[1:], value)
    return new


def router_scores(intermediates: Any) -> dict[tuple[str, ...], jax.Array]:
    """``{moe_path: scores [R, N, E] f32}`` from ``mutable=["intermediates"]`` output (R = scan repeats)."""
    out = {}
    for path, sub in _find_moe(intermediates.get("intermediates", intermediates)).items():
        s = sub["router_scores"]
        s = s[0] if isinstance(s, tuple | list) else s
        out[path] = s if s.ndim == 3 else s[None]
    return out


def moe_layer_indices(cfg: Any, moe_path: tuple[str, ...], repeats: int) -> list[int]:
    """Model layer index of each scan repeat of the MoE block at ``(..., "segment_S", "layer_J", _MOE)``."""
    from k3_jax.model import layer_plan

    seg = layer_plan(cfg)[int(moe_path[-3].removeprefix("segment_"))]
    return [seg.layer(r, int(moe_path[-2].removeprefix("layer_"))) for r in range(repeats)]


def _bias_path(moe_path: tuple[str, ...]) -> tuple[str, ...]:
    return moe_path + ("gate", "e_score_correction_bias")


# ------------------------------------------------------------------------------------ steps
def _on_input_mesh(fn: Callable, step_cfg: StepConfig) -> Callable:
    """``fn`` traced under the mesh its (sharded) inputs live on and ``step_cfg.preset``'s rules when no mesh is
    active at trace time (e.g. a jitted step called outside ``Trainer._context()``). The model picks expert
    parallelism and its activation constraints from the active mesh: traced without one, the step runs the
    single-device MoE on ``expert``-sharded weights, which XLA's SPMD partitioner aborts on
    (``PartitionGatherOperandPassthroughDimensions``, the tiled grouped matmul's gather of expert weights)."""
    return on_input_mesh(fn, step_cfg.preset)


def make_loss_fn(model: Any, step_cfg: StepConfig) -> Callable:
    """``loss_fn(params, batch) -> (loss_sum, (num_tokens, num_correct, scores_by_layer))``."""

    def loss_fn(params, batch):
        tokens, seg = batch["tokens"], batch["segment_ids"]
        inputs, seg_in, targets = tokens[:, :-1], seg[:, :-1], tokens[:, 1:]
        mask = loss_mask(seg, tokens, step_cfg.pad_id)
        hidden, state = model.apply({"params": params}, inputs, segment_ids=seg_in, return_hidden=True,
                                    mutable=["intermediates"])
        loss_sum, n, correct = chunked_cross_entropy(hidden, params["lm_head"]["kernel"], targets, mask,
                                                     chunk_size=step_cfg.loss_chunk)
        return loss_sum, (n, correct, router_scores(state))

    return _on_input_mesh(loss_fn, step_cfg)


def _split_micro(batch: dict, accum: int) -> dict:
    def split(x):
        b = x.shape[0]
        if b % accum:
            raise ValueError(f"per-step batch {b} is not divisible by accum={accum}")
        return jnp.swapaxes(x.reshape(b // accum, accum, *x.shape[1:]), 0, 1)

    return jax.tree.map(split, batch)


def make_train_step(model: Any, tx: optax.GradientTransformation, labels: Any, cfg: Any,
                    step_cfg: StepConfig, trainable: Any = None, loss_fn: Callable | None = None) -> Callable:
    """``train_step(state, batch) -> (state, metrics)`` (pure; jit it with shardings).

    ``trainable`` (bool pytree like the params, e.g. :func:`k3_jax.training.lora.trainable_mask`): only those
    leaves are differentiated and updated; ``tx`` and ``state["opt_state"]`` then cover just that subtree
    (``lora.split(params, trainable)[0]``) and weight clipping is off. None: every leaf, as labelled.
    ``loss_fn``: default :func:`make_loss_fn`'s (e.g. :func:`k3_jax.vision.train.make_multimodal_loss_fn` for
    image-text batches).
    """
    from k3_jax.training import lora  # noqa: PLC0415

    loss_fn = loss_fn or make_loss_fn(model, step_cfg)
    grad_fn = (jax.value_and_grad(loss_fn, has_aux=True) if trainable is None
               else lora.value_and_grad_trainable(loss_fn, trainable))
    master_of = (lambda p: p) if trainable is None else (lambda p: lora.split(p, trainable)[0])
    k = cfg.num_experts_per_token

    compute_dtype = jnp.dtype(cfg.dtype)
    cast_once = step_cfg.cast_params_once and compute_dtype != jnp.float32

    def train_step(state, batch):
        params = state["params"]
        micro = _split_micro(batch, step_cfg.accum)
        # gradients are taken w.r.t. these (bf16 copies of the GEMM-only weights, f32 elsewhere)
        compute_params = (cast_for_compute(params, compute_cast_mask(params, cfg.qat), compute_dtype) if cast_once
                          else params)

        def body(carry, mb):
            g_acc, l_acc, n_acc, c_acc = carry
            (loss_sum, (n, correct, scores)), g = grad_fn(compute_params, mb)
            g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
            return (g_acc, l_acc + loss_sum, n_acc + n, c_acc + correct), scores

        master = master_of(params)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), master)
        z = jnp.zeros((), jnp.float32)
        (grads, loss_sum, n, correct), scores = jax.lax.scan(body, (zeros, z, z, z), micro)
        denom = jnp.maximum(n, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        updates, opt_state = tx.update(grads, state["opt_state"], master)
        new_params = optax.apply_updates(master, updates)
        if trainable is None:
            new_params = clip_weights(new_params, labels, step_cfg.weight_clip)
        else:
            new_params = lora.join(new_params, lora.split(params, trainable)[1])

        metrics = {"loss": loss_sum / denom, "accuracy": correct / denom, "tokens": n,
                   "grad_norm": optax.tree.norm(grads), "param_norm": optax.tree.norm(master_of(new_params))}
        max_mean, max_mean_nobias, dead, n_layers = [], [], jnp.zeros((), jnp.int32), 0
        dead_per, layer_ids = [], []  # per MoE layer, and each entry's model layer index
        for path, s in scores.items():  # s: [accum, R, N, E]
            # [R, N*accum, E], token-major: the batch-sharded N stays the major part of the merged dimension, so
            # the merge keeps its sharding (accum-major would replicate every layer's scores on every device);
            # loads and quantiles do not depend on the tokens' order
            s = jnp.transpose(s, (1, 2, 0, 3)).reshape(s.shape[1], -1, s.shape[-1])
            bias = _get(params, _bias_path(path))  # [R, E], the bias that routed this step
            loads = jax.vmap(lambda sc, b: qb.expert_loads(sc, b, k))(s, bias).astype(jnp.float32)
            max_mean.append(jnp.max(loads, -1) / jnp.maximum(jnp.mean(loads, -1), 1e-9))
            raw = jax.vmap(lambda sc: qb.expert_loads(sc, jnp.zeros(sc.shape[-1]), k))(s).astype(jnp.float32)
            max_mean_nobias.append(jnp.max(raw, -1) / jnp.maximum(jnp.mean(raw, -1), 1e-9))
            dead = dead + jnp.sum(loads == 0).astype(jnp.int32)
            dead_per.append(jnp.sum(loads == 0, -1).astype(jnp.int32))
            layer_ids += moe_layer_indices(cfg, path, s.shape[0])
            n_layers += s.shape[0]
            if step_cfg.qb:
                upd = jax.vmap(lambda sc, b: qb.qb_bias_update(sc, b, k, method=step_cfg.qb_method,
                                                               num_bins=step_cfg.qb_bins))(s, bias)
                new_params = _set(new_params, _bias_path(path), upd.astype(bias.dtype))
        if max_mean:
            mm = jnp.concatenate(max_mean)
            metrics.update({"load_max_mean": jnp.max(mm), "load_max_mean_avg": jnp.mean(mm),
                            "load_max_mean_nobias": jnp.max(jnp.concatenate(max_mean_nobias)),
                            "dead_experts": dead, "moe_layers": jnp.asarray(n_layers)})
            order = jnp.asarray(sorted(range(len(layer_ids)), key=layer_ids.__getitem__))  # model layer order
            metrics.update({"load_max_mean_per_layer": mm[order],
                            "dead_experts_per_layer": jnp.concatenate(dead_per)[order]})
        rng, _ = jax.random.split(jax.random.wrap_key_data(state["rng"]))
        new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state,
                     "rng": jax.random.key_data(rng)}
        return new_state, metrics

    return _on_input_mesh(train_step, step_cfg)


def make_eval_step(model: Any, step_cfg: StepConfig, loss_fn: Callable | None = None) -> Callable:
    """``eval_step(params, batch) -> {"loss_sum", "tokens", "correct"}`` (router bias frozen)."""
    loss_fn = loss_fn or make_loss_fn(model, step_cfg)

    def eval_step(params, batch):
        loss_sum, (n, correct, _) = loss_fn(params, batch)
        return {"loss_sum": loss_sum, "tokens": n, "correct": correct}

    return _on_input_mesh(eval_step, step_cfg)


def init_state(model: Any, tx: optax.GradientTransformation, rng: jax.Array, seq_len: int) -> dict:
    """Fresh train state (plain arrays; call under jit with out_shardings for sharded init)."""
    import flax.linen as nn

    init_rng, state_rng = jax.random.split(rng)
    variables = model.init(init_rng, jnp.zeros((1, seq_len), jnp.int32))
    params = nn.unbox(variables)["params"]
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
            "rng": jax.random.key_data(state_rng)}
