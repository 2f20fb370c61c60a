"""Training metrics: FLOPs per token from the config, MFU, and the loggers (progress, JSONL, TensorBoard).

FLOPs per trained token (:func:`flops_per_token`) = 3 × forward FLOPs (backward ≈ 2 × forward), where the
forward counts multiply-adds as 2 FLOPs and has
  * matmuls: ``2 · active`` with ``active`` from :func:`k3_jax.config.count_params` (every projection, the
    shared experts, the top-k routed experts, the router, lm_head; the embedding lookup excluded);
  * MLA attention per MLA layer, causal over a packed row of length T (mean context ``(T+1)/2``):
    ``2 · ctx · H · (qk_nope + qk_rope)`` for the scores + ``2 · ctx · H · v_head_dim`` for the values;
  * KDA per KDA layer (chunked form, chunk C): ``4 · H · Dk · Dv`` for the state read-out and state update
    (inter-chunk) + ``2 · (C/2) · H · (Dk + Dv)`` for the causal intra-chunk scores and values.
Elementwise work (norms, SiTU, gates, softmax, AttnRes mixing) is not counted, so MFU is conservative.
MFU = achieved FLOP/s ÷ (peak bf16 dense FLOP/s per device × devices); the peak table covers common
accelerators (``--peak-tflops`` overrides); on CPU MFU is reported as null.

The optimizer's own FLOPs are not model FLOPs and are not in MFU. Muon's Newton–Schulz iterations cost a fixed
amount per step (:func:`muon_flops_per_step`), independent of the tokens in the step; at K3's widths they are
hundreds of TFLOP, so a step of a few thousand tokens is optimizer-bound, and a benchmark should state its
tokens per optimizer step (``batch × seq_len``, gradient accumulation included) next to its MFU.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import jax

from k3_jax.config import K3Config, count_params
from k3_jax.progress import Progress
from k3_jax.training.optim import block_shape, muon_heads

# bf16 dense peak TFLOP/s per device
PEAK_TFLOPS = {
    "h200": 989.0, "h100": 989.0, "h800": 989.0, "gh200": 989.0, "b200": 2250.0, "a100": 312.0,
    "tpu v4": 275.0, "tpu v5 lite": 197.0, "tpu v5e": 197.0, "tpu v5p": 459.0, "tpu v5": 459.0,
    "tpu v6 lite": 918.0, "tpu v6e": 918.0, "tpu7x": 2307.0,
}


def flops_per_token(cfg: K3Config, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token: ``{"matmul", "attention", "total"}`` (see module docstring)."""
    active = count_params(cfg)["active"]
    ctx = (seq_len + 1) / 2
    n_mla = sum(1 for i in range(cfg.num_hidden_layers) if cfg.mixer_kind(i) == "mla")
    n_kda = cfg.num_hidden_layers - n_mla
    mla = 2 * ctx * cfg.num_attention_heads * (cfg.q_head_dim + cfg.v_head_dim)
    c = min(cfg.kda_chunk_size, seq_len)
    kda = (4 * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim
           + 2 * (c / 2) * cfg.kda_num_heads * 2 * cfg.kda_head_dim)
    matmul = 3 * 2 * active
    attn = 3 * (n_mla * mla + n_kda * kda)
    return {"matmul": float(matmul), "attention": float(attn), "total": float(matmul + attn)}


def muon_flops_per_step(abstract_params: Any, labels: Any, ns_steps: int = 5) -> float:
    """FLOPs of Muon's Newton–Schulz orthogonalisation per optimizer step (all ``muon*``-labelled leaves).

    Per ``a × b`` block (``a ≤ b``; per head for ``muon_h*`` labels, per leading index for stacked leaves), one
    quintic iteration is ``X Xᵀ`` (``2a²b``) + ``S S`` (``2a³``) + ``P X`` (``2a²b``). ``abstract_params`` and
    ``labels`` are matching pytrees (arrays or ShapeDtypeStructs; labels from ``optim.param_labels``).
    """
    total = 0
    for p, lab in zip(jax.tree.leaves(abstract_params), jax.tree.leaves(labels), strict=True):
        if not lab.startswith("muon"):
            continue
        heads = muon_heads(lab)
        a, b = sorted(block_shape(p.shape, heads))
        total += ns_steps * (4 * a * a * b + 2 * a ** 3) * math.prod(p.shape[:-2]) * max(heads, 1)
    return float(total)


def peak_flops_per_device(override_tflops: float | None = None) -> float | None:
    """Peak bf16 FLOP/s of one local device (None if unknown, e.g. CPU)."""
    if override_tflops:
        return override_tflops * 1e12
    kind = jax.devices()[0].device_kind.lower()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in kind:
            return PEAK_TFLOPS[key] * 1e12
    return None


class MetricsLogger:
    """JSONL always; progress through :class:`k3_jax.progress.Progress` (a tqdm bar on a terminal, else plain
    ``train: …`` lines every ``K3_PROGRESS_INTERVAL_S`` seconds with steps, step/s, ETA and tokens/s) plus a
    metrics line every ``print_every`` steps; TensorBoard when ``tensorboardX`` (or ``torch.utils.tensorboard``)
    is installed. Only process 0 writes."""

    def __init__(self, workdir: str | os.PathLike, total_steps: int, *, print_every: int = 10,
                 tensorboard: bool = True, start_step: int = 0):
        self.enabled = jax.process_index() == 0
        self.total = total_steps
        self.print_every = max(1, print_every)
        self._progress = None
        self._tb = None
        self._jsonl = None
        if not self.enabled:
            return
        Path(workdir).mkdir(parents=True, exist_ok=True)
        self._jsonl = open(Path(workdir) / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        self._progress = Progress("train", total_steps, unit="step", initial=start_step)
        if tensorboard:
            self._tb = _tensorboard_writer(Path(workdir) / "tb")

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        if not self.enabled:
            return
        row = {"step": step, "kind": kind, "time": round(time.time(), 3)}
        row.update({k: _py(v) for k, v in metrics.items()})
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, int | float) and k not in ("step", "time"):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)
        short = _short(row)
        if kind == "train":
            self._progress.set(step, **{k: row[k] for k in _PROGRESS_KEYS if row.get(k) is not None})
        if self._progress.mode == "bar":
            if kind != "train":
                self._progress.write(f"[{kind} {step}] {short}")
        elif kind != "train" or step % self.print_every == 0 or step == self.total:
            print(f"[{kind} {step}/{self.total}] {short}", flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


_PROGRESS_KEYS = ("loss", "tokens_per_s", "mfu")


def _tensorboard_writer(path: Path):
    for mod in ("tensorboardX", "torch.utils.tensorboard"):
        try:
            module = __import__(mod, fromlist=["SummaryWriter"])
            return module.SummaryWriter(str(path))
        except Exception:  # noqa: BLE001 - optional dependency of any kind missing/broken
            continue
    return None


def _py(v: Any) -> Any:
    if hasattr(v, "tolist") and getattr(v, "ndim", 0) > 0:  # per-layer vectors -> JSON lists
        return [_py(x) for x in v.tolist()]
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float):
        return None if math.isnan(v) else round(v, 6)
    return v


def _short(row: dict) -> str:
    keys = ("loss", "eval_loss", "accuracy", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s",
            "load_max_mean", "dead_experts")
    parts = []
    for k in keys:
        v = row.get(k)
        if v is None:
            continue
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)
