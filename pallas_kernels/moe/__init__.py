"""LatentMoE expert kernels: grouped matmul, fused expert FFN, dispatch/combine (reference, Pallas).

Public entry points dispatch on ``implementation="auto"|"reference"|"pallas_tpu"|"pallas_gpu"``.
"""

from pallas_kernels.moe.ops import expert_ffn, grouped_matmul, moe_dispatch_combine, resolve
from pallas_kernels.moe.reference import situ_glu

__all__ = ["expert_ffn", "grouped_matmul", "moe_dispatch_combine", "resolve", "situ_glu"]
