"""The one-token decode step compiles ahead of time for one TPU v5p chip on this CPU host
(``benchmarks/decode_aot.py``): the TPU's kernels, XLA's bytes accessed, and the KDA states updated in place
(the donated cache aliased to the output)."""

import importlib.util
import os

import pytest

if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed (pip install -e '.[aot]')", allow_module_level=True)
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from benchmarks.decode import layer_config  # noqa: E402
from benchmarks.decode_aot import compile_decode  # noqa: E402
from k3_jax.config import load_config  # noqa: E402
from tests._model_fixtures import REPO  # noqa: E402


def test_decode_step_compiles_for_v5p_with_states_in_place():
    cfg = load_config(str(REPO / "configs" / "k3-tiny.json")).replace(platform="tpu", param_dtype="bfloat16")
    cfg = layer_config(cfg, ["kda", "mla"], None)
    try:
        out = compile_decode("v5p", cfg, batch=8, prompt_len=64, max_len=128)
    except RuntimeError as exc:  # libtpu present but unable to describe the topology on this host
        if "topology" in str(exc).lower():
            pytest.skip(f"libtpu cannot describe v5p: {exc}")
        raise
    assert out["layers"] == ["kda+moe", "mla+moe"]
    assert out["mosaic_kernels"] >= 2, out  # the KDA decode kernel and the MoE grouped matmuls
    must = out["must_bytes"]
    assert must["total"] <= out["bytes_accessed"] < 50 * must["total"], out
    assert out["alias_bytes"] >= must["kda_state_rw"] // 2, out  # the states' buffer is the output's
