"""What the Mosaic GPU kernels (the intra-chunk products, W and U, the recurrence) share: the
shared-memory transforms of WGMMA operands, column parts for TMA copies, and the pipeline of
input buffers."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def swizzled_transforms(dtype, width):
    """SMEM transforms of a WGMMA operand with rows of ``width`` elements: 8-row tiles of one row's
    bytes (at most 128), swizzled. The operands of one product share one swizzle (the layout
    inference takes no mix)."""
    swizzle = min(128, width * jnp.dtype(dtype).itemsize)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def column_part(x, width):
    """Columns ``[x width, (x + 1) width)``: ``x`` a Python int (a first copy) or a loop's traced index
    (a multiple of ``width`` for the layout inference of the TMA copies)."""
    return pl.ds(x * width if isinstance(x, int) else pl.multiple_of(x * width, width), width)


def pipelined(n, slots, issue, step, started=None):
    """Parts ``0 .. n - 1`` through ``slots`` input buffers: ``issue(x, slot)`` copies part ``x`` in,
    ``step(x, slot)`` works on it. Part ``x + slots - 1``'s copies are issued before part ``x``'s
    work (the slot they fill was last read by part ``x - 1``). ``started()`` runs once the first
    parts' copies are issued, before any work: a wait there for inputs every part reads (copied
    before this call) overlaps the first parts' copies."""
    for x in range(min(slots - 1, n)):
        issue(x, x)
    if started is not None:
        started()

    @pl.loop(0, n)
    def _(x):
        nxt = x + slots - 1
        pl.when(nxt < n)(lambda: issue(nxt, lax.rem(nxt, slots)))
        step(x, lax.rem(x, slots))
