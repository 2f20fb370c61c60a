# ruff: noqa: E402
# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # k3-jax quickstart
#
# Train a small model with the **Kimi K3** architecture from scratch, generate text with the serving engine,
# save and restore an orbax checkpoint, and round-trip the weights through the released Hugging Face format.
#
# K3 mixes two attentions: **KDA** (Kimi Delta Attention, a linear attention whose memory is a fixed
# `[heads, K, V]` state per sequence) in most layers, and **MLA** (multi-head latent attention, which caches
# one small latent vector per token instead of per-head keys and values) in the rest. Its feed-forward layers
# are a **LatentMoE**: a router picks the top-k experts per token, and a learned bias keeps the load even.
#
# Sizes follow the backend: CPU → `configs/k3-tiny.json` (10 M parameters, a few minutes),
# GPU/TPU → `configs/k3-small.json` (253 M parameters, 120 M active per token). Environment variables
# override this: `K3_NOTEBOOK_CONFIG` (`tiny`, `small` or a config path), `K3_NOTEBOOK_STEPS`,
# `K3_NOTEBOOK_BATCH`, `K3_NOTEBOOK_SEQ_LEN`, `K3_NOTEBOOK_GEN_TOKENS`. Nothing is downloaded: the corpus and
# tokenizer ship inside the package. On Colab, upload or clone the k3-jax repository, `%cd` into its
# `examples/` folder, and run all cells.

# %% [markdown]
# ## 1. Install
# `pip install -e ..` installs the repository this notebook lives in; it is skipped when `k3_jax` already
# imports (on a GPU add the extra: `pip install -e "..[gpu]"`).

# %%
import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "k3_jax").is_dir() and (p / "configs").is_dir()),
            None)
if importlib.util.find_spec("k3_jax") is None:
    if REPO is None:
        raise RuntimeError("run this notebook from inside a k3-jax checkout (its examples/ folder)")
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e", str(REPO)])
    sys.path.insert(0, str(REPO))  # a running kernel does not re-read the editable install's .pth file
import k3_jax  # noqa: E402 - after the guarded install above

print("k3_jax from", Path(k3_jax.__file__).parent)

# %% [markdown]
# ## 2. Backend and sizes
# JAX picks the accelerator by itself; we only choose the model size and the compute dtype. XLA's CPU backend
# emulates bfloat16 (and has no bf16×bf16→f32 matmul), so on CPU we compute in float32.

# %%
import os

from k3_jax import xla_flags

xla_flags.apply_defaults()  # XLA:GPU matmuls on cuBLAS (3x faster train steps on an H200); before any computation

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3_jax.config import config_path, count_params  # noqa: E402

BACKEND = jax.default_backend()  # "cpu", "gpu" or "tpu"
CHOICE = os.environ.get("K3_NOTEBOOK_CONFIG") or ("tiny" if BACKEND == "cpu" else "small")
CONFIG = config_path(f"k3-{CHOICE}" if CHOICE in ("tiny", "small") else CHOICE)
SIZES = {"tiny": dict(steps=300, batch=4, seq_len=64, gen=48), "small": dict(steps=300, batch=16, seq_len=512, gen=64)}
size = SIZES.get(CHOICE, SIZES["tiny" if BACKEND == "cpu" else "small"])
STEPS = int(os.environ.get("K3_NOTEBOOK_STEPS", size["steps"]))
BATCH = int(os.environ.get("K3_NOTEBOOK_BATCH", size["batch"]))
SEQ_LEN = int(os.environ.get("K3_NOTEBOOK_SEQ_LEN", size["seq_len"]))
GEN_TOKENS = int(os.environ.get("K3_NOTEBOOK_GEN_TOKENS", size["gen"]))
DTYPE = "float32" if BACKEND == "cpu" else "bfloat16"
print(f"backend={BACKEND} ({jax.devices()[0].device_kind}) config={Path(CONFIG).name} steps={STEPS} "
      f"batch={BATCH}x{SEQ_LEN} dtype={DTYPE}")

# %% [markdown]
# ## 3. The model
# `Trainer` builds the model, the Muon/AdamW optimizer and the packed data pipeline from one `TrainConfig`.
# Layers of the same kind are stacked and run with `nn.scan`, so depth costs little compile time.

# %%
import tempfile

from k3_jax.model import layer_plan
from k3_jax.training.loop import TrainConfig, Trainer
from k3_jax.training.step import make_loss_fn

WORK = Path(tempfile.mkdtemp(prefix="k3-quickstart-"))  # everything this notebook writes goes here
tc = TrainConfig(config=CONFIG, model_overrides={"dtype": DTYPE}, workdir=str(WORK / "run"), steps=STEPS,
                 batch_size=BATCH, seq_len=SEQ_LEN, mesh="none", eval_every=0, tensorboard=False)
trainer = Trainer(tc)
cfg = trainer.cfg
n = count_params(cfg)
print(f"{n['total'] / 1e6:.1f} M parameters, {n['active'] / 1e6:.1f} M active per token")
print("layers:", " ".join(f"{cfg.mixer_kind(i)}/{cfg.ffn_kind(i)}" for i in range(cfg.num_hidden_layers)))
print("scanned segments:", [(s.start, s.period, s.repeats) for s in layer_plan(cfg)])

# %% [markdown]
# ## 4. Train
# Each step packs documents of the bundled corpus (Python's own documentation) into rows with segment ids
# (KDA state and MLA attention reset at document boundaries), computes a chunked cross-entropy, and updates
# the weights. Quantile Balancing then moves each MoE layer's router bias so that the next step's expert loads
# are even; that bias only selects experts and gets no gradient. The first step includes compilation.

# %%
import itertools
import time

from k3_jax.progress import Progress

state = trainer.init_state()
data = trainer.data_iterator("train")
train_step, _ = trainer.compiled_steps(state)
history = []  # one row per step, the same fields train.py writes to metrics.jsonl
bar = Progress("train", STEPS, unit="step")  # a bar on a terminal, a line every 10 s elsewhere
for step in range(1, STEPS + 1):
    batch = jax.tree.map(jnp.asarray, next(data))
    t0 = time.perf_counter()
    state, metrics = train_step(state, batch)
    metrics = jax.device_get(metrics)  # scalars, and per-MoE-layer vectors (load_max_mean_per_layer, ...)
    dt = time.perf_counter() - t0
    history.append({"step": step, "kind": "train", "time_s": dt, "tokens_per_s": BATCH * SEQ_LEN / dt,
                    **{k: float(v) if np.ndim(v) == 0 else np.asarray(v).tolist() for k, v in metrics.items()}})
    bar.update(1, loss=history[-1]["loss"])
bar.close()
step_times = [h["time_s"] for h in history[1:]] or [history[0]["time_s"]]
STEP_S = float(np.median(step_times))
print(f"first step (compile) {history[0]['time_s']:.1f} s; then {STEP_S * 1e3:.1f} ms/step, "
      f"{BATCH * SEQ_LEN / STEP_S:,.0f} tokens/s")

# one jitted forward for evaluation: (summed loss, (target tokens, correct tokens, router scores per MoE layer))
forward = jax.jit(make_loss_fn(trainer.model, trainer.step_cfg))
EVAL_BATCHES = [jax.tree.map(jnp.asarray, b) for b in itertools.islice(trainer.data_iterator("eval"), 2)]


def evaluate(params) -> dict:
    """Held-out loss (nats/token) and next-token accuracy over EVAL_BATCHES."""
    total = np.zeros(3)
    for b in EVAL_BATCHES:
        loss_sum, (tokens, correct, _) = forward(params, b)
        total += [float(loss_sum), float(tokens), float(correct)]
    return {"eval_loss": total[0] / total[1], "eval_accuracy": total[2] / total[1]}


EVAL = evaluate(state["params"])
print(f"train loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f}; held-out loss {EVAL['eval_loss']:.3f}, "
      f"next-token accuracy {EVAL['eval_accuracy']:.1%}")

# %% [markdown]
# The run in pictures, drawn by `k3_jax.training.plot` (the same figure as
# `python -m k3_jax.training.plot RUN_DIR` draws from a `train.py` run): loss, throughput, and the most loaded
# expert relative to the mean (1.0 = perfectly even) with the router bias and without it -- the gap is what
# Quantile Balancing buys -- then that ratio and the dead experts per MoE layer over the steps.

# %%
try:
    import matplotlib.pyplot as plt
except ImportError:
    plt = None
if plt is not None:
    from k3_jax.training.plot import figure

    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.ffn_kind(i) == "moe"]
    fig = figure([{"kind": "meta", "step": 0, "moe_layer_ids": moe_layers}, *history,
                  {"kind": "eval", "step": STEPS, **EVAL}], title=f"{Path(CONFIG).stem}, {STEPS} steps")
    plt.show()
else:
    print(" step   loss  load max/mean (bias | no bias)")
    for h in history[:: max(1, STEPS // 10)] + history[-1:]:
        print(f"{h['step']:5d} {h['loss']:6.3f}  {h['load_max_mean']:6.2f} | {h['load_max_mean_nobias']:6.2f}")

# %% [markdown]
# ## 5. Generate with the serving engine
# `Engine` keeps a decode cache with one row ("slot") per running request. For a KDA layer a slot holds a
# fixed-size state (plus a short convolution tail) whatever the length; for an MLA layer it holds one latent
# vector per token (`kv_lora_rank + rope` numbers), from which attention is computed directly. Requests join
# and leave the running batch without recompiling.

# %%
from k3_jax.cache import cache_bytes_per_sequence
from k3_jax.serving import Engine
from k3_jax.tokenizer import Tokenizer

tok = Tokenizer.bundled()
engine = Engine(cfg, state["params"], max_batch=4, max_len=GEN_TOKENS + 32, tokenizer=tok, prefill_mode="unit")
kda_layer = next(i for i in range(cfg.num_hidden_layers) if cfg.mixer_kind(i) == "kda")
mla_layer = next(i for i in range(cfg.num_hidden_layers) if cfg.mixer_kind(i) == "mla")
for seg, entries in zip(layer_plan(cfg), engine.cache["segments"], strict=True):
    for j, entry in entries.items():
        print(f"segment at layer {seg.start} {j} ({seg.kinds[int(j.split('_')[1])][0]}):",
              {k: tuple(v.shape) for k, v in entry.items()})
b = cache_bytes_per_sequence(cfg, 4096)
print(f"cache per 4096-token sequence: KDA state {b['kda_state'] / 2**20:.2f} MiB, "
      f"MLA latent {b['mla_latent'] / 2**20:.2f} MiB")

PROMPTS = ["def ", "The return value is", "class ", "If the"]
t0 = time.perf_counter()
outs = engine.generate([tok.encode(p, add_bos=True) for p in PROMPTS], max_new_tokens=GEN_TOKENS, temperature=0.0)
GEN_S = time.perf_counter() - t0
GENERATED = {p: p + tok.decode(o, skip_special=True) for p, o in zip(PROMPTS, outs, strict=True)}
for text in GENERATED.values():
    print(repr(text))
print(f"{sum(map(len, outs))} tokens in {GEN_S:.1f} s (greedy, incl. compilation)")

# %% [markdown]
# Streaming: `generate_stream` yields one `TokenEvent` per token with its text delta; here sampled at
# temperature 0.8.

# %%
for ev in engine.generate_stream([tok.encode("The ", add_bos=True)], max_new_tokens=GEN_TOKENS, temperature=0.8,
                                 seed=0):
    print(ev.text, end="")
print()

# %% [markdown]
# ## 6. Save and restore an orbax checkpoint
# The train state (float32 weights, optimizer state, router biases, RNG) and the data iterator's position are
# saved together, so a restored run continues exactly where it stopped. We restore into a freshly initialised
# state to show every array comes back.

# %%
from k3_jax.training.checkpoint import Checkpointer

ckpt = Checkpointer(WORK / "orbax")
ckpt.save(STEPS, state, data.get_state(), force=True)
ckpt.wait()
fresh = trainer.init_state()
restored, data_state, restored_step = ckpt.restore(fresh)
same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), jax.device_get(state), jax.device_get(restored))
print(f"restored step {restored_step}: {sum(jax.tree.leaves(same))}/{len(jax.tree.leaves(same))} arrays identical")
data.set_state(data_state)
ckpt.close()
assert all(jax.tree.leaves(same))

# %% [markdown]
# ## 7. Export to the release's Hugging Face format and load it back
# `save_checkpoint` writes `config.json`, `model.safetensors.index.json` and `model-XXXXX-of-XXXXXX.safetensors`
# shards with the released tensor names; `experts="mxfp4"` quantizes the routed experts to MXFP4 (4-bit values
# with one shared scale per 32), as in the release. `load_checkpoint` verifies the directory and converts it
# back; here the experts are dequantized to bf16, so the held-out loss measures what 4-bit experts cost.

# %%
from k3_jax.convert import load_checkpoint, save_checkpoint

HF_DIR = WORK / "hf"
params_np = jax.device_get(state["params"])
save_checkpoint(cfg, params_np, HF_DIR, experts="mxfp4", max_shard_bytes=max(1 << 20, n["total"] // 2))
for f in sorted(HF_DIR.iterdir()):
    print(f"{f.stat().st_size / 2**20:8.2f} MiB  {f.name}")
hf_cfg, hf_params = load_checkpoint(HF_DIR, experts="bf16")
# same tree and dtypes as training, so the compiled forward is reused
hf_params = jax.tree.map(lambda new, old: jnp.asarray(new, old.dtype), hf_params, state["params"])
HF_EVAL = evaluate(hf_params)
print(f"held-out loss: trained {EVAL['eval_loss']:.4f}, after MXFP4 export + load {HF_EVAL['eval_loss']:.4f}")

# %% [markdown]
# The same directory loads with the experts kept packed (`experts="mxfp4"`, 4.25 bits per weight in memory);
# `python -m k3_jax.convert fixture` writes a random checkpoint of any config in this format for tests.

# %%
packed_cfg, packed = load_checkpoint(HF_DIR)
moe = next(lay["block_sparse_moe"]["experts"]["w1"] for seg in packed["model"].values() if isinstance(seg, dict)
           for lay in seg.values() if isinstance(lay, dict) and "block_sparse_moe" in lay)
print(packed_cfg.expert_format, {k: (v.shape, str(v.dtype)) for k, v in moe.items()})

# %% [markdown]
# ## 8. MoE routing: expert loads
# The router scores every expert with a sigmoid and picks the top-k of `score + bias`. The forward pass sows
# the scores, so one held-out batch gives the share of tokens each expert received in every MoE layer, with
# the trained bias and (for comparison) without it.

# %%
_, (_, _, scores) = jax.device_get(forward(state["params"], EVAL_BATCHES[0]))
E, K = cfg.num_experts, cfg.num_experts_per_token


def token_share(s: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Fraction of routed slots per expert [E] for router scores s [N, E] and bias [E]."""
    top = np.argsort(-(s + bias), axis=-1)[:, :K]
    return np.bincount(top.ravel(), minlength=E) / top.size


LAYERS, LOADS, LOADS_NOBIAS = [], [], []
for s_idx, seg in enumerate(layer_plan(cfg)):
    for j in range(seg.period):
        path = ("model", f"segment_{s_idx}", f"layer_{j}", "block_sparse_moe")
        if path not in scores:
            continue
        bias = jax.device_get(state["params"]["model"][path[1]][path[2]]["block_sparse_moe"]["gate"][
            "e_score_correction_bias"])  # [repeats, E]
        for r in range(seg.repeats):
            LAYERS.append(seg.layer(r, j))
            LOADS.append(token_share(scores[path][r], bias[r]))
            LOADS_NOBIAS.append(token_share(scores[path][r], 0.0))
order = np.argsort(LAYERS)
LAYERS = [LAYERS[i] for i in order]
LOADS, LOADS_NOBIAS = np.stack(LOADS)[order], np.stack(LOADS_NOBIAS)[order]  # [moe layers, E]
if plt is not None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.3 * len(LAYERS) + 1.6), sharey=True)
    vmax = max(LOADS.max(), LOADS_NOBIAS.max())
    for ax, mat, title in ((axes[0], LOADS, "with QB bias"), (axes[1], LOADS_NOBIAS, "without bias")):
        im = ax.imshow(mat, aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
        ax.set(xlabel="expert", title=f"token share, {title}")
    axes[0].set_yticks(range(len(LAYERS)), [f"layer {i}" for i in LAYERS])
    fig.colorbar(im, ax=list(axes), fraction=0.03)
    plt.show()
else:
    print(f"token share per expert, with the QB bias (' ' = 0, '*' = uniform 1/{E}, '@' = 1.5x or more)")
    for layer, row in zip(LAYERS, LOADS, strict=True):
        cells = "".join(" .:-=+*#%@"[min(9, int(round(x * E * 6)))] for x in row)
        print(f"layer {layer:2d} |{cells}|")
print("max/mean load per layer, with bias:", np.round(LOADS.max(1) * E, 2).tolist())
print("max/mean load per layer, no bias:  ", np.round(LOADS_NOBIAS.max(1) * E, 2).tolist())

# %% [markdown]
# ## 9. Summary
# The numbers of this run in one place (written to `$K3_NOTEBOOK_OUT/summary.json` when that is set), then the
# temporary directory is removed.

# %%
import json
import shutil

SUMMARY = {
    "backend": BACKEND, "device": jax.devices()[0].device_kind, "config": Path(CONFIG).name, "dtype": DTYPE,
    "steps": STEPS, "batch": BATCH, "seq_len": SEQ_LEN, "params_m": round(n["total"] / 1e6, 1),
    "loss_curve": {h["step"]: round(h["loss"], 3) for h in history[:: max(1, STEPS // 10)] + history[-1:]},
    "eval_loss": round(EVAL["eval_loss"], 4), "eval_loss_mxfp4_export": round(HF_EVAL["eval_loss"], 4),
    "first_step_s": round(history[0]["time_s"], 1), "step_ms": round(STEP_S * 1e3, 1),
    "tokens_per_s": round(BATCH * SEQ_LEN / STEP_S), "generated": GENERATED,
    "load_max_mean": {"bias": round(float(LOADS.max(1).mean() * E), 2),
                      "no_bias": round(float(LOADS_NOBIAS.max(1).mean() * E), 2)},
}
print(json.dumps(SUMMARY, indent=1))
if os.environ.get("K3_NOTEBOOK_OUT"):
    Path(os.environ["K3_NOTEBOOK_OUT"]).mkdir(parents=True, exist_ok=True)
    (Path(os.environ["K3_NOTEBOOK_OUT"]) / "summary.json").write_text(json.dumps(SUMMARY, indent=1))
shutil.rmtree(WORK, ignore_errors=True)
