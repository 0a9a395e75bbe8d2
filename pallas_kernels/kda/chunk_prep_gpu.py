"""Kernel bodies of chunked KDA prefill shared by the TPU (Mosaic) and GPU (Triton) kernels.

Both stages are written with operations both lowerings accept: whole-tile elementwise math,
reductions, ``iota`` masks and float32 matmuls (TF32x3 on a GPU, HIGHEST on TPU and in the
interpreters). Rows are addressed only through static ref slices of 16-row sub-chunks;
values are never sliced (the Triton lowering cannot), so rows are picked with masked
reductions and blocks are placed with 0/1 placement matmuls (exact: one non-zero per column).

Stage 1, ``prep_body`` (token-parallel, one program per (chunk, value head)):
  G = cumsum(g), Aqk (scaled, causal), Akk (beta, strictly causal), W = T (beta k exp G),
  U = T (beta v) with T = (I + Akk)^-1 by blocked forward substitution in float32,
  qg = scale q exp G, kd^T = (k exp(G_C - G))^T, decay = exp(G_C) as a column.
  Off-diagonal 16 x 16 blocks are matmuls anchored at the first row of the row sub-chunk
  (exponents <= 0, no future gate read); diagonal blocks use exact pairwise differences.
  The GPU stage 1 (:func:`gpu_prep_call`) computes the same without serial row picks, as
  kernels: per 16-row sub-chunk (:func:`_rows_body`, one warp: anchored 16 x 16 block products,
  diagonal block included while the gate span allows, exact pairwise differences beyond it),
  per chunk the inverse (:func:`_inverse_body`, one warp: the diagonal blocks' inverses, then
  forward substitution over 16 x 16 blocks), then W, U.
Stage 2, ``chunk_step`` (the recurrence, one chunk; the TPU kernel): with S [K, BV] float32,
  V_new = U - W S;  O = qg S + Aqk V_new;  S' = decay * S + kd^T V_new. The GPU kernels
  (``prefill_gpu``, ``prefill_mgpu``) loop over a sequence's chunks with S in registers.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

SUB = 16
_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST
# The GPU kernels pass TF32x3 (three tensor-core passes, float32-accurate); TPU and the
# interpreters use HIGHEST.
GPU_PRECISION = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3


_LOG2_E = 1.4426950408889634


def _exp(x):
    """``exp(x)`` as ``exp2(x log2 e)``: on the GPU one ``ex2.approx`` (relative error ~1e-7, plus
    ``|x|`` x 6e-8 from rounding the argument) instead of the accurate ``exp``'s range reduction."""
    return jnp.exp2(x * _LOG2_E)


def _dot(a, b, precision=_HI):
    return jnp.dot(a, b, precision=precision, preferred_element_type=_F32)


def _dot_nt(a, b, precision):
    """``a @ b.T`` (contract the last axes)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=_F32)


def _iota(shape, dim):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _pick_row(x, i):
    """Row ``i`` of a ``[R, N]`` tile as ``[1, N]``."""
    return jnp.sum(jnp.where(_iota((x.shape[0], 1), 0) == i, x, 0.0), axis=0, keepdims=True)


def _unit_lower_inverse(D):
    """``(I + D)^-1`` for a strictly lower ``[16, 16]`` tile, column-oriented forward substitution."""
    n = D.shape[0]
    rows, cols = _iota((n, n), 0), _iota((n, n), 1)

    def step(j, X):
        col = jnp.sum(jnp.where(cols == j, D, 0.0), axis=1, keepdims=True)  # D[:, j]
        return X - col * _pick_row(X, j)

    return jax.lax.fori_loop(0, n, step, jnp.where(rows == cols, 1.0, 0.0).astype(_F32))


def _decays(k, G):
    """``kd^T = (k exp(G_C - G))^T`` and ``decay = exp(G_C)`` as a column, from a chunk's keys and
    gate cumsum ``G`` (``[C, K']`` tiles)."""
    C = k.shape[0]
    GT = G.T
    GlastT = jnp.sum(jnp.where(_iota((1, C), 1) == C - 1, GT, 0.0), axis=1, keepdims=True)  # [K', 1]
    return k.T * _exp(GlastT - GT), _exp(GlastT)


def _gates(g_ref, k_ref, kdT_ref, decay_ref):
    """The chunk's gate cumsum (a HIGHEST-precision matmul with a triangular ones matrix); writes
    kd^T and decay (:func:`_decays`). Returns float32 ``g, k, G``."""
    C = k_ref.shape[0]
    g = g_ref[...].astype(_F32)
    k = k_ref[...].astype(_F32)
    G = _dot(jnp.where(_iota((C, C), 1) <= _iota((C, C), 0), 1.0, 0.0).astype(_F32), g)
    kdT, decay_ref[...] = _decays(k, G)
    kdT_ref[...] = kdT.astype(kdT_ref.dtype)
    return g, k, G


def prep_body(q_ref, k_ref, v_ref, g_ref, beta_ref, qg_ref, kdT_ref, w_ref, u_ref, aqk_ref, decay_ref, *, scale,
              precision=_HI):
    """Stage 1 on one chunk of one value head. Inputs ``[C, K]``/``[C, V]``, beta ``[C, 1]``.

    Outputs: qg, W ``[C, K]``; U ``[C, V]``; Aqk ``[C, C]``; kd^T ``[K, C]``; decay ``[K, 1]``.
    Loops are ``fori_loop``s (not unrolled) to keep the kernel small to compile. The gate
    cumsum is always a HIGHEST-precision matmul; ``precision`` is for the other matmuls.
    """
    dot = partial(_dot, precision=precision)
    C, K = k_ref.shape
    V = v_ref.shape[1]
    g, k, G = _gates(g_ref, k_ref, kdT_ref, decay_ref)
    r16 = _iota((SUB, 1), 0)
    lane = _iota((1, C), 1)

    def sub_chunk(i, X):
        Xw, Xu = X
        start = i * SUB
        rows = pl.ds(pl.multiple_of(start, SUB), SUB)
        qi = q_ref[rows, :].astype(_F32)
        ki = k_ref[rows, :].astype(_F32)
        bi = beta_ref[rows, :].astype(_F32)
        Gi = _dot(jnp.where(_iota((SUB, C), 1) <= _iota((SUB, C), 0) + start, 1.0, 0.0).astype(_F32), g)
        anchor = _pick_row(Gi, 0)
        # Columns of earlier sub-chunks: both factors anchored at this sub-chunk's first row.
        k_anc = k * _exp(jnp.where(_iota((C, 1), 0) < start, anchor - G, -jnp.inf))
        to_anchor = _exp(Gi - anchor)
        Akk_prev = _dot_nt(ki * to_anchor, k_anc, precision)  # [16, C], zero from column `start` on

        def diagonal(c, A):  # the diagonal block, exact pairwise decay differences
            Aqk, Akk = A
            t = _exp(jnp.where(r16 >= c, Gi - _pick_row(Gi, c), -jnp.inf)) * _pick_row(ki, c)
            at = lane == start + c
            Aqk = jnp.where(at, jnp.sum(qi * t, axis=1, keepdims=True), Aqk)
            Akk = jnp.where(at & (r16 > c), jnp.sum(ki * t, axis=1, keepdims=True), Akk)
            return Aqk, Akk

        Aqk, Akk = jax.lax.fori_loop(0, SUB, diagonal, (_dot_nt(qi * to_anchor, k_anc, precision), Akk_prev))
        aqk_ref[rows, :] = scale * Aqk
        egi = _exp(Gi)
        qg_ref[rows, :] = scale * qi * egi
        # Blocked forward substitution: X_i = (I + D_ii)^-1 (R_i - Akk[i, :i] X[:i]).
        place = jnp.where(_iota((C, SUB), 0) == _iota((C, SUB), 1) + start, 1.0, 0.0).astype(_F32)  # [C, 16]
        Linv = _unit_lower_inverse(dot(bi * Akk, place))
        Akk_prev = bi * Akk_prev
        Xw_i = dot(Linv, bi * ki * egi - dot(Akk_prev, Xw))
        Xu_i = dot(Linv, bi * v_ref[rows, :].astype(_F32) - dot(Akk_prev, Xu))
        w_ref[rows, :] = Xw_i
        u_ref[rows, :] = Xu_i
        return Xw + dot(place, Xw_i), Xu + dot(place, Xu_i)

    jax.lax.fori_loop(0, C // SUB, sub_chunk, (jnp.zeros((C, K), _F32), jnp.zeros((C, V), _F32)))


def _diagonal_exact(q_ref, k_ref, g_ref, rows, k_piece):
    """A sub-chunk's diagonal ``[16, 16]`` blocks of ``q k^T`` and ``k k^T`` with exact pairwise
    decays (causal, diagonal included): per ``k_piece`` slice of K, a local gate cumsum and a
    ``[16, 16, k_piece]`` broadcast reduced over K."""
    K = k_ref.shape[1]
    kp = min(k_piece, K)
    r16, c16 = _iota((SUB, SUB), 0), _iota((SUB, SUB), 1)
    causal = (r16 >= c16)[:, :, None]
    tri16 = jnp.where(c16 <= r16, 1.0, 0.0).astype(_F32)

    def piece(p, A):
        cols = pl.ds(pl.multiple_of(p * kp, kp), kp)
        Gl = _dot(tri16, g_ref[rows, cols].astype(_F32))  # local cumsum: differences are exact G_r - G_c
        kq = k_ref[rows, cols].astype(_F32)
        e = kq[None, :, :] * _exp(jnp.where(causal, Gl[:, None, :] - Gl[None, :, :], -jnp.inf))
        return (A[0] + jnp.sum(q_ref[rows, cols].astype(_F32)[:, None, :] * e, axis=2),
                A[1] + jnp.sum(kq[:, None, :] * e, axis=2))

    zero = jnp.zeros((SUB, SUB), _F32)
    return jax.lax.fori_loop(0, K // kp, piece, (zero, zero))


# Gate span (nats, over a 16-row sub-chunk) up to which kernel A forms a row's diagonal block as
# anchored matmuls: factors stay in [e^-60, e^60], normal float32 with margin. Rows past it are
# recomputed with exact pairwise differences.
_SPAN_SAFE = 60.0


def _rows_body(q_ref, k_ref, g_ref, G_ref, beta_ref, qg_ref, aqk_ref, n_ref, *, scale, precision,
               bounded=False, k_piece=16, k_block=64, i=None):
    """GPU stage 1, kernel A: one 16-row sub-chunk ``i`` (``program_id(2)``) of one chunk and head.

    Inputs are the chunk's ``[C, K]`` tiles (``G`` its gate cumsum). Per causal ``16 x 16`` block
    ``(i, j)``, one ``[16, K] x [K, 16]`` product each for ``q k^T`` and ``k k^T`` (accumulated over
    ``k_block`` slices of K), both factors anchored at the sub-chunk's first row; blocks right of the
    diagonal are written as zeros without a product. Run it on one warp: Triton repeats a
    ``[16, 16]`` product on every warp (one warp took 1802 us at B1 T32k H32 on the H200, two 2465;
    whole ``[16, C]`` row products on four warps 2152).
    Left of the diagonal block the exponents are <= 0; on the diagonal block the column factor
    ``exp(anchor - G_c)`` grows with the gate span of the rows before. A row whose own span
    (``max_K (anchor - G_r)``, which bounds every factor it uses) exceeds :data:`_SPAN_SAFE`
    takes its diagonal block from exact pairwise differences (:func:`_diagonal_exact`, computed
    only in sub-chunks that need it). The choice depends on the row's own gates only, so future
    tokens never change a row's bits. ``bounded`` (gates >= -5: spans <= 75, finite): no fallback.
    Entries right of the causal diagonal are selected away (they may overflow). Writes
    ``qg [16, K]``, ``Aqk [16, C]`` (scaled, causal) and ``N [16, C]`` (beta Akk, strictly lower)
    for kernel B.
    """
    C, K = k_ref.shape
    kb = min(k_block, K)
    i = pl.program_id(2) if i is None else i
    block = lambda j: pl.ds(pl.multiple_of(j * SUB, SUB), SUB)  # the j-th 16-row / 16-column block
    rows = block(i)
    start = rows.start
    r16, c16 = _iota((SUB, SUB), 0), _iota((SUB, SUB), 1)
    zero = jnp.zeros((SUB, SUB), _F32)

    bi = beta_ref[rows, :].astype(_F32)
    nk = K // kb

    # One loop over (column block j <= i, K slice) pairs, so the pipelined loads run ahead across
    # blocks (nested loops, a K loop per block, took 8% longer); block j's sums are stored after its
    # last slice, and the carry leaves the loop with the diagonal block's. Unless bounded, the
    # diagonal block's column factor is capped and the deepest gate descent below the anchor is
    # kept elementwise.
    def step(t, A):
        j, p = jax.lax.div(t, nk), jax.lax.rem(t, nk)
        cols = block(j)
        ks = pl.ds(pl.multiple_of(p * kb, kb), kb)
        Aq, Ak = (jnp.where(p == 0, 0.0, X) for X in A[:2])
        anchor = G_ref[pl.ds(start, 1), ks]
        down = G_ref[rows, ks] - anchor
        to_anchor = _exp(down)
        up = anchor - G_ref[cols, ks]
        if not bounded:
            up = jnp.where(j == i, jnp.minimum(up, _SPAN_SAFE), up)
        k_anc = k_ref[cols, ks].astype(_F32) * _exp(up)
        Aq = Aq + _dot_nt(q_ref[rows, ks].astype(_F32) * to_anchor, k_anc, precision)
        Ak = Ak + _dot_nt(k_ref[rows, ks].astype(_F32) * to_anchor, k_anc, precision)

        @pl.when((p == nk - 1) & (j < i))
        def _():
            aqk_ref[:, cols] = (scale * Aq).astype(aqk_ref.dtype)
            n_ref[:, cols] = bi * Ak

        return (Aq, Ak, *(jnp.minimum(m, down) for m in A[2:]))

    def later(j, carry):
        cols = block(j)
        aqk_ref[:, cols] = zero.astype(aqk_ref.dtype)
        n_ref[:, cols] = zero
        return carry

    jax.lax.fori_loop(i + 1, C // SUB, later, 0)
    lowest = () if bounded else (jnp.zeros((SUB, kb), _F32),)
    Aq, Ak, *lowest = jax.lax.fori_loop(0, (i + 1) * nk, step, (zero, zero, *lowest))
    if not bounded:
        def exact(A):
            redo = jnp.max(G_ref[pl.ds(start, 1), :] - G_ref[rows, :], axis=1, keepdims=True) > _SPAN_SAFE
            return tuple(jnp.where(redo, X, Y) for X, Y in zip(_diagonal_exact(q_ref, k_ref, g_ref, rows, k_piece), A))

        # Whether any row needs it: one scalar from an elementwise minimum over the K slices (a
        # per-row reduction up front cost 9% of the kernel); the per-row test runs in the branch.
        deepest = jnp.min(jnp.min(lowest[0], axis=1), axis=0)
        Aq, Ak = jax.lax.cond(deepest < -_SPAN_SAFE, exact, lambda A: A, (Aq, Ak))
    aqk_ref[:, rows] = (scale * jnp.where(c16 <= r16, Aq, 0.0)).astype(aqk_ref.dtype)
    n_ref[:, rows] = bi * jnp.where(c16 < r16, Ak, 0.0)
    qg_ref[...] = (scale * q_ref[rows, :].astype(_F32) * _exp(G_ref[rows, :])).astype(qg_ref.dtype)


def _inverse_body(n_ref, x_ref, *, precision):
    """GPU stage 1, kernel B: one chunk's ``X = (I + N)^-1`` from kernel A's ``N`` (beta Akk,
    strictly lower; entries on or above the diagonal are not read). First each 16 x 16 diagonal
    block's inverse, by column-oriented forward substitution in IEEE float32 (each column of the
    block one ``[16, 1]`` load, the four blocks' steps interleaved), then forward substitution over
    16 x 16 blocks: ``X_ij = -X_ii sum_{j <= m < i} N_im X_mj``, exact elimination (no series).
    Blocks are read and written through static ref slices, so every product is
    ``[16, 16] x [16, 16]``. On the H200 at B1 T131k H12 (2026-12-03) this took 292 us where the
    diagonal inverses as their own kernel (two warps, row-oriented, strided loads) and this kernel
    reading them took 88 + 299.
    """
    nb = n_ref.shape[0] // SUB
    blk = lambda i: pl.ds(i * SUB, SUB)
    rows, cols = _iota((SUB, SUB), 0), _iota((SUB, SUB), 1)
    below = _iota((SUB, 1), 0)
    X = {(i, i): jnp.where(rows == cols, 1.0, 0.0).astype(_F32) for i in range(nb)}
    for j in range(SUB):
        for i in range(nb):
            col = jnp.where(below > j, n_ref[blk(i), pl.ds(i * SUB + j, 1)], 0.0)  # D_ii[:, j] below j
            X[i, i] = X[i, i] - col * _pick_row(X[i, i], j)
    zero = jnp.zeros((SUB, SUB), _F32)
    for i in range(nb):
        N = [n_ref[blk(i), blk(m)] for m in range(i)]
        for j in range(i):
            acc = zero
            for m in range(j, i):
                acc = acc + _dot(N[m], X[m, j], precision)
            X[i, j] = -_dot(X[i, i], acc, precision)
        for j in range(nb):
            x_ref[blk(i), blk(j)] = X[i, j] if j <= i else zero


def _wu_body(k_ref, v_ref, G_ref, beta_ref, x_ref, kdT_ref, w_ref, u_ref, decay_ref, *, precision, block=64):
    """GPU stage 1, kernel C: W, U, kd^T and decay of one chunk from its inverse ``X``.

    W, kd^T and decay are formed per ``block`` columns of K, U per ``block`` columns of V (fewer
    live registers).
    """
    C, K = k_ref.shape
    V = v_ref.shape[1]
    X = x_ref[...]
    beta = beta_ref[...].astype(_F32)
    kb, vb = min(block, K), min(block, V)

    def k_slice(p, carry):
        cols = pl.ds(pl.multiple_of(p * kb, kb), kb)
        k, G = k_ref[:, cols].astype(_F32), G_ref[:, cols]
        kdT, decay_ref[cols, :] = _decays(k, G)
        kdT_ref[cols, :] = kdT.astype(kdT_ref.dtype)
        w_ref[:, cols] = _dot(X, beta * k * _exp(G), precision).astype(w_ref.dtype)
        return carry

    def v_slice(p, carry):
        cols = pl.ds(pl.multiple_of(p * vb, vb), vb)
        u_ref[:, cols] = _dot(X, beta * v_ref[:, cols].astype(_F32), precision).astype(u_ref.dtype)
        return carry

    jax.lax.fori_loop(0, K // kb, k_slice, 0)
    jax.lax.fori_loop(0, V // vb, v_slice, 0)


def _rows_where(body, wide_ref, q_ref, k_ref, g_ref, G_ref, beta_ref, _qg, _aqk, _n, qg_ref, aqk_ref, n_ref):
    """``body`` (:func:`_rows_body`) where the chunk's flag ``wide_ref`` is set; the outputs keep
    what they hold (aliased to the inputs ``_qg, _aqk, _n``) elsewhere. The sub-chunk index is
    read out here: the generic interpreter does not take ``program_id`` inside ``pl.when``."""
    i = pl.program_id(2)
    pl.when(wide_ref[...] != 0)(lambda: body(q_ref, k_ref, g_ref, G_ref, beta_ref, qg_ref, aqk_ref, n_ref, i=i))


def _cumsum_body(g_ref, G_ref, *wide_ref, span=None):
    G = jnp.cumsum(g_ref[...].astype(_F32), axis=0)
    G_ref[...] = G
    if span is not None:
        C, K = G.shape
        G3 = G.reshape(C // SUB, SUB, K)
        # Triton's max and min skip NaN, so NaN is looked for apart. One axis per reduction: the
        # Triton lowering of a reduction over two fails under an explicit mesh (jax 0.11.2).
        any_ = lambda x: jnp.max(jnp.max(jnp.where(x, 1, 0), axis=1), axis=0)
        wide = jnp.max(G3, axis=1) - jnp.min(G3, axis=1) > span
        wide_ref[0][...] = jnp.maximum(any_(wide), any_(G != G))


def gate_cumsum_call(g, *, C, span=None, compiler_params=None, interpret=False):
    """The chunk-local gate cumsum of token-major ``g [TT, HV, K]``, one program per (chunk, head):
    float32 ``G [TT, HV, K]``. At T = 32768, H = 32 on the H200 it takes 0.28 ms, where XLA's
    cumsum (a slice and an add fusion) took 0.77 ms. The grid runs the heads fastest, so the
    programs running at once read whole token rows: 3-4% faster than chunks fastest (420 against
    437 us at B1 T131k H12, 280 against 293 at T32k H32, 2026-12-03); the same order made kernel
    A (Triton) 2% and kernel C 0.5% slower, so they keep theirs.

    ``span`` (nats): also return int32 ``wide [HV, TT // C]``, 1 where a 16-row sub-chunk of the
    chunk spans more than ``span`` in some channel (its largest G minus its smallest) or holds a
    NaN, else 0. A check by XLA reading two rows of every 16 of G took 36 us at B1 T131k H12 on
    the H200 (2026-12-03); in here the whole call took the same time as with it (3.77 ms)."""
    TT, HV, K = g.shape
    spec = pl.BlockSpec((C, None, K), lambda h, c: (c, h, 0))
    out_specs, out_shape = spec, jax.ShapeDtypeStruct((TT, HV, K), _F32)
    if span is not None:
        out_specs = [spec, pl.BlockSpec((None, None), lambda h, c: (h, c))]
        out_shape = [out_shape, jax.ShapeDtypeStruct((HV, TT // C), jnp.int32)]
    return pl.pallas_call(partial(_cumsum_body, span=span), grid=(HV, TT // C), in_specs=[spec],
                          out_specs=out_specs, out_shape=out_shape, compiler_params=compiler_params,
                          interpret=interpret)(g)


def gpu_prep_call(q, k, v, g, beta, *, C, scale, precision, inv_precision, store_dtype=_F32, bounded=False,
                  compiler_params=None, rows_compiler_params=None, inverse_compiler_params=None,
                  interpret=False, rows_call=None, rows_span=None, wu_call=None):
    """GPU stage 1 as kernels of small programs (many per SM; one fused kernel per chunk was
    1.6x slower on the H200) after the chunk-local gate cumsum (:func:`gate_cumsum_call`); kernel A
    over ``(chunk, head, sub-chunk)`` writes qg, Aqk and N's rows (strictly lower, beta Akk);
    kernel B over ``(chunk, head)`` (:func:`_inverse_body`) forms the chunk's inverse ``X`` (float32, ``[HV, TT, C]``);
    kernel C over ``(chunk, head)`` writes W, U, kd^T, decay.
    Token-major inputs ``q, k [TT, H, K]``, ``v [TT, HV, V]``, ``g [TT, HV, K]``,
    ``beta [TT, HV, 1]``; outputs as :func:`prep_call`. ``inv_precision`` is for kernel B's
    products (the diagonal blocks' inverses are IEEE float32), ``precision`` for the products
    (Aqk, Akk, W, U). ``store_dtype`` is the dtype of the outputs stage 2 reads (qg, Aqk, kd^T,
    W, U; bfloat16 halves their traffic); the inverse's pieces and decay stay float32.
    ``bounded``: see :func:`_rows_body`. ``rows_compiler_params`` and ``inverse_compiler_params``
    are kernels A's and B's (one warp each: their ``[16, 16]`` products replicate across warps;
    kernel B on 1 warp took 168 us at B1 T32k H32 on the H200, 2 warps 240, 4 warps 408; kernel
    A's loop pipelined in 2 stages 1589 us, 1 stage 1782, 3 stages 1989 when it was nested, and
    flat at B1 T131k H12 with K3 gates 2106 us in 2 stages, 2423 in 3),
    ``compiler_params`` the other kernels' (kernel C's slice loops in 2 stages took 1158 us at
    B1 T131k H12 with K3 gates on the H200, 1 stage 1201, 3 stages 1314; 2 warps 1179, 8 warps
    1529). ``rows_call``: another kernel A,
    ``rows_call(q, k, G, beta) -> (qg, Aqk, N)``, e.g. :func:`pallas_kernels.kda.prep_mgpu.rows_call`;
    ``rows_span``: keep ``rows_call``'s rows only in chunks whose 16-row sub-chunks all span
    at most this many nats (checked by the cumsum kernel); the Triton kernel A redoes the other
    chunks. E.g. :data:`pallas_kernels.kda.prep_mgpu.SPAN`;
    ``wu_call``: another kernel C, ``wu_call(k, v, G, beta, X) -> (kd^T, W, U, decay)``, e.g.
    :func:`pallas_kernels.kda.wu_mgpu.wu_call`.
    """
    (TT, H, K), (_, HV, V) = k.shape, v.shape
    rep, NC, ns = HV // H, TT // C, C // SUB
    checked = rows_call is not None and rows_span is not None
    G = gate_cumsum_call(g, C=C, span=rows_span if checked else None, compiler_params=compiler_params,
                         interpret=interpret)
    if checked:
        G, wide = G
    tok = lambda width, qk: pl.BlockSpec((C, None, width), lambda c, h, *_: (c, h // rep if qk else h, 0))
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, _F32)
    st = lambda *shape: jax.ShapeDtypeStruct(shape, store_dtype)
    sub_rows = lambda width: pl.BlockSpec((None, SUB, width), lambda c, h, i: (h, c * ns + i, 0))
    in_specs = [tok(K, True), tok(K, True), tok(K, False), tok(K, False), tok(1, False)]
    out_specs = [sub_rows(K), sub_rows(C), sub_rows(C)]
    triton_rows = partial(
        pl.pallas_call, grid=(NC, HV, ns), out_specs=out_specs,
        out_shape=[st(HV, TT, K), st(HV, TT, C), f32(HV, TT, C)],
        compiler_params=rows_compiler_params, interpret=interpret)
    body = partial(_rows_body, scale=scale, precision=precision, bounded=bounded)
    if rows_call is None:
        qg, aqk, N = triton_rows(body, in_specs=in_specs)(q, k, g, G, beta)
    elif checked:
        # The Triton kernel A redoes the chunks too steep for rows_call, in place; its other
        # programs return at once. Launched only if a chunk is flagged: launched always, the
        # whole call took 3.84 against 3.77 ms at B1 T131k H12 on the H200 (2026-12-04).
        flag = pl.BlockSpec((None, None), lambda c, h, i: (h, c))
        redo = triton_rows(partial(_rows_where, body), in_specs=[flag, *in_specs, *out_specs],
                           input_output_aliases={6: 0, 7: 1, 8: 2})
        fast = tuple(rows_call(q, k, G, beta))
        qg, aqk, N = jax.lax.cond(jnp.max(wide) > 0, lambda: tuple(redo(wide, q, k, g, G, beta, *fast)),
                                  lambda: fast)
    else:
        qg, aqk, N = rows_call(q, k, G, beta)
    rows = lambda width: pl.BlockSpec((None, C, width), lambda c, h: (h, c, 0))
    X = pl.pallas_call(
        partial(_inverse_body, precision=inv_precision),
        grid=(NC, HV),
        in_specs=[rows(C)],
        out_specs=rows(C),
        out_shape=f32(HV, TT, C),
        compiler_params=inverse_compiler_params,
        interpret=interpret,
    )(N)
    if wu_call is not None:
        kdT, W, U, decay = wu_call(k, v, G, beta, X)
        return qg, kdT, W, U, aqk, decay
    per_chunk = lambda width: pl.BlockSpec((None, None, K, width), lambda c, h: (h, c, 0, 0))
    kdT, W, U, decay = pl.pallas_call(
        partial(_wu_body, precision=precision),
        grid=(NC, HV),
        in_specs=[tok(K, True), tok(V, False), tok(K, False), tok(1, False), rows(C)],
        out_specs=[per_chunk(C), rows(K), rows(V), per_chunk(1)],
        out_shape=[st(HV, NC, K, C), st(HV, TT, K), st(HV, TT, V), f32(HV, NC, K, 1)],
        compiler_params=compiler_params,
        interpret=interpret,
    )(k, v, G, beta, X)
    return qg, kdT, W, U, aqk, decay


def chunk_step(S, qg, kdT, W, U, Aqk, decay, precision=_HI):
    """One chunk of the recurrence on ``S f32[K, BV]``. Returns ``(o [C, BV], S')``."""
    dot = partial(_dot, precision=precision)
    v_new = U - dot(W, S)
    o = dot(qg, S) + dot(Aqk, v_new)
    return o, decay * S + dot(kdT, v_new)


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
