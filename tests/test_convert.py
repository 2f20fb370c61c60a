"""Checkpoint converter: fixture round trips (bf16 / MXFP4), MXFP4 decoding, table vs model tree, logits."""

from __future__ import annotations

import filecmp
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k3_jax.config import config_path, load_config
from k3_jax.convert import load_checkpoint, save_checkpoint, verify
from k3_jax.convert.fixture import random_params, write_fixture
from k3_jax.convert.hf import param_shapes, read_index
from k3_jax.convert.safetensors_io import SafetensorsFile, write_safetensors
from k3_jax.convert.transforms import pack_mxfp4_np, unpack_mxfp4_np


def _leaves(tree):
    return jax.tree_util.tree_leaves_with_path(tree)


def _bitwise_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.fixture(scope="module", params=["bf16", "mxfp4"])
def fixture_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"fx_{request.param}") / "ckpt"
    cfg, params = write_fixture(d, "k3-tiny", experts=request.param, seed=1, max_shard_bytes=2 << 20)
    return request.param, d, cfg, params


def test_fixture_layout(fixture_dir):
    fmt, d, cfg, _ = fixture_dir
    files = sorted(os.listdir(d))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):06d}.safetensors"
    raw = json.load(open(d / "config.json"))
    assert raw["model_type"] == "kimi_k3"
    qc = raw["text_config"].get("quantization_config")
    if fmt == "mxfp4":
        assert qc["format"] == "mxfp4-pack-quantized"
        assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    else:
        assert qc is None
    idx = read_index(d)
    name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2." + (
        "weight_packed" if fmt == "mxfp4" else "weight"
    )
    assert name in idx.weight_map
    with SafetensorsFile(d / idx.weight_map[name]) as f:
        info = f.tensors[name]
    lat, ei = cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    assert info.shape == ((lat, ei // 2) if fmt == "mxfp4" else (lat, ei))
    assert info.dtype == ("U8" if fmt == "mxfp4" else "BF16")
    rep = verify(d)
    assert rep.ok and rep.unknown == 0 and rep.bytes == rep.declared == idx.total_size, rep.errors


def test_round_trip_byte_identical(fixture_dir, tmp_path):
    fmt, d, cfg, params = fixture_dir
    cfg2, loaded = load_checkpoint(d)  # default: keep the checkpoint's format (MXFP4 stays packed)
    assert cfg2.expert_format == fmt
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(params)
    for (path, a), (_, b) in zip(_leaves(params), _leaves(loaded), strict=True):
        assert _bitwise_equal(a, b), jax.tree_util.keystr(path)
    out = save_checkpoint(cfg2, loaded, tmp_path / "export", max_shard_bytes=2 << 20)
    for f in sorted(os.listdir(d)):  # same writer + same plan => identical files, not just tensors
        assert filecmp.cmp(d / f, os.path.join(out, f), shallow=False), f


def test_mxfp4_dequantized_load_and_bf16_export(fixture_dir, tmp_path):
    fmt, d, cfg, params = fixture_dir
    if fmt != "mxfp4":
        pytest.skip("MXFP4 fixture only")
    cfg_b, deq = load_checkpoint(d, experts="bf16")
    assert cfg_b.expert_format == "bf16"
    ex = params["model"]["segment_1"]["layer_0"]["block_sparse_moe"]["experts"]["w1"]
    w1 = deq["model"]["segment_1"]["layer_0"]["block_sparse_moe"]["experts"]["w1"]
    assert w1.dtype == ml_dtypes.bfloat16 and w1.shape == (*ex["weight_packed"].shape[:2], 128, 64)
    ref = np.swapaxes(unpack_mxfp4_np(ex["weight_packed"], ex["weight_scale"]), -1, -2)
    np.testing.assert_array_equal(w1.astype(np.float32), ref)  # E2M1 * 2^k is exact in bf16
    # bf16 export of the dequantized model, then re-quantizing on load gives back the packed values exactly
    out = save_checkpoint(cfg_b, deq, tmp_path / "bf16", max_shard_bytes=2 << 20)
    assert verify(out).ok
    _, again = load_checkpoint(out, experts="mxfp4")
    e2 = again["model"]["segment_1"]["layer_0"]["block_sparse_moe"]["experts"]["w1"]
    np.testing.assert_array_equal(
        unpack_mxfp4_np(e2["weight_packed"], e2["weight_scale"]),
        unpack_mxfp4_np(ex["weight_packed"], ex["weight_scale"]),
    )


def test_mxfp4_decode_matches_spec_formula_and_ml_dtypes():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (8, 64), dtype=np.uint8)
    scale = rng.integers(100, 150, (8, 4), dtype=np.uint8)
    got = unpack_mxfp4_np(packed, scale)
    # ml_dtypes' float4_e2m1fn decoding of each nibble, low nibble first
    nib = np.stack([packed & 0x0F, packed >> 4], -1).reshape(8, 128)
    f4 = np.array([np.uint8(c) for c in range(16)], np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    want = f4[nib] * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=1)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    # and the packer inverts it exactly for representable values (low nibble first)
    p2, s2 = pack_mxfp4_np(got)
    np.testing.assert_array_equal(unpack_mxfp4_np(p2, s2), got)
    from k3_jax.quant.mxfp4 import pack_mxfp4, unpack_mxfp4

    w = rng.standard_normal((4, 96)).astype(np.float32)
    pj, sj = pack_mxfp4(jnp.asarray(w))
    pn, sn = pack_mxfp4_np(w)
    np.testing.assert_array_equal(np.asarray(pj), pn)
    np.testing.assert_array_equal(np.asarray(sj), sn)
    np.testing.assert_array_equal(np.asarray(unpack_mxfp4(pj, sj)), unpack_mxfp4_np(pn, sn))


def test_safetensors_writer_matches_library(tmp_path):
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(0)
    t = {
        "b": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        "a": rng.standard_normal(7).astype(np.float32),
        "c": rng.integers(0, 255, (2, 9), dtype=np.uint8),
        "d": np.zeros((0, 4), np.float32),
    }
    write_safetensors(tmp_path / "ours.safetensors", t, {"format": "pt"})
    save_file(t, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()
    back = load_file(str(tmp_path / "ours.safetensors"))
    with SafetensorsFile(tmp_path / "lib.safetensors") as f:
        for k, v in t.items():
            assert _bitwise_equal(f.get(k), v) and _bitwise_equal(back[k], v)


def _struct(tree):
    return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in _leaves(tree)}


@pytest.mark.parametrize("name,experts", [("k3-tiny", "bf16"), ("k3-tiny", "mxfp4"), ("k3", "mxfp4")])
def test_table_tree_equals_model_init_tree(name, experts):
    import flax

    from k3_jax.model import K3ForCausalLM

    cfg = load_config(config_path(name)).replace(expert_format=experts)
    abstract = jax.eval_shape(lambda: K3ForCausalLM(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32)))
    model_tree = flax.core.meta.unbox(abstract)["params"]
    ours = param_shapes(cfg)
    assert _struct(ours) == _struct(model_tree)
    for (p, a), (_, b) in zip(_leaves(ours), _leaves(model_tree), strict=True):
        if a.dtype in (np.uint8, np.float32):  # packed experts and the six fp32 kinds: dtype fixed by the spec
            assert b.dtype == a.dtype, jax.tree_util.keystr(p)


def test_random_params_match_table():
    cfg = load_config(config_path("k3-tiny")).replace(expert_format="mxfp4")
    p = random_params(cfg, 0, "mxfp4")
    shapes = param_shapes(cfg)
    assert _struct(p) == _struct(shapes)
    for (path, a), (_, b) in zip(_leaves(p), _leaves(shapes), strict=True):
        assert a.dtype == b.dtype, jax.tree_util.keystr(path)


@pytest.mark.slow
def test_logits_of_loaded_model_equal_writer_model(fixture_dir):
    fmt, d, cfg, params = fixture_dir
    if fmt != "bf16":
        pytest.skip("one model compile is enough; MXFP4 params are checked bitwise above")
    from k3_jax.model import K3ForCausalLM

    cfg2, loaded = load_checkpoint(d)
    model = K3ForCausalLM(cfg2.replace(dtype="float32"))
    fwd = jax.jit(lambda p, t: model.apply({"params": p}, t))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 9)), jnp.int32)
    a = np.asarray(fwd(params, tokens))
    b = np.asarray(fwd(loaded, tokens))
    assert np.isfinite(a).all()
    np.testing.assert_array_equal(a, b)


def test_convert_to_orbax_restores_the_loaded_params(fixture_dir, tmp_path):
    fmt, d, cfg, params = fixture_dir
    if fmt != "mxfp4":
        pytest.skip("one orbax conversion is enough (MXFP4 exercises the u8 leaves)")
    from k3_jax.convert.orbax_io import convert_to_orbax, restore_params

    out = tmp_path / "orbax"
    st = convert_to_orbax(d, out)
    assert st["tensors"] == len(_leaves(params))
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]
    restored = restore_params(out)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(params)
    for (path, a), (_, b) in zip(_leaves(params), _leaves(restored), strict=True):
        assert _bitwise_equal(a, b), jax.tree_util.keystr(path)
