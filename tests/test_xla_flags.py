"""Default XLA flags of train.py: added when absent, a user's own value wins, K3_XLA_DEFAULTS=off disables."""

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
