"""Kimi Delta Attention: pure-JAX reference and Pallas kernels (TPU Mosaic, GPU Triton).

``chunk_kda`` / ``recurrent_kda`` dispatch by platform (see :mod:`pallas_kernels.kda.ops`);
``reference`` holds the pure-JAX forms they are tested against.
"""

from pallas_kernels.kda import reference
from pallas_kernels.kda.ops import chunk_kda, recurrent_kda

__all__ = ["chunk_kda", "recurrent_kda", "reference"]
