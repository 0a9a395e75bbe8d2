"""Pallas KDA kernels (TPU Mosaic, GPU): chunked prefill, decode, speculative verify, commit by replay.

Entry points: :func:`chunk_kda` (prefill; tuning in :class:`PrefillConfig`), :func:`kda_decode`,
:func:`kda_verify`, :func:`kda_commit` and :func:`kda_commit_verify` on a slot pool, and the
``k3jax.model.Kernels`` variants on a dense state batch, :func:`kda_recurrent_dense` and
:func:`kda_commit_dense`. The kernel files by what they compute: README.md.
"""

from pallas_kernels.kda.decode import (
    kda_commit,
    kda_commit_dense,
    kda_commit_verify,
    kda_decode,
    kda_recurrent_dense,
    kda_verify,
)
from pallas_kernels.kda.prefill import PrefillConfig, chunk_kda

__all__ = [
    "PrefillConfig",
    "chunk_kda",
    "kda_commit",
    "kda_commit_dense",
    "kda_commit_verify",
    "kda_decode",
    "kda_recurrent_dense",
    "kda_verify",
]
