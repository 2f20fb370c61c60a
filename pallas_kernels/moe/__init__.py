"""LatentMoE expert kernels: grouped matmul, fused expert FFN, dispatch/combine (reference, Pallas).

Public entry points dispatch through :data:`pallas_kernels.moe.ops.EXPERT_FFN` (``implementation="auto"`` or
``"mosaic_tpu"``, ``"triton"``, ``"xla"``).
"""

from pallas_kernels.moe.ops import EXPERT_FFN, expert_ffn, grouped_matmul, moe_dispatch_combine
from pallas_kernels.moe.reference import situ_glu

__all__ = ["EXPERT_FFN", "expert_ffn", "grouped_matmul", "moe_dispatch_combine", "situ_glu"]
