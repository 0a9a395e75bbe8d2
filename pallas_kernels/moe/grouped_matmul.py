"""Grouped matmul over dense (bf16 or float32) experts for decode-sized groups, with the contract
of :func:`jax.lax.ragged_dot`: ``lhs [M, K]`` rows sorted by group, ``rhs [G, K, N]``, group ``g``
holding rows ``[sum(sizes[:g]), sum(sizes[:g + 1]))``.

A decode step routes a few tokens to each expert, so it is bound by reading the experts once.
GPU kernel on the Pallas Triton lowering (interpreted on CPU for tests), laid out as
:mod:`pallas_kernels.moe.mxfp4_matmul`: grid ``(G, N / block_n)``, one program per (group,
column tile), which walks its group's rows ``block_m`` at a time and the contracted axis
``block_k`` at a time; an empty group reads nothing. A group of more than ``block_m`` rows reads
its expert's column tile once per row tile (prefill-sized groups belong to a tiled library
kernel).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_F32 = jnp.float32


def store_group_rows(o_ref, start, size, cols, block_m: int, tile):
    """Store ``tile(rows) -> f32[block_m, n]`` at ``o_ref[rows, cols]`` for each ``block_m`` rows
    of a group (rows ``[start, start + size)``), masked to the group: the next group's rows stay
    its own."""

    def row_tile(t, carry):
        rows = pl.ds(start + t * block_m, block_m)
        keep = (t * block_m + jnp.arange(block_m)) < size
        pltriton.store(o_ref.at[rows, cols], tile(rows), mask=keep[:, None])
        return carry

    jax.lax.fori_loop(0, pl.cdiv(size, block_m), row_tile, jnp.int32(0))


def call_grouped(kernel, sizes, *operands, rows: int, N: int, block_m: int, block_n: int, interpret, name: str):
    """``kernel(starts_ref, sizes_ref, *operand_refs, zeros_ref, o_ref)`` on a grid of (group,
    column tile of ``block_n``), its output ``f32[rows, N]`` zeros where no group writes."""
    zeros = jnp.zeros((rows + block_m, N), _F32)  # a last row tile may run past the rows
    out = pl.pallas_call(kernel, grid=(sizes.shape[0], N // block_n), out_shape=jax.ShapeDtypeStruct(zeros.shape, _F32),
                         input_output_aliases={2 + len(operands): 0}, interpret=interpret, name=name)(
        jnp.cumsum(sizes) - sizes, sizes, *operands, zeros)
    return out[:rows]


def _kernel(starts_ref, sizes_ref, a_ref, w_ref, _, o_ref, *, block_m: int, block_n: int, block_k: int, precision):
    g, j = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * block_n, block_n)

    def tile(rows):
        def k_block(b, acc):
            ks = pl.ds(b * block_k, block_k)
            return acc + jnp.dot(a_ref[rows, ks], w_ref[g, ks, cols], preferred_element_type=_F32, precision=precision)

        return jax.lax.fori_loop(0, a_ref.shape[1] // block_k, k_block, jnp.zeros((block_m, block_n), _F32))

    store_group_rows(o_ref, starts_ref[g], sizes_ref[g], cols, block_m, tile)


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=_F32, precision=None, block_m: int = 16,
                   block_n: int = 64, block_k: int = 64, interpret=None):
    """``lhs [M, K]`` times each row's group's ``rhs [G, K, N]``, accumulated in float32.

    Args:
      lhs, rhs: the same dtype (bfloat16 or float32); group_sizes: ``i32[G]`` rows per group.
      preferred_element_type: the result's dtype; precision: as for :func:`jax.numpy.dot`
        (float32 operands are multiplied at HIGHEST unless told otherwise).
      block_m, block_n, block_k: the tile a program multiplies at a time (Triton dots take at
        least 16 of each); a width that is no multiple of its block takes ``gcd(width, block)``.
      interpret: None interprets on CPU and compiles elsewhere.
    Returns:
      ``[M, N]``; rows past ``sum(group_sizes)`` are zeros.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    (M, K), (G, K2, N) = lhs.shape, rhs.shape
    if K2 != K or group_sizes.shape != (G,):
        raise ValueError(f"lhs [M, {K}] needs rhs [G, {K}, N] and group_sizes [G], got {rhs.shape} and "
                         f"{group_sizes.shape}")
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"lhs and rhs must have one dtype, got {lhs.dtype} and {rhs.dtype}")
    block_n, block_k = math.gcd(N, block_n), math.gcd(K, block_k)
    if min(block_n, block_k) < 16:
        raise ValueError(f"K = {K} and N = {N} must be multiples of 16 (Triton dots take at least 16)")
    if precision is None and lhs.dtype == _F32:
        precision = jax.lax.Precision.HIGHEST
    sizes = group_sizes.astype(jnp.int32)
    a = jnp.pad(lhs, ((0, block_m), (0, 0)))  # a last row tile may run past the rows
    kernel = functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k, precision=precision)
    out = call_grouped(kernel, sizes, a, rhs, rows=M, N=N, block_m=block_m, block_n=block_n, interpret=interpret,
                       name="grouped_matmul")
    return out.astype(preferred_element_type)
