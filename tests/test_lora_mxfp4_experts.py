"""LoRA adapters on routed experts kept packed in MXFP4 (k3_jax.training.lora, pallas_kernels.moe.ops): a 1-layer
MLA MoE cut of k3-tiny (fp32) whose experts are MXFP4 equals the same model with the experts decoded to the bf16
layout and the same adapters; adapters get that model's gradients, codes and scales none."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3_jax.config import load_config
from k3_jax.convert.hf import load_checkpoint
from k3_jax.convert.transforms import pack_mxfp4_np, unpack_mxfp4_np
from k3_jax.layers.common import lora_delta
from k3_jax.model import K3ForCausalLM
from k3_jax.quant.mxfp4 import pack_mxfp4
from k3_jax.training import lora
from k3_jax.training.optim import OptimConfig, build_optimizer
from pallas_kernels.moe import ops
from pallas_kernels.moe import reference as ref
from sharding.rules import logical_to_pspec
from tests.test_triton_lowering import verified_modules  # noqa: F401  (a fixture)
from tests.train_common import draw_params

RANK = 4


def _experts_of(tree):
    return tree["model"]["segment_0"]["layer_0"]["block_sparse_moe"]["experts"]


def _map_experts(tree, fn):
    """``tree`` with its ``experts`` dict replaced by ``fn(experts)`` (dicts copied on the way)."""
    if not isinstance(tree, dict):
        return tree
    return {k: fn(v) if k == "experts" else _map_experts(v, fn) for k, v in tree.items()}


def _pack(experts):
    """bf16-layout experts ``[R, E, in, out]`` -> release MXFP4 dicts (``[R, E, out, in/2]`` + scales)."""
    return {w: dict(zip(("weight_packed", "weight_scale"),
                        map(jnp.asarray, pack_mxfp4_np(np.swapaxes(np.asarray(experts[w]), -1, -2))), strict=True))
            for w in ("w1", "w3", "w2")}


def _decode(experts):
    """MXFP4 experts -> the same values in the bf16 layout ``[R, E, in, out]`` (f32)."""
    return {w: jnp.asarray(np.swapaxes(unpack_mxfp4_np(*(np.asarray(experts[w][k]) for k in (
        "weight_packed", "weight_scale"))), -1, -2)) for w in ("w1", "w3", "w2")}


@pytest.fixture(scope="module")
def setup():
    cfg = load_config("configs/k3-tiny.json").replace(num_hidden_layers=1, kda_layers=(), mla_layers=(0,),
                                                      first_k_dense_replace=0, num_experts=8,
                                                      num_experts_per_token=2, dtype="float32")
    mx_cfg = cfg.replace(expert_format="mxfp4")
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, size=(2, 9)), jnp.int32)
    boxed = jax.eval_shape(K3ForCausalLM(cfg).init, jax.random.key(0), tokens[:, :-1])["params"]

    packed = _map_experts(draw_params(nn.unbox(boxed), rng), _pack)
    decoded = _map_experts(packed, _decode)  # the same model, experts held in the bf16 layout
    lc = lora.LoraConfig(rank=RANK, alpha=8.0, targets=("experts",))
    adapters = lora.init_adapters(packed, lc, jax.random.key(1))
    keys = iter(jax.random.split(jax.random.key(2), 100))
    adapters = jax.tree_util.tree_map_with_path(  # non-zero b: a fresh adapter is the identity
        lambda p, x: 0.3 * jax.random.normal(next(keys), x.shape) if str(p[-1].key).endswith("lora_b") else x,
        adapters)
    return cfg, mx_cfg, tokens, packed, decoded, adapters


@functools.cache
def _value_and_adapter_grads(cfg):
    """Jitted ``(params, tokens) -> (sum(logits²), grads)``, grads only for the adapters (the LoRA step's
    :func:`lora.value_and_grad_trainable`); one compile per config and tree."""

    def f(params, tokens):
        loss = lambda p, t: (jnp.sum(K3ForCausalLM(cfg).apply({"params": p}, t) ** 2), None)
        (value, _), grads = lora.value_and_grad_trainable(loss, lora.trainable_mask(params))(params, tokens)
        return value, grads

    return jax.jit(f)


def _logits_and_adapter_grads(cfg, params, tokens):
    return _value_and_adapter_grads(cfg)(params, tokens)


def test_forward_and_adapter_gradients_equal_the_decoded_bf16_model(setup):
    cfg, mx_cfg, tokens, packed, decoded, adapters = setup
    v_mx, g_mx = _logits_and_adapter_grads(mx_cfg, lora.with_adapters(packed, adapters), tokens)
    v_bf, g_bf = _logits_and_adapter_grads(cfg, lora.with_adapters(decoded, adapters), tokens)
    np.testing.assert_allclose(float(v_mx), float(v_bf), rtol=1e-5)
    flat_mx = jax.tree_util.tree_flatten_with_path(g_mx)[0]
    assert len(flat_mx) == 6 and all("lora_" in jax.tree_util.keystr(p) for p, _ in flat_mx)  # a, b of w1/w3/w2
    for (path, got), want in zip(flat_mx, jax.tree.leaves(g_bf), strict=True):
        assert float(jnp.max(jnp.abs(want))) > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                                   atol=1e-5 * float(jnp.max(jnp.abs(want))), err_msg=jax.tree_util.keystr(path))
    # merge folds the adapters into the decoded experts: the result is the bf16-layout model, merged
    merged = lora.merge(lora.with_adapters(packed, adapters))
    assert jax.tree.structure(merged) == jax.tree.structure(decoded)
    exp_m, exp_d, exp_a = _experts_of(merged), _experts_of(decoded), _experts_of(adapters)
    for w in ("w1", "w3", "w2"):
        a, b, s = (exp_a[f"{w}_{n}"][0] for n in ("lora_a", "lora_b", "lora_scale"))
        np.testing.assert_allclose(np.asarray(exp_m[w][0]), np.asarray(exp_d[w][0] + lora_delta(a, b, s)),
                                   rtol=1e-6, atol=1e-7)
    assert lora.merge(packed) == packed  # no adapters: the packed experts stay packed


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_kernel_path_equals_reference_on_cpu_interpret():
    """The unfused Triton path (interpret mode on CPU): MXFP4 base products + low-rank terms (per-expert A on w1,
    shared A on w2, w3 without adapter; rank 4 zero-padded to 16) give the reference's output and gradients for
    the tokens and every adapter leaf, MXFP8 expert inputs included."""
    e, m, lat, inter, r = 4, 24, 64, 32, 4
    ks = jax.random.split(jax.random.key(3), 8)
    mk = lambda key, n, k: dict(zip(("weight_packed", "weight_scale"),
                                    pack_mxfp4(0.1 * jax.random.normal(key, (e, n, k))), strict=True))
    w1, w3, w2 = mk(ks[1], inter, lat), mk(ks[2], inter, lat), mk(ks[3], lat, inter)

    def adapter(key, din, dout, per_expert):
        ka, kb = jax.random.split(key)
        a = jax.random.normal(ka, ((e,) if per_expert else ()) + (din, r)) / np.sqrt(din)
        return a, 0.3 * jax.random.normal(kb, (e, r, dout)), jnp.float32(2.0)

    adapters = {"w1": adapter(ks[5], lat, inter, True), "w2": adapter(ks[7], inter, lat, False)}
    x, c = jax.random.normal(ks[0], (m, lat)), jax.random.normal(ks[4], (m, lat))
    gs = jnp.array([5, 0, 12, 7], jnp.int32)  # 24 rows: all routed

    def loss(impl, interpret):
        return lambda v, ad: jnp.sum(c * ops.expert_ffn(v, gs, w1, w3, w2, implementation=impl, adapters=ad,
                                                        interpret=interpret, mxfp8_activations=True))

    with jax.default_matmul_precision("highest"):
        got = jax.jit(jax.value_and_grad(loss("triton", True), argnums=(0, 1)))(x, adapters)
        want = jax.jit(jax.value_and_grad(loss("xla", False), argnums=(0, 1)))(x, adapters)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    trained = lambda g: [g[0]] + [g[1][n][i] for n in ("w1", "w2") for i in (0, 1)]  # tokens, a, b
    for g, w in zip(trained(got[1]), trained(want[1]), strict=True):
        assert float(jnp.max(jnp.abs(w))) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(w))))
    # the frozen MXFP4 weight: its codes and scales get float0 (no) cotangents
    cotangents = lambda v, w: jax.vjp(lambda v, w: ops.mxfp4_grouped_matmul("triton", True, None, v, gs, w),
                                      v, w)[1](jnp.ones((m, inter)))
    dx, dw = jax.eval_shape(cotangents, x, w1)
    assert dx.shape == x.shape and {a.dtype for a in jax.tree.leaves(dw)} == {jax.dtypes.float0}


def test_adapter_shapes_and_sharding_over_packed_experts(setup):
    """Packed experts get the adapters of the bf16 layout (shared A / per-expert B, or per-expert A and B), with
    the logical names of the weight's axes, so B's expert axis shards as the packed weight's does, and its rank
    over the axis its width leaves free."""
    cfg, mx_cfg, _, _, _, _ = setup
    e, lat, im = cfg.num_experts, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    boxed_mx = jax.eval_shape(K3ForCausalLM(mx_cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    boxed_bf = jax.eval_shape(K3ForCausalLM(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    for mode in ("shared_a", "per_expert"):
        lc = lora.LoraConfig(rank=RANK, targets=("experts",), experts=mode)
        got, want = (_experts_of(lora.adapter_shapes(b, lc)) for b in (boxed_mx, boxed_bf))
        described = lambda t: {k: (nn.unbox(v).shape, v.names) for k, v in t.items()}
        assert described(got) == described(want)
        reps = nn.unbox(got["w1_lora_b"]).shape[0]
        a_lead = (reps,) if mode == "shared_a" else (reps, e)
        assert nn.unbox(got["w1_lora_a"]).shape == (*a_lead, lat, RANK)
        assert nn.unbox(got["w2_lora_a"]).shape == (*a_lead, im, RANK)
        assert nn.unbox(got["w2_lora_b"]).shape == (reps, e, RANK, lat)
        assert got["w2_lora_b"].names == ("layers", "experts", "lora_rank", "latent")
    mesh = {"expert": 4, "fsdp": 2, "tensor": 2, "data": 1}
    packed_w1 = _experts_of(boxed_mx)["w1"]["weight_packed"]
    b_spec = logical_to_pspec(got["w1_lora_b"].names, "train", mesh)
    assert b_spec[1] == logical_to_pspec(packed_w1.names, "train", mesh)[1] and b_spec[1] is not None
    assert b_spec[2] == "fsdp"  # the rank takes fsdp (ZeRO-3; the expert-parallel kernels gather it)
    w2_spec = logical_to_pspec(got["w2_lora_b"].names, "train", mesh)
    assert w2_spec[2:] == ("tensor", "fsdp")  # w2's latent width took fsdp: the rank takes tensor
    # the memory plan trains exactly the adapters over the packed base
    from sharding.memory import param_bytes

    with_ad = lora.with_adapters(boxed_mx, lora.adapter_shapes(boxed_mx, lc))
    n_adapters = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(_experts_of(with_ad)))
                     if x.dtype == jnp.float32)  # lora_a/b and the (frozen) scales
    n_scales = sum(int(np.prod(nn.unbox(v).shape)) for k, v in _experts_of(with_ad).items() if "scale" in k)
    sizes = {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1, "sequence": 1}
    assert param_bytes(with_ad, sizes, "train", lora=True)["train_elems_total"] == n_adapters - n_scales


def test_unsupported_cases_raise_clearly(setup):
    _, _, _, packed, _, adapters = setup
    x, gs = jnp.zeros((4, 128)), jnp.array([4] + [0] * 7, jnp.int32)
    exp, ad = _experts_of(packed), _experts_of(adapters)
    w = {k: jax.tree.map(lambda a: a[0], exp[k]) for k in ("w1", "w3", "w2")}
    one = (ad["w1_lora_a"][0], ad["w1_lora_b"][0], ad["w1_lora_scale"][0])
    with pytest.raises(ValueError, match="w1_lora_b: expected"):
        ops.expert_ffn(x, gs, w["w1"], w["w3"], w["w2"], adapters={"w1": (one[0], one[1][:, :, :8], one[2])})
    with pytest.raises(ValueError, match="no such expert weight"):
        ops.expert_ffn(x, gs, w["w1"], w["w3"], w["w2"], adapters={"w4": one})
    with pytest.raises(ValueError, match="layer="):
        ops.expert_ffn(x, gs, *(exp[k] for k in ("w1", "w3", "w2")), layer=jnp.int32(0), adapters={"w1": one})


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices; see tests/conftest.py")
def test_expert_parallel_adapters_equal_reference():
    """Expert parallelism (all-gather over `expert`=4, the expert width over `tensor`=2) with adapters on packed
    experts — shared A on w1/w2, per-expert A on w3 — equals the single-device reference, forward and gradients
    of the tokens and the adapters."""
    from k3_jax.parallel.expert import moe_dispatch_combine_ep
    from sharding.mesh import make_mesh

    t, lat, inter, e, k, r = 16, 64, 64, 8, 2, 4
    ks = jax.random.split(jax.random.key(0), 10)
    z, c = jax.random.normal(ks[0], (t, lat)), jax.random.normal(ks[9], (t, lat))
    ids = jax.lax.top_k(jax.random.normal(ks[1], (t, e)), k)[1].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[2], (t, k)))
    mk = lambda key, n, kk: dict(zip(("weight_packed", "weight_scale"),
                                     pack_mxfp4(0.1 * jax.random.normal(key, (e, n, kk))), strict=True))
    ex = {"w1": mk(ks[3], inter, lat), "w3": mk(ks[4], inter, lat), "w2": mk(ks[5], lat, inter)}

    def adapter(key, din, dout, per_expert):
        ka, kb = jax.random.split(key)
        a = jax.random.normal(ka, ((e,) if per_expert else ()) + (din, r)) / np.sqrt(din)
        return a, 0.3 * jax.random.normal(kb, (e, r, dout)), jnp.float32(2.0)

    ad = {"w1": adapter(ks[6], lat, inter, False), "w3": adapter(ks[7], lat, inter, True),
          "w2": adapter(ks[8], inter, lat, False)}
    mesh = make_mesh("expert=4,tensor=2")
    ep = lambda z, ad: jnp.sum(c * moe_dispatch_combine_ep(z, ids, w, ex, mesh=mesh, strategy="allgather",
                                                           adapters=ad))
    single = lambda z, ad: jnp.sum(c * ref.moe_dispatch_combine(z, ids, w, ex, adapters=ad))
    with jax.default_matmul_precision("highest"):
        got = jax.jit(jax.value_and_grad(ep, argnums=(0, 1)))(z, ad)
        want = jax.jit(jax.value_and_grad(single, argnums=(0, 1)))(z, ad)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    trained = lambda g: [g[0]] + [g[1][n][i] for n in ("w1", "w3", "w2") for i in (0, 1)]  # tokens, a, b
    for g, wt in zip(trained(got[1]), trained(want[1]), strict=True):
        assert float(jnp.max(jnp.abs(wt))) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(wt), rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(wt))))


@pytest.fixture(scope="module")
def finetuned(setup):
    """Two AdamW steps on fresh expert adapters over the packed experts, from the LoRA step's gradient function
    (the one compiled above) and optimizer: (params before, after, mask, optimizer state before)."""
    _, mx_cfg, tokens, packed, _, adapters = setup
    lc = lora.LoraConfig(rank=RANK, alpha=8.0, targets=("experts",))
    params = lora.with_adapters(packed, lora.init_adapters(packed, lc, jax.random.key(5)))
    mask = lora.trainable_mask(params)
    labels = lora.labels(params, mask)
    tx = build_optimizer(OptimConfig(name="adamw", lr=1e-2, warmup_frac=0.0, total_steps=10), labels)
    opt_state0 = tx.init(lora.split(params, mask)[0])

    @jax.jit
    def update(trainable, grads, opt_state):
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state

    new, opt_state = params, opt_state0
    for _ in range(2):  # lr is 0 at step 0 (warmup)
        value, grads = _logits_and_adapter_grads(mx_cfg, new, tokens)
        trainable, frozen = lora.split(new, mask)
        trainable, opt_state = update(trainable, grads, opt_state)
        new = lora.join(trainable, frozen)
    assert np.isfinite(float(value))
    return params, new, mask, opt_state0, grads


def test_codes_and_scales_get_no_gradient_and_no_optimizer_state(finetuned):
    params, new, mask, opt_state, grads = finetuned
    adapter_bytes = lora.tree_bytes(lora.split(params, mask)[0])
    assert lora.tree_bytes(grads) == adapter_bytes  # gradients for the adapters alone
    opt_bytes = lora.tree_bytes(opt_state)
    assert 2 * adapter_bytes <= opt_bytes <= 2 * adapter_bytes + 64  # AdamW mu + nu per adapter leaf, counters
    exp_mask = _experts_of(mask)
    assert not any(jax.tree.leaves({k: v for k, v in exp_mask.items() if k in ("w1", "w3", "w2")}))
    assert all(exp_mask[f"{w}_lora_{n}"] for w in ("w1", "w3", "w2") for n in "ab")
    for (p, old), upd, m in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(new),
                                jax.tree.leaves(mask), strict=True):
        if m and "lora_b" in jax.tree_util.keystr(p):
            assert not np.array_equal(old, upd), jax.tree_util.keystr(p)  # the expert adapters train
        elif not m:
            assert np.array_equal(old, upd), jax.tree_util.keystr(p)  # codes, scales, lora_scale: bit-identical


def test_finetune_merge_export_load_round_trip(setup, finetuned, tmp_path):
    """Export writes the merged model (packed experts decoded, ``W_deq + s·a b`` re-quantised) in the release
    layout with its rounding error; loading it gives exactly those tensors and the release's config, so the loaded
    model is the merged model re-quantised (the same params under the same config: the same logits)."""
    _, mx_cfg, _, _, _, _ = setup
    tuned = finetuned[1]
    report = lora.export(mx_cfg, tuned, tmp_path / "hf", experts="mxfp4")
    rnd = report["expert_rounding"]
    assert rnd["count"] > 0 and 0 < rnd["rel_rms"] < 0.3 and rnd["max_abs"] > 0
    cfg_l, loaded = load_checkpoint(report["path"], dtype="float32")
    assert cfg_l.to_hf_dict() == mx_cfg.replace(qat="mxfp4").to_hf_dict()  # packed experts, MXFP8 expert inputs
    want = _map_experts(lora.merge(tuned), _pack)  # the merged model packed as the release stores it
    assert jax.tree.structure(loaded) == jax.tree.structure(want)
    for (path, got), w in zip(jax.tree_util.tree_flatten_with_path(loaded)[0], jax.tree.leaves(want), strict=True):
        w = np.asarray(w).astype(got.dtype).astype(np.asarray(w).dtype)  # as the stored dtype holds it
        np.testing.assert_array_equal(np.asarray(got), w, err_msg=jax.tree_util.keystr(path))
    exp_l, exp_t = _experts_of(loaded), _experts_of(tuned)
    assert not np.array_equal(exp_l["w1"]["weight_packed"], exp_t["w1"]["weight_packed"])  # the adapters moved it


def _lowering_problem(e: int = 4, m: int = 64, k: int = 256, n: int = 256, r: int = 4):
    """Per-expert rank-``r`` adapters on packed ``w1, w3 [E, n, k]``, ``w2 [E, k, n]`` (HF layout), bf16 rows."""
    rng = np.random.default_rng(0)
    mx = lambda rows, cols: {"weight_packed": jnp.asarray(rng.integers(0, 256, (e, rows, cols // 2)), jnp.uint8),
                             "weight_scale": jnp.asarray(rng.integers(120, 130, (e, rows, cols // 32)), jnp.uint8)}
    ad = lambda din, dout: (jnp.ones((e, din, r)), jnp.ones((e, r, dout)), jnp.float32(1.0))
    return (jnp.ones((m, k), jnp.bfloat16), jnp.array([30, 0, 20, 14], jnp.int32), (mx(n, k), mx(n, k), mx(k, n)),
            {"w1": ad(k, n), "w3": ad(k, n), "w2": ad(n, k)})


def _adapter_step(impl: str, platform: str, gs, weights):
    """The gradients a LoRA step takes through the experts: tokens and adapters."""
    loss = lambda x, ad: jnp.sum(ops.expert_ffn(x, gs, *weights, adapters=ad, implementation=impl,
                                                platform=platform).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1))


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_triton_adapter_path_lowers_for_hopper(verified_modules):  # noqa: F811  (the imported fixture)
    """The Triton path with adapters (MXFP4 products, the rank-padded grouped matmuls and their kernel backward)
    lowers on CPU to Triton modules that pass MLIR verification (see tests/test_triton_lowering.py)."""
    x, gs, weights, adapters = _lowering_problem()
    jax.jit(_adapter_step("triton", "gpu", gs, weights)).trace(x, adapters).lower(lowering_platforms=("cuda",))
    assert {"moe_gmm_mxfp4_gpu", "moe_gmm_gpu", "moe_tgmm_gpu"} <= set(verified_modules)


def test_mosaic_tpu_adapter_path_compiles_aot():
    """The Mosaic TPU path with adapters (rank 4, not padded: blocks take the full rank) compiles for v5p on this
    host (needs libtpu; K3-width shapes, ranks 4/16/64 on v5p and 16 on v6e, were compiled the same way by hand)."""
    import importlib.util
    import os

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install -e '.[aot]')")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    try:
        dev = topologies.get_topology_desc("v5p:2x2x1", platform="tpu").devices[0]
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"libtpu cannot describe topology v5p:2x2x1: {type(exc).__name__}: {exc}")
    x, gs, weights, adapters = _lowering_problem()
    on_tpu = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                   sharding=SingleDeviceSharding(dev)), t)
    step = lambda x, ad, gs, weights: _adapter_step("mosaic_tpu", "tpu", gs, weights)(x, ad)
    compiled = jax.jit(step).lower(*on_tpu((x, adapters, gs, weights))).compile()
    assert "tpu_custom_call" in compiled.as_text()


def test_memory_plan_of_expert_adapters_agrees_with_the_compiler():
    """The plan's activations + gradient accumulator of a LoRA step with adapters on the packed experts (rank 64,
    all targets, adapters sharded over fsdp) are within 10% of XLA:TPU's temp bytes for the same K3 depth cut
    (2 layers, v5p-128 mesh fsdp=4,expert=4,tensor=4, 16×2048 tokens, remat full: 15.300 GB; RESULTS.md), and
    count one f32 unfused product."""
    from benchmarks.finetune_aot import depth_cut
    from sharding.memory import plan
    from sharding.plan import abstract_params

    cfg = load_config("configs/k3.json", expert_format="mxfp4", param_dtype="bfloat16", remat="full",
                      **depth_cut("configs/k3.json", 2))
    boxed = abstract_params(cfg)
    lc = lora.LoraConfig(rank=64, targets=("attention", "shared_experts", "latent", "experts"))
    with_experts = lora.with_adapters(boxed, lora.adapter_shapes(boxed, lc, dtype=jnp.float32))
    kw = {"batch": 16, "seq_len": 2048, "optimizer": "adamw", "lora": True}
    p = plan(cfg, "train", "fsdp=4,expert=4,tensor=4", boxed=with_experts, **kw)
    est = (p.per_device["activations_est"] + p.per_device["gradients"]) / 1e9
    assert est == pytest.approx(15.300, rel=0.10)
    lc_no = lora.LoraConfig(rank=64, targets=("attention", "shared_experts", "latent"))
    no_experts = plan(cfg, "train", "fsdp=4,expert=4,tensor=4", **kw,
                      boxed=lora.with_adapters(boxed, lora.adapter_shapes(boxed, lc_no, dtype=jnp.float32)))
    rows, inter_t = 2048 * 4 * cfg.num_experts_per_token, cfg.moe_intermediate_size // 4
    extra = p.per_device["activations_est"] - no_experts.per_device["activations_est"]
    assert extra == 4 * rows * inter_t  # an unfused w1/w3 product (f32)
    assert p.per_device["optimizer"] > 10 * no_experts.per_device["optimizer"]  # B per expert: the bulk of it
