"""The intra-chunk products (Aqk, Akk as ``N = beta Akk``, qg) in Mosaic GPU (``plgpu.kernel``):
:func:`rows_call`, the contract of the Triton kernel
(:func:`pallas_kernels.kda.chunk_intra_triton.rows_call`) where every 16-row sub-chunk's gate span
is at most ``SPAN``.

One warpgroup per item (chunk, value head), ``WGS`` warpgroups per CTA (one by default),
items in order with the heads fastest. TMA brings the chunk's q, k, gate cumsum G and
each 16-row sub-chunk's anchor row of G into shared memory in 32-column parts of K, the next two
parts' copies in flight while this one is computed, and beta once (awaited after the first
parts' copies are issued, so no item starts with two memory latencies in a row).
Every sub-chunk ``i`` is anchored at its first row's G, ``a_i`` (as in the Triton kernel), so
the row factors ``exp(G_r - a_i)`` lie in ``[e^-75, 1]`` and the column factors
``exp(a_i - G_c)`` of the columns up to the sub-chunk's end in ``[e^-240, e^75]`` when every gate
is at least -5 (normal float32 and TF32). One exponential per element gives every column's factor
against its own sub-chunk's anchor; the later anchors' factors follow by per-column products with
``exp(a_i - a_(i-1)) <= 1`` (a vector), so a column's factor for anchor ``i`` reads no row past
sub-chunk ``i``'s first, and columns past sub-chunk ``i``'s end are zero.
WGMMA tiles have 64 rows, and a sub-chunk has 16, so the products run transposed: the chunk's
64 columns are the M side and sub-chunk ``i``'s rows the N = 16 side,
``(k exp(a_i - G))  (q exp(G - a_i))_i^T`` and the same with ``beta k`` (TF32, float32
accumulation, over the K parts): eight ``64 x 16 x K`` products per chunk, none of them wasted
on rows that are dropped. Each result, block column ``i`` of ``Aqk^T`` and ``Akk^T``, goes to
rows ``16 i ..`` of the output tiles by a transposed store: a register relayout to the
transposed WGMMA layout (a lane shuffle), then a store through the transposed view of a plain
shared memory tile. Writes qg, Aqk (scaled, causal) and ``N = beta Akk`` strictly lower, its
diagonal blocks included, for the inverse (:mod:`pallas_kernels.kda.wy_fast_triton`).

The products and the output tiles are two scopes in turn over one shared memory region (86 KB
per warpgroup at K = 128 with bf16 outputs), so two CTAs share an SM (255 registers, which also
allows two). The kernel is written with warpgroup threads (``num_threads=WGS``; the scopes are
collective, so a CTA's warpgroups enter each together), which was faster than the same code as
a plain one-warpgroup kernel over a ``(chunk, head)`` grid, with the same bits. G comes from the
cumsum kernel (:func:`pallas_kernels.kda.chunk_prep_gpu.gate_cumsum_call`); forming it in here
was slower. The variants tried and their times: ``docs/benchmarks.md``.

Those ranges hold whenever every sub-chunk's gate span (its largest G minus its smallest, per
head and channel) is at most ``SPAN`` = 75 nats, which gates of at least -5 guarantee. For
unbounded gates the cumsum kernel flags the chunks where a span is wider
(``gate_cumsum_call(span=SPAN)``), and after this kernel the Triton kernel (its per-row span test
and exact fallback) redoes those chunks in place. Columns carried past a much steeper gate
underflow to zero, as their true terms (below ``e^-87`` relative) do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.common import LOG2_E, SUB, fast_exp
from pallas_kernels.kda.mgpu_common import column_part, pipelined, swizzled_transforms

_F32 = jnp.float32
C = 64  # chunk rows: one WGMMA row block
PART = 32  # K columns per pass: one 128-byte row of float32 (tile 8 x 32, 128-byte swizzle)
NS = C // SUB
# Input buffers: parts x + 1 and x + 2's copies are in flight while part x is computed (three were
# faster than two and than four; two CTAs per SM either way: registers limit them).
SLOTS = 3
# Warpgroups per CTA, each on an item (chunk, value head) of its own with its own buffers (one, two
# CTAs per SM, was faster than two or three).
WGS = 1


SPAN = 75.0  # nats: 15 steps of the -5 gate bound


def supported(K, chunk_size, dtype) -> bool:
    """Whether :func:`rows_call` takes these shapes: chunk 64, K in {64, 128}, 16-bit inputs (TF32
    products are the Triton path's precision for those only). Its rows are right where every
    sub-chunk spans at most ``SPAN``; for unbounded gates ``chunk_kda`` has the Triton kernel
    redo the other chunks."""
    return chunk_size == C and K in (64, 128) and jnp.dtype(dtype).itemsize == 2


def _kernel(q_ref, k_ref, G_ref, beta_ref, qg_ref, aqk_ref, n_ref, *, scale, rep):
    HV = G_ref.shape[1]
    wg = lax.axis_index("wg")
    items = G_ref.shape[0] // C * HV
    w = lax.axis_index("i") * WGS + wg  # this warpgroup's item: chunk w // HV, head w % HV
    # The last CTA's spare warpgroups redo the last item without storing it: they still enter
    # the CTA's shared memory scopes, which synchronise its warpgroups.
    has_item = w < items
    w = jnp.minimum(w, items - 1)
    c, h = lax.div(w, HV), lax.rem(w, HV)
    store = lambda src, dst: pl.when(has_item)(lambda: plgpu.copy_smem_to_gmem(src, dst))
    K = q_ref.shape[-1]
    nparts = K // PART
    rows = pl.ds(pl.multiple_of(c * C, C), C)
    lay = plgpu.Layout.WGMMA
    # Every tile in the WGMMA layout: the layout inference then has one choice per value.
    pin = lambda x: plgpu.layout_cast(x, lay)
    iota = lambda shape, dim: plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=lay)
    part = lambda x: column_part(x, PART)
    # Every warpgroup's own buffers along a leading axis (:func:`mine` takes its part).
    smem = lambda shape, dtype, width=None: plgpu.SMEM((WGS, *shape), dtype,
                                                       transforms=swizzled_transforms(dtype, width) if width else ())
    mine = lambda f: lambda *refs: f(*(r.at[wg] for r in refs[:-1]), refs[-1])  # the last: barriers
    barrier_at = lambda bars, slot: bars.at[wg * SLOTS + slot]
    st = qg_ref.dtype

    def products(b_s, b_bar, q_s, k_s, G_s, a_s, rq_s, rk_s, kc_s, qg_s, ready):
        return pl.run_scoped(functools.partial(products_into, b_s, b_bar, q_s, k_s, G_s, a_s, rq_s, rk_s, kc_s, qg_s, ready),
                             *[plgpu.ACC((C, SUB), _F32) for _ in range(2 * NS)])

    def products_into(b_s, b_bar, q_s, k_s, G_s, a_s, rq_s, rk_s, kc_s, qg_s, ready, *accs):
        """Block column ``i`` of ``Aqk^T`` and ``Akk^T`` into ``accs[i]`` and ``accs[NS + i]``, over
        K in parts of ``PART`` columns; qg written part by part."""

        anchor_row = lambda slot, i: a_s.at[slot, i, pl.ds(0, PART)]

        def issue(x, slot):
            cols = part(x)
            bar = barrier_at(ready, slot)
            for src, dst in ((q_ref.at[rows, h // rep, cols], q_s), (k_ref.at[rows, h // rep, cols], k_s),
                             (G_ref.at[rows, h, cols], G_s)):
                plgpu.copy_gmem_to_smem(src, dst.at[slot], bar)
            for i in range(NS):  # the anchors: each sub-chunk's first row of G
                plgpu.copy_gmem_to_smem(G_ref.at[c * C + i * SUB, h, cols], anchor_row(slot, i), bar)

        sub = pin(lax.div(iota((C, PART), 0), SUB))
        spread = lambda v: pin(lax.broadcast_in_dim(v, (C, PART), [1]))  # a row vector down the rows

        def part_step(x, slot):
            plgpu.barrier_wait(barrier_at(ready, slot))
            G = plgpu.load(G_s.at[slot], layout=lay)
            avec = [plgpu.load(anchor_row(slot, i), layout=lay.reduce(0)) for i in range(NS)]
            anchor = spread(avec[NS - 1])
            for i in range(NS - 2, -1, -1):
                anchor = pin(jnp.where(sub == i, spread(avec[i]), anchor))
            t = pin((G - anchor) * LOG2_E)  # G_r - a_sub(r), in base 2
            e = pin(jnp.exp2(t))
            q = pin(plgpu.load(q_s.at[slot], layout=lay).astype(_F32))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # part x - 1's qg has left qg_s
            qg_s[...] = pin((scale * q * fast_exp(G)).astype(st))
            rq_s[...] = pin(q * e)
            beta = pin(lax.broadcast_in_dim(plgpu.load(b_s, layout=lay.reduce(1)), (C, PART), [0]))
            k = pin(plgpu.load(k_s.at[slot], layout=lay).astype(_F32))
            rk_s[...] = pin(beta * k * e)
            # Column factors: each row's against its own sub-chunk's anchor, exp(a_sub(c) - G_c) in
            # [1, e^75], then carried to later anchors by exp(a_i - a_(i-1)) <= 1 per column (a
            # vector): kc_i = k exp(a_i - G) on the rows up to sub-chunk i's end, zero below. Row c
            # of kc_i reads only a_sub(c) .. a_i, never a later token than sub-chunk i's rows.
            own = pin(k * jnp.exp2(-t))
            kc = pin(jnp.where(sub == 0, own, 0.0))
            for i in range(NS):
                if i:
                    step = spread(fast_exp(avec[i] - avec[i - 1]))
                    kc = pin(jnp.where(sub == i, own, kc * step))
                # kc_s[i % 2]'s last products (sub-chunk i - 2's) are done: at most the latest pair
                # is in flight.
                plgpu.wgmma_wait(2)
                kc_s[i % 2] = kc
                plgpu.commit_smem()
                if i == 0:
                    store(qg_s, qg_ref.at[h, rows, part(x)])
                block = pl.ds(i * SUB, SUB)
                plgpu.wgmma(accs[i], kc_s.at[i % 2], rq_s.at[block].T)
                plgpu.wgmma(accs[NS + i], kc_s.at[i % 2], rk_s.at[block].T)
            plgpu.wgmma_wait(0)  # before rq_s, rk_s and kc_s are rewritten

        # The parts as a loop, not unrolled: faster, and fewer registers.
        pipelined(nparts, SLOTS, issue, part_step, lambda: plgpu.barrier_wait(b_bar))  # beta's copy
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # qg_s is freed with this scope
        return [a[...] for a in accs]

    def write(P, aqk_s, n_s):
        """Block column ``i`` of ``Aqk^T`` and ``Akk^T`` (``[c, t]``: row ``16 i + t``'s products with
        column ``c``) stored transposed into rows ``16 i ..`` of the output tiles (a register
        relayout to the transposed WGMMA layout, then a plain shared memory store), masked causal."""
        col, t = iota((C, SUB), 0), iota((C, SUB), 1)
        for i in range(NS):
            row = t + i * SUB
            for p, dst, keep, factor in ((P[i], aqk_s, col <= row, scale), (P[NS + i], n_s, col < row, 1.0)):
                value = pin(jnp.where(keep, factor * p, 0.0)).astype(dst.dtype)
                dst.at[pl.ds(i * SUB, SUB)].T[...] = plgpu.layout_cast(value, plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()
        store(aqk_s, aqk_ref.at[h, rows])
        store(n_s, n_ref.at[h, rows])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the writes to global memory finish on their own

    def body(b_s, b_bar):
        b_s = b_s.at[wg]
        plgpu.copy_gmem_to_smem(beta_ref.at[h, rows], b_s, b_bar.at[wg])  # awaited with the first parts in flight
        # Two scopes in turn share their shared memory (86 KB per warpgroup at K = 128 with bf16
        # outputs): the products, the outputs.
        part_tile = lambda dtype: smem((SLOTS, C, PART), dtype, PART)
        P = pl.run_scoped(mine(functools.partial(products, b_s, b_bar.at[wg])), part_tile(q_ref.dtype), part_tile(k_ref.dtype),
                          # The anchors unswizzled (rows loaded as vectors), each row 128-byte aligned for TMA.
                          part_tile(_F32), smem((SLOTS, NS, max(PART, 32)), _F32),
                          smem((C, PART), _F32, PART), smem((C, PART), _F32, PART), smem((2, C, PART), _F32, PART),
                          smem((C, PART), st, PART),
                          plgpu.Barrier(num_arrivals=3 + NS, num_barriers=WGS * SLOTS), collective_axes="wg")
        pl.run_scoped(lambda aqk_s, n_s: write(P, aqk_s.at[wg], n_s.at[wg]), smem((C, C), st), smem((C, C), _F32),
                      collective_axes="wg")

    pl.run_scoped(body, smem((C,), _F32), plgpu.Barrier(num_arrivals=1, num_barriers=WGS), collective_axes="wg")


def rows_call(q, k, G, beta, *, scale, store_dtype, interpret=False):
    """Token-major ``q, k [TT, H, K]`` (16-bit), ``G [TT, HV, K]`` float32 (the chunk-local gate
    cumsum), ``beta [TT, HV, 1]``; right where every sub-chunk spans at most ``SPAN`` (gates >= -5
    give that). Returns ``qg [HV, TT, K]`` and ``Aqk [HV, TT, C]`` in ``store_dtype`` and
    ``N [HV, TT, C]`` float32 (see the module).
    ``interpret``: True or a ``plgpu.InterpretGPUParams`` runs it in the Mosaic GPU interpreter."""
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    TT, H, K = q.shape
    HV = G.shape[1]
    if not supported(K, C, q.dtype) or TT % C:
        raise ValueError(f"the Mosaic GPU intra-chunk kernel takes chunk {C}, K in (64, 128) and 16-bit q, k; got "
                         f"K={K}, {q.dtype}, {TT} tokens")
    out = (jax.ShapeDtypeStruct((HV, TT, K), store_dtype), jax.ShapeDtypeStruct((HV, TT, C), store_dtype),
           jax.ShapeDtypeStruct((HV, TT, C), _F32))
    kernel = plgpu.kernel(functools.partial(_kernel, scale=scale, rep=HV // H), out_type=out,
                          grid=(-(-(TT // C * HV) // WGS),), grid_names=("i",), num_threads=WGS, thread_name="wg",
                          kernel_name="kda_prep", interpret=interpret)
    return kernel(q, k, G, jnp.moveaxis(beta[..., 0], 1, 0).astype(_F32))
