"""Checkpointer: a save that does not write raises instead of being counted (the loop-level resume hardening
tests are in ``tests/test_train_loop.py``, beside the compiled micro trainer they share)."""

import shutil

import jax.numpy as jnp
import pytest

from k3_jax.training.checkpoint import Checkpointer, CheckpointError


def test_a_save_that_does_not_write_raises(tmp_path):
    state = {"step": jnp.zeros((), jnp.int32), "w": jnp.arange(4.0)}
    ckpt = Checkpointer(tmp_path / "ck", async_save=False)
    assert ckpt.save(2, state, {"pos": 2})
    with pytest.raises(CheckpointError, match=r"step 2 already exists in .*ck"):
        ckpt.save(2, state, {"pos": 9})
    ckpt.confirm_written(2)
    shutil.rmtree(ckpt.step_dir(2) / "state")
    with pytest.raises(CheckpointError, match=r"step 2 was saved but .*ck/2 is missing or incomplete"):
        ckpt.confirm_written(2)
    ckpt.close()
