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

from pallas_kernels.kda._window import Mode, apply_delta, delta_rule, readout, split_refs

_F32 = jnp.float32


def _load_window(k_ref, v_ref, g_ref, beta_ref=None):
    """A window's inputs in VMEM: K-indexed ones transposed to columns ``[K, Tp]``; ``v_ref`` holds
    the deltas and ``beta_ref`` is None for a window replayed from deltas."""
    w = (k_ref[0, 0].astype(_F32).T, v_ref[0, 0].astype(_F32), g_ref[0, 0].astype(_F32).T)
    return w if beta_ref is None else (*w, beta_ref[0, 0].astype(_F32))


def _step(S, w, t):
    """Position t: the delta rule, or (a window of deltas) the given correction. Returns (S, u)."""
    kT, v, gT, *beta = w
    x = (kT[:, t : t + 1], v[t : t + 1, :], gT[:, t : t + 1])
    return delta_rule(S, *x, beta[0][:, t : t + 1]) if beta else (apply_delta(S, *x), x[1])


def _kernel(slots_ref, n_ref, *refs, mode: Mode, T: int, T_prev: int, scale: float, num_slots: int):
    (prev_refs, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_hbm, o_ref, d_ref, snap_ref, pool_out_hbm), scratch = (
        split_refs(refs, mode))
    s_vmem, sem = scratch

    b, h = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[b]
    valid = (slot >= 0) & (slot < num_slots)
    n = n_ref[b]
    copy_out = pltpu.make_async_copy(s_vmem, pool_out_hbm.at[slot, h], sem.at[1]) if mode.write_state else None

    @pl.when(valid)
    def _():
        copy_in = pltpu.make_async_copy(pool_hbm.at[slot, h], s_vmem, sem.at[0])
        copy_in.start()
        w = _load_window(k_ref, v_ref, g_ref, beta_ref)
        qT = q_ref[0, 0].astype(_F32).T if mode.readout else None
        prev = _load_window(*prev_refs) if mode.replay_first else None
        copy_in.wait()

        def replay(window, steps):
            """The row's first n positions only: each step runs under a branch on ``t < n`` and keeps
            the state in VMEM (tiles are sliced by static t, so the loop is unrolled)."""
            for t in range(steps):
                @pl.when(t < n)
                def _(t=t):
                    s_vmem[...] = _step(s_vmem[...], window, t)[0]

        if mode.replay_first:
            replay(prev, T_prev)
            copy_out.start()  # overlaps the verify loop below
        if mode.replay_only:
            replay(w, T)
        else:
            S = s_vmem[...]
            for t in range(T):
                S, u = _step(S, w, t)
                if mode.deltas_out:
                    d_ref[0, 0, t : t + 1, :] = u
                if mode.readout:
                    o_ref[0, 0, t : t + 1, :] = readout(S, qT[:, t : t + 1], scale).astype(o_ref.dtype)
                if mode.snapshot:
                    snap_ref[0, t, 0] = S
            if mode.writes_at_end:
                s_vmem[...] = S
        if mode.writes_at_end:
            copy_out.start()
        if mode.write_state:
            copy_out.wait()

    @pl.when(jnp.logical_not(valid))
    def _():
        for ref in (o_ref, d_ref, snap_ref):
            if ref is not None:
                ref[...] = jnp.zeros(ref.shape, ref.dtype)


def window_call(pool, slot_ids, num_accepted, q, k, v, g, beta, *, mode: Mode, scale, interpret=False, prev=None):
    """Run one window kernel; inputs in the public layouts (``q, k [B, T, H, K]`` ...).

    ``prev``: the previous window's ``(k, v, g, beta)`` for ``mode.replay_first``; with
    ``mode.deltas_in`` a replayed window is ``(k, deltas, g)`` (``v`` = deltas, ``beta`` = None).
    Returns ``(o [B, T, HV, V] or None, deltas f32[B, T, HV, V] or None, snapshots
    f32[B, T, HV, K, V] or None, pool)``.
    """
    num_slots, HV, K, V = pool.shape
    B, T, H, _ = k.shape
    rep = HV // H
    Tp = -(-T // 8) * 8

    def window(k, v, g, beta=None):
        """Specs and operands of one window: heads first, T padded to a multiple of 8."""
        T = k.shape[1]
        Tp = -(-T // 8) * 8
        pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
        heads_first = lambda x: jnp.swapaxes(pad(x), 1, 2)  # [B, heads, Tp, *]
        specs = [qk_spec(Tp), hv_spec(Tp, V), hv_spec(Tp, K)]
        operands = [heads_first(k), heads_first(v), heads_first(g)]
        if beta is None:
            return specs, operands
        return specs + [hv_spec(1, Tp)], operands + [jnp.swapaxes(pad(beta), 1, 2)[:, :, None, :]]  # beta [B, HV, 1, Tp]

    qk_spec = lambda Tp: pl.BlockSpec((1, 1, Tp, K), lambda b, h, *_: (b, jax.lax.div(h, rep), 0, 0))
    hv_spec = lambda rows, D: pl.BlockSpec((1, 1, rows, D), lambda b, h, *_: (b, h, 0, 0))
    in_specs, inputs = [], []
    T_prev = 0
    if mode.replay_first:
        T_prev = prev[0].shape[1]
        specs, operands = window(*prev)
        in_specs += specs
        inputs += operands
    if mode.readout:
        in_specs.append(qk_spec(Tp))
        inputs.append(jnp.swapaxes(jnp.pad(q, [(0, 0), (0, Tp - T), (0, 0), (0, 0)]), 1, 2))
    specs, operands = window(k, v, g, beta)
    in_specs += specs + [pl.BlockSpec(memory_space=pl.ANY)]
    inputs += operands + [pool]
    out_specs, out_shape = [], []
    out_dtype = v.dtype if jnp.issubdtype(v.dtype, jnp.floating) else _F32
    for present, dtype in ((mode.readout, out_dtype), (mode.deltas_out, _F32)):
        if present:
            out_specs.append(hv_spec(Tp, V))
            out_shape.append(jax.ShapeDtypeStruct((B, HV, Tp, V), dtype))
    if mode.snapshot:
        out_specs.append(pl.BlockSpec((1, T, 1, K, V), lambda b, h, *_: (b, 0, h, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, T, HV, K, V), _F32))
    aliases = {}
    if mode.write_state:
        out_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        out_shape.append(jax.ShapeDtypeStruct(pool.shape, pool.dtype))
        # Operand indices count the two scalar-prefetch operands first.
        aliases = {2 + len(inputs) - 1: len(out_shape) - 1}

    kernel = functools.partial(_kernel, mode=mode, T=T, T_prev=T_prev, scale=scale, num_slots=num_slots)
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
    rows = lambda x: jnp.swapaxes(x, 1, 2)[:, :T]
    o = rows(outs.pop(0)) if mode.readout else None
    deltas = rows(outs.pop(0)) if mode.deltas_out else None
    snaps = outs.pop(0) if mode.snapshot else None
    return o, deltas, snaps, (outs.pop(0) if mode.write_state else pool)
