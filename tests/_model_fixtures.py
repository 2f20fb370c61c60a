"""Shared tiny-model fixtures (fp32, so comparisons can be tight); built once per test session."""

from __future__ import annotations

import functools
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest

from k3_jax.config import K3Config, load_config
from k3_jax.model import K3ForCausalLM

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def tiny_config(**overrides) -> K3Config:
    return load_config(REPO / "configs" / "k3-tiny.json", **{"dtype": "float32", **overrides})


@functools.cache
def tiny_model_and_params(seed: int = 0):
    cfg = tiny_config()
    model = K3ForCausalLM(cfg)
    tokens = jax.numpy.zeros((1, 8), jax.numpy.int32)
    variables = jax.jit(model.init)(jax.random.PRNGKey(seed), tokens)
    return cfg, model, nn.unbox(variables)


@functools.cache
def jitted_apply(cfg: K3Config):
    return jax.jit(K3ForCausalLM(cfg).apply)


FIXTURES = Path(__file__).parent / "fixtures"


def load_golden(name: str, generator: str) -> dict[str, np.ndarray]:
    """Every array of ``tests/fixtures/<name>`` (skips, naming ``generator``, when the file is missing)."""
    path = FIXTURES / name
    if not path.exists():
        pytest.skip(f"golden file {path} missing (generate with tests/fixtures/{generator})")
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 values stored as their ``uint16`` bit patterns -> the same values in float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)
