"""KDA decode on the unified page pool for TPU (Mosaic): the contract of
:func:`pallas_kernels.kda.decode_pages.kda_decode_pages`, one program per (row, value head).

The pool stays in HBM (``pl.ANY``, aliased to the output): each program DMAs its layer's ``K``
state rows of head ``h`` from page ``src`` into VMEM (a zero state when ``src`` is out of range),
steps it (the per-head math of :mod:`pallas_kernels.kda._window`), and DMAs it to ``dst`` and
``checkpoint`` when they are in range. The words are bitcast in VMEM, so the pool keeps its
``uint32`` dtype outside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda._window import delta_rule, readout

_F32 = jnp.float32


def _kernel(src_ref, dst_ref, ckpt_ref, row_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_hbm, o_ref, pool_out_hbm,
            s_in, s_out, sem, *, K: int, num_pages: int, scale: float):
    b, h = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(row_ref[0], K)
    in_pool = lambda p: (p >= 0) & (p < num_pages)
    src = src_ref[b]

    @pl.when(in_pool(src))
    def _():
        read = pltpu.make_async_copy(pool_hbm.at[src, h, rows], s_in, sem.at[0])
        read.start()
        read.wait()

    @pl.when(jnp.logical_not(in_pool(src)))
    def _():
        s_in[...] = jnp.zeros(s_in.shape, s_in.dtype)  # zero bits: a zero state

    S = jax.lax.bitcast_convert_type(s_in[...], _F32)
    S, _ = delta_rule(S, k_ref[...].astype(_F32), v_ref[...].astype(_F32), g_ref[...].astype(_F32),
                      beta_ref[...].astype(_F32))
    o_ref[...] = readout(S, q_ref[...].astype(_F32), scale).astype(o_ref.dtype)
    s_out[...] = jax.lax.bitcast_convert_type(S, s_out.dtype)
    for i, page in enumerate((dst_ref[b], ckpt_ref[b])):
        @pl.when(in_pool(page))
        def _(page=page, i=i):
            write = pltpu.make_async_copy(s_out, pool_out_hbm.at[page, h, rows], sem.at[1 + i])
            write.start()
            write.wait()


def kda_decode_pages_tpu(states, state_row, src, dst, checkpoint, q, k, v, g, beta, *, scale: float, interpret=False):
    """:func:`pallas_kernels.kda.decode_pages.kda_decode_pages` on TPU (its checked arguments;
    ``interpret``: False compiles, True or ``pltpu.InterpretParams`` runs the Mosaic interpreter).
    Returns ``(o [B, HV, V] in v.dtype, states)``."""
    N, HV, _, V = states.shape
    B, H, K = k.shape
    rep = HV // H
    col, row = (lambda x: x[..., None]), (lambda x: x[..., None, :])
    q_spec = pl.BlockSpec((None, None, K, 1), lambda b, h, *_: (b, jax.lax.div(h, rep), 0, 0))
    head = lambda *shape: pl.BlockSpec((None, None, *shape), lambda b, h, *_: (b, h, 0, 0))
    kernel = functools.partial(_kernel, K=K, num_pages=N, scale=scale)
    o, states = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(B, HV),
            in_specs=[q_spec, q_spec, head(1, V), head(K, 1), head(1, 1), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=[head(1, V), pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((K, V), states.dtype), pltpu.VMEM((K, V), states.dtype),
                            pltpu.SemaphoreType.DMA((3,))],
        ),
        out_shape=(jax.ShapeDtypeStruct((B, HV, 1, V), v.dtype), jax.ShapeDtypeStruct(states.shape, states.dtype)),
        input_output_aliases={9: 1},  # operand indices count the four scalar-prefetch operands
        # no page is read by one row and written by another (the contract): rows are independent
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
        name="kda_decode_pages_tpu",
    )(src, dst, checkpoint, jnp.reshape(state_row, (1,)), col(q), col(k), row(v), col(g), beta[..., None, None],
      states)
    return o[:, :, 0], states
