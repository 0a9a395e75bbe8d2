"""The prefill kernels on TPU (Mosaic): both stages.

Stage 1, :func:`prep_call` (body :func:`prep_body`), on head-major inputs (``(C, K)`` tiles), one
program per (chunk, value head): G = cumsum(g), Aqk (scaled, causal), Akk (beta, strictly
causal), ``W = T (beta k exp G)``, ``U = T (beta v)`` with ``T = (I + Akk)^-1`` by blocked forward
substitution in float32, ``qg = scale q exp G``, ``kd^T = (k exp(G_C - G))^T`` and
``decay = exp(G_C)`` as a column. Off-diagonal 16 x 16 blocks are matmuls anchored at the first
row of the row sub-chunk (exponents <= 0, no future gate read); diagonal blocks use exact
pairwise differences. Rows are addressed only through static ref slices of 16-row sub-chunks and
picked from values with masked reductions; blocks are placed with 0/1 placement matmuls (exact:
one non-zero per column).

Stage 2, :func:`scan_call`: grid ``(HV, NC)`` with the head axis parallel and the chunk axis
sequential ("arbitrary"); the state ``f32[K, V]`` stays in a VMEM scratch across the chunk axis
and each chunk runs :func:`chunk_step` (``V_new = U - W S; O = qg S + Aqk V_new;
S' = decay S + kd^T V_new``). Per-chunk tables arrive by scalar prefetch: ``first`` (load the
sequence's initial state), ``last`` (write its final state), ``seq`` (which initial/final block)
and ``ck`` (write a checkpoint). The checkpoint output block of a chunk is the next checkpoint its
sequence will write (or its sequence's spare slot), so a block is only written back after the
chunk that fills it.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda.common import HIGHEST, SUB, chunk_decays, dot_f32, dot_nt_f32, fast_exp, iota, pick_row

_F32 = jnp.float32
PREP_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))


def _unit_lower_inverse(D):
    """``(I + D)^-1`` for a strictly lower ``[16, 16]`` tile, column-oriented forward substitution."""
    n = D.shape[0]
    rows, cols = iota((n, n), 0), iota((n, n), 1)

    def step(j, X):
        col = jnp.sum(jnp.where(cols == j, D, 0.0), axis=1, keepdims=True)  # D[:, j]
        return X - col * pick_row(X, j)

    return jax.lax.fori_loop(0, n, step, jnp.where(rows == cols, 1.0, 0.0).astype(_F32))


def _gates(g_ref, k_ref, kdT_ref, decay_ref):
    """The chunk's gate cumsum (a HIGHEST-precision matmul with a triangular ones matrix); writes
    kd^T and decay (:func:`chunk_decays`). Returns float32 ``g, k, G``."""
    C = k_ref.shape[0]
    g = g_ref[...].astype(_F32)
    k = k_ref[...].astype(_F32)
    G = dot_f32(jnp.where(iota((C, C), 1) <= iota((C, C), 0), 1.0, 0.0).astype(_F32), g)
    kdT, decay_ref[...] = chunk_decays(k, G)
    kdT_ref[...] = kdT.astype(kdT_ref.dtype)
    return g, k, G


def prep_body(q_ref, k_ref, v_ref, g_ref, beta_ref, qg_ref, kdT_ref, w_ref, u_ref, aqk_ref, decay_ref, *, scale,
              precision=HIGHEST):
    """Stage 1 on one chunk of one value head. Inputs ``[C, K]``/``[C, V]``, beta ``[C, 1]``.

    Outputs: qg, W ``[C, K]``; U ``[C, V]``; Aqk ``[C, C]``; kd^T ``[K, C]``; decay ``[K, 1]``.
    Loops are ``fori_loop``s (not unrolled) to keep the kernel small to compile. The gate
    cumsum is always a HIGHEST-precision matmul; ``precision`` is for the other matmuls.
    """
    dot = partial(dot_f32, precision=precision)
    C, K = k_ref.shape
    V = v_ref.shape[1]
    g, k, G = _gates(g_ref, k_ref, kdT_ref, decay_ref)
    r16 = iota((SUB, 1), 0)
    lane = iota((1, C), 1)

    def sub_chunk(i, X):
        Xw, Xu = X
        start = i * SUB
        rows = pl.ds(pl.multiple_of(start, SUB), SUB)
        qi = q_ref[rows, :].astype(_F32)
        ki = k_ref[rows, :].astype(_F32)
        bi = beta_ref[rows, :].astype(_F32)
        Gi = dot_f32(jnp.where(iota((SUB, C), 1) <= iota((SUB, C), 0) + start, 1.0, 0.0).astype(_F32), g)
        anchor = pick_row(Gi, 0)
        # Columns of earlier sub-chunks: both factors anchored at this sub-chunk's first row.
        k_anc = k * fast_exp(jnp.where(iota((C, 1), 0) < start, anchor - G, -jnp.inf))
        to_anchor = fast_exp(Gi - anchor)
        Akk_prev = dot_nt_f32(ki * to_anchor, k_anc, precision)  # [16, C], zero from column `start` on

        def diagonal(c, A):  # the diagonal block, exact pairwise decay differences
            Aqk, Akk = A
            t = fast_exp(jnp.where(r16 >= c, Gi - pick_row(Gi, c), -jnp.inf)) * pick_row(ki, c)
            at = lane == start + c
            Aqk = jnp.where(at, jnp.sum(qi * t, axis=1, keepdims=True), Aqk)
            Akk = jnp.where(at & (r16 > c), jnp.sum(ki * t, axis=1, keepdims=True), Akk)
            return Aqk, Akk

        Aqk, Akk = jax.lax.fori_loop(0, SUB, diagonal, (dot_nt_f32(qi * to_anchor, k_anc, precision), Akk_prev))
        aqk_ref[rows, :] = scale * Aqk
        egi = fast_exp(Gi)
        qg_ref[rows, :] = scale * qi * egi
        # Blocked forward substitution: X_i = (I + D_ii)^-1 (R_i - Akk[i, :i] X[:i]).
        place = jnp.where(iota((C, SUB), 0) == iota((C, SUB), 1) + start, 1.0, 0.0).astype(_F32)  # [C, 16]
        Linv = _unit_lower_inverse(dot(bi * Akk, place))
        Akk_prev = bi * Akk_prev
        Xw_i = dot(Linv, bi * ki * egi - dot(Akk_prev, Xw))
        Xu_i = dot(Linv, bi * v_ref[rows, :].astype(_F32) - dot(Akk_prev, Xu))
        w_ref[rows, :] = Xw_i
        u_ref[rows, :] = Xu_i
        return Xw + dot(place, Xw_i), Xu + dot(place, Xu_i)

    jax.lax.fori_loop(0, C // SUB, sub_chunk, (jnp.zeros((C, K), _F32), jnp.zeros((C, V), _F32)))


def prep_call(q, k, v, g, beta, *, C, scale, compiler_params=None, interpret=False):
    """TPU stage 1 (:func:`prep_body`) over every chunk at once: grid ``(NC, HV)``, both axes parallel.

    Inputs are chunk-aligned packed head-major streams (blocks are ``(C, K)`` tiles):
    ``q, k [H, TT, K]``, ``v [HV, TT, V]``, ``g [HV, TT, K]``, ``beta [HV, TT, 1]``; ``TT % C == 0``.
    Returns head-major float32 ``qg, W [HV, TT, K]``, ``U [HV, TT, V]``, ``Aqk [HV, TT, C]``,
    ``kdT [HV, NC, K, C]``, ``decay [HV, NC, K, 1]``.
    """
    (H, TT, K), (HV, _, V) = k.shape, v.shape
    rep = HV // H
    NC = TT // C
    spec = lambda width, qk: pl.BlockSpec((None, C, width), lambda c, h: (h // rep if qk else h, c, 0))
    rows = lambda width: pl.BlockSpec((None, C, width), lambda c, h: (h, c, 0))
    per_chunk = lambda width: pl.BlockSpec((None, None, K, width), lambda c, h: (h, c, 0, 0))
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, _F32)
    return pl.pallas_call(
        partial(prep_body, scale=scale),
        grid=(NC, HV),
        in_specs=[spec(K, True), spec(K, True), spec(V, False), spec(K, False), spec(1, False)],
        out_specs=[rows(K), per_chunk(C), rows(K), rows(V), rows(C), per_chunk(1)],
        out_shape=[f32(HV, TT, K), f32(HV, NC, K, C), f32(HV, TT, K), f32(HV, TT, V), f32(HV, TT, C), f32(HV, NC, K, 1)],
        compiler_params=compiler_params,
        interpret=interpret,
    )(q, k, v, g, beta)


def chunk_step(S, qg, kdT, W, U, Aqk, decay, precision=HIGHEST):
    """One chunk of the recurrence on ``S f32[K, BV]``. Returns ``(o [C, BV], S')``."""
    dot = partial(dot_f32, precision=precision)
    v_new = U - dot(W, S)
    o = dot(qg, S) + dot(Aqk, v_new)
    return o, decay * S + dot(kdT, v_new)


def _scan_kernel(first_ref, last_ref, seq_ref, ck_ref, ckslot_ref, qg_ref, kdT_ref, w_ref, u_ref, aqk_ref, decay_ref,
                 init_ref, o_ref, final_ref, ckpt_ref, S_ref):
    c = pl.program_id(1)

    @pl.when(first_ref[c] == 1)
    def _():
        S_ref[...] = init_ref[...]

    o, S = chunk_step(S_ref[...], qg_ref[...], kdT_ref[...], w_ref[...], u_ref[...], aqk_ref[...], decay_ref[...])
    S_ref[...] = S
    o_ref[...] = o.astype(o_ref.dtype)

    @pl.when(last_ref[c] == 1)
    def _():
        final_ref[...] = S

    @pl.when(ck_ref[c] == 1)
    def _():
        ckpt_ref[...] = S


def scan_call(prep, init, first, last, seq, ck, ckslot, *, n_ck_slots, out_dtype, interpret=False):
    """Stage 2 on one packed stream of whole sequences.

    ``init f32[N, HV, K, V]``; per-chunk i32 tables ``first, last, seq, ck, ckslot [NC]``.
    Returns ``(o [HV, TT, V] out_dtype, final f32[N, HV, K, V], ckpts f32[n_ck_slots, HV, K, V])``;
    final blocks of sequences without chunks and checkpoint slots never written hold garbage.
    """
    qg, kdT, W, U, Aqk, decay = prep
    HV, TT, K = W.shape
    V = U.shape[-1]
    NC, C = kdT.shape[1], kdT.shape[-1]
    N = init.shape[0]
    rows = lambda width: pl.BlockSpec((None, C, width), lambda h, c, *_: (h, c, 0))
    per_chunk = lambda width: pl.BlockSpec((None, None, K, width), lambda h, c, *_: (h, c, 0, 0))
    state = pl.BlockSpec((None, None, K, V), lambda h, c, f, l, s, ck, slot: (s[c], h, 0, 0))
    ck_state = pl.BlockSpec((None, None, K, V), lambda h, c, f, l, s, ck, slot: (slot[c], h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(HV, NC),
        in_specs=[rows(K), per_chunk(C), rows(K), rows(V), rows(C), per_chunk(1), state],
        out_specs=[rows(V), state, ck_state],
        scratch_shapes=[pltpu.VMEM((K, V), _F32)],
    )
    return pl.pallas_call(
        _scan_kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((HV, TT, V), out_dtype),
            jax.ShapeDtypeStruct((N, HV, K, V), _F32),
            jax.ShapeDtypeStruct((n_ck_slots, HV, K, V), _F32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(first, last, seq, ck, ckslot, qg, kdT, W, U, Aqk, decay, init)
