"""``--init-from`` onto a mesh (k3_jax.training.init_from): a converted checkpoint read shard by shard into
sharded parameters on 8 virtual CPU devices, never loaded whole on the host."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from k3_jax.convert import hf
from k3_jax.convert.fixture import write_fixture
from k3_jax.training import lora
from k3_jax.training.init_from import load_sharded
from k3_jax.training.loop import TrainConfig, Trainer

MESH = "fsdp=2,expert=2,tensor=2"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("init_from") / "ckpt"
    write_fixture(out, "k3-tiny", experts="mxfp4")
    return str(out)


def _host_copy(tr: Trainer, path: str) -> dict:
    """What the single-device path loads: the whole checkpoint on the host, floats cast to the params' dtypes."""
    _, base = hf.load_checkpoint(path, experts=tr.cfg.expert_format, vision=False)
    return jax.tree.map(lambda w, x: np.asarray(x, w.dtype) if np.issubdtype(w.dtype, np.floating) else x,
                        tr._abstract_base, base)


@pytest.mark.parametrize("mode", ["lora_mxfp4_frozen", "full_bf16_decoded"])
def test_init_from_reads_shards_onto_the_mesh(ckpt, tmp_path, monkeypatch, mode):
    lora_kw = ({"lora_rank": 4, "lora_targets": ("attention", "shared_experts", "latent", "experts")}
               if mode.startswith("lora") else {"model_overrides": {"expert_format": "bf16"}})
    tc = TrainConfig(init_from=ckpt, mesh=MESH, workdir=str(tmp_path), seq_len=16, batch_size=8, optimizer="adamw",
                     tensorboard=False, **lora_kw)
    tr = Trainer(tc)
    assert tr.cfg.expert_format == ("mxfp4" if mode.startswith("lora") else "bf16")
    with monkeypatch.context() as m:  # the mesh path must not take the whole-checkpoint host load
        m.setattr(hf, "load_checkpoint", lambda *a, **k: pytest.fail("init_from onto a mesh loaded the whole "
                                                                       "checkpoint on the host"))
        params = tr.init_state()["params"]
    want = _host_copy(tr, ckpt)
    flat_want = dict(jax.tree_util.tree_leaves_with_path(want))
    sharded = 0
    for (path, got), sharding in zip(jax.tree_util.tree_leaves_with_path(params),
                                     jax.tree.leaves(tr._param_shardings), strict=True):
        assert got.sharding.is_equivalent_to(sharding, got.ndim), jax.tree_util.keystr(path)
        sharded += len({s.index for s in got.addressable_shards} - {None}) > 1
        if path in flat_want:
            w = flat_want[path]
            assert got.dtype == w.dtype, jax.tree_util.keystr(path)
            np.testing.assert_array_equal(np.asarray(got), w, err_msg=jax.tree_util.keystr(path))
    assert sharded > 10  # most leaves really are split over the devices
    if tr.lora is not None:  # adapters: the values the single-device init draws, laid out by the preset
        init_rng = jax.random.split(jax.random.key(tc.seed))[0]
        ref = lora.init_adapters(want, tr.lora, jax.random.fold_in(init_rng, 1))
        n = 0
        for path, want_a in jax.tree_util.tree_leaves_with_path(ref):
            got_a = params
            for k in path:
                got_a = got_a[k.key]
            np.testing.assert_array_equal(np.asarray(got_a), np.asarray(want_a), err_msg=jax.tree_util.keystr(path))
            n += 1
        assert n > 0


def test_load_sharded_names_a_leaf_the_checkpoint_does_not_fit(ckpt):
    tr = Trainer(TrainConfig(init_from=ckpt, mesh="none", workdir="/tmp/unused", seq_len=16, lora_rank=4,
                             lora_targets=("attention",)))
    abstract = dict(tr._abstract_base)
    abstract["lm_head"] = {"kernel": jax.ShapeDtypeStruct((7, 3), np.float32)}
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
    with pytest.raises(hf.CheckpointError, match=r"lm_head/kernel: the model has shape \[7, 3\]"):
        load_sharded(ckpt, abstract, shardings, experts="mxfp4")
