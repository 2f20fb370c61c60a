"""Config loading, validation and the analytic parameter counter."""

import json

import pytest

from k3_jax.config import ConfigError, config_from_dict, count_params, load_config
from tests._model_fixtures import REPO, SHARED


def test_k3_json_matches_release_text_config():
    ref = SHARED / "reference" / "config.json"
    if not ref.exists():
        pytest.skip(f"release config not found at {ref} (shared/ absent)")
    ours = json.loads((REPO / "configs" / "k3.json").read_text())
    assert ours["text_config"] == json.loads(ref.read_text())["text_config"]


def test_k3_layer_lists_converted_to_zero_based():
    cfg = load_config(REPO / "configs" / "k3.json")
    assert len(cfg.kda_layers) == 69 and len(cfg.mla_layers) == 24
    assert cfg.mla_layers[:3] == (3, 7, 11) and cfg.mla_layers[-2:] == (91, 92)
    assert cfg.mixer_kind(0) == "kda" and cfg.ffn_kind(0) == "dense" and cfg.ffn_kind(1) == "moe"
    assert cfg.expert_format == "mxfp4"  # the release's quantization_config
    assert cfg.num_attn_res_blocks == 8


def test_k3_parameter_counts_match_release():
    counts = count_params(load_config(REPO / "configs" / "k3.json"))
    assert abs(counts["total"] / 2.78e12 - 1) < 0.005
    assert abs(counts["active"] / 104.2e9 - 1) < 0.005


def test_tiny_config_has_every_k3_feature():
    cfg = load_config(REPO / "configs" / "k3-tiny.json")
    assert cfg.mla_layers == (3, 7, 8, 9) and cfg.kda_layers == (0, 1, 2, 4, 5, 6)
    assert cfg.ffn_kind(0) == "dense" and all(cfg.ffn_kind(i) == "moe" for i in range(1, 10))
    assert cfg.num_hidden_layers % cfg.attn_res_block_size != 0 and cfg.num_attn_res_blocks >= 3
    assert cfg.kda_proj_size != cfg.hidden_size and cfg.routed_expert_hidden_size != cfg.hidden_size


def test_small_config_size():
    total = count_params(load_config(REPO / "configs" / "k3-small.json"))["total"]
    assert 100e6 <= total <= 300e6


def _tiny_raw():
    return json.loads((REPO / "configs" / "k3-tiny.json").read_text())


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda t: t["linear_attn_config"].update(kda_layers=[1, 2, 3, 4]), "kda_layers/full_attn_layers"),
        (lambda t: t["linear_attn_config"].update(full_attn_layers=[0, 4]), "full_attn_layers"),
        (lambda t: t.pop("hidden_size"), "hidden_size"),
        (lambda t: t.update(num_experts_per_token=99), "num_experts_per_token"),
        (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
        (lambda t: t.update(num_key_value_heads=2), "num_key_value_heads"),
        (lambda t: t.update(attn_res_block_size=0), "attn_res_block_size"),
    ],
)
def test_bad_config_names_the_key(mutate, key):
    raw = _tiny_raw()
    mutate(raw["text_config"])
    with pytest.raises(ConfigError, match=key):
        config_from_dict(raw)


def test_slice_config_has_k3_layer_shapes():
    """``k3-slice.json`` (the benchmark config for training throughput on one GPU): every per-layer width equals
    the released K3's, so its matmuls and kernels run at K3's shapes; only depth, expert count, top-k and the
    vocabulary are smaller."""
    k3, sl = (load_config(REPO / "configs" / f"{n}.json") for n in ("k3", "k3-slice"))
    for field in ("hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "kda_num_heads", "kda_head_dim", "moe_intermediate_size",
                  "routed_expert_hidden_size", "num_shared_experts", "gate_lower_bound"):
        assert getattr(sl, field) == getattr(k3, field), field
    assert [sl.mixer_kind(i) for i in range(sl.num_hidden_layers)] == ["kda", "kda", "kda", "mla"]
    assert 4.8e9 < count_params(sl)["total"] < 5.0e9


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "configs").glob("*.json")))
def test_every_bundled_config_loads(name):
    cfg = load_config(REPO / "configs" / f"{name}.json")
    assert count_params(cfg)["active"] <= count_params(cfg)["total"]


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)


def test_hf_dict_round_trip():
    cfg = load_config(REPO / "configs" / "k3.json")
    assert config_from_dict(cfg.to_hf_dict()) == cfg
