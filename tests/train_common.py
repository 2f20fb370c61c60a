"""Shared pieces of the training tests: small random parameters and a compiled trainer with a fixed batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3_jax.training.loop import TrainConfig, Trainer


def draw_params(params, rng: np.random.Generator):
    """Random values for an (unboxed, abstract) parameter tree: router bias 0, vectors 1, matrices N(0, 0.02²)."""

    def draw(path, leaf):
        if "e_score_correction_bias" in jax.tree_util.keystr(path):
            return jnp.zeros(leaf.shape, leaf.dtype)
        if len(leaf.shape) < 2:
            return jnp.ones(leaf.shape, leaf.dtype)
        return jnp.asarray(0.02 * rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, params)


def compiled_trainer(tc: TrainConfig, batch: int, seq: int):
    """``(trainer, initial state, compiled train step, one global batch [batch, seq + 1] of random tokens)``."""
    tr = Trainer(tc)
    state = tr.init_state()
    train_step, _ = tr.compiled_steps(state)
    rng = np.random.default_rng(0)
    rows = {"tokens": rng.integers(3, tr.cfg.vocab_size, (batch, seq + 1)).astype(np.int32),
            "segment_ids": np.ones((batch, seq + 1), np.int32)}
    return tr, state, train_step, tr._to_global(rows)
