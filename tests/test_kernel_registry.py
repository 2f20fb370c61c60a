"""The kernel registries: every branch of a choice (chosen, explained, refused with a reason), the gate-bound
invariant, the target platform, config validation, and the Triton launches' shared-memory budget. Pure Python
or trace-only, except one tiny interpret-mode call."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from k3_jax.config import ConfigError, load_config
from k3_jax.kernels import explain
from pallas_kernels import attention
from pallas_kernels.kda import launch
from pallas_kernels.kda import ops as kda_ops
from pallas_kernels.moe import ops as moe_ops
from pallas_kernels.registry import (
    KernelUnavailable,
    Registry,
    clear_selections,
    platform_scope,
    selections,
    target_compute_capability,
    target_platform,
    visible_gpu_compute_capability,
)
from tests._model_fixtures import REPO

TINY = REPO / "configs" / "k3-tiny.json"
K3_KDA = (1, 8192, 96, 128, 128)  # B, T, H, K, V of the K3 shape


def kda_call(platform, dtype="bfloat16", shape=K3_KDA, gate_bound=-5.0, chunk=64, interpret=False):
    return kda_ops.KdaCall(platform, dtype, shape, chunk, gate_bound, interpret)


@pytest.mark.parametrize("platform, want", [("tpu", "mosaic_tpu"), ("gpu", "triton"), ("cpu", "xla")])
def test_auto_takes_the_first_backend_that_supports_the_call(platform, want):
    for reg in (kda_ops.CHUNK, kda_ops.DECODE):
        call = kda_call(platform, shape=(1, 1, 96, 128, 128)) if reg is kda_ops.DECODE else kda_call(platform)
        sel = reg.select("auto", call, record=False)
        assert sel.backend == want
        passed = [name for name, _ in sel.passed_over]
        assert passed == list(reg.names[: reg.names.index(want)])  # everything ahead of it, with a reason
        assert all(f"target is {platform}" in why or "compute capability >= 9.0" in why  # mosaic_gpu: sm_90+
                   for _, why in sel.passed_over)
    moe = moe_ops.MoeCall(platform, "bfloat16", (65536, 3584, 3072), 64, False)
    assert moe_ops.EXPERT_FFN.select("auto", moe, record=False).backend == want


def test_interpret_mode_runs_the_kernels_on_cpu():
    assert kda_ops.CHUNK.select("auto", kda_call("cpu", interpret=True), record=False).backend == "mosaic_tpu"
    assert kda_ops.CHUNK.select("triton", kda_call("cpu", interpret=True), record=False).backend == "triton"


def test_explicit_choice_that_cannot_run_raises_with_the_reason():
    with pytest.raises(KernelUnavailable, match="kda.chunk: implementation='triton'.*needs target platform gpu"):
        kda_ops.CHUNK.select("triton", kda_call("cpu"))
    with pytest.raises(KernelUnavailable, match="powers of two"):
        kda_ops.CHUNK.select("triton", kda_call("gpu", shape=(1, 64, 2, 96, 96)))
    with pytest.raises(KernelUnavailable, match="one-token decode step, got T=8192"):
        kda_ops.DECODE.select("mosaic_tpu", kda_call("tpu"))
    with pytest.raises(KernelUnavailable, match="float32 or bfloat16"):
        moe_ops.EXPERT_FFN.select("mosaic_tpu", moe_ops.MoeCall("tpu", "float16", (8, 64, 32), 4, False))
    with pytest.raises(ValueError, match="implementation must be one of .*'xla'.*got 'pallas_gpu'"):
        kda_ops.CHUNK.select("pallas_gpu", kda_call("gpu"))
    assert kda_ops.CHUNK.canonical("reference") == "xla"  # the old name of the reference, still accepted


def test_unsupported_shapes_fall_back_to_xla_visibly(caplog):
    """A GPU call the Triton kernels cannot take lands on the reference with a WARNING naming the reason, once
    per (op, call, choice); the choice is listed in ``selections()`` for benchmark output."""
    clear_selections()
    call = kda_call("gpu", shape=(1, 64, 2, 96, 96))
    with caplog.at_level(logging.INFO, logger="pallas_kernels"):
        for _ in range(2):
            assert kda_ops.CHUNK.select("auto", call).backend == "xla"
    records = [r for r in caplog.records if r.name == "pallas_kernels"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert "triton: head dims and chunk must be powers of two" in records[0].getMessage()
    assert [s.describe() for s in selections()] == [records[0].getMessage().removeprefix("kernel choice ")]
    clear_selections()


@pytest.mark.parametrize("bound", [-8.0, None])
def test_gate_bound_below_the_kernels_selects_xla_or_raises(bound):
    """``gate_lower_bound < -5`` (or no bound) never runs the bounded kernels: "auto" takes the reference with
    the reason, an explicit kernel raises; through ``chunk_kda`` too (where interpret mode would otherwise pick
    mosaic_tpu on this host)."""
    for platform, kernel in (("tpu", "mosaic_tpu"), ("gpu", "triton")):
        sel = kda_ops.CHUNK.select("auto", kda_call(platform, gate_bound=bound), record=False)
        assert sel.backend == "xla" and "g >= -5" in dict(sel.passed_over)[kernel]
        with pytest.raises(KernelUnavailable, match="needs the lower-bounded gate g >= -5"):
            kda_ops.CHUNK.select(kernel, kda_call(platform, gate_bound=bound))
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    q, k, v, f = (jax.random.normal(kk, (1, 32, 1, 16)) for kk in ks[:4])
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (1, 32, 1)))
    a_log = jnp.zeros((1,))
    lb = -8.0 if bound is None else bound
    jaxpr = str(jax.make_jaxpr(lambda *a: kda_ops.chunk_kda(*a, A_log=a_log, lower_bound=lb, interpret=True))(
        q, k, v, f, beta))
    assert "pallas_call" not in jaxpr  # the reference ran
    with pytest.raises(KernelUnavailable, match="g >= -5"):
        kda_ops.chunk_kda(q, k, v, f, beta, A_log=a_log, lower_bound=lb, implementation="mosaic_tpu",
                          interpret=True)
    with pytest.raises(KernelUnavailable, match="g >= -5"):
        kda_ops.chunk_kda(q, k, v, jnp.zeros_like(f), beta, gate_bound=bound, implementation="triton",
                          interpret=True)


def test_gate_bound_from_the_config():
    cfg = load_config(TINY, gate_lower_bound=-8.0, platform="tpu")
    (chunk,) = [c for c in explain(cfg) if c.layer == "kda (train/prefill)"]
    assert chunk.backend == "xla" and "g >= -5" in dict(chunk.passed_over)["mosaic_tpu"]
    (chunk,) = [c for c in explain(cfg.replace(kda_implementation="mosaic_tpu"))
                if c.layer == "kda (train/prefill)"]
    assert chunk.backend is None and "g >= -8" in chunk.error
    decode = [c for c in explain(cfg) if c.layer == "kda (decode)"]
    assert decode[0].backend == "mosaic_tpu"  # the decode step is exact for any gate


def test_explain_per_layer_kind_and_platform():
    cfg = load_config(TINY)
    rows = explain(cfg, compute_capability=9.0)
    assert {(c.platform, c.layer) for c in rows} == {
        (p, kind) for p in ("cpu", "gpu", "tpu")
        for kind in ("kda (train/prefill)", "kda (decode)", "kda (spec. verify)", "mla (train/prefill)",
                     "mla (cached prefill)", "mla (decode)", "mla (paged decode)", "moe (routed experts)")}
    got = {(c.platform, c.layer): c.backend for c in rows}
    assert got[("gpu", "mla (train/prefill)")] == "cudnn" and got[("tpu", "mla (train/prefill)")] == "xla"
    assert got[("gpu", "mla (cached prefill)")] == "cudnn" and got[("cpu", "mla (cached prefill)")] == "xla"
    assert got[("gpu", "moe (routed experts)")] == "triton" and got[("cpu", "kda (decode)")] == "xla"
    assert got[("gpu", "kda (spec. verify)")] == "triton" and got[("tpu", "kda (spec. verify)")] == "mosaic_tpu"
    assert got[("tpu", "mla (decode)")] == "mosaic_tpu" and got[("gpu", "mla (decode)")] == "xla"
    assert got[("tpu", "mla (paged decode)")] == "mosaic_tpu" and got[("gpu", "mla (paged decode)")] == "xla"
    paged_gpu = [c for c in rows if c.layer == "mla (paged decode)" and c.platform == "gpu"][0]
    reason = dict(paged_gpu.passed_over)["triton"]  # tiny has 4 heads
    assert "T·H divisible by 16" in reason or "no longer ships" in reason, reason
    fp32 = {c.layer: c for c in explain(cfg.replace(dtype="float32"), "gpu", compute_capability=9.0)}
    assert fp32["mla (train/prefill)"].backend == "xla"
    assert "bfloat16/float16" in dict(fp32["mla (train/prefill)"].passed_over)["cudnn"]
    assert fp32["kda (train/prefill)"].backend == "triton"  # fp32 fits shared memory (fewer stages)
    old_gpu = {c.layer: c for c in explain(cfg, "gpu", compute_capability=8.0)}
    assert "compute capability >= 9.0" in dict(old_gpu["mla (train/prefill)"].passed_over)["cudnn"]
    refused = explain(cfg.replace(mla_attention_implementation="cudnn"), "cpu")
    assert [c.error for c in refused if c.layer == "mla (train/prefill)"][0].startswith("mla.attention")
    assert "-> xla" in rows[0].line() and "passed over" in rows[0].line()
    # one field per KDA op: naming the chunk backend leaves decode and verify to their own fields (VERIFY has no
    # mosaic_gpu, which used to make the one shared field an error there)
    k128 = cfg.replace(kda_head_dim=128)  # the Mosaic GPU kernels' head dim
    named = {c.layer: c for c in explain(k128.replace(kda_implementation="mosaic_gpu"), "gpu", compute_capability=9.0)}
    assert named["kda (train/prefill)"].backend == "mosaic_gpu" and named["kda (decode)"].requested == "auto"
    assert named["kda (decode)"].backend == "triton" and named["kda (spec. verify)"].backend == "triton"
    named = {c.layer: c for c in explain(k128.replace(kda_decode_implementation="mosaic_gpu"), "gpu",
                                         compute_capability=9.0)}
    assert named["kda (decode)"].backend == "mosaic_gpu"
    assert named["kda (train/prefill)"].backend == "mosaic_gpu"  # auto on sm_90+
    refused = {c.layer: c for c in explain(k128.replace(kda_decode_implementation="mosaic_gpu"), "gpu",
                                           compute_capability=8.0)}
    assert refused["kda (decode)"].backend is None and "compute capability >= 9.0" in refused["kda (decode)"].error
    assert "ERROR" in refused["kda (decode)"].line()
    # one field per MLA decode cache: the paged backend named leaves the contiguous cache's decode to its own field
    named = {c.layer: c for c in explain(cfg.replace(mla_paged_decode_implementation="xla"), "tpu")}
    assert named["mla (paged decode)"].backend == "xla" and named["mla (decode)"].backend == "mosaic_tpu"
    named = {c.layer: c for c in explain(cfg.replace(mla_decode_attention_implementation="xla"), "tpu")}
    assert named["mla (decode)"].backend == "xla" and named["mla (paged decode)"].backend == "mosaic_tpu"


def test_attention_choice_in_the_layer_raises_off_gpu():
    cfg = load_config(TINY, mla_attention_implementation="cudnn")
    q = jnp.zeros((1, 16, 2, 8), jnp.bfloat16)
    with pytest.raises(KernelUnavailable, match="mla.attention: implementation='cudnn'.*target is cpu"):
        from k3_jax.layers.mla import causal_attention  # noqa: PLC0415

        causal_attention(cfg, q, q, q[..., :4], 0.3, None)
    call = attention.AttentionCall("gpu", "bfloat16", (1, 16384 + 2, 2, 192, 128), True, 9.0)
    sel = attention.ATTENTION.select("auto", call, record=False)
    assert sel.backend == "xla" and "even T <= 16384" in dict(sel.passed_over)["cudnn"]


BAD_FIELDS = [("kda_implementation", "pallas_gpu"), ("kda_decode_implementation", "cuda"),
              ("kda_verify_implementation", "mosaic_gpu"), ("moe_implementation", "ep_allgather"),
              ("mla_attention_implementation", "flash"), ("moe_expert_parallel", "ring"), ("platform", "cuda"),
              ("mla_decode_attention_implementation", "triton"),  # a paged-cache backend only: its own field
              ("mla_paged_decode_implementation", "cudnn")]


@pytest.mark.parametrize("key, value", BAD_FIELDS)
def test_config_fields_are_validated_against_the_registries(key, value):
    with pytest.raises(ConfigError, match=f"config key '{key}': expected one of"):
        load_config(TINY, **{key: value})


def test_expert_parallel_strategy_is_its_own_field():
    from k3_jax.layers.moe import expert_parallel_strategy  # noqa: PLC0415
    from sharding.mesh import make_mesh  # noqa: PLC0415

    cfg = load_config(TINY)
    assert expert_parallel_strategy(cfg) is None  # no mesh
    if jax.device_count() < 2:
        pytest.skip("needs 2 (virtual) devices")
    with jax.set_mesh(make_mesh("expert=2", devices=jax.devices()[:2])):
        assert expert_parallel_strategy(cfg) == "allgather"
        assert expert_parallel_strategy(cfg.replace(moe_expert_parallel="all_to_all")) == "all_to_all"
        assert expert_parallel_strategy(cfg.replace(moe_expert_parallel="none")) is None
        assert expert_parallel_strategy(cfg.replace(moe_implementation="xla")) is None


def test_target_platform_is_explicit_scoped_mesh_or_default_device():
    assert target_platform("cuda") == "gpu" and target_platform("tpu") == "tpu"
    assert target_platform() == jax.devices()[0].platform  # no mesh: the default device
    with platform_scope("tpu"):
        assert target_platform() == "tpu" and target_platform("gpu") == "gpu"
        with platform_scope("auto"), platform_scope(None):  # a layer with platform "auto" keeps the outer scope
            assert target_platform() == "tpu"
            with platform_scope("gpu"):
                assert target_platform() == "gpu"
            assert target_platform() == "tpu"
    assert target_platform() == jax.devices()[0].platform
    with pytest.raises(ValueError, match="platform must be one of"):
        target_platform("metal")


def test_target_compute_capability_is_scoped_or_the_visible_gpus():
    """A compile for a GPU this host does not have names its compute capability in the scope; the op calls carry
    it (here the KDA chunk's, which makes ``mosaic_gpu`` selectable on a CPU host)."""
    visible = visible_gpu_compute_capability()
    assert target_compute_capability("gpu") == visible and target_compute_capability("cpu") is None
    q = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)
    with platform_scope("gpu", compute_capability=9.0):
        assert target_compute_capability("gpu") == 9.0 and target_compute_capability("tpu") is None
        with platform_scope("gpu"):  # no compute capability named: the outer one stays
            assert target_compute_capability("gpu") == 9.0
        call = kda_ops.make_call(q, q, 64, -5.0, False, None)
        assert call.platform == "gpu" and call.compute_capability == 9.0
        assert kda_ops.CHUNK.select("mosaic_gpu", call, record=False).backend == "mosaic_gpu"
        with platform_scope(None, compute_capability=8.0):
            assert target_compute_capability("gpu") == 8.0
            with pytest.raises(KernelUnavailable, match="9.0"):
                kda_ops.CHUNK.select("mosaic_gpu", kda_ops.make_call(q, q, 64, -5.0, False, None), record=False)
    assert target_compute_capability("gpu") == visible


def test_registry_rejects_inconsistent_tables():
    with pytest.raises(ValueError, match="unknown backends"):
        Registry("x", kda_ops.CHUNK.backends, {"old": "missing"})


# ----------------------------------------------------------------------------- Triton shared memory (issue 25)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_launch_fits_the_h200_at_k3_shapes(dtype):
    """The chosen stages of every Triton sweep fit the H200's 232,448 B per block for fp32 and bf16 inputs at
    K = V = 128, chunk 64 (the fp32 forward's default 3 stages would need ~427 kB: Triton asked 327,680 B)."""
    dt = jnp.dtype(dtype)
    plan = launch.chunk_launch(chunk=64, k=128, v=128, q_dtype=dt, v_dtype=dt, limit=launch.H200_SHARED_MEMORY)
    assert all(b <= launch.H200_SHARED_MEMORY for b in plan.bytes.values()), plan
    assert plan.stages["kda_chunk_state_gpu"] == (3 if dtype == "bfloat16" else 1), plan
    big = launch.shared_memory_bytes("kda_chunk_state_gpu", 3, chunk=64, k=128, block_v=64, q_dtype=dt, v_dtype=dt)
    assert (big > 327_680) == (dtype == "float32")  # the estimate is conservative where Triton failed
    if dtype == "float32":
        with pytest.raises(ValueError, match="num_stages=3 needs ~427,520 B of shared memory"):
            launch.fit_num_stages("kda_chunk_state_gpu", 3, chunk=64, k=128, block_v=64, q_dtype=dt, v_dtype=dt,
                                  limit=launch.H200_SHARED_MEMORY)


def test_triton_refused_when_no_launch_fits(monkeypatch):
    assert launch.shared_memory_limit("8.6") == 101_376 and launch.shared_memory_limit((9, 0)) == 232_448
    monkeypatch.setattr(launch, "device_shared_memory", lambda: 120_000)
    sel = kda_ops.CHUNK.select("auto", kda_call("gpu", dtype="float32"), record=False)
    assert sel.backend == "xla" and dict(sel.passed_over)["triton"].startswith("shared memory: kda_")
    assert kda_ops.CHUNK.select("auto", kda_call("gpu"), record=False).backend == "triton"  # bf16 fits
