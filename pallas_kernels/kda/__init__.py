"""Pallas KDA kernels (TPU Mosaic, GPU): chunked prefill, decode, speculative verify, commit by replay."""

from pallas_kernels.kda.decode import (
    kda_commit,
    kda_commit_dense,
    kda_commit_snapshot,
    kda_commit_verify,
    kda_decode,
    kda_recurrent_dense,
    kda_verify,
    kda_verify_snapshot,
)
from pallas_kernels.kda.prefill import chunk_kda, plan_segments

__all__ = [
    "chunk_kda",
    "kda_commit",
    "kda_commit_dense",
    "kda_commit_snapshot",
    "kda_commit_verify",
    "kda_decode",
    "kda_recurrent_dense",
    "kda_verify",
    "kda_verify_snapshot",
    "plan_segments",
]
