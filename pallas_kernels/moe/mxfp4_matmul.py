"""Grouped matmul over MXFP4 experts that dequantises in registers: each weight is read from
memory once, packed (4.25 bits), never written back dequantised.

For the routed experts of a decode step, where few tokens route to each expert and the step is
bound by reading the expert weights: the pure-JAX path (:func:`k3jax.model.step.grouped_mxfp4`)
writes the dequantised bf16 weights and reads them again, four times the packed bytes each way.

GPU kernel on the Pallas Triton lowering (interpreted on CPU for tests). Grid ``(G, N / block_n)``:
one program per (group, column tile). A program reads its group's expert id, walks the group's
rows ``block_m`` at a time and, for each, the contracted axis 32 values (one scale) at a time:
the 16 packed rows' low nibbles are the even inputs, the high nibbles the odd ones, so the
activations come split into even and odd columns and no weights are interleaved. A group's rows
are sorted together, as for :func:`jax.lax.ragged_dot`; rows past the groups are zeros.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.gpu_common import check_offset_width
from pallas_kernels.moe.grouped_matmul import call_grouped, store_group_rows

_F32 = jnp.float32
_BLOCK = 32  # values per MXFP4 scale along the contracted axis


def _dequantize_tile(codes, scale, dtype):
    """E2M1 codes ``int32[16, n]`` (4 bits each) times ``2^(scale - 127)`` (``int32[1, n]``, E8M0)
    as ``dtype``, as :func:`k3jax.model.mxfp4.dequantize` (scale 255: inf, NaN for a zero code),
    but in float arithmetic: the subnormal weights of scales 0 and 1 may flush to zero."""
    m = codes & 7  # magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6
    mf = m.astype(_F32)
    mag = jnp.where(m < 4, mf * 0.5, jnp.where(m < 6, mf - 2.0, mf * 2.0 - 8.0))
    value = jnp.where(codes >= 8, -mag, mag)
    bits = jnp.where(scale == 0, 1 << 22, scale << 23)  # 2^(s - 127) as float32 bits (s = 0: subnormal 2^-127)
    return (value * jax.lax.bitcast_convert_type(bits, _F32)).astype(dtype)  # exact: <= 2 significant bits


def _kernel(starts_ref, sizes_ref, experts_ref, even_ref, odd_ref, packed_ref, scale_ref, _, o_ref, *, block_m: int,
            block_n: int, dtype):
    g, j = pl.program_id(0), pl.program_id(1)
    e = experts_ref[g]
    cols = pl.ds(j * block_n, block_n)
    K2 = packed_ref.shape[1]  # packed rows: K / 2
    dot = functools.partial(jnp.dot, preferred_element_type=_F32,
                            precision=jax.lax.Precision.HIGHEST if dtype == _F32 else None)

    def tile(rows):
        def k_block(b, acc):
            half = pl.ds(b * (_BLOCK // 2), _BLOCK // 2)
            codes = packed_ref[e, half, cols].astype(jnp.int32)  # [16, block_n]
            scale = scale_ref[e, pl.ds(b, 1), cols].astype(jnp.int32)  # [1, block_n]
            lo, hi = (_dequantize_tile(c, scale, dtype) for c in (codes & 15, codes >> 4))
            return acc + dot(even_ref[rows, half], lo) + dot(odd_ref[rows, half], hi)

        return jax.lax.fori_loop(0, K2 // (_BLOCK // 2), k_block, jnp.zeros((block_m, block_n), _F32))

    store_group_rows(o_ref, starts_ref[g], sizes_ref[g], cols, block_m, tile)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "interpret"))
def mxfp4_grouped_matmul(a, packed, scale, sizes, experts=None, *, block_m: int = 16, block_n: int = 64,
                         interpret=None):
    """``a [M, K]`` times each row's group's expert, dequantised from MXFP4.

    Args:
      a: ``[M, K]`` (bfloat16 or float32; the weights are dequantised to this dtype), rows sorted
        by group: group ``g`` holds rows ``[sum(sizes[:g]), sum(sizes[:g + 1]))``.
      packed: ``u8[E, K / 2, N]``, two E2M1 codes a byte (the even input in the low nibble);
        scale: ``u8[E, K / 32, N]``, E8M0 (:class:`k3jax.model.mxfp4.MXFP4` with ``axis=-2``).
      sizes: ``i32[G]`` rows per group; experts: ``i32[G]`` the expert each group multiplies by
        (None: group ``g`` is expert ``g``, ``G = E``); an empty group's expert is never read.
      block_m, block_n: rows and columns a program multiplies at a time (Triton dots take at
        least 16 of each); a width ``N`` that is no multiple of ``block_n`` takes
        ``gcd(N, block_n)`` columns (at least 16). interpret: None interprets on CPU and
        compiles elsewhere.
    Returns:
      ``f32[M, N]``; rows past ``sum(sizes)`` are zeros.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    M, K = a.shape
    E, K2, N = packed.shape
    if K2 * 2 != K or scale.shape != (E, K // _BLOCK, N) or K % _BLOCK:
        raise ValueError(f"a [M, {K}] needs packed [E, {K // 2}, N] and scale [E, {K // _BLOCK}, N] with K a multiple "
                         f"of {_BLOCK}, got {packed.shape} and {scale.shape}")
    if packed.dtype != jnp.uint8 or scale.dtype != jnp.uint8:
        raise ValueError(f"packed and scale must be uint8, got {packed.dtype} and {scale.dtype}")
    check_offset_width("packed", packed)
    check_offset_width("scale", scale)
    block_n = math.gcd(N, block_n)  # a width that is no multiple of block_n takes narrower column tiles
    if block_n < 16:
        raise ValueError(f"N = {N} must be a multiple of 16 (Triton dots take at least 16 columns)")
    sizes = sizes.astype(jnp.int32)
    experts = jnp.arange(E, dtype=jnp.int32) if experts is None else jnp.minimum(experts.astype(jnp.int32), E - 1)
    if experts.shape != sizes.shape:
        raise ValueError(f"experts {experts.shape} and sizes {sizes.shape} must have one entry per group")
    a = jnp.pad(a, ((0, block_m), (0, 0)))  # a last row tile may run past the rows
    even, odd = a[:, 0::2], a[:, 1::2]
    kernel = functools.partial(_kernel, block_m=block_m, block_n=block_n, dtype=jnp.dtype(a.dtype))
    return call_grouped(kernel, sizes, experts, even, odd, packed, scale, rows=M, N=N, block_m=block_m,
                        block_n=block_n, interpret=interpret, name="mxfp4_grouped_matmul")
