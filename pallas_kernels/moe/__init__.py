"""LatentMoE expert kernels: grouped matmul, fused expert FFN, dispatch/combine (reference, Pallas)."""

from pallas_kernels.moe.reference import expert_ffn, grouped_matmul, moe_dispatch_combine, situ_glu

__all__ = ["expert_ffn", "grouped_matmul", "moe_dispatch_combine", "situ_glu"]
