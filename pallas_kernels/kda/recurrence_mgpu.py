"""The recurrent stage in Mosaic GPU (``plgpu.kernel``): :func:`scan_call`, the contract of
:func:`pallas_kernels.kda.recurrence_triton.scan_call` for bfloat16 intermediates.

One CTA per ``(virtual sequence, HV, V / 64)`` loops over the sequence's chunks; each of its
``64 / block_v`` warpgroups keeps ``f32[K, block_v]`` of the state in registers (the WGMMA
accumulator layout). Per chunk, TMA brings W, qg, Aqk, kd^T and the decay into shared memory
once for the CTA (its warpgroups share them) and each warpgroup's U columns, double-buffered
(three slots in summary mode): chunk ``c + 1``'s copies (``c + 2``'s) are issued before chunk
``c``'s work, and a slot is refilled only once every warpgroup has released it. The state goes
to shared memory as bfloat16 (the operand of ``W S`` and ``qg S``) and so does
``V_new = U - W S`` (of ``Aqk V_new`` and ``kd^T V_new``); the four products run on the tensor
cores (WGMMA, bf16 operands, f32 accumulation: the numerics of the Triton kernel's
``BF16_BF16_F32``), the state stays float32.
The outputs leave through shared memory by TMA; checkpoints and final states likewise, staged in
memory the state and V_new tiles share (a ``RefUnion``; with several warpgroups between CTA-wide
syncs). The recurrence may also hold two warpgroups of 64 columns in a CTA (``cta_cols=128``,
16-bit outputs: 209 KB at K = 128): half the CTAs for a longer chunk, which pays where it saves
waves (:func:`pallas_kernels.kda.segment_plan.recurrence_cta_cols`).
``summary=True`` runs the ``[M | E]`` columns as the Triton kernel does (README.md); there a CTA
may also hold two warpgroups of 64 columns (``cta_cols=128``: 145 KB with two input slots) or
all ``K + V = 256`` columns on four warpgroups (``cta_cols=256``: 193 KB; W and kd^T copied once
for the M and E columns, the M warpgroups read no U). The summary pass stages its f32 states in
shared memory of their own scopes before and after the loop (128 KB at 256 columns), and at 256
columns each ``kd^T V_new`` accumulates onto ``decay S`` in its own registers
(``pl.run_state``: 128 registers per thread, where a separate accumulator and sum spills);
the Mosaic GPU interpreter, which has no ``run_state``, runs the separate form (the same bits).
Measurements: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.mgpu_common import swizzled_transforms

_F32, _BF16 = jnp.float32, jnp.bfloat16
BV = 64  # value columns per CTA: one 128-byte swizzled row of bf16
# State columns per warpgroup: one warpgroup of 64 per CTA (faster than two of 32 on the H200).
DEFAULT_BLOCK_V = 64


def supported(K, V, C, store_dtype) -> bool:
    """Whether :func:`scan_call` takes these sizes: bf16 intermediates, C = 64 (one WGMMA row
    block), K in {64, 128} (the shared memory of two input slots), V a multiple of 64."""
    return jnp.dtype(store_dtype) == jnp.dtype(_BF16) and C == 64 and K in (64, 128) and V % BV == 0


def summary_widths(K, V, block_v):
    """State columns per CTA the summary pass takes: 64; where ``block_v`` is 64, 128 (two
    warpgroups of 64, each CTA's columns all M or all E) for K and V multiples of 128, and all
    ``K + V`` columns (four warpgroups of 64 sharing one copy of W and kd^T) for ``K + V = 256``."""
    if block_v != BV:
        return (BV,)
    wide = 2 * BV
    return (BV,) + ((wide,) if K % wide == 0 and V % wide == 0 else ()) + ((K + V,) if K + V == 4 * BV else ())


def recurrence_widths(K, V, block_v, out_dtype):
    """State columns per CTA the recurrence takes: 64; where ``block_v`` is 64, V a multiple of 128
    and the outputs 16-bit, also 128 (two warpgroups of 64 sharing W, kd^T, qg, Aqk and the decay:
    209 KB of shared memory at K = 128)."""
    wide = block_v == BV and V % (2 * BV) == 0 and jnp.dtype(out_dtype).itemsize == 2
    return (BV, 2 * BV) if wide else (BV,)


def check_block_v(block_v):
    """State columns per warpgroup: 32 (two warpgroups per CTA) or 64 (one)."""
    if block_v not in (32, 64):
        raise ValueError(f"block_v must be 32 or 64 for the Mosaic GPU recurrence, got {block_v}")


def _products(w, kdT, u, s_smem, vn_smem, qa, ws_acc, kv_acc, o_acc):
    """One chunk's products on the tensor cores: ``W S`` and ``qg S`` (both need only the state),
    ``V_new = U - W S`` to shared memory, then ``kd^T V_new`` and ``Aqk V_new``. Each wait leaves
    the output product in flight, so it overlaps the CUDA-core work of the state's chain (faster
    than issuing the outputs' products after ``kd^T V_new`` and awaiting all three; the same
    bits). Returns ``kd^T V_new`` and the outputs."""
    plgpu.wgmma(ws_acc, w, s_smem)
    plgpu.wgmma(o_acc, qa[0], s_smem)
    ws = plgpu.wgmma_accumulator_load(ws_acc, wait_n=1)
    vn_smem[...] = (u.astype(_F32) - ws).astype(_BF16)
    plgpu.commit_smem()
    plgpu.wgmma(kv_acc, kdT, vn_smem)
    plgpu.wgmma(o_acc, qa[1], vn_smem)
    kv = plgpu.wgmma_accumulator_load(kv_acc, wait_n=1)
    return kv, plgpu.wgmma_accumulator_load(o_acc)


def _summary_products(w, kdT, u, u_scale, s_smem, vn_smem, dS, in_place):
    """A summary chunk: ``V_new = u_scale U - W S`` to shared memory, then the next state
    ``dS + kd^T V_new`` (``dS = decay S``). ``in_place``: the product accumulates onto ``dS`` in
    its registers (``pl.run_state``, which the Mosaic GPU interpreter does not run), one
    ``[K, 64]`` accumulator fewer than a separate product and sum."""

    def v_new(ws_acc):
        plgpu.wgmma(ws_acc, w, s_smem)
        ws = plgpu.wgmma_accumulator_load(ws_acc)
        vn_smem[...] = (u_scale * u.astype(_F32) - ws).astype(_BF16)
        plgpu.commit_smem()

    pl.run_scoped(v_new, plgpu.ACC(vn_smem.shape, _F32))
    if in_place:
        return pl.run_state(lambda acc: plgpu.wgmma(acc, kdT, vn_smem))(plgpu.ACC.init(dS))

    def kv(kv_acc):
        plgpu.wgmma(kv_acc, kdT, vn_smem)
        return plgpu.wgmma_accumulator_load(kv_acc)

    return dS + pl.run_scoped(kv, plgpu.ACC(dS.shape, _F32))


def _kernel(bounds_ref, ck_ref, kdT_ref, w_ref, u_ref, decay_ref, init_ref, qg_ref, aqk_ref, *outs, summary: bool,
            e_init: bool, wgs: int, cols: int, slots: int, in_place: bool):
    s, h, j = lax.axis_index("s"), lax.axis_index("h"), lax.axis_index("j")
    wg = lax.axis_index("wg")
    HV, TT, K = w_ref.shape
    C, V = aqk_ref.shape[-1], u_ref.shape[-1]
    BW = cols // wgs  # this warpgroup's columns: [j * cols + wg * BW, + BW)
    # Offsets as multiples of their tiles, for the layout inference of the TMA copies.
    span = lambda start, size: pl.ds(pl.multiple_of(start, size), size)
    rows_of = lambda c: span(c * C, C)
    mine = span(j * cols + wg * BW, BW)
    lo, hi = bounds_ref[s, 0], bounds_ref[s, 1]
    wgmma_layout = plgpu.Layout.WGMMA
    # The warpgroups that read U: all, but at all K + V columns per CTA only those of the E columns.
    n_u = wgs if cols < K + V else V // BW
    # The warpgroup's U buffer (the M warpgroups read the first one, times 0).
    u_wg = jnp.maximum(wg - (wgs - n_u), 0)
    copies_u = wg >= wgs - n_u
    # Who refills a slot waits for every warpgroup's release of it: warpgroup 0 (the shared
    # inputs) and, where the M warpgroups read the E warpgroups' U buffers, those.
    waits_for_release = (wg == 0) | (copies_u & (n_u < wgs))
    if summary:
        (final_ref,) = outs
        col0 = j * cols + wg * BW  # the warpgroup's first column of [M | E]
        is_m = col0 < K
        ucols = span(jnp.maximum(col0 - K, 0), BW)
        # The CTA runs if any of its columns are wanted (its warpgroups share one loop): at K + V
        # columns per CTA a segment's M columns are computed whenever its E columns are.
        wanted = ((j * cols < K) & (ck_ref[s, 1] > 0)) | (((j + 1) * cols > K) & (ck_ref[s, 2] > 0))
        hi = jnp.where(wanted, hi, lo)
        u_scale = jnp.where(is_m, 0.0, 1.0).astype(_F32)  # U = 0 in the M columns
    else:
        o_ref, final_ref, ckpt_ref = outs
        ucols = mine
    # Per chunk, shared by the CTA's warpgroups: (source in GMEM, SMEM buffer shape, dtype,
    # swizzled for WGMMA). Each warpgroup of E columns also copies its own U columns (n_u of them).
    shared = [
        (lambda c: w_ref.at[h, rows_of(c)], (C, K), _BF16, True),
        (lambda c: kdT_ref.at[h, c], (K, C), _BF16, True),
        (lambda c: decay_ref.at[h, c], (K,), _F32, False),
    ]
    if not summary:
        shared += [
            (lambda c: qg_ref.at[h, rows_of(c)], (C, K), _BF16, True),
            (lambda c: aqk_ref.at[h, rows_of(c)], (C, C), _BF16, True),
        ]
    # Swizzled buffers take the swizzle of a row of the warpgroup's columns in their dtype: every
    # bf16 operand the same (64 bytes at 32 columns, 128 at 64).
    smem = lambda shape, dtype, swizzled=True: plgpu.SMEM(
        shape, dtype, transforms=swizzled_transforms(dtype, BW) if swizzled else ())
    # Each warpgroup's operand tiles: the state and V_new in bf16 (and its output tile).
    tiles = (smem((wgs, K, BW), _BF16), smem((wgs, C, BW), _BF16)) + (
        () if summary else (smem((wgs, C, BW), o_ref.dtype),))
    # The f32 state's staging buffer (initial, final states and checkpoints through TMA). The
    # summary pass stages states only before and after its loop, so there it has scopes of its own
    # and its shared memory is free for the loop's buffers; the recurrence's staging shares the
    # tiles' memory (a ``RefUnion``), used between CTA-wide syncs (``synced``).
    staging = (smem((wgs, K, BW), _F32, False), plgpu.Barrier(num_barriers=wgs))
    scratch = dict(
        tiles=tiles if summary else plgpu.RefUnion(tiles, staging[0]),
        bufs=[smem((slots, *shape), dtype, sw) for _, shape, dtype, sw in shared],
        u_bufs=smem((slots, n_u, C, BW), _BF16),
        ready=plgpu.Barrier(num_arrivals=len(shared) + n_u, num_barriers=slots),
        consumed=plgpu.Barrier(num_arrivals=wgs, num_barriers=slots),
    )
    if not summary:
        scratch.update(st_ready=staging[1], synced=plgpu.Barrier(num_arrivals=wgs))

    def load_state(st_all, st_ready, src):
        plgpu.copy_gmem_to_smem(src, st_all.at[wg], st_ready.at[wg])
        plgpu.barrier_wait(st_ready.at[wg])
        return plgpu.load(st_all.at[wg], layout=wgmma_layout)

    def store_state(st_all, S, dst, sync=lambda: None):
        """``S`` to ``dst`` through the staging buffer; ``sync`` where the staging shares memory
        with the other warpgroups' tiles: after this warpgroup's earlier stores have read theirs."""
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        sync()
        st_all.at[wg][...] = S
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(st_all.at[wg], dst)

    def run(S, tiles, bufs, u_bufs, ready, consumed, checkpoint=None):
        """The chunk loop from the state ``S``; returns the final state. ``checkpoint(S, dst)``
        stores a checkpoint (not in summary mode)."""
        s_smem, vn_smem = tiles[0].at[wg], tiles[1].at[wg]

        def issue(c, slot):
            """Chunk c's inputs into ``slot``: the shared ones by warpgroup 0 once every warpgroup
            has released the chunk that used the slot before, U by each warpgroup that reads it."""

            released = lambda: pl.when(c - slots >= lo)(lambda: plgpu.barrier_wait(consumed.at[slot]))

            @pl.when(wg == 0)
            def _():
                released()
                for (src, *_), buf in zip(shared, bufs):
                    plgpu.copy_gmem_to_smem(src(c), buf.at[slot], ready.at[slot])

            def copy_u():
                if n_u < wgs:  # the M warpgroups read this buffer too
                    released()
                plgpu.copy_gmem_to_smem(u_ref.at[h, rows_of(c), ucols], u_bufs.at[slot, u_wg], ready.at[slot])

            if n_u == wgs:
                copy_u()
            else:
                pl.when(copies_u)(copy_u)

        for ahead in range(slots - 1):
            @pl.when(lo + ahead < hi)
            def _():
                issue(lo + ahead, ahead)

        def chunk(c, S):
            slot = lax.rem(c - lo, slots)

            @pl.when(c + slots - 1 < hi)
            def _():
                issue(c + slots - 1, lax.rem(c + slots - 1 - lo, slots))

            plgpu.barrier_wait(ready.at[slot])
            w, kdT, decay, *qa = (buf.at[slot] for buf in bufs)
            s_smem[...] = S.astype(_BF16)
            u = plgpu.load(u_bufs.at[slot, u_wg], layout=wgmma_layout)
            d = plgpu.load(decay, layout=wgmma_layout.reduce(1))
            # The fence orders the store above before the tensor cores read it, and the reads of U
            # before the TMA writes the next chunk issues into this slot.
            plgpu.commit_smem()
            dS = lax.broadcast_in_dim(d, (K, BW), [0]) * S
            if summary:
                S = _summary_products(w, kdT, u, u_scale, s_smem, vn_smem, dS, in_place)
                plgpu.barrier_arrive(consumed.at[slot])  # done with the slot's shared inputs
                return S
            kv, o = pl.run_scoped(
                functools.partial(_products, w, kdT, u, s_smem, vn_smem, qa),
                plgpu.ACC((C, BW), _F32), plgpu.ACC((K, BW), _F32), plgpu.ACC((C, BW), _F32))
            plgpu.barrier_arrive(consumed.at[slot])  # done with the slot's shared inputs
            S = dS + kv
            o_smem = tiles[2].at[wg]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[...] = o.astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[rows_of(c), h, mine])
            slot_ck = ck_ref[c]

            pl.when(slot_ck >= 0)(lambda: checkpoint(S, ckpt_ref.at[slot_ck, h, :, mine]))

            return S

        S = lax.fori_loop(lo, hi, chunk, S)

        @pl.when(waits_for_release)
        def _():  # observe the last chunks' releases as well: no barrier is left mid-phase
            for back in range(slots, 0, -1):
                @pl.when(hi - back >= lo)
                def _():
                    plgpu.barrier_wait(consumed.at[lax.rem(hi - back - lo, slots)])

        return S

    def finish(st_all, S, sync=lambda: None):
        store_state(st_all, S, final_ref.at[s, h, :, mine], sync)
        plgpu.wait_smem_to_gmem(0)

    if summary:
        rows = plgpu.broadcasted_iota(jnp.int32, (K, BW), 0, layout=wgmma_layout)
        cidx = plgpu.broadcasted_iota(jnp.int32, (K, BW), 1, layout=wgmma_layout)
        # [I | 0]: the diagonal of the M columns (pushed past the tile in the E columns).
        S0 = (rows == cidx + col0 + jnp.where(is_m, 0, 2 * K)).astype(_F32)
        if e_init:  # the E columns of a segment whose start is known begin at that state
            src = ck_ref[s, 0]
            start = pl.run_scoped(lambda st_all, st_ready: load_state(
                st_all, st_ready, init_ref.at[jnp.maximum(src, 0), h, :, ucols]), *staging, collective_axes="wg")
            # A blend, not a select: Mosaic GPU does not broadcast a scalar predicate.
            keep = (is_m | (src < 0)).astype(_F32)
            S0 = keep * S0 + (1.0 - keep) * start
        S = pl.run_scoped(functools.partial(run, S0), *scratch.values(), collective_axes="wg")
        pl.run_scoped(lambda st_all, st_ready: finish(st_all, S), *staging, collective_axes="wg")
    else:
        def whole(union, bufs, u_bufs, ready, consumed, st_ready, synced):
            tiles, st_all = union

            def sync():  # every warpgroup of the CTA gets here
                if wgs > 1:
                    plgpu.barrier_arrive(synced)
                    plgpu.barrier_wait(synced)

            def checkpoint(S, dst):
                store_state(st_all, S, dst, sync)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                sync()  # every staging buffer is read before the next chunk writes the tiles

            S = load_state(st_all, st_ready, init_ref.at[s, h, :, mine])
            sync()
            S = run(S, tiles, bufs, u_bufs, ready, consumed, checkpoint=checkpoint)
            finish(st_all, S, sync)

        pl.run_scoped(whole, *scratch.values(), collective_axes="wg")


def scan_call(prep, init, vstart, vend, ck_slot, *, n_ck_slots, summary=False, out_dtype=None,
              block_v=DEFAULT_BLOCK_V, cta_cols=BV, interpret=False):
    """Stage 2 on Mosaic GPU; arguments and results as :func:`pallas_kernels.kda.recurrence_triton.scan_call`
    (``prep`` must hold bfloat16 intermediates, see :func:`supported`). ``block_v``: state columns
    per warpgroup, 64 (one warpgroup per CTA) or 32 (two sharing the CTA's inputs). ``cta_cols``:
    state columns per CTA, 64, or 128 (:func:`recurrence_widths`), in summary mode 128 or ``K + V``
    (:func:`summary_widths`).
    ``interpret``: True or a ``plgpu.InterpretGPUParams`` runs the kernel in the Mosaic GPU
    interpreter (on CPU)."""
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    qg, kdT, W, U, Aqk, decay = prep
    HV, TT, K = W.shape
    V, C = U.shape[-1], Aqk.shape[-1]
    NC = TT // C
    if not supported(K, V, C, W.dtype):
        raise ValueError(f"the Mosaic GPU recurrence takes bf16 intermediates, C = 64, K in (64, 128) and V a "
                         f"multiple of 64; got {W.dtype}, C={C}, K={K}, V={V}")
    check_block_v(block_v)
    widths = summary_widths(K, V, block_v) if summary else recurrence_widths(K, V, block_v, out_dtype)
    if cta_cols not in widths:
        raise ValueError(f"cta_cols is one of {widths} here; got {cta_cols} (block_v {block_v}, summary {summary}, "
                         f"K={K}, V={V}, out_dtype {None if summary else jnp.dtype(out_dtype).name})")
    wgs = cta_cols // block_v
    # Input slots: chunk c + slots - 1's copies are issued before chunk c's work. Three in summary
    # mode at 64 columns (no qg, Aqk: 145 KB of shared memory at K = 128; faster there than two),
    # two otherwise (193 KB; 145 KB for the summary at 128 columns, 193 at 256).
    slots = 3 if summary and cta_cols == BV else 2
    Nv = vstart.shape[0]
    width = K + V if summary else V
    e_init = summary and init is not None
    if summary:
        out_type = jax.ShapeDtypeStruct((Nv, HV, K, width), _F32)
        init = jnp.zeros((1, 1, K, V), _F32) if init is None else init
    else:
        out_type = (jax.ShapeDtypeStruct((TT, HV, V), out_dtype), jax.ShapeDtypeStruct((Nv, HV, K, V), _F32),
                    jax.ShapeDtypeStruct((n_ck_slots, HV, K, V), _F32))
    bounds = jnp.stack([vstart, vend], axis=-1).astype(jnp.int32)
    kernel = plgpu.kernel(
        functools.partial(_kernel, summary=summary, e_init=e_init, wgs=wgs, cols=cta_cols, slots=slots,
                          in_place=not interpret),
        out_type=out_type,
        grid=(Nv, HV, width // cta_cols),
        grid_names=("s", "h", "j"),
        num_threads=wgs,
        thread_name="wg",
        kernel_name="kda_summary" if summary else "kda_recurrence",  # the names profiles show
        interpret=interpret,
    )
    return kernel(bounds, ck_slot.astype(jnp.int32), kdT, W, U, decay.reshape(HV, NC, K), init.astype(_F32), qg, Aqk)
