"""The WY representation in Triton: every chunk's ``X = (I + N)^-1`` (:func:`inverse_call`, ``N =
beta Akk`` from the intra-chunk products), then ``W = X (beta k exp(G))``, ``U = X (beta v)``,
``kd^T = (k exp(G_C - G))^T`` and ``decay = exp(G_C)`` (:func:`wu_call`; Mosaic GPU's for 16-bit
inputs is :mod:`pallas_kernels.kda.wy_fast_mgpu`). One program per (chunk, value head).

The inverse is exact elimination in float32 (no series: those cancel catastrophically when keys
repeat): each 16 x 16 diagonal block's inverse by column-oriented forward substitution in IEEE
float32, then forward substitution over 16 x 16 blocks, on one warp.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.common import SUB, chunk_decays, dot_f32, fast_exp, iota, pick_row

_F32 = jnp.float32


def _inverse_body(n_ref, x_ref, *, precision):
    """One chunk's ``X = (I + N)^-1`` from the intra-chunk products' ``N`` (beta Akk, strictly
    lower; entries on or above the diagonal are not read). First each 16 x 16 diagonal
    block's inverse, by column-oriented forward substitution in IEEE float32 (each column of the
    block one ``[16, 1]`` load, the four blocks' steps interleaved), then forward substitution over
    16 x 16 blocks: ``X_ij = -X_ii sum_{j <= m < i} N_im X_mj``, exact elimination (no series).
    Blocks are read and written through static ref slices, so every product is
    ``[16, 16] x [16, 16]``.
    """
    nb = n_ref.shape[0] // SUB
    blk = lambda i: pl.ds(i * SUB, SUB)
    rows, cols = iota((SUB, SUB), 0), iota((SUB, SUB), 1)
    below = iota((SUB, 1), 0)
    X = {(i, i): jnp.where(rows == cols, 1.0, 0.0).astype(_F32) for i in range(nb)}
    for j in range(SUB):
        for i in range(nb):
            col = jnp.where(below > j, n_ref[blk(i), pl.ds(i * SUB + j, 1)], 0.0)  # D_ii[:, j] below j
            X[i, i] = X[i, i] - col * pick_row(X[i, i], j)
    zero = jnp.zeros((SUB, SUB), _F32)
    for i in range(nb):
        N = [n_ref[blk(i), blk(m)] for m in range(i)]
        for j in range(i):
            acc = zero
            for m in range(j, i):
                acc = acc + dot_f32(N[m], X[m, j], precision)
            X[i, j] = -dot_f32(X[i, i], acc, precision)
        for j in range(nb):
            x_ref[blk(i), blk(j)] = X[i, j] if j <= i else zero


def _wu_body(k_ref, v_ref, G_ref, beta_ref, x_ref, kdT_ref, w_ref, u_ref, decay_ref, *, precision, block=64):
    """W, U, kd^T and decay of one chunk from its inverse ``X``.

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
        kdT, decay_ref[cols, :] = chunk_decays(k, G)
        kdT_ref[cols, :] = kdT.astype(kdT_ref.dtype)
        w_ref[:, cols] = dot_f32(X, beta * k * fast_exp(G), precision).astype(w_ref.dtype)
        return carry

    def v_slice(p, carry):
        cols = pl.ds(pl.multiple_of(p * vb, vb), vb)
        u_ref[:, cols] = dot_f32(X, beta * v_ref[:, cols].astype(_F32), precision).astype(u_ref.dtype)
        return carry

    jax.lax.fori_loop(0, K // kb, k_slice, 0)
    jax.lax.fori_loop(0, V // vb, v_slice, 0)


def inverse_call(N, *, precision, compiler_params=None, interpret=False):
    """Every chunk's ``X = (I + N)^-1``: ``N f32[HV, TT, C]`` (strictly lower per chunk) in,
    ``X f32[HV, TT, C]`` out."""
    HV, TT, C = N.shape
    rows = lambda width: pl.BlockSpec((None, C, width), lambda c, h: (h, c, 0))
    return pl.pallas_call(
        partial(_inverse_body, precision=precision),
        grid=(TT // C, HV),
        in_specs=[rows(C)],
        out_specs=rows(C),
        out_shape=jax.ShapeDtypeStruct((HV, TT, C), _F32),
        compiler_params=compiler_params,
        interpret=interpret,
    )(N)


def wu_call(k, v, G, beta, X, *, precision, store_dtype=_F32, compiler_params=None, interpret=False):
    """Token-major ``k [TT, H, K]``, ``v [TT, HV, V]``, ``G [TT, HV, K]`` float32, ``beta [TT, HV, 1]``,
    ``X f32[HV, TT, C]`` (every chunk's inverse). Returns ``kd^T [HV, NC, K, C]``, ``W [HV, TT, K]``,
    ``U [HV, TT, V]`` in ``store_dtype`` and ``decay f32[HV, NC, K, 1]``."""
    (TT, H, K), (_, HV, V), C = k.shape, v.shape, X.shape[-1]
    rep, NC = HV // H, TT // C
    tok = lambda width, qk: pl.BlockSpec((C, None, width), lambda c, h, *_: (c, h // rep if qk else h, 0))
    rows = lambda width: pl.BlockSpec((None, C, width), lambda c, h: (h, c, 0))
    per_chunk = lambda width: pl.BlockSpec((None, None, K, width), lambda c, h: (h, c, 0, 0))
    st = lambda *shape: jax.ShapeDtypeStruct(shape, store_dtype)
    return pl.pallas_call(
        partial(_wu_body, precision=precision),
        grid=(NC, HV),
        in_specs=[tok(K, True), tok(V, False), tok(K, False), tok(1, False), rows(C)],
        out_specs=[per_chunk(C), rows(K), rows(V), per_chunk(1)],
        out_shape=[st(HV, NC, K, C), st(HV, TT, K), st(HV, TT, V), jax.ShapeDtypeStruct((HV, NC, K, 1), _F32)],
        compiler_params=compiler_params,
        interpret=interpret,
    )(k, v, G, beta, X)
