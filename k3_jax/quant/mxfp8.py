"""MXFP8 activation fake-quant (E4M3 elements, E8M0 scale per group of 32): the public name of
:mod:`pallas_kernels.mxfp8`."""

from pallas_kernels.mxfp8 import E4M3_MAX, FP8_EXP_OFFSET, dequantize_mxfp8, fake_quant_mxfp8, quantize_mxfp8

__all__ = ["E4M3_MAX", "FP8_EXP_OFFSET", "dequantize_mxfp8", "fake_quant_mxfp8", "quantize_mxfp8"]
