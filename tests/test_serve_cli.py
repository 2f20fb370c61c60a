"""``serve.py`` argument checks that refuse before any model is loaded."""

from __future__ import annotations

import pytest

from k3_jax.cli import serve


def test_page_size_without_a_paged_cache_is_refused_naming_the_flag():
    with pytest.raises(SystemExit, match=r"--page-size 16 sets the paged cache's page tokens: add --paged"):
        serve.main(["--config", "configs/k3-tiny.json", "--page-size", "16", "--prompt", "hi"])


def test_set_overrides_a_model_config_field_and_refuses_unknown_keys_and_bad_items():
    args = serve._parse(["--config", "configs/k3-tiny.json", "--set", "kda_implementation=xla",
                             "--set", "moe_implementation=xla", "--dtype", "float32"])
    assert serve.config_overrides(args) == {"kda_implementation": "xla", "moe_implementation": "xla",
                                            "dtype": "float32"}
    cfg, _, _, _ = serve.load_model(args)
    assert (cfg.kda_implementation, cfg.moe_implementation, cfg.dtype) == ("xla", "xla", "float32")
    with pytest.raises(SystemExit, match=r"--set kda_impl: not a model-config field"):
        serve.main(["--config", "configs/k3-tiny.json", "--set", "kda_impl=xla", "--prompt", "hi"])
    with pytest.raises(SystemExit, match=r"--set expects KEY=VALUE, got 'kda_implementation'"):
        serve.main(["--config", "configs/k3-tiny.json", "--set", "kda_implementation", "--prompt", "hi"])
    with pytest.raises(SystemExit, match=r"config: config key 'kda_implementation': expected one of"):
        serve.main(["--config", "configs/k3-tiny.json", "--set", "kda_implementation=cuda", "--prompt", "hi"])
