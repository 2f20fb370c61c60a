"""The train step's once-per-step bf16 cast of GEMM-only weights: which leaves, and unchanged gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from k3_jax.config import load_config
from k3_jax.convert.fixture import random_params
from k3_jax.model import K3ForCausalLM
from k3_jax.training.compute_cast import cast_for_compute, compute_cast_mask
from k3_jax.training.step import StepConfig, make_loss_fn


def _paths(tree, mask):
    return {"/".join(str(k.key) for k in p) for (p, _), m in
            zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(mask), strict=True) if m}


def test_mask_selects_gemm_weights_only():
    cfg = load_config("configs/k3-tiny.json")
    params = nn.unbox(jax.eval_shape(K3ForCausalLM(cfg).init, jax.random.key(0),
                                     jnp.zeros((1, 8), jnp.int32))["params"])
    cast = _paths(params, compute_cast_mask(params))
    names = {p.split("/", 2)[-1] if p.startswith("model/segment") else p for p in cast}
    assert {"layer_0/self_attn/q_proj/kernel", "layer_0/self_attn/q_b_proj/kernel",
            "layer_0/block_sparse_moe/experts/w2", "layer_0/mlp/down_proj/kernel",
            "layer_0/block_sparse_moe/shared_experts/up_proj/kernel",
            "layer_0/block_sparse_moe/routed_expert_down_proj/kernel"} <= names
    for kept in ("gate/kernel", "conv1d/kernel", "kv_b_proj/kernel", "lm_head/kernel", "embedding",
                 "weight", "A_log", "dt_bias", "e_score_correction_bias"):
        assert not any(p.endswith(kept) for p in cast), kept


def test_precast_gradients_equal_per_use_casts():
    """bf16 model on CPU: loss and every gradient are the same whether GEMM weights are cast per use (f32
    masters in) or once before (bf16 copies in)."""
    # k3-tiny cut to 2 layers (KDA dense, MLA MoE): every kind of cast leaf (24 of 53), a quick compile
    cfg = load_config("configs/k3-tiny.json").replace(num_hidden_layers=2, kda_layers=(0,), mla_layers=(1,),
                                                      num_experts=8, num_experts_per_token=2, dtype="bfloat16")
    model = K3ForCausalLM(cfg)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(2, 33)), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 13], 2, axis=0), jnp.int32)
    # the init tree with random values (numpy, no init compile); every leaf gets fp32 noise, so the fp32 masters
    # of the cast leaves are not bf16 numbers (random_params stores GEMM weights in bf16, their checkpoint dtype)
    params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float32)
                                                * (1 + 1e-2 * rng.standard_normal(x.shape, dtype=np.float32))),
                          random_params(cfg, seed=0))
    abstract = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens[:, :-1])["params"])
    assert jax.tree.structure(params) == jax.tree.structure(abstract)
    assert all(a.shape == b.shape and a.dtype == b.dtype
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(abstract), strict=True))
    loss_fn = make_loss_fn(model, StepConfig())
    grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    batch = {"tokens": tokens, "segment_ids": seg}
    (l_ref, _), g_ref = grad(params, batch)
    mask = compute_cast_mask(params)
    (l_cast, _), g_cast = grad(cast_for_compute(params, mask, jnp.bfloat16), batch)
    np.testing.assert_allclose(l_cast, l_ref, rtol=1e-6)
    n_cast = 0
    for (path, a), b, m in zip(jax.tree_util.tree_leaves_with_path(g_cast), jax.tree.leaves(g_ref),
                               jax.tree.leaves(mask), strict=True):
        assert a.dtype == (jnp.bfloat16 if m else b.dtype), path
        n_cast += m
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-9,
                                   err_msg=jax.tree_util.keystr(path))
    assert n_cast >= 20
