"""Kernel A of the GPU token-parallel stage in Mosaic GPU (``plgpu.kernel``), for bounded gates:
:func:`rows_call`, an alternative to the Triton kernel A of
:func:`pallas_kernels.kda._chunk.gpu_prep_call`.

One CTA (one warpgroup) per (chunk, value head). TMA brings the chunk's q, k, gate cumsum G (in
64-column halves of K), each 16-row sub-chunk's anchor row of G and beta into shared memory.
Every sub-chunk ``i`` is anchored at its first row's G, ``a_i`` (as in the Triton kernel A), so
the row factors ``exp(G_r - a_i)`` lie in ``[e^-75, 1]`` and the column factors
``exp(a_i - G_c)`` of the columns up to the sub-chunk's end at most ``e^75`` when every gate is
at least -5 (normal float32 and TF32). WGMMA tiles have 64 rows, and a sub-chunk has 16, so the
products run transposed: the chunk's 64 columns are the M side and sub-chunk ``i``'s rows the
N = 16 side, ``(k exp(a_i - G))  (q exp(G - a_i))_i^T`` and the same with ``beta k`` (TF32,
float32 accumulation, over the K halves): eight ``64 x 16 x K`` products per chunk, none of
them wasted on rows that are dropped. Each result, block column ``i`` of ``Aqk^T`` and
``Akk^T``, is moved to rows ``16 i ..`` of ``[64, 64]`` accumulators by a product with a 0/1
placement matrix. That product reads its operand as TF32, so the value goes in as two parts,
its top 10 mantissa bits and the exact remainder: the placed sums keep float32 accuracy.
Writes qg, Aqk (scaled, causal) and ``N = beta Akk`` strictly lower, its diagonal blocks
included: the Triton kernel B inverts those (``_inverse_body`` without ``Xd``).

Unbounded gates need the Triton kernel A's per-row span test and exact fallback; that stays on
Triton.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda._chunk import SUB, _exp
from pallas_kernels.kda.prefill_mgpu import _swizzled

_F32 = jnp.float32
C = 64  # chunk rows: one WGMMA row block
HALF = 64  # K columns per pass: one 256-byte row of float32 (tile 8 x 32, 128-byte swizzle)
NS = C // SUB


def supported(K, chunk_size, dtype, bounded) -> bool:
    """Whether :func:`rows_call` takes these: bounded gates, chunk 64, K in {64, 128} (shared
    memory), 16-bit inputs (TF32 products are the Triton path's precision for those only)."""
    return bounded and chunk_size == C and K in (64, 128) and jnp.dtype(dtype).itemsize == 2


def _kernel(q_ref, k_ref, G_ref, beta_ref, qg_ref, aqk_ref, n_ref, *, scale, rep):
    c, h = lax.axis_index("c"), lax.axis_index("h")
    K = q_ref.shape[-1]
    nh = K // HALF
    rows = pl.ds(pl.multiple_of(c * C, C), C)
    lay = plgpu.Layout.WGMMA
    # Every tile in the WGMMA layout: the layout inference then has one choice per value.
    pin = lambda x: plgpu.layout_cast(x, lay)
    iota = lambda shape, dim: plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=lay)
    part = lambda x: pl.ds(x * HALF, HALF)

    def body(q_s, k_s, G_s, a_s, b_s, rq_s, rk_s, kc_s, p_s, e_s, qg_s, aqk_s, n_s, bar):
        for x in range(nh):
            for src, dst in ((q_ref.at[rows, h // rep, part(x)], q_s.at[x]),
                             (k_ref.at[rows, h // rep, part(x)], k_s.at[x]), (G_ref.at[rows, h, part(x)], G_s.at[x])):
                plgpu.copy_gmem_to_smem(src, dst, bar.at[0])
            for i in range(NS):  # the anchors: each sub-chunk's first row of G
                plgpu.copy_gmem_to_smem(G_ref.at[c * C + i * SUB, h, part(x)], a_s.at[x, i], bar.at[0])
        plgpu.copy_gmem_to_smem(beta_ref.at[h, rows], b_s, bar.at[0])
        r16, c16 = iota((C, SUB), 0), iota((C, SUB), 1)
        for i in range(NS):  # placement matrices: E_i[r, t] = (r == 16 i + t)
            e_s[i] = pin((r16 == c16 + i * SUB).astype(_F32))
        plgpu.barrier_wait(bar.at[0])
        sub = pin(lax.div(iota((C, HALF), 0), SUB))
        beta = pin(lax.broadcast_in_dim(plgpu.load(b_s, (), layout=lay.reduce(1)), (C, HALF), [0]))

        def products(*accs):
            """Block column ``i`` of ``Aqk^T`` and ``Akk^T`` into ``accs[i]`` and ``accs[NS + i]``."""
            for x in range(nh):
                G = plgpu.load(G_s.at[x], (), layout=lay)
                anchors = [pin(lax.broadcast_in_dim(plgpu.load(a_s.at[x, i], (), layout=lay.reduce(0)), (C, HALF),
                                                    [1])) for i in range(NS)]
                anchor = anchors[NS - 1]
                for i in range(NS - 2, -1, -1):
                    anchor = pin(jnp.where(sub == i, anchors[i], anchor))
                e = pin(_exp(G - anchor))
                q = pin(plgpu.load(q_s.at[x], (), layout=lay).astype(_F32))
                qg_s[x] = pin((scale * q * _exp(G)).astype(qg_s.dtype))
                rq_s[...] = pin(q * e)
                k = pin(plgpu.load(k_s.at[x], (), layout=lay).astype(_F32))
                rk_s[...] = pin(beta * k * e)
                for i in range(NS):
                    keep = sub <= i  # columns up to sub-chunk i's end; later ones zero before exp
                    kc_s[...] = pin(jnp.where(keep, k * _exp(pin(jnp.where(keep, anchors[i] - G, 0.0))), 0.0))
                    plgpu.commit_smem()
                    block = pl.ds(i * SUB, SUB)
                    plgpu.wgmma(accs[i], kc_s, rq_s.at[block].T)
                    plgpu.wgmma(accs[NS + i], kc_s, rk_s.at[block].T)
                    plgpu.wgmma_wait(0)  # before kc_s (and, after the last i, rq_s and rk_s) is rewritten
            return [a[...] for a in accs]

        P = pl.run_scoped(products, *[plgpu.ACC((C, SUB), _F32) for _ in range(2 * NS)])

        def place(acc_q, acc_k):
            """``acc[16 i + t, c] = P_i[c, t]``: ``E_i P_i^T``, P_i in two TF32-exact parts."""
            for i in range(NS):
                for which in range(2):
                    p = P[which * NS + i]  # [c, t]: row 16 i + t's products with column c
                    bits = pin(lax.bitcast_convert_type(p, jnp.int32) & jnp.int32(-8192))  # 10 mantissa bits
                    hi = pin(lax.bitcast_convert_type(bits, _F32))
                    p_s[which, 0] = hi
                    p_s[which, 1] = pin(p - hi)
                plgpu.commit_smem()
                for which, acc in ((0, acc_q), (1, acc_k)):
                    for piece in range(2):  # the top bits, then the remainder
                        plgpu.wgmma(acc, e_s.at[i], p_s.at[which, piece].T)
                plgpu.wgmma_wait(0)
            return acc_q[...], acc_k[...]

        aq, ak = pl.run_scoped(place, plgpu.ACC((C, C), _F32), plgpu.ACC((C, C), _F32))
        r2, c2 = iota((C, C), 0), iota((C, C), 1)
        aqk_s[...] = pin((scale * jnp.where(c2 <= r2, aq, 0.0)).astype(aqk_s.dtype))
        n_s[...] = pin(jnp.where(c2 < r2, ak, 0.0))
        plgpu.commit_smem()
        for x in range(nh):
            plgpu.copy_smem_to_gmem(qg_s.at[x], qg_ref.at[h, rows, part(x)])
        plgpu.copy_smem_to_gmem(aqk_s, aqk_ref.at[h, rows])
        plgpu.copy_smem_to_gmem(n_s, n_ref.at[h, rows])
        plgpu.wait_smem_to_gmem(0)

    # Shared memory (184 KB at K = 128 with bf16 outputs): the inputs, the anchors (unswizzled:
    # rows loaded as vectors), beta; the operands rq, rk, kc; the two parts of two results; the
    # placement matrices; the outputs.
    st = qg_ref.dtype
    smem = lambda shape, dtype, width=None: plgpu.SMEM(shape, dtype,
                                                       transforms=_swizzled(dtype, width) if width else ())
    half_tile = lambda dtype: smem((nh, C, HALF), dtype, HALF)
    pl.run_scoped(body, half_tile(q_ref.dtype), half_tile(k_ref.dtype), half_tile(_F32), smem((nh, NS, HALF), _F32),
                  smem((C,), _F32), *[smem((C, HALF), _F32, HALF) for _ in range(3)],
                  smem((2, 2, C, SUB), _F32, SUB), smem((NS, C, SUB), _F32, SUB), half_tile(st), smem((C, C), st, C),
                  smem((C, C), _F32), plgpu.Barrier(num_arrivals=(3 + NS) * nh + 1, num_barriers=1))


def rows_call(q, k, G, beta, *, scale, store_dtype, interpret=False):
    """Token-major ``q, k [TT, H, K]`` (16-bit), ``G [TT, HV, K]`` float32 (the chunk-local gate
    cumsum), ``beta [TT, HV, 1]``; every gate at least -5. Returns ``qg [HV, TT, K]`` and
    ``Aqk [HV, TT, C]`` in ``store_dtype`` and ``N [HV, TT, C]`` float32 (see the module).
    ``interpret``: True or a ``plgpu.InterpretGPUParams`` runs it in the Mosaic GPU interpreter."""
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    TT, H, K = q.shape
    HV = G.shape[1]
    if not supported(K, C, q.dtype, True) or TT % C:
        raise ValueError(f"the Mosaic GPU kernel A takes chunk {C}, K in (64, 128) and 16-bit q, k; got "
                         f"K={K}, {q.dtype}, {TT} tokens")
    out = (jax.ShapeDtypeStruct((HV, TT, K), store_dtype), jax.ShapeDtypeStruct((HV, TT, C), store_dtype),
           jax.ShapeDtypeStruct((HV, TT, C), _F32))
    kernel = plgpu.kernel(functools.partial(_kernel, scale=scale, rep=HV // H), out_type=out, grid=(TT // C, HV),
                          grid_names=("c", "h"), interpret=interpret)
    return kernel(q, k, G, jnp.moveaxis(beta[..., 0], 1, 0).astype(_F32))
