"""Pallas kernels for the MoE: grouped matmuls over dense experts and over MXFP4 experts
dequantised in registers, for decode-sized groups."""

from pallas_kernels.moe.grouped_matmul import grouped_matmul
from pallas_kernels.moe.mxfp4_matmul import mxfp4_grouped_matmul

__all__ = ["grouped_matmul", "mxfp4_grouped_matmul"]
