"""Suite-wide setup, before JAX initialises: 8 virtual CPU devices (sharding tests need a mesh), no persistent
compilation cache."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
# Entry points (train.py, serve.py) turn on a persistent compilation cache in ~/.cache; tests never do.
os.environ.setdefault("K3_COMPILATION_CACHE", "off")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip, with one reason, unless JAX's default backend is a GPU."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import jax
    import pytest

    if jax.default_backend() != "gpu":
        skip = pytest.mark.skip(reason="needs a CUDA GPU (jax default backend is not gpu)")
        for item in gpu_tests:
            item.add_marker(skip)
