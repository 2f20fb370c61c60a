"""Quantization formats: MXFP4 weights (pack/unpack) and MXFP8 activation fake-quant.

The codecs live in :mod:`pallas_kernels.mxfp4` and :mod:`pallas_kernels.mxfp8` (the expert kernels decode
them, and ``pallas_kernels`` imports nothing from ``k3_jax``); this package is their public name.
"""

from k3_jax.quant.mxfp4 import E2M1_LUT, fake_quant_mxfp4, is_mxfp4, pack_mxfp4, unpack_mxfp4
from k3_jax.quant.mxfp8 import dequantize_mxfp8, fake_quant_mxfp8, quantize_mxfp8

__all__ = [
    "E2M1_LUT",
    "dequantize_mxfp8",
    "fake_quant_mxfp4",
    "fake_quant_mxfp8",
    "is_mxfp4",
    "pack_mxfp4",
    "quantize_mxfp8",
    "unpack_mxfp4",
]
