"""Memory plan of the full K3 config against hand-computed and published figures (abstract shapes only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3_jax.config import load_config
from sharding import rules
from sharding.memory import plan, vision_tower_bytes
from sharding.plan import abstract_params, main

ROOT = Path(__file__).resolve().parents[1]
INDEX_TOTAL_SIZE = 1_560_860_324_864  # model.safetensors.index.json total_size of the release


@pytest.fixture(scope="module")
def k3():
    cfg = load_config(ROOT / "configs" / "k3.json", param_dtype="bfloat16", dtype="bfloat16")
    assert cfg.expert_format == "mxfp4"
    return cfg, abstract_params(cfg)


def test_checkpoint_bytes_and_published_serving_figures(k3):
    cfg, boxed = k3
    p = plan(cfg, "serve", {"tensor": 8}, seq_len=1 << 20, latent_dtype="float8_e4m3fn", boxed=boxed)
    # the model's abstract parameters + A_log padding + vision tower = the release index, to the byte
    assert p.whole["checkpoint_bytes_with_vision"] == INDEX_TOTAL_SIZE
    assert vision_tower_bytes() == 2 * 447_358_976
    # MLA latent: 576 values x 24 layers x 2^20 tokens x 1 byte (FP8) = 14.496 GB, replicated over tensor
    assert p.whole["mla_latent_per_sequence"] == 576 * 24 * 2**20 == 14_495_514_624
    assert p.per_device["mla_latent_cache"] == 14_495_514_624
    # KDA states: 69 x 96*128*128 f32 per sequence; with the conv tails well under 1 GB
    assert p.whole["kda_state_per_sequence"] == 69 * 96 * 128 * 128 * 4
    assert p.whole["kda_state_per_sequence"] + p.whole["kda_conv_per_sequence"] < 1e9
    assert p.per_device["kda_state"] == p.whole["kda_state_per_sequence"] / 8  # heads over tensor=8
    # seed 000 (AMD, 8 x 288 GiB, TP8, MXFP4, FP8 latent, 1M tokens): "about 205 GB per GPU loaded"
    assert abs(p.loaded / 205e9 - 1) < 0.05, p.loaded
    assert p.total < 288 * 2**30
    # AttnRes bank for an 8,192-token prefill chunk: 8 blocks x 8192 x 7168 x bf16 = 0.94 GB (seed 000)
    assert abs(p.whole["attn_res_bank_per_chunk"] / 0.94e9 - 1) < 0.01


def test_train_plan_counts_optimizer(k3):
    cfg, boxed = k3
    mesh = {"fsdp": 16, "expert": 8, "tensor": 4}  # v5p-512 (512 chips)
    p = plan(cfg, "train", mesh, optimizer="adamw", batch=512, seq_len=8192, boxed=boxed)
    # nearly everything is sharded 512 ways under `train`; the rest (f_b_proj's unnamed input dim, conv taps,
    # norms: ~65 MB per device) is only split over `tensor`
    assert p.whole["params"] / 512 < p.per_device["params"] < 1.03 * p.whole["params"] / 512
    # AdamW: two f32 moments per trainable (dequantized) element; MXFP4 experts count 2 elements per byte
    assert p.whole["optimizer"] == pytest.approx(8 * 2.78e12, rel=0.01)


@pytest.mark.parametrize("preset, mesh", [
    ("train", {"fsdp": 16, "expert": 8, "tensor": 4}),
    ("serve", {"expert": 64, "tensor": 4}),
    ("serve", {"tensor": 8}),
    ("long-context", {"fsdp": 8, "sequence": 8, "tensor": 4}),
])
def test_no_large_parameter_replicated(k3, preset, mesh):
    _, boxed = k3
    big = rules.replicated_params(boxed, mesh, preset, min_bytes=1 << 20)
    allowed = rules.REPLICATED_OK.get(preset, ())
    unexpected = [(path, shape) for path, shape, _ in big if not any(a in path for a in allowed)]
    assert not unexpected, f"{preset} leaves these >1 MiB parameters replicated: {unexpected}"


def test_cli_prints_table(capsys):
    assert main(["--config", str(ROOT / "configs" / "k3-tiny.json"), "--preset", "train", "--mesh", "fsdp=-1",
                 "--devices", "8", "--optimizer", "adamw", "--seq-len", "64", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "optimizer" in out and "activations_est" in out and "mla_latent_cache" not in out  # no decode cache
    assert main(["--config", str(ROOT / "configs" / "k3-tiny.json"), "--preset", "serve", "--mesh", "tensor=2",
                 "--seq-len", "4096", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    # tiny: 4 MLA layers x (32 + 16) latent values x 4096 tokens x 1 byte (FP8), replicated over tensor
    assert d["per_device_bytes"]["mla_latent_cache"] == 4 * 48 * 4096
    assert d["per_device_bytes"]["kda_state"] == 6 * 6 * 64 * 64 * 4 / 2  # 6 KDA layers, heads split in 2


# LoRA steps compiled for TPU on the CPU host (benchmarks/finetune_aot.py; RESULTS.md "Memory plan" rows): config,
# mesh, batch, seq_len, remat, layers of the depth cut, the compiler's temp bytes per chip (GB)
COMPILED_LORA_CUTS = [
    ("k3.json", "fsdp=4,expert=4,tensor=4", 16, 2048, "none", 4, 21.925),
    ("k3.json", "fsdp=4,expert=4,tensor=4", 16, 2048, "none", 8, 34.227),
    ("k3.json", "fsdp=4,expert=4,tensor=4", 16, 2048, "full", 2, 15.173),
    ("k3.json", "fsdp=4,expert=4,tensor=4", 16, 2048, "full", 3, 15.185),
    ("k3-small.json", "fsdp=2,expert=2,tensor=2", 8, 2048, "none", 2, 0.480),
    ("k3-small.json", "fsdp=2,expert=2,tensor=2", 8, 2048, "none", 3, 0.754),
    ("k3-small.json", "fsdp=2,expert=2,tensor=2", 8, 2048, "full", 2, 0.428),
    ("k3-small.json", "fsdp=2,expert=2,tensor=2", 8, 2048, "full", 3, 0.440),
]


@pytest.mark.parametrize("config, mesh, batch, seq_len, remat, layers, temp_gb", COMPILED_LORA_CUTS)
def test_train_activations_agree_with_the_compiler(config, mesh, batch, seq_len, remat, layers, temp_gb):
    """The plan's activations + gradient accumulator of a LoRA step (rank 64, frozen MXFP4 experts) are within 10%
    of XLA:TPU's temp bytes for the same depth cut (what the compiler keeps: train_activation_terms)."""
    import jax.numpy as jnp

    from benchmarks.finetune_aot import TARGETS, depth_cut
    from k3_jax.training import lora

    path = ROOT / "configs" / config
    cfg = load_config(path, expert_format="mxfp4", param_dtype="bfloat16", remat=remat, **depth_cut(str(path), layers))
    boxed = abstract_params(cfg)
    boxed = lora.with_adapters(boxed, lora.adapter_shapes(boxed, lora.LoraConfig(rank=64, targets=TARGETS),
                                                          dtype=jnp.float32))
    p = plan(cfg, "train", mesh, batch=batch, seq_len=seq_len, optimizer="adamw", boxed=boxed, lora=True)
    est = (p.per_device["activations_est"] + p.per_device["gradients"]) / 1e9
    assert est == pytest.approx(temp_gb, rel=0.10)


def test_remat_full_keeps_one_bank_per_layer(k3):
    cfg, boxed = k3
    mesh = {"fsdp": 4, "expert": 4, "tensor": 4}
    full = plan(cfg.replace(remat="full"), "train", mesh, optimizer="adamw", batch=64, seq_len=4096, accum=4,
                boxed=boxed)
    bank = full.whole["activation_bank_per_layer_per_device"]
    assert bank == 9 * (64 * 4096 // 4 // 16) * 7168 * 2  # 9 source slots x 4096 tokens x D, bf16
    assert full.whole["activation_saved_layers_per_device"] == 93 * bank
    none = plan(cfg, "train", mesh, optimizer="adamw", batch=64, seq_len=4096, accum=4, boxed=boxed)
    assert none.per_device["activations_est"] > 5 * full.per_device["activations_est"]
