"""TPU (Mosaic) window kernels on a slot pool: decode, verify, commit by replay, snapshot verify.

Grid ``(B, HV)``, both axes parallel. The pool stays in HBM (``pl.ANY``): each grid step DMAs its
slot's ``[K, V]`` state into VMEM and, when the mode writes state, back out, so rows that are
padding (slot out of range) never read or write the pool and unused slots are never touched.
Window inputs arrive as ``(Tp, K)`` / ``(Tp, V)`` blocks (``Tp`` = window rounded up to 8 for
the (8, 128) tiling) and are transposed once in VMEM to get K-indexed columns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda._window import Mode, delta_update, readout

_F32 = jnp.float32


def _kernel(slots_ref, n_ref, *refs, mode: Mode, T: int, scale: float, num_slots: int):
    it = iter(refs)
    q_ref = next(it) if mode.readout else None
    k_ref, v_ref, g_ref, beta_ref, pool_hbm = (next(it) for _ in range(5))
    o_ref = next(it) if mode.readout else None
    snap_ref = next(it) if mode.snapshot else None
    pool_out_hbm = next(it) if mode.write_state else None
    s_vmem, sem = next(it), next(it)

    b, h = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[b]
    valid = (slot >= 0) & (slot < num_slots)
    n = n_ref[b] if mode.per_row_n else T

    @pl.when(valid)
    def _():
        copy_in = pltpu.make_async_copy(pool_hbm.at[slot, h], s_vmem, sem.at[0])
        copy_in.start()
        kT = k_ref[0, 0].astype(_F32).T  # [K, Tp]
        gT = g_ref[0, 0].astype(_F32).T
        qT = q_ref[0, 0].astype(_F32).T if mode.readout else None
        v = v_ref[0, 0].astype(_F32)  # [Tp, V]
        beta = beta_ref[0, 0].astype(_F32)  # [1, Tp]
        copy_in.wait()
        S = s_vmem[...]
        for t in range(T):
            S_next = delta_update(S, kT[:, t : t + 1], v[t : t + 1, :], gT[:, t : t + 1], beta[:, t : t + 1])
            S = jnp.where(t < n, S_next, S) if mode.per_row_n else S_next
            if mode.readout:
                o_ref[0, 0, t : t + 1, :] = readout(S, qT[:, t : t + 1], scale).astype(o_ref.dtype)
            if mode.snapshot:
                snap_ref[0, t, 0] = S
        if mode.write_state:
            s_vmem[...] = S
            copy_out = pltpu.make_async_copy(s_vmem, pool_out_hbm.at[slot, h], sem.at[1])
            copy_out.start()
            copy_out.wait()

    @pl.when(jnp.logical_not(valid))
    def _():
        if mode.readout:
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        if mode.snapshot:
            snap_ref[...] = jnp.zeros(snap_ref.shape, snap_ref.dtype)


def window_call(pool, slot_ids, num_accepted, q, k, v, g, beta, *, mode: Mode, scale, interpret=False):
    """Run one window kernel; inputs in the public layouts (``q, k [B, T, H, K]`` ...).

    Returns ``(o [B, T, HV, V] or None, snapshots f32[B, T, HV, K, V] or None, pool)``.
    """
    num_slots, HV, K, V = pool.shape
    B, T, H, _ = k.shape
    rep = HV // H
    Tp = -(-T // 8) * 8
    pad_t = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
    heads_first = lambda x: jnp.swapaxes(pad_t(x), 1, 2)  # [B, heads, Tp, *]
    beta_t = jnp.swapaxes(pad_t(beta), 1, 2)[:, :, None, :]  # [B, HV, 1, Tp]

    qk_spec = pl.BlockSpec((1, 1, Tp, K), lambda b, h, *_: (b, jax.lax.div(h, rep), 0, 0))
    hv_spec = lambda D: pl.BlockSpec((1, 1, Tp, D), lambda b, h, *_: (b, h, 0, 0))
    in_specs = ([qk_spec] if mode.readout else []) + [
        qk_spec,
        hv_spec(V),
        hv_spec(K),
        pl.BlockSpec((1, 1, 1, Tp), lambda b, h, *_: (b, h, 0, 0)),
        pl.BlockSpec(memory_space=pl.ANY),
    ]
    inputs = ([heads_first(q)] if mode.readout else []) + [
        heads_first(k),
        heads_first(v),
        heads_first(g),
        beta_t,
        pool,
    ]
    out_specs, out_shape = [], []
    out_dtype = v.dtype if jnp.issubdtype(v.dtype, jnp.floating) else _F32
    if mode.readout:
        out_specs.append(hv_spec(V))
        out_shape.append(jax.ShapeDtypeStruct((B, HV, Tp, V), out_dtype))
    if mode.snapshot:
        out_specs.append(pl.BlockSpec((1, T, 1, K, V), lambda b, h, *_: (b, 0, h, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, T, HV, K, V), _F32))
    aliases = {}
    if mode.write_state:
        out_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        out_shape.append(jax.ShapeDtypeStruct(pool.shape, pool.dtype))
        # Operand indices count the two scalar-prefetch operands first.
        aliases = {2 + len(inputs) - 1: len(out_shape) - 1}

    kernel = functools.partial(_kernel, mode=mode, T=T, scale=scale, num_slots=num_slots)
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, HV),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((K, V), _F32), pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
    )(slot_ids, num_accepted, *inputs)
    outs = list(outs)
    o = jnp.swapaxes(outs.pop(0), 1, 2)[:, :T] if mode.readout else None
    snaps = outs.pop(0) if mode.snapshot else None
    return o, snaps, (outs.pop(0) if mode.write_state else pool)
