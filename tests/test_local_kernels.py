"""``sharding.local_kernels.per_shard``: a single-device function runs once per shard of the active mesh, its
arguments split by logical axis names under the active rules; a plain call without a multi-device mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharding.local_kernels import per_shard
from sharding.mesh import make_mesh
from sharding.rules import activate

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (virtual) devices; see tests/conftest.py")


def _scaled_by_local_rows(x, w):
    """Depends on the block it sees: rows scaled by the number of local rows, plus a whole (replicated) weight."""
    return x * x.shape[0] + w.sum(), jnp.full((1,), x.shape[0], jnp.int32)


def test_per_shard_splits_by_logical_names_and_passes_whole_args():
    x = jnp.arange(16 * 6, dtype=jnp.float32).reshape(16, 6)
    w = jnp.ones((3, 3), jnp.float32)
    y, rows = per_shard(_scaled_by_local_rows, (x, w), (("batch", None), None), (("batch", None), None))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x * 16 + 9))  # no mesh: one call on everything
    mesh = make_mesh("data=2,fsdp=4")
    with activate(mesh, "train"):
        y, rows = jax.jit(lambda x, w: per_shard(_scaled_by_local_rows, (x, w), (("batch", None), None),
                                                 (("batch", None), None)))(x, w)
    # "batch" -> (data, fsdp): 8 shards of 2 rows each; w arrives whole on every shard
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x * 2 + 9))
    assert int(rows[0]) == 2


def test_per_shard_names_must_match_ranks():
    mesh = make_mesh("fsdp=8")
    x = jnp.zeros((8, 4))
    with activate(mesh, "train"), pytest.raises(ValueError, match="do not match"):
        jax.jit(lambda x: per_shard(lambda a: a, (x,), (("batch",),), (("batch", None),)))(x)
