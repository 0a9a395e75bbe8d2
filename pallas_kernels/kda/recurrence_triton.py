"""The recurrent stage in Triton (Pallas Triton lowering; README.md says why not Mosaic GPU
everywhere), and the fold of the segments' maps.

:func:`scan_call` has grid ``(virtual sequences, HV, column blocks)``: each program keeps
``f32[K, BV]`` of one state in registers and loops over its virtual sequence's chunks
(``vstart[s] <= c < vend[s]``) doing ``V_new = U - W S``, the chunk's outputs
``qg S + Aqk V_new`` and ``S' = decay S + kd^T V_new``. A virtual sequence is a whole sequence
or, for segment-parallel prefill, one segment of it. Refs are whole arrays indexed in the kernel.
The outputs are formed in the loop: the two output products are off the state's dependency
chain, and no per-chunk state or ``V_new`` goes through memory (a separate all-parallel output
kernel was slower).

``summary=True`` computes each virtual sequence's affine map ``S -> M S + E`` instead of
outputs: the recurrence is independent across state columns, so running it on ``K + V``
columns that start as ``[I | 0]``, with U replaced by 0 in the first K, gives ``[M | E]``.
Started from ``[I | S_in]`` the E columns give ``M S_in + E`` directly (a sequence's first
segment, whose start is known), and column blocks whose results nobody reads are skipped.
:func:`fold_call` chains the maps into every segment's starting state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.common import GPU_PRECISION, HIGHEST, dot_f32
from pallas_kernels.kda.gpu_common import triton_params

_F32 = jnp.float32


def _scan_kernel(vstart_ref, vend_ref, ck_ref, kdT_ref, w_ref, u_ref, decay_ref, init_ref, qg_ref, aqk_ref, *outs,
                 BV: int, summary: bool, precision, e_init: bool = False):
    """``ck_ref``: the recurrence's checkpoint slot per chunk; in summary mode, per virtual sequence,
    the row of ``init_ref`` its E columns start from (-1: zero) and whether its M and E columns
    run (1) or keep their start (0)."""
    s, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    K = w_ref.shape[-1]
    C = kdT_ref.shape[-1]
    lo, hi = vstart_ref[s], vend_ref[s]
    cols = pl.ds(j * BV, BV)
    if summary:
        (final_ref,) = outs
        nK = K // BV
        is_m = j < nK
        ucols = pl.ds(jnp.maximum(j - nK, 0) * BV, BV)
        eye = jax.lax.broadcasted_iota(jnp.int32, (K, BV), 0) == jax.lax.broadcasted_iota(jnp.int32, (K, BV), 1) + j * BV
        src = ck_ref[s, 0]
        S0 = jnp.where(is_m & eye, 1.0, 0.0).astype(_F32)
        if e_init:  # static: ``init_ref`` holds states (else a placeholder)
            S0 = jnp.where(is_m | (src < 0), S0, init_ref[jnp.maximum(src, 0), h, :, ucols])
        hi = jnp.where(jnp.where(is_m, ck_ref[s, 1], ck_ref[s, 2]) > 0, hi, lo)
        u_scale = jnp.clip(j - nK + 1, 0, 1).astype(_F32)  # 0 for the M columns
    else:
        o_ref, final_ref, ckpt_ref = outs
        ucols = cols
        S0 = init_ref[s, h, :, ucols]
        u_scale = 1.0

    def body(c, S):
        rows = pl.ds(c * C, C)
        f32 = lambda ref: ref[h, rows, :].astype(_F32)  # the chunk's rows of a [HV, TT, width] input
        v_new = u_scale * u_ref[h, rows, ucols].astype(_F32) - dot_f32(f32(w_ref), S, precision)
        if not summary:
            o = dot_f32(f32(qg_ref), S, precision) + dot_f32(f32(aqk_ref), v_new, precision)
            o_ref[rows, h, cols] = o.astype(o_ref.dtype)
        S = decay_ref[h, c] * S + dot_f32(kdT_ref[h, c].astype(_F32), v_new, precision)
        if not summary:
            slot = ck_ref[c]

            @pl.when(slot >= 0)
            def _():
                ckpt_ref[slot, h, :, cols] = S

        return S

    final_ref[s, h, :, cols] = jax.lax.fori_loop(lo, hi, body, S0)


def scan_call(prep, init, vstart, vend, ck_slot, *, n_ck_slots, summary=False, out_dtype=None, block_v=64,
              num_warps=4, num_stages=1, precision=GPU_PRECISION, interpret=False):
    """Stage 2: the state recurrence with every chunk's outputs (four matmuls per chunk, two of
    them on the state's dependency chain).

    ``prep`` is stage 1's output; ``init f32[Nv, HV, K, V]``. When ``summary``: ``ck_slot`` is
    ``int32[Nv, 3]``, per virtual sequence the row of ``init`` (``f32[N, HV, K, V]``, or None)
    its E columns start from (-1: zero, the map's own E), and whether its M and its E columns
    run (1) or return their start (0: I for M).
    Returns ``(o [TT, HV, V] in out_dtype, final f32[Nv, HV, K, V], ckpts f32[n_ck_slots, HV, K, V])``:
    the outputs, each virtual sequence's final state, and checkpoint slot ``ck_slot[c]`` written
    after chunk ``c`` when ``>= 0`` (others untouched, so unwritten slots hold garbage); or
    ``f32[Nv, HV, K, K + V]`` (``[M | E]``) when ``summary``. The recurrence runs in float32.
    ``num_stages`` applies up to K = 128; wider keys run one stage (three asked for 560 KB of
    shared memory at K = V = 256 in float32 on the H200, which has 227 KB).
    """
    qg, kdT, W, U, Aqk, decay = prep
    HV, TT, K = W.shape
    V = U.shape[-1]
    Nv = vstart.shape[0]
    BV = min(block_v, V, K)
    if V % BV or K % BV:
        raise ValueError(f"K={K} and V={V} must be multiples of block_v={BV}")
    width = K + V if summary else V
    e_init = summary and init is not None
    if summary:
        out_shape = [jax.ShapeDtypeStruct((Nv, HV, K, width), _F32)]
        init = jnp.zeros((1, 1, 1, 1), _F32) if init is None else init
    else:
        out_shape = [jax.ShapeDtypeStruct((TT, HV, V), out_dtype), jax.ShapeDtypeStruct((Nv, HV, K, V), _F32),
                     jax.ShapeDtypeStruct((n_ck_slots, HV, K, V), _F32)]
    outs = pl.pallas_call(
        functools.partial(_scan_kernel, BV=BV, summary=summary, precision=HIGHEST if interpret else precision, e_init=e_init),
        grid=(Nv, HV, width // BV),
        out_shape=out_shape,
        compiler_params=None if interpret else triton_params(num_warps, num_stages if K <= 128 else 1),
        interpret=interpret,
    )(vstart, vend, ck_slot, kdT, W, U, decay, init, qg, Aqk)
    return outs[0] if summary else tuple(outs)


def _fold_kernel(me_ref, init_ref, out_ref, *, P: int, BV: int, KB: int, precision):
    n, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    K = me_ref.shape[2]
    nb = K // KB
    cols, ecols = pl.ds(j * BV, BV), pl.ds(K + j * BV, BV)
    rows = [pl.ds(i * KB, KB) for i in range(nb)]
    out_ref[n * P, h, :, cols] = init_ref[n, h, :, cols]
    # The state as nb row blocks (values cannot be sliced): S_i = sum_m M_im S_m + E_i.
    first = tuple(me_ref[n * P, h, r, ecols] for r in rows)

    def store(p, S):
        for r, x in zip(rows, S):
            out_ref[n * P + p, h, r, cols] = x

    def load(p):  # segment p's map, loaded a step ahead of its product
        seg = n * P + p
        M = tuple(tuple(me_ref[seg, h, ri, rm] for rm in rows) for ri in rows)
        return M, tuple(me_ref[seg, h, r, ecols] for r in rows)

    def step(p, carry):
        S, (M, E) = carry
        ahead = load(jnp.minimum(p + 1, P - 2))
        S = tuple(sum(dot_f32(m, x, precision) for m, x in zip(Mi, S)) + Ei for Mi, Ei in zip(M, E))
        store(p + 1, S)
        return S, ahead

    store(1, first)
    if P > 2:
        jax.lax.fori_loop(1, P - 1, step, (first, load(1)))


def fold_call(ME, init, *, P: int, block_v=16, block_k=128, num_warps=8, num_stages=1, precision=GPU_PRECISION,
              interpret=False):
    """Every segment's starting state from the summary pass's maps, one kernel: ``ME [N * P, HV,
    K, K + V]`` (``[M_p | E_p]`` per sequence and segment, the first segment's E columns already
    run from its start, its M and the last segment's map never read), ``init f32[N, HV, K, V]``.
    Returns ``f32[N * P, HV, K, V]``: ``init``, ``E_0``, then ``S_{p+1} = M_p S_p + E_p``. One
    program per ``(sequence, head, block_v columns)`` keeps its columns of the state in registers
    (as ``K / block_k`` row blocks) through the ``P - 2`` products, TF32x3 (float32-accurate, as
    KDA.md asks of the M chain), each segment's map loaded a step ahead (the defaults, 16 columns
    on 8 warps, were the fastest timed; docs/benchmarks.md). K = 256 (two row blocks) is tested,
    not timed."""
    NP, HV, K, W = ME.shape
    N, V = init.shape[0], W - K
    if NP != N * P or init.shape != (N, HV, K, V):
        raise ValueError(f"ME {ME.shape} and init {init.shape} do not match P = {P}")
    BV, KB = min(block_v, V), min(block_k, K)
    if V % BV or K % KB:
        raise ValueError(f"V={V} and K={K} must be multiples of block_v={BV} and block_k={KB}")
    return pl.pallas_call(
        functools.partial(_fold_kernel, P=P, BV=BV, KB=KB, precision=HIGHEST if interpret else precision),
        grid=(N, HV, V // BV),
        out_shape=jax.ShapeDtypeStruct((NP, HV, K, V), _F32),
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
        interpret=interpret,
    )(ME, init.astype(_F32))
