"""The jitted train step on 8 CPU devices equals the single-device one: expert-parallel and pure FSDP meshes.

The step is called the way ``benchmarks/train.py`` and ``examples/quickstart.py`` call it: the function from
``Trainer.compiled_steps`` invoked *outside* ``Trainer._context()``. It must still trace under the mesh its
inputs live on (expert parallelism, activation constraints); traced as the single-device model instead, the
``fsdp=2,expert=4`` step aborted in XLA's SPMD partitioner (``PartitionGatherOperandPassthroughDimensions``).
"""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from k3_jax.training.loop import TrainConfig
from tests.train_common import compiled_trainer

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices; see tests/conftest.py")

BATCH, SEQ, STEPS = 8, 16, 3
# k3-tiny cut to 2 layers: dense KDA, MoE MLA (16 experts: 4 per `expert` rank)
OVERRIDES = {"num_hidden_layers": 2, "kda_layers": (0,), "mla_layers": (1,), "first_k_dense_replace": 1,
             "kda_chunk_size": 16}
RTOL = 1e-3  # bf16 activations; sharded reductions (loss, grads, Muon) sum in another order


def _losses(mesh: str, tmp_path) -> list[float]:
    tc = TrainConfig(config="configs/k3-tiny.json", model_overrides=OVERRIDES, workdir=str(tmp_path / "run"),
                     steps=100, seq_len=SEQ, batch_size=BATCH, eval_every=0, tensorboard=False, resume=False,
                     mesh=mesh, optimizer="adamw", lr=1e-2, warmup_frac=0.0)
    tr, state, train_step, batch = compiled_trainer(tc, BATCH, SEQ)
    losses = []
    t0 = time.time()
    for _ in range(STEPS):  # no mesh context here (on purpose: see the module docstring)
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
    print(f"mesh {mesh}: losses {losses}, {time.time() - t0:.1f} s")
    if mesh != "none":  # the step kept the parameters on the mesh, and the moments in their parameters' layout
        w = state["params"]["model"]["segment_1"]["layer_0"]["block_sparse_moe"]["experts"]["w1"]
        assert len(w.sharding.device_set) == 8, w.sharding
        _assert_moments_like_params(state)
    return losses


def _assert_moments_like_params(state: dict) -> None:
    """Every AdamW moment (``mu`` / ``nu``) has its parameter's sharding: the optimizer state is sharded as the
    parameters are, not replicated (a jitted ``tx.init`` alone replicates it)."""
    params = {jax.tree_util.keystr(p): x.sharding.spec for p, x in jax.tree_util.tree_leaves_with_path(state["params"])}
    checked = 0
    for path, x in jax.tree_util.tree_leaves_with_path(state["opt_state"]):
        key = jax.tree_util.keystr(path)
        for moment in (".mu", ".nu"):
            if moment in key:
                want = params[key.split(moment, 1)[1]]
                assert x.sharding.spec == want, f"{key}: {x.sharding.spec}, its parameter {want}"
                checked += 1
    assert checked > 0 and any(s != jax.sharding.PartitionSpec() for s in params.values())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    return _losses("none", tmp_path_factory.mktemp("none"))


@pytest.mark.parametrize("mesh", ["fsdp=2,expert=4"])  # fsdp alone: tests/test_sharding_model.py (forward)
def test_sharded_train_step_matches_single_device(mesh, reference, tmp_path):
    losses = _losses(mesh, tmp_path)
    assert np.all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0] - 0.05, losses  # the updates did something
    np.testing.assert_allclose(losses, reference, rtol=RTOL, err_msg=f"mesh {mesh}: {losses} vs {reference}")
