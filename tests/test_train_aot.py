"""The whole train step compiles ahead of time for a 4-chip v5p slice on this CPU host, sharded (FSDP x expert
parallel), with the kernels ``"auto"`` picks for the target: the mesh's TPU devices decide, not the CPU host.
The kernels run per shard (``sharding.local_kernels.per_shard`` and the expert-parallel body), since XLA refuses
to partition a Mosaic call ("Mosaic kernels cannot be automatically partitioned")."""

import importlib.util
import os

import pytest

if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed (pip install -e '.[aot]')", allow_module_level=True)
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from k3_jax.training.aot import compile_train_step  # noqa: E402
from tests._model_fixtures import REPO  # noqa: E402

# k3-tiny cut to 2 layers (KDA + dense FFN, MLA + MoE) to keep the XLA:TPU compile short
TWO_LAYERS = {"num_hidden_layers": 2, "kda_layers": (0,), "mla_layers": (1,), "first_k_dense_replace": 1}


def test_sharded_train_step_compiles_for_v5p_with_the_targets_kernels():
    try:
        out = compile_train_step(str(REPO / "configs" / "k3-tiny.json"), "v5p:2x2x1", "fsdp=2,expert=2",
                                 batch_size=8, seq_len=128, overrides=TWO_LAYERS)
    except RuntimeError as exc:  # libtpu present but unable to describe the topology on this host
        if "topology" in str(exc).lower():
            pytest.skip(f"libtpu cannot describe v5p:2x2x1: {exc}")
        raise
    assert out["devices"] == 4 and out["mesh"]["fsdp"] == 2 and out["mesh"]["expert"] == 2
    assert out["implementation"] == "auto"
    # KDA forward + backward kernels and the MoE grouped matmuls (forward + backward), chosen by "auto"
    assert out["mosaic_kernels"] >= 8, out
    # TPU code paths, not the host's: einsum_f32's forward products (MLA scores and values, lm head / chunked
    # loss) are bf16 x bf16 -> f32 dots (4 here; the host-decided program had 0 of them and 4 more f32 x f32:
    # both operands upcast, as on CPU)
    assert out["dots"].get("bf16 x bf16 -> f32", 0) >= 4, out["dots"]
    assert 0 < out["temp_bytes"] < 2**30 and 0 < out["argument_bytes"] < 2**30, out
