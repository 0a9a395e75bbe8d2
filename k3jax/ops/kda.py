"""Kimi Delta Attention (KDA): the pure-JAX references every kernel is judged by.

Layouts follow flash-linear-attention: ``q, k: [B, T, H, K]``, ``v: [B, T, HV, V]``,
``g: [B, T, HV, K]`` (log decay, <= 0), ``beta: [B, T, HV]``, states ``[N, HV, K, V]`` float32
(K-first). ``HV % H == 0`` (GVA: value head ``i`` reads q/k head ``i // (HV // H)``). Varlen
inputs are packed with ``B == 1`` and ``cu_seqlens: i32[N + 1]``; tokens at or after
``cu_seqlens[-1]`` are padding: they never touch a state and their outputs are 0.

All math runs in float32 with HIGHEST matmul precision; outputs are cast to ``v.dtype``.
The derivation of the chunked form and its numerics is in ``k3jax/ops/README.md``.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
SUB_CHUNK = 16
_einsum = partial(jnp.einsum, precision=HIGHEST)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """L2-normalise over the last axis in float32: ``x / sqrt(sum(x^2) + eps)``.

    Args:
      x: ``[..., K]`` any float dtype.
    Returns:
      the normalised array in ``x.dtype``.
    """
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def kda_gate(
    g_raw: jax.Array, A_log: jax.Array, dt_bias: jax.Array, *, lower_bound: float | None = None
) -> jax.Array:
    """The KDA forget gate in log space (float32, always <= 0).

    Kimi Linear: ``g = -exp(A_log) * softplus(g_raw + dt_bias)``.
    Kimi K3 (``lower_bound`` set, e.g. -5): ``g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))``.

    Args:
      g_raw: ``[..., HV, K]`` the gate projection output.
      A_log: ``[HV]`` one log-rate per value head.
      dt_bias: ``[HV * K]`` per-channel bias.
      lower_bound: None for the softplus form, a negative float for the K3 form.
    Returns:
      ``f32[..., HV, K]``.
    """
    HV, K = g_raw.shape[-2:]
    if A_log.shape[-1] != HV or dt_bias.size != HV * K:
        raise ValueError(f"A_log {A_log.shape} / dt_bias {dt_bias.shape} do not match g_raw heads x K = {HV} x {K}")
    x = g_raw.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(HV, K)
    a = jnp.exp(A_log.astype(jnp.float32).reshape(HV, 1))
    if lower_bound is None:
        return -a * jax.nn.softplus(x)
    if lower_bound >= 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    return lower_bound * jax.nn.sigmoid(a * x)


class KdaDims(NamedTuple):
    """Sizes of a KDA call: batch rows, tokens per row, q/k heads, value heads, key and value head
    dims, sequences (``B``, or ``len(cu_seqlens) - 1`` for packed varlen inputs)."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int


def check_kda_inputs(q, k, v, g, beta, initial_state=None, cu_seqlens=None, *, chunk_size=None,
                     checkpoint_stride=None) -> KdaDims:
    """Static checks of a KDA call's arguments (shapes, GVA, varlen packing, and for the chunked
    forms ``chunk_size`` in {16, 32, 64} and ``checkpoint_stride`` a positive multiple of it);
    raises ``ValueError`` naming the first bad one. Shared by every KDA entry point (references,
    Pallas kernels, context parallelism). Returns the call's :class:`KdaDims`."""
    if chunk_size is not None and chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    if checkpoint_stride is not None and (checkpoint_stride <= 0 or checkpoint_stride % (chunk_size or 1)):
        raise ValueError(f"checkpoint_stride {checkpoint_stride} must be a positive multiple of chunk_size {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    if k.shape != q.shape:
        raise ValueError(f"k {k.shape} must match q {q.shape}")
    if v.shape[:2] != (B, T) or g.shape != (B, T, HV, K) or beta.shape != (B, T, HV):
        raise ValueError(
            f"expected v [B,T,HV,V], g [B,T,HV,K], beta [B,T,HV] with B={B} T={T} K={K}; "
            f"got v {v.shape}, g {g.shape}, beta {beta.shape}"
        )
    if HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of q/k heads H={H}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"varlen inputs must be packed with B == 1, got B={B}")
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be i32[N + 1] with N >= 1, got {cu_seqlens.shape}")
        N = cu_seqlens.shape[0] - 1
    else:
        N = B
    if initial_state is not None and initial_state.shape != (N, HV, K, V):
        raise ValueError(f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)}, got {initial_state.shape}")
    return KdaDims(B, T, H, HV, K, V, N)


def _flatten(q, k, v, g, beta, cu_seqlens, use_qk_l2norm):
    """Flatten batch into one packed float32 stream with GVA expanded.

    Returns (q, k, v, g, beta) as ``[T', HV, *]`` float32 and ``cu_seqlens`` (i32[N + 1]).
    """
    B, T, H = q.shape[:3]
    HV = v.shape[2]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    rep = HV // H
    f32 = lambda x: x.astype(jnp.float32).reshape(B * T, *x.shape[2:])
    q = jnp.repeat(f32(q), rep, axis=1)
    k = jnp.repeat(f32(k), rep, axis=1)
    if cu_seqlens is None:
        cu_seqlens = jnp.arange(B + 1, dtype=jnp.int32) * T
    return q, k, f32(v), f32(g), f32(beta), cu_seqlens.astype(jnp.int32)


def _token_seq_ids(cu_seqlens: jax.Array, T: int) -> jax.Array:
    """Sequence index of every packed token; ``N`` marks padding past ``cu_seqlens[-1]``."""
    t = jnp.arange(T, dtype=jnp.int32)
    return jnp.searchsorted(cu_seqlens, t, side="right").astype(jnp.int32) - 1


def _delta_step(S, q, k, v, g, beta):
    """One token of the recurrence for all heads. S: [HV, K, V]; q, k, g: [HV, K]; v: [HV, V]; beta: [HV]."""
    S = S * jnp.exp(g)[..., None]
    u = beta[:, None] * (v - _einsum("hk,hkv->hv", k, S))
    S = S + k[..., None] * u[:, None, :]
    return _einsum("hk,hkv->hv", q, S), S


def naive_recurrent_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False
):
    """Token-by-token KDA in float32: the reference for everything else.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]`` log decay;
      beta: ``[B, T, HV]``.
      scale: query scale, default ``K ** -0.5``.
      initial_state: ``f32[N, HV, K, V]`` or None (zeros).
      cu_seqlens: ``i32[N + 1]`` for packed varlen inputs (``B == 1``), else None (``N = B``).
      use_qk_l2norm: L2-normalise q and k first.
    Returns:
      ``(o [B, T, HV, V] in v.dtype, final_state f32[N, HV, K, V])``.
    """
    B, T, H, HV, K, V, N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta, cu = _flatten(q, k, v, g, beta, cu_seqlens, use_qk_l2norm)
    TT = q.shape[0]
    seq = _token_seq_ids(cu, TT)
    t = jnp.arange(TT, dtype=jnp.int32)
    valid = seq < N
    seq_c = jnp.minimum(seq, N - 1)
    is_first = valid & (cu[seq_c] == t)
    is_last = valid & (cu[seq_c + 1] - 1 == t)
    init = jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def step(carry, x):
        S, final = carry
        qt, kt, vt, gt, bt, s, first, last, ok = x
        S = jnp.where(first, init[s], S)
        o, S_new = _delta_step(S, qt * scale, kt, vt, gt, bt)
        S = jnp.where(ok, S_new, S)
        final = final.at[s].set(jnp.where(last, S, final[s]))
        return (S, final), jnp.where(ok, o, 0.0)

    xs = (q, k, v, g, beta, seq_c, is_first, is_last, valid)
    (_, final), o = jax.lax.scan(step, (jnp.zeros((HV, K, V), jnp.float32), init), xs)
    return o.reshape(B, T, HV, V).astype(output_dtype(v)), final


def output_dtype(v):
    """The dtype of a call's outputs: ``v``'s if floating, else float32."""
    return v.dtype if jnp.issubdtype(v.dtype, jnp.floating) else jnp.float32


class ChunkPrep(NamedTuple):
    """The token-parallel stage of chunked KDA, every chunk at once (``[NC, HV, C, *]``).

    ``qg = scale * q * exp(G)``, ``kd = k * exp(G_C - G)``, ``decay = exp(G_C)`` (``[NC, HV, K]``),
    ``Aqk`` (causal, scaled), ``W = T (beta k exp(G))``, ``U = T (beta v)`` with ``T = (I + Akk)^-1``.
    """

    qg: jax.Array
    kd: jax.Array
    decay: jax.Array
    Aqk: jax.Array
    W: jax.Array
    U: jax.Array


def _intra_chunk_scores(a, k, G, sub, strict):
    """``A[r, c] = sum_d a_rd k_cd exp(G_rd - G_cd)`` for ``c <= r`` (``c < r`` when strict), else 0.

    Off-diagonal sub-blocks are matmuls with both factors anchored at the first row of the row
    sub-chunk (at or before every row, after every column: both exponents <= 0, and no future
    gate enters a past row). Diagonal sub-blocks use exact pairwise differences.

    a, k, G: ``[NC, HV, C, K]`` float32. Returns ``[NC, HV, C, C]``.
    """
    NC, HV, C, K = a.shape
    ns = C // sub
    a_s, k_s, G_s = (x.reshape(NC, HV, ns, sub, K) for x in (a, k, G))
    anchor = G_s[:, :, :, 0]  # [NC, HV, ns, K]
    a_anc = a_s * jnp.exp(G_s - anchor[:, :, :, None])
    col_sub = jnp.arange(C) // sub
    earlier = col_sub[None, :] < jnp.arange(ns)[:, None]  # [ns, C]: column sub-chunk before row sub-chunk
    expo = jnp.where(earlier[:, :, None], anchor[:, :, :, None, :] - G[:, :, None, :, :], -jnp.inf)
    k_anc = k[:, :, None] * jnp.exp(expo)  # [NC, HV, ns, C, K]
    off = _einsum("nhisd,nhicd->nhisc", a_anc, k_anc)

    r, c = jnp.arange(sub)[:, None], jnp.arange(sub)[None, :]
    keep = (r > c) if strict else (r >= c)
    # Exact pairwise differences G_r - G_c (<= 0 where kept); XLA fuses this into one reduction.
    e = jnp.exp(jnp.where(keep[..., None], G_s[:, :, :, :, None] - G_s[:, :, :, None], -jnp.inf))
    diag = jnp.sum(a_s[:, :, :, :, None] * k_s[:, :, :, None] * e, axis=-1)  # [NC, HV, ns, sub(r), sub(c)]
    diag = _einsum("nhirj,ik->nhirkj", diag, jnp.eye(ns, dtype=diag.dtype)).reshape(NC, HV, ns, sub, C)
    return (off + diag).reshape(NC, HV, C, C)


def chunk_prep(q, k, v, g, beta, scale: float) -> ChunkPrep:
    """Token-parallel stage on chunked float32 inputs ``[NC, HV, C, *]`` (beta ``[NC, HV, C]``).

    ``q`` may be None when only the state map is needed (then ``qg`` and ``Aqk`` are None).
    """
    C = k.shape[2]
    sub = min(SUB_CHUNK, C)
    G = jnp.cumsum(g, axis=2)
    Aqk = None if q is None else scale * _intra_chunk_scores(q, k, G, sub, strict=False)
    Akk = beta[..., None] * _intra_chunk_scores(k, k, G, sub, strict=True)
    eye = jnp.eye(C, dtype=jnp.float32)
    rhs = jnp.concatenate([beta[..., None] * k * jnp.exp(G), beta[..., None] * v], axis=-1)
    # Forward substitution in float32: series inverses cancel catastrophically on repeated keys.
    WU = jax.lax.linalg.triangular_solve(eye + Akk, rhs, left_side=True, lower=True, unit_diagonal=True)
    K = k.shape[-1]
    G_last = G[:, :, -1:, :]
    return ChunkPrep(
        qg=None if q is None else scale * q * jnp.exp(G),
        kd=k * jnp.exp(G_last - G),
        decay=jnp.exp(G_last[:, :, 0]),
        Aqk=Aqk,
        W=WU[..., :K],
        U=WU[..., K:],
    )


def chunk_step(S, p: ChunkPrep):
    """One chunk of the recurrent stage for one chunk's ``ChunkPrep`` (leading NC dropped).

    S: ``f32[HV, K, V]``. Returns ``(o [HV, C, V], S')``.
    """
    v_new = p.U - _einsum("hck,hkv->hcv", p.W, S)
    o = _einsum("hck,hkv->hcv", p.qg, S) + _einsum("hcs,hsv->hcv", p.Aqk, v_new)
    S = p.decay[..., None] * S + _einsum("hck,hcv->hkv", p.kd, v_new)
    return o, S


def chunk_summary(p: ChunkPrep):
    """The affine map ``S -> M S + E`` of every chunk: ``M [NC, HV, K, K]``, ``E [NC, HV, K, V]``."""
    K = p.kd.shape[-1]
    M = p.decay[..., :, None] * jnp.eye(K, dtype=jnp.float32) - _einsum("nhck,nhcj->nhkj", p.kd, p.W)
    E = _einsum("nhck,nhcv->nhkv", p.kd, p.U)
    return M, E


def combine_segments(first, second):
    """Compose two segment maps, ``first`` applied before ``second``: ``(M2 M1, M2 E1 + E2)``.

    Args:
      first, second: ``(M [..., HV, K, K], E [..., HV, K, V])`` with broadcastable leading axes.
    """
    M1, E1 = first
    M2, E2 = second
    return _einsum("...ij,...jk->...ik", M2, M1), _einsum("...ij,...jv->...iv", M2, E1) + E2


def _sequence_maps(prep: ChunkPrep, lay, N):
    """Each sequence's state map ``(M f32[N, HV, K, K], E f32[N, HV, K, V])`` from its chunks' maps:
    a segmented associative scan (a sequence's first chunk restarts it); identity when empty."""
    M, E = chunk_summary(prep)

    def combine(a, b):
        (fa, *ma), (fb, *mb) = a, b
        restart = fb[:, None, None, None]
        M, E = combine_segments(ma, mb)
        return fa | fb, jnp.where(restart, mb[0], M), jnp.where(restart, mb[1], E)

    _, M, E = jax.lax.associative_scan(combine, (lay.first, M, E))
    has = (lay.cstart[1:] > lay.cstart[:-1])[:, None, None, None]
    last = jnp.maximum(lay.cstart[1:] - 1, 0)
    eye = jnp.eye(M.shape[-1], dtype=jnp.float32)
    return jnp.where(has, M[last], eye), jnp.where(has, E[last], 0.0)


def sequence_maps(k, v, g, beta, *, cu_seqlens=None, chunk_size: int = 64):
    """The affine state map of every sequence (each row, or each ``cu_seqlens`` sequence):
    ``final = M @ initial + E`` per head, from the sequence's own tokens.

    Returns ``(M f32[N, HV, K, K], E f32[N, HV, K, V])``; an empty sequence gives ``(I, 0)``.
    """
    B, T, H, HV, K, V, N = check_kda_inputs(k, k, v, g, beta, None, cu_seqlens)
    _, kf, vf, gf, bf, cu = _flatten(k, k, v, g, beta, cu_seqlens, False)
    lay = chunk_layout(cu, kf.shape[0], chunk_size, N, None)
    prep = chunk_prep(None, *(_to_chunks(x, lay, chunk_size) for x in (kf, vf, gf, bf)), 1.0)
    return _sequence_maps(prep, lay, N)


class ChunkLayout(NamedTuple):
    """Chunk-aligned packing of varlen sequences: every sequence starts on a chunk boundary."""

    src: jax.Array  # i32[NC * C] packed token feeding each padded slot (clipped)
    ok: jax.Array  # bool[NC * C] slot holds a real token
    dst: jax.Array  # i32[T] padded slot of each packed token (clipped)
    tok_ok: jax.Array  # bool[T] token is real (before cu_seqlens[-1])
    chunk_seq: jax.Array  # i32[NC] sequence of each chunk, clipped to N - 1
    first: jax.Array  # bool[NC]
    last: jax.Array  # bool[NC]
    ckpt: jax.Array  # i32[NC] checkpoint index written after this chunk, or -1
    lens: jax.Array  # i32[N] sequence lengths
    cstart: jax.Array  # i32[N + 1] first chunk of each sequence (and the end)


def chunk_layout(cu, T, C, N, stride) -> ChunkLayout:
    """The chunk-aligned packing of ``T`` packed tokens in ``N`` sequences (``cu i32[N + 1]``) into
    chunks of ``C`` tokens, with the checkpoint written after each chunk every ``stride`` tokens
    of its sequence (``stride`` None: none)."""
    lens = cu[1:] - cu[:-1]
    nch = (lens + C - 1) // C
    cstart = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(nch).astype(jnp.int32)])  # i32[N + 1]
    NC = -(-T // C) + N
    j = jnp.arange(NC, dtype=jnp.int32)
    s = jnp.searchsorted(cstart, j, side="right").astype(jnp.int32) - 1
    chunk_ok = s < N
    s_c = jnp.minimum(s, N - 1)
    local = j - cstart[s_c]
    p = jnp.arange(NC * C, dtype=jnp.int32)
    off = p - jnp.repeat(cstart[s_c], C) * C
    ok = jnp.repeat(chunk_ok, C) & (off < jnp.repeat(lens[s_c], C))
    src = jnp.clip(jnp.repeat(cu[s_c], C) + off, 0, T - 1)
    seq = _token_seq_ids(cu, T)
    tok_ok = seq < N
    seq_c = jnp.minimum(seq, N - 1)
    dst = jnp.where(tok_ok, cstart[seq_c] * C + jnp.arange(T) - cu[seq_c], 0)
    end = (local + 1) * C
    if stride is None:
        ckpt = jnp.full((NC,), -1, jnp.int32)
    else:
        ckpt = jnp.where(chunk_ok & (end % stride == 0) & (end <= lens[s_c]), end // stride - 1, -1)
    return ChunkLayout(
        src=src,
        ok=ok,
        dst=dst,
        tok_ok=tok_ok,
        chunk_seq=s_c,
        first=chunk_ok & (local == 0),
        last=chunk_ok & (local == nch[s_c] - 1),
        ckpt=ckpt,
        lens=lens,
        cstart=cstart,
    )


def _to_chunks(x, lay: ChunkLayout, C):
    """Packed ``[T, HV, *]`` -> ``[NC, HV, C, *]`` with 0 in padded slots (NaN padding never leaks)."""
    y = x[lay.src]
    y = jnp.where(lay.ok.reshape((-1,) + (1,) * (y.ndim - 1)), y, 0.0)
    y = y.reshape(-1, C, *x.shape[1:])
    return jnp.moveaxis(y, 1, 2)


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    chunk_size: int = 64,
    checkpoint_stride: int | None = None,
    use_qk_l2norm: bool = False,
    initial_state_fn=None,
):
    """Chunked KDA in XLA: a token-parallel stage over all chunks, then a scan over chunks.

    Same arguments as :func:`naive_recurrent_kda`, plus:
      chunk_size: 16, 32 or 64.
      checkpoint_stride: if set (a multiple of ``chunk_size``, e.g. 512), also return the state
        after every ``checkpoint_stride`` tokens of each sequence (counted from its start).
      initial_state_fn: if set, called once with every sequence's own state map
        ``(M [N, HV, K, K], E [N, HV, K, V])`` (as :func:`sequence_maps`) and returning the
        initial states ``[N, HV, K, V]`` to run from (``initial_state`` is then ignored). Context
        parallelism exchanges and folds the maps there, so the token-parallel stage runs once.
    Returns:
      ``(o, final_state)``, or ``(o, final_state, checkpoints)`` when ``checkpoint_stride`` is set;
      ``checkpoints: f32[N, L // stride, HV, K, V]`` with ``L`` the longest possible sequence
      (``T``); entry ``j`` of sequence ``n`` holds the state after ``(j + 1) * stride`` tokens
      and is valid for ``j < len_n // stride`` (0 beyond).
    """
    B, T, H, HV, K, V, N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size=chunk_size,
                                            checkpoint_stride=checkpoint_stride)
    scale = K**-0.5 if scale is None else scale
    out_dtype = output_dtype(v)
    C = chunk_size
    qf, kf, vf, gf, bf, cu = _flatten(q, k, v, g, beta, cu_seqlens, use_qk_l2norm)
    TT = qf.shape[0]
    lay = chunk_layout(cu, TT, C, N, checkpoint_stride)
    prep = chunk_prep(*(_to_chunks(x, lay, C) for x in (qf, kf, vf, gf, bf)), scale)
    init = jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    if initial_state_fn is not None:
        init = initial_state_fn(*_sequence_maps(prep, lay, N)).astype(jnp.float32)
    n_ckpt = 0 if checkpoint_stride is None else T // checkpoint_stride
    ckpts = jnp.zeros((N, max(n_ckpt, 1), HV, K, V), jnp.float32)

    def step(carry, x):
        S, final, ck = carry
        p, s, first, last, ci = x
        S = jnp.where(first, init[s], S)
        o, S = chunk_step(S, p)
        final = final.at[s].set(jnp.where(last, S, final[s]))
        ci_c = jnp.maximum(ci, 0)
        ck = ck.at[s, ci_c].set(jnp.where(ci >= 0, S, ck[s, ci_c]))
        return (S, final, ck), o

    xs = (prep, lay.chunk_seq, lay.first, lay.last, lay.ckpt)
    (_, final, ckpts), o = jax.lax.scan(step, (jnp.zeros((HV, K, V), jnp.float32), init, ckpts), xs)
    o = jnp.moveaxis(o, 1, 2).reshape(-1, HV, V)[lay.dst]
    o = jnp.where(lay.tok_ok[:, None, None], o, 0.0).reshape(B, T, HV, V).astype(out_dtype)
    if checkpoint_stride is None:
        return o, final
    return o, final, ckpts[:, :n_ckpt]


def kda_decode_step(state, q, k, v, g, beta, *, scale=None):
    """One decode token on a dense state.

    Args:
      state: ``f32[B, HV, K, V]``; q, k: ``[B, H, K]``; v: ``[B, HV, V]``; g: ``[B, HV, K]``;
      beta: ``[B, HV]``.
    Returns:
      ``(o [B, HV, V] in v.dtype, new_state f32[B, HV, K, V])``.
    """
    o, S = naive_recurrent_kda(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=scale, initial_state=state
    )
    return o[:, 0], S


def _window_states(state, q, k, v, g, beta, scale):
    """Per-row scan over a speculative window; yields outputs and the state after every position."""
    B, T, H, K = k.shape
    HV = v.shape[2]
    rep = HV // H
    scale = K**-0.5 if scale is None else scale
    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)
    expand = lambda x: jnp.repeat(f32(x), rep, axis=2)

    def step(S, x):
        qt, kt, vt, gt, bt = x
        o, S = jax.vmap(_delta_step)(S, qt * scale, kt, vt, gt, bt)
        return S, (o, S)

    _, (o, states) = jax.lax.scan(step, state.astype(jnp.float32), (expand(q), expand(k), f32(v), f32(g), f32(beta)))
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)


def kda_verify(state, q, k, v, g, beta, *, scale=None):
    """Outputs for a speculative window; the state is read, never written.

    Args:
      state: ``f32[B, HV, K, V]`` the committed state; q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``;
      g: ``[B, T, HV, K]``; beta: ``[B, T, HV]``.
    Returns:
      ``o [B, T, HV, V]`` in v.dtype: position ``t`` sees the state after positions ``0..t``.
    """
    check_kda_inputs(q, k, v, g, beta, state, None)
    o, _ = _window_states(state, q, k, v, g, beta, scale)
    return o.astype(output_dtype(v))


def kda_commit(state, k, v, g, beta, num_tokens):
    """The state after each row's first ``num_tokens[b]`` window positions (0..T).

    Args:
      state: ``f32[B, HV, K, V]``; k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]``;
      beta: ``[B, T, HV]``; num_tokens: ``i32[B]``.
    Returns:
      ``f32[B, HV, K, V]``.
    """
    check_kda_inputs(k, k, v, g, beta, state, None)
    _, states = _window_states(state, k, k, v, g, beta, None)
    all_states = jnp.concatenate([state.astype(jnp.float32)[:, None], states], axis=1)
    n = jnp.clip(num_tokens, 0, k.shape[1])
    return jnp.take_along_axis(all_states, n[:, None, None, None, None], axis=1)[:, 0]
