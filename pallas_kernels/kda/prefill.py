"""Public chunked KDA prefill: :func:`chunk_kda`, same contract as :func:`k3jax.ops.kda.chunk_kda`.

Two stages (``_chunk.py``): a token-parallel stage over every (chunk, value head) and a
recurrent stage over (sequence, value head[, column block]). Varlen inputs are packed so every
sequence starts on a chunk boundary (padding slots are zero tokens: the identity map).

Segment-parallel prefill (GPU): when sequences x heads x column blocks cannot fill the device,
each sequence's chunks are split into ``P`` segments; one pass computes every segment's affine
map ``(M, E)`` from its own tokens (in parallel), a fold in float32 (a chain of products in one
kernel, :func:`prefill_gpu.fold_call`, or XLA's associative scan when an ``initial_state_fn``
wants every sequence's whole map)
gives each segment's true initial state, and a second pass finishes every segment from it.
:func:`plan_segments` picks ``P``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops.kda import _check_inputs, _chunk_layout, _out_dtype, l2norm, sequence_maps
from k3jax.ops.segments import combine_segments, prefix_starts
from pallas_kernels.kda import prefill_gpu, prefill_mgpu, prefill_tpu, prep_mgpu, wu_mgpu
from pallas_kernels.kda._chunk import GPU_PRECISION, gpu_prep_call, prep_call

_F32 = jnp.float32
# Float32 q, k, v with K or V above this do not fit the GPU kernels' shared memory on Hopper
# (232448 bytes): chunk_kda runs them as bf16 operands, the state and outputs staying float32.
GPU_F32_MAX_HEAD = 64


def plan_segments(num_seqs, num_heads, V, max_chunks, *, backend, block_v=64, num_cores=None, min_chunks=16,
                  summary_paid=False, recurrence="triton", K=None, recurrence_widths=(64,)):
    """Segments per sequence for the recurrent stage.

    GPU: one program per (segment, head, column block); ``chunk_kda`` runs split sequences at
    ``block_v = 64``. Segments add a summary pass (over ``K + V`` columns) and a fold, and pay off
    when ``P x programs`` fills the SMs. Triton recurrence: ``P = num_cores // programs``, used
    from ``P = 3`` (on the H200 with bf16 recurrence operands: H = 12, T = 131072, 24 programs,
    P = 5 took 10.19 ms against 12.04 unsplit; H = 4, P = 16 took 3.51 ms).
    ``recurrence="mosaic_gpu"`` (one CTA per SM, all of a pass's CTAs equally long) minimises
    :func:`mosaic_segment_cost`, the waves of both passes over ``P`` and the fold. On the H200 it
    tracked the measured recurrent stage within 3% at H = 12, T = 131072 for P = 3 to 6 (P = 4:
    1.31 ms, P = 5: 1.51, whose summary pass takes two waves at 64 columns per CTA) and picks
    P = 2 at H = 32. The recurrence runs at the cheapest of ``recurrence_widths`` columns per CTA
    (:func:`recurrence_cta_cols`). With the summary at 128 columns per CTA where that saves waves
    (:func:`summary_cta_cols`) it picks P = 11 at H = 12 (the same whole call as P = 5, 4.81 ms;
    P = 4 at 64 columns 4.84) and was 1-5% faster than the choice before at five other shapes
    (H = 4 to 24, T = 32768 and 131072; docs/benchmarks.md, 2026-12-02).
    When the summary pass runs anyway (``summary_paid``: an ``initial_state_fn``, as KCP
    passes), segments cost only their fold, so ``P`` fills the cores: ``P x programs >=
    num_cores`` (P = 3 per rank at H = 32: KCP 1.81x on two H200s at T = 131072). Segments keep at
    least ``min_chunks`` chunks. TPU: 1 (its one or two cores are filled by heads).
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


# A summary-pass chunk against a recurrence chunk on the H200 (no outputs: two products of four),
# by columns per CTA. 64 (one warpgroup): 0.80 at H = 12, T = 131072, P = 4 (580 against 728 us
# over 512 chunks), 0.74 at H = 32, P = 2 (0.72 at T = 32768 and 0.68 at T = 131072 on 2026-12-03):
# 0.75 between them, which keeps P = 2 at H = 32 against P = 4 with the recurrence at 128 columns
# (0.4% faster at T = 131072). 128 (two warpgroups of 64 sharing W and kd^T, half the
# CTAs): 0.98 at H = 12, P = 5 (581 against 590 us) and at H = 4, P = 16 (193 against 197). 256
# (four warpgroups: all K + V columns of a map in one CTA): 1.58 at H = 12, P = 11 (447 us for its
# one wave against 567 for the recurrence's two, 2026-12-03).
_SUMMARY_STEP = {64: 0.75, 128: 1.0, 256: 1.6}
# The recurrence's chunk by columns per CTA, against one warpgroup of 64. On the H200 (2026-12-03)
# a chunk of 128 columns (two warpgroups) took 1.3-1.45x one of 64 in waves of 32-96 CTAs, and
# 1.8-1.9x in waves of 120-132, where both widths move about 4.1 TB/s (HBM-bound): fewer CTAs
# pay only where they save waves.
_RECURRENCE_STEP = {64: 1.0, 128: 1.9}
# What a wave of CTAs pays besides its chunks (the state in and out, the first loads), in chunks.
_WAVE_START = 4
# What a segment adds to the fold of the maps, in chunks (a recurrence chunk takes 1.44 us on the
# H200). Set when the fold was XLA's batched products: about 8 us per segment at H = 12 (90 us more
# at P = 16 than at P = 5; XLA's associative scan took 156 more, 2026-12-03). The fold kernel
# (:func:`prefill_gpu.fold_call`) takes about 3.5 us per segment (34 us at H = 12, P = 11; 49 at
# H = 4, P = 16); 3 here would move T = 32768 from P = 9 to 16 at H = 4 and from 5 to 11 at
# H = 12 (not timed), and leaves the choices at T = 131072 as they are.
_FOLD_STEP = 6


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
    Mosaic GPU summary pass (:func:`pallas_kernels.kda.prefill_mgpu.summary_widths`)."""
    return min((_SUMMARY_STEP[cols] * _summary_waves(num_seqs, num_heads, K, V, P, cols, num_cores=num_cores,
                                                     paid=paid), cols)
               for cols in prefill_mgpu.summary_widths(K, V, block_v))


def summary_cta_cols(num_seqs, num_heads, K, V, P, *, num_cores=None, block_v=64, paid=False) -> int:
    """Columns per CTA of the Mosaic GPU summary pass for ``P`` segments: 128 (two warpgroups of
    64; K and V multiples of 128) where its fewer waves outweigh its slower chunks, else 64.
    On the H200 at H = 12, T = 131072 that lets the planner take P = 5 (the recurrence's 120 CTAs
    fill the SMs; the summary's 84 take one wave, 168 at 64 columns take two): the recurrent
    stage 1171 against 1237 us at P = 4; at H = 4, P = 16 the summary 193 against 273 us."""
    return _summary_cost(num_seqs, num_heads, K, V, P, num_cores=num_cores or gpu_core_count(), block_v=block_v,
                         paid=paid)[1]


def _recurrence_cost(num_seqs, num_heads, V, P, widths, *, num_cores):
    """``(cost in recurrence chunk steps per chunk, columns per CTA)`` of the cheapest of the
    Mosaic GPU recurrence's ``widths`` (:func:`pallas_kernels.kda.prefill_mgpu.recurrence_widths`)."""
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


def gpu_programs(rows, num_heads, V, block_v):
    """Programs of a GPU kernel with one per (row, head, column block): the recurrent kernel per
    segment (rows = sequences) and the decode window kernels (rows = batch rows)."""
    return rows * num_heads * max(V // block_v, 1)


def gpu_core_count() -> int:
    """Streaming multiprocessors of the default device (132 on the H200 when it does not say)."""
    return getattr(jax.devices()[0], "core_count", 132)


def gpu_head_dims_ok(*dims) -> bool:
    """Whether the GPU kernels take these head sizes (powers of two >= 16)."""
    return all(d >= 16 and not d & (d - 1) for d in dims)


def default_precision(precision, dtype, *, scan=False):
    """A GPU matmul precision: ``precision`` if given, else TF32x3 (float32-accurate) for float32
    ``dtype``; for 16-bit ``dtype`` (outputs round to 8 bits anyway) single-pass TF32, or for the
    recurrent kernel (``scan``) bf16 operands with float32 accumulation, fla's
    choice: the state stays float32 and only the matmul operands round. On the H200 that took
    B1 T32k H32 from 7.81 to 6.23 ms with the same errors against the float32 reference (outputs
    3.0e-3, states 1.9e-3 relative RMS)."""
    if precision is not None:
        return precision
    if jnp.dtype(dtype).itemsize == 4:
        return GPU_PRECISION
    return jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if scan else jax.lax.DotAlgorithmPreset.TF32_TF32_F32


def gpu_prep(q, k, v, g, beta, *, C, scale, precision, num_warps=4, store_dtype=_F32, bounded=False,
             interpret=False, kernel="triton", wu_kernel="triton"):
    """The GPU token-parallel stage on packed token-major inputs (``beta [TT, HV, 1]``): products at
    ``precision``, the triangular inverse at TF32x3; HIGHEST throughout when interpreting.
    ``kernel="mosaic_gpu"``: kernel A in Mosaic GPU (:mod:`pallas_kernels.kda.prep_mgpu`; for
    unbounded gates only where every sub-chunk's gate span is within
    :data:`~pallas_kernels.kda.prep_mgpu.SPAN`, checked by the cumsum kernel, else Triton's);
    ``wu_kernel="mosaic_gpu"``: kernel C (:mod:`pallas_kernels.kda.wu_mgpu`)."""
    hi = jax.lax.Precision.HIGHEST
    params = lambda warps, stages: None if interpret else prefill_gpu.params(warps, stages)
    rows = rows_span = wu = None
    if kernel == "mosaic_gpu":
        rows = partial(prep_mgpu.rows_call, scale=scale, store_dtype=store_dtype, interpret=bool(interpret))
        rows_span = None if bounded else prep_mgpu.SPAN
    if wu_kernel == "mosaic_gpu":
        wu = partial(wu_mgpu.wu_call, store_dtype=store_dtype, interpret=bool(interpret))
    return gpu_prep_call(q, k, v, g, beta, C=C, scale=scale, interpret=interpret, store_dtype=store_dtype,
                         bounded=bounded, rows_call=rows, rows_span=rows_span, wu_call=wu,
                         precision=hi if interpret else precision, inv_precision=hi if interpret else GPU_PRECISION,
                         compiler_params=params(num_warps, 2), rows_compiler_params=params(1, 2),
                         inverse_compiler_params=params(1, 1))


def default_recurrence(K, V, chunk_size, store_dtype, block_v=None):
    """The GPU recurrent kernel :func:`chunk_kda` runs when ``recurrence`` is None: Mosaic GPU where
    it applies (:func:`pallas_kernels.kda.prefill_mgpu.supported`) and no Triton ``block_v`` is
    given, else Triton."""
    return "mosaic_gpu" if block_v is None and prefill_mgpu.supported(K, V, chunk_size, store_dtype) else "triton"


def default_intermediates(dtype):
    """What the GPU stages pass through memory by default: bfloat16 for 16-bit inputs (their outputs
    round to 8 bits; 1.10x faster on the H200), float32 otherwise."""
    return jnp.bfloat16 if jnp.dtype(dtype).itemsize < 4 else _F32


def _backend(backend):
    backend = backend or jax.default_backend()
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    if backend in ("tpu", "cpu"):
        return "tpu"
    raise ValueError(f"no KDA prefill kernel for backend {backend!r}")


def _kernel_choice(arg, value, ok, *, requirement, default=None):
    """A GPU stage's kernel, ``"triton"`` or ``"mosaic_gpu"``: ``value``, checked (``ok``: the Mosaic
    GPU kernel applies, else ``requirement`` is the error), or for None Mosaic GPU where
    ``default`` (``ok`` unless given), else Triton."""
    if value is None:
        return "mosaic_gpu" if (ok if default is None else default) else "triton"
    if value not in ("triton", "mosaic_gpu"):
        raise ValueError(f"{arg} must be 'triton' or 'mosaic_gpu', got {value!r}")
    if value == "mosaic_gpu" and not ok:
        raise ValueError(requirement)
    return value


def _interpret(interpret, backend):
    if interpret is None:
        if jax.default_backend() != "cpu":
            return False
        return pltpu.InterpretParams() if backend == "tpu" else True
    return interpret


def chunk_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size: int = 64,
    checkpoint_stride: int | None = None, use_qk_l2norm: bool = False, num_segments: int | None = None,
    backend: str | None = None, interpret=None, block_v: int | None = None, num_warps: int = 4, num_stages: int = 3,
    prep_num_warps: int = 4, scan_precision=None, prep_precision=None, initial_state_fn=None,
    intermediate_dtype=None, gate_lower_bound=None, summary_block_v: int = 64, recurrence: str | None = None,
    prep_kernel: str | None = None, wu_kernel: str | None = None,
):
    """Chunked KDA prefill as Pallas kernels; arguments and results as :func:`k3jax.ops.kda.chunk_kda`.

    On the GPU, float32 ``q, k, v`` with K or V above ``GPU_F32_MAX_HEAD`` (64) run as a bf16
    call (they do not fit the kernels' shared memory in float32): bf16 operands and outputs (cast
    back to float32); the gates, beta, the state and the checkpoints stay float32.

    Extra keyword arguments:
      num_segments: segments per sequence for the recurrent stage (GPU); None asks
        :func:`plan_segments`.
      backend: "tpu" or "gpu" kernels; None picks by the default device ("cpu" runs the TPU
        kernels in the interpreter).
      interpret: None: interpret on CPU (``pltpu.InterpretParams()`` for the TPU kernels),
        compile elsewhere; or an explicit value passed to ``pallas_call``.
      block_v, num_warps, num_stages: GPU recurrent-stage tiling and software pipelining. block_v
        None: 64 when segments or ``sequences x heads x V / 64`` programs fill the SMs (wider
        blocks halve the re-reads of W, kd^T and qg), else 32 (twice the programs for the serial
        scan). On the H200 (kernel time, 2026-12-01): B1 T32k H32 (64 programs at 64) 3.83 ms at
        32 against 4.00 at 64; B8 T4k H32 4.08 at 32 against 3.55 at 64; B1 T8k H96 3.03 against
        2.77. 3 stages (the next chunks' loads overlap this chunk's matmuls): the recurrence at B1 T32k H32 took
        0.94 ms against 1.15 with 2 and 0.94 with 4 (but 4 was 1.4-1.6x slower than 3 at H12 T131k).
      summary_block_v: GPU column block of the segment summary pass, which runs over ``K + V``
        columns (twice the recurrence's programs). 64 against 32: KCP at T = 131072, H = 32 on two
        H200s went 1.64x -> 1.76x (2 segments per rank: 512 -> 256 programs); 128 gave 1.65x.
      prep_num_warps: GPU warps per program of the gate cumsum and the W/U kernel (kernels A and B
        of stage 1 run on one warp: their 16 x 16 products repeat on every warp).
      scan_precision: GPU matmul precision of the recurrent stage (state and outputs); None: bf16 operands
        with float32 accumulation for bf16/f16 inputs with bf16 intermediates (the default; the
        state stays float32), single-pass TF32 for them with float32 intermediates, TF32x3 for
        float32 inputs (:func:`default_precision`).
      prep_precision: the same for the token-parallel stage's products (Aqk, Akk, W, U); its
        triangular inverse is always TF32x3 (float32-accurate).
      intermediate_dtype: GPU: the dtype of what the stages pass through memory (qg, Aqk, kd^T,
        W, U, the per-chunk states and V_new): float32 or bfloat16 (half the traffic, fla's
        choice; the recurrence, final state and checkpoints stay float32). None:
        :func:`default_intermediates`.
      gate_lower_bound: a promise that every gate value is at least this (K3: -5; must be >= -5).
        GPU: stage 1 then skips its per-row gate-span check (diagonal blocks always as anchored
        matmuls: finite in float32 only for bounded gates; 1.02x faster on the H200); gates
        below the bound give wrong results. The serving engine passes the K3 configs' bound.
      recurrence: GPU: the recurrent stage's kernel, "mosaic_gpu"
        (:mod:`pallas_kernels.kda.prefill_mgpu`: WGMMA products with bf16 operands; needs
        bfloat16 intermediates, chunk 64, K in (64, 128), V a multiple of 64; ``block_v`` is then
        the state columns per warpgroup, 64 (the default: one warpgroup per CTA) or 32 (two), in both
        passes; ``num_warps``, ``num_stages``, ``summary_block_v`` and ``scan_precision`` are the
        Triton kernel's and do not apply) or "triton" (the Pallas Triton lowering). None: Mosaic
        GPU where it applies and no ``block_v`` is given, else Triton. On the H200 (2026-12-01,
        whole call) the Mosaic recurrence made the prefill 3-7% faster at the five benchmark
        shapes timed (e.g. B8 T4k H32 3.65 against 3.92 ms).
      prep_kernel: GPU: stage 1's kernel A (Aqk, Akk, qg), "triton" or "mosaic_gpu"
        (:mod:`pallas_kernels.kda.prep_mgpu`: TF32 WGMMA products; needs chunk 64, K in (64, 128)
        and 16-bit inputs; without ``gate_lower_bound`` the cumsum kernel flags the chunks with a
        16-token sub-chunk whose gate span passes 75 nats, and the Triton kernel A, launched only
        if one is flagged, redoes those in place). None: Mosaic GPU where it applies, else
        Triton. With Kimi Linear gates at B1 T131k H12 on the H200 the whole call took 3.77
        against 4.43 ms with the Triton kernel A (2026-12-04). The gate cumsum and the inverse
        stay on Triton. Kernel time, K3 gates (2026-12-02): on the
        H200 it took 1.42 ms against the Triton kernel A's 2.10 at B1 T131k H12 (the whole call
        4.94 against 5.25 ms when it took 1.49; 1.14 ms on 2026-12-03); on an H100 the whole call was 8-10% faster at
        H = 4, 12 and 32.
      wu_kernel: GPU: stage 1's kernel C (W, U, kd^T, decay), "triton" or "mosaic_gpu"
        (:mod:`pallas_kernels.kda.wu_mgpu`: TF32 WGMMA products; needs chunk 64, K and V multiples
        of 32 and k, v of one 16-bit dtype). None: Mosaic GPU where it applies, else Triton. On
        the H200 (2026-12-03, kernel time) it took 870 against 1153 us at B1 T131k H12 and made
        the whole call 7-8% faster at the dense shapes timed.
      initial_state_fn: as in :func:`k3jax.ops.kda.chunk_kda` (the sequences' own maps in, the
        initial states out). GPU: the maps come from the segment summary pass over this call's
        token-parallel stage; TPU: from :func:`k3jax.ops.kda.sequence_maps` (XLA).
    """
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    if checkpoint_stride is not None and (checkpoint_stride <= 0 or checkpoint_stride % chunk_size):
        raise ValueError(f"checkpoint_stride {checkpoint_stride} must be a positive multiple of chunk_size {chunk_size}")
    B, T, H, HV, K, V, N = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    kind = _backend(backend)
    if kind == "tpu" and num_segments not in (None, 1):
        raise ValueError("segment-parallel prefill is implemented for the GPU kernels only (num_segments must be 1)")
    if kind == "gpu" and not gpu_head_dims_ok(K, V):
        raise ValueError(f"the GPU kernels need K and V to be powers of two >= 16, got K={K}, V={V}")
    result_dtype = _out_dtype(v)
    if kind == "gpu" and max(K, V) > GPU_F32_MAX_HEAD and jnp.dtype(result_dtype) == jnp.dtype(_F32):
        q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))  # from here on a bf16 call
    out_dtype = _out_dtype(v)
    if intermediate_dtype is None:
        intermediate_dtype = default_intermediates(out_dtype) if kind == "gpu" else _F32
    store = jnp.dtype(intermediate_dtype)
    if store not in (jnp.dtype(_F32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"intermediate_dtype must be float32 or bfloat16, got {store}")
    if kind == "tpu" and store != jnp.dtype(_F32):
        raise ValueError("bfloat16 intermediates are implemented for the GPU kernels only")
    if gate_lower_bound is not None and not -5.0 <= gate_lower_bound <= 0.0:
        raise ValueError(f"gate_lower_bound must be in [-5, 0] (None for unbounded gates), got {gate_lower_bound}")
    recurrence = _kernel_choice(
        "recurrence", recurrence, kind == "gpu" and prefill_mgpu.supported(K, V, chunk_size, store),
        default=kind == "gpu" and default_recurrence(K, V, chunk_size, store, block_v) == "mosaic_gpu",
        requirement="the Mosaic GPU recurrence runs on the GPU backend with bfloat16 intermediates, chunk_size 64, "
                    f"K in (64, 128) and V a multiple of 64; got backend {kind}, {store.name} intermediates, "
                    f"chunk_size {chunk_size}, K={K}, V={V}")
    prep_kernel = _kernel_choice(
        "prep_kernel", prep_kernel, kind == "gpu" and prep_mgpu.supported(K, chunk_size, q.dtype),
        requirement="the Mosaic GPU kernel A runs on the GPU backend with chunk_size 64, K in (64, 128) and "
                    f"16-bit inputs; got backend {kind}, chunk_size {chunk_size}, K={K}, {q.dtype}")
    wu_kernel = _kernel_choice(
        "wu_kernel", wu_kernel, kind == "gpu" and wu_mgpu.supported(K, V, chunk_size, k.dtype, v.dtype),
        requirement="the Mosaic GPU kernel C runs on the GPU backend with chunk_size 64, K and V multiples of 32 "
                    f"and k, v of one 16-bit dtype; got backend {kind}, chunk_size {chunk_size}, K={K}, V={V}, "
                    f"{k.dtype} and {v.dtype}")
    if recurrence == "mosaic_gpu" and block_v is not None:
        prefill_mgpu.check_block_v(block_v)  # before stage 1 runs
    if num_segments is not None and num_segments < 1:
        raise ValueError(f"num_segments must be >= 1, got {num_segments}")
    interpret = _interpret(interpret, kind)
    scale = K**-0.5 if scale is None else float(scale)
    C = chunk_size
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    init = jnp.zeros((N, HV, K, V), _F32) if initial_state is None else initial_state.astype(_F32)
    if initial_state_fn is not None and kind == "tpu":
        init = initial_state_fn(*sequence_maps(k, v, g, beta, cu_seqlens=cu_seqlens, chunk_size=C)).astype(_F32)
    TT = B * T
    flat = lambda x: x.reshape(TT, *x.shape[2:])
    q, k, v, g, beta = flat(q), flat(k), flat(v), flat(g.astype(_F32)), flat(beta)[..., None]
    cu = (jnp.arange(B + 1, dtype=jnp.int32) * T) if cu_seqlens is None else cu_seqlens.astype(jnp.int32)
    lay = _chunk_layout(cu, TT, C, N, checkpoint_stride)
    dense = cu_seqlens is None and T % C == 0
    NC = TT // C if dense else lay.chunk_seq.shape[0]
    if not dense:  # chunk-aligned packing; zero tokens (k = beta = g = 0) are the identity map
        ok = lay.ok
        q, k, v, g, beta = (jnp.where(ok.reshape(-1, 1, 1), x[lay.src], 0).astype(x.dtype) for x in (q, k, v, g, beta))
    lens, cstart = lay.lens, lay.cstart
    nch = cstart[1:] - cstart[:-1]
    n_ck = 0 if checkpoint_stride is None else T // checkpoint_stride
    ci = lay.ckpt[:NC]
    seq = lay.chunk_seq[:NC]
    n_slots = N * n_ck + N  # + a spare slot per sequence for chunks that write none (TPU)

    if kind == "gpu":
        prep = gpu_prep(q, k, v, g, beta, C=C, scale=scale, precision=default_precision(prep_precision, out_dtype),
                        num_warps=prep_num_warps, store_dtype=store, bounded=gate_lower_bound is not None,
                        interpret=interpret, kernel=prep_kernel, wu_kernel=wu_kernel)
        widths = (64,)
        if recurrence == "mosaic_gpu":
            # State columns per warpgroup, the same in the summary pass.
            block_v = summary_block_v = block_v or prefill_mgpu.DEFAULT_BLOCK_V
            widths = prefill_mgpu.recurrence_widths(K, V, block_v, out_dtype)
        P = num_segments or plan_segments(N, HV, V, int(T // C) + 1, backend="gpu", K=K, recurrence_widths=widths,
                                          summary_paid=initial_state_fn is not None, recurrence=recurrence)
        if recurrence == "mosaic_gpu":
            scan = partial(prefill_mgpu.scan_call, n_ck_slots=n_slots, interpret=bool(interpret))
        else:
            if block_v is None:
                block_v = 64 if P > 1 or gpu_programs(N, HV, V, 64) >= gpu_core_count() else 32
            scan_precision = default_precision(scan_precision, out_dtype, scan=store == jnp.dtype(jnp.bfloat16))
            scan = partial(prefill_gpu.scan_call, n_ck_slots=n_slots, num_warps=num_warps, num_stages=num_stages,
                           precision=scan_precision, interpret=interpret)
        p = jnp.arange(P, dtype=jnp.int32)
        vstart = (cstart[:-1, None] + (p * nch[:, None]) // P).reshape(-1)
        vend = (cstart[:-1, None] + ((p + 1) * nch[:, None]) // P).reshape(-1)
        ck_slot = jnp.where(ci >= 0, seq * n_ck + ci, -1)
        starts = init
        if P > 1 or initial_state_fn is not None:
            seg = np.broadcast_to(np.arange(P), (N, P))
            if initial_state_fn is None:
                # The maps only give the segments' starts: the first segment runs its E columns from
                # the sequence's initial state (its map becomes the constant (0, M init + E)) and
                # the last segment's map is never read.
                src = np.where(seg == 0, np.arange(N)[:, None], -1)
                table, e_start = (src, (seg > 0) & (seg < P - 1), seg < P - 1), init
            else:  # the hook gets every sequence's whole map
                table, e_start = (np.full((N, P), -1), np.ones((N, P)), np.ones((N, P))), None
            table = jnp.asarray(np.stack(table, axis=-1).reshape(N * P, 3), jnp.int32)
            cta_cols = {} if recurrence != "mosaic_gpu" else dict(cta_cols=summary_cta_cols(
                N, HV, K, V, P, block_v=block_v, paid=initial_state_fn is not None))
            ME = scan(prep, e_start, vstart, vend, table, summary=True, block_v=summary_block_v, **cta_cols)
            if initial_state_fn is None:
                starts = prefill_gpu.fold_call(ME, init, P=P, interpret=bool(interpret))
            else:
                M, E = ME[..., :K].reshape(N, P, HV, K, K), ME[..., K:].reshape(N, P, HV, K, V)
                M_all, E_all = jax.lax.associative_scan(combine_segments, (M, E), axis=1)
                init = initial_state_fn(M_all[:, -1], E_all[:, -1]).astype(_F32)
                starts = prefix_starts((M_all, E_all), init).reshape(N * P, HV, K, V)  # the same scan, not run again
        cta_cols = {} if recurrence != "mosaic_gpu" else dict(cta_cols=recurrence_cta_cols(N, HV, V, P, widths))
        o, final, ckpts = scan(prep, starts, vstart, vend, ck_slot, out_dtype=out_dtype, block_v=block_v, **cta_cols)
        final = final.reshape(N, P, HV, K, V)[:, -1]
    else:
        head = lambda x: jnp.moveaxis(x, 1, 0)
        prep = prep_call(*(head(x) for x in (q, k, v, g, beta)), C=C, scale=scale,
                         compiler_params=prefill_tpu.PREP_PARAMS, interpret=interpret)
        c = jnp.arange(NC, dtype=jnp.int32)
        slot = jnp.where(ci >= 0, seq * n_ck + ci, N * n_ck + seq)
        # The checkpoint block of a chunk that writes none: the next one its sequence writes.
        nxt = jax.lax.cummin(jnp.where(ci >= 0, c, NC), reverse=True)
        nxt_c = jnp.minimum(nxt, NC - 1)
        slot = jnp.where((ci < 0) & (nxt < NC) & (seq[nxt_c] == seq), slot[nxt_c], slot)
        i32 = lambda x: x.astype(jnp.int32)
        o, final, ckpts = prefill_tpu.scan_call(
            prep, init, i32(lay.first[:NC]), i32(lay.last[:NC]), seq, i32(ci >= 0), slot,
            n_ck_slots=n_slots, out_dtype=out_dtype, interpret=interpret,
        )
        o = head(o)
    final = jnp.where((lens == 0)[:, None, None, None], init, final)
    if dense:
        o = o.reshape(B, T, HV, V)
    else:
        o = jnp.where(lay.tok_ok[:, None, None], o[lay.dst], 0).astype(out_dtype).reshape(B, T, HV, V)
    o = o.astype(result_dtype)
    if checkpoint_stride is None:
        return o, final
    ckpts = ckpts[: N * n_ck].reshape(N, n_ck, HV, K, V)
    written = jnp.arange(n_ck)[None, :] < (lens // checkpoint_stride)[:, None]
    return o, final, jnp.where(written[..., None, None, None], ckpts, 0.0)
