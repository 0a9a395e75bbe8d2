"""KDA decode on the unified page pool: one token per row, the state read from one page and
written to others in place (GPU, Pallas Triton lowering, interpreted on CPU for tests; the TPU
version is :mod:`pallas_kernels.kda.decode_pages_tpu`).

The serving step keeps each request's recurrent state for every KDA layer in a page of the
pool (:mod:`k3jax.model.pool`). Gathering those states into a dense batch, stepping it and
scattering it back moves each state three times; this kernel reads it once from its page and
writes it once. The pool is passed as its state view ``[N, HV, rows, V]`` of 32-bit words
(``uint32``, the pool's own dtype, read and written as float32 inside the kernel: a bitcast
outside it would make XLA copy the whole pool): head ``h`` of page ``p`` is ``rows`` rows of
``V`` words, and one layer's state ``f32[K, V]`` is the ``K`` rows from ``state_row`` (a layer's
offset, traced under a scan over layers).

Grid ``(B, HV, V / BV)`` as :mod:`pallas_kernels.kda.decode_gpu`'s (the same per-head math,
:mod:`pallas_kernels.kda._window`): each program steps ``f32[K, BV]`` of one row's state.
Per row: ``src`` the page read (out of range: a zero state), ``dst`` and ``checkpoint`` pages
written (out of range: not written). A page must not be both read by one row and written by
another in the same call (the serving step's slots are private; a checkpoint read is never
the page a step writes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda._window import DECODE, delta_rule, readout
from pallas_kernels.kda.decode import default_interpret, pages_on_tpu
from pallas_kernels.kda.decode_gpu import default_block_v
from pallas_kernels.kda.decode_pages_tpu import kda_decode_pages_tpu
from pallas_kernels.kda.gpu_common import check_offset_width, triton_params

_F32 = jnp.float32


def _kernel(src_ref, dst_ref, ckpt_ref, row_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref, o_ref,
            pool_out_ref, *, K: int, BV: int, rep: int, num_pages: int, scale: float):
    b, h = pl.program_id(0), pl.program_id(1)
    cols, rows = pl.ds(pl.program_id(2) * BV, BV), pl.ds(row_ref[0], K)
    in_pool = lambda p: (p >= 0) & (p < num_pages)
    src, dst, ckpt = src_ref[b], dst_ref[b], ckpt_ref[b]
    S = pool_ref[jnp.clip(src, 0, num_pages - 1), h, rows, cols]
    S = jnp.where(in_pool(src), jax.lax.bitcast_convert_type(S, _F32), 0.0)
    hq = h // rep
    S, _ = delta_rule(S, k_ref[b, hq].astype(_F32), v_ref[b, h, :, cols].astype(_F32), g_ref[b, h].astype(_F32),
                      beta_ref[b, h].astype(_F32))
    o_ref[b, h, :, cols] = readout(S, q_ref[b, hq].astype(_F32), scale).astype(o_ref.dtype)
    for page in (dst, ckpt):
        @pl.when(in_pool(page))
        def _(page=page):
            pool_out_ref[page, h, rows, cols] = jax.lax.bitcast_convert_type(S, pool_out_ref.dtype)


def kda_decode_pages(states, state_row, src, dst, checkpoint, q, k, v, g, beta, *, scale=None, block_v=None,
                     num_warps=8, interpret=None, backend=None):
    """One decode token per row on pages of the unified pool.

    Args:
      states: ``[N, HV, rows, V]`` of ``uint32`` (the pool's state view, float32 bits) or
        ``float32``, updated in place when the caller donates it;
      state_row: ``i32`` scalar, the first of this layer's ``K`` rows;
      src, dst, checkpoint: ``i32[B]`` page ids per row: the state is read from ``src`` (out of
        ``[0, N)``: zeros, a fresh request) and the new state written to ``dst`` and to
        ``checkpoint`` (out of range: not written; padding rows use -1);
      q, k: ``[B, H, K]``; v: ``[B, HV, V]``; g: ``[B, HV, K]`` log decay; beta: ``[B, HV]``;
      scale: None is ``K ** -0.5``; interpret: None interprets on CPU and compiles elsewhere;
      backend: "gpu" (Triton), "tpu" (Mosaic; ``interpret`` as for :mod:`pallas_kernels.kda.decode`),
        None: "tpu" on a TPU, else "gpu".
    Returns:
      ``(o [B, HV, V] in v.dtype, states)``.
    """
    N, HV, num_rows, V = states.shape
    B, H, K = k.shape
    if states.dtype not in (_F32, jnp.uint32) or HV % H or num_rows < K:
        raise ValueError(f"states must be f32 or u32[N, HV, rows >= K, V] with HV a multiple of H={H}, "
                         f"got {states.dtype}{list(states.shape)} for K={K}")
    for name, x, shape in (("q", q, (B, H, K)), ("v", v, (B, HV, V)), ("g", g, (B, HV, K)), ("beta", beta, (B, HV)),
                           ("src", src, (B,)), ("dst", dst, (B,)), ("checkpoint", checkpoint, (B,))):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    scale = float(K**-0.5 if scale is None else scale)
    ids = [x.astype(jnp.int32) for x in (src, dst, checkpoint)] + [jnp.reshape(state_row, (1,)).astype(jnp.int32)]
    if pages_on_tpu(backend):
        return kda_decode_pages_tpu(states, ids[3], *ids[:3], q, k, v, g, beta, scale=scale,
                                    interpret=default_interpret(interpret))
    check_offset_width("states", states)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    BV = min(block_v or default_block_v(DECODE, B, HV, V), V)
    col, row = (lambda x: x[..., None]), (lambda x: x[..., None, :])
    kernel = functools.partial(_kernel, K=K, BV=BV, rep=HV // H, num_pages=N, scale=scale)
    o, states = pl.pallas_call(
        kernel,
        grid=(B, HV, V // BV),
        out_shape=(jax.ShapeDtypeStruct((B, HV, 1, V), v.dtype), jax.ShapeDtypeStruct(states.shape, states.dtype)),
        input_output_aliases={9: 1},
        compiler_params=None if interpret else triton_params(num_warps, 1),
        interpret=interpret,
        name="kda_decode_pages",
    )(*ids, col(q), col(k), row(v), col(g), beta[..., None, None], states)
    return o[:, :, 0], states
