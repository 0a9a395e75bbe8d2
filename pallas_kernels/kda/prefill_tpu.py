"""TPU (Mosaic) prefill kernels.

Stage 1 is :func:`pallas_kernels.kda._chunk.prep_call` on head-major inputs (``(C, K)`` tiles).
Stage 2, :func:`scan_call`: grid ``(HV, NC)`` with the head axis parallel and the chunk axis
sequential ("arbitrary"); the state ``f32[K, V]`` stays in a VMEM scratch across the chunk axis.
Per-chunk tables arrive by scalar prefetch: ``first`` (load the sequence's initial state),
``last`` (write its final state), ``seq`` (which initial/final block) and ``ck`` (write a
checkpoint). The checkpoint output block of a chunk is the next checkpoint its sequence will
write (or its sequence's spare slot), so a block is only written back after the chunk that fills it.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda._chunk import _F32, chunk_step


def _scan_kernel(first_ref, last_ref, seq_ref, ck_ref, ckslot_ref, qg_ref, kdT_ref, w_ref, u_ref, aqk_ref, decay_ref,
                 init_ref, o_ref, final_ref, ckpt_ref, S_ref):
    c = pl.program_id(1)

    @pl.when(first_ref[c] == 1)
    def _():
        S_ref[...] = init_ref[...]

    o, S = chunk_step(S_ref[...], qg_ref[...], kdT_ref[...], w_ref[...], u_ref[...], aqk_ref[...], decay_ref[...])
    S_ref[...] = S
    o_ref[...] = o.astype(o_ref.dtype)

    @pl.when(last_ref[c] == 1)
    def _():
        final_ref[...] = S

    @pl.when(ck_ref[c] == 1)
    def _():
        ckpt_ref[...] = S


def scan_call(prep, init, first, last, seq, ck, ckslot, *, n_ck_slots, out_dtype, interpret=False):
    """Stage 2 on one packed stream of whole sequences.

    ``init f32[N, HV, K, V]``; per-chunk i32 tables ``first, last, seq, ck, ckslot [NC]``.
    Returns ``(o [HV, TT, V] out_dtype, final f32[N, HV, K, V], ckpts f32[n_ck_slots, HV, K, V])``;
    final blocks of sequences without chunks and checkpoint slots never written hold garbage.
    """
    qg, kdT, W, U, Aqk, decay = prep
    HV, TT, K = W.shape
    V = U.shape[-1]
    NC, C = kdT.shape[1], kdT.shape[-1]
    N = init.shape[0]
    rows = lambda width: pl.BlockSpec((None, C, width), lambda h, c, *_: (h, c, 0))
    per_chunk = lambda width: pl.BlockSpec((None, None, K, width), lambda h, c, *_: (h, c, 0, 0))
    state = pl.BlockSpec((None, None, K, V), lambda h, c, f, l, s, ck, slot: (s[c], h, 0, 0))
    ck_state = pl.BlockSpec((None, None, K, V), lambda h, c, f, l, s, ck, slot: (slot[c], h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(HV, NC),
        in_specs=[rows(K), per_chunk(C), rows(K), rows(V), rows(C), per_chunk(1), state],
        out_specs=[rows(V), state, ck_state],
        scratch_shapes=[pltpu.VMEM((K, V), _F32)],
    )
    return pl.pallas_call(
        _scan_kernel,
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((HV, TT, V), out_dtype),
            jax.ShapeDtypeStruct((N, HV, K, V), _F32),
            jax.ShapeDtypeStruct((n_ck_slots, HV, K, V), _F32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(first, last, seq, ck, ckslot, qg, kdT, W, U, Aqk, decay, init)

PREP_PARAMS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
