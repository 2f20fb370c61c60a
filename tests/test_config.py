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


@pytest.mark.parametrize(
    "where, key, value, expected",
    [
        ("text", "hidden_size", "abc", "an int"),
        ("text", "num_experts", 2.5, "an int"),
        ("text", "rms_norm_eps", "tiny", "a number"),
        ("text", "latent_moe_use_norm", "yes", "true/false"),
        ("linear", "num_heads", "six", "an int"),
        ("top", "tie_word_embeddings", 0, "true/false"),
    ],
)
def test_wrongly_typed_value_names_key_type_and_value(tmp_path, where, key, value, expected):
    raw = _tiny_raw()
    target = {"text": raw["text_config"], "linear": raw["text_config"]["linear_attn_config"], "top": raw}[where]
    target[key] = value
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert repr(key) in msg and expected in msg and repr(value) in msg and str(path) in msg, msg


def test_wrongly_typed_override_names_the_field():
    with pytest.raises(ConfigError, match=r"'rms_norm_eps': expected a number, got 'abc'"):
        load_config(REPO / "configs" / "k3-tiny.json", rms_norm_eps="abc")
    with pytest.raises(ConfigError, match=r"'remat': expected a string, got 1"):
        load_config(REPO / "configs" / "k3-tiny.json", remat=1)
    # list values of tuple fields become tuples (the config stays hashable)
    cfg = load_config(REPO / "configs" / "k3-tiny.json").replace(kda_layers=[0, 1, 2, 4, 5, 6])
    assert cfg.kda_layers == (0, 1, 2, 4, 5, 6) and hash(cfg)


def test_unknown_keys_warn_once_by_name(tmp_path):
    from k3_jax.config import ConfigWarning

    raw = _tiny_raw()
    raw["text_config"]["hiden_size"] = 256
    raw["text_config"]["linear_attn_config"]["chunk"] = 64
    raw["vision_tower_extra"] = {}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    with pytest.warns(ConfigWarning) as record:
        load_config(path)
    assert len(record) == 1
    msg = str(record[0].message)
    for name in ("text_config.hiden_size", "text_config.linear_attn_config.chunk", "vision_tower_extra"):
        assert name in msg, msg
    assert str(path) in msg


def test_release_and_bundled_configs_load_without_warnings():
    """The published config.json's known-but-unused keys (HF generation defaults, vision_config, auto_map...)
    and every bundled config load without a warning; so does the HF dict k3-jax itself writes."""
    import warnings

    paths = sorted((REPO / "configs").glob("*.json"))
    ref = SHARED / "reference" / "config.json"
    if ref.exists():
        paths.append(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for p in paths:
            cfg = load_config(p)
            config_from_dict(cfg.to_hf_dict())


def test_bundled_configs_travel_with_the_package():
    """``k3_jax/configs`` (what a wheel carries as package data) is the repository's ``configs/``: a config or
    sharding preset named by short name resolves without the checkout's working directory."""
    import pathlib
    import tomllib

    from k3_jax.config import bundled_config_dirs, config_path

    root = pathlib.Path(__file__).resolve().parents[1]
    (bundled,) = bundled_config_dirs()
    assert pathlib.Path(bundled).samefile(root / "configs")
    assert pathlib.Path(config_path("k3-tiny")).samefile(root / "configs" / "k3-tiny.json")
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["k3_jax"]
    assert {"configs/*.json", "configs/sharding/*.json"} <= set(data)


def test_replace_and_parse_overrides_name_bad_keys_and_items():
    from k3_jax.config import parse_overrides

    cfg = load_config("configs/k3-tiny.json")
    with pytest.raises(ConfigError, match=r"config keys \['kda_impl'\] are not K3Config fields"):
        cfg.replace(kda_impl="xla")
    assert parse_overrides(["kda_implementation=triton", "kda_layers=[0, 2]", "rms_norm_eps=1e-5"]) == {
        "kda_implementation": "triton", "kda_layers": (0, 2), "rms_norm_eps": 1e-5}
    with pytest.raises(ConfigError, match=r"--set expects KEY=VALUE, got '=1'"):
        parse_overrides(["=1"])
