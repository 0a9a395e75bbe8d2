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

from pallas_kernels.kda._window import Mode, apply_delta, delta_rule, readout, split_refs
from pallas_kernels.kda.gpu_common import gpu_core_count, gpu_programs

_F32 = jnp.float32


def _kernel(slots_ref, n_ref, *refs, mode: Mode, T: int, rep: int, scale: float, num_slots: int, BV: int,
            prefetch: bool):
    (prev_refs, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref, o_ref, d_ref, snap_ref, pool_out_ref), _ = (
        split_refs(refs, mode))

    b, h = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.program_id(2) * BV, BV)
    hq = h // rep
    slot = slots_ref[b]
    valid = (slot >= 0) & (slot < num_slots)
    n = n_ref[b]

    def load(refs, t):
        """Position t's inputs: k, g as columns [K, 1], v (or the delta u) as a row [1, BV], beta [1, 1]."""
        k_ref, v_ref, g_ref, *beta_ref = refs
        return (k_ref[b, t, hq].astype(_F32), v_ref[b, t, h, :, cols].astype(_F32), g_ref[b, t, h].astype(_F32),
                *(r[b, t, h].astype(_F32) for r in beta_ref))

    def replay(S, refs):
        """The row's first n positions only: a loop of n steps (not T masked ones)."""
        step = apply_delta if mode.deltas_in else lambda S, *x: delta_rule(S, *x)[0]
        return jax.lax.fori_loop(0, n, lambda t, S: step(S, *load(refs, t)), S)

    window = tuple(r for r in (k_ref, v_ref, g_ref, beta_ref) if r is not None)  # no beta: replayed from deltas

    @pl.when(valid)
    def _():
        S = pool_ref[slot, h, :, cols]
        if mode.replay_first:
            S = replay(S, prev_refs)
            pool_out_ref[slot, h, :, cols] = S
        if mode.replay_only:
            S = replay(S, window)
        else:
            # prefetch: position t + 1's inputs are loaded before position t's work, so their
            # latency hides behind it (the snapshot verify, whose stores otherwise queue ahead).
            # Without it, q is loaded after the update (fewer live registers: faster verify).
            q_at = lambda t: q_ref[b, t, hq].astype(_F32) if mode.readout else None
            inputs = lambda t: (load(window, t), q_at(t))
            ahead = inputs(0) if prefetch else None
            for t in range(T):
                if prefetch:
                    (x, q), ahead = ahead, (inputs(t + 1) if t + 1 < T else None)
                    S, u = delta_rule(S, *x)
                else:
                    S, u = delta_rule(S, *load(window, t))
                    q = q_at(t)
                if mode.deltas_out:
                    d_ref[b, t, h, :, cols] = u
                if mode.readout:
                    o_ref[b, t, h, :, cols] = readout(S, q, scale).astype(o_ref.dtype)
                if mode.snapshot:
                    snap_ref[b, t, h, :, cols] = S
        if mode.writes_at_end:
            pool_out_ref[slot, h, :, cols] = S

    @pl.when(jnp.logical_not(valid))
    def _():
        for t in range(T):
            for ref in (o_ref, d_ref, snap_ref):
                if ref is not None:
                    ref[b, t, h, :, cols] = jnp.zeros((ref.shape[-2], BV), ref.dtype)


def default_block_v(mode: Mode, B, HV, V):
    """Value columns per program. On the H200 at T = 8 (device time, docs/benchmarks.md):
    the verify takes 128 once ``B x HV`` programs of 128 columns fill the SMs (701 against
    801 us at H = 32, B = 256; 96 against 107 at B = 32; 13 against 11 at B = 1), and so do the
    kernels that replay given deltas (commit 317 against 335 us, fused commit + verify 969
    against 1002 at H = 32, B = 256); the snapshot verify (prefetching) takes 128 from there up
    to 32 programs per SM (813 against 926 us at H = 32, B = 128, but 1621 against 1445 at
    B = 256); the commit and the fused commit + verify that recompute the deltas take 64
    (412 / 1108 against 432 / 1470 us at H = 32, B = 256)."""
    per_sm = _programs_per_sm(B, HV, V)
    if mode.snapshot:
        return 128 if 1 <= per_sm <= 32 else 64
    if _is_verify(mode) or mode.deltas_in:
        return 128 if per_sm >= 1 else 64
    return 64


def default_prefetch(mode: Mode, B, HV, V):
    """Whether to load each position's inputs one position ahead. On the H200 at T = 8 (device
    time): the snapshot verify gains (64 columns: 1445 against 1675 us at H = 32, B = 256; 4425
    against 5885 at H = 96); the verify gains while its programs do not fill the SMs (8.7
    against 10.8 us at H = 32, B = 1) and loses once they do (108 against 95 us at B = 32);
    the commit and the fused commit + verify lose (448 / 1148 against 406 / 1132 us at H = 32,
    B = 256: more registers; with given deltas 1277 against 969)."""
    if mode.snapshot:
        return True
    if _is_verify(mode) or (mode.deltas_in and mode.readout):
        return _programs_per_sm(B, HV, V) < 1
    return False


def _is_verify(mode: Mode):
    """A verify without snapshots (outputs, optionally deltas; no state written)."""
    return mode.readout and not mode.write_state and not mode.snapshot


def _programs_per_sm(B, HV, V):
    """Programs of 128 value columns per SM: what both tiling rules are stated in."""
    return gpu_programs(B, HV, V, 128) / gpu_core_count()


def window_call(
    pool, slot_ids, num_accepted, q, k, v, g, beta, *, mode: Mode, scale, interpret=False, prev=None, block_v=None,
    num_warps=8, prefetch=None,
):
    """Same contract as :func:`pallas_kernels.kda.decode_tpu.window_call`; ``block_v`` columns per
    program (None: :func:`default_block_v`); ``prefetch`` (None: :func:`default_prefetch`) loads
    each position's inputs before the previous position's work (windows of fixed length)."""
    num_slots, HV, K, V = pool.shape
    B, T, H, _ = k.shape
    BV = min(block_v or default_block_v(mode, B, HV, V), V)
    if V % BV:
        raise ValueError(f"V={V} must be a multiple of block_v={BV}")
    col = lambda x: x[..., None]  # [B, T, heads, K, 1]
    row = lambda x: x[..., None, :]  # [B, T, HV, 1, V]
    # A window: (k, v, g, beta), or (k, u, g) when it is replayed from given deltas u.
    window = lambda k, v, g, beta=None: [col(k), row(v), col(g)] + ([] if beta is None else [beta[..., None, None]])
    inputs = (window(*prev) if mode.replay_first else []) + ([col(q)] if mode.readout else []) + window(k, v, g, beta) + [pool]
    out_dtype = v.dtype if jnp.issubdtype(v.dtype, jnp.floating) else _F32
    rows_out = lambda dtype: jax.ShapeDtypeStruct((B, T, HV, 1, V), dtype)
    out_shape = ([rows_out(out_dtype)] if mode.readout else []) + ([rows_out(_F32)] if mode.deltas_out else [])
    if mode.snapshot:
        out_shape.append(jax.ShapeDtypeStruct((B, T, HV, K, V), _F32))
    aliases = {}
    if mode.write_state:
        out_shape.append(jax.ShapeDtypeStruct(pool.shape, pool.dtype))
        aliases = {2 + len(inputs) - 1: len(out_shape) - 1}
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
    kernel = functools.partial(_kernel, mode=mode, T=T, rep=HV // H, scale=scale, num_slots=num_slots, BV=BV,
                               prefetch=default_prefetch(mode, B, HV, V) if prefetch is None else prefetch)
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
    deltas = outs.pop(0)[..., 0, :] if mode.deltas_out else None
    snaps = outs.pop(0) if mode.snapshot else None
    return o, deltas, snaps, (outs.pop(0) if mode.write_state else pool)
