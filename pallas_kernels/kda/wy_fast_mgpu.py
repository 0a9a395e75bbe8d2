"""W, U, kd^T and the decay in Mosaic GPU (``plgpu.kernel``): :func:`wu_call`, the contract of the
Triton kernel (:func:`pallas_kernels.kda.wy_fast_triton.wu_call`): every chunk's
``W = X (beta k exp(G))``, ``U = X (beta v)`` from its inverse ``X = (I + N)^-1``, and
``kd^T = (k exp(G_C - G))^T``, ``decay = exp(G_C)``; :func:`pallas_kernels.kda.chunk_kda`'s
default where it applies.

One warpgroup per item (chunk, value head), items with the heads fastest. TMA brings the chunk's
inverse X (float32) and beta once, and k with the gate cumsum G, then v, in 32-column parts
through one pipeline of ``SLOTS`` input buffers that the k and v parts share (two parts' copies in
flight while one is computed). Per part the right operand of the product with X,
``beta k exp(G)`` or ``beta v``, goes to shared memory transposed (a register relayout to the
transposed WGMMA layout and a store through the transposed view), so the TF32 WGMMA
``X [C, C] x B [C, 32]`` reads both operands along the contraction (TF32 WGMMA takes no other
order); kd^T goes out the same way, W and U as row tiles, all by TMA. One pipeline of three
shared buffers was faster than two per input or four shared ones (docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.common import fast_exp
from pallas_kernels.kda.mgpu_common import column_part, pipelined, swizzled_transforms

_F32 = jnp.float32
C = 64
PART = 32  # columns per part: one 128-byte row of float32
SLOTS = 3  # input buffers, shared by the k parts then the v parts (68.5 KB in all: three CTAs per SM)


def supported(K, V, chunk_size, k_dtype, v_dtype) -> bool:
    """Whether :func:`wu_call` takes these: chunk 64, K and V multiples of 32 (whole parts), k and v
    of one 16-bit dtype (TF32 products are the Triton path's precision for those only; the two
    share input buffers)."""
    return (chunk_size == C and K % PART == 0 and V % PART == 0 and jnp.dtype(k_dtype).itemsize == 2
            and jnp.dtype(k_dtype) == jnp.dtype(v_dtype))


def _kernel(k_ref, v_ref, G_ref, beta_ref, x_ref, kdT_ref, w_ref, u_ref, decay_ref, *, rep):
    HV = G_ref.shape[1]
    K, V = k_ref.shape[-1], v_ref.shape[-1]
    w = lax.axis_index("i")
    c, h = lax.div(w, HV), lax.rem(w, HV)
    rows = pl.ds(pl.multiple_of(c * C, C), C)
    lay = plgpu.Layout.WGMMA
    pin = lambda x: plgpu.layout_cast(x, lay)
    cols = lambda x: column_part(x, PART)
    st = w_ref.dtype
    swz = lambda shape, dtype, width: plgpu.SMEM(shape, dtype, transforms=swizzled_transforms(dtype, width))
    plain = lambda shape, dtype: plgpu.SMEM(shape, dtype)

    def body(x_s, b_s, in_s, G_s, gl_s, bT_s, kd_s, out_s, dec_s, start, ready_k, ready_v):
        plgpu.copy_gmem_to_smem(x_ref.at[h, rows], x_s, start)
        plgpu.copy_gmem_to_smem(beta_ref.at[h, rows], b_s, start)
        nk = K // PART

        def issue(x, slot):  # parts 0 .. nk - 1: k and G; then v
            def k_part():
                bar = ready_k.at[slot]
                plgpu.copy_gmem_to_smem(k_ref.at[rows, h // rep, cols(x)], in_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(G_ref.at[rows, h, cols(x)], G_s.at[slot], bar)
                plgpu.copy_gmem_to_smem(G_ref.at[c * C + C - 1, h, cols(x)], gl_s.at[slot], bar)

            def v_part():
                plgpu.copy_gmem_to_smem(v_ref.at[rows, h, cols(x - nk)], in_s.at[slot], ready_v.at[slot])

            pl.when(x < nk)(k_part)  # a Python bool for the first parts, traced in the loop
            pl.when(x >= nk)(v_part)

        beta = []

        def started():  # X and beta, in flight with the first parts
            plgpu.barrier_wait(start)
            beta.append(pin(lax.broadcast_in_dim(plgpu.load(b_s, layout=lay.reduce(1)), (C, PART), [0])))

        def product(b):
            """``X b`` (``b [C, PART]`` float32) into the part's output tile as ``st``; returns the tile."""
            bT_s.T[...] = plgpu.layout_cast(b, plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()

            def run(acc):
                plgpu.wgmma(acc, x_s, bT_s.T)
                return acc[...]

            out = pl.run_scoped(run, plgpu.ACC((C, PART), _F32))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last part's tiles have left
            out_s[...] = pin(out).astype(st)
            return out_s

        def step(x, slot):
            @pl.when(x < nk)
            def _():
                plgpu.barrier_wait(ready_k.at[slot])
                G = plgpu.load(G_s.at[slot], layout=lay)
                k = pin(plgpu.load(in_s.at[slot], layout=lay).astype(_F32))
                gl = plgpu.load(gl_s.at[slot], layout=lay.reduce(0))
                kd = pin(k * fast_exp(pin(lax.broadcast_in_dim(gl, (C, PART), [1])) - G))
                tile = product(pin(beta[0] * k * fast_exp(G)))
                kd_s.T[...] = plgpu.layout_cast(kd.astype(st), plgpu.Layout.WGMMA_TRANSPOSED)
                dec_s[...] = fast_exp(gl)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(tile, w_ref.at[h, rows, cols(x)])
                plgpu.copy_smem_to_gmem(kd_s, kdT_ref.at[h, c, cols(x)])
                plgpu.copy_smem_to_gmem(dec_s, decay_ref.at[h, c, cols(x)])

            @pl.when(x >= nk)
            def _():
                plgpu.barrier_wait(ready_v.at[slot])
                v = pin(plgpu.load(in_s.at[slot], layout=lay).astype(_F32))
                tile = product(pin(beta[0] * v))
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(tile, u_ref.at[h, rows, cols(x - nk)])

        pipelined(nk + V // PART, SLOTS, issue, step, started)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the writes to global memory finish on their own

    pl.run_scoped(body, swz((C, C), _F32, PART), plain((C,), _F32),
                  swz((SLOTS, C, PART), k_ref.dtype, PART), swz((SLOTS, C, PART), _F32, PART),
                  plain((SLOTS, PART), _F32),
                  swz((PART, C), _F32, PART), plain((PART, C), st), swz((C, PART), st, PART), plain((PART,), _F32),
                  plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=3, num_barriers=SLOTS),
                  plgpu.Barrier(num_arrivals=1, num_barriers=SLOTS))


def wu_call(k, v, G, beta, X, *, store_dtype, interpret=False):
    """Token-major ``k [TT, H, K]``, ``v [TT, HV, V]`` (16-bit), ``G [TT, HV, K]`` float32,
    ``beta [TT, HV, 1]``, ``X [HV, TT, C]`` float32 (every chunk's inverse). Returns
    ``kd^T [HV, NC, K, C]``, ``W [HV, TT, K]``, ``U [HV, TT, V]`` in ``store_dtype`` and
    ``decay [HV, NC, K, 1]`` float32, as the Triton kernel."""
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    TT, H, K = k.shape
    HV, V = v.shape[1], v.shape[-1]
    if not supported(K, V, C, k.dtype, v.dtype) or TT % C:
        raise ValueError(f"the Mosaic GPU W/U kernel takes chunk {C}, K and V multiples of {PART} and 16-bit k, v of "
                         f"one dtype; got K={K}, V={V}, {k.dtype} and {v.dtype}, {TT} tokens")
    NC = TT // C
    st = lambda *shape: jax.ShapeDtypeStruct(shape, store_dtype)
    out = (st(HV, NC, K, C), st(HV, TT, K), st(HV, TT, V), jax.ShapeDtypeStruct((HV, NC, K), _F32))
    kernel = plgpu.kernel(functools.partial(_kernel, rep=HV // H), out_type=out, grid=(NC * HV,), grid_names=("i",),
                          kernel_name="kda_wu", interpret=interpret)
    kdT, W, U, decay = kernel(k, v, G, jnp.moveaxis(beta[..., 0], 1, 0).astype(_F32), X)
    return kdT, W, U, decay[..., None]
