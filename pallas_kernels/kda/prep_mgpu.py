"""Kernel A of the GPU token-parallel stage in Mosaic GPU (``plgpu.kernel``), for bounded gates:
:func:`rows_call`, an alternative to the Triton kernel A of
:func:`pallas_kernels.kda._chunk.gpu_prep_call`.

One CTA (one warpgroup) per (chunk, value head). TMA brings the chunk's q, k, gate cumsum G and
beta into shared memory. Every 16-row sub-chunk is anchored at its first row's G (as in the
Triton kernel A), so the row factors ``exp(G_r - a)`` lie in ``[e^-75, 1]`` and the column
factors ``exp(a - G_j)`` of the columns up to the sub-chunk's end at most ``e^75`` when every
gate is at least -5 (normal float32 and TF32). The rows of all four sub-chunks form one
``[64, K]`` operand each for q and beta k; per anchor ``i`` the columns form one more, and two
tensor-core products (TF32, f32 accumulation) give ``q k^T`` and ``beta k k^T`` of which the
rows of sub-chunk ``i`` are kept. Four 64-row products instead of ten 16 x 16 blocks: WGMMA's
tiles have 64 rows, so each product computes three sub-chunks' rows only to drop them.
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


def supported(K, chunk_size, dtype, bounded) -> bool:
    """Whether :func:`rows_call` takes these: bounded gates, chunk 64, K in {64, 128} (shared
    memory), 16-bit inputs (TF32 products are the Triton path's precision for those only)."""
    return bounded and chunk_size == C and K in (64, 128) and jnp.dtype(dtype).itemsize == 2


def _kernel(q_ref, k_ref, G_ref, beta_ref, qg_ref, aqk_ref, n_ref, *, scale, rep):
    c, h = lax.axis_index("c"), lax.axis_index("h")
    K = q_ref.shape[-1]
    rows = pl.ds(pl.multiple_of(c * C, C), C)
    lay = plgpu.Layout.WGMMA
    # Every tile in the WGMMA layout: the layout inference then has one choice per value.
    pin = lambda x: plgpu.layout_cast(x, lay)
    iota = lambda shape, dim: plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=lay)

    def body(q_s, k_s, G_s, b_s, rq_s, rk_s, qg_s, aqk_s, n_s, bar):
        for src, dst in ((q_ref.at[rows, h // rep], q_s), (k_ref.at[rows, h // rep], k_s),
                         (G_ref.at[rows, h], G_s), (beta_ref.at[h, rows], b_s)):
            plgpu.copy_gmem_to_smem(src, dst, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        # Live tiles are few (each [64, K] f32 tile is 64 registers a thread): q goes once its two
        # uses are stored, the anchors stay [K] vectors until used.
        G = plgpu.load(G_s, layout=lay)
        r = iota((C, K), 0)
        sub = pin(lax.div(r, SUB))
        # Sub-chunk i's anchor: its first row of G, picked by a reduction over the rows.
        anchor_of = lambda i: pin(lax.broadcast_in_dim(jnp.max(jnp.where(r == i * SUB, G, -jnp.inf), axis=0),
                                                       (C, K), [1]))
        anchor = anchor_of(0)
        for i in range(1, C // SUB):
            anchor = pin(jnp.where(sub == i, anchor_of(i), anchor))
        e = pin(_exp(G - anchor))
        q = plgpu.load(q_s, layout=lay).astype(_F32)
        rq_s[...] = pin(q * e)
        qg_s[...] = (scale * q * _exp(G)).astype(qg_s.dtype)
        k = plgpu.load(k_s, layout=lay).astype(_F32)
        beta = pin(lax.broadcast_in_dim(plgpu.load(b_s, layout=lay.reduce(1)), (C, K), [0]))
        rk_s[...] = pin(beta * k * e)
        r2, c2 = iota((C, C), 0), iota((C, C), 1)
        sub2 = pin(lax.div(r2, SUB))
        aq = ak = pin(jnp.zeros((C, C), _F32))
        for i in range(C // SUB):
            # G's buffer (G is in registers) takes the columns; those past sub-chunk i are selected
            # away before their exponent can overflow.
            up = pin(jnp.where(sub <= i, anchor_of(i) - G, 0.0))
            G_s[...] = pin(jnp.where(sub <= i, k * _exp(up), 0.0))
            plgpu.commit_smem()

            def products(acc_q, acc_k):
                plgpu.wgmma(acc_q, rq_s, G_s.T)
                plgpu.wgmma(acc_k, rk_s, G_s.T)
                return acc_q[...], acc_k[...]

            aq_i, ak_i = pl.run_scoped(products, plgpu.ACC((C, C), _F32), plgpu.ACC((C, C), _F32))
            aq = pin(jnp.where(sub2 == i, aq_i, aq))
            ak = pin(jnp.where(sub2 == i, ak_i, ak))
        aqk_s[...] = (scale * jnp.where(c2 <= r2, aq, 0.0)).astype(aqk_s.dtype)
        n_s[...] = jnp.where(c2 < r2, ak, 0.0)
        plgpu.commit_smem()
        for src, dst in ((qg_s, qg_ref), (aqk_s, aqk_ref), (n_s, n_ref)):
            plgpu.copy_smem_to_gmem(src, dst.at[h, rows])
        plgpu.wait_smem_to_gmem(0)

    smem = lambda shape, dtype, swizzled=True: plgpu.SMEM(shape, dtype,
                                                          transforms=_swizzled(dtype, 128) if swizzled else ())
    st = qg_ref.dtype
    pl.run_scoped(body, smem((C, K), q_ref.dtype), smem((C, K), k_ref.dtype), smem((C, K), _F32),
                  smem((C,), _F32, False), smem((C, K), _F32), smem((C, K), _F32), smem((C, K), st),
                  smem((C, C), st), smem((C, C), _F32, False), plgpu.Barrier(num_arrivals=4, num_barriers=1))


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
