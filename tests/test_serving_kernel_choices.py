"""The serving engine with the GPU (and TPU) kernel choices of ``implementation="auto"``, on CPU.

Regression for the H200 failure (2026-11-29, ``benchmarks/serve.py``, k3-small): building the engine with the
default ``"auto"`` kernels raised ``ValueError: broadcasted variable has a data dependency on the scan body``
in flax's ``nn.scan``. Cause: the KDA decode step was a bare ``pallas_call``, which JAX's dead-code elimination
never removes, and flax's scan constancy check relies on DCE (see :mod:`pallas_kernels.forward_only`). The
same held for the MXFP4 grouped matmuls and the TPU decode step.

Tracing needs no accelerator: the flax check runs at trace time, so the real (non-interpret) kernel choices of
``"auto"`` for a GPU / TPU target (``cfg.platform``) are traced here with ``jax.eval_shape``; the end-to-end test
runs them in the Pallas interpreter and compares the greedy tokens with the reference implementation.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.cache import init_cache
from k3_jax.config import load_config
from k3_jax.convert.fixture import random_params
from k3_jax.model import K3ForCausalLM
from k3_jax.serving.engine import Engine
from pallas_kernels import mla_decode
from pallas_kernels.kda import gpu as kda_gpu
from pallas_kernels.kda import gpu_decode_fused
from pallas_kernels.kda import tpu as kda_tpu
from pallas_kernels.moe import gpu as moe_gpu
from pallas_kernels.moe import tpu as moe_tpu

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

KERNEL_MODULES = {"gpu": (kda_gpu, moe_gpu), "tpu": (kda_tpu, moe_tpu)}


def _small_cfg(**changes):
    """k3-tiny cut to 3 layers (KDA dense, KDA MoE, MLA MoE), 8 experts top-2, fp32."""
    cfg = load_config("configs/k3-tiny.json")
    return cfg.replace(**{"num_hidden_layers": 3, "kda_layers": (0, 1), "mla_layers": (2,), "num_experts": 8,
                          "num_experts_per_token": 2, "dtype": "float32", **changes})


def _engine_cfg(**changes):
    """The engine tests' model: :func:`_small_cfg` without its dense layer (KDA MoE, MLA MoE): every kernel
    ``"auto"`` picks (KDA chunk and decode, MoE grouped matmul, MLA decode) still runs, in 2 segments instead
    of 3 (a dense FFN has no kernel)."""
    return _small_cfg(num_hidden_layers=2, kda_layers=(0,), mla_layers=(1,), first_k_dense_replace=0, **changes)


def _interpret_kernels(monkeypatch, platform: str) -> None:
    """Run the ``platform`` kernels (decode and chunked KDA, MoE) in the Pallas interpreter on this CPU host."""
    kda_mod, moe_mod = KERNEL_MODULES[platform]
    fused = [(gpu_decode_fused, "fused_decode_step")] if platform == "gpu" else []  # the layer's in-place decode
    for mod, fname in ((kda_mod, "decode_step"), (kda_mod, "chunk_kda_fwd"), (moe_mod, "gmm"),
                       (moe_mod, "gmm_mxfp4"), *fused):
        fn = getattr(mod, fname)
        monkeypatch.setattr(mod, fname, lambda *a, _fn=fn, **k: _fn(*a, **{**k, "interpret": True}))


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_auto_kernels_trace_in_scanned_model(platform, experts):
    """Prefill (T=4) and decode (T=1) with a cache trace through the scanned segments with the real kernels
    that ``"auto"`` picks for the target platform."""
    cfg = _small_cfg(expert_format=experts, platform=platform)
    params = random_params(cfg, seed=0, experts=experts)
    model = K3ForCausalLM(cfg)
    cache = init_cache(cfg, 2, 16)
    for t in (4, 1):
        logits, new_cache = jax.eval_shape(
            lambda p, x, c: model.apply({"params": p}, x, cache=c), params, jnp.zeros((2, t), jnp.int32), cache)
        assert logits.shape == (2, t, cfg.vocab_size)
        assert jax.tree.structure(new_cache) == jax.tree.structure(cache)


class _ScanKernel(nn.Module):
    """One scan step that feeds the carry through a forward-only kernel (the bare shape of the bug)."""

    fn: object

    @nn.compact
    def __call__(self, carry, _):
        return self.fn(carry), None


def _decode(mod, **kw):
    def fn(state):  # state [2, 2, 16, 16] f32 is the pool; q/k/v/g/beta derived from it
        x = state[:, :, :, 0]
        o, pool = mod.decode_step(x, x, x, -jnp.abs(x), jax.nn.sigmoid(x[..., 0]), 0.25, state,
                                  jnp.arange(2, dtype=jnp.int32), **kw)
        return pool + o[:, :, None, :]

    return fn


def _mxfp4_gmm(mod):
    codes = jnp.zeros((2, 16, 16), jnp.uint8)
    scales = jnp.full((2, 16, 1), 127, jnp.uint8)
    weights = [(codes, scales)]

    def fn(state):  # state [16, 32]
        return jnp.pad(mod.gmm_mxfp4(state, weights, jnp.array([8, 8], jnp.int32)), ((0, 0), (0, 16)))

    return fn


@pytest.mark.parametrize("name", ["kda_gpu_decode", "kda_tpu_decode", "moe_gpu_mxfp4", "moe_tpu_mxfp4"])
def test_forward_only_kernels_inside_nn_scan(name):
    """Each formerly bare ``pallas_call`` fed by the carry traces inside ``nn.scan`` (flax DCEs the body)."""
    fn, shape = {
        "kda_gpu_decode": (_decode(kda_gpu), (2, 2, 16, 16)),
        "kda_tpu_decode": (_decode(kda_tpu, heads_per_block=2), (2, 2, 16, 16)),
        "moe_gpu_mxfp4": (_mxfp4_gmm(moe_gpu), (16, 32)),
        "moe_tpu_mxfp4": (_mxfp4_gmm(moe_tpu), (16, 32)),
    }[name]
    scan = nn.scan(_ScanKernel, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    out = jax.eval_shape(lambda c: scan(fn).apply({}, c, None)[0], x)
    assert out.shape == shape


def test_decode_kernel_is_not_differentiable_with_a_clear_error():
    x = jnp.ones((1, 1, 16), jnp.float32)
    pool = jnp.zeros((1, 1, 16, 16), jnp.float32)

    def loss(q):
        o, _ = kda_gpu.decode_step(q, x, x, -x, jnp.ones((1, 1)), 0.25, pool, jnp.zeros(1, jnp.int32))
        return o.sum()

    with pytest.raises(NotImplementedError, match="kda.gpu.decode_step is a forward-only"):
        jax.grad(loss)(x)


def _greedy(cfg, params, prompts, steps):
    engine = Engine(cfg, params, max_batch=2, max_len=16, prefill_chunk=4, eos_ids=())
    return engine.generate(prompts, max_new_tokens=steps, stop_token_ids=())


def test_engine_gpu_kernels_interpret_equal_reference_greedy(monkeypatch):
    """Engine prefill (4 tokens: KDA chunk kernels, MoE grouped-matmul kernel) + 3 decode steps (KDA decode
    kernel on the state pool, MoE kernel) with the GPU choices of "auto" in interpret mode == the reference."""
    cfg = _engine_cfg()
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), random_params(cfg, seed=1))
    prompts = [[5, 17, 200, 3], [9, 1000, 64, 12]]
    want = _greedy(cfg.replace(kda_implementation="xla", moe_implementation="xla"), params, prompts, 4)
    _interpret_kernels(monkeypatch, "gpu")
    got = _greedy(cfg.replace(platform="gpu"), params, prompts, 4)
    assert got == want


def test_engine_tpu_kernels_interpret_equal_reference_greedy(monkeypatch):
    """The same with the TPU choices of "auto" and MXFP4 experts: the Mosaic TPU KDA kernels, the MXFP4
    grouped matmul on the HF-layout experts (read in place in the segment's stacked weights at decode) and the MLA
    decode kernel over the stacked latent cache."""
    cfg = _engine_cfg(expert_format="mxfp4")
    params = jax.tree.map(lambda x: np.asarray(x, np.uint8 if x.dtype == jnp.uint8 else np.float32),
                          random_params(cfg, seed=1, experts="mxfp4"))
    prompts = [[5, 17, 200, 3], [9, 1000, 64, 12]]
    want = _greedy(cfg.replace(kda_implementation="xla", moe_implementation="xla"), params, prompts, 4)
    _interpret_kernels(monkeypatch, "tpu")
    fn = mla_decode.latent_attention_tpu
    monkeypatch.setattr(mla_decode, "latent_attention_tpu", lambda *a, **k: fn(*a, **{**k, "interpret": True}))
    got = _greedy(cfg.replace(platform="tpu"), params, prompts, 4)
    assert got == want
