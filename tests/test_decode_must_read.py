"""``benchmarks/decode.py``'s must-read from the experts a decode step really routes to (CPU, k3-tiny widths, fp32,
[KDA, MLA] x 2 in one scanned segment): the count its routing probe reports equals one computed independently
(numpy top-k of the routers applied to the inputs captured from each MoE layer, and a hand-built routing whose
experts are known), and the must-read bytes and the roofline fraction move with the count."""

import contextlib
import io
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.decode import (
    count_experts,
    expected_distinct_experts,
    layer_config,
    parse_args,
    routing_probe,
    run_case,
    step_bytes,
)
from k3_jax.convert.fixture import random_params
from k3_jax.layers.moe import Router
from k3_jax.model import K3ForCausalLM, layer_plan
from k3_jax.serving.engine import Engine
from tests._model_fixtures import tiny_config

BATCH, PROMPT, STEPS = 12, 6, 2


@pytest.fixture(scope="module")
def setup():
    cfg = layer_config(tiny_config(), ["kda", "mla", "kda", "mla"], None)
    assert [(s.period, s.repeats) for s in layer_plan(cfg)] == [(2, 2)]
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), random_params(cfg, seed=5))
    return cfg, params


def _router_leaves(params: dict) -> dict:
    return params["model"]["segment_0"]


def _expert_bytes_per_layer(params: dict) -> float:
    seg = _router_leaves(params)
    total = sum(x.nbytes for j in ("layer_0", "layer_1")
                for x in jax.tree.leaves(seg[j]["block_sparse_moe"]["experts"]))
    return total / 4  # four MoE layers, experts of one shape


def test_known_routing_counts_k_experts_and_must_read_follows(setup):
    """Routers of zero weight: every token takes the top-k of its layer's correction bias, so every layer of every
    step hits exactly k experts; the case's must-read counts k / E of the experts, the uniform key its expectation."""
    cfg, params = setup
    params = jax.tree.map(np.copy, params)
    rs = np.random.RandomState(0)
    for j in ("layer_0", "layer_1"):
        gate = _router_leaves(params)[j]["block_sparse_moe"]["gate"]
        gate["kernel"][...] = 0.0
        gate["e_score_correction_bias"][...] = rs.standard_normal(gate["e_score_correction_bias"].shape)
    args = parse_args(["--calls", "1", "--gen", "4"])
    rec = run_case(cfg, params, BATCH, PROMPT, STEPS, args, gbps=100.0, first=False)

    k, e = cfg.num_experts_per_token, cfg.num_experts
    hit = rec["experts_hit"]
    assert hit["per_step"] == {str(layer): [k] * STEPS for layer in range(4)}, hit
    assert hit["mean"] == k and hit["greedy_agree"] == 1.0, hit
    assert hit["uniform_expected"] == pytest.approx(expected_distinct_experts(e, k, BATCH), abs=1e-3)
    assert hit["uniform_expected"] > k + 5  # 12 tokens spread over ~14 of 16 experts: the two counts differ

    per_layer = _expert_bytes_per_layer(params)
    assert rec["bytes"]["routed_experts"] == pytest.approx(4 * per_layer * k / e, rel=1e-6)
    assert rec["bytes_uniform"]["routed_experts"] == pytest.approx(4 * per_layer * hit["uniform_expected"] / e,
                                                                   rel=1e-3)
    moved = rec["bytes_uniform"]["total"] - rec["bytes"]["total"]
    assert moved == rec["bytes_uniform"]["routed_experts"] - rec["bytes"]["routed_experts"] > 0
    assert rec["roofline_ms"] == pytest.approx(rec["bytes"]["total"] / 100e9 * 1e3, abs=1e-3)
    assert rec["roofline_fraction"] == pytest.approx(rec["roofline_ms"] / rec["ms_per_step"], abs=2e-3)
    # the same time over fewer bytes (both fractions are rounded to 3 decimals: on a slow host they may tie)
    assert rec["roofline_fraction"] <= rec["roofline_fraction_uniform"]
    assert rec["roofline_ms"] <= rec["roofline_ms_uniform"]


def _capture_router_inputs(next_fun, args, kwargs, context):
    if isinstance(context.module, Router) and context.method_name == "__call__":
        context.module.sow("intermediates", "router_input", args[0])
    return next_fun(*args, **kwargs)


def _numpy_distinct(x: np.ndarray, kernel: np.ndarray, bias: np.ndarray, k: int) -> int:
    """Distinct experts of top-k(sigmoid(x @ W) + bias) in float64; the k-th and (k+1)-th choices of every token
    must be apart (no near-tie the model's fp32 could order differently)."""
    sel = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ kernel.astype(np.float64)))) + bias
    order = np.argsort(-sel, axis=-1, kind="stable")
    ranked = np.take_along_axis(sel, order, axis=-1)
    assert np.min(ranked[:, k - 1] - ranked[:, k]) > 1e-6
    return int(np.unique(order[:, :k]).size)


def test_probe_counts_equal_routers_applied_to_captured_inputs(setup):
    """Random routers, two decode steps from a random cache: per layer and step, the probe's count equals the
    numpy top-k of each layer's router (its parameters) applied to that layer's captured inputs, step 2 fed step
    1's greedy tokens; the must-read bytes follow the counts layer by layer."""
    cfg, params = setup
    eng = Engine(cfg, params, max_batch=BATCH, max_len=PROMPT + 4, eos_ids=(), decode_block=STEPS)
    leaves, tree = jax.tree.flatten(eng.cache)
    rs = np.random.RandomState(1)
    cache = jax.tree.unflatten(tree, [jnp.asarray(0.3 * rs.standard_normal(x.shape), x.dtype) for x in leaves])
    cache = {**cache, "lengths": jnp.full((BATCH,), PROMPT, jnp.int32)}
    first = jnp.asarray(rs.randint(3, cfg.vocab_size, BATCH), jnp.int32)

    model = K3ForCausalLM(cfg)
    step = jax.jit(lambda v, c, t: model.apply(v, t[:, None], cache=c, mutable=["intermediates"]))
    inputs, greedy, c, tok = [], [], jax.tree.map(jnp.copy, cache), first
    with nn.intercept_methods(_capture_router_inputs):
        for _ in range(STEPS):
            (logits, c), inter = step(eng.variables, c, tok)
            seg = inter["intermediates"]["model"]["segment_0"]
            inputs.append({j: np.asarray(seg[j]["block_sparse_moe"]["gate"]["router_input"][0])
                           for j in ("layer_0", "layer_1")})
            tok = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
            greedy.append(np.asarray(tok))
    k = cfg.num_experts_per_token
    want = {}
    for r in range(2):
        for p, j in enumerate(("layer_0", "layer_1")):
            gate = _router_leaves(params)[j]["block_sparse_moe"]["gate"]
            want[2 * r + p] = [_numpy_distinct(inputs[s][j][r], gate["kernel"][r], gate["e_score_correction_bias"][r],
                                               k) for s in range(STEPS)]

    hit = count_experts(cfg, routing_probe(eng, BATCH), eng.variables, jax.tree.map(jnp.copy, cache), first,
                        np.stack(greedy))
    assert hit["per_step"] == {str(layer): v for layer, v in want.items()}, (hit, want)
    assert hit["greedy_agree"] == 1.0
    assert len({v for counts in want.values() for v in counts}) > 1  # the layers' counts differ: a real check

    per_layer = {layer: float(np.mean(v)) for layer, v in want.items()}
    nbytes = step_bytes(cfg, eng.variables["params"], eng.cache, BATCH, PROMPT, experts_hit=per_layer)
    expert_layer = _expert_bytes_per_layer(params)
    assert nbytes["routed_experts"] == pytest.approx(expert_layer * sum(per_layer.values()) / cfg.num_experts,
                                                     rel=1e-6)
    fewer = step_bytes(cfg, eng.variables["params"], eng.cache, BATCH, PROMPT,
                       experts_hit={**per_layer, 3: per_layer[3] - 1})
    assert nbytes["total"] - fewer["total"] == pytest.approx(expert_layer / cfg.num_experts, abs=2)
    with pytest.raises(ValueError, match=r"no count for MoE layer\(s\) \[3\]"):
        step_bytes(cfg, eng.variables["params"], eng.cache, BATCH, PROMPT, experts_hit={0: 1, 1: 1, 2: 1})


def _line(kind: str, batch: int, ms: float, gb: float, hit: float | None) -> str:
    rec = {"bench": "decode", "layers": kind, "batch": batch, "ms_per_step": ms, "bytes": {"total": gb * 1e9},
           "copy_gbps": 4000.0}
    if hit is not None:
        rec["experts_hit"] = {"mean": hit}
    return json.dumps(rec)


def test_projection_takes_the_measured_count(tmp_path):
    """decode_projection.py: per-chip routed experts at the measured lines' count (layers of each kind weighted),
    the uniform expectation only when asked; lines without a count cannot be projected at a measured count."""
    from benchmarks.decode_projection import main

    run = tmp_path / "run.jsonl"
    run.write_text("\n".join([_line("kda", 64, 3.7, 10.0, 470.0), _line("mla", 64, 4.3, 9.0, 500.0),
                              _line("kda", 1, 0.6, 1.5, 16.0), _line("mla", 1, 0.5, 1.1, 16.0)]))
    out = {}
    for source in ("measured", "uniform"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            main(["--measured", str(run), "--meshes", "tensor=8", "--experts-hit", source])
        out[source] = {r["batch"]: r for r in map(json.loads, buf.getvalue().splitlines())}
    m, u = out["measured"][64], out["uniform"][64]
    assert m["experts_hit"]["source"] == "measured" and u["experts_hit"]["source"] == "uniform"
    assert m["experts_hit"]["per_moe_layer"] == pytest.approx((69 * 470 + 24 * 500) / 93, abs=0.01)
    assert u["experts_hit"]["per_moe_layer"] == pytest.approx(expected_distinct_experts(896, 16, 64), abs=0.01)
    ratio = m["experts_hit"]["per_moe_layer"] / u["experts_hit"]["per_moe_layer"]
    assert m["chip_bytes"]["routed_experts"] == pytest.approx(ratio * u["chip_bytes"]["routed_experts"], rel=1e-4)
    assert m["chip_bytes"]["dense_weights"] == u["chip_bytes"]["dense_weights"]
    assert m["same_fraction_ms"] < u["same_fraction_ms"]
    assert out["measured"][1]["chip_bytes"] == out["uniform"][1]["chip_bytes"]  # one token: k experts either way

    run.write_text("\n".join([_line("kda", 64, 3.7, 10.0, None), _line("mla", 64, 4.3, 9.0, None)]))
    with pytest.raises(ValueError, match="carry no experts_hit count"):
        main(["--measured", str(run), "--meshes", "tensor=8"])
