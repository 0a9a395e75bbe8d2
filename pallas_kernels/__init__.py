"""Pallas kernels (TPU Mosaic, GPU) for KDA and MLA; may import k3jax, never serving."""
