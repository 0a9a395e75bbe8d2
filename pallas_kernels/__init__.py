"""Pallas kernels (TPU Mosaic, GPU) for KDA; may import k3jax, never serving."""
