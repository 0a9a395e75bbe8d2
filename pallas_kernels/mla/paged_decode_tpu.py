"""Paged attention over MLA latents for decode queries on TPU (Mosaic): the contract of
:func:`pallas_kernels.mla.paged_mla_decode` (the GPU kernel), one program per (query row, page).

Grid ``(Q, blocks)``, the page axis sequential: the block table, lengths and layer are scalar
prefetch, so each step's latent block is the rows ``[layer * P, (layer + 1) * P)`` of the row's
page ``block_tables[q, b]``, fetched by the pipeline (double-buffered). Pages past a row's length
map to its last page, which the pipeline does not fetch again, and are skipped. The online
softmax state (``m``, ``l``, the weighted latent sum) lives in VMEM scratch across the pages.

The latents arrive as the pool's ``u32`` words and are unpacked in VMEM (bf16: the even element
in a word's low half). Scores and the weighted sum run over whole word rows: the query's latent
and rope parts are packed the same way, and the rope columns of the sum are dropped afterwards,
so no lane-unaligned slice is taken in the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.mla._words import check_latents, unpack

_F32 = jnp.float32


def _kernel(bt_ref, len_ref, layer_ref, q_ref, lat_ref, o_ref, m_ref, l_ref, acc_ref, *, page_tokens: int,
            scale: float, dtype):
    q, b = pl.program_id(0), pl.program_id(1)
    n = len_ref[q]
    parts = q_ref.shape[0]
    dot = functools.partial(jnp.dot, preferred_element_type=_F32,
                            precision=jax.lax.Precision.HIGHEST if dtype == _F32 else None)

    @pl.when(b == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, _F32)
        l_ref[...] = jnp.zeros(l_ref.shape, _F32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, _F32)

    @pl.when(b * page_tokens < n)
    def _():
        ks = unpack(lat_ref[...], dtype)  # parts of [P, words]
        s = sum(dot(q_ref[j], k.T) for j, k in enumerate(ks)) * scale  # [H, P]
        pos = b * page_tokens + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(pos < n, s, -jnp.inf)
        m = m_ref[...]  # [H, 1]
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new)
        l_ref[...] = l_ref[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        for j, k in enumerate(ks):
            acc_ref[j] = acc_ref[j] * alpha + dot(p.astype(dtype), k)
        m_ref[...] = m_new

    @pl.when(b == pl.num_programs(1) - 1)
    def _():
        l = l_ref[...]
        o_ref[...] = acc_ref[...] / jnp.where(l > 0, l, 1.0)[None]


@functools.partial(jax.jit, static_argnames=("page_tokens", "scale", "interpret"))
def paged_mla_decode_tpu(q_lat, q_rope, latents, block_tables, lengths, layer, *, page_tokens: int, scale: float,
                         interpret=False):
    """As :func:`pallas_kernels.mla.paged_mla_decode` (same arguments and result; no ``tile`` or
    ``splits``: a page is a step). ``interpret``: False compiles for the TPU; True or
    ``pltpu.InterpretParams`` runs the Mosaic interpreter (CPU tests)."""
    Q, H, L = q_lat.shape
    R = q_rope.shape[-1]
    dtype = jnp.dtype(q_lat.dtype)
    parts = check_latents(q_lat, q_rope, latents)
    words = latents.shape[-1]
    N, blocks = latents.shape[0], block_tables.shape[1]
    # [Q, H, L + R] -> [parts, Q, H, words]: the values each half of a word holds
    qs = jnp.concatenate([q_lat, q_rope.astype(dtype)], axis=-1).reshape(Q, H, words, parts)
    qs = jnp.moveaxis(qs, -1, 0)

    def page(q, b, bt, lengths, layer):
        last = jnp.maximum(pl.cdiv(lengths[q], page_tokens) - 1, 0)  # past the length: no new fetch
        return jnp.clip(bt[q, jnp.minimum(b, last)], 0, N - 1), layer[0], 0

    kernel = functools.partial(_kernel, page_tokens=page_tokens, scale=scale, dtype=dtype)
    acc = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(Q, blocks),
            in_specs=[pl.BlockSpec((parts, None, H, words), lambda q, b, *_: (0, q, 0, 0)),
                      pl.BlockSpec((None, page_tokens, words), page)],
            out_specs=pl.BlockSpec((None, parts, H, words), lambda q, b, *_: (q, 0, 0, 0)),
            scratch_shapes=[pltpu.VMEM((H, 1), _F32), pltpu.VMEM((H, 1), _F32), pltpu.VMEM((parts, H, words), _F32)],
        ),
        out_shape=jax.ShapeDtypeStruct((Q, parts, H, words), _F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
        name="paged_mla_decode_tpu",
    )(block_tables.astype(jnp.int32), lengths.astype(jnp.int32), jnp.reshape(layer, (1,)).astype(jnp.int32),
      qs, latents)
    return jnp.moveaxis(acc, 1, -1).reshape(Q, H, L + R)[..., :L]  # the parts interleaved again, rope dropped
