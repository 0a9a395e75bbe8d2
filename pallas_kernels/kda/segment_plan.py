"""How many segments per sequence the GPU recurrent stage runs (segment-parallel prefill), and at
how many state columns per CTA the Mosaic GPU passes run: :func:`plan_segments`.

When sequences x heads x column blocks cannot fill the device, each sequence's chunks are split
into ``P`` segments: a summary pass computes every segment's affine map ``(M, E)`` from its own
tokens, a fold gives each segment its true initial state, and the recurrence finishes every
segment from it. Segments pay a summary pass (over ``K + V`` columns) and the fold, so they pay
off only where ``P x programs`` fills more of the SMs. The cost model's constants were fitted on
the H200; the measurements are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

from functools import partial

from pallas_kernels.kda import recurrence_mgpu
from pallas_kernels.kda.gpu_common import gpu_core_count, gpu_programs

# A summary-pass chunk against a 64-column recurrence chunk, by columns per CTA: 64 (one
# warpgroup; no outputs: two products of four), 128 (two warpgroups sharing W and kd^T, half the
# CTAs), 256 (four warpgroups: all K + V columns of a map in one CTA).
_SUMMARY_STEP = {64: 0.75, 128: 1.0, 256: 1.6}
# A recurrence chunk by columns per CTA, against one warpgroup of 64: the 128-column chunk is
# HBM-bound in full waves, so fewer CTAs pay only where they save waves.
_RECURRENCE_STEP = {64: 1.0, 128: 1.9}
# What a wave of CTAs pays besides its chunks (the state in and out, the first loads), in chunks.
_WAVE_START = 4
# What a segment adds to the fold of the maps, in chunks.
_FOLD_STEP = 6


def plan_segments(num_seqs, num_heads, V, max_chunks, *, backend, block_v=64, num_cores=None, min_chunks=16,
                  summary_paid=False, recurrence="triton", K=None, recurrence_widths=(64,)):
    """Segments per sequence for the recurrent stage.

    GPU: one program per (segment, head, column block); ``chunk_kda`` runs split sequences at
    ``block_v = 64``. Triton recurrence: ``P = num_cores // programs``, used from ``P = 3``.
    ``recurrence="mosaic_gpu"`` (one CTA per SM, all of a pass's CTAs equally long) minimises
    :func:`mosaic_segment_cost`, the waves of both passes over ``P`` and the fold, with the
    recurrence at the cheapest of ``recurrence_widths`` columns per CTA
    (:func:`recurrence_cta_cols`) and the summary at :func:`summary_cta_cols`'.
    When the summary pass runs anyway (``summary_paid``: an ``initial_state_fn``, as KCP
    passes), segments cost only their fold, so ``P`` fills the cores: ``P x programs >=
    num_cores``. Segments keep at least ``min_chunks`` chunks. TPU: 1 (its one or two cores are
    filled by heads).
    """
    if backend not in ("gpu", "cuda", "rocm"):
        return 1
    num_cores = num_cores or gpu_core_count()
    most = max(max_chunks // min_chunks, 1)
    if recurrence == "mosaic_gpu" and not summary_paid:
        cost = partial(mosaic_segment_cost, num_seqs, num_heads, K or V, V, max_chunks, num_cores=num_cores,
                       recurrence_widths=recurrence_widths)
        return min(range(1, most + 1), key=lambda P: (cost(P), P))
    programs = gpu_programs(num_seqs, num_heads, V, block_v)
    P = -(-num_cores // programs) if summary_paid else num_cores // programs
    P = min(P, most)
    return P if P >= (2 if summary_paid else 3) else 1


def _waves(ctas, num_cores):
    return -(-ctas // num_cores)


def _summary_waves(num_seqs, num_heads, K, V, P, cols, *, num_cores, paid=False):
    """Waves of the Mosaic GPU summary pass at ``cols`` columns per CTA: the first segment's E
    columns (V), the middle segments' M and E (K + V), not the last segment; every segment's
    ``K + V`` when the maps are ``paid`` for (an ``initial_state_fn``)."""
    per = lambda width: gpu_programs(num_seqs, num_heads, width, cols)
    return _waves(P * per(K + V) if paid else per(V) + (P - 2) * per(K + V), num_cores)


def _summary_cost(num_seqs, num_heads, K, V, P, *, num_cores, block_v=64, paid=False):
    """``(cost in recurrence chunk steps per chunk, columns per CTA)`` of the cheapest width of the
    Mosaic GPU summary pass (:func:`pallas_kernels.kda.recurrence_mgpu.summary_widths`)."""
    return min((_SUMMARY_STEP[cols] * _summary_waves(num_seqs, num_heads, K, V, P, cols, num_cores=num_cores,
                                                     paid=paid), cols)
               for cols in recurrence_mgpu.summary_widths(K, V, block_v))


def summary_cta_cols(num_seqs, num_heads, K, V, P, *, num_cores=None, block_v=64, paid=False) -> int:
    """Columns per CTA of the Mosaic GPU summary pass for ``P`` segments: of the widths it takes
    (64; 128, two warpgroups of 64, for K and V multiples of 128; all ``K + V = 256``), the one
    whose waves cost least (:data:`_SUMMARY_STEP`)."""
    return _summary_cost(num_seqs, num_heads, K, V, P, num_cores=num_cores or gpu_core_count(), block_v=block_v,
                         paid=paid)[1]


def _recurrence_cost(num_seqs, num_heads, V, P, widths, *, num_cores):
    """``(cost in recurrence chunk steps per chunk, columns per CTA)`` of the cheapest of the
    Mosaic GPU recurrence's ``widths`` (:func:`pallas_kernels.kda.recurrence_mgpu.recurrence_widths`)."""
    return min((_RECURRENCE_STEP[cols] * _waves(P * gpu_programs(num_seqs, num_heads, V, cols), num_cores), cols)
               for cols in widths)


def recurrence_cta_cols(num_seqs, num_heads, V, P, widths, *, num_cores=None) -> int:
    """Columns per CTA of the Mosaic GPU recurrence for ``P`` segments: of ``widths``, the one whose
    waves cost least (:data:`_RECURRENCE_STEP`)."""
    return _recurrence_cost(num_seqs, num_heads, V, P, widths, num_cores=num_cores or gpu_core_count())[1]


def mosaic_segment_cost(num_seqs, num_heads, K, V, chunks, P, *, num_cores, recurrence_widths=(64,)):
    """The Mosaic GPU recurrent stage's time for ``P`` segments of sequences of ``chunks`` chunks,
    in recurrence chunk steps (at 64 columns per CTA): each pass takes ``ceil(CTAs / cores)``
    waves of ``chunks / P`` steps (plus :data:`_WAVE_START`), the recurrence at the cheapest of
    its ``recurrence_widths``, the summary pass (``chunk_kda`` without an ``initial_state_fn``)
    at the columns per CTA :func:`summary_cta_cols` picks."""
    summary = _summary_cost(num_seqs, num_heads, K, V, P, num_cores=num_cores)[0] if P > 1 else 0
    recurrence = _recurrence_cost(num_seqs, num_heads, V, P, recurrence_widths, num_cores=num_cores)[0]
    return (recurrence + summary) * (chunks / P + _WAVE_START) + _FOLD_STEP * (P - 1)
