"""What GPU the GPU-marked tests run on."""

from __future__ import annotations

import pytest


def skip_unless_hopper() -> None:
    """Skip the calling test unless the visible GPU has wgmma (compute capability >= 9.0): the Mosaic GPU kernels'
    compiled tests. The skip reason carries the capability found (``None``: no GPU visible)."""
    from pallas_kernels.registry import visible_gpu_compute_capability

    cc = visible_gpu_compute_capability()
    if cc is None or cc < 9.0:
        pytest.skip(f"needs an sm_90+ GPU (compute capability {cc})")
