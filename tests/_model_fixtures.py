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


def kda_verify_pass(platform: str, dtype: str = "float32"):
    """``(verify_pass, params, x, cache, cfg)``: the tiny config's KDA layer traced for ``platform`` through its verify
    pass (``record_position_states``) over T = 5 tokens of 2 rows, with abstract params; ``verify_pass(params, x,
    cache)`` returns the layer's ``(y, cache entry)``."""
    import jax
    import jax.numpy as jnp

    from k3_jax.layers.kda import KimiDeltaAttention, record_position_states

    cfg = tiny_config(platform=platform, dtype=dtype)
    h, dk, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
    layer = KimiDeltaAttention(cfg)
    x = jnp.zeros((2, 5, cfg.hidden_size), dtype)
    cache = {"state": jnp.zeros((2, h, dk, dk), jnp.float32), "conv": jnp.zeros((2, w - 1, 3 * h * dk), dtype)}
    params = jax.eval_shape(lambda: layer.init(jax.random.PRNGKey(0), x, cache=cache))

    def verify_pass(p, x, cache):
        with record_position_states():
            return layer.apply(p, x, cache=cache)

    return verify_pass, params, x, cache, cfg


def scanned_segment_config_and_params(seed: int):
    """k3-tiny's widths cut to four MoE layers ``[KDA, MLA] x 2`` (one scanned segment of two repeats), fp32, and
    its random params as numpy fp32: ``(cfg, params)``."""
    import jax

    from k3_jax.convert.fixture import random_params
    from k3_jax.model import layer_plan

    cfg = tiny_config(num_hidden_layers=4, kda_layers=(0, 2), mla_layers=(1, 3), first_k_dense_replace=0)
    assert [(s.period, s.repeats) for s in layer_plan(cfg)] == [(2, 2)]
    return cfg, jax.tree.map(lambda x: np.asarray(x, np.float32), random_params(cfg, seed=seed))
