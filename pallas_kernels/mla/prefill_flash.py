"""Causal attention of a prefill chunk's queries over one tile of its context's expanded keys and
values (MLA's expanded form: ``q_nope . k_nope + q_rope . k_rope``, the rope key shared by the
heads), fused: scores, mask, online softmax and the weighted values stay in registers, and the
running softmax state (``m``, ``l``, ``acc``) is read and written once per tile.

Without it the step's pure-JAX tile loop (:func:`k3jax.model.step.prefill_attention`) writes the
float32 scores of every (query, head, key) to memory and reads them back several times; with it
an 8192-token prefill of the 48B slice was 1.56x faster and a 131,072-token prompt's first token
3.56x sooner (H100, docs/benchmarks.md, issues 51 and 52).

GPU kernel on the Pallas Triton lowering (interpreted on CPU for tests). Grid ``(T / block_q, H)``:
one program per block of queries and head; it walks the tile's keys ``block_k`` at a time up to
the last one its queries may see (causal: the work of a chunk's early queries stops early; a block
of queries with nothing to see, such as another row's, returns at once).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.gpu_common import check_offset_width, triton_params

_F32 = jnp.float32


def _kernel(bounds_ref, pos_ref, qn_ref, qr_ref, kn_ref, kr_ref, v_ref, m_in, l_in, acc_in, m_ref, l_ref, acc_ref, *,
            scale: float, block_k: int, dtype):
    h = pl.program_id(1)
    start, length = bounds_ref[0], bounds_ref[1]
    pos = pos_ref[...]  # [bq] positions of the queries (-1: a query that sees nothing)
    hi = jnp.clip(jnp.max(pos) + 1 - start, 0, length)  # keys [0, hi) are all this block may see
    qn, qr = qn_ref[...], qr_ref[...]
    dot = functools.partial(jnp.dot, preferred_element_type=_F32,
                            precision=jax.lax.Precision.HIGHEST if dtype == _F32 else None)
    offs = jnp.arange(block_k, dtype=jnp.int32)

    def body(j, carry):
        m, l, acc = carry
        keys = pl.ds(j * block_k, block_k)
        s = (dot(qn, kn_ref[keys, h, :].T) + dot(qr, kr_ref[keys, :].T)) * scale  # [bq, bk]
        at = j * block_k + offs
        s = jnp.where((start + at[None, :] <= pos[:, None]) & (at < length)[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        base = jnp.where(m_new > -jnp.inf, m_new, 0.0)  # a query that has seen nothing yet
        p, alpha = jnp.exp(s - base[:, None]), jnp.exp(m - base)
        acc = acc * alpha[:, None] + dot(p.astype(dtype), v_ref[keys, h, :])
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    @pl.when(hi > 0)  # else the state stays as it is (the outputs are the inputs' buffers)
    def _():
        m, l, acc = jax.lax.fori_loop(0, pl.cdiv(hi, block_k), body, (m_in[...], l_in[...], acc_in[...]))
        m_ref[...], l_ref[...], acc_ref[...] = m, l, acc


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "num_warps", "num_stages", "interpret"),
                   donate_argnames=("state",))
def attend_tile(q_nope, q_rope, pos, k_nope, k_rope, v, start, length, state, *, scale: float, block_q: int = 64,
                block_k: int = 64, num_warps: int = 4, num_stages: int = 2, interpret=None):
    """One tile of an online-softmax attention, fused.

    Args:
      q_nope: ``[T, H, n]``, q_rope: ``[T, H, R]`` the queries; pos: ``i32[T]`` their positions
        (-1: a query that attends to nothing in this call).
      k_nope: ``[S, H, n]``, k_rope: ``[S, R]`` (shared by the heads), v: ``[S, H, Dv]``: the
        tile's keys and values, key ``s`` at position ``start + s``; only the first ``length``
        are real. A query at ``p`` sees the keys at positions ``<= p``.
      start, length: ``i32`` scalars (may be traced).
      state: ``(m f32[H, T], l f32[H, T], acc f32[H, T, Dv])``, the running maximum score, sum of
        weights and weighted values (start: ``-inf``, 0, 0); donated and returned updated.
      T must be a multiple of ``block_q`` and S of ``block_k``; every array in one dtype but
      ``pos`` and the state (bfloat16: 16-bit products, float32 accumulation). On a GPU the head
      sizes must be powers of two of at least 16 (:func:`pallas_kernels.kda.gpu_common.gpu_head_dims_ok`).
    Returns:
      the updated ``state``. The attention output is ``acc / l`` (where ``l > 0``).
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    T, H, n = q_nope.shape
    S, Dv = v.shape[0], v.shape[-1]
    if T % block_q or S % block_k:
        raise ValueError(f"{T} queries and {S} keys must be multiples of block_q {block_q} and block_k {block_k}")
    for name, x in (("k_nope", k_nope), ("v", v)):
        check_offset_width(name, x)
    dtype = jnp.dtype(q_nope.dtype)
    q_rows = lambda w: pl.BlockSpec((block_q, None, w), lambda i, h: (i, h, 0))
    rows = pl.BlockSpec((None, block_q), lambda i, h: (h, i))
    acc_rows = pl.BlockSpec((None, block_q, Dv), lambda i, h: (h, i, 0))
    whole = pl.BlockSpec()
    kernel = functools.partial(_kernel, scale=scale, block_k=block_k, dtype=dtype)
    bounds = jnp.stack([jnp.asarray(start, jnp.int32), jnp.asarray(length, jnp.int32)])
    return pl.pallas_call(
        kernel, grid=(T // block_q, H),
        in_specs=[whole, pl.BlockSpec((block_q,), lambda i, h: (i,)), q_rows(n), q_rows(q_rope.shape[-1]),
                  whole, whole, whole, rows, rows, acc_rows],
        out_specs=[rows, rows, acc_rows], out_shape=[jax.ShapeDtypeStruct(x.shape, _F32) for x in state],
        input_output_aliases={7: 0, 8: 1, 9: 2}, interpret=interpret, name="mla_prefill_flash",
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
    )(bounds, pos.astype(jnp.int32), q_nope, q_rope.astype(dtype), k_nope.astype(dtype), k_rope.astype(dtype),
      v.astype(dtype), *state)


def attend_tile_reference(q_nope, q_rope, pos, k_nope, k_rope, v, start, length, state, *, scale: float):
    """:func:`attend_tile` in plain JAX (float32 scores of every query and key)."""
    m, l, acc = state
    hp = jax.lax.Precision.HIGHEST
    s = (jnp.einsum("thn,shn->hts", q_nope, k_nope, precision=hp, preferred_element_type=_F32)
         + jnp.einsum("thr,sr->hts", q_rope, k_rope, precision=hp, preferred_element_type=_F32)) * scale
    at = jnp.arange(v.shape[0])
    s = jnp.where((start + at[None, :] <= pos[:, None]) & (at < length)[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    base = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    p, alpha = jnp.exp(s - base[..., None]), jnp.exp(m - base)
    pv = jnp.einsum("hts,shv->htv", p.astype(v.dtype), v, precision=hp, preferred_element_type=_F32)
    return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv
