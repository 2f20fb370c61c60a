"""Train a speculative-decoding draft (:mod:`k3_jax.draft`) against a frozen K3 target.

    python -m k3_jax.training.draft --target runs/k3-small --out runs/k3-small-draft --steps 2000
    python -m k3_jax.training.draft --config configs/k3-tiny.json --out /tmp/d --steps 20   # random target (smoke)

Labels are the target's own next-token distributions on the corpus (self-distillation; no corpus labels).
Loss per position (``--loss``): ``lk`` (default) ``-log Σ_x min(p(x), q(x))``, the log of the probability that
speculative sampling accepts the draft's token; ``kl`` ``KL(p || q)``; ``ce`` cross-entropy against the target's
argmax token. ``p``, ``q``: target / draft softmax of the logits divided by ``--temperature`` (default 1), the
sampling temperature the draft is trained to serve at (the engine samples both at the request's temperature).
``--temperature 0`` trains for greedy verification, which accepts the draft's token when it is the target's argmax:
``p`` becomes one-hot at that argmax, so ``lk`` and ``kl`` become ``-log q(argmax p)`` with ``q`` at temperature 1
(the smooth stand-in for that event), i.e. ``ce``; ``ce`` itself takes no temperature.

Pruned head (``--head-vocab N``): the vocab map is the ``N`` most frequent ids of the training shards (token
counts over every shard; :func:`k3_jax.draft.count_vocab_map`), computed once, kept in the training state
(``state["vocab_map"]``: checkpointed, so a resume uses the same map) and exported beside the draft. ``q`` lives on
the map (zero elsewhere). ``lk`` uses the target's unnormalised mass inside the map, ``Σ_{x∈map} min(p(x), q(x))``:
exactly the acceptance probability of a pruned draft (tokens outside the map are never accepted, and the loss
rewards no mass there). ``kl`` and ``ce`` use ``p`` renormalised on the map (``KL(p|map || q)``; the target's
argmax among the mapped ids): ``q`` cannot put mass outside the map, so the unrenormalised KL / CE would be
infinite whenever the target does.

Training-time test (``--ttt-steps S``): step 1 runs the draft over the sequence of (target feature at ``t``,
token ``t + 1``) pairs and predicts token ``t + 2`` (label: the target's distribution at ``t + 1``); step ``j > 1``
feeds the draft's own step ``j - 1`` hidden states with token ``t + j`` and predicts token ``t + j + 1`` (label at
``t + j``), as chained drafting does at inference. Every step runs causally over the whole row (its context is
the draft's own step-``j - 1`` states, where inference has target features: a cheaper stand-in for EAGLE-3's
tree-masked unroll). The loss is the mean over steps of the masked mean over positions.

Checkpoints: orbax via :class:`k3_jax.training.checkpoint.Checkpointer` in ``OUT/checkpoints`` (state = step,
draft params, optimizer state; data = the grain iterator state; run = the target's model config + every
:class:`DraftTrainConfig` field). Re-running with the same ``--out`` resumes from the latest checkpoint through
:func:`k3_jax.training.resume.resume` (a changed config is refused, naming the fields) and continues the
straight run's losses exactly. ``--max-seconds S`` ends the run after the step that passes ``S`` seconds
(checkpointed and exported as at that step; a re-run resumes it). At the end ``OUT/draft`` holds
``draft_config.json`` and ``params`` (orbax), what ``serve.py --draft OUT/draft`` loads.

Data (``--data``): token shards of the target's tokenizer (``python -m k3_jax.training.tokenize``), packed as
``train.py`` packs them; the bundled corpus by default (the small models' tokenizer).

``--target`` is a training workdir of ``train.py`` (``checkpoints/<step>/state`` + its stored model config) or a
converted orbax checkpoint (``--config`` or ``DIR/config.json`` gives the architecture).

``--mesh AXES`` (e.g. ``expert=2,tensor=8``; one process, :func:`sharding.make_mesh`): the target's parameters are
placed on the mesh by their logical axis names under ``--sharding-preset`` (default ``serve``; a converted
checkpoint is read straight onto the mesh), the draft's parameters and optimizer state by theirs, and the step runs
with the mesh and rules active (the layers pick their parallel forms), so a target too large for one device
trains a draft; the batch is replicated. The mesh is not part of the run config: a run may resume on another.

``--wait-for FILE`` (a pipeline that trains the target first): the step is compiled and run once on a random
target of ``--config``'s shapes, then the trainer waits until ``FILE`` exists and loads the target, so the first
real step compiles nothing (unless the target's stored config differs from ``--config``: that is logged) and
``--max-seconds`` counts training alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from k3_jax.config import K3Config, load_config
from k3_jax.draft import (
    DraftConfig,
    DraftModel,
    check_vocab_map,
    count_vocab_map,
    pruned_head,
    save_vocab_map,
    target_features,
    target_head,
)
from k3_jax.model import FEATURES, K3ForCausalLM
from k3_jax.serving.engine import shard_variables
from k3_jax.training.checkpoint import Checkpointer
from k3_jax.training.data import TOKENS_FILE, DataConfig, DataIterator, load_token_shard, make_dataset
from k3_jax.training.loop import TrainingDiverged, one_device
from k3_jax.training.resume import RUN_CONFIG_FORMAT, resume
from sharding import rules
from sharding.mesh import make_mesh

LOSSES = ("lk", "kl", "ce")


# ------------------------------------------------------------------------------------------------ losses
def _tempered(logits: jax.Array, temperature: float) -> jax.Array:
    return logits.astype(jnp.float32) / jnp.float32(temperature)


def _min_mass(p: jax.Array, q: jax.Array) -> jax.Array:
    return -jnp.log(jnp.maximum(jnp.sum(jnp.minimum(p, q), axis=-1), 1e-30))


def lk_loss(p_logits: jax.Array, q_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``-log Σ_x min(p(x), q(x))`` per position, f32 ``[...]`` for logits ``[..., V]``, ``p`` / ``q`` the
    softmaxes over V of the logits divided by ``temperature``; ``temperature == 0``: :func:`ce_loss`."""
    if temperature == 0:
        return ce_loss(p_logits, q_logits)
    return _min_mass(jax.nn.softmax(_tempered(p_logits, temperature), axis=-1),
                     jax.nn.softmax(_tempered(q_logits, temperature), axis=-1))


def kl_loss(p_logits: jax.Array, q_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``KL(p || q)`` per position, at ``temperature`` as :func:`lk_loss` (0: :func:`ce_loss`)."""
    if temperature == 0:
        return ce_loss(p_logits, q_logits)
    lp = jax.nn.log_softmax(_tempered(p_logits, temperature), axis=-1)
    lq = jax.nn.log_softmax(_tempered(q_logits, temperature), axis=-1)
    return jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)


def ce_loss(p_logits: jax.Array, q_logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Cross-entropy of the draft (softmax at temperature 1) against the target's argmax token, per position;
    ``temperature`` is ignored (the argmax does not depend on it)."""
    del temperature
    lq = jax.nn.log_softmax(q_logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(lq, jnp.argmax(p_logits, axis=-1)[..., None], axis=-1)[..., 0]


PER_POSITION = {"lk": lk_loss, "kl": kl_loss, "ce": ce_loss}


def pruned_loss(kind: str, p_logits: jax.Array, q_logits: jax.Array, vocab_map: jax.Array,
                temperature: float = 1.0) -> jax.Array:
    """Per-position loss ``kind`` of a pruned draft: target ``p_logits [..., V]``, draft ``q_logits [..., N]``
    over the ids ``vocab_map [N]`` (module docstring: ``lk`` on the unnormalised target mass inside the map,
    ``kl`` / ``ce`` on the target renormalised there), at ``temperature`` as :func:`lk_loss`. At 0, ``lk`` takes
    the target's argmax over the whole vocabulary: outside the map no draft token can match it (the loss is
    ``-log 1e-30``, with no gradient)."""
    p_in = jnp.take(p_logits.astype(jnp.float32), vocab_map, axis=-1)
    if kind != "lk":
        return PER_POSITION[kind](p_in, q_logits, temperature)
    if temperature == 0:
        p = (vocab_map == jnp.argmax(p_logits, axis=-1)[..., None]).astype(jnp.float32)
        return _min_mass(p, jax.nn.softmax(q_logits.astype(jnp.float32), axis=-1))
    p = jnp.exp(_tempered(p_in, temperature)
                - jax.nn.logsumexp(_tempered(p_logits, temperature), axis=-1, keepdims=True))
    return _min_mass(p, jax.nn.softmax(_tempered(q_logits, temperature), axis=-1))


def draft_loss(kind: str, p_logits: jax.Array, q_logits: jax.Array, mask: jax.Array,
               vocab_map: jax.Array | None = None, temperature: float = 1.0) -> jax.Array:
    """Masked mean of the per-position loss ``kind`` (one of :data:`LOSSES`) at ``temperature`` (>= 0); with
    ``vocab_map`` the draft's logits are over the map (:func:`pruned_loss`)."""
    fn = PER_POSITION.get(kind)
    if fn is None:
        raise ValueError(f"draft loss must be one of {LOSSES}, got {kind!r}")
    if not temperature >= 0:
        raise ValueError(f"draft loss temperature must be >= 0 (0: greedy verification), got {temperature}")
    m = mask.astype(jnp.float32)
    per = (fn(p_logits, q_logits, temperature) if vocab_map is None
           else pruned_loss(kind, p_logits, q_logits, vocab_map, temperature))
    return jnp.sum(per * m) / jnp.maximum(jnp.sum(m), 1.0)


# ------------------------------------------------------------------------------------------------ config
@dataclasses.dataclass(frozen=True)
class DraftTrainConfig:
    """Options of one draft-training run (all stored in each checkpoint's run config)."""

    target: str = ""  # train.py workdir or converted orbax dir; "" = a random target of `config` (smoke only)
    config: str = "configs/k3-tiny.json"  # the target architecture (ignored for a train.py workdir)
    data: tuple[str, ...] = ()  # token shards (.npz, k3_jax.training.tokenize); () = the bundled corpus
    out: str = "runs/draft"
    mixer: str = "mla"
    feature_layers: tuple[int, ...] = ()  # () = DraftConfig.default_for(target)
    intermediate_size: int = 0
    head_vocab: int = 0  # > 0: a pruned head over the N most frequent corpus ids (module doc); 0 = the full head
    loss: str = "lk"
    temperature: float = 1.0  # the serving temperature the loss is taken at (module doc); 0 = greedy verification
    ttt_steps: int = 3
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 1e-3
    warmup_steps: int = 10
    clip_norm: float = 1.0
    seed: int = 0
    save_every: int = 50
    dtype: str = ""  # compute dtype ("" = the target config's; float32 on CPU)
    max_seconds: float = 0.0  # > 0: end (checkpoint + export) after the step that passes this wall time
    wait_for: str = ""  # compile on a random target of `config`, then wait until this file exists (module doc)
    mesh: str = ""  # e.g. "expert=2,tensor=8": the target (and draft) sharded over a mesh; "" = one device
    sharding_preset: str = "serve"  # sharding.rules preset that lays out the parameters with --mesh

    def validate(self) -> DraftTrainConfig:
        if self.loss not in LOSSES:
            raise ValueError(f"--loss must be one of {LOSSES}, got {self.loss!r}")
        for name in ("ttt_steps", "steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.head_vocab < 0:
            raise ValueError(f"--head-vocab must be >= 0 (0: the full head), got {self.head_vocab}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0 (0: greedy verification), got {self.temperature}")
        if self.max_seconds < 0:
            raise ValueError(f"--max-seconds must be >= 0 (0: no limit), got {self.max_seconds}")
        if self.ttt_steps >= self.seq_len:
            raise ValueError(f"--ttt-steps {self.ttt_steps} must be < --seq-len {self.seq_len}")
        return self


def load_target(dtc: DraftTrainConfig, mesh: Mesh | None = None) -> tuple[K3Config, Any]:
    """``(cfg, params)`` of the target named by ``dtc.target`` (see the module docstring); with ``mesh`` the
    params are placed on it (:func:`place_on_mesh`; a converted checkpoint is read straight onto it)."""
    overrides = {"dtype": dtc.dtype} if dtc.dtype else {}
    if not overrides and jax.default_backend() == "cpu":
        overrides = {"dtype": "float32"}  # XLA:CPU cannot run bf16 x bf16 -> f32 dots
    path = Path(dtc.target).absolute()
    if dtc.target and mesh is not None and (path / "k3_config.json").is_file():
        from k3_jax.convert.orbax_io import restore_params_on_mesh  # noqa: PLC0415

        return restore_params_on_mesh(path, mesh, dtc.sharding_preset, **overrides)
    cfg, params = _load_target(dtc, path, overrides)
    if mesh is not None:
        params = place_on_mesh(K3ForCausalLM(cfg), (jnp.zeros((1, 1), jnp.int32),), params, mesh,
                               dtc.sharding_preset)
    return cfg, params


def place_on_mesh(module: nn.Module, init_args: tuple, params: Any, mesh: Mesh, preset: str) -> Any:
    """``params`` of ``module`` placed on ``mesh`` by their logical axis names under ``preset``'s rules."""
    return shard_variables(module, init_args, {"params": params}, mesh, preset)["params"]


def _load_target(dtc: DraftTrainConfig, path: Path, overrides: dict) -> tuple[K3Config, Any]:
    if not dtc.target:
        cfg = _target_config(dtc)
        return cfg, _random_target(cfg, dtc.seed + 1)
    import orbax.checkpoint as ocp  # noqa: PLC0415

    if not path.exists():
        raise FileNotFoundError(f"--target {path}: no such directory")
    if (path / "checkpoints").is_dir():
        ckpt = Checkpointer(path / "checkpoints", async_save=False)
        step = ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"--target {path}: no checkpoint in {path / 'checkpoints'}")
        run = ckpt.saved_run_config(step)
        if run is None:
            raise ValueError(f"--target {path}: checkpoint step {step} stores no model config")
        cfg = K3Config(**{**_tuples(run["model"]), **overrides})
        state = ocp.StandardCheckpointer().restore(ckpt.step_dir(step) / "state")
        ckpt.close()
        return cfg, state["params"]
    cfg_path = path / "config.json" if (path / "config.json").exists() else Path(dtc.config)
    cfg = load_config(cfg_path, **overrides)
    return cfg, ocp.StandardCheckpointer().restore(path)


def _target_config(dtc: DraftTrainConfig) -> K3Config:
    """``--config`` with the compute-dtype override ``load_target`` applies."""
    overrides = {"dtype": dtc.dtype} if dtc.dtype else {}
    if not overrides and jax.default_backend() == "cpu":
        overrides = {"dtype": "float32"}
    return load_config(dtc.config, **overrides)


def _uncommitted(tree: Any) -> Any:
    """Leaves placed as uncommitted device arrays, so a restored target hits the step compiled on a random one
    (jit keys on committed placement)."""
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x)), tree)


@functools.lru_cache(maxsize=2)
def _random_target(cfg: K3Config, seed: int) -> Any:
    variables = jax.jit(K3ForCausalLM(cfg).init)(jax.random.PRNGKey(seed), jnp.zeros((1, 8), jnp.int32))
    return nn.unbox(variables)["params"]


def _tuples(d: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


# ------------------------------------------------------------------------------------------------ step
def unrolled_loss(draft: DraftModel, dcfg: DraftConfig, cfg: K3Config, kind: str, ttt_steps: int,
                  draft_params: Any, target_logits: jax.Array, feats: jax.Array, tokens: jax.Array,
                  segment_ids: jax.Array, emb: jax.Array, head: jax.Array,
                  vocab_map: jax.Array | None = None, temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """``(loss, per-step losses [ttt_steps])`` of the training-time-test unroll over rows ``tokens [B, S]``
    with the target's ``target_logits [B, S, V]`` and ``feats [B, S, F]`` (module docstring); ``head`` is the
    draft's (``[D, N]`` gathered for ``vocab_map [N]`` when pruned)."""
    s = tokens.shape[1]
    losses = []
    inputs, from_draft = feats[:, :-1], False
    for j in range(1, ttt_steps + 1):
        n = s - j
        seg = segment_ids[:, :n]
        logits, hidden, _ = draft.apply({"params": draft_params}, inputs[:, :n], tokens[:, j:], emb, head,
                                        from_draft=from_draft, segment_ids=seg)
        mask = (segment_ids[:, :n] == segment_ids[:, j:]) & (segment_ids[:, j:] > 0)
        losses.append(draft_loss(kind, target_logits[:, j:], logits, mask, vocab_map, temperature))
        inputs, from_draft = hidden, True
    per_step = jnp.stack(losses)
    return jnp.mean(per_step), per_step


@functools.lru_cache(maxsize=4)
def _compiled_step(cfg: K3Config, dcfg: DraftConfig, dtc: DraftTrainConfig):
    """The jitted train step of one (target, draft, options) combination (cached: resumes reuse the compile)."""
    return jax.jit(_step_function(cfg, dcfg, dtc), donate_argnums=(0,))


def _sharded_step(cfg: K3Config, dcfg: DraftConfig, dtc: DraftTrainConfig, mesh: Mesh, state: dict):
    """The train step on ``mesh``: traced with the mesh and ``dtc.sharding_preset``'s rules active; the new state
    keeps ``state``'s placement (loss outputs replicated)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    placement = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(rules.on_input_mesh(_step_function(cfg, dcfg, dtc), dtc.sharding_preset), donate_argnums=(0,),
                   out_shardings=(placement, replicated, replicated))


def _place_state(cfg: K3Config, dcfg: DraftConfig, dtc: DraftTrainConfig, state: dict, mesh: Mesh) -> dict:
    """``state`` on ``mesh``: the draft's params by their logical names, the optimizer state by the params it
    mirrors (created from the placed params), the step counter replicated."""
    nf = cfg.hidden_size * len(dcfg.feature_layers)
    abstract = (jax.ShapeDtypeStruct((1, 2, nf), cfg.dtype), jax.ShapeDtypeStruct((1, 2), jnp.int32),
                jax.ShapeDtypeStruct((cfg.vocab_size, cfg.hidden_size), cfg.dtype),
                jax.ShapeDtypeStruct((cfg.hidden_size, cfg.vocab_size), cfg.dtype))
    params = place_on_mesh(DraftModel(cfg, dcfg), abstract, state["params"], mesh, dtc.sharding_preset)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_state = jax.tree.map(lambda x: x if x.sharding.num_devices > 1 else jax.device_put(x, replicated),
                             make_optimizer(dtc).init(params))
    placed = {"step": jax.device_put(state["step"], replicated), "params": params, "opt_state": opt_state}
    if "vocab_map" in state:
        placed["vocab_map"] = jax.device_put(state["vocab_map"], replicated)
    return placed


def placed_step(cfg: K3Config, dcfg: DraftConfig, dtc: DraftTrainConfig, state: dict, mesh: Mesh | None = None):
    """``(state, step)``: the training state (:func:`init_state`) placed for ``mesh`` (:func:`_place_state`; as is
    for one device) and the jitted step for it, ``step(state, target_params, tokens [B, S+1], segment_ids [B, S+1])
    -> (state, loss, per-TTT-step losses [ttt_steps])`` (``state`` donated; on a mesh the target's params placed by
    :func:`place_on_mesh`)."""
    if mesh is None:  # committed, as the step's outputs and a restored state are: the step compiles once
        return jax.device_put(state, one_device()), _compiled_step(cfg, dcfg, _step_options(dtc))
    state = _place_state(cfg, dcfg, dtc, state, mesh)
    return state, _sharded_step(cfg, dcfg, _step_options(dtc), mesh, state)


def _step_function(cfg: K3Config, dcfg: DraftConfig, dtc: DraftTrainConfig):
    """``step(state, target_params, tokens, segment_ids) -> (state, loss, per-TTT-step losses)``."""
    target, draft, tx = K3ForCausalLM(cfg), DraftModel(cfg, dcfg), make_optimizer(dtc)

    def step(state: dict, target_params: Any, tokens: jax.Array, segment_ids: jax.Array):
        logits, collected = target.apply({"params": target_params}, tokens, segment_ids, mutable=[FEATURES])
        logits = jax.lax.stop_gradient(logits)
        feats = jax.lax.stop_gradient(target_features(cfg, dcfg, collected))
        emb, head = target_head(cfg, target_params)
        vocab_map = state.get("vocab_map")
        if vocab_map is not None:
            head = pruned_head(head, vocab_map)
        (loss, per_step), grads = jax.value_and_grad(
            lambda p: unrolled_loss(draft, dcfg, cfg, dtc.loss, dtc.ttt_steps, p, logits, feats, tokens,
                                    segment_ids, emb, head, vocab_map, dtc.temperature),
            has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        if vocab_map is not None:
            new["vocab_map"] = vocab_map
        return new, loss, per_step

    return step


def make_optimizer(dtc: DraftTrainConfig) -> optax.GradientTransformation:
    warm = min(dtc.warmup_steps, max(dtc.steps - 1, 1))
    sched = optax.warmup_cosine_decay_schedule(0.0, dtc.lr, warm, max(dtc.steps, warm + 1), dtc.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(dtc.clip_norm), optax.adamw(sched, weight_decay=0.0))


def draft_config_of(cfg: K3Config, dtc: DraftTrainConfig) -> DraftConfig:
    base = DraftConfig.default_for(cfg, dtc.mixer)
    layers = tuple(dtc.feature_layers) or base.feature_layers
    return DraftConfig(layers, dtc.mixer, dtc.intermediate_size, dtc.head_vocab or None).validate(cfg)


def corpus_vocab_map(dtc: DraftTrainConfig, vocab_size: int) -> np.ndarray:
    """The ``dtc.head_vocab`` most frequent ids over every token shard of ``dtc.data`` (the bundled corpus when
    empty)."""
    paths = [Path(p) for p in dtc.data] or [TOKENS_FILE]
    return count_vocab_map((load_token_shard(p)[0] for p in paths), vocab_size, dtc.head_vocab)


@functools.lru_cache(maxsize=4)
def _draft_init(cfg: K3Config, dcfg: DraftConfig):
    return jax.jit(DraftModel(cfg, dcfg).init)


def init_state(cfg: K3Config, dcfg: DraftConfig, dtc: DraftTrainConfig, target_params: Any,
               vocab_map: np.ndarray | None = None) -> dict:
    """Step 0: fresh draft params and optimizer state (and ``vocab_map [N]`` i32 for a pruned head)."""
    emb, head = target_head(cfg, target_params)
    nf = cfg.hidden_size * len(dcfg.feature_layers)
    variables = _draft_init(cfg, dcfg)(jax.random.PRNGKey(dtc.seed), jnp.zeros((1, 2, nf), cfg.dtype),
                                       jnp.zeros((1, 2), jnp.int32), emb, head)
    params = nn.unbox(variables)["params"]
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": make_optimizer(dtc).init(params)}
    if dcfg.head_vocab is not None:
        if vocab_map is None:
            raise ValueError(f"head_vocab={dcfg.head_vocab}: init_state needs the vocab_map")
        state["vocab_map"] = jnp.asarray(check_vocab_map(vocab_map, dcfg, cfg.vocab_size))
    return state


def run_config(cfg: K3Config, dtc: DraftTrainConfig) -> dict:
    return json.loads(json.dumps({"format": RUN_CONFIG_FORMAT, "model": dataclasses.asdict(cfg),
                                  "train": dataclasses.asdict(dtc) | {"out": "(any)", "max_seconds": "(any)",
                                                                      "wait_for": "(any)", "mesh": "(any)"}}))


def _step_options(dtc: DraftTrainConfig) -> DraftTrainConfig:
    """``dtc`` without the options the compiled step does not depend on (its compile-cache key)."""
    return dataclasses.replace(dtc, out="", target="", max_seconds=0.0, wait_for="", mesh="")


def _precompile_and_wait(dtc: DraftTrainConfig, say) -> K3Config:
    """Run the step once on a random target of ``dtc.config`` (compiling it), then wait for ``dtc.wait_for``.
    Returns the config the step was compiled for."""
    t0 = time.perf_counter()
    cfg = _target_config(dtc)
    dcfg = draft_config_of(cfg, dtc)
    target = _uncommitted(_random_target(cfg, dtc.seed + 1))
    tokens = jnp.zeros((dtc.batch_size, dtc.seq_len + 1), jnp.int32)
    shapes_only = None if dcfg.head_vocab is None else np.arange(dcfg.head_vocab, dtype=np.int32)
    state, step_fn = placed_step(cfg, dcfg, dtc, init_state(cfg, dcfg, dtc, target, shapes_only))
    jax.block_until_ready(step_fn(state, target, tokens, jnp.ones_like(tokens)))
    say(f"draft step compiled on a random target ({time.perf_counter() - t0:.1f}s); waiting for {dtc.wait_for}")
    waited = time.perf_counter()
    while not Path(dtc.wait_for).exists():
        time.sleep(0.2)
        if time.perf_counter() - waited > 60:
            say(f"still waiting for {dtc.wait_for}")
            waited = time.perf_counter()
    return cfg


def export_draft(directory: Path, dcfg: DraftConfig, params: Any, vocab_map: Any = None) -> Path:
    """Write ``directory/{draft_config.json, params}`` and, for a pruned head, ``vocab_map.npy`` (built under a
    temp name, renamed when complete)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415

    directory = directory.absolute()
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    dcfg.save(tmp)
    if dcfg.head_vocab is not None:
        save_vocab_map(tmp, check_vocab_map(np.asarray(jax.device_get(vocab_map)), dcfg, np.iinfo(np.int32).max))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp / "params", jax.device_get(params))
    ckptr.wait_until_finished()
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
    return directory


def train(dtc: DraftTrainConfig, *, stop_at: int | None = None, say=print) -> dict[str, Any]:
    """Train (or resume) the draft; returns ``{"losses": [per step of this call], "step", "draft_dir"}``.
    ``stop_at``: save and return after that step (as a preemption would), without exporting. With
    ``dtc.max_seconds`` the run ends after the first step dispatched past that many seconds of this call
    (compile included; the host reads the losses every 10 steps, so it runs at most 10 steps ahead of the
    device): checkpointed and exported as at that step (the schedule still spans ``steps``)."""
    dtc = dtc.validate()
    mesh = make_mesh(dtc.mesh) if dtc.mesh else None
    if mesh is not None and dtc.wait_for:
        raise ValueError("--wait-for compiles the single-device step: it cannot be combined with --mesh")
    compiled_for = _precompile_and_wait(dtc, say) if dtc.wait_for else None
    cfg, target_params = load_target(dtc, mesh)
    if compiled_for is not None:
        target_params = _uncommitted(target_params)
        diff = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(compiled_for, f.name)]
        if diff:
            say(f"the target's config differs from --config in {diff}: the step compiles again")
    dcfg = draft_config_of(cfg, dtc)
    out = Path(dtc.out)
    out.mkdir(parents=True, exist_ok=True)
    it = DataIterator(make_dataset(DataConfig(paths=tuple(dtc.data), seq_len=dtc.seq_len, batch_size=dtc.batch_size,
                                              seed=dtc.seed, bos_id=cfg.bos_token_id or 1,
                                              eos_id=cfg.eos_token_id or 2)))
    ckpt = Checkpointer(out / "checkpoints", keep=2, save_every=dtc.save_every, async_save=False)
    ckpt.run_config = run_config(cfg, dtc)
    vocab_map = None
    if dcfg.head_vocab is not None:
        vocab_map = corpus_vocab_map(dtc, cfg.vocab_size)
        say(f"pruned head: the {dcfg.head_vocab} most frequent of {cfg.vocab_size} ids")
    state, step_fn = placed_step(cfg, dcfg, dtc, init_state(cfg, dcfg, dtc, target_params, vocab_map), mesh)
    start = 0
    if ckpt.latest_step() is not None:
        state, data_state, start, _ = resume(ckpt, state, ckpt.run_config, say=say)
        it.set_state(data_state)
    losses: list[float] = []
    unread: list[jax.Array] = []  # losses still on the device: read at log lines, so steps queue up meanwhile

    def read_losses() -> list[float]:
        """The losses so far; raises :class:`TrainingDiverged` at the first that is not finite (a target whose
        outputs are not finite gives that too)."""
        for x in unread:
            losses.append(float(x))
            if not np.isfinite(losses[-1]):
                raise TrainingDiverged(f"draft step {start + len(losses)}: loss {losses[-1]}; nothing saved after "
                                       "the last checkpoint")
        unread.clear()
        return losses

    t0 = time.perf_counter()
    for step in range(start + 1, dtc.steps + 1):
        batch = next(it)
        state, loss, per_step = step_fn(state, target_params, jnp.asarray(batch["tokens"]),
                                        jnp.asarray(batch["segment_ids"]))
        unread.append(loss)
        out_of_time = dtc.max_seconds > 0 and time.perf_counter() - t0 >= dtc.max_seconds
        if step == 1 or step % 10 == 0 or step == dtc.steps or out_of_time:
            read_losses()
            say(f"draft step {step}/{dtc.steps} loss({dtc.loss}) {losses[-1]:.4f} per TTT step "
                f"{np.round(np.asarray(per_step), 4).tolist()} ({time.perf_counter() - t0:.1f}s)")
        if out_of_time and step < dtc.steps:
            say(f"--max-seconds {dtc.max_seconds:g} reached at step {step} of {dtc.steps}")
            ckpt.save(step, state, it.get_state())
            ckpt.wait()
            break
        if ckpt.should_save(step) or step == dtc.steps or step == stop_at:
            if step not in ckpt.all_steps():
                ckpt.save(step, state, it.get_state())
                ckpt.wait()
        if step == stop_at:
            ckpt.close()
            return {"losses": read_losses(), "step": step, "draft_dir": None}
    ckpt.close()
    draft_dir = export_draft(out / "draft", dcfg, state["params"], state.get("vocab_map"))
    say(f"draft written to {draft_dir} (serve with: python serve.py ... --draft {draft_dir})")
    return {"losses": read_losses(), "step": int(state["step"]), "draft_dir": str(draft_dir)}


def _parse(argv: list[str] | None) -> DraftTrainConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = DraftTrainConfig()
    for f in dataclasses.fields(DraftTrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "data":
            p.add_argument(flag, type=lambda s: tuple(x for x in s.split(",") if x), default=(),
                           help="comma-separated token shards (.npz; default: the bundled corpus)")
        elif f.name == "feature_layers":
            p.add_argument(flag, type=lambda s: tuple(int(x) for x in s.split(",") if x), default=(),
                           help="comma-separated target layers (default: low, middle, high)")
        elif f.name == "loss":
            p.add_argument(flag, choices=LOSSES, default=d.loss)
        elif f.name == "mixer":
            p.add_argument(flag, choices=("mla", "kda"), default=d.mixer)
        else:
            p.add_argument(flag, type=type(getattr(d, f.name)), default=getattr(d, f.name))
    return DraftTrainConfig(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    dtc = _parse(argv)
    try:
        train(dtc)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TrainingDiverged as e:
        print(f"error: training diverged: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
