"""Default XLA flags of train.py: added when absent, a user's own value wins, K3_XLA_DEFAULTS=off disables; the
serving engine's XLA:GPU compile options."""

from k3_jax import xla_flags


def test_adds_missing_flags_and_keeps_the_users():
    env = {"XLA_FLAGS": "--xla_gpu_autotune_level=0"}
    assert xla_flags.apply_defaults(("--xla_gpu_enable_triton_gemm=false",), env) == [
        "--xla_gpu_enable_triton_gemm=false"]
    assert env["XLA_FLAGS"] == "--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false"
    env = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
    assert xla_flags.apply_defaults(("--xla_gpu_enable_triton_gemm=false",), env) == []
    assert env["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=true"
    env = {}
    assert xla_flags.apply_defaults(env=env) == list(xla_flags.TRAIN_DEFAULTS)
    assert env["XLA_FLAGS"] == " ".join(xla_flags.TRAIN_DEFAULTS)


def test_off_switch():
    env = {"K3_XLA_DEFAULTS": "off"}
    assert xla_flags.apply_defaults(env=env) == [] and "XLA_FLAGS" not in env


def test_serving_compiler_options_turn_the_dot_merger_off_on_gpu_only():
    import jax
    import jax.numpy as jnp

    assert xla_flags.serving_compiler_options("gpu") == {"xla_gpu_dot_merger_threshold_mb": 0}
    assert xla_flags.serving_compiler_options("cpu") == {} == xla_flags.serving_compiler_options("tpu")
    # the option names a real XLA debug option (an unknown one is refused at compile time)
    f = jax.jit(lambda a: a @ a, compiler_options=xla_flags.serving_compiler_options("gpu"))
    assert float(f(jnp.eye(2))[0, 0]) == 1.0
