"""What GPU the GPU-marked tests run on."""

from __future__ import annotations


def hopper() -> bool:
    """True when the visible GPU has wgmma (compute capability >= 9.0): the Mosaic GPU kernels' compiled tests."""
    from pallas_kernels.registry import visible_gpu_compute_capability

    cc = visible_gpu_compute_capability()
    return cc is not None and cc >= 9.0
