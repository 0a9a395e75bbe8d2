"""Pallas KDA kernels (TPU Mosaic, GPU): decode, speculative verify, commit by replay."""

from pallas_kernels.kda.decode import (
    kda_commit,
    kda_commit_snapshot,
    kda_commit_verify,
    kda_decode,
    kda_verify,
    kda_verify_snapshot,
)

__all__ = ["kda_commit", "kda_commit_snapshot", "kda_commit_verify", "kda_decode", "kda_verify", "kda_verify_snapshot"]
