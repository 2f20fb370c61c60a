"""MXFP4 codec (E2M1 elements, E8M0 scale per group of 32): the public name of :mod:`pallas_kernels.mxfp4`."""

from pallas_kernels.mxfp4 import (
    E2M1_LUT,
    E2M1_MAX,
    FP4_EXP_OFFSET,
    GROUP,
    decode_e2m1,
    e8m0_to_f32,
    is_mxfp4,
    mx_scale_exponent,
    pack_mxfp4,
    quantize_e2m1,
    unpack_mxfp4,
)

__all__ = ["E2M1_LUT", "E2M1_MAX", "FP4_EXP_OFFSET", "GROUP", "decode_e2m1", "e8m0_to_f32", "is_mxfp4",
           "mx_scale_exponent", "pack_mxfp4", "quantize_e2m1", "unpack_mxfp4"]
