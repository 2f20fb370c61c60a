"""Bad checkpoints: each gives one clear error naming the file and tensor, and leaves no output behind."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from k3_jax.convert import CheckpointError, SafetensorsError, load_checkpoint
from k3_jax.convert.fixture import write_fixture
from k3_jax.convert.hf import INDEX_NAME
from k3_jax.convert.orbax_io import convert_to_orbax
from k3_jax.convert.safetensors_io import SafetensorsFile, write_safetensors

TARGET = "language_model.model.layers.1.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good") / "ckpt"
    write_fixture(d, "k3-tiny", experts="bf16", seed=3, max_shard_bytes=2 << 20)
    return d


def _index(d):
    with open(d / INDEX_NAME) as f:
        return json.load(f)


def _rewrite_shard(d, fname, edit):
    """Re-write shard ``fname`` with ``edit(dict of tensors)`` applied (also updates the index map)."""
    with SafetensorsFile(d / fname) as f:
        tensors = {k: f.get(k) for k in f.keys()}
    before = set(tensors)
    edit(tensors)
    write_safetensors(d / fname, tensors, {"format": "pt"})
    idx = _index(d)
    for k in before - set(tensors):
        del idx["weight_map"][k]
    for k in set(tensors) - before:
        idx["weight_map"][k] = fname
    (d / INDEX_NAME).write_text(json.dumps(idx))


def _shard_of(d, name=TARGET):
    return _index(d)["weight_map"][name]


def _missing(d):
    _rewrite_shard(d, _shard_of(d), lambda t: t.pop(TARGET))


def _unexpected(d):
    name = "language_model.model.layers.1.self_attn.q_bias"
    _rewrite_shard(d, _shard_of(d), lambda t: t.__setitem__(name, np.zeros(4, np.float32)))
    return name


def _wrong_shape(d):
    _rewrite_shard(d, _shard_of(d), lambda t: t.__setitem__(TARGET, np.ascontiguousarray(t[TARGET].T)))


def _wrong_dtype(d):
    _rewrite_shard(d, _shard_of(d), lambda t: t.__setitem__(TARGET, t[TARGET].astype(np.float32)))


def _truncated(d):
    p = d / _shard_of(d)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 1000])


def _corrupt_header(d):
    p = d / _shard_of(d)
    data = bytearray(p.read_bytes())
    data[8:24] = b"\x00garbage!\xff\xfe{{{{{"
    p.write_bytes(bytes(data))


def _missing_file(d):
    os.remove(d / _shard_of(d))


def _config_mismatch(d):
    raw = json.loads((d / "config.json").read_text())
    raw["text_config"]["linear_attn_config"]["num_heads"] = 4  # tensors were written for 6 KDA heads
    (d / "config.json").write_text(json.dumps(raw))


CASES = {
    # case: (mutation, error type, substrings the message must contain (besides the file))
    "missing_tensor": (_missing, CheckpointError, ["missing tensor", TARGET]),
    "unexpected_tensor": (_unexpected, CheckpointError, ["layers.1.self_attn.q_bias"]),
    "wrong_shape": (_wrong_shape, CheckpointError, [TARGET, "expected BF16[384, 256]", "BF16[256, 384]"]),
    "wrong_dtype": (_wrong_dtype, CheckpointError, [TARGET, "expected BF16", "F32[384, 256]"]),
    "truncated_shard": (_truncated, CheckpointError, ["truncated", "tensor"]),
    "corrupt_header": (_corrupt_header, CheckpointError, ["corrupt header"]),
    "index_names_missing_file": (_missing_file, CheckpointError, ["does not exist", "tensor"]),
    "config_mismatch": (_config_mismatch, CheckpointError, ["self_attn", "expected"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_clear_error_and_no_output(case, good, tmp_path):
    mutate, err_type, needles = CASES[case]
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    fname = _shard_of(bad)
    mutate(bad)
    out = tmp_path / "out"
    with pytest.raises(err_type) as ei:
        convert_to_orbax(bad, out)
    msg = str(ei.value)
    file_named = fname in msg or INDEX_NAME in msg or "config.json" in msg
    assert file_named, msg
    for n in needles:
        assert n in msg, (n, msg)
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir()), list(tmp_path.iterdir())
    with pytest.raises(err_type):
        load_checkpoint(bad)


def test_truncated_header_and_tiny_file(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(b"\x01\x02")
    with pytest.raises(SafetensorsError, match="truncated"):
        SafetensorsFile(p)
    p.write_bytes((1000).to_bytes(8, "little") + b"{}")
    with pytest.raises(SafetensorsError, match="header length 1000"):
        SafetensorsFile(p)


def test_export_failure_leaves_no_directory(good, tmp_path):
    from k3_jax.convert import save_checkpoint

    cfg, params = load_checkpoint(good)
    del params["model"]["norm"]  # an incomplete model cannot be exported
    with pytest.raises(KeyError):
        save_checkpoint(cfg, params, tmp_path / "exp")
    assert list(tmp_path.iterdir()) == []
