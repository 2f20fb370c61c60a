"""Suite-wide setup, before JAX initialises.

* 8 virtual CPU devices (sharding tests need a mesh).
* On a machine without a CUDA plugin, XLA:CPU compiles with LLVM at -O0: the suite compiles hundreds of small
  programs and runs each a few times, so compile time dominates; results stay within every test's tolerance
  (outputs are not bit-identical to -O3 builds; fp32 parity of the entry points is checked with their own flags).
  With a CUDA plugin, XLA's GEMM autotuning is off instead (it chooses among algorithms, not results).
* One persistent compilation cache per test run, shared by the xdist workers and the processes tests start (the
  notebook kernel, launched multi-process runs), in the run's pytest temp directory, so each program compiles
  once per run; nothing is reused across runs. The entry points' own cache (``~/.cache``) stays off.
* Compiled programs are released after every test module (``jax.clear_caches()``). XLA:CPU maps each loaded
  executable's code into memory regions of its own; a worker that kept every program of ~460 tests alive reached
  ~51,000 of the kernel's default ``vm.max_map_count`` of 65,530, and past it the next compile dies with a
  segfault. Programs a later module needs again come back from the run's compilation cache.
"""

import gc
import importlib.util
import os
import pkgutil
import sys
from pathlib import Path

import pytest

_FLAGS = ["--xla_force_host_platform_device_count=8"]


def _has_cuda_plugin() -> bool:
    if importlib.util.find_spec("jax_plugins") is None:
        return False
    import jax_plugins

    return any("cuda" in m.name for m in pkgutil.iter_modules(jax_plugins.__path__))


if not _has_cuda_plugin():
    _FLAGS.append("--xla_backend_optimization_level=0")
else:  # GEMM autotuning only picks among correct algorithms; off, the GPU tests compile in a fraction of the time
    _FLAGS.append("--xla_gpu_autotune_level=0")
_xla_flags = os.environ.get("XLA_FLAGS", "")
for _flag in _FLAGS:
    if _flag.split("=")[0] not in _xla_flags:
        _xla_flags = f"{_xla_flags} {_flag}".strip()
os.environ["XLA_FLAGS"] = _xla_flags
# Entry points (train.py, serve.py) turn on a persistent compilation cache in ~/.cache; tests never do.
os.environ.setdefault("K3_COMPILATION_CACHE", "off")


@pytest.hookimpl(trylast=True)  # after the tmpdir plugin's configure made ``config._tmp_path_factory``
def pytest_configure(config):
    """Point JAX's persistent cache at ``<run basetemp>/xla-cache`` (one directory for all workers of a run)."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    base = config._tmp_path_factory.getbasetemp()
    if hasattr(config, "workerinput"):
        base = base.parent  # xdist: <basetemp>/popen-gwN -> the run's <basetemp>
    cache = base / "xla-cache"
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.25"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip, with one reason, unless JAX's default backend is a GPU."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return
    import jax

    if jax.default_backend() != "gpu":
        skip = pytest.mark.skip(reason="needs a CUDA GPU (jax default backend is not gpu)")
        for item in gpu_tests:
            item.add_marker(skip)


def _memory_maps() -> int | None:
    """How many memory mappings this process holds (``None`` where ``/proc`` does not tell)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


def _max_memory_maps() -> int | None:
    """The kernel's ``vm.max_map_count`` (``None`` where ``/proc`` does not tell)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


_MAX_MEMORY_MAPS = _max_memory_maps()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """After each test module: drop every compiled program JAX holds, then check this process has headroom left
    under ``vm.max_map_count`` (over half used means something outside JAX's caches keeps executables alive:
    the next module would risk a segfault in the compiler instead of a readable failure)."""
    yield
    if "jax" not in sys.modules:
        return
    import jax

    jax.clear_caches()
    gc.collect()
    held, limit = _memory_maps(), _MAX_MEMORY_MAPS
    if held is not None and limit is not None and held > limit // 2:
        pytest.fail(f"after {request.module.__name__} this process still holds {held} memory maps of the "
                    f"kernel's vm.max_map_count={limit}: something keeps compiled programs alive across modules")
