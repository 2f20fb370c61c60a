"""Mesh construction and logical-axis rules (8 virtual CPU devices, set in tests/conftest.py)."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sharding import rules
from sharding.mesh import AXES, MeshError, make_mesh, parse_axes, resolve_axes

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices; see tests/conftest.py")


def test_make_mesh_absorbs_and_orders_axes():
    mesh = make_mesh({"data": 1, "fsdp": -1, "expert": 2, "tensor": 2, "sequence": 1})
    assert mesh.axis_names == AXES
    assert dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)) == {
        "data": 1, "fsdp": 2, "expert": 2, "sequence": 1, "tensor": 2}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    assert make_mesh("expert=4,tensor=2").shape["expert"] == 4
    assert make_mesh().shape["fsdp"] == 8


@pytest.mark.parametrize("spec, msg", [
    ({"fsdp": 3}, "needs 3 devices"),
    ({"fsdp": -1, "tensor": -1}, "at most one"),
    ({"fsdp": -1, "tensor": 3}, "does not divide"),
    ({"model": 2}, "unknown mesh axes"),
    ("tensor:2", "axis=size"),
    ({"tensor": 0}, "positive"),
])
def test_make_mesh_errors(spec, msg):
    with pytest.raises(MeshError, match=msg):
        make_mesh(spec)


def test_parse_and_resolve():
    assert parse_axes("expert=64, tensor=4") == {"data": 1, "fsdp": 1, "expert": 64, "sequence": 1, "tensor": 4}
    assert resolve_axes("tensor=4,fsdp=-1", 256)["fsdp"] == 64


def test_rules_priority_params_vs_activations():
    r = rules.get_preset("train")
    sizes = {"data": 1, "fsdp": 2, "expert": 2, "sequence": 1, "tensor": 2}
    # parameter: embed takes the FSDP group (fsdp, expert)
    assert rules.logical_to_pspec(("embed", "kda_heads"), r, sizes) == P(("fsdp", "expert"), "tensor")
    # expert weight: experts took `expert`, latent falls back to fsdp
    assert rules.logical_to_pspec(("experts", "latent", "expert_mlp"), r, sizes) == P("expert", "fsdp", "tensor")
    # activation: batch claims data/fsdp/expert, embed is left replicated
    assert rules.logical_to_pspec(("batch", "length", "embed"), r, sizes) == P(("fsdp", "expert"))
    # matches flax's resolution when every axis has size > 1
    flax_spec = nn.logical_to_mesh_axes(("batch", "length", "embed"), r)
    assert flax_spec == P(("data", "fsdp", "expert"), None, None)
    # serve: batch replicated (data=1), embed replicated, heads over tensor
    s = rules.get_preset("serve")
    assert rules.logical_to_pspec(("embed", "heads"), s, sizes) == P(None, "tensor")
    assert rules.logical_to_pspec(("batch", "length", "embed"), s, sizes) == P()
    lc = rules.get_preset("long-context")
    sizes_lc = {"data": 1, "fsdp": 2, "expert": 1, "sequence": 4, "tensor": 1}
    assert rules.logical_to_pspec(("batch", "length", "embed"), lc, sizes_lc) == P("fsdp", "sequence")


def test_indivisible_dim_drops_axis_with_warning():
    sizes = {"data": 1, "fsdp": 4, "expert": 2, "sequence": 1, "tensor": 1}
    with pytest.warns(rules.ShardingFallbackWarning, match="not divisible"):
        spec = rules.logical_to_pspec(("embed", "vocab"), "train", sizes, shape=(12, 7), what="w")
    assert spec == P("fsdp")  # 12 % 8 != 0 -> drop `expert`, keep fsdp=4


def test_register_preset_and_json(tmp_path):
    rules.register_preset("my-tp", {"heads": "tensor", "embed": None}, overwrite=True)
    assert rules.logical_to_pspec(("embed", "heads"), "my-tp", {"tensor": 2}) == P(None, "tensor")
    with pytest.raises(rules.PresetError, match="already exists"):
        rules.register_preset("my-tp", [("heads", "tensor")])
    f = tmp_path / "exp8.json"
    f.write_text(json.dumps({"name": "exp8", "rules": [["experts", "expert"], ["embed", ["fsdp", "tensor"]]]}))
    assert rules.load_preset_file(f) == "exp8"
    assert rules.get_preset("exp8")[1] == ("embed", ("fsdp", "tensor"))
    assert "fsdp-only" in rules.preset_names()  # shipped example under configs/sharding/
    assert rules.get_preset("fsdp-only")[0] == ("batch", ("data", "fsdp"))
    with pytest.raises(rules.PresetError, match="unknown sharding preset"):
        rules.get_preset("nope")
    f.write_text(json.dumps({"rules": [["heads", 3]]}))
    with pytest.raises(rules.PresetError, match="mesh axes must be"):
        rules.load_preset_file(f)


class _Toy(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("kernel", nn.with_logical_partitioning(nn.initializers.normal(), ("embed", "mlp")),
                       (x.shape[-1], 64))
        b = self.param("norm", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (64,))
        h = nn.with_logical_constraint(x @ w, ("batch", "length", "mlp"))
        return h * b


def test_shard_params_and_flax_rules_context():
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    model = _Toy()
    x = jnp.ones((8, 4, 32))
    boxed = model.init(jax.random.PRNGKey(0), x)
    params = rules.shard_params(boxed, mesh, "train")
    k = params["params"]["kernel"]
    assert k.sharding.spec == P("fsdp", "tensor")
    assert k.addressable_shards[0].data.shape == (8, 32)
    ref = model.apply(nn.unbox(boxed), x)
    with rules.activate(mesh, "train"):
        out = jax.jit(model.apply)(params, x)
        hspec = jax.jit(lambda p, x: rules.with_logical_constraint(model.apply(p, x), ("batch", "length", "mlp")))(
            params, x).sharding.spec
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)
    assert hspec == P("fsdp", None, "tensor")
    assert rules.replicated_params(boxed, mesh, "train", min_bytes=0) == [("params/norm", (64,), 256)]
