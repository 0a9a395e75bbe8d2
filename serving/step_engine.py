"""The engine on the serving step: :class:`Runner` (device: the unified page pool, one jitted
step per bucket, compiled at start-up) under :class:`serving.scheduler.Scheduler` (host: one
token budget per step, pages, preemption).

Speculative decoding runs on the step: a request's drafts ride in its decode row's window.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import threading
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.model import ModelConfig, init_params, load_hf_checkpoint
from k3jax.model.loader import HFCheckpoint
from k3jax.model.pool import PoolLayout
from k3jax.model.step import (Parallel, StepBatch, StepKernels, batch_shapes, flatten_batch, import_kernel_libraries,
                              model_step, pack_batch, prepare_layer, prepare_params, sample, stack_layers,
                              unflatten_batch)
from k3jax.parallel.multihost import StepChannel, is_lead, min_over_processes
from k3jax.parallel.sharded_step import (MeshPlan, allocate_pool, device_param_bytes, host_memory_if, local_config,
                                         local_layout, param_specs, place_streamed, put_global, shard_params,
                                         shard_step)
from pallas_kernels.kda.decode_pages import kda_decode_pages
from pallas_kernels.kda.gpu_common import gpu_head_dims_ok
from pallas_kernels.mla.paged_decode import TILE as PAGED_MLA_TILE
from pallas_kernels.mla.paged_decode import paged_mla_decode
from pallas_kernels.mla.prefill_flash import attend_tile
from pallas_kernels.moe.mxfp4_matmul import mxfp4_grouped_matmul
from serving.engine import (CONFIGS, EMBEDDED, GREEDY_TEMPERATURE, MAX_LOGPROBS, EngineBase, NgramDrafter, SamplingParams,
                            default_kernels)
from serving.page_pool import PagePool
from serving.prefix_cache import CacheConfig, PrefixCache, chain_hashes
from serving.scheduler import Request, Scheduler, StepPlan

log = logging.getLogger("k3jax.step_engine")


def load_model(model, seed: int = 0):
    """``(ModelConfig, reference params)`` from "tiny", "tiny-k3" (random weights), a checkpoint
    directory, or a ``(ModelConfig, params)`` pair."""
    if isinstance(model, tuple):
        return model
    if model in EMBEDDED:
        cfg = ModelConfig.from_json(os.path.join(CONFIGS, EMBEDDED[model]))
        return cfg, init_params(cfg, jax.random.key(seed))
    return load_hf_checkpoint(model, keep_mxfp4=True)  # MXFP4 experts stay packed (the step dequantises)


def load_on_mesh(path: str, dtype, plan: MeshPlan, scan_layers: bool):
    """``(ModelConfig, params, specs)``: a checkpoint directory's serving params placed on
    ``plan``'s mesh one layer at a time (:func:`k3jax.parallel.sharded_step.place_streamed`;
    MXFP4 experts stay packed)."""
    ck = HFCheckpoint(path, keep_mxfp4=True)
    cfg = ck.cfg
    top = prepare_params(cfg, {**ck.top(), "layers": []}, dtype)
    params, specs = place_streamed(cfg, top, lambda i: prepare_layer(cfg, i, ck.layer(i), dtype), plan, scan_layers)
    ck.check_all_taken()
    return cfg, params, specs


def _powers_of_four(lo: int, hi: int) -> tuple[int, ...]:
    """``lo, 4 lo, 16 lo, ...`` below ``hi``, then ``hi``: few buckets (each is a compilation),
    at most 4x padding."""
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= 4
    return tuple(out) + (hi,)


DEFAULT_COMPILE_CACHE = os.environ.get("K3JAX_COMPILE_CACHE", os.path.expanduser("~/.cache/k3jax/xla"))


def use_compile_cache(path: str):
    """Point JAX's persistent compilation cache at ``path`` unless one is already configured, and
    keep every program in it: by JAX's default only those that took a second or more to compile,
    which left the sampler's and the model initialisation's to compile again at every start."""
    if not jax.config.jax_compilation_cache_dir:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def fed_step(cfg, lay, kernels, num_decode, params, pool, last, ints, floats, *, shapes, window, num_logprobs,
             sample_rows=True, par=Parallel()):
    """:func:`k3jax.model.step.model_step` on a flattened batch (:func:`k3jax.model.step.flatten_batch`)
    whose decode rows may take their token from the device: token -1 reads ``last[state_slot]``,
    the last token sampled for that slot; every live row's last emitted token is stored there.
    So step N + 1 can be dispatched before step N's tokens are read. ``par``: one device's part
    of a sharded step. ``sample_rows=False``: greedy tokens, and the logits for :func:`draw_rows`."""
    batch = unflatten_batch(ints, floats, shapes)
    first = jnp.arange(num_decode, dtype=jnp.int32) * window  # a decode row's first token
    if num_decode:
        dec = batch.tokens[first]
        fed = jnp.where(dec < 0, last[jnp.maximum(batch.state_slot[:num_decode], 0)], dec)
        batch = batch._replace(tokens=batch.tokens.at[first].set(fed))
    out, pool = model_step(cfg, lay, kernels, num_decode, params, pool, batch, window=window,
                           num_logprobs=num_logprobs, sample_rows=sample_rows, par=par)
    final = out.tokens
    if out.accepted is not None:  # a window's last emitted token
        last_drafted = out.window[jnp.arange(num_decode), out.accepted]
        kept = jnp.where(out.accepted > 0, last_drafted, out.tokens[:num_decode])
        # (not .at[:n].set: its empty index constant crashes Shardy inside shard_map, jax 0.11.2)
        final = jax.lax.dynamic_update_slice_in_dim(final, kept, 0, 0)
    slots = jnp.where(batch.state_slot >= 0, batch.state_slot, last.shape[0])
    return out, pool, last.at[slots].set(final, mode="drop")


_STATIC = dict(static_argnames=("shapes", "window", "num_logprobs"))
_fed_step = jax.jit(fed_step, static_argnums=(0, 1, 2, 3), donate_argnums=(5, 6),
                    static_argnames=(*_STATIC["static_argnames"], "sample_rows"))


@partial(jax.jit, static_argnames=("filters", "num_logprobs"), donate_argnums=3)
def draw_rows(logits, positions, params, last, *, filters: str, num_logprobs: int):
    """The sampling a step left out (``sample_rows=False``): :func:`k3jax.model.step.sample` of its
    ``logits`` with the rows' ``params`` (:func:`sampling_params`), the drawn tokens stored in
    ``last`` for their slots (a greedy row's token is the step's, stored already). Returns
    ``(tokens, logprob, top_ids, top_logprobs, last)``."""
    ints, temperature, top_p = params
    batch = StepBatch(*[None] * 10, temperature=temperature, top_k=ints[0],
                      top_p=top_p, seed=jax.lax.bitcast_convert_type(ints[1], jnp.uint32))
    tokens, lp, top_ids, top_lp = sample(logits, batch, positions, num_logprobs if filters == "sort" else 0, filters)
    slots = jnp.where((temperature > 0) & (ints[2] >= 0), ints[2], last.shape[0])
    return tokens, lp, top_ids, top_lp, last.at[slots].set(tokens, mode="drop")


def draw_filters(sps: list[SamplingParams], search: bool) -> str:
    """How a sampler call applies its rows' filters (:func:`k3jax.model.step.sample`): ``"sort"``
    for top logprobs; for a drawing row's ``top_k`` or ``top_p``, with ``search`` the searched
    cuts (``"top_k"``, else ``"top_p"``), without it the sort; else ``"none"``."""
    drawn = [sp for sp in sps if sp.temperature > 0]
    top_k, top_p = any(sp.top_k > 0 for sp in drawn), any(sp.top_p < 1 for sp in drawn)
    if any((sp.logprobs or 0) > 0 for sp in sps) or ((top_k or top_p) and not search):
        return "sort"
    return "top_k" if top_k else "top_p" if top_p else "none"


def sampling_params(batch: StepBatch):
    """A host batch's sampling fields as :func:`draw_rows` takes them: ``(i32[3, R]`` top_k, seed
    bits and state slot``, f32[R]`` temperature``, f32[R]`` top_p``)``."""
    ints = np.stack([batch.top_k, np.asarray(batch.seed).view(np.int32), batch.state_slot])
    return ints, batch.temperature, batch.top_p


def sharded_fed_step(cfg: ModelConfig, lay_l: PoolLayout, kernels: StepKernels, plan: MeshPlan, specs):
    """:func:`fed_step` over ``plan``'s mesh (:mod:`k3jax.parallel.sharded_step`), jitted, with
    ``_fed_step``'s signature less its first three arguments: ``cfg`` the global config (each
    device sees its part), ``lay_l`` a device's page layout, params placed by ``specs``, the pool
    ``[tp, N, words]``; and ``context``: split the prefill tokens over the mesh's expert axis
    (:meth:`k3jax.parallel.sharded_step.MeshPlan.context_parallel`)."""
    cfg_l = local_config(cfg, plan)

    @partial(jax.jit, static_argnums=0, donate_argnums=(2, 3), static_argnames=(*_STATIC["static_argnames"], "context"))
    def step(num_decode, params, pool, last, ints, floats, *, shapes, window, num_logprobs, context=False):
        body = partial(fed_step, cfg_l, lay_l, kernels, num_decode, shapes=shapes, window=window,
                       num_logprobs=num_logprobs, par=plan.context_parallel() if context else plan.parallel)
        return shard_step(plan, specs, body, num_batch=3, num_more=1)(params, pool, last, ints, floats)

    return step


class Runner:
    """Device side: params, the page pool ``u32[num_pages, page_words]`` and one compiled step per
    (decode rows, prefill tokens) bucket. ``dispatch`` packs a plan into its bucket and starts
    the step (pool donated); ``fetch`` waits for it and returns the sampled ``int32`` token of
    every planned row. ``context_from``: prefill buckets of at least this many tokens split them
    over ``plan``'s expert axis (KCP; see :meth:`k3jax.parallel.sharded_step.MeshPlan.context_parallel`).
    ``specs``: ``params`` are on ``plan``'s mesh already, placed by these (else they are placed here)."""

    def __init__(self, cfg: ModelConfig, params, lay: PoolLayout, kernels: StepKernels, num_pages: int, *,
                 decode_buckets, prefill_buckets, max_prefill_rows: int, max_blocks: int, mixed_decode_buckets=None,
                 num_logprobs: int = MAX_LOGPROBS, speculative: int = 0, plan: MeshPlan | None = None,
                 context_from: int | None = None, specs=None):
        self.cfg, self.params, self.lay, self.kernels, self.plan = cfg, params, lay, kernels, plan
        self.num_logprobs = num_logprobs
        self.num_pages, self.max_blocks, self.max_prefill_rows = num_pages, max_blocks, max_prefill_rows
        self.decode_buckets, self.prefill_buckets = tuple(sorted(decode_buckets)), tuple(sorted(prefill_buckets))
        if not self.decode_buckets or not self.prefill_buckets:
            raise ValueError("decode_buckets and prefill_buckets must not be empty")
        self.mixed_decode_buckets = tuple(sorted(mixed_decode_buckets or self.decode_buckets[-1:]))
        if min(self.decode_buckets + self.prefill_buckets + self.mixed_decode_buckets) < 1:
            raise ValueError("buckets must be positive")
        if self.mixed_decode_buckets[-1] < self.decode_buckets[-1]:
            raise ValueError(f"the largest mixed decode bucket must cover the largest decode bucket "
                             f"{self.decode_buckets[-1]}, got {self.mixed_decode_buckets}")
        self.context_from = context_from
        if context_from is not None:
            if plan is None:
                raise ValueError("context parallelism needs a mesh")
            P = plan.mesh.shape[plan.context_parallel().context]
            if any(b % P for b in self.prefill_buckets if b >= context_from):
                raise ValueError(f"prefill buckets from {context_from} tokens must split over the {P} devices of "
                                 f"the expert axis, got {self.prefill_buckets}")
        self.device_lay = lay if plan is None else local_layout(cfg, lay, plan)  # one device's pages
        # Off a mesh a step samples greedily and a second call draws only when a row asks for more
        # (the host knows; a conditional inside the step would make the host wait for its predicate).
        self.split_sampling = plan is None
        self.draw_modes = ("none", "top_p", "top_k", "sort") if kernels.search_cuts else ("none", "sort")
        if plan is None:
            self._step = partial(_fed_step, cfg, lay, kernels, sample_rows=False)
        else:
            if specs is None:  # else the params are on the mesh already
                self.params, specs = shard_params(cfg, params, plan)
            self._step = sharded_fed_step(cfg, self.device_lay, kernels, plan, specs)
        self.lanes = 1 if plan is None else plan.dp  # data shards: each has its own batch, pool and scheduler
        # the batch and per-slot arrays: replicated over a mesh, or one per data shard ([lanes, ...])
        self._batch_sharding = None if plan is None else NamedSharding(plan.mesh, PartitionSpec(plan.data))
        self.pool = self.allocate_pool()
        self.last = self.allocate_last()
        self.channel = StepChannel() if jax.process_count() > 1 else None  # process 0's steps to the others
        self.window = speculative + 1  # decode rows per step carry up to this many tokens when any has drafts
        self.compiled: set[tuple] = set()
        self.compiles_while_serving = 0
        import_kernel_libraries(kernels)  # before the first trace (see there)

    def allocate_pool(self) -> jax.Array:
        """A zeroed pool: ``u32[num_pages, page_words]``, or per device of a mesh (see
        :func:`k3jax.parallel.sharded_step.allocate_pool`)."""
        if self.plan is None:
            return self.lay.allocate(self.num_pages)
        return allocate_pool(self.device_lay, self.num_pages, self.plan)

    def allocate_last(self) -> jax.Array:
        """``i32[num_pages]`` (``[lanes, num_pages]`` over a ``data`` axis): the last token
        sampled into each state slot."""
        shape = (self.lanes, self.num_pages) if self._stacked else (self.num_pages,)
        return jax.jit(lambda: jnp.zeros(shape, jnp.int32), out_shardings=self._batch_sharding)()

    @property
    def _stacked(self) -> bool:
        return self.plan is not None and self.plan.data is not None

    def bucket(self, num_decode: int, prefill_tokens: int, drafts: bool = False) -> tuple[int, int, int]:
        """``(decode rows, prefill tokens, window)`` of the compiled step that runs a plan."""
        pick = lambda n, buckets: 0 if n == 0 else next(b for b in buckets if b >= n)
        nd = pick(num_decode, self.mixed_decode_buckets if prefill_tokens else self.decode_buckets)
        return nd, pick(prefill_tokens, self.prefill_buckets), self.window if drafts and nd else 1

    def bucket_keys(self) -> list[tuple[int, int, int]]:
        """Every bucket :meth:`bucket` can pick, which :meth:`warmup` compiles."""
        pairs = ([(nd, 0) for nd in self.decode_buckets] + [(0, tp) for tp in self.prefill_buckets]
                 + [(nd, tp) for nd in self.mixed_decode_buckets for tp in self.prefill_buckets])
        return [(nd, tp, w) for nd, tp in pairs for w in sorted({1, self.window if nd else 1})]

    def _call(self, nd: int, tp: int, w: int, rows=None, received=None):
        """Pack and start the step of bucket ``(nd, tp, w)`` on ``rows``, each lane's ``(decode
        rows, prefill rows)`` (None: padding only). With several processes, process 0 sends the
        bucket and batch to the others first; they run it with ``received``, its ``(ints, floats)``."""
        if self.channel is not None and not is_lead() and received is None:
            raise RuntimeError("with several processes only process 0 starts steps; the others follow()")
        lanes = rows or [([], [])] * (1 if received is not None else self.lanes)
        batches = [pack_batch(self.lay, decode, prefill, num_decode=nd, num_tokens=nd * w + tp,
                              num_rows=nd + (self.max_prefill_rows if tp else 0), max_blocks=self.max_blocks,
                              num_pages=self.num_pages, window=w, to_device=False)
                   for decode, prefill in lanes]
        if received is None:
            flats = [flatten_batch(b) for b in batches]
            flat = tuple(np.stack(x) for x in zip(*flats)) if self._stacked else flats[0]
            if self.channel is not None:
                self.channel.send((nd, tp, w), *(x.ravel() for x in flat))
        else:
            flat = tuple(x.reshape(self.lanes, -1) for x in received) if self._stacked else received
        ints, floats = self.place(flat)
        kw = {} if self.context_from is None else dict(context=tp >= self.context_from)
        out, self.pool, self.last = self._step(nd, self.params, self.pool, self.last, ints, floats,
                                               shapes=batch_shapes(batches[0]), window=w,
                                               num_logprobs=self.num_logprobs, **kw)
        return out, batches[0]

    def _draw(self, out, batch: StepBatch, filters: str):
        """Sample the rows of a step that left it out (:func:`draw_rows`), their filters applied as
        ``filters`` says (:func:`draw_filters`)."""
        self._note_compile(("draw", len(batch.temperature), filters))
        tokens, lp, top_ids, top_lp, self.last = draw_rows(out.logits, out.positions, sampling_params(batch),
                                                           self.last, filters=filters, num_logprobs=self.num_logprobs)
        return out._replace(tokens=tokens, logprob=lp, top_ids=top_ids, top_logprobs=top_lp)

    def _note_compile(self, key: tuple):
        if key not in self.compiled:
            self.compiles_while_serving += 1
            self.compiled.add(key)
            log.warning("compiling %s while serving", key)

    def place(self, flat):
        """A flattened batch (:func:`k3jax.model.step.flatten_batch`; stacked per lane over a
        ``data`` axis) on the devices, as the step takes it."""
        if self.plan is None:
            return jax.device_put(flat)
        return tuple(put_global(x, self._batch_sharding) for x in flat)

    def warmup(self):
        """Compile every bucket on all-padding batches (they write nothing), with a progress line each."""
        keys = self.bucket_keys()
        for i, key in enumerate(keys):
            t0 = time.perf_counter()
            out, batch = self._call(*key)
            for filters in self.draw_modes if self.split_sampling else ():  # once per row count
                if ("draw", len(batch.temperature), filters) not in self.compiled:
                    self.compiled.add(("draw", len(batch.temperature), filters))
                    out = self._draw(out, batch, filters)
            jax.block_until_ready(out.tokens)
            self.compiled.add(key)
            log.info("compiled step %d/%d (decode rows %d, prefill tokens %d, window %d) in %.1fs", i + 1, len(keys),
                     *key, time.perf_counter() - t0)

    def follow(self):
        """On a process other than 0 of a multi-process mesh: run the steps process 0 starts
        (its warm-up's included) until it calls :meth:`stop_followers`."""
        if self.channel is None or is_lead():
            raise RuntimeError("process 0 plans the steps; follow() is for the other processes of several")
        while (step := self.channel.receive()) is not None:
            key, ints, floats = step
            self._call(*key, received=(ints, floats))
        log.info("process %d: process 0 stopped serving", jax.process_index())

    def stop_followers(self):
        """On process 0 of several: end the other processes' :meth:`follow`."""
        if self.channel is not None and is_lead():
            self.channel.send((-1, 0, 0))

    def dispatch(self, plans: list[StepPlan], logprobs: bool = False) -> list:
        """Start one step for ``plans`` (one per lane; JAX dispatches asynchronously) and return
        a handle per lane for :meth:`fetch`. The step's bucket holds the largest lane's plan. A
        decode row's token -1 is read on the device from its slot's last sample. The results'
        copies to the host (``logprobs``: theirs too) start as soon as the step ends, so that
        reading them does not wait for a step dispatched after this one."""
        key = self.bucket(max(len(p.decode) for p in plans), max(sum(len(r.tokens) for r in p.prefill) for p in plans),
                          any(len(r.tokens) > 1 for p in plans for r in p.decode))
        self._note_compile(key)
        out, batch = self._call(*key, [(p.decode, p.prefill) for p in plans])
        if self.split_sampling:
            sps = [r.sp for p in plans for r in p.requests]
            if logprobs or any(sp.temperature > 0 for sp in sps):
                out = self._draw(out, batch, draw_filters(sps, self.kernels.search_cuts))
            out = out._replace(logits=None, positions=None)  # not held while the step is in flight
        for x in (out.tokens, out.accepted, out.window) + ((out.logprob, out.top_ids, out.top_logprobs) if logprobs
                                                            else ()):
            if x is not None:
                x.copy_to_host_async()
        nd = key[0]
        return [(out, np.array(list(range(len(p.decode))) + [nd + i for i in range(len(p.prefill))], np.int32),
                 lane if self._stacked else None) for lane, p in enumerate(plans)]

    @staticmethod
    def fetch(handle, logprobs: bool = False):
        """Wait for a dispatched step: ``(tokens i32[rows], logprobs, drafts)`` of its planned rows
        in plan order; ``logprobs`` is ``(logprob f32[rows], top_ids i32[rows, n], top_logprobs
        f32[rows, n])`` when asked, else None; ``drafts[i]`` the draft tokens row ``i`` accepted,
        which it emits after ``tokens[i]`` (only tokens come back from the device)."""
        out, rows, lane = handle
        if lane is not None:  # the step's results for every lane: this lane's
            out = jax.tree.map(lambda x: np.asarray(x)[lane], out)
        lps = None
        if logprobs:
            lps = tuple(np.asarray(x)[rows] for x in (out.logprob, out.top_ids, out.top_logprobs))
        drafts = [[] for _ in rows]
        if out.accepted is not None:
            acc, win = np.asarray(out.accepted), np.asarray(out.window)
            for i, row in enumerate(rows):
                if row < len(acc):  # a decode row
                    drafts[i] = win[row, 1 : 1 + acc[row]].tolist()
        return np.asarray(out.tokens)[rows], lps, drafts


def default_step_kernels(cfg: ModelConfig, backend: str | None = None) -> StepKernels:
    """The step's device ops when none are given: on a GPU the Pallas prefill (as
    :func:`serving.engine.default_kernels`), the Pallas decode kernels on pages
    (``paged_mla_decode``, ``kda_decode_pages``) and, for MXFP4 experts, the decode step's grouped
    matmul that dequantises in registers (``mxfp4_grouped_matmul``); the XLA paths elsewhere (the
    kernels' TPU versions are not yet measured on a TPU).

    The decode kernels became the GPU default once the engine ran on them on its default pool (2^31
    words) on an H100 on 2026-12-07 (``benchmarks.engine_check --paged both --pages 0``): the CUDA
    illegal address of 2026-12-06 came from padding decode rows reading page -1 (fixed in 38a9a4c).
    It ran on them again on a pool of 2.82 x 2^31 words (30% of an H100's free memory, 64-bit
    offsets in the kernels) on 2026-12-08. The MXFP4 matmul became the default after it measured
    2.4x faster than gathering the routed experts at batch 1 on the K3 slice (H100, 2026-12-07,
    docs/benchmarks.md); the gathered path handles one expert per routed slot whatever the routing.
    Prefill chunks of 1024 tokens or more attend over expanded keys and values
    (``expand_prefill_from``) since a 131,072-token prompt's first token came 1.41x sooner that way
    with the same token (H100, 2026-12-07, ``benchmarks.engine_prefill --expand-from 1024``), and
    those expanded tiles go through the fused attention kernel (``mla_prefill``, where the head
    sizes suit Triton) since the same prompt's first token came 3.56x sooner with it (1.24 s against
    4.41 s, the same token) and ``benchmarks.engine_check --expand-from 64`` passed on it (H100,
    2026-12-07)."""
    kernels = StepKernels(chunk_kda=default_kernels(cfg, backend).chunk_kda)
    if (backend or jax.default_backend()) != "gpu":
        return kernels
    flash = gpu_head_dims_ok(cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    return dataclasses.replace(kernels, mla_decode=paged_mla_decode, kda_decode=kda_decode_pages,
                               mxfp4_matmul=mxfp4_grouped_matmul, expand_prefill_from=1024,
                               mla_prefill=attend_tile if flash else None)


class StepEngine(EngineBase):
    """Offline and online serving on the serving step.

    Args:
      model: see :func:`load_model`; dtype: weights and activations (bf16; float32 for exact tests).
      max_running: decode rows per step; max_len: tokens per request (prompt + output).
      token_budget: tokens per step (decode rows and prefill chunks); max_prefill_rows: prefill
        chunks per step; max_chunk: tokens per chunk.
      prefix_cache: share prompt prefixes across requests (SERVING.md); hash_tokens: its hash
        block (the reuse unit; pages are a multiple of it).
      num_pages: pool pages (None: 30% of the device's free memory on an accelerator, else
        enough for ``max_running`` requests of ``max_len``); page_tokens: MLA page size (None:
        as large as a KDA state page allows, a multiple of the hash block).
      decode_buckets, prefill_buckets: compiled batch sizes (None: powers of four up to the limits).
      mixed_decode_buckets: the decode rows of the compiled steps that also prefill (None: only
        the largest decode bucket). Each is a compilation per prefill bucket, and a step with a
        prefill chunk is long beside the decode rows its padding adds, so by default a mixed
        step pads its decode rows to ``max(decode_buckets)``: start-up compiles
        ``D + P + P`` steps instead of ``D + P + D P``.
      async_dispatch: dispatch step N + 1 before reading step N's tokens (decode rows take their
        token from the device), so the host's work overlaps the device's.
      compile_cache: directory of JAX's persistent compilation cache (None: leave JAX's setting;
        default ``$K3JAX_COMPILE_CACHE`` or ``~/.cache/k3jax/xla``), so a restart compiles nothing.
      scan_layers: run the repeating layers as a ``lax.scan`` (:func:`k3jax.model.step.layer_runs`):
        each bucket traces and compiles one period of them instead of every layer.
      speculative: draft tokens per decode row for greedy requests without logprobs (0: off),
        proposed by ``drafter`` (default: n-gram prompt lookup) and verified in the row's window
        of the same step; its steps are synchronous (the accepted count decides where a request
        goes on), and a window never reaches a hash boundary (the checkpoint is written there).
        spec_backoff: after ``m`` windows in a row with no draft accepted, a request drafts again
        only after ``min(2^(m-1), spec_backoff)`` plain steps.
      mesh: a ``jax.sharding.Mesh`` with a ``tensor`` axis (optionally ``data`` and ``expert``) to
        run the step over (:mod:`k3jax.parallel.sharded_step`); None: one device. With a ``data`` axis
        each data shard is a lane with its own scheduler, pool and prefix cache (``max_running``
        each). After :func:`k3jax.parallel.multihost.initialize` the mesh spans every process's
        devices: process 0's engine serves, the others build the same engine and call
        ``engine.runner.follow()``; process 0 ends them with ``engine.runner.stop_followers()``.
      context_parallel_from: on a mesh with an ``expert`` axis (and no ``data`` axis), steps whose
        prefill bucket has at least this many tokens split them over that axis (KCP: the KDA
        layers by :func:`k3jax.parallel.kcp.chunk_kda_on_shard`, the MLA layers from every
        device's latents), where the attention otherwise runs whole on every device; None: off.
      checkpoints_inside: with the prefix cache (no context parallelism, hash blocks a multiple
        of the KDA chunk of 64), a prefill chunk may run past a hash boundary and the step takes
        that boundary's checkpoint inside it (``StepKernels.checkpoint_stride``, unless the
        kernels set it), so a prompt's chunks need not stop at its last boundary. The default
        since a Mooncake replay's TTFT p50 / p99 came 13% / 28% lower with it than with chunks
        stopping at the boundary, and equal to the run without the cache (H100, 2026-12-07,
        docs/benchmarks.md).
    """

    def __init__(self, model="tiny", *, dtype=jnp.bfloat16, max_running: int = 8, max_len: int = 2048,
                 token_budget: int = 512, max_prefill_rows: int = 4, max_chunk: int | None = None,
                 prefix_cache: bool = True, hash_tokens: int = 512, num_pages: int | None = None,
                 page_tokens: int | None = None, decode_buckets=None, prefill_buckets=None, mixed_decode_buckets=None,
                 kernels: StepKernels | None = None, seed: int = 0, compile_cache: str | None = DEFAULT_COMPILE_CACHE,
                 async_dispatch: bool = True, scan_layers: bool = True, speculative: int = 0, drafter=None,
                 spec_backoff: int = 16, params=None, mesh=None, context_parallel_from: int | None = None,
                 checkpoints_inside: bool = True):
        if compile_cache:
            use_compile_cache(compile_cache)
        # On a mesh the weights are prepared in host memory and placed shard by shard (no device
        # holds the whole model on the way); a checkpoint directory one layer at a time (nor does the host)
        plan = None if mesh is None else MeshPlan(mesh)
        specs = None  # the params' specs once they are on the mesh
        with host_memory_if(mesh):
            if params is None and plan is not None and isinstance(model, str) and model not in EMBEDDED:
                self.cfg, params, specs = load_on_mesh(model, dtype, plan, scan_layers)
            elif params is None:
                self.cfg, ref = load_model(model, seed)
                params = prepare_params(self.cfg, ref, dtype)
                del ref  # before the pool is sized from free memory
            elif isinstance(model, ModelConfig):
                self.cfg = model
            else:
                raise ValueError("params= (step-format weights) goes with a ModelConfig as model")
            if scan_layers and specs is None:
                params = stack_layers(self.cfg, params)
        self.max_len = max_len
        if jax.process_count() > 1 and (plan is None or mesh.devices.size != jax.device_count()):
            raise ValueError(f"with {jax.process_count()} processes the step's mesh must span all "
                             f"{jax.device_count()} devices of all of them")
        if plan is not None:
            plan.check(self.cfg)
        kernels = kernels or default_step_kernels(self.cfg)
        if (checkpoints_inside and prefix_cache and kernels.checkpoint_stride is None and not context_parallel_from
                and hash_tokens % 64 == 0):
            kernels = dataclasses.replace(kernels, checkpoint_stride=hash_tokens)
        if not prefix_cache:  # no checkpoints to take (the scheduler checks the stride against the hash block)
            kernels = dataclasses.replace(kernels, checkpoint_stride=None)
        elif kernels.checkpoint_stride and context_parallel_from:
            raise ValueError("checkpoint_stride does not go with context_parallel_from (the context-parallel "
                             "prefill takes no checkpoints inside its chunks)")
        # pages of whole hash blocks, and of whole tiles of the paged MLA decode kernel
        multiple = math.lcm(hash_tokens if prefix_cache else 16, PAGED_MLA_TILE if kernels.mla_decode else 1)
        lay = PoolLayout.for_model(self.cfg, page_tokens=page_tokens, latent_dtype=dtype, token_multiple=multiple)
        if prefix_cache and lay.page_tokens % hash_tokens:
            raise ValueError(f"page_tokens {lay.page_tokens} must be a multiple of hash_tokens {hash_tokens}")
        max_blocks = -(-max_len // lay.page_tokens)
        if token_budget <= max_running:
            raise ValueError(f"token_budget {token_budget} must exceed max_running {max_running} (room for prefill)")
        max_chunk = max_chunk or token_budget
        decode_buckets = decode_buckets or _powers_of_four(4, max_running)
        prefill_buckets = prefill_buckets or _powers_of_four(64, token_budget)
        if max(decode_buckets) < max_running or max(prefill_buckets) < min(token_budget, max_prefill_rows * max_chunk):
            raise ValueError(f"the largest buckets ({max(decode_buckets)}, {max(prefill_buckets)}) must cover "
                             f"max_running {max_running} and the prefill tokens a step can plan")
        # The state page; with the prefix cache also the checkpoints one request can hold: the
        # policy's (prompt end, junction, one per 16 hash blocks), its newest, and one superseding it.
        spare = 5 + max_len // (16 * hash_tokens) if prefix_cache else 1
        if num_pages is None:
            per_device = lay if plan is None else local_layout(self.cfg, lay, plan)
            # on a mesh the weights may still be in host memory: a device's share is set aside
            weights = 0 if plan is None or specs else device_param_bytes(params, param_specs(self.cfg, params, plan), mesh)
            num_pages = _default_pages(per_device, max_running, max_blocks + spare, weights)
            num_pages = min_over_processes(num_pages)  # the same pool everywhere, fitting the fullest device
        if num_pages < max_blocks + spare:
            raise ValueError(f"{num_pages} pages cannot hold one request of max_len {max_len} "
                             f"({max_blocks} MLA pages of {lay.page_tokens} tokens + {spare} state pages)")
        self.runner = Runner(self.cfg, params, lay, kernels, num_pages, decode_buckets=decode_buckets,
                             prefill_buckets=prefill_buckets, mixed_decode_buckets=mixed_decode_buckets,
                             max_prefill_rows=max_prefill_rows, max_blocks=max_blocks, speculative=speculative,
                             plan=plan, context_from=context_parallel_from, specs=specs)
        if speculative < 0:
            raise ValueError(f"speculative must be >= 0, got {speculative}")
        self._sched_args = dict(token_budget=token_budget, max_decode=max_running, max_prefill_rows=max_prefill_rows,
                                max_chunk=max_chunk, speculative=speculative,
                                drafter=(drafter or NgramDrafter()) if speculative else None, spec_backoff=spec_backoff,
                                checkpoint_stride=kernels.checkpoint_stride)
        self.hash_tokens = hash_tokens if prefix_cache else None
        self._ids = itertools.count()  # request ids, unique over the lanes and kept when they are rebuilt
        self.scheds = [self._scheduler() for _ in range(self.runner.lanes)]  # one per data shard
        self._rng = np.random.default_rng(seed)
        self._live: dict[int, Request] = {}
        self._lock = threading.RLock()
        self.async_dispatch = async_dispatch and not speculative
        self._inflight = None  # (plans, handles, logprobs wanted, dispatch time) of the step not yet read back
        self.metrics = {"requests": 0, "requests_finished": 0, "requests_aborted": 0, "prompt_tokens": 0,
                        "generation_tokens": 0, "cached_tokens": 0, "steps": 0, "step_tokens": 0, "step_time_s": 0.0,
                        "ttft_sum_s": 0.0, "accepted_drafts": 0}

    def _scheduler(self) -> Scheduler:
        """A scheduler over an empty pool (and an empty prefix cache)."""
        pool = PagePool(self.runner.num_pages, with_storage=False)
        P = self.runner.lay.page_tokens
        cache = PrefixCache(CacheConfig(self.hash_tokens, P, 1, 1, "junction+interval:16"), pool) if self.hash_tokens else None
        return Scheduler(pool, P, cache=cache, ids=self._ids, **self._sched_args)

    @property
    def sched(self) -> Scheduler:
        """The scheduler (lane 0's over a mesh with a ``data`` axis)."""
        return self.scheds[0]

    def warmup(self):
        self.runner.warmup()

    @property
    def preemptions(self) -> int:
        return sum(s.preemptions for s in self.scheds)

    def submit(self, prompt, sp: SamplingParams = SamplingParams(), on_token=None) -> Request:
        """Queue a request (thread-safe); :class:`serving.engine.RequestError` for one that can never be served."""
        prompt = [int(t) for t in prompt]
        self.validate(prompt, sp)
        if sp.temperature < GREEDY_TEMPERATURE:  # greedy (SamplingParams): no draw, drafts allowed
            sp = dataclasses.replace(sp, temperature=0.0)
        seed = int(self._rng.integers(2**32)) if sp.seed is None else int(sp.seed) % 2**32
        with self._lock:  # against fail_running: a request is tracked and queued, or neither
            self.metrics["requests"] += 1
            lane = self._pick_lane(prompt)
            req = self._track(self.scheds[lane].new_request(prompt, sp, seed, on_token))
            req.lane = lane
            self.scheds[lane].add(req)
        return req

    def _pick_lane(self, prompt: list[int]) -> int:
        """Of the lanes not busier than the least busy by more than a batch, the one whose prefix
        cache holds the most of ``prompt``, then the least busy."""
        n = len(self.scheds)
        if n == 1:
            return 0
        busy = [len(s.running) + len(s.waiting) for s in self.scheds]
        hit = [0] * n
        hashes = chain_hashes(prompt[:-1], self.hash_tokens) if self.hash_tokens else []
        if hashes:
            hit = [s.cache.lookup(hashes).tokens for s in self.scheds]
        open_lanes = [i for i in range(n) if busy[i] <= min(busy) + self._sched_args["max_decode"]]
        return min(open_lanes, key=lambda i: (-hit[i], busy[i], i))

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.scheds) or self._inflight is not None

    def step(self):
        """Plan and dispatch a step, then read back the previous one (with ``async_dispatch``: the
        device runs step N + 1 while the host emits step N's tokens; else this step's), emit the
        kept tokens and finish what is done."""
        for s in self.scheds:
            for r in [r for r in s.running if r.aborted]:
                self._finish(r, r.abort_reason)
            for r in s.take_aborted_waiting():
                self._complete(r, r.abort_reason)
        plans = [s.plan() for s in self.scheds]
        launched = None
        if any(p.requests for p in plans):
            want_lp = any(r.sp.logprobs is not None for p in plans for r in p.requests)
            launched = (plans, self.runner.dispatch(plans, want_lp), want_lp, time.perf_counter())
            for s, p in zip(self.scheds, plans):
                s.advance(p)
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            self._land(*previous)
        if launched is not None and not self.async_dispatch:
            self._inflight = None
            self._land(*launched)

    def _land(self, plans, handles, want_lp: bool, t0: float):
        """Read a dispatched step's tokens, emit the kept ones (a request finished meanwhile drops
        its extra token), and make what it wrote matchable in the prefix caches."""
        results = [self.runner.fetch(h, want_lp) if p.requests else None for p, h in zip(plans, handles)]
        self.metrics["steps"] += 1
        self.metrics["step_time_s"] += time.perf_counter() - t0
        for sched, plan, res in zip(self.scheds, plans, results):
            if res is not None:
                self._land_lane(sched, plan, *res)

    def _land_lane(self, sched: Scheduler, plan, tokens, lps, drafts):
        self.metrics["step_tokens"] += len(plan.decode) + sum(len(r.tokens) for r in plan.prefill)
        for i, (r, keep, tok) in enumerate(zip(plan.requests, plan.keep, tokens)):
            if not keep:
                continue
            r.pending -= 1
            if r.rid not in self._live:
                continue
            r.done += len(drafts[i])  # the accepted drafts are in the cache too
            if i < len(plan.decode) and len(plan.decode[i].tokens) > 1:
                sched.drafts_landed(r, len(drafts[i]))
            self.metrics["cached_tokens"] += r.cached if not r.out else 0
            self.metrics["accepted_drafts"] += len(drafts[i])
            k = r.sp.logprobs
            lp = None if k is None else (float(lps[0][i]), [(int(t), float(x)) for t, x in
                                                             zip(lps[1][i, :k], lps[2][i, :k])])
            for t in [int(tok)] + drafts[i]:
                if r.rid not in self._live:  # finished by a stop token or its length
                    break
                self._emit_token(r, t, lp)
        sched.landed()

    def fail_running(self, exc: BaseException) -> list:
        with self._lock:
            return self._fail_running(exc)

    def _fail_running(self, exc: BaseException) -> list:
        self._inflight = None  # its tokens are lost with the failed step; waiting requests recompute
        for r in list(self._live.values()):
            r.pending = 0
        failed = super().fail_running(exc)
        if self.runner.channel is not None:
            # The other processes may be stuck in the failed step's collectives: going on would pair
            # the next step's with theirs. Stop them and this engine's loop (its /health turns 503).
            log.critical("a step failed with %d processes: stopping them and this engine", jax.process_count())
            self.runner.stop_followers()
            raise SystemExit(1)
        if self.runner.pool.is_deleted() or self.runner.last.is_deleted():
            log.error("the page pool was lost with the failed step: the prefix cache starts empty")
            self.runner.pool = self.runner.allocate_pool()
            self.runner.last = self.runner.allocate_last()
            for lane, old in enumerate(self.scheds):
                self.scheds[lane] = self._scheduler()  # the waiting requests move over in order
                for r in old.waiting:
                    self.scheds[lane].add(r)
        else:
            for s in self.scheds:
                if s.cache is not None:
                    s.cache.end_all_steps()
        return failed

    def _finish(self, r: Request, reason: str):
        self.scheds[r.lane].release(r, keep=reason in ("stop", "length"))
        self._complete(r, reason)

    def _release(self, r: Request):
        self.scheds[r.lane].release(r)

    def _waiting_ids(self) -> set[int]:
        return set().union(*(s.waiting_ids() for s in self.scheds))

    def _counts(self) -> dict:
        total = lambda f: sum(f(s) for s in self.scheds)
        return {"waiting": total(lambda s: len(s.waiting)), "running": total(lambda s: len(s.running)),
                "free_slots": total(lambda s: max(0, s.max_decode - len(s.running))),
                "free_pages": total(lambda s: s.pool.num_free + s.pool.num_evictable), "preemptions": self.preemptions,
                "steps": self.metrics["steps"], "compiles_while_serving": self.runner.compiles_while_serving}


def _default_pages(lay: PoolLayout, max_running: int, per_request: int, reserved: int = 0) -> int:
    stats = jax.local_devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    if stats and "bytes_limit" in stats:
        # 30%: a prefill bucket's compiled step held up to two copies of the pool as temporaries
        # on the GPU (H100, 2026-12-06: pool 3.7 GiB, temporaries 7.3 GiB), plus its activations
        return lay.pages_for_memory(stats["bytes_limit"] - stats.get("bytes_in_use", 0) - reserved, fraction=0.3)
    return max_running * per_request
