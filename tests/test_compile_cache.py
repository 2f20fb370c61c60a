"""The entry points' persistent compilation cache: directory choice, opt-out, and that JAX writes to it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from k3_jax import compile_cache


@pytest.fixture
def restore_jax_cache_config():
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    saved = {k: getattr(jax.config, k) for k in keys}
    from jax._src import compilation_cache  # the cache object binds its directory once: unbind it

    compilation_cache.reset_cache()  # the suite's own run cache (tests/conftest.py) may be bound already
    yield
    for k, v in saved.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


def test_cache_dir_choice(monkeypatch, tmp_path):
    monkeypatch.delenv("K3_COMPILATION_CACHE", raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert compile_cache.cache_dir() == compile_cache.DEFAULT_DIR
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert compile_cache.cache_dir() == tmp_path / "jax"
    monkeypatch.setenv("K3_COMPILATION_CACHE", str(tmp_path / "k3"))
    assert compile_cache.cache_dir() == tmp_path / "k3"
    monkeypatch.setenv("K3_COMPILATION_CACHE", "off")
    assert compile_cache.cache_dir() is None
    assert compile_cache.enable() is None


def test_enable_writes_compiled_executables(monkeypatch, tmp_path, restore_jax_cache_config):
    monkeypatch.setenv("K3_COMPILATION_CACHE", str(tmp_path / "xla"))
    path = compile_cache.enable(min_compile_seconds=0.0)
    assert path == tmp_path / "xla" and path.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(path)

    @jax.jit
    def f(x):
        return jnp.sin(x) * 3.0 + jnp.arange(7.0)

    jax.block_until_ready(f(jnp.ones(7)))
    assert any(path.iterdir()), "no cache entry written"
