"""The training loop: builds model, optimizer, data, mesh and checkpoints from a :class:`TrainConfig`, and runs.

``Trainer(TrainConfig(...)).run()`` trains, evaluates, logs and checkpoints; it resumes from the latest
good checkpoint in ``workdir`` when one exists (``resume=True``; ``resume_step`` picks one), continuing the
exact loss trajectory, and refuses a checkpoint of another config unless ``allow_config_change``
(``k3_jax/training/resume.py``). ``resume=False`` refuses a workdir that holds checkpoints unless
``start_over`` (which moves them aside).
``stop_at`` ends a run early at that step (saving a checkpoint) without changing the LR schedule, which is
what a preempted-then-resumed run looks like.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.config import K3Config, load_config
from k3_jax.model import K3ForCausalLM, K3ForConditionalGeneration
from k3_jax.training import lora
from k3_jax.training.checkpoint import Checkpointer, PreemptionFlag
from k3_jax.training.data import (
    DataConfig,
    DataIterator,
    make_dataset,
    merge_row_states,
    process_rows,
    to_global_batch,
)
from k3_jax.training.metrics import MetricsLogger, flops_per_token, muon_flops_per_step, peak_flops_per_device
from k3_jax.training.multihost import allgather_text, replicated, synced_when_multiprocess
from k3_jax.training.optim import OptimConfig, build_optimizer, count_groups, lr_schedule, param_labels
from k3_jax.training.resume import ResumeError, resume, run_config, start_new_run
from k3_jax.training.step import StepConfig, make_eval_step, make_train_step

BATCH_AXES = ("data", "fsdp", "expert")


def gather_data_state(state: dict) -> dict:
    """All processes' data-iterator states merged into one ``{"rows": {row: state}}`` (JSON-able).

    Each process reads the rows of the global batch it owns, so each holds those rows' iterator states; orbax
    writes JSON items from one process only, so the states are all-gathered first (through the coordination
    service's key-value store) and merged. Keyed by row, the merged state resumes under any process count
    (see ``training/data.py``).
    """
    return merge_row_states([json.loads(t) for t in allgather_text("data_state", json.dumps(state))])


def select_data_state(saved: dict) -> dict:
    """The state to give this process's iterator (it takes its own rows from the merged state)."""
    return saved


def batch_sharding(mesh):
    """Token rows of a global batch split over the mesh's :data:`BATCH_AXES`."""
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(tuple(a for a in BATCH_AXES if a in mesh.axis_names)))


def resolve_muon_dtype(name: str) -> str:
    """``TrainConfig.muon_dtype`` -> the Newton–Schulz dtype: "auto" is bfloat16 on GPU/TPU, float32 on CPU."""
    if name == "auto":
        return "bfloat16" if jax.default_backend() in ("gpu", "tpu") else "float32"
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"TrainConfig.muon_dtype must be 'auto', 'float32' or 'bfloat16', got {name!r}")
    return name


def _say(text: str) -> None:
    """A resume decision, on stderr (process 0)."""
    if jax.process_index() == 0:
        import sys

        print(f"k3-jax train: {text}", file=sys.stderr, flush=True)


def _any_process(flag: bool) -> bool:
    """True on every process if ``flag`` is True on any (so all processes save the same step)."""
    if jax.process_count() == 1:
        return flag
    return "1" in allgather_text("preempted", str(int(flag)))


@dataclasses.dataclass
class TrainConfig:
    """Everything a run needs; ``python train.py --set key=value`` sets these or model-config fields."""

    config: str = "configs/k3-tiny.json"
    model_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    workdir: str = "runs/k3-tiny"
    steps: int = 100
    stop_at: int | None = None  # end this run at this step (checkpointed); the schedule still uses `steps`
    seq_len: int = 64
    batch_size: int = 8  # global rows per step (all processes, all micro-batches)
    accum: int = 1
    seed: int = 0
    data: tuple[str, ...] = ()  # token shards (.npz); empty = bundled corpus
    # optimizer
    optimizer: str = "muon"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.01
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    weight_clip: float | None = 8.0
    # Newton-Schulz dtype of Muon: "float32" (fp32 HIGHEST), "bfloat16" (tensor-core GEMMs, fp32
    # accumulation) or "auto" (bfloat16 on GPU/TPU, float32 on CPU)
    muon_dtype: str = "auto"
    # step
    loss_chunk: int = 1024
    # Quantile Balancing of the router bias: None = on for full training, off for LoRA (the bias is part of the
    # frozen base); True/False force it
    qb: bool | None = None
    qb_method: str = "histogram"
    # eval / logging / checkpoints
    eval_every: int = 25
    eval_batches: int = 2
    log_every: int = 10
    # stop at the first step whose loss or gradient norm is not finite (TrainingDiverged; that step's state is not
    # saved, the checkpoints before it stay); False: train on (the step's metrics still record it)
    halt_on_nonfinite: bool = True
    save_every: int = 0  # 0: only at the end / on SIGTERM
    save_final: bool = True  # False: no checkpoint at the end (runs kept only for their metrics); SIGTERM still saves
    keep: int = 3
    async_checkpoint: bool = True
    resume: bool = True  # False: a new run; refused if workdir holds checkpoints, unless start_over
    start_over: bool = False  # with resume=False: move workdir's checkpoints and metrics aside, start at step 0
    resume_step: int | None = None  # resume this step instead of the latest good one
    allow_config_change: bool = False  # resume although the stored run config differs (fields are named)
    tensorboard: bool = True
    peak_tflops: float | None = None
    # parallelism
    mesh: str | None = None  # "fsdp=-1", "data=2,fsdp=4"...; None: fsdp over all devices; "none": 1 device
    preset: str = "train"
    # fine-tuning: start from a converted (HF layout) checkpoint directory; its config.json is the model config
    init_from: str | None = None
    # LoRA (k3_jax.training.lora): rank 0 = off (full training); else only adapters train (AdamW, no decay)
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("attention", "shared_experts", "latent", "experts")
    lora_experts: str = "shared_a"  # routed experts: "shared_a" | "per_expert"

class TrainingDiverged(RuntimeError):
    """A train step's loss or gradient norm was not finite (:attr:`TrainConfig.halt_on_nonfinite`)."""


def nonfinite_metrics(row: dict[str, Any], names: tuple[str, ...] = ("loss", "grad_norm")) -> dict[str, float]:
    """The scalars of ``row`` among ``names`` that are present and not finite."""
    return {k: row[k] for k in names if isinstance(row.get(k), float) and not np.isfinite(row[k])}


def one_device() -> jax.sharding.SingleDeviceSharding:
    """Where a single-device trainer's state lives (committed): :meth:`Trainer.init_state` places it there,
    :meth:`Trainer.precompile` lowers for it, a restored state arrives there (the draft trainer's too)."""
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


class Trainer:
    def __init__(self, tc: TrainConfig):
        if tc.qb is None:
            tc = dataclasses.replace(tc, qb=not tc.lora_rank)
        self.tc = tc
        cfg = load_config(Path(tc.init_from) / "config.json" if tc.init_from else tc.config, **tc.model_overrides)
        self.lora = (lora.LoraConfig(rank=tc.lora_rank, alpha=tc.lora_alpha, targets=tuple(tc.lora_targets),
                                     experts=tc.lora_experts) if tc.lora_rank else None)
        if cfg.expert_format != "bf16" and self.lora is None:
            raise ValueError(f"full training needs expert_format='bf16' (MXFP4 codes are not trainable; LoRA "
                             f"keeps them frozen), got {cfg.expert_format!r}")
        self.cfg: K3Config = cfg
        self.image_text = cfg.vision is not None  # a vision config trains on the bundled image-text example
        self.model = K3ForConditionalGeneration(cfg) if self.image_text else K3ForCausalLM(cfg)
        self.mesh = self._make_mesh()
        if self.image_text and (tc.data or tc.accum != 1 or self.mesh is not None):
            raise ValueError("a vision config trains on the bundled image-text example (k3_jax.vision.shapes_data) "
                             "on one device: it needs no --data, accum=1 and a single device (--mesh none); got "
                             f"data={tc.data}, accum={tc.accum}, mesh={tc.mesh}")
        self.rules_ctx = None
        abstract = jax.eval_shape(self.model.init, jax.random.key(0), jnp.zeros((1, tc.seq_len), jnp.int32))
        self._abstract_base = nn.unbox(abstract)["params"]  # what an init_from checkpoint must hold
        self._abstract_base_boxed = abstract["params"]
        self._adapters_boxed = None
        if self.lora is not None:
            self._adapters_boxed = lora.adapter_shapes(abstract["params"], self.lora)
            abstract = {**abstract, "params": lora.with_adapters(abstract["params"], self._adapters_boxed)}
        self.abstract_params_boxed = abstract["params"]  # shapes + logical axis names (for sharding elsewhere)
        abstract_params = nn.unbox(abstract)["params"]
        self.trainable = None if self.lora is None else lora.trainable_mask(abstract_params)
        self.labels = (param_labels(abstract_params, cfg, tc.optimizer) if self.lora is None
                       else lora.labels(abstract_params, self.trainable))
        self.optim_cfg = OptimConfig(name=tc.optimizer, lr=tc.lr, min_lr_ratio=tc.min_lr_ratio,
                                     warmup_frac=tc.warmup_frac, total_steps=tc.steps,
                                     weight_decay=tc.weight_decay, clip_norm=tc.clip_norm,
                                     weight_clip=tc.weight_clip, muon_dtype=resolve_muon_dtype(tc.muon_dtype))
        self.schedule = lr_schedule(self.optim_cfg)
        self.tx = build_optimizer(self.optim_cfg, self.labels)
        self.step_cfg = StepConfig(accum=tc.accum, loss_chunk=tc.loss_chunk, qb=tc.qb,
                                   qb_method=tc.qb_method, weight_clip=tc.weight_clip,
                                   pad_id=cfg.pad_token_id, preset=tc.preset)
        self.param_groups = (count_groups(self.labels, abstract_params) if self.lora is None else
                             lora.count_trainable(abstract_params, self.trainable))
        self._param_shardings = None
        if self.mesh is not None:
            from sharding.rules import param_shardings

            self._param_shardings = param_shardings(abstract["params"], self.mesh, tc.preset)
            self._base_shardings = param_shardings(self._abstract_base_boxed, self.mesh, tc.preset)
            self._adapter_shardings = (None if self._adapters_boxed is None else
                                       param_shardings(self._adapters_boxed, self.mesh, tc.preset))
        self.flops = flops_per_token(cfg, tc.seq_len)
        self.optimizer_flops = (muon_flops_per_step(abstract_params, self.labels, self.optim_cfg.ns_steps)
                                if tc.optimizer == "muon" and self.lora is None else 0.0)
        self.peak = peak_flops_per_device(tc.peak_tflops)

    # ------------------------------------------------------------------ setup
    def _make_mesh(self):
        tc = self.tc
        if tc.mesh == "none" or (tc.mesh is None and jax.device_count() == 1):
            return None
        from sharding.mesh import make_mesh

        return make_mesh(tc.mesh or {"fsdp": -1})

    def _context(self):
        if self.mesh is None:
            import contextlib

            return contextlib.nullcontext()
        from sharding.rules import activate

        return activate(self.mesh, self.tc.preset)

    def _init_functions(self):
        """``(init_params(rng, base | None), init_opt(params))``, jitted once per trainer."""
        model, tx, tc = self.model, self.tx, self.tc
        if getattr(self, "_init_fns", None) is None:
            # the init forward's dummy batch: one row per device, so every batch sharding of the mesh divides it
            rows = 1 if self.mesh is None else self.mesh.size

            def init_params(r, base):
                if base is None:
                    base = nn.unbox(model.init(r, jnp.zeros((rows, tc.seq_len), jnp.int32)))["params"]
                if self.lora is None:
                    return base
                return lora.with_adapters(base, lora.init_adapters(base, self.lora, jax.random.fold_in(r, 1)))

            def init_opt(params):
                return tx.init(self._trained(params))

            opt_shardings = None
            if self.mesh is not None:  # the moments take their parameters' layout (not the compiler's replicas)
                from sharding.rules import state_shardings  # noqa: PLC0415

                params = self._abstract_params()
                opt_shardings = state_shardings(jax.eval_shape(init_opt, params), self._trained(params),
                                                self._trained(self._param_shardings), self.mesh)
            self._init_fns = (jax.jit(init_params, out_shardings=self._param_shardings),
                              jax.jit(init_opt, out_shardings=opt_shardings))
        return self._init_fns

    def _trained(self, tree: Any) -> Any:
        """The part of a params-shaped ``tree`` the optimizer sees: all of it, or the LoRA adapters alone."""
        return tree if self.trainable is None else lora.split(tree, self.trainable)[0]

    def _abstract_params(self) -> Any:
        """The model's params (with adapters) as ``jax.ShapeDtypeStruct`` s."""
        return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nn.unbox(self.abstract_params_boxed))

    def init_state(self) -> dict:
        """Fresh train state, params placed per the sharding preset."""
        init_rng, state_rng = jax.random.split(jax.random.key(self.tc.seed))
        init_params, init_opt = self._init_functions()
        with self._context():
            if self.tc.init_from and self.mesh is not None:
                params = self._sharded_init_from(init_rng)
            else:
                params = init_params(init_rng, self._load_base())
            opt_state = init_opt(params)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": opt_state,
                 "rng": jax.random.key_data(state_rng)}
        if self.mesh is not None:  # anything not laid out on the mesh (counters, rng): replicate
            from jax.sharding import NamedSharding, PartitionSpec

            rep = NamedSharding(self.mesh, PartitionSpec())

            def place(x):
                sh = getattr(x, "sharding", None)
                if isinstance(sh, NamedSharding) and sh.mesh == self.mesh:
                    return x
                return replicated(x, rep)

            state = jax.tree.map(place, state)
        else:  # committed to the device, as a restored state is: the train step then compiles once for both
            state = jax.device_put(state, one_device())
        return state

    def precompile(self) -> dict[str, Any]:
        """Compile the init, train and eval steps from shapes alone (nothing is placed on the device), so a later
        :meth:`init_state` / :meth:`run` of this trainer starts without compiling (JAX's in-memory cache).

        Single device, text model only (raises ``ValueError`` otherwise). Returns ``{"train": the compiled train
        step (``.memory_analysis()``: the compiler's bytes), "compile_s": seconds of all three compiles}``.
        """
        if self.mesh is not None or self.image_text:
            raise ValueError("Trainer.precompile is for a single-device text-model trainer (mesh none, no vision "
                             f"config); got mesh={self.tc.mesh!r}, vision={self.image_text}")
        t0 = time.time()
        init_params, init_opt = self._init_functions()
        rng = jax.eval_shape(lambda: jax.random.split(jax.random.key(self.tc.seed))[0])
        base = (jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, w.dtype), self._abstract_base)
                if self.tc.init_from else None)
        init_params.lower(rng, base).compile()
        params = jax.eval_shape(init_params, rng, base)
        init_opt.lower(params).compile()
        state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
                 "opt_state": jax.eval_shape(init_opt, params),
                 "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))}
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device()), state)
        rows = jax.ShapeDtypeStruct((self.tc.batch_size, self.tc.seq_len + 1), jnp.int32)
        batch = {"tokens": rows, "segment_ids": rows}
        train_step, eval_step = self.compiled_steps(state)
        train = train_step.lower(state, batch).compile()
        eval_step.lower(state["params"], batch).compile()
        return {"train": train, "compile_s": time.time() - t0}

    def _sharded_init_from(self, rng: jax.Array) -> dict:
        """The ``init_from`` checkpoint read shard by shard straight onto the mesh (no host copy of the model,
        :func:`k3_jax.training.init_from.load_sharded`), plus fresh adapters (the same values
        :meth:`_init_functions`' ``init_params`` draws) laid out by the preset."""
        from k3_jax.training.init_from import load_sharded  # noqa: PLC0415

        base = load_sharded(self.tc.init_from, self._abstract_base, self._base_shardings,
                            experts=self.cfg.expert_format)
        if self.lora is None:
            return base
        shapes, lc = self._abstract_base, self.lora
        adapters = jax.jit(lambda r: lora.init_adapters(shapes, lc, jax.random.fold_in(r, 1)),
                           out_shardings=self._adapter_shardings)(rng)
        return lora.with_adapters(base, adapters)

    def _load_base(self) -> dict | None:
        """The ``init_from`` checkpoint's params (experts as ``cfg.expert_format``), or None."""
        if not self.tc.init_from:
            return None
        from k3_jax.convert.hf import load_checkpoint  # noqa: PLC0415

        _, base = load_checkpoint(self.tc.init_from, experts=self.cfg.expert_format, vision=False)
        return jax.tree.map(lambda w, x: np.asarray(x, w.dtype) if np.issubdtype(w.dtype, np.floating) else x,
                            self._abstract_base, base)

    def _batch_sharding(self):
        return None if self.mesh is None else batch_sharding(self.mesh)

    def _to_global(self, batch: dict) -> dict:
        if self.image_text:
            return jax.tree.map(jnp.asarray, batch)
        return to_global_batch(batch, process_rows(self._batch_sharding(), self.tc.batch_size),
                               self._batch_sharding(), self.tc.batch_size)

    def data_iterator(self, split: str = "train") -> DataIterator:
        tc, cfg = self.tc, self.cfg
        if self.image_text:
            from k3_jax.tokenizer import Tokenizer  # noqa: PLC0415
            from k3_jax.vision.shapes_data import ShapesCaptions  # noqa: PLC0415

            return ShapesCaptions(Tokenizer.bundled(media=True), cfg, tc.seq_len, tc.batch_size, tc.seed, split)
        dc = DataConfig(paths=tuple(tc.data), seq_len=tc.seq_len, batch_size=tc.batch_size, seed=tc.seed,
                        bos_id=cfg.bos_token_id if cfg.bos_token_id is not None else 1,
                        eos_id=cfg.eos_token_id if cfg.eos_token_id is not None else 2)
        return DataIterator(make_dataset(dc, split=split,
                                         rows=process_rows(self._batch_sharding(), tc.batch_size)))

    def compiled_steps(self, state: dict):
        """(train_step, eval_step) jitted with the state's shardings; cached on the trainer."""
        if getattr(self, "_compiled", None) is None:
            self._compiled = self._compile(state)
        return self._compiled

    def _compile(self, state: dict):
        shardings = jax.tree.map(lambda x: x.sharding, state) if self.mesh is not None else None
        loss_fn = None
        if self.image_text:
            from k3_jax.vision.train import make_multimodal_loss_fn  # noqa: PLC0415

            loss_fn = make_multimodal_loss_fn(self.model, self.step_cfg)
        train = make_train_step(self.model, self.tx, self.labels, self.cfg, self.step_cfg, self.trainable, loss_fn)
        evals = make_eval_step(self.model, self.step_cfg, loss_fn)
        if shardings is None:
            return jax.jit(train, donate_argnums=0), jax.jit(evals)
        bs = self._batch_sharding()
        return (synced_when_multiprocess(jax.jit(train, in_shardings=(shardings, bs),
                                                 out_shardings=(shardings, None), donate_argnums=0), "train"),
                synced_when_multiprocess(jax.jit(evals, in_shardings=(shardings["params"], bs)), "eval"))

    # ------------------------------------------------------------------ run
    def evaluate(self, eval_step, params) -> dict[str, float]:
        it = self.data_iterator("eval")
        tot = {"loss_sum": 0.0, "tokens": 0.0, "correct": 0.0}
        with self._context():
            for _ in range(self.tc.eval_batches):
                out = jax.device_get(eval_step(params, self._to_global(next(it))))
                for k in tot:
                    tot[k] += float(out[k])
        n = max(tot["tokens"], 1.0)
        return {"eval_loss": tot["loss_sum"] / n, "eval_accuracy": tot["correct"] / n}

    def _resume_or_start(self, ckpt: Checkpointer, it: DataIterator) -> tuple[dict, int, list[str]]:
        """``(state, start step, notes)``: the checked resume of ``ckpt`` (``tc.resume``), or a fresh state
        after a new run's check that ``ckpt`` holds no steps (see ``resume.py``; refusals come before any
        compile); closes ``ckpt`` when it raises."""
        tc = self.tc
        ckpt.run_config = run_config(tc, self.cfg, muon_dtype=self.optim_cfg.muon_dtype)
        if tc.init_from or tc.lora_rank:  # fine-tuning fields (absent from plain runs' stored configs)
            ckpt.run_config["train"].update(json.loads(json.dumps(
                {k: getattr(tc, k) for k in ("init_from", "lora_rank", "lora_alpha", "lora_targets", "lora_experts")})))
        try:
            if not tc.resume:
                if tc.resume_step is not None:
                    raise ResumeError(f"resume_step={tc.resume_step} asks to resume, but resume=False")
                notes = start_new_run(ckpt, start_over=tc.start_over, say=_say)
                return self.init_state(), 0, notes
            if not ckpt.all_steps():
                if tc.resume_step is not None:
                    raise ResumeError(f"--resume-step {tc.resume_step}: {ckpt.directory} holds no checkpoints")
                return self.init_state(), 0, []
            state, data_state, start, notes = resume(ckpt, self.init_state(), ckpt.run_config, step=tc.resume_step,
                                                     allow_config_change=tc.allow_config_change, say=_say)
            it.set_state(select_data_state(data_state))
            return state, start, notes
        except BaseException:
            ckpt.close()
            raise

    def run(self) -> dict[str, Any]:
        """Train to ``stop_at`` or ``steps``; returns ``{"losses": {step: loss}, "eval": [...], ...}``."""
        tc = self.tc
        t_start = time.time()
        it = self.data_iterator("train")
        ckpt = Checkpointer(Path(tc.workdir) / "checkpoints", keep=tc.keep, save_every=tc.save_every,
                            async_save=tc.async_checkpoint)
        state, start, notes = self._resume_or_start(ckpt, it)
        end = min(tc.steps, tc.stop_at) if tc.stop_at is not None else tc.steps
        logger = MetricsLogger(tc.workdir, tc.steps, print_every=tc.log_every, tensorboard=tc.tensorboard,
                               start_step=start)
        logger.log(start, {"event": "start", "resumed": start > 0, "notes": notes, "devices": jax.device_count(),
                           "mesh": None if self.mesh is None else dict(self.mesh.shape),
                           "params": self.param_groups, "flops_per_token": self.flops["total"],
                           "optimizer_flops_per_step": self.optimizer_flops,
                           "moe_layer_ids": [i for i in range(self.cfg.num_hidden_layers)  # *_per_layer rows
                                             if self.cfg.ffn_kind(i) == "moe"]}, kind="meta")
        train_step, eval_step = self.compiled_steps(state)
        flag = PreemptionFlag()
        losses: dict[int, float] = {}
        evals: list[dict] = []
        tokens_per_step = tc.batch_size * tc.seq_len
        n_dev = jax.device_count()
        compile_s = None
        step = last_saved = start
        try:
            with self._context():
                while step < end:
                    batch = self._to_global(next(it))
                    t0 = time.time()
                    state, m = train_step(state, batch)
                    m = jax.device_get(m)
                    dt = time.time() - t0
                    if compile_s is None:
                        compile_s = dt
                    step += 1
                    row = {k: (float(v) if np.ndim(v) == 0 else v) for k, v in m.items()}
                    row.update({"lr": float(self.schedule(step - 1)), "step_time_s": dt,
                                "tokens_per_s": tokens_per_step / dt})
                    achieved = self.flops["total"] * tokens_per_step / dt
                    row["tflops_per_device"] = achieved / n_dev / 1e12
                    row["mfu"] = achieved / (self.peak * n_dev) if self.peak else None
                    losses[step] = row["loss"]
                    logger.log(step, row)
                    bad = nonfinite_metrics(row) if tc.halt_on_nonfinite else {}
                    if bad:
                        logger.log(step, {"event": "nonfinite", **bad, "last_saved": last_saved}, kind="meta")
                        raise TrainingDiverged(
                            f"step {step}: {', '.join(f'{k} = {v}' for k, v in bad.items())}; nothing saved after "
                            f"step {last_saved} (set halt_on_nonfinite=False to train on)")
                    if tc.eval_every and (step % tc.eval_every == 0 or step == tc.steps):
                        ev = self.evaluate(eval_step, state["params"])
                        evals.append({"step": step, **ev})
                        logger.log(step, ev, kind="eval")
                    preempted = _any_process(flag.triggered)
                    if ckpt.should_save(step) or preempted:
                        ckpt.save(step, state, gather_data_state(it.get_state()), force=preempted)
                        last_saved = step
                    if preempted:
                        logger.log(step, {"event": "preempted", "signal": flag.signum}, kind="meta")
                        break
            if tc.save_final and last_saved != step and (step > start or ckpt.latest_step() is None):
                ckpt.save(step, state, gather_data_state(it.get_state()), force=True)
                last_saved = step
        finally:
            ckpt.close()
            flag.restore_handlers()
            logger.close()
        if last_saved > start and jax.process_index() == 0:  # the last save is on disk (else CheckpointError)
            ckpt.confirm_written(last_saved)
        return {"losses": losses, "eval": evals, "final_step": step, "wall_s": time.time() - t_start,
                "compile_s": compile_s, "state": state}
