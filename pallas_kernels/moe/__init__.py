"""Pallas kernels for the MoE: the grouped matmul over MXFP4 experts, dequantised in registers."""

from pallas_kernels.moe.mxfp4_matmul import mxfp4_grouped_matmul

__all__ = ["mxfp4_grouped_matmul"]
