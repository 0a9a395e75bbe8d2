"""The serving step: one jitted forward over a packed ragged batch of rows on the unified page pool.

Each row is a decode token or a prefill chunk of one request. The first ``num_decode`` rows are
decode rows (row ``i`` is token ``i``); the prefill rows follow, packed (``cu_seqlens``). Every
token-wise op (projections, norms, MoE) runs over all tokens at once; KDA and MLA split into the
decode part (one recurrence step per row; multi-query attention over latent pages) and the
prefill part (the varlen chunked KDA; attention over cached pages plus the chunk).

Compared with :func:`k3jax.model.forward` (the golden reference): weights in ``dtype`` (bf16 for
serving) with float32 accumulation, float32 residual stream, norm statistics, router, gates, KDA
state and logits; MLA with absorbed weights (``kv_b`` split at load into ``w_uk`` and ``w_uv``,
attention over the 576-wide latents, never re-expanded over the cache); routed experts as one
grouped matmul per projection over tokens sorted by expert; logits for one token per row and
sampling on the device. Caches live in the unified pool (:mod:`k3jax.model.pool`), read by page
id and written in place (the pool is donated).

The attention here is the pure-JAX form: it gathers ``max_blocks * page_tokens`` latent rows per
row (the batch's context bucket) and masks, so its work follows the bucket, not each row's
context; a paged kernel replaces it (issue 51).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.model.config import ModelConfig
from k3jax.model.model import (attn_res_mix, glu, init_tree, latent_moe_out, mla_inputs, param_shapes, rms_norm,
                               route)
from k3jax.model.mxfp4 import MXFP4, dequantize
from k3jax.model.pool import (PoolLayout, copy_pages, from_state_view, latent_words, read_conv, read_kda,
                              read_latent_tile, read_latents, state_row, state_view, token_pages, write_conv, write_kda,
                              write_latents)
from k3jax.ops.conv import short_conv, short_conv_step
from k3jax.ops.kda import chunk_kda, kda_commit, kda_decode_step, kda_gate, kda_verify, l2norm
from k3jax.parallel.kcp import chunk_kda_on_shard, short_conv_on_shard

f32 = jnp.float32
i32 = jnp.int32


def grouped_matmul(lhs, rhs, group_sizes, **kw):
    """``tokamax.ragged_dot`` (the contract of :func:`jax.lax.ragged_dot`): on the H200 it ran one
    MoE projection of Kimi-Linear-48B 9-104x faster than ``jax.lax.ragged_dot`` with the same bits
    (docs/benchmarks.md); elsewhere it falls back to XLA. Its implementations are picked once for
    the default device (see :func:`_grouped_implementations`)."""
    import tokamax  # imported on first use: it pulls in its profiler tooling

    impls = implementations_for_widths(_grouped_implementations(), lhs.shape[-1], rhs.shape[-1])
    if impls == ():
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, **kw)
    return tokamax.ragged_dot(lhs, rhs, group_sizes, implementation=impls, bypass_device_check=impls is not None,
                              **kw)


MOSAIC_GPU_TILE = 32  # tokamax's Mosaic GPU ragged_dot fails to lower other widths (48: the tiny K3's latent)


def implementations_for_widths(impls: tuple[str, ...] | None, k: int, n: int) -> tuple[str, ...] | None:
    """``impls``, or only its XLA one when the contracted width ``k`` or the output width ``n``
    is not a whole number of Mosaic GPU tiles: tokamax picks its Mosaic kernel for them and it
    then fails to lower, past tokamax's fallback (an H100, 2026-12-07: "dimension 1 must have size
    smaller or a multiple of its tiling 32, but got 48"). ``()``: none left, use ``jax.lax.ragged_dot``."""
    if impls is None or (k % MOSAIC_GPU_TILE == 0 and n % MOSAIC_GPU_TILE == 0):
        return impls
    return tuple(i for i in impls if i == "xla")


def import_kernel_libraries(kernels: "StepKernels"):
    """Import now what ``kernels`` would import on first use. Importing tokamax changes JAX's
    tracing context, so a step traced before it is traced (and compiled) again after it: an
    engine calls this before compiling its steps."""
    if kernels.ragged_dot is grouped_matmul:
        import tokamax  # noqa: F401


@functools.cache
def _grouped_implementations() -> tuple[str, ...] | None:
    """tokamax's default implementations that support the default device, in its order (None if
    its internals moved). Given explicitly, tokamax skips its per-call device check, which on traced
    arguments builds an error message by walking the whole trace so far: 35 of the 43 s of
    tracing a 27-layer step (quadratic in the layers)."""
    try:
        from tokamax._src.ops.ragged_dot import api
    except ImportError:
        return None
    dev = jax.devices()[0]
    names = {"mosaic": "mosaic_gpu" if "NVIDIA" in dev.device_kind else "mosaic_tpu"}
    ops = [(n, getattr(api, "IMPLEMENTATIONS", {}).get(names.get(n, n))) for n in getattr(api, "_DEFAULT_IMPLEMENTATIONS", ())]
    out = tuple(n for n, op in ops if op is not None and op.supported_on(dev))
    return out or None


@dataclass(frozen=True)
class StepKernels:
    """Device ops of the serving step. ``chunk_kda`` has the varlen contract of
    :func:`k3jax.ops.kda.chunk_kda` (serving passes the Pallas prefill on a GPU); ``ragged_dot``
    that of :func:`jax.lax.ragged_dot` with ``preferred_element_type``; ``mla_decode`` (None: the
    pure-JAX attention over the gathered bucket) that of
    :func:`pallas_kernels.mla.paged_mla_decode`, for decode and window tokens; ``kda_decode``
    (None: gather the decode rows' states, step them, scatter them back) that of
    :func:`pallas_kernels.kda.decode_pages.kda_decode_pages`, for plain decode rows."""

    chunk_kda: Callable = chunk_kda
    ragged_dot: Callable = grouped_matmul
    mla_decode: Callable | None = None
    kda_decode: Callable | None = None
    mxfp4_block_bytes: int = 1 << 30  # the most bytes of packed experts dequantised at once (see grouped_mxfp4)
    # MXFP4 experts of a decode step (fewer routed slots than experts): a grouped matmul that
    # dequantises in registers, the contract of pallas_kernels.moe.mxfp4_grouped_matmul (None:
    # gather the routed experts still packed, then grouped_mxfp4)
    mxfp4_matmul: Callable | None = None
    # prefill buckets of at least this many tokens attend over expanded keys and values (prefill_attention;
    # None: never; default_step_kernels sets 1024 on a GPU)
    expand_prefill_from: int | None = None
    # a sampler call off the step applies top-k and top-p by searched cuts (sample's filters
    # "top_k" / "top_p"), not the sort (False: the sort). The engine's chat-sampling step was 1.3x
    # faster with the search (H100, 2026-12-07, docs/benchmarks.md)
    search_cuts: bool = True
    # a prefill row may take its checkpoint inside its chunk (batch.checkpoint_at, a multiple of this
    # many tokens from its start; the prefill kernel's checkpoint_stride), so the chunk need not
    # end on the hash boundary (None: the checkpoint is the state after the row)
    checkpoint_stride: int | None = None
    # expanded prefill attention (expand_prefill_from) tile by tile in this fused kernel, the
    # contract of pallas_kernels.mla.prefill_flash.attend_tile (None: scores in XLA)
    mla_prefill: Callable | None = None


class Parallel(NamedTuple):
    """How :func:`model_step` runs on one device's part of a mesh (inside ``shard_map``; see
    :mod:`k3jax.parallel.sharded_step`): the mesh axis its heads, dense widths and vocabulary
    split over (``tensor``; its attention and dense outputs are summed over it, its logits
    gathered), and the axes its routed experts split over (``experts``, row-major; the routed
    output is summed over them). Its ``cfg`` then counts the device's own heads.

    ``data``: an axis (the first of ``experts``) over which each device has its own batch and
    pages: the MoE gathers every data shard's tokens, multiplies those routed to its experts,
    and sums each token's result back to its shard (all-gather + local grouped matmul +
    reduce-scatter).

    ``context``: an axis (one of ``experts``, over which the attention is replicated) over which
    the step's prefill tokens split (context parallelism): each device runs every decode token
    and a contiguous ``1 / P`` of the prefill tokens, the KDA layers by KCP (each prefill row's
    state carried across devices by :func:`k3jax.parallel.kcp.chunk_kda_on_shard`), the MLA
    layers by an all-gather of the prefill tokens' latents (every device writes every latent;
    its queries read them from the pages), the MoE by an all-gather of its prefill tokens and a
    reduce-scatter of their sums."""

    tensor: str | None = None
    experts: tuple[str, ...] = ()
    data: str | None = None
    context: str | None = None


def _psum(x, axes):
    return jax.lax.psum(x, axes) if axes else x


class StepBatch(NamedTuple):
    """One step's packed inputs (host-built, bucketed shapes; see :func:`pack_batch`).

    tokens ``i32[T]``; cu_seqlens ``i32[R + 1]`` (rows ``i < num_decode`` are tokens
    ``[i * window, (i + 1) * window)``: the last sampled token then ``draft[i]`` draft tokens, the rest
    padding; with ``window == 1`` row ``i`` is token ``i``; padding
    rows are empty or have ``state_slot == -1``); start ``i32[R]`` tokens of the row's sequence
    already in the cache (its first position); block_tables ``i32[R, blocks]`` MLA page ids
    (-1 unused); state_slot ``i32[R]`` the request's KDA state page (-1: padding row, nothing
    written); state_src ``i32[R]`` the page its state is read from (its own slot, a prefix-cache
    checkpoint to resume from, or -1 for zero state); checkpoint ``i32[R]`` a page that also
    receives the row's final state (-1: none), or with ``checkpoint_at i32[R]`` > 0 its state after
    that many of its tokens (a multiple of ``StepKernels.checkpoint_stride``; None or 0: the final
    state); copy_src / copy_dst ``i32[R]`` a whole page copied
    before anything runs (a prefix-cache hit's partial MLA page into the request's own; -1: none);
    draft ``i32[R]`` draft tokens of a decode row's speculative window (0: none); temperature ``f32[R]`` (0: greedy), top_k ``i32[R]`` (0: off), top_p ``f32[R]`` (1: off), seed
    ``u32[R]``.
    """

    tokens: jax.Array
    cu_seqlens: jax.Array
    start: jax.Array
    block_tables: jax.Array
    state_slot: jax.Array
    state_src: jax.Array
    checkpoint: jax.Array
    copy_src: jax.Array
    copy_dst: jax.Array
    draft: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    checkpoint_at: jax.Array | None = None


class StepOutput(NamedTuple):
    """``tokens i32[R]`` sampled after each row's last token (a decode row's window: after its
    first); ``logprob f32[R]`` of that token; ``top_ids i32[R, n]`` / ``top_logprobs f32[R, n]``
    (n = ``num_logprobs``); ``logits f32[R, V]`` only when asked (tests). With a window ``W > 1``:
    ``accepted i32[num_decode]`` draft tokens each decode row accepted (greedy rows; a draft is
    accepted while it equals the greedy token before it) and ``window i32[num_decode, W]`` the
    greedy token after each window position: the row emits ``tokens[i]`` then
    ``window[i, 1 : accepted[i] + 1]``, and its state is committed after ``1 + accepted[i]`` tokens.
    A step that leaves the sampling to a second call (``sample_rows=False``) has greedy ``tokens``,
    no logprobs, and ``logits`` with ``positions i32[R]`` (the position each row samples at) for
    :func:`sample`."""

    tokens: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    logits: jax.Array | None
    accepted: jax.Array | None = None
    window: jax.Array | None = None
    positions: jax.Array | None = None


def prepare_params(cfg: ModelConfig, params, dtype=jnp.bfloat16):
    """Serving params from reference params: matrices in ``dtype``; gates, norms, conv and router
    in float32; q, k, v of KDA fused; MLA ``kv_b [nh * (nope + v), L]`` split into
    ``w_uk [nh, nope, L]`` and ``w_uv [nh, v, L]``; experts as ``gate_up [E, D, 2I]``, ``down [E, I, D]``."""
    out = dict(embed=jnp.asarray(params["embed"], dtype), norm=jnp.asarray(params["norm"], f32),
               layers=[prepare_layer(cfg, i, lp, dtype) for i, lp in enumerate(params["layers"])],
               **{k: jnp.asarray(params[k], f32) for k in ("out_res_proj", "out_res_norm") if k in params})
    if not cfg.tie_word_embeddings:
        out["lm_head"] = jnp.asarray(params["lm_head"], dtype)
    return out


_FLOAT32_PARAMS = {"conv", "A_log", "dt_bias", "o_norm", "q_a_norm", "kv_a_norm", "router", "bias", "latent_norm"}


def prepare_layer(cfg: ModelConfig, i: int, lp, dtype=jnp.bfloat16):
    """:func:`prepare_params` for layer ``i`` alone. MXFP4 experts stay packed (``[E, in, out]``,
    ``axis=-2``; :func:`moe` dequantises them)."""
    cast = lambda tree: {k: (cast(v) if isinstance(v, dict) else v if isinstance(v, MXFP4) else
                             jnp.asarray(v, f32 if k in _FLOAT32_PARAMS else dtype)) for k, v in tree.items()}
    a, mp = dict(lp["attn"]), dict(lp["mlp"])
    if cfg.layer_types[i] == "kda":
        a["qkv"] = jnp.concatenate([a.pop("q"), a.pop("k"), a.pop("v")])
    else:
        kv_b = jnp.asarray(a.pop("kv_b")).reshape(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
        a["w_uk"], a["w_uv"] = kv_b[:, : cfg.qk_nope_head_dim], kv_b[:, cfg.qk_nope_head_dim :]
    if cfg.mlp_types[i] == "moe":
        for k in ("gate_up", "down"):
            mp[k] = mp[k].mT if isinstance(mp[k], MXFP4) else jnp.swapaxes(jnp.asarray(mp[k]), 1, 2)
    trunk = {k: jnp.asarray(v, f32) for k, v in lp.items() if k not in ("attn", "mlp")}  # norms, AttnRes
    return dict(**trunk, attn=cast(a), mlp=cast(mp))


def random_mxfp4(key, shape) -> MXFP4:
    """Random packed MXFP4 matrices ``[..., out, in]`` (the checkpoint's layout): uniform codes,
    scales ``2^-8 .. 2^-6`` (weights up to about 0.09)."""
    if shape[-1] % 32:
        raise ValueError(f"MXFP4 packs 32 inputs a scale; matrices {shape} have {shape[-1]}")
    k1, k2 = jax.random.split(key)
    packed = jax.random.bits(k1, (*shape[:-1], shape[-1] // 2), jnp.uint8)
    scale = jax.random.randint(k2, (*shape[:-1], shape[-1] // 32), 119, 122).astype(jnp.uint8)
    return MXFP4(packed, scale)


def random_params(cfg: ModelConfig, key, dtype=jnp.bfloat16, mxfp4: bool = False):
    """Random serving params (the distribution of :func:`k3jax.model.init_params`) built one layer
    at a time, so a model that fills the device never exists twice (benchmarks). ``mxfp4``: the
    routed experts packed (:func:`random_mxfp4`), as in Kimi K3's checkpoint."""
    shapes = param_shapes(cfg)
    keys = jax.random.split(key, cfg.num_layers + 1)
    top = init_tree({k: v for k, v in shapes.items() if k != "layers"}, keys[-1], dtype)
    out = prepare_params(cfg, {**top, "layers": []}, dtype)

    def make(k, i, shp):
        packed = {}
        if mxfp4 and cfg.mlp_types[i] == "moe":
            mlp = dict(shp["mlp"])
            packed = {n: random_mxfp4(kn, mlp.pop(n)) for n, kn in zip(("gate_up", "down"), jax.random.split(k))}
            shp = {**shp, "mlp": mlp}
        lp = init_tree(shp, k, dtype)
        return prepare_layer(cfg, i, {**lp, "mlp": {**lp["mlp"], **packed}}, dtype)

    makers = {}
    for i, shp in enumerate(shapes["layers"]):
        kind = (cfg.layer_types[i], cfg.mlp_types[i])
        if kind not in makers:
            makers[kind] = jax.jit(partial(make, i=i, shp=shp))
        out["layers"].append(makers[kind](keys[i]))
    return out


def _operands(a, b):
    """Both operands in ``b``'s dtype, and the precision: float32 weights run at HIGHEST (the
    reference's numbers); 16-bit ones as 16-bit products with float32 accumulation. XLA:CPU has no
    bf16 x bf16 -> f32 dot, so there the operands are upcast (the same products: a bf16 x bf16
    product is exact in float32)."""
    a = a.astype(b.dtype)
    if b.dtype == f32:
        return a, b, jax.lax.Precision.HIGHEST
    if jax.default_backend() == "cpu":
        return a.astype(f32), b.astype(f32), jax.lax.Precision.DEFAULT
    return a, b, jax.lax.Precision.DEFAULT


def mm(spec: str, a, b, out=f32):
    """``einsum(spec, a, b)`` in ``b``'s dtype, accumulated in float32, the result in ``out`` (see
    :func:`_operands`). A 16-bit ``out`` of 16-bit operands is written by the matmul itself
    (float32 accumulators rounded once, as a float32 result cast after, without its round trip
    through memory)."""
    a, b, prec = _operands(a, b)
    if a.dtype == f32:
        return jnp.einsum(spec, a, b, preferred_element_type=f32, precision=prec).astype(out)
    return jnp.einsum(spec, a, b, preferred_element_type=out, precision=prec)


def linear(x, w, out=f32):
    """``x @ w.T`` with ``w [out, in]``: operands in ``w``'s dtype, the result in ``out``."""
    return mm("...i,oi->...o", x, w, out)


@jax.named_scope("dense_mlp")
def dense_mlp(cfg: ModelConfig, p, x):
    return linear(glu(cfg, linear(x, p["gate"]), linear(x, p["up"])), p["down"])


class _Rows(NamedTuple):
    """Static split and per-token bookkeeping derived from a batch."""

    nd: int  # decode rows
    W: int  # tokens per decode row (its speculative window; 1: plain decode)
    row: jax.Array  # i32[T] row of each token (R for padding tokens)
    pos: jax.Array  # i32[T] position of each token in its sequence
    live: jax.Array  # bool[T]
    context: str | None = None  # the axis the prefill tokens split over (see Parallel)
    every: "_Rows | None" = None  # with ``context``: the rows of every device's tokens (these are its own)

    @property
    def nt(self) -> int:
        """Decode tokens."""
        return self.nd * self.W


def _rows(batch: StepBatch, nd: int, W: int = 1) -> _Rows:
    T, R = batch.tokens.shape[0], batch.start.shape[0]
    t = jnp.arange(T, dtype=i32)
    row = jnp.searchsorted(batch.cu_seqlens, t, side="right").astype(i32) - 1
    live = (t < batch.cu_seqlens[-1]) & (row < R)
    row = jnp.where(live, row, R)
    rc = jnp.minimum(row, R - 1)
    pos = batch.start[rc] + t - batch.cu_seqlens[rc]
    if W > 1:  # a window's padding past its drafts writes nothing
        live = live & ((t >= nd * W) | (t - batch.cu_seqlens[rc] <= batch.draft[rc]))
    return _Rows(nd, W, row, pos, live)


def _context_shard(rows: _Rows, T: int, axis: str) -> tuple[_Rows, jax.Array]:
    """This device's part of a step whose prefill tokens split over ``axis`` (see
    :class:`Parallel`): every decode token, then its contiguous ``1 / P`` of the prefill tokens.
    Returns its rows and their tokens' indices in the batch."""
    L, rem = divmod(T - rows.nt, jax.lax.axis_size(axis))
    if rem:
        raise ValueError(f"{T - rows.nt} prefill tokens do not split over the {jax.lax.axis_size(axis)} devices "
                         f"of axis {axis!r}")
    idx = jnp.concatenate([jnp.arange(rows.nt, dtype=i32), rows.nt + jax.lax.axis_index(axis) * L
                           + jnp.arange(L, dtype=i32)])
    return _Rows(rows.nd, rows.W, rows.row[idx], rows.pos[idx], rows.live[idx], axis, rows), idx


def _spread(a, nt: int, axis: str | None):
    """``a [nt + L, ...]``, a device's decode tokens then its prefill tokens, with every device's
    prefill tokens: ``[nt + P L, ...]`` (``a`` itself without an axis)."""
    if axis is None:
        return a
    return jnp.concatenate([a[:nt], jax.lax.all_gather(a[nt:], axis, axis=0, tiled=True)])


@jax.named_scope("kda_layer")
def kda_layer(cfg: ModelConfig, lay: PoolLayout, kernels: StepKernels, p, x, pool, li: int, batch: StepBatch,
              rows: _Rows):
    """KDA sublayer over packed ``x [T, D]``; reads and writes KDA layer ``li``'s state pages.
    Returns ``(out, pool, window)``: with decode windows (``rows.W > 1``) their rows' states are
    not written here; ``window`` holds what :func:`commit_windows` needs to write them once the
    accepted drafts are known (else None)."""
    T = x.shape[0]
    HV, K, nd, nt = cfg.linear_num_heads, cfg.linear_head_dim, rows.nd, rows.nt
    raw = linear(x, p["qkv"], x.dtype)  # [T, 3 * HV * K]
    g = kda_gate(linear(linear(x, p["f_a"]), p["f_b"]).reshape(T, HV, K), p["A_log"].reshape(HV), p["dt_bias"],
                 lower_bound=cfg.kda_lower_bound)
    beta = jax.nn.sigmoid(linear(x, p["b"]))
    outs, finals, convs, window, checkpoint = [], [], [], None, None
    paged = nd and rows.W == 1 and kernels.kda_decode is not None
    if paged:  # the decode rows step their states on their pages; the prefill rows' are read after
        o_d, pool = _kda_decode_on_pages(cfg, lay, kernels, p["conv"], raw[:nd], g[:nd], beta[:nd], pool, li, batch)
        outs.append(o_d)
    first = nd if paged else 0  # the first row whose state is gathered
    if not paged or T > nt:
        state, conv = read_kda(lay, pool, batch.state_src[first:], li)
    if nd and rows.W > 1:
        raw_w = raw[:nt].reshape(nd, rows.W, -1)
        y, _ = short_conv(raw_w, p["conv"], activation="silu", initial_state=conv[:nd])
        q, k, v = (a.reshape(nd, rows.W, HV, K) for a in jnp.split(y, 3, axis=-1))
        k = l2norm(k)
        g_w, beta_w = g[:nt].reshape(nd, rows.W, HV, K), beta[:nt].reshape(nd, rows.W, HV)
        outs.append(kda_verify(state[:nd], l2norm(q), k, v, g_w, beta_w).reshape(nt, HV, K))
        window = (conv[:nd], raw_w, k, v, g_w, beta_w)
    elif nd and not paged:
        y, c_d = short_conv_step(raw[:nd], conv[:nd], p["conv"], activation="silu")
        q, k, v = (a.reshape(nd, HV, K) for a in jnp.split(y, 3, axis=-1))
        o_d, s_d = kda_decode_step(state[:nd], l2norm(q), l2norm(k), v, g[:nd], beta[:nd])
        outs.append(o_d)
        finals.append(s_d)
        convs.append(c_d)
    if T > nt:
        cu = batch.cu_seqlens[nd:] - nt  # with rows.context: the prefill rows over every device's tokens
        if rows.context:
            y, c_p = short_conv_on_shard(raw[None, nt:], cu, conv[nd - first:], p["conv"], axis_name=rows.context)
        else:
            y, c_p = short_conv(raw[None, nt:], p["conv"], activation="silu", initial_state=conv[nd - first:],
                                cu_seqlens=cu)
        q, k, v = (a.reshape(1, T - nt, HV, K) for a in jnp.split(y[0], 3, axis=-1))
        args = (l2norm(q), l2norm(k), v, g[None, nt:], beta[None, nt:])
        stride = kernels.checkpoint_stride
        if rows.context:
            o_p, s_p = chunk_kda_on_shard(*args, cu, state[nd - first:], axis_name=rows.context,
                                          kernel=kernels.chunk_kda)
        elif stride is not None and T - nt >= stride and batch.checkpoint_at is not None:
            o_p, s_p, inside = kernels.chunk_kda(*args, initial_state=state[nd - first:], cu_seqlens=cu,
                                                 checkpoint_stride=stride)
            checkpoint = _checkpoint_inside(inside, raw[nt:], cu, batch.checkpoint_at[nd:], stride, s_p, c_p)
        else:
            o_p, s_p = kernels.chunk_kda(*args, initial_state=state[nd - first:], cu_seqlens=cu)
        outs.append(o_p[0])
        finals.append(s_p)
        convs.append(c_p)
    o = jnp.concatenate([part.astype(f32) for part in outs])
    if finals:  # rows of decode windows are written by commit_windows, after the step
        first = nd if window is not None or paged else 0  # the first row in finals
        final, conv = (jnp.concatenate([part.astype(f32) for part in a]) for a in (finals, convs))
        pool = write_kda(lay, pool, batch.state_slot[first:], li, final, conv)
        if checkpoint is not None:  # the prefill rows' checkpoints from inside their chunks
            final, conv = (jnp.concatenate([part.astype(f32) for part in [*a[:-1], c]])
                           for a, c in zip((finals, convs), checkpoint))
        pool = write_kda(lay, pool, batch.checkpoint[first:], li, final, conv)
    gate = linear(x, p["g"]) if "g" in p else linear(linear(x, p["g_a"]), p["g_b"])
    o = rms_norm(o.astype(f32), p["o_norm"], cfg.rms_norm_eps) * jax.nn.sigmoid(gate.reshape(T, HV, K))
    return linear(o.reshape(T, HV * K), p["o"]), pool, window


def _checkpoint_inside(inside, raw, cu, at, stride: int, final, conv):
    """Each prefill row's checkpoint: where ``at i32[N] > 0`` its state after ``at`` of its tokens
    (from the kernel's states every ``stride`` tokens, ``inside [N, n, HV, K, V]``) and the conv
    state there (the ``W - 1`` raw inputs ``raw [tokens, D]`` before it; ``at >= W - 1``), else its
    ``final`` and ``conv`` states. ``cu``: the rows' offsets in ``raw``."""
    W1 = conv.shape[1]
    j = jnp.clip(at // stride - 1, 0, inside.shape[1] - 1)
    state = jnp.take_along_axis(inside, j[:, None, None, None, None], axis=1)[:, 0]
    tok = jnp.clip(cu[:-1, None] + at[:, None] - W1 + jnp.arange(W1), 0, raw.shape[0] - 1)
    take = at > 0
    return (jnp.where(take[:, None, None, None], state, final),
            jnp.where(take[:, None, None], raw[tok].astype(conv.dtype), conv))


def _kda_decode_on_pages(cfg: ModelConfig, lay: PoolLayout, kernels: StepKernels, conv_w, raw, g, beta, pool, li,
                         batch: StepBatch):
    """The decode rows of :func:`kda_layer` through ``kernels.kda_decode``: their states are read
    from and written to their pages by the kernel (no gather or scatter of states); only the
    small conv states go through XLA. Returns ``(o [nd, HV, V], pool)``."""
    nd, HV, K = raw.shape[0], cfg.linear_num_heads, cfg.linear_head_dim
    src, slot, ckpt = batch.state_src[:nd], batch.state_slot[:nd], batch.checkpoint[:nd]
    y, conv = short_conv_step(raw, read_conv(lay, pool, src, li), conv_w, activation="silu")
    q, k, v = (a.reshape(nd, HV, K) for a in jnp.split(y, 3, axis=-1))
    o, states = kernels.kda_decode(state_view(lay, pool), state_row(lay, li), src, slot, ckpt, l2norm(q), l2norm(k),
                                   v, g, beta)
    pool = from_state_view(lay, states)
    for pages in (slot, ckpt):
        pool = write_conv(lay, pool, pages, li, conv)
    return o, pool


def commit_windows(lay: PoolLayout, pool, batch: StepBatch, nd: int, layers, windows, num_tokens):
    """Write the state of decode rows after their window's first ``num_tokens i32[nd]`` tokens
    into their slots (and checkpoint pages), for KDA layers ``layers i32[n]`` from their
    ``windows`` (:func:`kda_layer`'s, stacked over those layers)."""
    def one(pool, xs):
        li, (conv, raw, k, v, g, beta) = xs
        state, _ = read_kda(lay, pool, batch.state_src[:nd], li)
        state = kda_commit(state, k, v, g, beta, num_tokens)
        both = jnp.concatenate([conv, raw.astype(f32)], axis=1)  # the inputs the conv state is the last W - 1 of
        conv = jax.vmap(lambda b, n: jax.lax.dynamic_slice_in_dim(b, n, conv.shape[1]))(both, num_tokens)
        pool = write_kda(lay, pool, batch.state_slot[:nd], li, state, conv)
        return write_kda(lay, pool, batch.checkpoint[:nd], li, state, conv), None

    return jax.lax.scan(one, pool, (layers, windows))[0]


def latent_attention(q_lat, q_rope, ctx, visible, L: int, scale: float, w_uv):
    """Multi-query attention over latents (absorbed MLA): ``q_lat [.., nh, L]`` (q_nope through
    ``w_uk``), ``q_rope [.., nh, R]``, ``ctx [S, L + R]``, ``visible bool[.., S]``.
    Returns ``[.., nh, v]`` in float32."""
    s = (mm("...hl,sl->...hs", q_lat, ctx[:, :L]) + mm("...hr,sr->...hs", q_rope, ctx[:, L:])) * scale
    s = jnp.where(visible[..., None, :], s, -jnp.inf)
    a = jax.nn.softmax(s, axis=-1)
    return mm("...hl,hvl->...hv", mm("...hs,sl->...hl", a, ctx[:, :L]), w_uv)


@jax.named_scope("prefill_attention")
def prefill_attention(lay: PoolLayout, pool, li, q_lat, q_rope, mine, pos, block_table, end, *, scale: float,
                      tile: int, expand=None):
    """Absorbed attention of the queries ``mine bool[T]`` of ``q_lat [T, nh, L]``, ``q_rope [T, nh, R]``
    (those of one row, at positions ``pos i32[T]``) over that row's latents in the pool, read
    ``tile`` tokens at a time from its ``block_table`` up to its context ``end`` (an online
    softmax: the work and memory follow the row's context, not the bucket's). Returns the
    attention-weighted latents ``f32[T, nh, L]`` (zeros for other rows' queries).

    ``expand=(w_uk [nh, n, L], w_uv [nh, v, L])``: ``q_lat`` is the un-absorbed ``q_nope [T, nh, n]``
    and each tile's latents are expanded to keys and values first (``n + R + v`` products a score
    and value instead of ``2 L + R``: fewer for a long chunk); returns ``f32[T, nh, v]``
    (:func:`flash_prefill_attention`: the same in a fused kernel)."""
    T, H, _ = q_lat.shape
    L = lay.latent - q_rope.shape[-1]
    offs = jnp.arange(tile, dtype=i32)

    def body(j, carry):
        m, l, acc = carry
        ctx = read_latent_tile(lay, pool, li, block_table, j * tile, tile, end)  # [tile, L + R]
        if expand is None:
            keys, values = ctx[:, :L], ctx[:, :L]
            s = mm("thl,sl->ths", q_lat, keys)
        else:
            keys, values = _expand_tile(ctx[:, :L], expand)
            s = mm("thn,shn->ths", q_lat, keys)
        s = (s + mm("thr,sr->ths", q_rope, ctx[:, L:])) * scale
        vis = mine[:, None] & (j * tile + offs[None, :] <= pos[:, None])  # causal; rows past `end` are zeros
        s = jnp.where(vis[:, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a query that has seen nothing yet
        p, alpha = jnp.exp(s - base[..., None]), jnp.exp(m - base)
        pv = mm("ths,sl->thl", p, values) if expand is None else mm("ths,shv->thv", p, values)
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv

    width = L if expand is None else expand[1].shape[1]
    init = (jnp.full((T, H), -jnp.inf, f32), jnp.zeros((T, H), f32), jnp.zeros((T, H, width), f32))
    _, l, acc = jax.lax.fori_loop(0, (end + tile - 1) // tile, body, init)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def _expand_tile(latents, expand):
    """A tile's keys and values ``[S, nh, n]``, ``[S, nh, v]`` from its latents ``[S, L]`` through
    ``expand=(w_uk, w_uv)``, in the latents' dtype."""
    return tuple(mm("sl,hnl->shn", latents, w, latents.dtype) for w in expand)


@jax.named_scope("flash_prefill_attention")
def flash_prefill_attention(lay: PoolLayout, pool, li, q_nope, q_rope, pos, block_table, end, expand, *,
                            scale: float, tile: int, flash: Callable, block: int):
    """:func:`prefill_attention`'s expanded form with each tile's scores in ``flash`` (the contract
    of :func:`pallas_kernels.mla.prefill_flash.attend_tile`, in blocks of ``block`` queries and
    keys): ``q_nope [T, nh, n]``, ``q_rope [T, nh, R]`` in the latents' dtype and ``pos i32[T]``
    (-1 for another row's queries), T and ``tile`` multiples of ``block``. Returns ``f32[T, nh, v]``."""
    T, H, _ = q_nope.shape
    L = lay.latent - q_rope.shape[-1]

    def body(j, state):
        ctx = read_latent_tile(lay, pool, li, block_table, j * tile, tile, end)  # [tile, L + R]
        keys, values = _expand_tile(ctx[:, :L], expand)
        return flash(q_nope, q_rope, pos, keys, ctx[:, L:], values, j * tile, jnp.minimum(end - j * tile, tile),
                     state, scale=scale, block_q=block, block_k=block)

    Dv = expand[1].shape[1]
    init = (jnp.full((H, T), -jnp.inf, f32), jnp.zeros((H, T), f32), jnp.zeros((H, T, Dv), f32))
    _, l, acc = jax.lax.fori_loop(0, (end + tile - 1) // tile, body, init)
    return jnp.moveaxis(acc / jnp.where(l > 0, l, 1.0)[..., None], 0, 1)


PREFILL_TILE = 512  # context tokens a prefill row's attention reads per iteration
FLASH_TILE = 2048  # the same with the fused kernel (it keeps no scores in memory; its state is read once a tile)


@jax.named_scope("mla_layer")
def mla_layer(cfg: ModelConfig, lay: PoolLayout, kernels: StepKernels, p, x, pool, li, batch: StepBatch,
              rows: _Rows):
    """MLA sublayer (no positional encoding, as in Kimi Linear): writes the tokens' latents into
    their pages, then every token attends over its row's latents with absorbed ``kv_b`` (decode
    tokens through ``kernels.mla_decode`` when given), or, in a bucket of at least
    ``kernels.expand_prefill_from`` prefill tokens, the prefill tokens over keys and values
    expanded from them tile by tile."""
    T = x.shape[0]
    nope, rope, L = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    q, latent = mla_inputs(cfg, p, x, linear)
    every = rows.every or rows  # every device writes every token's latent (one device: its own)
    latent = _spread(latent, rows.nt, rows.context)
    page, off = token_pages(lay, batch.block_tables, jnp.minimum(every.row, batch.start.shape[0] - 1), every.pos)
    pool = write_latents(lay, pool, li, jnp.where(every.live, page, -1), off, latent)
    absorb = lambda q: mm("thn,hnl->thl", q[..., :nope], p["w_uk"])
    q_lat, q_rope = absorb(q[: rows.nt]), q[..., nope:]  # the decode tokens'
    S = batch.block_tables.shape[1] * lay.page_tokens
    nd, nt, R = rows.nd, rows.nt, batch.start.shape[0]
    ends = batch.start + batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
    if rows.W > 1:  # a window's padding positions were never written: not part of its context
        ends = jax.lax.dynamic_update_slice_in_dim(ends, batch.start[:nd] + 1 + batch.draft[:nd], 0, 0)
    paged = nd and kernels.mla_decode is not None
    scale = (nope + rope) ** -0.5
    outs = []
    if paged:  # each decode token over its own pages
        tables = batch.block_tables[jnp.minimum(rows.row[:nt], R - 1)]
        # a padding decode row (no pages) reads nothing: its length is 0, not its one position
        # (page -1 read out of the pool: the illegal address on a GPU pool of 2^31 words)
        lengths = jnp.where(rows.live[:nt] & (tables[:, 0] >= 0), rows.pos[:nt] + 1, 0)
        o = kernels.mla_decode(q_lat[:nt].astype(lay.latent_dtype), q_rope[:nt].astype(lay.latent_dtype),
                               latent_words(lay, pool), tables, lengths, li, page_tokens=lay.page_tokens, scale=scale)
        outs.append(mm("thl,hvl->thv", o, p["w_uv"]))
    elif nd:  # each decode row's window of W queries over its own latents, gathered: [nd, S, L + R]
        ctx = read_latents(lay, pool, li, batch.block_tables[:nd], S, ends[:nd])
        attend = partial(latent_attention, L=L, scale=scale, w_uv=p["w_uv"])
        win = lambda a: a[:nt].reshape(nd, rows.W, *a.shape[1:])
        vis = jnp.arange(S, dtype=i32)[None, None, :] <= win(rows.pos)[..., None]
        outs.append(jax.vmap(attend)(win(q_lat), win(q_rope), ctx, vis).reshape(nt, *q_lat.shape[1:2], -1))
    if T > nt:
        # a long chunk attends with expanded keys and values; a short one over the latents
        long = kernels.expand_prefill_from is not None and T - nt >= kernels.expand_prefill_from
        expand = (p["w_uk"], p["w_uv"]) if long else None
        q_p = q[nt:, :, :nope] if expand else absorb(q[nt:])
        block = next((b for b in (64, 32, 16) if S % b == 0), None)  # the fused kernel's query and key block
        flash = kernels.mla_prefill if expand and block else None
        if flash:  # the queries in the latents' dtype, padded to whole blocks, once for every row
            Tq = -(-(T - nt) // block) * block
            pad = lambda a, v=0: jnp.pad(a, ((0, Tq - (T - nt)),) + ((0, 0),) * (a.ndim - 1), constant_values=v)
            q_flash = pad(q_p.astype(lay.latent_dtype)), pad(q_rope[nt:].astype(lay.latent_dtype))

        def one_row(r, mine):  # the context its queries see: up to its last one here
            end = jnp.minimum(ends[r], jnp.max(jnp.where(mine, rows.pos[nt:], -1)) + 1)
            if flash:
                o = flash_prefill_attention(lay, pool, li, *q_flash, pad(jnp.where(mine, rows.pos[nt:], -1), -1),
                                            batch.block_tables[r], end, expand, scale=scale,
                                            tile=min(S, FLASH_TILE), flash=flash, block=block)
                return o[: T - nt]
            return prefill_attention(lay, pool, li, q_p, q_rope[nt:], mine, rows.pos[nt:], batch.block_tables[r], end,
                                     scale=scale, tile=min(S, PREFILL_TILE), expand=expand)

        # each token's row adds its output; a bucket's unused prefill rows (most steps have fewer
        # than its rows) and, with rows.context, those with no token on this device cost nothing
        def add_row(r, o):
            mine = rows.row[nt:] == r
            return jax.lax.cond(jnp.any(mine), lambda r: o + one_row(r, mine), lambda r: o, r)

        width = p["w_uv"].shape[1] if expand else L
        o = jax.lax.fori_loop(nd, R, add_row, jnp.zeros((T - nt, q.shape[1], width), f32))
        outs.append(o if expand else mm("thl,hvl->thv", o, p["w_uv"]))
    o = (jnp.concatenate(outs) if len(outs) > 1 else outs[0]).reshape(T, -1)
    if cfg.mla_output_gate:
        o = o * jax.nn.sigmoid(linear(x, p["g"]))
    return linear(o, p["o"]), pool


def _ragged(kernels: StepKernels, a, w, sizes):
    """``kernels.ragged_dot`` of rows ``a`` sorted by group and a dense stack ``w``, float32 out."""
    a, w, prec = _operands(a, w)
    return kernels.ragged_dot(a, w, sizes, preferred_element_type=f32, precision=prec)


def grouped_mxfp4(kernels: StepKernels, a, w: MXFP4, sizes, dtype):
    """``kernels.ragged_dot(a, dequantize(w), sizes)`` (rows ``a [M, K]`` sorted by group,
    ``sizes i32[E]``; rows past the groups give zeros) without the whole dequantised ``w`` at
    once: ``G`` experts at a time (``kernels.mxfp4_block_bytes`` of them dequantised to ``dtype``),
    each multiplying its own rows ``R`` at a time. Kimi K3's 896 experts of a layer are 39 GB
    dequantised in bf16 (their gate and up projections alone)."""
    E, K, N = w.shape
    per = K * N * jnp.dtype(dtype).itemsize
    G = max((g for g in range(1, E + 1) if E % g == 0 and g * per <= kernels.mxfp4_block_bytes), default=1)
    if G == E:
        return _ragged(kernels, a, dequantize(w, dtype), sizes)
    M, R = a.shape[0], min(a.shape[0], 512)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    a = jnp.concatenate([a, jnp.zeros((R, K), a.dtype)])  # a last tile may run past the rows

    def block(i, out):
        wd = dequantize(jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i * G, G), w), dtype)
        lo, hi = starts[i * G], ends[i * G + G - 1]  # the block's rows
        s0, e0 = (jax.lax.dynamic_slice_in_dim(x, i * G, G) for x in (starts, ends))

        def tile(carry):
            r0, out = carry
            tile_sizes = (jnp.clip(e0 - r0, 0, R) - jnp.clip(s0 - r0, 0, R)).astype(i32)
            y = _ragged(kernels, jax.lax.dynamic_slice_in_dim(a, r0, R), wd, tile_sizes)
            keep = (jnp.arange(R) < hi - r0)[:, None]
            y = jnp.where(keep, y, jax.lax.dynamic_slice_in_dim(out, r0, R))  # the next block's rows stay
            return r0 + R, jax.lax.dynamic_update_slice_in_dim(out, y, r0, 0)

        return jax.lax.while_loop(lambda c: c[0] < hi, tile, (lo, out))[1]

    return jax.lax.fori_loop(0, E // G, block, jnp.zeros((M + R, N), f32))[:M]


@jax.named_scope("moe")
def moe(cfg: ModelConfig, kernels: StepKernels, p, x, par: Parallel = Parallel(), num_decode_tokens: int = 0):
    """Routed experts as grouped matmuls over tokens sorted by expert, plus the shared experts
    (Stable LatentMoE: the experts work in ``latent_down x``; see :func:`k3jax.model.model.moe`).
    Packed MXFP4 experts are dequantised to ``x``'s dtype (the step's weight dtype) right before
    their grouped matmul, a block of them at a time (:func:`grouped_mxfp4`); with fewer routed
    slots than experts (a decode step), only the experts the tokens route to (gathered, or read
    in place by ``kernels.mxfp4_matmul``). Under
    ``par.experts`` the device holds experts ``[first, first + E)`` of the router's: it
    multiplies only the tokens routed to them (the rest sort last, outside every group, and
    weigh 0), and the routed sums are added over those axes. Under
    ``par.data`` that is done for the tokens of every data shard (see :class:`Parallel`), and
    under ``par.context`` for every device's prefill tokens (``x``: the device's
    ``num_decode_tokens`` decode tokens, then its prefill tokens)."""
    I = cfg.moe_intermediate_size
    z = linear(x, p["latent_down"]) if cfg.latent_moe_size else x
    w, idx = route(cfg, p, x.astype(f32))
    if par.data:  # every data shard's tokens, routed where they are
        w, idx, z = (jax.lax.all_gather(a, par.data, axis=0, tiled=True) for a in (w, idx, z))
    nt = num_decode_tokens
    w, idx, z = (_spread(a, nt, par.context) for a in (w, idx, z))
    E = jax.tree.leaves(p["gate_up"])[0].shape[0]  # the experts on this device
    if par.experts:
        idx = idx - jax.lax.axis_index(par.experts) * E
        mine = (idx >= 0) & (idx < E)
        w, idx = jnp.where(mine, w, 0.0), jnp.where(mine, idx, E)
    flat = idx.reshape(-1)
    gate_up, down = p["gate_up"], p["down"]
    used = None  # the expert of each group, where the groups are the routed experts
    if isinstance(gate_up, MXFP4) and flat.shape[0] < E:  # the routed experts only
        used = jnp.unique(flat, size=flat.shape[0], fill_value=E)  # sorted; E: another device's, or none
        flat = jnp.where(flat < E, jnp.searchsorted(used, flat), flat.shape[0]).astype(i32)  # order kept
        if kernels.mxfp4_matmul is None:  # gathered still packed
            gate_up, down = (jax.tree.map(lambda a: a[jnp.minimum(used, E - 1)], w) for w in (gate_up, down))
        E = flat.shape[0]  # the groups: one per routed slot, the unused ones empty
    k = cfg.num_experts_per_tok
    order = jnp.argsort(flat)
    tok = order // k
    sizes = jnp.bincount(flat, length=E + 1)[:E].astype(i32)

    def grouped(a, w):
        if not isinstance(w, MXFP4):
            return _ragged(kernels, a, w, sizes)
        if used is not None and kernels.mxfp4_matmul is not None:
            return kernels.mxfp4_matmul(a.astype(x.dtype), w.packed, w.scale, sizes, used)
        return grouped_mxfp4(kernels, a, w, sizes, x.dtype)

    h = grouped(z[tok], gate_up)
    y = grouped(glu(cfg, h[:, :I], h[:, I:]), down)
    if par.experts:  # rows past the groups: not this device's (a grouped matmul may leave them unset)
        y = jnp.where((flat[order] < E)[:, None], y, 0.0)
    # back in token order by a gather (no scatter-add), summed in a fixed order
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = jnp.sum(y[back].reshape(-1, k, y.shape[-1]) * w[..., None], axis=1)
    if par.data:  # each shard's tokens back to it, summed over the data axis's experts
        y = jax.lax.psum_scatter(y, par.data, scatter_dimension=0, tiled=True)
    if par.context:  # the decode tokens' sums everywhere, each device's prefill tokens' back to it
        y = jnp.concatenate([jax.lax.psum(y[:nt], par.context),
                             jax.lax.psum_scatter(y[nt:], par.context, scatter_dimension=0, tiled=True)])
    y = _psum(y, tuple(a for a in par.experts if a not in (par.data, par.context)))
    return latent_moe_out(cfg, p, y, linear) + _psum(dense_mlp(cfg, p["shared"], x), par.tensor)


SELECT_BITS = 4  # key bits a pass of the cut search settles (15 thresholds a pass, 8 passes)


def sample(logits, batch: StepBatch, positions, num_logprobs: int = 0, filters: str = "sort"):
    """Per-row sampling of ``logits f32[R, V]``: greedy where ``temperature == 0``, else
    temperature, top-k, top-p and a Gumbel draw keyed by ``fold_in(key(seed), position)``.
    Returns ``(tokens i32[R], logprob f32[R], top_ids i32[R, n], top_logprobs f32[R, n])`` with
    log-probabilities of the unfiltered, untempered distribution.

    ``filters`` (static) says how the top-k and top-p filters are applied:

    - ``"sort"``: one stable sort of the logits, with their ids, serves the filters and the top
      ``n``: a positive temperature keeps the order, so the sorted logits over it are the sorted
      tempered logits, bit for bit; ``jax.lax.top_k`` beside a sort of values would be a second
      full sort on the GPU (XLA's top-k kernel stops at k = 16). The top ids are ranked by
      logit, ties by id: where two logits one rounding apart have the same log-probability, the
      larger comes first (``top_k`` over the log-probabilities would put the lower id first).
    - ``"top_p"`` and ``"top_k"``: no sort; each row's cut is searched (:func:`select_cuts`), with
      its top-k cut only for ``"top_k"`` (the caller guarantees every ``top_k == 0`` for
      ``"top_p"``); no top logprobs (``num_logprobs`` must be 0). The same tokens as ``"sort"``,
      up to the rounding of the top-p mass.
    - ``"none"``: no row filters (every ``top_k == 0`` and ``top_p >= 1``, which the caller
      guarantees) and no top logprobs; the same bits as ``"sort"``."""
    R, V = logits.shape
    if filters not in ("none", "top_p", "top_k", "sort"):
        raise ValueError(f"filters must be 'none', 'top_p', 'top_k' or 'sort', got {filters!r}")
    if filters != "sort" and num_logprobs:
        raise ValueError("top logprobs need the sort: filters='sort'")
    greedy = batch.temperature <= 0
    temp = jnp.where(greedy, 1.0, batch.temperature)[:, None]
    x = logits / temp
    top_ids = jnp.zeros((R, 0), i32)
    if filters == "sort":
        neg, order = jax.lax.sort((-logits, jax.lax.broadcasted_iota(i32, (R, V), 1)), dimension=1, is_stable=True,
                                  num_keys=1)  # descending; ties by id, as top_k
        x = filter_logits(x, -neg / temp, batch.top_k, batch.top_p)
        top_ids = order[:, :num_logprobs]
    elif filters != "none":
        x = select_cuts(x, batch.top_k if filters == "top_k" else None, batch.top_p)
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s.astype(jnp.uint32)), t))(batch.seed, positions)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), f32))(keys)
    drawn = jnp.argmax(x + gumbel, axis=-1)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(i32)
    lp = jax.nn.log_softmax(logits, axis=-1)
    top_lp = jnp.take_along_axis(lp, top_ids, axis=1)
    return tokens, jnp.take_along_axis(lp, tokens[:, None], axis=1)[:, 0], top_ids, top_lp


def select_cuts(x, top_k, top_p):
    """``x f32[R, V]`` with what each row's top-k (``top_k`` None: no row has one) and top-p
    filters drop set to -inf, as :func:`filter_logits` but without a sort and without data-
    dependent control flow (a loop or branch on a GPU waits on the device, stalling the host).

    Each cut is the largest value ``c`` with ``weight(x >= c)`` at least the target: the count
    at least ``top_k`` (the k-th value), then the probability mass over the top-k set at least
    ``top_p`` of the row's (the smallest prefix of the sorted distribution that reaches
    ``top_p``, ties kept together). It is searched over 32-bit keys in the values' order,
    :data:`SELECT_BITS` bits a pass: each pass one reduction over the row that weighs 15
    thresholds and the row's total at once (so the sums and the target round alike). A row
    always keeps its largest value."""
    if x.dtype != f32:
        raise ValueError(f"select_cuts takes float32 logits, got {x.dtype}")
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    bits = jnp.where(bits == jnp.uint32(1 << 31), jnp.uint32(0), bits)  # -0.0 and 0.0: one key (equal values)
    key = jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))  # unsigned, in the order of x
    if top_k is not None:
        kth = _largest_cut(key, jnp.ones(x.shape, i32), lambda total: jnp.maximum(top_k, 1))
        x = jnp.where((top_k[:, None] > 0) & (key < kth[:, None]), -jnp.inf, x)
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    cut = jnp.minimum(_largest_cut(key, e, lambda total: top_p * total), jnp.max(key, axis=-1))
    return jnp.where((top_p[:, None] < 1) & (key < cut[:, None]), -jnp.inf, x)


def _largest_cut(key, weight, target, block: int = 1024):
    """Per row the largest ``c`` (uint32) with ``sum(weight[key >= c]) >= target(total)``, where
    ``total`` is the row's weight summed as the thresholds' sums are (0 if none reaches it).
    Sums run over blocks of ``block``, then over the blocks (every operand in the same order, so
    a sum never falls below one over fewer weights)."""
    if 32 % SELECT_BITS:
        raise ValueError(f"SELECT_BITS must divide 32, got {SELECT_BITS}")
    R, V = key.shape
    block = min(block, V)
    key, weight = (jnp.pad(a, ((0, 0), (0, -V % block))).reshape(R, -1, block) for a in (key, weight))
    zero = jnp.zeros((), weight.dtype)
    add = lambda a, b: tuple(u + v for u, v in zip(a, b))

    def sums(thresholds):  # one pass: the weight at or above each threshold [R]
        parts = tuple(jnp.where(key >= t[:, None, None], weight, zero) for t in thresholds)
        blocks = jax.lax.reduce(parts, (zero,) * len(parts), add, (2,))
        return jax.lax.reduce(blocks, (zero,) * len(parts), add, (1,))

    n = (1 << SELECT_BITS) - 1
    cut, goal = jnp.zeros((R,), jnp.uint32), None
    for shift in range(32 - SELECT_BITS, -1, -SELECT_BITS):
        tries = [cut | jnp.uint32(d << shift) for d in range(1, n + 1)]
        if goal is None:  # the first pass also sums the whole row (threshold 0)
            total, *got = sums([cut] + tries)
            goal = target(total)
        else:
            got = sums(tries)
        digit = sum((g >= goal).astype(jnp.uint32) for g in got)  # the sums fall with the digit
        cut = cut | (digit << shift)
    return cut


def filter_logits(x, srt, top_k, top_p):
    """``x f32[R, V]`` with what each row's top-k and top-p filters drop set to -inf; ``srt`` is
    ``x`` sorted in descending order."""
    V = x.shape[1]
    kth = jnp.take_along_axis(srt, jnp.clip(top_k - 1, 0, V - 1)[:, None], axis=1)
    x = jnp.where((top_k[:, None] > 0) & (x < kth), -jnp.inf, x)
    srt = jnp.where((top_k[:, None] > 0) & (srt < kth), -jnp.inf, srt)
    p = jax.nn.softmax(srt, axis=-1)
    # Keep the smallest prefix of the sorted distribution whose mass reaches top_p.
    before = jnp.cumsum(p, axis=-1) - p
    kept = (before < top_p[:, None]) | (top_p[:, None] >= 1) | (jnp.arange(V) == 0)  # the largest value at least
    cut = jnp.min(jnp.where(kept, srt, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x < cut, -jnp.inf, x)


def layer_runs(cfg: ModelConfig) -> tuple[tuple[int, int, int], ...]:
    """The runs of layers a step scans over: ``(start, period, count)`` with layers
    ``start + n * period + j`` of one kind (attention and MLP type) for each ``j`` and every
    ``n < count``; picked greedily, most layers saved first. A scanned run compiles one period
    instead of ``count`` (Kimi-Linear-48B: layers 1-24, six periods of 3 KDA + 1 MLA; Kimi K3:
    layers 1-88, 22 periods)."""
    kinds = list(zip(cfg.layer_types, cfg.mlp_types))
    runs, free = [], [True] * cfg.num_layers

    def best():
        top = (0, None)
        for P in range(1, min(8, cfg.num_layers // 2) + 1):
            for s in range(cfg.num_layers - 2 * P + 1):
                c = 0
                while (s + (c + 1) * P <= cfg.num_layers and all(free[s + c * P : s + (c + 1) * P])
                       and kinds[s + c * P : s + (c + 1) * P] == kinds[s : s + P]):
                    c += 1
                if c >= 2 and (c - 1) * P > top[0]:
                    top = ((c - 1) * P, (s, P, c))
        return top[1]

    while (run := best()) is not None:
        runs.append(run)
        s, P, c = run
        free[s : s + P * c] = [False] * (P * c)
    return tuple(sorted(runs))


@partial(jax.jit, donate_argnums=0)
def set_layer(stacked, n, layer):
    """``stacked`` (layers along a leading axis) with ``layer`` at ``n``."""
    return jax.tree.map(lambda s, x: s.at[n].set(x), stacked, layer)


# donated: an eager ``.at[n].set`` would copy the stack each time, and on an H200 the 48B model's
# weights (98 GB) beside two stacks of its experts (2 x 22 GB) do not fit
_set_layer_in_place = jax.jit(set_layer, donate_argnums=0)


def stack_layers(cfg: ModelConfig, params):
    """Serving params whose :func:`layer_runs` are stacked for the step's scan: ``layers[i]`` is
    None for a scanned layer and ``runs[r][j]`` holds the run's layers ``start + n * period + j``
    along a leading axis ``n``. Consumes ``params["layers"]``: each layer is freed once copied, so
    at the peak one stack (``count`` layers of one period position) exists twice."""
    layers = params.pop("layers")
    stacked = []
    for s, P, c in layer_runs(cfg):
        group = []
        for j in range(P):
            first = layers[s + j]
            tree = jax.tree.map(lambda a: jnp.zeros((c, *a.shape), a.dtype), first)
            for n in range(c):
                tree = _set_layer_in_place(tree, n, layers[s + n * P + j])
                layers[s + n * P + j] = None
            group.append(tree)
        stacked.append(group)
    return dict(params, layers=layers, runs=stacked)


def layer_shapes(cfg: ModelConfig, params) -> list:
    """Each layer's params, as arrays or (for a layer of a scanned run) ``jax.ShapeDtypeStruct``:
    for counting bytes and FLOPs of params with or without :func:`stack_layers`."""
    out = list(params["layers"])
    for (s, P, c), group in zip(layer_runs(cfg), params.get("runs", ())):
        for j, tree in enumerate(group):
            for n in range(c):
                out[s + n * P + j] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)
    return out


class StepTrunk(NamedTuple):
    """The residual trunk of a step (:class:`k3jax.model.model.Trunk`'s sums) as one fixed-shape
    pytree, so a scan over layers can carry it: ``x`` the current partial sum and, for Block
    AttnRes, the sealed block sums in ``blocks f32[nb, T, D]`` of which the first ``n`` are live."""

    x: jax.Array
    blocks: jax.Array | None = None
    n: jax.Array | int = 0

    @classmethod
    def start(cls, cfg: ModelConfig, x):
        bs = cfg.attn_res_block_size
        return cls(x) if bs is None else cls(x, jnp.zeros((-(-cfg.num_layers // bs), *x.shape), f32), 0)

    def _mix(self, proj, norm, eps):
        live = jnp.arange(self.blocks.shape[0] + 1) < self.n
        live = live.at[-1].set(True)  # x itself
        return attn_res_mix(jnp.concatenate([self.blocks, self.x[None]]), proj, norm, eps, live)

    def attn_input(self, cfg: ModelConfig, i, lp):
        """The attention input of layer ``i`` (may be traced); the trunk after sealing a block."""
        bs = cfg.attn_res_block_size
        if bs is None:
            return self.x, self
        h = self._mix(lp["attn_res_proj"], lp["attn_res_norm"], cfg.rms_norm_eps)  # x alone: x
        seal = i % bs == 0
        if isinstance(seal, bool):
            return h, StepTrunk(jnp.zeros_like(self.x), self.blocks.at[self.n].set(self.x), self.n + 1) if seal else self
        blocks = self.blocks.at[self.n].set(jnp.where(seal, self.x, self.blocks[self.n]))  # in place
        return h, StepTrunk(jnp.where(seal, 0.0, self.x), blocks, self.n + seal.astype(i32))

    def mlp_input(self, cfg: ModelConfig, lp, attn_out):
        t = self._replace(x=self.x + attn_out)
        if cfg.attn_res_block_size is None:
            return t.x, t
        return t._mix(lp["mlp_res_proj"], lp["mlp_res_norm"], cfg.rms_norm_eps), t

    def output(self, cfg: ModelConfig, params):
        if cfg.attn_res_block_size is None:
            return self.x
        return self._mix(params["out_res_proj"], params["out_res_norm"], cfg.rms_norm_eps)


def _run_layers(cfg: ModelConfig, lay: PoolLayout, kernels: StepKernels, params, trunk, pool, batch: StepBatch,
                rows: _Rows, par: Parallel):
    """:func:`model_step`'s layers on ``trunk``, the runs of repeating layers (params from
    :func:`stack_layers`) as a ``lax.scan``. Returns the trunk, the pool and the KDA layers'
    decode windows ``[(KDA layer indices, windows stacked over them)]``."""
    dt = params["embed"].dtype
    index = [sum(t == kind for t in cfg.layer_types[:i]) for i, kind in enumerate(cfg.layer_types)]
    windows = []

    def layer(i, lp, trunk, pool, n=0, per=(0, 0), P=0):
        """Layer ``i + n * P`` (the ``n``-th period of a run of ``P`` layers with ``per`` KDA and MLA
        layers each; ``n`` may be traced) on ``trunk``; returns the trunk, the pool and the KDA
        layer's decode window (or None)."""
        h, trunk = trunk.attn_input(cfg, i + n * P, lp)
        h = rms_norm(h, lp["input_norm"], cfg.rms_norm_eps).astype(dt)
        win = None
        if cfg.layer_types[i] == "kda":
            h, pool, win = kda_layer(cfg, lay, kernels, lp["attn"], h, pool, index[i] + n * per[0], batch, rows)
        else:
            h, pool = mla_layer(cfg, lay, kernels, lp["attn"], h, pool, index[i] + n * per[1], batch, rows)
        h, trunk = trunk.mlp_input(cfg, lp, _psum(h, par.tensor))
        h = rms_norm(h, lp["post_norm"], cfg.rms_norm_eps).astype(dt)
        if cfg.mlp_types[i] == "moe":
            mlp = moe(cfg, kernels, lp["mlp"], h, par, rows.nt)
        else:
            mlp = _psum(dense_mlp(cfg, lp["mlp"], h), par.tensor)
        return trunk._replace(x=trunk.x + mlp), pool, win

    runs = {s: (P, c, group) for (s, P, c), group in zip(layer_runs(cfg), params.get("runs", ()))}
    i = 0
    while i < cfg.num_layers:
        if i not in runs:
            trunk, pool, win = layer(i, params["layers"][i], trunk, pool)
            if win is not None:
                windows.append((jnp.full((1,), index[i], i32), jax.tree.map(lambda a: a[None], win)))
            i += 1
            continue
        P, c, group = runs[i]
        kinds = cfg.layer_types[i : i + P]
        per = (kinds.count("kda"), kinds.count("mla"))

        def period(carry, xs, i=i, P=P, per=per):
            t, pool = carry
            n, lps = xs
            wins = []
            for j in range(P):
                t, pool, win = layer(i + j, lps[j], t, pool, n, per, P)
                if win is not None:
                    wins.append((index[i + j] + n * per[0], win))
            return (t, pool), wins

        (trunk, pool), wins = jax.lax.scan(period, (trunk, pool), (jnp.arange(c, dtype=i32), group))
        windows += wins
        i += P * c
    return trunk, pool, windows


def model_step(cfg: ModelConfig, lay: PoolLayout, kernels: StepKernels, num_decode: int, params, pool,
               batch: StepBatch, *, window: int = 1, num_logprobs: int = 0, return_logits: bool = False,
               sample_rows: bool = True, par: Parallel = Parallel()):
    """One serving step (un-jitted; see :func:`jit_step`). Returns ``(StepOutput, pool)``. With
    params from :func:`stack_layers` the runs of repeating layers are a ``lax.scan``. ``window``:
    tokens per decode row (1 + its most drafts; see :class:`StepBatch` and :class:`StepOutput`).
    ``par``: one device's part of a sharded step (see :class:`Parallel`). ``sample_rows=False``:
    greedy tokens only, and the logits for a :func:`sample` call that the caller makes when a row
    draws or asks for logprobs (the sort and the Gumbel draw then cost nothing on greedy steps)."""
    if par.context and par.data:
        raise ValueError("context parallelism over a mesh with a data axis is not supported")
    rows = every = _rows(batch, num_decode, window)
    tokens = batch.tokens
    if par.context:
        rows, idx = _context_shard(rows, tokens.shape[0], par.context)
        tokens = tokens[idx]
    pool = copy_pages(pool, batch.copy_src, batch.copy_dst)
    trunk = StepTrunk.start(cfg, params["embed"][tokens].astype(f32))
    trunk, pool, windows = _run_layers(cfg, lay, kernels, params, trunk, pool, batch, rows, par)
    last = jnp.maximum(batch.cu_seqlens[1:] - 1, 0)
    out = trunk.output(cfg, params)
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    def logits_of(t):
        logits = linear(rms_norm(_hidden(out, t, rows.nt, par.context), params["norm"], cfg.rms_norm_eps), head)
        vocab_split = par.tensor and not cfg.tie_word_embeddings  # a tied head is the (whole) embedding
        return jax.lax.all_gather(logits, par.tensor, axis=-1, tiled=True) if vocab_split else logits

    accepted = greedy = None
    if window > 1 and num_decode:  # every window token's logits; a decode row samples after its first
        # (the same logits its drafts are checked against: a greedy row's token is greedy[:, 0])
        nt = rows.nt
        win_logits = logits_of(jnp.arange(nt))
        last = jax.lax.dynamic_update_slice_in_dim(last, jnp.arange(num_decode, dtype=i32) * window, 0, 0)
        logits = jnp.concatenate([win_logits[::window], logits_of(last[num_decode:])])
        greedy = jnp.argmax(win_logits, -1).astype(i32).reshape(num_decode, window)
    else:
        logits = logits_of(last)
    positions = every.pos[last] + 1
    if sample_rows:
        tokens, lp, top_ids, top_lp = sample(logits, batch, positions, num_logprobs)
    else:
        tokens, lp, top_ids, top_lp = jnp.argmax(logits, axis=-1).astype(i32), None, None, None
    if greedy is not None:
        drafts = batch.tokens[:nt].reshape(num_decode, window)[:, 1:]
        ok = ((drafts == greedy[:, :-1]) & (jnp.arange(window - 1) < batch.draft[:num_decode, None])
              & (batch.temperature[:num_decode, None] <= 0))
        accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(i32)
        layers, wins = (jax.tree.map(lambda *a: jnp.concatenate(a), *x) for x in zip(*windows))
        pool = commit_windows(lay, pool, batch, num_decode, layers, wins, accepted + 1)
    return StepOutput(tokens, lp, top_ids, top_lp, logits if return_logits or not sample_rows else None, accepted,
                      greedy, None if sample_rows else positions), pool


def _hidden(out, t, nt: int, axis: str | None):
    """The trunk's output at batch tokens ``t i32[n]`` (each a decode token, or a prefill token of
    some device under ``axis``: summed over it from the device that has it)."""
    if axis is None:
        return out[t]
    L = out.shape[0] - nt
    j = t - nt - jax.lax.axis_index(axis) * L  # a prefill token's index among this device's
    here = (t >= nt) & (j >= 0) & (j < L)
    h = jax.lax.psum(jnp.where(here[:, None], out[nt + jnp.clip(j, 0, L - 1)], 0.0), axis)
    return h if nt == 0 else jnp.where((t < nt)[:, None], out[jnp.minimum(t, nt - 1)], h)


@partial(jax.jit, static_argnums=(0, 1, 2, 3),
         static_argnames=("window", "num_logprobs", "return_logits", "sample_rows"), donate_argnums=5)
def jit_step(cfg, lay, kernels, num_decode, params, pool, batch, *, window=1, num_logprobs=0, return_logits=False,
             sample_rows=True):
    """:func:`model_step` jitted, the pool donated (updated in place)."""
    return model_step(cfg, lay, kernels, num_decode, params, pool, batch, window=window, num_logprobs=num_logprobs,
                      return_logits=return_logits, sample_rows=sample_rows)


class Row(NamedTuple):
    """One row for :func:`pack_batch`: ``tokens`` to run after ``start`` cached tokens, its MLA
    ``pages``, its state ``slot``, where its state comes from (``src``: defaults to ``slot`` when
    ``start > 0``, else -1), an optional ``checkpoint`` page, an optional page ``copy`` ``(src, dst)``
    done before the step, sampling parameters, and for a prefill row whose checkpoint is its state
    inside the chunk, after how many of its ``tokens`` (``checkpoint_at``; 0: after all)."""

    tokens: list
    start: int
    pages: list
    slot: int
    src: int | None = None
    checkpoint: int = -1
    copy: tuple[int, int] | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    checkpoint_at: int = 0


def pack_batch(lay: PoolLayout, decode: list[Row], prefill: list[Row], *, num_decode: int, num_tokens: int,
               num_rows: int, max_blocks: int, num_pages: int, window: int = 1, to_device: bool = True) -> StepBatch:
    """Pack rows into a :class:`StepBatch` of the given bucket: ``num_decode`` decode rows of
    ``window`` tokens (a row's last sampled token and up to ``window - 1`` drafts), prefill rows
    after them, ``num_tokens`` tokens and ``num_rows`` rows in all. Raises ``ValueError`` for a
    batch over its bucket, a row whose context passes its block table, or a page or slot id
    outside ``[0, num_pages)``. ``to_device=False``: numpy arrays (see :func:`flatten_batch`)."""
    if len(decode) > num_decode or any(not 1 <= len(r.tokens) <= window for r in decode):
        raise ValueError(f"{len(decode)} decode rows (1 to {window} tokens each) for a bucket of {num_decode}")
    if num_decode + len(prefill) > num_rows:
        raise ValueError(f"{num_decode} + {len(prefill)} rows exceed the bucket of {num_rows} rows")
    n_tok = num_decode * window + sum(len(r.tokens) for r in prefill)
    if n_tok > num_tokens:
        raise ValueError(f"{n_tok} tokens exceed the bucket of {num_tokens}")
    R, rows = num_rows, decode + prefill
    at = np.concatenate([np.arange(len(decode)), num_decode + np.arange(len(prefill))]).astype(np.int64)
    f = Row(*(list(c) for c in zip(*rows))) if rows else Row(*[[] for _ in Row._fields])  # per field, over rows
    n, npg = np.array([len(t) for t in f.tokens], np.int64), np.array([len(p) for p in f.pages], np.int64)
    start, slot, ckpt = (np.array(x, np.int64) for x in (f.start, f.slot, f.checkpoint))
    given = np.array([x is not None for x in f.src], bool)
    src = np.where(given, np.array([0 if x is None else x for x in f.src], np.int64), np.where(start > 0, slot, -1))
    copy = np.array([c or (-1, -1) for c in f.copy], np.int64).reshape(len(rows), 2)
    pages = np.fromiter(itertools.chain.from_iterable(f.pages), np.int64, int(npg.sum()))
    for i in np.flatnonzero((start + n > npg * lay.page_tokens) | (npg > max_blocks))[:1]:
        raise ValueError(f"row {at[i]}: context {start[i] + n[i]} exceeds its block table "
                         f"({npg[i]} pages of {lay.page_tokens} tokens, bucket {max_blocks} pages)")
    cat = np.array(f.checkpoint_at, np.int64)
    for i in np.flatnonzero((cat < 0) | (cat > 0) & ((cat >= n) | (ckpt < 0) | (at < num_decode)))[:1]:
        raise ValueError(f"row {at[i]}: checkpoint_at {cat[i]} is not 0 or inside a prefill row of {n[i]} tokens "
                         f"with a checkpoint page")
    ids = np.concatenate([slot, ckpt, src, copy.ravel(), pages])
    if np.any((ids < -1) | (ids >= num_pages)) or np.any(slot < 0):
        bad = next(i for i, r in enumerate(rows) if r.slot < 0 or any(
            not -1 <= p < num_pages for p in [r.slot, r.checkpoint, src[i], *r.pages, *(r.copy or ())]))
        r = rows[bad]
        raise ValueError(f"row {at[bad]}: page or slot id outside [0, {num_pages}): "
                         f"{[r.slot, r.checkpoint, *r.pages, *(r.copy or ()), src[bad]]}")
    excl = lambda x: np.cumsum(x) - x  # exclusive prefix sums
    lens = np.zeros(R, np.int64)
    lens[:num_decode] = window
    lens[at[len(decode):]] = n[len(decode):]
    cu = np.concatenate([[0], np.cumsum(lens)])
    tokens = np.zeros(num_tokens, np.int32)
    tokens[np.repeat(cu[at], n) + np.arange(n.sum()) - np.repeat(excl(n), n)] = np.fromiter(
        itertools.chain.from_iterable(f.tokens), np.int64, int(n.sum()))
    block_tables = np.full((R, max_blocks), -1, np.int32)
    block_tables[np.repeat(at, npg), np.arange(npg.sum()) - np.repeat(excl(npg), npg)] = pages
    out = dict(tokens=tokens, cu_seqlens=cu.astype(np.int32), block_tables=block_tables)
    for name, vals, fill, dtype in (
            ("start", start, 0, np.int32), ("state_slot", slot, -1, np.int32), ("state_src", src, -1, np.int32),
            ("checkpoint", ckpt, -1, np.int32), ("copy_src", copy[:, 0], -1, np.int32),
            ("copy_dst", copy[:, 1], -1, np.int32), ("draft", np.where(at < num_decode, n - 1, 0), 0, np.int32),
            ("temperature", f.temperature, 0, np.float32), ("top_k", f.top_k, 0, np.int32),
            ("top_p", f.top_p, 1, np.float32), ("seed", np.array(f.seed, np.uint64), 0, np.uint32),
            ("checkpoint_at", cat, 0, np.int32)):
        out[name] = np.full(R, fill, dtype)
        out[name][at] = vals
    return StepBatch(**(jax.device_put(out) if to_device else out))  # one call for every array


_FLOAT_FIELDS = ("temperature", "top_p")


def flatten_batch(batch: StepBatch) -> tuple[np.ndarray, np.ndarray]:
    """A host batch as one ``int32`` and one ``float32`` vector (two host->device copies, not
    fourteen); :func:`unflatten_batch` inverts it inside the step."""
    ints = [np.asarray(x).view(np.int32).ravel() for name, x in zip(StepBatch._fields, batch)
            if name not in _FLOAT_FIELDS]
    return np.concatenate(ints), np.concatenate([batch.temperature, batch.top_p])


def batch_shapes(batch: StepBatch) -> tuple[tuple[int, ...], ...]:
    """The static shapes :func:`unflatten_batch` needs."""
    return tuple(np.shape(x) for x in batch)


def unflatten_batch(ints, floats, shapes) -> StepBatch:
    """Inverse of :func:`flatten_batch` (jittable; ``shapes`` from :func:`batch_shapes`)."""
    out, offs = {}, {"i": 0, "f": 0}
    for name, shape in zip(StepBatch._fields, shapes):
        kind, src = ("f", floats) if name in _FLOAT_FIELDS else ("i", ints)
        size = math.prod(shape)
        out[name] = src[offs[kind] : offs[kind] + size].reshape(shape)
        offs[kind] += size
    out["seed"] = jax.lax.bitcast_convert_type(out["seed"], jnp.uint32)
    return StepBatch(**out)
