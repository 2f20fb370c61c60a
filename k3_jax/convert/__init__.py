"""Checkpoint conversion: released Kimi K3 safetensors <-> k3-jax parameters (sharded safetensors + index).

API: :func:`load_checkpoint`, :func:`save_checkpoint`, :func:`verify`, :func:`write_fixture`,
:func:`convert_to_orbax`; CLI: ``python -m k3_jax.convert {verify,convert,export,fixture}``.
"""

from k3_jax.convert.hf import CheckpointError, VerifyReport, load_checkpoint, read_index, save_checkpoint, verify
from k3_jax.convert.safetensors_io import SafetensorsError

__all__ = [
    "CheckpointError",
    "SafetensorsError",
    "VerifyReport",
    "load_checkpoint",
    "read_index",
    "save_checkpoint",
    "verify",
    "write_fixture",
    "convert_to_orbax",
]


def __getattr__(name):  # lazy: these import the model / orbax
    if name == "write_fixture":
        from k3_jax.convert.fixture import write_fixture

        return write_fixture
    if name == "convert_to_orbax":
        from k3_jax.convert.orbax_io import convert_to_orbax

        return convert_to_orbax
    raise AttributeError(name)
