"""Paged attention over MLA latents for decode and speculative-window queries (absorbed MLA):
each query reads only its own context's pages, tile by tile, with an online softmax, instead of
gathering the batch's whole context bucket (the pure-JAX step's form).

GPU kernel on the Pallas Triton lowering (interpreted on CPU for tests). Grid ``(Q, S, heads /
block)``: one program per (query row, split of its context, block of heads, :func:`head_block`);
a program walks its split in tiles of ``tile`` tokens, loads each tile's latent rows from the
row's page (the page id from the block table), and keeps ``m``, ``l`` and the weighted latent sum
``acc [block, L]`` in registers; the splits are merged afterwards (flash decoding). The TPU
(Mosaic) version, with the same contract, is :mod:`pallas_kernels.mla.paged_decode_tpu`
(``backend="tpu"``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.decode import default_interpret, pages_on_tpu
from pallas_kernels.kda.gpu_common import check_offset_width
from pallas_kernels.mla._words import check_latents, unpack
from pallas_kernels.mla.paged_decode_tpu import paged_mla_decode_tpu

_F32 = jnp.float32


TILE = 64  # context tokens a program scores at a time (page_tokens must be a multiple)


def _kernel(bt_ref, len_ref, layer_ref, ql_ref, qr_ref, lat_ref, o_ref, m_ref, l_ref, *, page_tokens: int, tile: int,
            per_split: int, scale: float, L: int, H: int, dtype):
    q, sp = pl.program_id(0), pl.program_id(1)
    heads = pl.ds(pl.program_id(2) * H, H)  # this program's block of H heads
    lo = sp * per_split
    hi = jnp.minimum(lo + per_split, len_ref[q])
    base = layer_ref[0] * page_tokens
    parts = ql_ref.shape[0]  # values per word
    qs = [ql_ref[j, q, heads] for j in range(parts)] + [qr_ref[j, q, heads] for j in range(parts)]  # [H, n / parts]
    dot = functools.partial(jnp.dot, preferred_element_type=_F32,
                            precision=jax.lax.Precision.HIGHEST if dtype == _F32 else None)

    def score(a, b):  # [H, n] x [tile, n] -> [H, tile]; Triton dots need n >= 16
        return dot(a, b.T) if b.shape[-1] >= 16 else jnp.sum(a[:, None, :].astype(_F32) * b[None].astype(_F32), -1)

    def body(it, carry):
        m, l, acc = carry
        t0 = lo + it * tile
        page = jnp.clip(bt_ref[q, t0 // page_tokens], 0, lat_ref.shape[0] - 1)  # a bad table reads in the pool
        rows, Lw = pl.ds(base + t0 % page_tokens, tile), L // parts
        kl = unpack(lat_ref[page, rows, pl.ds(0, Lw)], dtype)  # parts of [tile, L / parts]
        kr = unpack(lat_ref[page, rows, pl.ds(Lw, lat_ref.shape[2] - Lw)], dtype)  # parts of [tile, R / parts]
        s = sum(score(a, b) for a, b in zip(qs, kl + kr)) * scale  # [H, tile]
        s = jnp.where((t0 + jnp.arange(tile))[None, :] < hi, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new[:, None])
        acc = tuple(a * alpha[:, None] + dot(p.astype(dtype), k) for a, k in zip(acc, kl))
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    init = (jnp.full((H,), -jnp.inf, _F32), jnp.zeros((H,), _F32), (jnp.zeros((H, L // parts), _F32),) * parts)
    m, l, acc = jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(hi - lo, 0), tile), body, init)
    for j in range(parts):
        o_ref[q, sp, j, heads] = acc[j]
    m_ref[q, sp, heads] = m
    l_ref[q, sp, heads] = l


def head_block(H: int) -> int:
    """Heads one program scores (Triton's arrays are powers of two, its dots at least 16 rows):
    all of them when that is a power of two up to 64 (at least 16), else 32 at a time (K3's 96
    heads: three blocks; the heads are padded to a whole number of blocks). Each block reads the
    row's latents again, so fewer, larger blocks read less; 32 keeps the accumulator in registers."""
    n = max(H, 16)
    if n <= 64 and n & (n - 1) == 0:
        return n
    return 32 if H > 32 else 1 << (n - 1).bit_length()


@functools.partial(jax.jit, static_argnames=("page_tokens", "scale", "tile", "splits", "interpret", "backend"))
def paged_mla_decode(q_lat, q_rope, latents, block_tables, lengths, layer, *, page_tokens: int, scale: float,
                     tile: int = TILE, splits: int | None = None, interpret=None, backend: str | None = None):
    """``softmax(scale * (q_lat . lat[:, :L] + q_rope . lat[:, L:])) @ lat[:, :L]`` over each query
    row's first ``lengths[i]`` tokens.

    Args:
      q_lat: ``[Q, H, L]`` (q_nope through ``w_uk``); q_rope: ``[Q, H, R]``; in the latents' dtype
        (float32 or bfloat16).
      latents: ``u32[N, rows, (L + R) * itemsize / 4]``, the pool's words (:func:`k3jax.model.pool.latent_words`;
        the kernel unpacks them: a bitcast outside it would make XLA copy the whole pool): page
        ``p``'s row ``layer * page_tokens + t`` is token ``t`` of that page for MLA layer ``layer``.
      block_tables: ``i32[Q, blocks]`` each query row's page ids; lengths: ``i32[Q]`` tokens it
        attends to (0: none, output 0); layer: ``i32`` scalar (may be traced).
      page_tokens: a multiple of ``tile``; splits: programs per query row (None: enough for the
        GPU's cores at small batch); interpret: None interprets on CPU and compiles elsewhere;
      backend: "gpu" (Triton), "tpu" (Mosaic: one program per page, ``tile`` and ``splits``
        unused; ``interpret`` True or ``pltpu.InterpretParams`` for the Mosaic interpreter), None:
        "tpu" on a TPU, else "gpu".
    Returns:
      ``f32[Q, H, L]``.
    """
    if pages_on_tpu(backend):
        return paged_mla_decode_tpu(q_lat, q_rope, latents, block_tables, lengths, layer, page_tokens=page_tokens,
                                    scale=scale, interpret=default_interpret(interpret))
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    Q, H, L = q_lat.shape
    dtype = jnp.dtype(q_lat.dtype)
    parts = check_latents(q_lat, q_rope, latents)
    check_offset_width("latents", latents)
    if page_tokens % tile:
        raise ValueError(f"page_tokens {page_tokens} must be a multiple of tile {tile}")
    context = block_tables.shape[1] * page_tokens
    hb = head_block(H)
    Hp = -(-H // hb) * hb
    if splits is None:
        splits = max(1, min(context // tile, -(-132 * 2 // max(Q * (Hp // hb), 1))))
    per_split = -(-context // splits // tile) * tile
    # [Q, H, n] -> [parts, Q, Hp, n / parts]: the values each part of a word holds
    split = lambda x: jnp.moveaxis(jnp.pad(x, ((0, 0), (0, Hp - H), (0, 0))).reshape(Q, Hp, -1, parts), -1, 0)
    out_shape = (jax.ShapeDtypeStruct((Q, splits, parts, Hp, L // parts), _F32),
                 jax.ShapeDtypeStruct((Q, splits, Hp), _F32), jax.ShapeDtypeStruct((Q, splits, Hp), _F32))
    kernel = functools.partial(_kernel, page_tokens=page_tokens, tile=tile, per_split=per_split, scale=scale, L=L,
                               H=hb, dtype=dtype)
    acc, m, l = pl.pallas_call(kernel, grid=(Q, splits, Hp // hb), out_shape=out_shape, interpret=interpret,
                               name="paged_mla_decode")(
        block_tables.astype(jnp.int32), lengths.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32),
        split(q_lat), split(q_rope.astype(dtype)), latents)
    top = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - jnp.where(jnp.isfinite(top), top, 0.0))  # empty splits (m = -inf) weigh 0
    total = jnp.sum(w * l, axis=1)
    o = jnp.sum(w[:, :, None, :, None] * acc, axis=1) / jnp.where(total > 0, total, 1.0)[:, None, :, None]
    return jnp.moveaxis(o, 1, -1).reshape(Q, Hp, L)[:, :H]  # the parts interleaved again
