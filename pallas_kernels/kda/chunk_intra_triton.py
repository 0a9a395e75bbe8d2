"""The intra-chunk products in Triton: :func:`rows_call`, per 16-row sub-chunk of a chunk, the rows
of ``Aqk = scale (q k^T) * decays`` (causal), ``N = beta (k k^T) * decays`` (strictly lower: the
matrix whose ``(I + N)^-1`` :mod:`pallas_kernels.kda.wy_fast_triton` forms) and
``qg = scale q exp(G)``, from the chunk-local gate cumsum ``G``.

Off-diagonal 16 x 16 blocks are products anchored at the sub-chunk's first row (exponents <= 0,
no future gate read); the diagonal block too while a row's own gate span allows
(``SPAN_SAFE``), else from exact pairwise gate differences, so it is right for unbounded gates
(:func:`redo_rows_call` reruns it on the chunks too steep for the Mosaic GPU kernel,
:mod:`pallas_kernels.kda.chunk_intra_mgpu`). One program per (chunk, value head, sub-chunk), on
one warp: Triton repeats a ``[16, 16]`` product on every warp.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.common import SUB, dot_f32, dot_nt_f32, fast_exp, iota

_F32 = jnp.float32


def _diagonal_exact(q_ref, k_ref, g_ref, rows, k_piece):
    """A sub-chunk's diagonal ``[16, 16]`` blocks of ``q k^T`` and ``k k^T`` with exact pairwise
    decays (causal, diagonal included): per ``k_piece`` slice of K, a local gate cumsum and a
    ``[16, 16, k_piece]`` broadcast reduced over K."""
    K = k_ref.shape[1]
    kp = min(k_piece, K)
    r16, c16 = iota((SUB, SUB), 0), iota((SUB, SUB), 1)
    causal = (r16 >= c16)[:, :, None]
    tri16 = jnp.where(c16 <= r16, 1.0, 0.0).astype(_F32)

    def piece(p, A):
        cols = pl.ds(pl.multiple_of(p * kp, kp), kp)
        Gl = dot_f32(tri16, g_ref[rows, cols].astype(_F32))  # local cumsum: differences are exact G_r - G_c
        kq = k_ref[rows, cols].astype(_F32)
        e = kq[None, :, :] * fast_exp(jnp.where(causal, Gl[:, None, :] - Gl[None, :, :], -jnp.inf))
        return (A[0] + jnp.sum(q_ref[rows, cols].astype(_F32)[:, None, :] * e, axis=2),
                A[1] + jnp.sum(kq[:, None, :] * e, axis=2))

    zero = jnp.zeros((SUB, SUB), _F32)
    return jax.lax.fori_loop(0, K // kp, piece, (zero, zero))


# Gate span (nats, over a 16-row sub-chunk) up to which a row's diagonal block is formed as
# anchored matmuls: factors stay in [e^-60, e^60], normal float32 with margin. Rows past it are
# recomputed with exact pairwise differences.
SPAN_SAFE = 60.0


def _rows_body(q_ref, k_ref, g_ref, G_ref, beta_ref, qg_ref, aqk_ref, n_ref, *, scale, precision,
               bounded=False, k_piece=16, k_block=64, i=None):
    """The intra-chunk products of one 16-row sub-chunk ``i`` (``program_id(2)``) of one chunk and head.

    Inputs are the chunk's ``[C, K]`` tiles (``G`` its gate cumsum). Per causal ``16 x 16`` block
    ``(i, j)``, one ``[16, K] x [K, 16]`` product each for ``q k^T`` and ``k k^T`` (accumulated over
    ``k_block`` slices of K), both factors anchored at the sub-chunk's first row; blocks right of the
    diagonal are written as zeros without a product. Run it on one warp: Triton repeats a
    ``[16, 16]`` product on every warp.
    Left of the diagonal block the exponents are <= 0; on the diagonal block the column factor
    ``exp(anchor - G_c)`` grows with the gate span of the rows before. A row whose own span
    (``max_K (anchor - G_r)``, which bounds every factor it uses) exceeds :data:`SPAN_SAFE`
    takes its diagonal block from exact pairwise differences (:func:`_diagonal_exact`, computed
    only in sub-chunks that need it). The choice depends on the row's own gates only, so future
    tokens never change a row's bits. ``bounded`` (gates >= -5: spans <= 75, finite): no fallback.
    Entries right of the causal diagonal are selected away (they may overflow). Writes
    ``qg [16, K]``, ``Aqk [16, C]`` (scaled, causal) and ``N [16, C]`` (beta Akk, strictly lower)
    for the inverse.
    """
    C, K = k_ref.shape
    kb = min(k_block, K)
    i = pl.program_id(2) if i is None else i
    block = lambda j: pl.ds(pl.multiple_of(j * SUB, SUB), SUB)  # the j-th 16-row / 16-column block
    rows = block(i)
    start = rows.start
    r16, c16 = iota((SUB, SUB), 0), iota((SUB, SUB), 1)
    zero = jnp.zeros((SUB, SUB), _F32)

    bi = beta_ref[rows, :].astype(_F32)
    nk = K // kb

    # One loop over (column block j <= i, K slice) pairs, so the pipelined loads run ahead across
    # blocks (faster than a K loop per block); block j's sums are stored after its
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
        to_anchor = fast_exp(down)
        up = anchor - G_ref[cols, ks]
        if not bounded:
            up = jnp.where(j == i, jnp.minimum(up, SPAN_SAFE), up)
        k_anc = k_ref[cols, ks].astype(_F32) * fast_exp(up)
        Aq = Aq + dot_nt_f32(q_ref[rows, ks].astype(_F32) * to_anchor, k_anc, precision)
        Ak = Ak + dot_nt_f32(k_ref[rows, ks].astype(_F32) * to_anchor, k_anc, precision)

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
            redo = jnp.max(G_ref[pl.ds(start, 1), :] - G_ref[rows, :], axis=1, keepdims=True) > SPAN_SAFE
            return tuple(jnp.where(redo, X, Y) for X, Y in zip(_diagonal_exact(q_ref, k_ref, g_ref, rows, k_piece), A))

        # Whether any row needs it: one scalar from an elementwise minimum over the K slices (cheaper
        # than a per-row reduction up front); the per-row test runs in the branch.
        deepest = jnp.min(jnp.min(lowest[0], axis=1), axis=0)
        Aq, Ak = jax.lax.cond(deepest < -SPAN_SAFE, exact, lambda A: A, (Aq, Ak))
    aqk_ref[:, rows] = (scale * jnp.where(c16 <= r16, Aq, 0.0)).astype(aqk_ref.dtype)
    n_ref[:, rows] = bi * jnp.where(c16 < r16, Ak, 0.0)
    qg_ref[...] = (scale * q_ref[rows, :].astype(_F32) * fast_exp(G_ref[rows, :])).astype(qg_ref.dtype)


def _rows_where(body, wide_ref, q_ref, k_ref, g_ref, G_ref, beta_ref, _qg, _aqk, _n, qg_ref, aqk_ref, n_ref):
    """``body`` (:func:`_rows_body`) where the chunk's flag ``wide_ref`` is set; the outputs keep
    what they hold (aliased to the inputs ``_qg, _aqk, _n``) elsewhere. The sub-chunk index is
    read out here: the generic interpreter does not take ``program_id`` inside ``pl.when``."""
    i = pl.program_id(2)
    pl.when(wide_ref[...] != 0)(lambda: body(q_ref, k_ref, g_ref, G_ref, beta_ref, qg_ref, aqk_ref, n_ref, i=i))


def _rows_pallas_call(body, q, G, *, C, store_dtype, compiler_params, interpret, **kw):
    """The ``pallas_call`` of ``body`` over ``(chunk, value head, sub-chunk)``, writing ``qg``,
    ``Aqk`` (``store_dtype``) and ``N`` (float32) a sub-chunk of rows per program."""
    TT, _, K = q.shape
    HV = G.shape[1]
    ns = C // SUB
    sub_rows = lambda width: pl.BlockSpec((None, SUB, width), lambda c, h, i: (h, c * ns + i, 0))
    st = lambda *shape: jax.ShapeDtypeStruct(shape, store_dtype)
    return pl.pallas_call(body, grid=(TT // C, HV, ns), out_specs=[sub_rows(K), sub_rows(C), sub_rows(C)],
                          out_shape=[st(HV, TT, K), st(HV, TT, C), jax.ShapeDtypeStruct((HV, TT, C), _F32)],
                          compiler_params=compiler_params, interpret=interpret, **kw)


def _in_specs(q, G, C):
    """Token-major ``[C, width]`` tiles of q, k (the value head's q/k head), g, G and beta."""
    H, K, HV = q.shape[1], q.shape[2], G.shape[1]
    rep = HV // H
    tok = lambda width, qk: pl.BlockSpec((C, None, width), lambda c, h, *_: (c, h // rep if qk else h, 0))
    return [tok(K, True), tok(K, True), tok(K, False), tok(K, False), tok(1, False)]


def rows_call(q, k, g, G, beta, *, C, scale, precision, store_dtype=_F32, bounded=False, compiler_params=None,
              interpret=False):
    """The intra-chunk products of every chunk. Token-major ``q, k [TT, H, K]``, ``g, G [TT, HV, K]``
    (``G`` float32, the chunk-local gate cumsum), ``beta [TT, HV, 1]``. Returns ``qg [HV, TT, K]``
    and ``Aqk [HV, TT, C]`` in ``store_dtype``, ``N [HV, TT, C]`` float32. ``bounded``: gates >= -5
    (no span check; see :func:`_rows_body`)."""
    body = partial(_rows_body, scale=scale, precision=precision, bounded=bounded)
    return _rows_pallas_call(body, q, G, C=C, store_dtype=store_dtype, compiler_params=compiler_params,
                             interpret=interpret, in_specs=_in_specs(q, G, C))(q, k, g, G, beta)


def redo_rows_call(wide, q, k, g, G, beta, qg, aqk, N, *, C, scale, precision, store_dtype=_F32, bounded=False,
                   compiler_params=None, interpret=False):
    """:func:`rows_call`'s rows in the chunks flagged in ``wide i32[HV, TT // C]``, written in place
    over ``qg, aqk, N`` (another kernel's rows, aliased to the outputs); the programs of unflagged
    chunks return at once."""
    body = partial(_rows_body, scale=scale, precision=precision, bounded=bounded)
    ns = C // SUB
    K = q.shape[2]
    sub_rows = lambda width: pl.BlockSpec((None, SUB, width), lambda c, h, i: (h, c * ns + i, 0))
    flag = pl.BlockSpec((None, None), lambda c, h, i: (h, c))
    in_specs = [flag, *_in_specs(q, G, C), sub_rows(K), sub_rows(C), sub_rows(C)]
    return _rows_pallas_call(partial(_rows_where, body), q, G, C=C, store_dtype=store_dtype,
                             compiler_params=compiler_params, interpret=interpret, in_specs=in_specs,
                             input_output_aliases={6: 0, 7: 1, 8: 2})(wide, q, k, g, G, beta, qg, aqk, N)
