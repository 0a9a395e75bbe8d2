"""GPU window kernels on a slot pool (Pallas Triton lowering; see README.md for why not Mosaic GPU).

Grid ``(B, HV, V / BV)``: one program per (row, value head, block of BV value columns) holds
``f32[K, BV]`` of the state in registers (the delta rule is independent across value columns,
so the split is exact and gives the GPU more programs at small batch).
Refs are whole arrays indexed with the row's slot id, so padding rows (slot out of range) never
read or write the pool and unused slots are never touched. The wrapper only reshapes (free):
K-indexed inputs get a trailing unit axis (columns), V-indexed ones a unit axis before V (rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda._window import Mode, delta_update, delta_update_vk, pool_dims, readout, readout_vk, split_refs

_F32 = jnp.float32


def _kernel(slots_ref, n_ref, *refs, mode: Mode, T: int, rep: int, scale: float, num_slots: int, BV: int,
            vk: bool):
    (prev_refs, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref, o_ref, snap_ref, pool_out_ref), _ = split_refs(refs, mode)

    b, h = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.program_id(2) * BV, BV)
    hq = h // rep
    slot = slots_ref[b]
    valid = (slot >= 0) & (slot < num_slots)
    n = n_ref[b]

    v_at = (lambda v_ref, t: v_ref[b, t, h, cols, :]) if vk else (lambda v_ref, t: v_ref[b, t, h, :, cols])
    # The program's state tile of a pool or snapshot ref: [K, BV], or [BV, K] when stored transposed.
    tile = (lambda *idx: (*idx, cols, slice(None))) if vk else (lambda *idx: (*idx, slice(None), cols))

    def step(S, refs, t):
        k_ref, v_ref, g_ref, beta_ref = refs
        return (delta_update_vk if vk else delta_update)(
            S,
            k_ref[b, t, hq].astype(_F32),
            v_at(v_ref, t).astype(_F32),
            g_ref[b, t, h].astype(_F32),
            beta_ref[b, t, h].astype(_F32),
        )

    def out(S, t):
        return (readout_vk if vk else readout)(S, q_ref[b, t, hq].astype(_F32), scale)

    def replay(S, refs):
        """The row's first n positions only: a loop of n steps (not T masked ones)."""
        return jax.lax.fori_loop(0, n, lambda t, S: step(S, refs, t), S)

    window = (k_ref, v_ref, g_ref, beta_ref)

    @pl.when(valid)
    def _():
        S = pool_ref[tile(slot, h)]
        if mode.replay_first:
            S = replay(S, prev_refs)
            pool_out_ref[tile(slot, h)] = S
        if mode.replay_only:
            S = replay(S, window)
        else:
            for t in range(T):
                S = step(S, window, t)
                if mode.readout:
                    o_ref[b, t, h, :, cols] = out(S, t).astype(o_ref.dtype)
                if mode.snapshot:
                    snap_ref[tile(b, t, h)] = S
        if mode.writes_at_end:
            pool_out_ref[tile(slot, h)] = S

    @pl.when(jnp.logical_not(valid))
    def _():
        for t in range(T):
            if mode.readout:
                o_ref[b, t, h, :, cols] = jnp.zeros((1, BV), o_ref.dtype)
            if mode.snapshot:
                snap_ref[tile(b, t, h)] = jnp.zeros((BV, snap_ref.shape[-1]) if vk else (snap_ref.shape[-2], BV), _F32)


def window_call(
    pool, slot_ids, num_accepted, q, k, v, g, beta, *, mode: Mode, scale, interpret=False, prev=None, block_v=64,
    num_warps=8, state_layout="kv",
):
    """Same contract as :func:`pallas_kernels.kda.decode_tpu.window_call`; ``block_v`` columns per program.

    ``state_layout``: how the pool (and the snapshots) are stored. "kv": ``f32[num_slots, HV, K, V]``,
    the package's layout; a program's ``[K, BV]`` tile is laid out with lanes along V, so the
    per-token reductions over K cross warps (shared memory and barriers). "vk": transposed,
    ``f32[num_slots, HV, V, K]`` (snapshots ``[B, T, HV, V, K]``); the ``[BV, K]`` tile has lanes
    along K, so at K = 128 a reduction stays inside a warp (PTX of the verify at block_v 64, 8
    warps: 31 barriers and 64 registers against 79 and 99; see docs/benchmarks.md before
    changing the default). Transposing the state in registers instead gives the "kv" code.
    """
    num_slots, HV, K, V = pool_dims(pool.shape, state_layout)
    vk = state_layout == "vk"
    BV = min(block_v, V)
    if V % BV:
        raise ValueError(f"V={V} must be a multiple of block_v={BV}")
    B, T, H, _ = k.shape
    col = lambda x: x[..., None]  # [B, T, heads, K, 1]
    row = lambda x: x[..., None, :]  # [B, T, HV, 1, V]
    if vk:
        col, row = row, col
    window = lambda k, v, g, beta: [col(k), row(v), col(g), beta[..., None, None]]
    inputs = (window(*prev) if mode.replay_first else []) + ([col(q)] if mode.readout else []) + window(k, v, g, beta) + [pool]
    out_dtype = v.dtype if jnp.issubdtype(v.dtype, jnp.floating) else _F32
    out_shape = []
    if mode.readout:
        out_shape.append(jax.ShapeDtypeStruct((B, T, HV, 1, V), out_dtype))
    if mode.snapshot:
        out_shape.append(jax.ShapeDtypeStruct((B, T, HV, V, K) if vk else (B, T, HV, K, V), _F32))
    aliases = {}
    if mode.write_state:
        out_shape.append(jax.ShapeDtypeStruct(pool.shape, pool.dtype))
        aliases = {2 + len(inputs) - 1: len(out_shape) - 1}
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
    kernel = functools.partial(_kernel, mode=mode, T=T, rep=HV // H, scale=scale, num_slots=num_slots, BV=BV,
                               vk=vk)
    outs = pl.pallas_call(
        kernel,
        grid=(B, HV, V // BV),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=compiler_params,
        interpret=interpret,
    )(slot_ids, num_accepted, *inputs)
    outs = list(outs)
    o = outs.pop(0)[..., 0, :] if mode.readout else None
    snaps = outs.pop(0) if mode.snapshot else None
    return o, snaps, (outs.pop(0) if mode.write_state else pool)
