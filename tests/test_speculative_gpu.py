"""On a GPU (``-m gpu``): the forwards the H200 speculative pipeline (``benchmarks/speculative_h200.sh``) rests on.

* the plain engine's cached forward (two prompts served at once: prefill pieces of 64 + 1 and 32 + 8 + 4 + 1 tokens,
  with ``auto`` also 64 · 3 + 8 and 64 · 2 + 32 + 16 + 4; then decode steps) against the uncached full forward of the
  prompt and the generated tokens (KDA and experts in plain XLA), teacher-forced on the engine's tokens, per
  backend, so a failure names it: KDA ``auto`` (on sm_90+ the Mosaic GPU chunk forward, else Triton) and
  ``xla``; experts ``auto`` (the Triton kernel, which reads the stacked expert weights in place in every cached
  forward on one device) and ``xla``;
* the Mosaic GPU chunk forward at the engine's prefill-piece shapes (one chunk: T = 64, 33, 1, with an initial
  state and the final state) against the fp32 reference (T = 64 and 33 were wrong while its per-chunk kernel fed
  wgmma A operands from registers);
* the speculative engine with a random draft: finite log-probabilities, an acceptance a random draft can reach
  (a degenerate forward accepts every draft), and greedy output equal to the plain engine's up to a near-tie.

bf16, random weights of ``configs/k3-tiny.json`` with K3's KDA head dim (128, what the Mosaic GPU kernels take).
On a CPU host they are skipped (``tests/conftest.py``)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.draft import DraftConfig, DraftModel, target_head
from k3_jax.model import K3ForCausalLM
from k3_jax.serving.engine import Engine
from k3_jax.serving.speculative import SpeculativeEngine
from tests._gpu import skip_unless_hopper
from tests._model_fixtures import tiny_config

NEW = 8
TIE = 0.3
"""Log-probability tolerance: the bf16 cached engine vs the full forward differ by up to 0.13 (CPU) / 0.18 (H200);
constant logits miss by ~0.9."""


def _config(kda: str = "auto", dtype: str = "bfloat16", moe: str = "auto"):
    return tiny_config(dtype=dtype, kda_head_dim=128, kda_num_heads=2, kda_implementation=kda,
                       kda_decode_implementation=kda, kda_verify_implementation=kda, moe_implementation=moe)


@functools.cache
def _params(dtype: str = "bfloat16"):
    cfg = _config(dtype=dtype)
    variables = jax.jit(K3ForCausalLM(cfg).init)(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    return nn.unbox(variables)["params"]


def _prompt(n: int, vocab: int) -> list[int]:
    return np.random.RandomState(n).randint(3, vocab, n).tolist()


def _full_logprobs(dtype: str, params, tokens: list[int]) -> np.ndarray:
    """Log-probabilities ``[T, V]`` of the uncached full forward over ``tokens``, KDA in plain XLA (the reference
    every backend's engine is held to)."""
    model = K3ForCausalLM(_config("xla", dtype, "xla"))
    logits = jax.jit(model.apply)({"params": params}, jnp.asarray([tokens], jnp.int32))
    return np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1))


def _engine_events(engine, prompts: list[list[int]]) -> list[list]:
    """Each prompt's events of one greedy ``generate_stream`` over all of them (rows served at once)."""
    rows: list[list] = [[] for _ in prompts]
    for ev in engine.generate_stream(prompts, max_new_tokens=NEW, stop_token_ids=[], logprobs=2):
        rows[int(ev.request_id.split("-")[1])].append(ev)
    return rows


def engine_deviation(kda: str, moe: str, prompt_len: int, dtype: str = "bfloat16") -> list[dict]:
    """Per prompt (two served at once, slots 0 and 1; the second 20 tokens shorter: other prefill pieces), how far
    the plain engine's greedy generation is from the uncached full forward teacher-forced on the engine's own
    tokens: ``err`` = max |engine log-probability of its token - the full forward's|, ``gap`` = max (the full
    forward's best log-probability - that of the engine's token), ``finite``."""
    cfg = _config(kda, dtype, moe)
    params = _params(dtype)
    prompts = [_prompt(prompt_len, cfg.vocab_size), _prompt(prompt_len - 20, cfg.vocab_size)]
    engine = Engine(cfg, params, max_batch=2, max_len=prompt_len + NEW + 8, prefill_chunk=64)
    out = []
    for prompt, events in zip(prompts, _engine_events(engine, prompts), strict=True):
        tokens = [ev.token for ev in events]
        lp_engine = np.asarray([ev.top_logprobs[0][1] for ev in events])
        ref = _full_logprobs(dtype, params, prompt + tokens[:-1])[len(prompt) - 1:]  # [NEW, V]
        chosen = ref[np.arange(len(tokens)), tokens]
        out.append({"prompt": len(prompt), "tokens": len(tokens), "finite": bool(np.isfinite(lp_engine).all()),
                    "err": float(np.max(np.abs(lp_engine - chosen))), "gap": float(np.max(ref.max(-1) - chosen))})
    return out


def check_engine_against_full_forward(kda: str, moe: str, prompt_len: int, dtype: str = "bfloat16") -> None:
    """The engine's log-probabilities within :data:`TIE` of the full forward's on the same tokens, each greedy
    token within :data:`TIE` of the full forward's best (bf16 near-ties may flip), every value finite. A
    degenerate forward (non-finite, or constant logits: every log-probability ``-log V``) misses by far more."""
    for row in engine_deviation(kda, moe, prompt_len, dtype):
        where = f"kda={kda}, moe={moe}: {row}"
        assert row["tokens"] == NEW and row["finite"], where
        assert row["err"] < TIE and row["gap"] < TIE, where


@pytest.mark.gpu
@pytest.mark.timeout(420)  # the auto cases compile the Mosaic GPU KDA kernels for each prefill piece
@pytest.mark.parametrize("kda, moe, prompt_len", [("auto", "auto", 65), ("auto", "auto", 200), ("xla", "auto", 65),
                                                  ("xla", "xla", 65)])
def test_gpu_engine_matches_full_forward_per_backend(kda, moe, prompt_len):
    check_engine_against_full_forward(kda, moe, prompt_len)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [64, 33, 1])
def test_gpu_mosaic_chunk_forward_at_prefill_piece_shapes(t):
    from pallas_kernels.kda import mosaic_gpu
    from pallas_kernels.kda import reference as ref
    skip_unless_hopper()
    ks = jax.random.split(jax.random.PRNGKey(t), 6)
    b, h, d = 1, 2, 128
    q, k, v = (jax.random.normal(kk, (b, t, h, d), jnp.float32).astype(jnp.bfloat16) for kk in ks[:3])
    k = k / jnp.linalg.norm(k.astype(jnp.float32), axis=-1, keepdims=True).astype(jnp.bfloat16)
    g = -jax.random.uniform(ks[3], (b, t, h, d), jnp.float32, 0.0, 1.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h), jnp.float32))
    h0 = jax.random.normal(ks[5], (b, h, d, d), jnp.float32) * 0.1
    o, ht = jax.jit(lambda *a: mosaic_gpu.chunk_kda_fwd(*a, d**-0.5, h0))(q, k, v, g, beta)
    f = lambda x: x.astype(jnp.float32)
    ro, rh = ref.chunk_kda(f(q), f(k), f(v), g, f(beta), None, h0, True)
    rel = lambda a, r: float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(r, np.float64))
                             / np.linalg.norm(np.asarray(r, np.float64)))
    assert np.isfinite(np.asarray(ht)).all() and np.isfinite(np.asarray(o, np.float32)).all()
    assert rel(o, ro) < 1e-2 and rel(ht, rh) < 1e-2, (rel(o, ro), rel(ht, rh))


def check_speculative_engine(dtype: str = "bfloat16") -> None:
    """A random draft through the speculative engine (module docstring)."""
    cfg = _config("auto", dtype)
    params = _params(dtype)
    dcfg = DraftConfig.default_for(cfg)
    emb, head = target_head(cfg, params)
    dp = nn.unbox(jax.jit(DraftModel(cfg, dcfg).init)(
        jax.random.PRNGKey(1), jnp.zeros((1, 2, cfg.hidden_size * len(dcfg.feature_layers)), cfg.dtype),
        jnp.zeros((1, 2), jnp.int32), emb, head))["params"]
    prompts = [_prompt(n, cfg.vocab_size) for n in (65, 30)]
    plain = Engine(cfg, params, max_batch=2, max_len=90, prefill_chunk=64)
    spec = SpeculativeEngine(cfg, params, dp, dcfg, num_draft_tokens=4, max_batch=2, max_len=90, prefill_chunk=64)
    for want, got in zip(_engine_events(plain, prompts), _engine_events(spec, prompts), strict=True):
        lp = np.asarray([[x for _, x in ev.top_logprobs] for ev in got])
        assert np.isfinite(lp).all(), f"non-finite speculative log-probabilities {lp[:, 0]}"
        a, b = [ev.token for ev in want], [ev.token for ev in got]
        if a != b:
            i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            margin = want[i].top_logprobs[0][1] - want[i].top_logprobs[1][1]
            assert margin < TIE, f"speculative {b} vs plain {a}: first difference at {i}, plain margin {margin:.4f}"
    # a random draft over 1,024 ids agrees with the target's argmax on few tokens: all of them means a degenerate
    # forward (e.g. every logit NaN: argmax 0 on both sides)
    assert spec.spec.acceptance_rate < 0.9, spec.spec.as_dict()


@pytest.mark.gpu
@pytest.mark.timeout(600)  # compiles the most programs of the GPU suite, each with the Mosaic GPU KDA kernels
def test_gpu_speculative_engine_with_a_random_draft():
    check_speculative_engine()
