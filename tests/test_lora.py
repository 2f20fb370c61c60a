"""LoRA adapters (k3_jax.training.lora) and QAT (cfg.qat="mxfp4") on a 3-layer cut of k3-tiny (fp32)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3_jax.config import load_config
from k3_jax.convert.hf import load_checkpoint
from k3_jax.model import K3ForCausalLM
from k3_jax.quant import dequantize_mxfp8, quantize_mxfp8
from k3_jax.quant.mxfp4 import fake_quant_mxfp4, pack_mxfp4, unpack_mxfp4
from k3_jax.training import lora
from k3_jax.training.optim import OptimConfig, build_optimizer
from k3_jax.training.step import StepConfig, make_train_step
from sharding.rules import logical_to_pspec
from tests.train_common import draw_params

RANK = 4


@functools.cache
def _apply(cfg):
    return jax.jit(K3ForCausalLM(cfg).apply)


@pytest.fixture(scope="module")
def setup():
    # one MLA MoE layer: Linear (KDA's projections are Linear too), kv_b_proj, shared/latent/routed experts;
    # few, small compiles (params drawn from the abstract tree instead of compiling model.init)
    cfg = load_config("configs/k3-tiny.json").replace(num_hidden_layers=1, kda_layers=(), mla_layers=(0,),
                                                      first_k_dense_replace=0, num_experts=8,
                                                      num_experts_per_token=2, dtype="float32")
    model = K3ForCausalLM(cfg)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(2, 9)), jnp.int32)
    boxed = jax.eval_shape(model.init, jax.random.key(0), tokens[:, :-1])["params"]

    params = draw_params(nn.unbox(boxed), rng)
    lc = lora.LoraConfig(rank=RANK, alpha=8.0)
    adapters = lora.init_adapters(params, lc, jax.random.key(1))
    return cfg, model, tokens, boxed, params, lc, adapters


def KDA_BOXED():  # noqa: N802
    """Abstract params of a 1-layer KDA model (shapes and names only, nothing compiled)."""
    cfg = load_config("configs/k3-tiny.json").replace(num_hidden_layers=1, kda_layers=(0,), mla_layers=())
    return jax.eval_shape(K3ForCausalLM(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]


def _randomised(adapters):
    """Adapters with non-zero ``b`` (a fresh adapter is the identity)."""
    keys = iter(jax.random.split(jax.random.key(2), 1000))
    return jax.tree_util.tree_map_with_path(
        lambda p, x: 0.05 * jax.random.normal(next(keys), x.shape) if str(p[-1].key).endswith("lora_b") else x,
        adapters)


def test_lora_model_equals_merged_model(setup):
    cfg, model, tokens, _, params, _, adapters = setup
    apply = _apply(cfg)
    full = lora.with_adapters(params, _randomised(adapters))
    merged = lora.merge(full)
    assert jax.tree.structure(merged) == jax.tree.structure(params)
    y_lora = apply({"params": full}, tokens)
    y_merged = apply({"params": merged}, tokens)
    y_base = apply({"params": params}, tokens)
    np.testing.assert_allclose(np.asarray(y_lora), np.asarray(y_merged), atol=2e-5, rtol=2e-5)
    assert float(jnp.max(jnp.abs(y_lora - y_base))) > 1e-2  # the adapters do change the model
    fresh = lora.merge(lora.with_adapters(params, adapters))  # b = 0: merging changes no weight
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(params), strict=True))


def test_shared_a_per_expert_b_shapes_and_sharding(setup):
    cfg, _, _, boxed, _, lc, _ = setup
    e, lat, im = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    shapes = lora.adapter_shapes(boxed, lc)
    exp = shapes["model"]["segment_0"]["layer_0"]["block_sparse_moe"]["experts"]
    reps = nn.unbox(boxed["model"]["segment_0"]["layer_0"]["block_sparse_moe"]["experts"]["w1"]).shape[0]
    kda = lora.adapter_shapes(KDA_BOXED(), lora.LoraConfig(rank=RANK, targets=("attention",)))
    kda_attn = kda["model"]["segment_0"]["layer_0"]["self_attn"]
    assert {"q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_proj", "o_proj"} <= set(kda_attn)
    assert nn.unbox(exp["w1_lora_a"]).shape == (reps, lat, RANK)  # one A for all experts
    assert nn.unbox(exp["w1_lora_b"]).shape == (reps, e, RANK, im)  # one B per expert
    assert nn.unbox(exp["w2_lora_a"]).shape == (reps, im, RANK)
    assert nn.unbox(exp["w2_lora_b"]).shape == (reps, e, RANK, lat)
    assert exp["w1_lora_b"].names == ("layers", "experts", "lora_rank", "expert_mlp")
    per = lora.adapter_shapes(boxed, lora.LoraConfig(rank=RANK, experts="per_expert", targets=("experts",)))
    per_exp = per["model"]["segment_0"]["layer_0"]["block_sparse_moe"]["experts"]
    assert nn.unbox(per_exp["w1_lora_a"]).shape == (reps, e, lat, RANK)
    assert "self_attn" not in per["model"]["segment_0"]["layer_0"]  # only the selected targets
    # adapters shard by the base's table: B's expert axis goes where w1's does, its width where w1's does, and the
    # rank takes the FSDP axis the width left free (ZeRO-3: B and its AdamW moments are not replicated over fsdp)
    mesh = {"expert": 4, "fsdp": 2, "tensor": 2, "data": 1}
    base_w1 = boxed["model"]["segment_0"]["layer_0"]["block_sparse_moe"]["experts"]["w1"]
    base_spec = logical_to_pspec(base_w1.names, "train", mesh)
    b_spec = logical_to_pspec(exp["w1_lora_b"].names, "train", mesh)
    assert b_spec[1] == base_spec[1] and b_spec[1] is not None
    assert b_spec[2:] == ("fsdp", base_spec[3]) and base_spec[3] == "tensor"  # [layers, E, rank, expert_mlp]
    q = shapes["model"]["segment_0"]["layer_0"]["self_attn"]["q_b_proj"]
    q_base = boxed["model"]["segment_0"]["layer_0"]["self_attn"]["q_b_proj"]["kernel"]
    q_spec = logical_to_pspec(q["lora_b"].names, "train", mesh)
    assert q_spec[-1] == logical_to_pspec(q_base.names, "train", mesh)[-1] and q_spec[-2] == "fsdp"
    assert logical_to_pspec(q["lora_b"].names, "serve", mesh)[-2:] == (None, "tensor")  # serving: rank whole


def test_memory_plan_trains_only_adapters(setup):
    from sharding.memory import param_bytes

    _, _, _, boxed, _, lc, _ = setup
    shapes = lora.adapter_shapes(boxed, lc)
    with_ad = lora.with_adapters(boxed, shapes)
    mask = lora.trainable_mask(nn.unbox(with_ad))
    n_adapters = sum(int(np.prod(x.shape)) for x, m in zip(jax.tree.leaves(nn.unbox(with_ad)), jax.tree.leaves(mask),
                                                            strict=True) if m)
    sizes = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1, "sequence": 1}
    assert param_bytes(with_ad, sizes, "train", lora=True)["train_elems_total"] == n_adapters
    assert param_bytes(boxed, sizes, "train")["train_elems_total"] > 10 * n_adapters


def test_unknown_target_raises(setup):
    _, _, _, boxed, _, _, _ = setup
    with pytest.raises(lora.LoraError, match="nope_proj"):
        lora.adapter_specs(boxed, lora.LoraConfig(targets=("nope_proj",)))
    cfg4 = setup[0].replace(expert_format="mxfp4")
    packed = jax.eval_shape(K3ForCausalLM(cfg4).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    assert lora.adapter_specs(packed, lora.LoraConfig(targets=("attention", "latent")))  # packed base is fine
    # (adapters on the packed experts themselves: tests/test_lora_mxfp4_experts.py)


@pytest.fixture(scope="module")
def finetuned(setup):
    """One LoRA train step (AdamW on the adapters only): (state before, state after, trainable mask)."""
    cfg, model, tokens, _, params, _, adapters = setup
    full = lora.with_adapters(params, adapters)
    mask = lora.trainable_mask(full)
    trainable, _ = lora.split(full, mask)
    labels = lora.labels(full, mask)
    tx = build_optimizer(OptimConfig(name="adamw", lr=1e-2, warmup_frac=0.0, total_steps=10), labels)
    state = {"step": jnp.zeros((), jnp.int32), "params": full, "opt_state": tx.init(trainable),
             "rng": jax.random.key_data(jax.random.key(0))}
    step = jax.jit(make_train_step(model, tx, labels, cfg, StepConfig(qb=False, weight_clip=None), mask))
    batch = {"tokens": tokens, "segment_ids": jnp.ones_like(tokens)}
    new_state, _ = step(jax.tree.map(jnp.copy, state), batch)  # lr is 0 at step 0 (warmup)
    new_state, metrics = step(new_state, batch)
    return state, new_state, mask, metrics


def test_frozen_leaves_get_no_gradient_and_no_optimizer_state(setup, finetuned):
    cfg, model, tokens, _, params, _, adapters = setup
    state, new_state, mask, metrics = finetuned
    adapter_bytes = lora.tree_bytes(lora.split(state["params"], mask)[0])
    assert adapter_bytes == lora.tree_bytes(jax.tree.map(
        lambda p, m: p if m else None, adapters, lora.trainable_mask(adapters)))
    # AdamW: mu + nu per adapter leaf, plus step counters; nothing for the frozen base
    opt_bytes = lora.tree_bytes(state["opt_state"])
    assert 2 * adapter_bytes <= opt_bytes <= 2 * adapter_bytes + 64
    assert opt_bytes < lora.tree_bytes(params) // 4
    # the gradient function differentiates the adapters only
    loss = lambda p, t: (jnp.sum(model.apply({"params": p}, t) ** 2), None)
    (_, _), grads = jax.eval_shape(lora.value_and_grad_trainable(loss, mask), state["params"], tokens)
    g_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]}
    want = {jax.tree_util.keystr(p) for p, m in jax.tree_util.tree_flatten_with_path(mask)[0] if m}
    assert g_paths == want and lora.tree_bytes(grads) == adapter_bytes
    # one step: adapters moved, every frozen leaf (base and scales) bit-identical
    assert np.isfinite(float(metrics["loss"]))
    for (p, old), new, m in zip(jax.tree_util.tree_flatten_with_path(state["params"])[0],
                                jax.tree.leaves(new_state["params"]), jax.tree.leaves(mask), strict=True):
        if m and "lora_b" in jax.tree_util.keystr(p):
            assert not np.array_equal(old, new), jax.tree_util.keystr(p)
        elif not m:
            assert np.array_equal(old, new), jax.tree_util.keystr(p)


def _np_mxfp4_along0(w):
    return np.asarray(unpack_mxfp4(*pack_mxfp4(jnp.asarray(w).T))).T


def test_ste_gradients_equal_numpy_reference():
    """y = MXFP8(x) @ MXFP4(W): dL/dW = MXFP8(x)^T G and dL/dx = G MXFP4(W)^T (straight through both)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    w = (0.05 * rng.standard_normal((64, 32))).astype(np.float32)
    g = rng.standard_normal((8, 32)).astype(np.float32)
    from k3_jax.quant import fake_quant_mxfp8

    def f(x, w):
        return jnp.sum(jnp.asarray(g) * jnp.matmul(fake_quant_mxfp8(x), fake_quant_mxfp4(w, 0),
                                                   precision=jax.lax.Precision.HIGHEST))

    dx, dw = jax.jit(jax.grad(f, argnums=(0, 1)))(jnp.asarray(x), jnp.asarray(w))
    xq = np.asarray(dequantize_mxfp8(*quantize_mxfp8(jnp.asarray(x))))
    wq = _np_mxfp4_along0(w)
    assert not np.array_equal(wq, w) and not np.array_equal(xq, x)  # the quantisation is not the identity
    np.testing.assert_allclose(np.asarray(dw), xq.T.astype(np.float64) @ g, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx), g.astype(np.float64) @ wq.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(fake_quant_mxfp4(jnp.asarray(w), 0)), wq)


def _packed_experts(params):
    """bf16-held experts ``[R, E, in, out]`` -> release MXFP4 dicts (``[R, E, out, in/2]`` + scales)."""
    def walk(t):
        if not isinstance(t, dict):
            return t
        out = {}
        for k, v in t.items():
            if k == "experts":
                out[k] = {w: dict(zip(("weight_packed", "weight_scale"),
                                      pack_mxfp4(jnp.swapaxes(jnp.asarray(v[w]), -1, -2)), strict=True))
                          for w in ("w1", "w3", "w2")}
            else:
                out[k] = walk(v)
        return out
    return walk(params)


def test_qat_forward_equals_exported_mxfp4_forward_bit_for_bit(setup):
    cfg, _, tokens, _, params, _, _ = setup
    qat_cfg = cfg.replace(qat="mxfp4")
    y_qat = _apply(qat_cfg)({"params": params}, tokens)
    y_plain = _apply(cfg)({"params": params}, tokens)
    y_exported = _apply(qat_cfg.replace(expert_format="mxfp4"))({"params": _packed_experts(params)}, tokens)
    np.testing.assert_array_equal(np.asarray(y_qat), np.asarray(y_exported))
    assert float(jnp.max(jnp.abs(y_qat - y_plain))) > 0  # QAT does change the forward


def test_qat_train_step_forward_quantises_the_fp32_masters(setup):
    """bf16 compute: the train step's once-per-step cast keeps QAT's experts in fp32, so its forward equals the
    MXFP4 export of the fp32 masters bit for bit; quantising a bf16 copy instead (double rounding) does not."""
    from k3_jax.training.compute_cast import cast_for_compute, compute_cast_mask

    cfg, _, tokens, _, params, _, _ = setup
    qat_cfg = cfg.replace(qat="mxfp4", dtype="bfloat16")
    apply = _apply(qat_cfg)
    y_step = apply({"params": cast_for_compute(params, compute_cast_mask(params, "mxfp4"), jnp.bfloat16)}, tokens)
    y_exported = _apply(qat_cfg.replace(expert_format="mxfp4"))({"params": _packed_experts(params)}, tokens)
    np.testing.assert_array_equal(np.asarray(y_step), np.asarray(y_exported))
    y_bf16_first = apply({"params": cast_for_compute(params, compute_cast_mask(params), jnp.bfloat16)}, tokens)
    assert not np.array_equal(np.asarray(y_bf16_first), np.asarray(y_exported))


def test_finetune_merge_export_load_gives_same_logits(setup, finetuned, tmp_path):
    cfg, model, tokens, _, _, _, _ = setup
    _, new_state, _, _ = finetuned
    tuned = new_state["params"]
    report = lora.export(cfg, tuned, tmp_path / "hf", experts="mxfp4")
    rnd = report["expert_rounding"]
    assert rnd["count"] > 0 and 0 < rnd["rel_rms"] < 0.3 and rnd["max_abs"] > 0
    cfg_l, loaded = load_checkpoint(report["path"], dtype="float32")
    mx_cfg = cfg.replace(expert_format="mxfp4", qat="mxfp4")  # the release's boundary (MXFP8 expert inputs)
    assert cfg_l.to_hf_dict() == mx_cfg.to_hf_dict()
    apply = _apply(mx_cfg)  # compiled by the QAT test already
    y_loaded = apply({"params": jax.tree.map(jnp.asarray, loaded)}, tokens)
    # reference: the merged model held as the release layout stores it (each leaf in the stored dtype)
    ref = jax.tree.map(lambda x, stored: jnp.asarray(x).astype(stored.dtype).astype(jnp.asarray(x).dtype),
                       _packed_experts(lora.merge(tuned)), loaded)
    y_ref = apply({"params": ref}, tokens)
    np.testing.assert_array_equal(np.asarray(y_loaded), np.asarray(y_ref))


def test_cli_fine_tune_flags():
    from k3_jax.cli.train import build_train_config

    tc = build_train_config(["--init-from", "CKPT", "--lora", "8", "--lora-targets", "attention,latent",
                             "--lora-experts", "per_expert", "--qat", "mxfp4", "--lora-alpha", "4"])
    assert (tc.init_from, tc.lora_rank, tc.lora_targets, tc.lora_experts, tc.lora_alpha) == (
        "CKPT", 8, ("attention", "latent"), "per_expert", 4.0)
    assert tc.model_overrides["qat"] == "mxfp4"
    assert build_train_config([]).lora_rank == 0


def test_trainer_precompile_leaves_nothing_to_compile(tmp_path):
    """``Trainer.precompile`` (shapes only) compiles init, train and eval steps; the LoRA trainer's first
    ``init_state`` + train step + evaluation then compile none of them again (the fine-tuning benchmarks time
    on this)."""
    import logging

    from k3_jax.training.loop import TrainConfig, Trainer

    one_layer = {"num_hidden_layers": 1, "kda_layers": (), "mla_layers": (0,), "first_k_dense_replace": 1}
    tr = Trainer(TrainConfig(model_overrides=one_layer, seq_len=8, batch_size=1, optimizer="adamw", lora_rank=2,
                             lora_targets=("attention",), mesh="none", tensorboard=False, workdir=str(tmp_path)))
    assert tr.precompile()["compile_s"] > 0

    seen: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    grab = Grab()
    logging.getLogger("jax").addHandler(grab)
    try:
        with jax.log_compiles(True):
            state = tr.init_state()
            train_step, eval_step = tr.compiled_steps(state)
            rows = np.ones((1, 9), np.int32) * 5
            batch = tr._to_global({"tokens": rows, "segment_ids": np.ones_like(rows)})
            state, m = train_step(state, batch)
            jax.block_until_ready(eval_step(state["params"], batch))
            jax.jit(lambda x: x + 1)(jnp.ones(3))  # control: a fresh jit is seen compiling
    finally:
        logging.getLogger("jax").removeHandler(grab)
    compiled = [s for s in seen if s.startswith("Compiling ")]
    assert np.isfinite(float(m["loss"]))
    for name in ("init_params", "init_opt", "train_step", "eval_step"):
        assert not any(f"jit({name})" in s for s in compiled), (name, compiled)
    assert any("jit(<lambda>)" in s for s in compiled), compiled


def test_mxfp4_expert_kernels_differentiate_wrt_tokens():
    """LoRA over frozen MXFP4 experts differentiates through the MXFP4 kernel path (Triton, interpret mode on
    CPU): the tokens' gradient equals the reference's (XLA over the decoded weights), MXFP8 inputs included."""
    from pallas_kernels import moe

    e, m, lat, inter = 4, 24, 64, 32
    ks = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(ks[0], (m, lat))
    mk = lambda key, n, k: dict(zip(("weight_packed", "weight_scale"),
                                    pack_mxfp4(0.1 * jax.random.normal(key, (e, n, k))), strict=True))
    w1, w3, w2 = mk(ks[1], inter, lat), mk(ks[2], inter, lat), mk(ks[3], lat, inter)
    gs = jnp.array([5, 0, 12, 7], jnp.int32)
    c = jax.random.normal(ks[4], (m, lat))

    def loss(impl, interpret):
        return lambda v: jnp.sum(c * moe.expert_ffn(v, gs, w1, w3, w2, implementation=impl, interpret=interpret,
                                                    mxfp8_activations=True))

    with jax.default_matmul_precision("highest"):
        got = np.asarray(jax.jit(jax.grad(loss("triton", True)))(x))
        want = np.asarray(jax.jit(jax.grad(loss("xla", False)))(x))
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_router_statistics_do_not_depend_on_the_token_order():
    """The train step merges micro-batches token-major for Quantile Balancing and the load metrics (so the merged
    scores keep the batch sharding): the bias update and the loads are the same for any order of the tokens."""
    from k3_jax.training import quantile_balancing as qb

    rng = np.random.default_rng(0)
    accum, n, e, k = 2, 64, 16, 4
    scores = jnp.asarray(rng.standard_normal((accum, n, e)), jnp.float32)
    bias = jnp.asarray(0.1 * rng.standard_normal(e), jnp.float32)
    accum_major = scores.reshape(accum * n, e)
    token_major = jnp.transpose(scores, (1, 0, 2)).reshape(accum * n, e)
    assert not np.array_equal(np.asarray(accum_major), np.asarray(token_major))
    # jitted as in the train step (one compile per function instead of one per eager op)
    loads = jax.jit(qb.expert_loads, static_argnums=2)
    np.testing.assert_array_equal(np.asarray(loads(token_major, bias, k)), np.asarray(loads(accum_major, bias, k)))
    for method in ("histogram", "exact"):
        update = jax.jit(functools.partial(qb.qb_bias_update, k=k, method=method))
        np.testing.assert_array_equal(np.asarray(update(token_major, bias)), np.asarray(update(accum_major, bias)))


def test_quantile_balancing_is_off_for_lora_unless_asked(tmp_path):
    """The router's selection bias is part of the frozen base: a LoRA run leaves it alone (QB off) unless
    ``qb=True`` is asked for; full training balances by default. The resolved value is what resumes compare."""
    from k3_jax.training.loop import TrainConfig, Trainer

    one_layer = {"num_hidden_layers": 1, "kda_layers": (), "mla_layers": (0,), "first_k_dense_replace": 0}
    kw = dict(model_overrides=one_layer, seq_len=8, batch_size=1, optimizer="adamw", mesh="none",
              tensorboard=False, workdir=str(tmp_path))
    assert Trainer(TrainConfig(**kw, lora_rank=2, lora_targets=("attention",))).step_cfg.qb is False
    assert Trainer(TrainConfig(**kw, lora_rank=2, lora_targets=("attention",), qb=True)).step_cfg.qb is True
    full = Trainer(TrainConfig(**kw))
    assert full.step_cfg.qb is True and full.tc.qb is True
