"""Public chunked KDA prefill: :func:`chunk_kda`, the contract of :func:`k3jax.ops.kda.chunk_kda`.

The call reads as its stages: validate the inputs, resolve the kernel configuration
(:class:`PrefillConfig`), pack the tokens so every sequence starts on a chunk boundary (padding
slots are zero tokens: the identity map), run the token-parallel stage (stage 1) over every
(chunk, value head), run the recurrent stage over (sequence, value head[, column block]), and
unpack the outputs. The kernels by stage and backend (README.md):

- stage 1, GPU: :mod:`~pallas_kernels.kda.chunk_prep_gpu` (gate cumsum, then
  :mod:`~pallas_kernels.kda.chunk_intra_triton` / :mod:`~pallas_kernels.kda.chunk_intra_mgpu`,
  :mod:`~pallas_kernels.kda.wy_fast_triton` / :mod:`~pallas_kernels.kda.wy_fast_mgpu`); TPU:
  :func:`pallas_kernels.kda.prefill_tpu.prep_call`;
- recurrence, GPU: :mod:`~pallas_kernels.kda.recurrence_triton` /
  :mod:`~pallas_kernels.kda.recurrence_mgpu`; TPU: :func:`pallas_kernels.kda.prefill_tpu.scan_call`.

Segment-parallel prefill (GPU): when sequences x heads x column blocks cannot fill the device,
each sequence's chunks are split into ``P`` segments; one pass computes every segment's affine
map ``(M, E)`` from its own tokens (in parallel), a fold in float32 (a chain of products in one
kernel, :func:`~pallas_kernels.kda.recurrence_triton.fold_call`, or XLA's associative scan when
an ``initial_state_fn`` wants every sequence's whole map) gives each segment's true initial
state, and a second pass finishes every segment from it.
:func:`pallas_kernels.kda.segment_plan.plan_segments` picks ``P``.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops.kda import ChunkLayout, check_kda_inputs, chunk_layout, l2norm, output_dtype, sequence_maps
from k3jax.ops.segments import combine_segments, prefix_starts
from pallas_kernels.kda import chunk_intra_mgpu, prefill_tpu, recurrence_mgpu, recurrence_triton, wy_fast_mgpu
from pallas_kernels.kda.chunk_prep_gpu import gpu_prep
from pallas_kernels.kda.common import GPU_PRECISION
from pallas_kernels.kda.gpu_common import gpu_core_count, gpu_head_dims_ok, gpu_programs
from pallas_kernels.kda.segment_plan import plan_segments, recurrence_cta_cols, summary_cta_cols

_F32 = jnp.float32
_BF16 = jnp.bfloat16
# Float32 q, k, v with K or V above this do not fit the GPU kernels' shared memory on Hopper
# (232448 bytes): chunk_kda runs them as bf16 operands, the state and outputs staying float32.
GPU_F32_MAX_HEAD = 64
KERNELS = ("triton", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """The tuning knobs of :func:`chunk_kda` (GPU unless said), checked on construction. They pick
    kernels, tiles and matmul precisions; ``None`` lets ``chunk_kda`` choose for the inputs.
    Measurements behind the defaults: ``docs/benchmarks.md``.

    Attributes:
      num_segments: segments per sequence for the recurrent stage (segment-parallel prefill; 1 on
        TPU); None asks :func:`~pallas_kernels.kda.segment_plan.plan_segments`.
      recurrence: the recurrent stage's kernel, "mosaic_gpu" (:mod:`~pallas_kernels.kda.recurrence_mgpu`:
        WGMMA products with bf16 operands; needs bfloat16 intermediates, chunk 64, K in (64, 128),
        V a multiple of 64) or "triton" (:mod:`~pallas_kernels.kda.recurrence_triton`). None:
        Mosaic GPU where it applies and no ``block_v`` is given, else Triton.
      prep_kernel: stage 1's intra-chunk products (Aqk, Akk, qg), "triton" or "mosaic_gpu"
        (:mod:`~pallas_kernels.kda.chunk_intra_mgpu`: TF32 WGMMA products; needs chunk 64, K in
        (64, 128) and 16-bit inputs; for unbounded gates the Triton kernel redoes the chunks with
        a 16-token sub-chunk whose gate span passes 75 nats). None: Mosaic GPU where it applies.
      wu_kernel: stage 1's W, U, kd^T and decay, "triton" or "mosaic_gpu"
        (:mod:`~pallas_kernels.kda.wy_fast_mgpu`: TF32 WGMMA products; needs chunk 64, K and V
        multiples of 32 and k, v of one 16-bit dtype). None: Mosaic GPU where it applies.
      block_v: state columns per program of the Triton recurrence (None: 64 when segments or
        ``sequences x heads x V / 64`` programs fill the SMs, else 32), or per warpgroup of the
        Mosaic GPU one (32 or 64; None: 64), in both of its passes.
      num_warps, num_stages: the Triton recurrence's warps and software pipelining stages (the
        next chunks' loads overlap this chunk's matmuls; one stage past K = 128).
      summary_block_v: the Triton segment summary pass's column block (it runs over ``K + V``
        columns).
      prep_num_warps: warps per program of the gate cumsum and the Triton W/U kernel (the
        intra-chunk and inverse kernels run on one warp: their 16 x 16 products repeat on every
        warp).
      scan_precision: matmul precision of the Triton recurrence (state and outputs); None:
        :func:`default_precision` (bf16 operands with float32 accumulation for 16-bit inputs with
        bf16 intermediates; the state stays float32).
      prep_precision: the same for stage 1's products (Aqk, Akk, W, U); its triangular inverse is
        always TF32x3 (float32-accurate).
      intermediate_dtype: the dtype of what the stages pass through memory (qg, Aqk, kd^T, W, U):
        float32 or bfloat16 (half the traffic, fla's choice; the recurrence, final state and
        checkpoints stay float32). None: :func:`default_intermediates` (TPU: float32 only).
    """

    num_segments: int | None = None
    recurrence: str | None = None
    prep_kernel: str | None = None
    wu_kernel: str | None = None
    block_v: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    summary_block_v: int = 64
    prep_num_warps: int = 4
    scan_precision: Any = None
    prep_precision: Any = None
    intermediate_dtype: Any = None

    def __post_init__(self):
        if self.num_segments is not None and self.num_segments < 1:
            raise ValueError(f"num_segments must be >= 1, got {self.num_segments}")
        for name in ("recurrence", "prep_kernel", "wu_kernel"):
            value = getattr(self, name)
            if value is not None and value not in KERNELS:
                raise ValueError(f"{name} must be 'triton' or 'mosaic_gpu', got {value!r}")
        for name in ("num_warps", "num_stages", "summary_block_v", "prep_num_warps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        store = self.intermediate_dtype
        if store is not None and jnp.dtype(store) not in (jnp.dtype(_F32), jnp.dtype(_BF16)):
            raise ValueError(f"intermediate_dtype must be float32 or bfloat16, got {jnp.dtype(store)}")
        if self.recurrence == "mosaic_gpu" and self.block_v is not None:
            recurrence_mgpu.check_block_v(self.block_v)


def default_precision(precision, dtype, *, scan=False):
    """A GPU matmul precision: ``precision`` if given, else TF32x3 (float32-accurate) for float32
    ``dtype``; for 16-bit ``dtype`` (outputs round to 8 bits anyway) single-pass TF32, or for the
    recurrent kernel (``scan``) bf16 operands with float32 accumulation, fla's choice: the state
    stays float32 and only the matmul operands round (the same errors against the float32
    reference, faster)."""
    if precision is not None:
        return precision
    if jnp.dtype(dtype).itemsize == 4:
        return GPU_PRECISION
    return jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if scan else jax.lax.DotAlgorithmPreset.TF32_TF32_F32


def default_recurrence(K, V, chunk_size, store_dtype, block_v=None):
    """The GPU recurrent kernel :func:`chunk_kda` runs when ``recurrence`` is None: Mosaic GPU where
    it applies (:func:`pallas_kernels.kda.recurrence_mgpu.supported`) and no Triton ``block_v`` is
    given, else Triton."""
    return "mosaic_gpu" if block_v is None and recurrence_mgpu.supported(K, V, chunk_size, store_dtype) else "triton"


def default_intermediates(dtype):
    """What the GPU stages pass through memory by default: bfloat16 for 16-bit inputs (their outputs
    round to 8 bits), float32 otherwise."""
    return _BF16 if jnp.dtype(dtype).itemsize < 4 else _F32


def _backend(backend):
    backend = backend or jax.default_backend()
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    if backend in ("tpu", "cpu"):
        return "tpu"
    raise ValueError(f"no KDA prefill kernel for backend {backend!r}")


def _interpret(interpret, backend):
    if interpret is None:
        if jax.default_backend() != "cpu":
            return False
        return pltpu.InterpretParams() if backend == "tpu" else True
    return interpret


def _kernel_choice(arg, value, ok, *, requirement, default=None):
    """A GPU stage's kernel, ``"triton"`` or ``"mosaic_gpu"``: ``value``, checked (``ok``: the Mosaic
    GPU kernel applies, else ``requirement`` is the error), or for None Mosaic GPU where
    ``default`` (``ok`` unless given), else Triton."""
    if value is None:
        return "mosaic_gpu" if (ok if default is None else default) else "triton"
    if value == "mosaic_gpu" and not ok:
        raise ValueError(requirement)
    return value


def _resolve(config: PrefillConfig, kind, K, V, C, q_dtype, k_dtype, v_dtype, out_dtype) -> PrefillConfig:
    """``config`` with the kernels and the intermediates chosen for these inputs (checked)."""
    gpu = kind == "gpu"
    if not gpu and config.num_segments not in (None, 1):
        raise ValueError("segment-parallel prefill is implemented for the GPU kernels only (num_segments must be 1)")
    store = config.intermediate_dtype
    store = jnp.dtype((default_intermediates(out_dtype) if gpu else _F32) if store is None else store)
    if not gpu and store != jnp.dtype(_F32):
        raise ValueError("bfloat16 intermediates are implemented for the GPU kernels only")
    recurrence = _kernel_choice(
        "recurrence", config.recurrence, gpu and recurrence_mgpu.supported(K, V, C, store),
        default=gpu and default_recurrence(K, V, C, store, config.block_v) == "mosaic_gpu",
        requirement="the Mosaic GPU recurrence runs on the GPU backend with bfloat16 intermediates, chunk_size 64, "
                    f"K in (64, 128) and V a multiple of 64; got backend {kind}, {store.name} intermediates, "
                    f"chunk_size {C}, K={K}, V={V}")
    prep_kernel = _kernel_choice(
        "prep_kernel", config.prep_kernel, gpu and chunk_intra_mgpu.supported(K, C, q_dtype),
        requirement="prep_kernel='mosaic_gpu' (the intra-chunk products) runs on the GPU backend with chunk_size 64, "
                    f"K in (64, 128) and 16-bit inputs; got backend {kind}, chunk_size {C}, K={K}, {q_dtype}")
    wu_kernel = _kernel_choice(
        "wu_kernel", config.wu_kernel, gpu and wy_fast_mgpu.supported(K, V, C, k_dtype, v_dtype),
        requirement="wu_kernel='mosaic_gpu' (W and U) runs on the GPU backend with chunk_size 64, K and V "
                    f"multiples of 32 and k, v of one 16-bit dtype; got backend {kind}, chunk_size {C}, K={K}, "
                    f"V={V}, {k_dtype} and {v_dtype}")
    return dataclasses.replace(config, intermediate_dtype=store, recurrence=recurrence, prep_kernel=prep_kernel,
                               wu_kernel=wu_kernel)


class _Packed(NamedTuple):
    """Token-major inputs packed chunk-aligned (``[TT, H or HV, *]``, beta ``[TT, HV, 1]``)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array
    lay: ChunkLayout
    dense: bool  # no repacking: rows of whole chunks, packed as they are
    NC: int  # chunks
    n_ck: int  # checkpoints per sequence


def _pack(q, k, v, g, beta, cu_seqlens, *, C, N, checkpoint_stride) -> _Packed:
    """Rows flattened into one token stream; varlen sequences repacked so each starts on a chunk
    boundary, the padding slots zero tokens (k = beta = g = 0: the identity map)."""
    B, T = q.shape[:2]
    TT = B * T
    flat = lambda x: x.reshape(TT, *x.shape[2:])
    q, k, v, g, beta = flat(q), flat(k), flat(v), flat(g.astype(_F32)), flat(beta)[..., None]
    cu = (jnp.arange(B + 1, dtype=jnp.int32) * T) if cu_seqlens is None else cu_seqlens.astype(jnp.int32)
    lay = chunk_layout(cu, TT, C, N, checkpoint_stride)
    dense = cu_seqlens is None and T % C == 0
    if not dense:
        ok = lay.ok
        q, k, v, g, beta = (jnp.where(ok.reshape(-1, 1, 1), x[lay.src], 0).astype(x.dtype) for x in (q, k, v, g, beta))
    NC = TT // C if dense else lay.chunk_seq.shape[0]
    return _Packed(q, k, v, g, beta, lay, dense, NC, 0 if checkpoint_stride is None else T // checkpoint_stride)


def _segment_starts(scan, prep, init, vstart, vend, *, cfg, N, P, HV, K, V, initial_state_fn, interpret):
    """The state entering each of the ``P`` segments of every sequence (``f32[N * P, HV, K, V]``),
    from the summary pass's maps, and the sequences' initial states (``initial_state_fn``'s, given
    every sequence's whole map, or ``init``)."""
    seg = np.broadcast_to(np.arange(P), (N, P))
    if initial_state_fn is None:
        # The maps only give the segments' starts: the first segment runs its E columns from the
        # sequence's initial state (its map becomes the constant (0, M init + E)) and the last
        # segment's map is never read.
        src = np.where(seg == 0, np.arange(N)[:, None], -1)
        table, e_start = (src, (seg > 0) & (seg < P - 1), seg < P - 1), init
    else:  # the hook gets every sequence's whole map
        table, e_start = (np.full((N, P), -1), np.ones((N, P)), np.ones((N, P))), None
    table = jnp.asarray(np.stack(table, axis=-1).reshape(N * P, 3), jnp.int32)
    cta_cols = {} if cfg.recurrence != "mosaic_gpu" else dict(cta_cols=summary_cta_cols(
        N, HV, K, V, P, block_v=cfg.block_v, paid=initial_state_fn is not None))
    ME = scan(prep, e_start, vstart, vend, table, summary=True, block_v=cfg.summary_block_v, **cta_cols)
    if initial_state_fn is None:
        return recurrence_triton.fold_call(ME, init, P=P, interpret=bool(interpret)), init
    M, E = ME[..., :K].reshape(N, P, HV, K, K), ME[..., K:].reshape(N, P, HV, K, V)
    M_all, E_all = jax.lax.associative_scan(combine_segments, (M, E), axis=1)
    init = initial_state_fn(M_all[:, -1], E_all[:, -1]).astype(_F32)
    return prefix_starts((M_all, E_all), init).reshape(N * P, HV, K, V), init  # the same scan, not run again


def _recurrence_gpu(prep, packed: _Packed, init, *, cfg, T, C, N, HV, K, V, out_dtype, initial_state_fn, interpret):
    """The GPU recurrent stage over ``P`` segments per sequence (the summary pass and the fold
    first when ``P > 1`` or an ``initial_state_fn`` wants the maps). Returns
    ``(o [TT, HV, V], final f32[N, HV, K, V], checkpoint slots, the initial states used)``."""
    lay, NC, n_ck = packed.lay, packed.NC, packed.n_ck
    store = jnp.dtype(cfg.intermediate_dtype)
    mosaic = cfg.recurrence == "mosaic_gpu"
    widths = (64,)
    if mosaic:
        # State columns per warpgroup, the same in the summary pass.
        block_v = cfg.block_v or recurrence_mgpu.DEFAULT_BLOCK_V
        cfg = dataclasses.replace(cfg, block_v=block_v, summary_block_v=block_v)
        widths = recurrence_mgpu.recurrence_widths(K, V, block_v, out_dtype)
    P = cfg.num_segments or plan_segments(N, HV, V, int(T // C) + 1, backend="gpu", K=K, recurrence_widths=widths,
                                          summary_paid=initial_state_fn is not None, recurrence=cfg.recurrence)
    n_slots = N * n_ck + N
    if mosaic:
        scan = partial(recurrence_mgpu.scan_call, n_ck_slots=n_slots, interpret=bool(interpret))
    else:
        if cfg.block_v is None:
            cfg = dataclasses.replace(cfg, block_v=64 if P > 1 or gpu_programs(N, HV, V, 64) >= gpu_core_count() else 32)
        scan_precision = default_precision(cfg.scan_precision, out_dtype, scan=store == jnp.dtype(_BF16))
        scan = partial(recurrence_triton.scan_call, n_ck_slots=n_slots, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, precision=scan_precision, interpret=interpret)
    cstart = lay.cstart
    nch = cstart[1:] - cstart[:-1]
    ci, seq = lay.ckpt[:NC], lay.chunk_seq[:NC]
    p = jnp.arange(P, dtype=jnp.int32)
    vstart = (cstart[:-1, None] + (p * nch[:, None]) // P).reshape(-1)
    vend = (cstart[:-1, None] + ((p + 1) * nch[:, None]) // P).reshape(-1)
    ck_slot = jnp.where(ci >= 0, seq * n_ck + ci, -1)
    starts = init
    if P > 1 or initial_state_fn is not None:
        starts, init = _segment_starts(scan, prep, init, vstart, vend, cfg=cfg, N=N, P=P, HV=HV, K=K, V=V,
                                       initial_state_fn=initial_state_fn, interpret=interpret)
    cta_cols = {} if not mosaic else dict(cta_cols=recurrence_cta_cols(N, HV, V, P, widths))
    o, final, ckpts = scan(prep, starts, vstart, vend, ck_slot, out_dtype=out_dtype, block_v=cfg.block_v, **cta_cols)
    return o, final.reshape(N, P, HV, K, V)[:, -1], ckpts, init


def _recurrence_tpu(prep, packed: _Packed, init, *, N, out_dtype, interpret):
    """The TPU recurrent stage over whole sequences. Returns ``(o [TT, HV, V], final, checkpoint slots)``."""
    lay, NC, n_ck = packed.lay, packed.NC, packed.n_ck
    ci, seq = lay.ckpt[:NC], lay.chunk_seq[:NC]
    c = jnp.arange(NC, dtype=jnp.int32)
    # + a spare checkpoint slot per sequence for chunks that write none.
    slot = jnp.where(ci >= 0, seq * n_ck + ci, N * n_ck + seq)
    # The checkpoint block of a chunk that writes none: the next one its sequence writes.
    nxt = jax.lax.cummin(jnp.where(ci >= 0, c, NC), reverse=True)
    nxt_c = jnp.minimum(nxt, NC - 1)
    slot = jnp.where((ci < 0) & (nxt < NC) & (seq[nxt_c] == seq), slot[nxt_c], slot)
    i32 = lambda x: x.astype(jnp.int32)
    o, final, ckpts = prefill_tpu.scan_call(
        prep, init, i32(lay.first[:NC]), i32(lay.last[:NC]), seq, i32(ci >= 0), slot,
        n_ck_slots=N * n_ck + N, out_dtype=out_dtype, interpret=interpret,
    )
    return jnp.moveaxis(o, 1, 0), final, ckpts


def _unpack(o, final, ckpts, init, packed: _Packed, *, B, T, N, HV, K, V, out_dtype, checkpoint_stride):
    """Outputs back to ``[B, T, HV, V]`` (tokens past ``cu_seqlens[-1]`` zero), empty sequences'
    final states their initial ones, checkpoints per sequence (zero where not written)."""
    lay, n_ck = packed.lay, packed.n_ck
    final = jnp.where((lay.lens == 0)[:, None, None, None], init, final)
    if packed.dense:
        o = o.reshape(B, T, HV, V)
    else:
        o = jnp.where(lay.tok_ok[:, None, None], o[lay.dst], 0).astype(out_dtype).reshape(B, T, HV, V)
    if checkpoint_stride is None:
        return o, final
    ckpts = ckpts[: N * n_ck].reshape(N, n_ck, HV, K, V)
    written = jnp.arange(n_ck)[None, :] < (lay.lens // checkpoint_stride)[:, None]
    return o, final, jnp.where(written[..., None, None, None], ckpts, 0.0)


def chunk_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, chunk_size: int = 64,
    checkpoint_stride: int | None = None, use_qk_l2norm: bool = False, initial_state_fn=None, gate_lower_bound=None,
    backend: str | None = None, interpret=None, config: PrefillConfig | None = None, **tuning,
):
    """Chunked KDA prefill as Pallas kernels; arguments and results as :func:`k3jax.ops.kda.chunk_kda`.

    On the GPU, float32 ``q, k, v`` with K or V above ``GPU_F32_MAX_HEAD`` (64) run as a bf16
    call (they do not fit the kernels' shared memory in float32): bf16 operands and outputs (cast
    back to float32); the gates, beta, the state and the checkpoints stay float32.

    Extra keyword arguments:
      gate_lower_bound: a promise that every gate value is at least this (K3: -5; must be in
        [-5, 0]). GPU: stage 1 then skips its gate-span checks (diagonal blocks always as
        anchored matmuls: finite in float32 only for bounded gates); gates below the bound give
        wrong results. The serving engine passes the K3 configs' bound.
      backend: "tpu" or "gpu" kernels; None picks by the default device ("cpu" runs the TPU
        kernels in the interpreter).
      interpret: None: interpret on CPU (``pltpu.InterpretParams()`` for the TPU kernels),
        compile elsewhere; or an explicit value passed to ``pallas_call``.
      initial_state_fn: as in :func:`k3jax.ops.kda.chunk_kda` (the sequences' own maps in, the
        initial states out). GPU: the maps come from the segment summary pass over this call's
        token-parallel stage; TPU: from :func:`k3jax.ops.kda.sequence_maps` (XLA).
      config, **tuning: the kernels' tuning knobs, a :class:`PrefillConfig` and/or its fields as
        keyword arguments (``num_segments=2, recurrence="triton"``), which override ``config``'s.
    """
    # Validate.
    B, T, H, HV, K, V, N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size=chunk_size,
                                            checkpoint_stride=checkpoint_stride)
    kind = _backend(backend)
    if kind == "gpu" and not gpu_head_dims_ok(K, V):
        raise ValueError(f"the GPU kernels need K and V to be powers of two >= 16, got K={K}, V={V}")
    if gate_lower_bound is not None and not -5.0 <= gate_lower_bound <= 0.0:
        raise ValueError(f"gate_lower_bound must be in [-5, 0] (None for unbounded gates), got {gate_lower_bound}")
    result_dtype = output_dtype(v)
    if kind == "gpu" and max(K, V) > GPU_F32_MAX_HEAD and jnp.dtype(result_dtype) == jnp.dtype(_F32):
        q, k, v = (x.astype(_BF16) for x in (q, k, v))  # from here on a bf16 call
    out_dtype = output_dtype(v)

    # Configure.
    cfg = dataclasses.replace(config or PrefillConfig(), **tuning)
    cfg = _resolve(cfg, kind, K, V, chunk_size, q.dtype, k.dtype, v.dtype, out_dtype)
    interpret = _interpret(interpret, kind)
    scale = K**-0.5 if scale is None else float(scale)
    C = chunk_size
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    init = jnp.zeros((N, HV, K, V), _F32) if initial_state is None else initial_state.astype(_F32)
    if initial_state_fn is not None and kind == "tpu":
        init = initial_state_fn(*sequence_maps(k, v, g, beta, cu_seqlens=cu_seqlens, chunk_size=C)).astype(_F32)

    # Pack, stage 1, recurrence.
    packed = _pack(q, k, v, g, beta, cu_seqlens, C=C, N=N, checkpoint_stride=checkpoint_stride)
    if kind == "gpu":
        prep = gpu_prep(packed.q, packed.k, packed.v, packed.g, packed.beta, C=C, scale=scale,
                        precision=default_precision(cfg.prep_precision, out_dtype), num_warps=cfg.prep_num_warps,
                        store_dtype=jnp.dtype(cfg.intermediate_dtype), bounded=gate_lower_bound is not None,
                        interpret=interpret, kernel=cfg.prep_kernel, wu_kernel=cfg.wu_kernel)
        o, final, ckpts, init = _recurrence_gpu(prep, packed, init, cfg=cfg, T=T, C=C, N=N, HV=HV, K=K, V=V,
                                                out_dtype=out_dtype, initial_state_fn=initial_state_fn,
                                                interpret=interpret)
    else:
        head = lambda x: jnp.moveaxis(x, 1, 0)
        prep = prefill_tpu.prep_call(*(head(x) for x in packed[:5]), C=C, scale=scale,
                                     compiler_params=prefill_tpu.PREP_PARAMS, interpret=interpret)
        o, final, ckpts = _recurrence_tpu(prep, packed, init, N=N, out_dtype=out_dtype, interpret=interpret)

    # Unpack.
    o, *rest = _unpack(o, final, ckpts, init, packed, B=B, T=T, N=N, HV=HV, K=K, V=V, out_dtype=out_dtype,
                       checkpoint_stride=checkpoint_stride)
    return (o.astype(result_dtype), *rest)
