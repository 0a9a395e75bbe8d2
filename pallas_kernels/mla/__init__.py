"""Pallas kernels for MLA: paged attention over latents (absorbed MLA) for decode and speculative
windows."""

from pallas_kernels.mla.paged_decode import paged_mla_decode

__all__ = ["paged_mla_decode"]
