"""Whole-tile math every KDA kernel body uses, on every lowering (Mosaic TPU, Triton, Mosaic GPU).

Only operations all lowerings accept: whole-tile elementwise math, reductions, ``iota`` masks and
float32 matmuls. Values are never sliced (the Triton lowering cannot): a row is picked with a
masked reduction (:func:`pick_row`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SUB = 16  # rows of a sub-chunk: the unit of the anchored intra-chunk products
LOG2_E = 1.4426950408889634
HIGHEST = jax.lax.Precision.HIGHEST
# The GPU kernels' float32-accurate matmuls: TF32x3 (three tensor-core passes). TPU and the
# interpreters use HIGHEST.
GPU_PRECISION = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
_F32 = jnp.float32


def fast_exp(x):
    """``exp(x)`` as ``exp2(x log2 e)``: on the GPU one ``ex2.approx`` (relative error ~1e-7, plus
    ``|x|`` x 6e-8 from rounding the argument) instead of the accurate ``exp``'s range reduction."""
    return jnp.exp2(x * LOG2_E)


def dot_f32(a, b, precision=HIGHEST):
    """``a @ b`` with float32 accumulation."""
    return jnp.dot(a, b, precision=precision, preferred_element_type=_F32)


def dot_nt_f32(a, b, precision):
    """``a @ b.T`` (contract the last axes) with float32 accumulation."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=_F32)


def iota(shape, dim):
    """int32 indices along ``dim`` of a tile of ``shape``."""
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def pick_row(x, i):
    """Row ``i`` of a ``[R, N]`` tile as ``[1, N]``."""
    return jnp.sum(jnp.where(iota((x.shape[0], 1), 0) == i, x, 0.0), axis=0, keepdims=True)


def chunk_decays(k, G):
    """``kd^T = (k exp(G_C - G))^T`` and ``decay = exp(G_C)`` as a column, from a chunk's keys and
    gate cumsum ``G`` (``[C, K']`` tiles)."""
    C = k.shape[0]
    GT = G.T
    GlastT = jnp.sum(jnp.where(iota((1, C), 1) == C - 1, GT, 0.0), axis=1, keepdims=True)  # [K', 1]
    return k.T * fast_exp(GlastT - GT), fast_exp(GlastT)
