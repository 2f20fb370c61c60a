"""Tensor transforms between HF checkpoint tensors and k3-jax parameters (numpy, one tensor at a time).

Names match the ``transform`` column of :data:`k3_jax.convert.names.TEXT_RULES`. ``to_flax`` maps one HF
tensor to the per-layer Flax value (for experts: one expert's slot); ``to_hf`` is its exact inverse.
MXFP4 helpers here are numpy (the converter streams on the host); they agree bit for bit with
:mod:`k3_jax.quant.mxfp4` (tested).
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np

from k3_jax.convert.names import Rule

E2M1_LUT = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


def to_flax(rule: Rule, x: np.ndarray, sym: dict[str, int], name: str = "") -> np.ndarray:
    """HF tensor -> Flax value (per layer; for experts the ``[in, out]`` or packed slot of one expert)."""
    t = rule.transform
    if t in ("identity", "expert"):
        return x
    if t in ("transpose", "expert_t"):
        return np.ascontiguousarray(x.T)
    if t == "row":
        return x.reshape(x.shape[1:])
    if t == "conv":
        return np.ascontiguousarray(x[:, 0, :].T)
    if t == "a_log":
        h = sym["H"]
        tail = x[h:]
        if tail.size and np.any(tail != 0):
            warnings.warn(
                f"{name}: A_log padding [{h}:{x.shape[0]}] is not all zero; it is dropped (export re-pads zeros)",
                stacklevel=2,
            )
        return np.ascontiguousarray(x[:h])
    if t == "patch":  # vision patch conv [D, 3, P, P] -> linear kernel [3*P*P, D]
        return np.ascontiguousarray(x.reshape(x.shape[0], -1).T)
    raise ValueError(f"{name}: unknown transform {t!r}")


def to_hf(rule: Rule, y: np.ndarray, sym: dict[str, int], name: str = "") -> np.ndarray:
    """Inverse of :func:`to_flax`."""
    t = rule.transform
    if t in ("identity", "expert"):
        return y
    if t in ("transpose", "expert_t"):
        return np.ascontiguousarray(y.T)
    if t == "row":
        return y.reshape(1, *y.shape)
    if t == "conv":
        return np.ascontiguousarray(y.T[:, None, :])
    if t == "a_log":
        out = np.zeros((sym["AP"],), y.dtype)
        out[: y.shape[0]] = y
        return out
    if t == "patch":
        p = sym["PS"]
        return np.ascontiguousarray(y.T.reshape(y.shape[1], 3, p, p))
    raise ValueError(f"{name}: unknown transform {t!r}")


def unpack_mxfp4_np(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """MXFP4 (``u8 [..., N/2]`` low nibble first, E8M0 ``u8 [..., N/32]``) -> ``f32 [..., N]``."""
    n = packed.shape[-1] * 2
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], n)
    vals = E2M1_LUT[codes].reshape(*packed.shape[:-1], n // 32, 32)
    exp = scale.astype(np.int32) - 127
    factor = np.ldexp(np.float32(1.0), exp).astype(np.float32)
    factor = np.where(scale == 255, np.float32(np.nan), factor)
    return (vals * factor[..., None]).reshape(*packed.shape[:-1], n)


def pack_mxfp4_np(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize ``w [..., N]`` to MXFP4 -> ``(packed u8 [..., N/2], scale u8 [..., N/32])``.

    Same rule as :func:`k3_jax.quant.mxfp4.pack_mxfp4` (bit-identical, tested): per 32-group, amax rounded to a
    power of two (mantissa >= 1.75 rounds up), exponent minus 2 (= floor(log2 6)) clamped to [-127, 127];
    elements = round-to-nearest-even E2M1 of ``x / 2^exp`` saturating at ±6.
    """
    n = w.shape[-1]
    if n % 32:
        raise ValueError(f"pack_mxfp4_np: last dim must be a multiple of 32, got shape {w.shape}")
    g = np.asarray(w, np.float32).reshape(*w.shape[:-1], n // 32, 32)
    amax = np.max(np.abs(g), axis=-1)
    bits = (amax.view(np.uint32) + np.uint32(1 << 21)) & np.uint32(0x7F800000)
    exp = np.clip((bits >> 23).astype(np.int32) - 127 - 2, -127, 127)
    inv = np.ldexp(np.float32(1.0), -exp).astype(np.float32)
    a = np.abs(g * inv[..., None])
    m = (
        (a > 0.25).astype(np.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    ).astype(np.uint8)
    codes = (m | np.where(np.signbit(g), np.uint8(8), np.uint8(0))).reshape(*w.shape[:-1], n // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8)
    return packed, (exp + 127).astype(np.uint8)


def to_bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16)
