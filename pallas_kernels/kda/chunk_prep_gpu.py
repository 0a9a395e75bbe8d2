"""The token-parallel stage (stage 1) on the GPU: :func:`gpu_prep`, everything of every chunk that
does not depend on the state, as kernels of small programs (many per SM):

1. ``G = cumsum(g)`` per chunk (:func:`gate_cumsum_call`, Triton), with the span flags the Mosaic
   GPU intra-chunk kernel needs for unbounded gates;
2. the intra-chunk products ``Aqk``, ``N = beta Akk`` and ``qg``
   (:mod:`~pallas_kernels.kda.chunk_intra_triton` or :mod:`~pallas_kernels.kda.chunk_intra_mgpu`);
3. ``X = (I + N)^-1`` (:func:`pallas_kernels.kda.wy_fast_triton.inverse_call`);
4. ``W``, ``U``, ``kd^T`` and the decay from ``X``
   (:mod:`~pallas_kernels.kda.wy_fast_triton` or :mod:`~pallas_kernels.kda.wy_fast_mgpu`).

Outputs are head-major, as :func:`pallas_kernels.kda.prefill_tpu.prep_call`'s.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda import chunk_intra_mgpu, chunk_intra_triton, wy_fast_mgpu, wy_fast_triton
from pallas_kernels.kda.common import GPU_PRECISION, SUB
from pallas_kernels.kda.gpu_common import triton_params

_F32 = jnp.float32


def _cumsum_body(g_ref, G_ref, *wide_ref, span=None):
    G = jnp.cumsum(g_ref[...].astype(_F32), axis=0)
    G_ref[...] = G
    if span is not None:
        C, K = G.shape
        G3 = G.reshape(C // SUB, SUB, K)
        # Triton's max and min skip NaN, so NaN is looked for apart. One axis per reduction: the
        # Triton lowering of a reduction over two fails under an explicit mesh (jax 0.11.2).
        any_ = lambda x: jnp.max(jnp.max(jnp.where(x, 1, 0), axis=1), axis=0)
        wide = jnp.max(G3, axis=1) - jnp.min(G3, axis=1) > span
        wide_ref[0][...] = jnp.maximum(any_(wide), any_(G != G))


def gate_cumsum_call(g, *, C, span=None, compiler_params=None, interpret=False):
    """The chunk-local gate cumsum of token-major ``g [TT, HV, K]``, one program per (chunk, head):
    float32 ``G [TT, HV, K]`` (faster than XLA's cumsum). The grid runs the heads fastest, so the
    programs running at once read whole token rows (faster here; the other stage-1 kernels keep
    chunks fastest, faster for them).

    ``span`` (nats): also return int32 ``wide [HV, TT // C]``, 1 where a 16-row sub-chunk of the
    chunk spans more than ``span`` in some channel (its largest G minus its smallest) or holds a
    NaN, else 0 (free here, where an XLA check over G was not)."""
    TT, HV, K = g.shape
    spec = pl.BlockSpec((C, None, K), lambda h, c: (c, h, 0))
    out_specs, out_shape = spec, jax.ShapeDtypeStruct((TT, HV, K), _F32)
    if span is not None:
        out_specs = [spec, pl.BlockSpec((None, None), lambda h, c: (h, c))]
        out_shape = [out_shape, jax.ShapeDtypeStruct((HV, TT // C), jnp.int32)]
    return pl.pallas_call(partial(_cumsum_body, span=span), grid=(HV, TT // C), in_specs=[spec],
                          out_specs=out_specs, out_shape=out_shape, compiler_params=compiler_params,
                          interpret=interpret)(g)


def gpu_prep(q, k, v, g, beta, *, C, scale, precision, num_warps=4, store_dtype=_F32, bounded=False,
             interpret=False, kernel="triton", wu_kernel="triton"):
    """Stage 1 on packed token-major inputs ``q, k [TT, H, K]``, ``v [TT, HV, V]``,
    ``g [TT, HV, K]``, ``beta [TT, HV, 1]`` (``TT`` a multiple of ``C``). Returns head-major
    ``(qg [HV, TT, K], kd^T [HV, NC, K, C], W [HV, TT, K], U [HV, TT, V], Aqk [HV, TT, C],
    decay f32[HV, NC, K, 1])``, all but the decay in ``store_dtype`` (bfloat16 halves what the
    recurrence reads; the inverse stays float32).

    ``precision``: the products' (Aqk, Akk, W, U); the inverse's merge products are TF32x3 and its
    diagonal blocks IEEE float32; HIGHEST throughout when interpreting. ``num_warps``: the cumsum
    and the Triton W/U kernel's warps (the intra-chunk and inverse kernels run on one warp: their
    16 x 16 products repeat on every warp). ``bounded``: gates >= -5 (no span checks).
    ``kernel``: the intra-chunk products' kernel, "triton" or "mosaic_gpu"
    (:mod:`~pallas_kernels.kda.chunk_intra_mgpu`; for unbounded gates its rows are kept only in
    chunks whose sub-chunks all span at most :data:`~pallas_kernels.kda.chunk_intra_mgpu.SPAN`,
    flagged by the cumsum kernel, and the Triton kernel, launched only if a chunk is flagged,
    redoes the others in place). ``wu_kernel``: W and U's, "triton" or "mosaic_gpu"
    (:mod:`~pallas_kernels.kda.wy_fast_mgpu`).
    """
    hi = jax.lax.Precision.HIGHEST
    params = lambda warps, stages: None if interpret else triton_params(warps, stages)
    products = hi if interpret else precision
    checked = kernel == "mosaic_gpu" and not bounded
    G = gate_cumsum_call(g, C=C, span=chunk_intra_mgpu.SPAN if checked else None, compiler_params=params(num_warps, 2),
                         interpret=interpret)
    if checked:
        G, wide = G
    rows_kw = dict(C=C, scale=scale, precision=products, store_dtype=store_dtype, bounded=bounded,
                   compiler_params=params(1, 2), interpret=interpret)
    if kernel != "mosaic_gpu":
        qg, aqk, N = chunk_intra_triton.rows_call(q, k, g, G, beta, **rows_kw)
    else:
        fast = tuple(chunk_intra_mgpu.rows_call(q, k, G, beta, scale=scale, store_dtype=store_dtype,
                                                interpret=bool(interpret)))
        if checked:
            # The Triton kernel redoes the chunks too steep for the Mosaic GPU one, in place; launched
            # only if a chunk is flagged (its other programs return at once).
            redo = lambda: tuple(chunk_intra_triton.redo_rows_call(wide, q, k, g, G, beta, *fast, **rows_kw))
            fast = jax.lax.cond(jnp.max(wide) > 0, redo, lambda: fast)
        qg, aqk, N = fast
    X = wy_fast_triton.inverse_call(N, precision=hi if interpret else GPU_PRECISION, compiler_params=params(1, 1),
                                    interpret=interpret)
    if wu_kernel == "mosaic_gpu":
        kdT, W, U, decay = wy_fast_mgpu.wu_call(k, v, G, beta, X, store_dtype=store_dtype, interpret=bool(interpret))
    else:
        kdT, W, U, decay = wy_fast_triton.wu_call(k, v, G, beta, X, precision=products, store_dtype=store_dtype,
                                                  compiler_params=params(num_warps, 2), interpret=interpret)
    return qg, kdT, W, U, aqk, decay
