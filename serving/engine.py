"""The serving engine: continuous batching, chunked prefill and the prefix cache.

Device state is one batch of per-slot caches (``ModelCache`` with a leading slot axis) plus the
page pool that backs the prefix cache. Each ``step``: admit waiting requests into free slots
(prefix-cache lookup; a hit copies the KDA checkpoint and the MLA latents from pool pages into
the slot), run one batched decode step for every decoding request, then prefill pieces under
a token budget. Pieces are power-of-two lengths that never cross a hash boundary, so the state
after a piece that ends on a boundary is that boundary's checkpoint (no second pass), and the
number of compiled shapes is bounded (logged).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.model import (Kernels, ModelCache, ModelConfig, commit_window, forward, init_cache, init_params,
                         load_hf_checkpoint)
from pallas_kernels.kda import chunk_kda as pallas_chunk_kda
from pallas_kernels.kda.prefill import gpu_head_dims_ok
from serving.page_pool import KDA, MLA, PagePool, PoolExhausted
from serving.prefix_cache import CacheConfig, PrefixCache, chain_hashes

log = logging.getLogger("k3jax.engine")
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
# The embedded models (random weights, byte-level vocabulary): Kimi Linear and Kimi K3.
EMBEDDED = {"tiny": "tiny.json", "tiny-k3": "tiny_k3.json"}


def default_kernels(cfg: ModelConfig, backend: str | None = None) -> Kernels:
    """The device ops used when none are given: on a GPU the Pallas chunked prefill (measured
    faster end to end on the H200, docs/benchmarks.md) when the KDA head size suits its
    kernels, told the gates' lower bound when it is at least -5 (K3: stage 1's diagonal blocks as
    matmuls); the XLA paths elsewhere (TPU: not yet measured)."""
    if (backend or jax.default_backend()) == "gpu" and gpu_head_dims_ok(cfg.linear_head_dim):
        bound = cfg.kda_lower_bound
        return Kernels(chunk_kda=_bounded_prefill(bound) if bound is not None and bound >= -5.0 else pallas_chunk_kda)
    return Kernels()


@cache
def _bounded_prefill(bound: float):
    """One Pallas prefill per gate bound, so engines built from the same config share the jitted
    steps (kernels are a static argument: a fresh ``partial`` would compile them again)."""
    return partial(pallas_chunk_kda, gate_lower_bound=bound)


class RequestError(ValueError):
    """A request that can never be served (the reason is the message)."""


SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # accepted seeds; negative seeds are taken modulo 2**64
MAX_LOGPROBS = 20  # top alternatives a request may ask for with each token
GREEDY_TEMPERATURE = 1e-5  # a temperature below this (but > 0) samples greedily, like temperature 0


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_num(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class SamplingParams:
    """Sampling: greedy when ``temperature < GREEDY_TEMPERATURE`` (0 included); ``top_k = 0`` and
    ``top_p = 1`` disable those filters; ``seed`` is any integer in ``[SEED_MIN, SEED_MAX]``
    (``[-2**63, 2**64 - 1]``; negative seeds are taken modulo ``2**64``) or None."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the top k

    def validate(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (_is_num(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k < 2**31:  # an int32 in the step's batch
            raise RequestError(f"top_k must be an integer in [0, 2**31 - 1], got {self.top_k!r}")
        if not (_is_num(self.top_p) and 0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise RequestError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")


@dataclass
class Result:
    """A finished request: generated ``token_ids``, prompt tokens served from cache, timings
    (seconds since submission: time to first token and each token's arrival)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    num_cached_tokens: int
    ttft_s: float
    token_times_s: list[float]
    finish_reason: str
    logprobs: list | None = None  # per token (logprob, [(token, logprob)] top alternatives) when asked


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    sp: SamplingParams
    on_token: object = None  # callable(token_id) from the engine thread
    out: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    slot: int = -1
    done: int = 0  # tokens whose KV/state are in the slot
    cached: int = 0
    hashes: list[int] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)
    result: Result | None = None
    aborted: bool = False
    abort_reason: str = "abort"  # the finish reason an abort gives ("stop": the server found a stop string)
    logprobs: list = field(default_factory=list)  # filled before on_token sees the token
    spec_misses: int = 0  # consecutive verify windows that accepted no draft
    spec_wait: int = 0  # decode steps left before drafting again

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


def _bucket_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


class EngineBase:
    """What both engines do with requests on the host: validation, offline ``generate``, token
    emission with stop and length checks, completion, failing a step's requests, stats.
    Subclasses set ``cfg``, ``max_len``, ``metrics`` and ``_live`` (``{}``) and define ``submit``
    (which calls :meth:`_track`), ``step``, ``_finish``, ``_release`` and ``_counts``."""

    def validate(self, prompt: list[int], sp: SamplingParams):
        """Raise :class:`RequestError` for a request that can never be served."""
        sp.validate()
        self.check_tokens(prompt)
        if len(prompt) + sp.max_tokens > self.max_len:
            raise RequestError(f"prompt ({len(prompt)}) + max_tokens ({sp.max_tokens}) exceeds max_len {self.max_len}")

    def check_tokens(self, prompt: list[int]):
        """Raise :class:`RequestError` for an empty prompt or ids outside the model's vocabulary."""
        if not prompt:
            raise RequestError("empty prompt")
        bad = [t for t in prompt if not (0 <= int(t) < self.cfg.vocab_size)]
        if bad:
            raise RequestError(f"token ids outside the vocabulary [0, {self.cfg.vocab_size}): {bad[:5]}")

    def generate(self, prompts: list[list[int]], max_tokens: int = 16, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_token_ids=(), logprobs: int | None = None
                 ) -> list[Result]:
        """Run prompts to completion (offline use); results in prompt order."""
        reqs = [self.submit(p, SamplingParams(max_tokens, temperature, top_k, top_p,
                                              None if seed is None else seed + i, tuple(stop_token_ids), logprobs))
                for i, p in enumerate(prompts)]
        while not all(r.finished.is_set() for r in reqs):
            self.step()
        return [r.result for r in reqs]

    def abort(self, req, reason: str = "abort"):
        """Cancel a request (e.g. the client disconnected); its pages are released next step and it
        finishes with ``reason`` ("stop": a stop string ended it, and what it cached stays cached)."""
        req.abort_reason, req.aborted = reason, True

    @property
    def num_waiting(self) -> int:
        return self._counts()["waiting"]

    def stats(self) -> dict:
        """Gauges for the server: ``waiting``, ``running``, ``free_pages``, ``free_slots``,
        ``prefix_cache_hit_tokens`` and engine-specific counters."""
        return {**self._counts(), "prefix_cache_hit_tokens": self.metrics.get("cached_tokens", 0)}

    def fail_running(self, exc: BaseException) -> list:
        """A step raised ``exc``: finish every request that has left the queue (running, or taken
        off it by the failed step) with an ``error:`` reason and free what it held; the engine
        stays usable and the waiting requests are served later. Returns the failed requests."""
        reason = f"error: the engine failed while serving this request: {exc!r}"
        waiting = self._waiting_ids()
        failed = [r for r in list(self._live.values()) if r.rid not in waiting]
        for r in failed:
            try:
                self._release(r)
            except Exception:  # noqa: BLE001 - the request fails either way
                log.exception("releasing request %d after a failed step failed", r.rid)
            self._complete(r, reason)
        return failed

    def _track(self, r):
        self._live[r.rid] = r
        return r

    def _emit_token(self, r, tok: int, logprobs=None):
        """``logprobs``: ``(logprob, [(token, logprob)])`` of this token when the request asked."""
        now = time.perf_counter() - r.t0
        if not r.out:
            self.metrics["ttft_sum_s"] += now
        r.out.append(tok)
        r.times.append(now)
        if r.sp.logprobs is not None:
            r.logprobs.append(logprobs)
        self.metrics["generation_tokens"] += 1
        if r.on_token is not None:
            r.on_token(tok)
        if tok in r.sp.stop_token_ids:
            self._finish(r, "stop")
        elif len(r.out) >= r.sp.max_tokens:
            self._finish(r, "length")

    def _complete(self, r, reason: str):
        if self._live.pop(r.rid, None) is None and r.finished.is_set():
            return
        self.metrics["requests_finished"] += 1
        self.metrics["requests_aborted"] += reason == "abort"
        self.metrics["prompt_tokens"] += len(r.prompt)
        r.result = Result(r.rid, r.prompt, list(r.out), r.cached, r.times[0] if r.times else float("nan"),
                          list(r.times), reason, list(r.logprobs) if r.sp.logprobs is not None else None)
        r.finished.set()
        if r.on_token is not None:
            r.on_token(None)


def token_logprobs(logits: np.ndarray, tok: int, k: int):
    """``(logprob of tok, [(token, logprob)] of the k most likely)`` from ``logits [V]``."""
    x = np.asarray(logits, np.float64)
    lp = x - x.max() - np.log(np.sum(np.exp(x - x.max())))
    top = np.argsort(-lp, kind="stable")[:k]
    return float(lp[tok]), [(int(t), float(lp[t])) for t in top]


class Engine(EngineBase):
    """Offline and online serving of one model.

    Args:
      model: "tiny" (the embedded default: ``configs/tiny.json`` with random weights and a
        byte-level vocabulary), "tiny-k3" (the same for Kimi K3: ``configs/tiny_k3.json``), a Hugging Face checkpoint directory, or ``(ModelConfig, params)``.
      max_slots: requests decoded together; max_len: tokens per request (prompt + output).
      prefill_chunk: prefill token budget per step.
      prefix_cache: enable the prefix cache; cache_pages: pool pages backing it.
      hash_tokens: prefix-cache hash block; kernels: device ops for the model (default:
        :func:`default_kernels`).
      speculative: drafts per step for greedy requests (0 = off); drafter: a :class:`Drafter`
        (default: :class:`NgramDrafter`); spec_backoff: after ``m`` consecutive windows with no
        draft accepted, a request proposes no drafts for ``min(2^(m-1), spec_backoff)`` steps
        (0: never back off). In a step where any row drafts, the rows without drafts (backing
        off, sampled, no n-gram match) decode inside the same verify window, one forward per step.
    """

    def __init__(self, model="tiny", *, max_slots: int = 4, max_len: int = 2048, prefill_chunk: int = 256,
                 prefix_cache: bool = True, cache_pages: int = 64, hash_tokens: int = 512, kernels: Kernels | None = None,
                 seed: int = 0, dtype=jnp.float32, speculative: int = 0, drafter: "Drafter | None" = None,
                 spec_backoff: int = 16):
        if isinstance(model, tuple):  # (ModelConfig, params), e.g. a random config for benchmarks
            self.cfg, self.params = model
        elif model in EMBEDDED:
            self.cfg = ModelConfig.from_json(os.path.join(CONFIGS, EMBEDDED[model]))
            self.params = init_params(self.cfg, jax.random.key(seed), dtype=dtype)
        else:
            self.cfg, self.params = load_hf_checkpoint(model)
        self.max_slots, self.max_len, self.prefill_chunk = max_slots, max_len, prefill_chunk
        self.kernels = kernels or default_kernels(self.cfg)
        self.H = hash_tokens
        cache_len = max_len
        if prefix_cache:
            # Physical block B: the smallest multiple of the hash block whose MLA page is at
            # least the KDA checkpoint page, so both kinds share one page size.
            nk, nm = len(self.cfg.kda_layers), len(self.cfg.mla_layers)
            probe = init_cache(self.cfg, 1)
            self._kda_shapes = (probe.kda_state.shape[1:], probe.conv_state.shape[1:])
            kda_words = sum(int(np.prod(s)) for s in self._kda_shapes) * nk
            lat = self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim
            self.B = hash_tokens * max(1, -(-kda_words // (hash_tokens * max(nm, 1) * lat)))
            self._mla_shape = (self.B, nm, lat)
            cache_len = -(-max_len // self.B) * self.B
        one = init_cache(self.cfg, cache_len)
        self.caches = jax.tree.map(lambda x: jnp.zeros((max_slots,) + x.shape, x.dtype), one)
        self._compiled: set = set()
        self.speculative = speculative
        self.drafter = drafter or NgramDrafter()
        self.spec_backoff = spec_backoff
        self.cache = self.pool = None
        if prefix_cache:
            self.pool = PagePool(cache_pages, max(kda_words, int(np.prod(self._mla_shape))))
            self.cache = PrefixCache(CacheConfig(hash_tokens, self.B, 1, 1), self.pool)
        self.waiting: deque[_Req] = deque()
        self.running: dict[int, _Req] = {}
        self._live: dict[int, _Req] = {}
        self.free_slots = list(range(max_slots - 1, -1, -1))
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.metrics = {"requests": 0, "requests_finished": 0, "requests_rejected": 0, "prompt_tokens": 0,
                        "requests_aborted": 0, "generation_tokens": 0, "cached_tokens": 0, "preemptions": 0,
                        "ttft_sum_s": 0.0, "spec_proposed": 0, "spec_accepted": 0}

    def _note_compile(self, key):
        if key not in self._compiled:
            self._compiled.add(key)
            log.info("compiling %s (%d shapes so far)", key, len(self._compiled))

    @property
    def num_compilations(self) -> int:
        return len(self._compiled)

    # ---- requests
    def submit(self, prompt: list[int], sp: SamplingParams = SamplingParams(), on_token=None) -> _Req:
        """Queue a request (thread-safe). Raises RequestError for invalid input."""
        prompt = [int(t) for t in prompt]
        self.validate(prompt, sp)
        req = _Req(next(self._ids), prompt, sp, on_token)
        with self._lock:
            self.waiting.append(self._track(req))
            self.metrics["requests"] += 1
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling
    def step(self):
        """One scheduling step: admit, decode, prefill under the token budget, land the cache."""
        for req in [r for r in self.running.values() if r.aborted]:
            self._finish(req, req.abort_reason)
        self._admit()
        self._decode_step()
        self._prefill_step()
        if self.cache is not None:
            self.cache.end_step()

    def _admit(self):
        while self.free_slots:
            with self._lock:
                if not self.waiting:
                    return
                req = self.waiting.popleft()
            if req.aborted:
                self._complete(req, req.abort_reason)
                continue
            tokens = req.tokens
            req.hashes = chain_hashes(tokens, self.H)
            hit = 0
            if self.cache is not None:
                try:
                    adm = self.cache.admit(req.rid, req.hashes, len(tokens))
                except PoolExhausted as e:
                    if self.running:  # pages come back as requests finish
                        with self._lock:
                            self.waiting.appendleft(req)
                        return
                    self._reject(req, f"request cannot fit the cache pool: {e}")
                    continue
                hit = adm.num_cached_tokens
            req.slot = self.free_slots.pop()
            self.running[req.rid] = req  # before the device work: a failure there releases it all
            if hit:
                self._restore(req.slot, adm, hit)
            else:  # a recycled slot starts from zero state
                self.caches = _zero_slot(self.caches, req.slot)
            req.done = req.cached = hit
            if not req.out:
                self.metrics["cached_tokens"] += hit

    def _restore(self, slot, adm, hit):
        """Copy the hit checkpoint and MLA latents from pool pages into the slot: one device call
        of one shape whatever the hit length (page ids padded to the slot's block count)."""
        blocks = adm.block_table[: -(-hit // self.B)]
        if adm.copy_block_from is not None:
            blocks[-1] = adm.copy_block_from
        ids = self.pool.page_ids([adm.copy_state_from[0]] + [b[0] for b in blocks])
        n_blocks = self.caches.mla_kv.shape[2] // self.B
        mla_ids = np.concatenate([ids[1:], np.full(n_blocks - len(blocks), ids[1], np.int32)])
        self.caches = _restore_slot(self._kda_shapes, self._mla_shape, self.caches, self.pool.words, slot, ids[0],
                                    mla_ids, hit)

    def warmup(self, prefill: bool = True):
        """Compile what the loop runs, on an idle engine, so no request pays a compilation: the
        decode step, verify and commit when speculating, and with ``prefill`` every prefill
        bucket (powers of two up to the step budget). Slots are reset at admission, so the
        dummy calls leave nothing behind."""
        if self.running:
            raise RuntimeError("warmup() needs an idle engine")
        run = (self.cfg, self.kernels)
        idle = jnp.zeros(self.max_slots, bool)
        self._note_compile(("decode", self.max_slots))
        _, self.caches = _decode(*run, self.params, jnp.zeros(self.max_slots, jnp.int32), self.caches, idle)
        if self.speculative:
            S = self.speculative
            self._note_compile(("verify", self.max_slots, S + 1))
            _, after, win = _verify(*run, self.params, jnp.zeros((self.max_slots, S + 1), jnp.int32), self.caches)
            self._note_compile(("commit", self.max_slots, S + 1))
            self.caches = _commit(*run, self.caches, after, win, jnp.ones(self.max_slots, jnp.int32), idle)
        n = 1
        while prefill and n <= min(self.prefill_chunk, self.H, self.max_len):
            self._note_compile(("prefill", n))
            _, self.caches = _prefill(*run, self.params, jnp.zeros(n, jnp.int32), self.caches, 0)
            self.caches = _zero_slot(self.caches, 0)
            n *= 2
        jax.block_until_ready(self.caches)

    def _decode_step(self):
        dec = [r for r in self.running.values() if r.done == len(r.tokens) - 1 and r.out]
        if self.speculative:
            fits = self.caches.mla_kv.shape[2] - self.speculative - 1
            drafts = {}
            for r in dec:
                if r.sp.temperature != 0 or r.done > fits:
                    continue
                if r.spec_wait:
                    r.spec_wait -= 1
                elif d := self._draft(r):
                    drafts[r.rid] = d
            if drafts:  # rows without drafts ride in the same window (one token): one forward per step
                self._spec_step([r for r in dec if r.done <= fits], drafts)
                dec = [r for r in dec if r.done > fits]
        if not dec:
            return
        tokens = np.zeros(self.max_slots, np.int32)
        active = np.zeros(self.max_slots, bool)
        for r in dec:
            tokens[r.slot], active[r.slot] = r.out[-1], True
        self._note_compile(("decode", self.max_slots))
        logits, self.caches = _decode(self.cfg, self.kernels, self.params, jnp.asarray(tokens), self.caches, jnp.asarray(active))
        logits = np.asarray(logits)
        for r in dec:
            r.done += 1
            if self._after_forward(r):
                self._emit(r, logits[r.slot])

    def _prefill_step(self):
        budget = self.prefill_chunk
        for r in list(self.running.values()):
            if budget <= 0:
                break
            toks = r.tokens
            end = len(toks) - (1 if r.out else 0)  # a preempted request re-feeds its output but the last token
            while budget > 0 and r.done < end:
                next_boundary = (r.done // self.H + 1) * self.H
                n = _bucket_floor(min(end - r.done, budget, next_boundary - r.done))
                self._note_compile(("prefill", n))
                last, self.caches = _prefill(self.cfg, self.kernels, self.params, jnp.asarray(toks[r.done : r.done + n], jnp.int32),
                                                  self.caches, r.slot)
                r.done += n
                budget -= n
                if not self._after_forward(r):
                    break
                if r.done == end and not r.out:
                    self._emit(r, np.asarray(last))
                if r.rid not in self.running:
                    break

    def _after_forward(self, r: _Req) -> bool:
        """Register what the forward wrote; write checkpoints and MLA blocks into pool pages."""
        if self.cache is None:
            return True
        toks = r.tokens
        full = r.done // self.H
        if len(r.hashes) < full:
            r.hashes += chain_hashes(toks[len(r.hashes) * self.H : full * self.H], self.H,
                                     r.hashes[-1] if r.hashes else 0)
        try:
            if r.out:
                self.cache.extend(r.rid, r.hashes, len(toks))
            writes = self.cache.on_forward(r.rid, r.done)
        except PoolExhausted:
            self._preempt(r)
            return False
        for tok, pages in writes:
            assert tok == r.done, "a checkpoint must be the state the slot holds"
            self.pool.write_f32(pages[0], _checkpoint(self.caches, r.slot), KDA)
        if r.done % self.H == 0:
            # A hash block completed: its physical block's page gets the slot's latents
            # before the step lands (only complete hash blocks are ever matched).
            j = (r.done - 1) // self.B
            self.pool.write_f32(self.cache.request_blocks(r.rid)[j][0], _mla_block(self.B, self.caches, r.slot, j), MLA)
        return True

    def _preempt(self, r: _Req):
        """Out of pool pages: drop the request's slot and recompute it later from its tokens."""
        self.metrics["preemptions"] += 1
        self.cache.abort(r.rid)
        del self.running[r.rid]
        self.free_slots.append(r.slot)
        r.slot, r.done = -1, 0
        with self._lock:
            self.waiting.appendleft(r)

    def _draft(self, r: _Req) -> list[int]:
        room = min((r.done // self.H + 1) * self.H - r.done,  # never cross a hash boundary
                   self.max_len - r.done, r.sp.max_tokens - len(r.out)) - 1
        return self.drafter.propose(r.tokens, min(self.speculative, room)) if room > 0 else []

    def _spec_step(self, rows: list[_Req], drafts: dict[int, list[int]]):
        """Speculative decode, batched over slots: verify ``[last] + drafts`` of every row in one
        forward (a row without drafts is a window of one token, greedy or sampled), keep each
        row's agreeing prefix plus the next token, and rebuild each state after exactly those
        tokens by replaying the window's cached projections (one batched commit)."""
        S = self.speculative
        windows = np.zeros((self.max_slots, S + 1), np.int32)
        active = np.zeros(self.max_slots, bool)
        for r in rows:
            d = drafts.get(r.rid, [])
            windows[r.slot, 0], windows[r.slot, 1 : 1 + len(d)] = r.out[-1], d
            active[r.slot] = True
        self._note_compile(("verify", self.max_slots, S + 1))
        logits, after, win = _verify(self.cfg, self.kernels, self.params, jnp.asarray(windows), self.caches)
        logits = np.asarray(logits)
        preds = np.argmax(logits, axis=-1)
        accepted = np.zeros(self.max_slots, np.int32)
        for r in rows:
            if not (d := drafts.get(r.rid)):
                continue
            n = 0
            while n < len(d) and d[n] == preds[r.slot, n]:
                n += 1
            accepted[r.slot] = n
            r.spec_misses = 0 if n else r.spec_misses + 1
            r.spec_wait = min(1 << (r.spec_misses - 1), self.spec_backoff) if r.spec_misses else 0
            self.metrics["spec_proposed"] += len(d)
            self.metrics["spec_accepted"] += n
        self._note_compile(("commit", self.max_slots, S + 1))
        self.caches = _commit(self.cfg, self.kernels, self.caches, after, win, jnp.asarray(accepted + 1),
                              jnp.asarray(active))
        for r in rows:
            n = int(accepted[r.slot])
            for i in range(n):
                tok = drafts[r.rid][i]
                k = r.sp.logprobs
                self._emit_token(r, tok, None if k is None else token_logprobs(logits[r.slot, i], tok, k))
                if r.rid not in self.running:  # a stop token or max_tokens among the drafts
                    break
            else:
                r.done += 1 + n
                if self._after_forward(r):
                    self._emit(r, logits[r.slot, n])  # greedy rows: preds[r.slot, n]

    def _emit(self, r: _Req, logits: np.ndarray):
        try:
            tok = sample(logits, r.sp, len(r.out))
        except Exception as e:  # noqa: BLE001 - one request's failure must not stop the loop
            log.exception("sampling failed for request %d", r.rid)
            self._finish(r, f"error: sampling failed: {e!r}")
            return
        self._emit_token(r, tok, None if r.sp.logprobs is None else token_logprobs(logits, tok, r.sp.logprobs))

    def _finish(self, r: _Req, reason: str):
        if self.cache is not None:
            (self.cache.abort if reason == "abort" else self.cache.finish)(r.rid)
        del self.running[r.rid]
        self.free_slots.append(r.slot)
        self._complete(r, reason)

    def _release(self, r: _Req):
        """Free what a failed request holds (its cache entries are withdrawn, not kept)."""
        if self.running.pop(r.rid, None) is not None:
            if self.cache is not None:
                self.cache.abort(r.rid)
            if r.slot >= 0 and r.slot not in self.free_slots:
                self.free_slots.append(r.slot)
        r.slot = -1

    def _waiting_ids(self) -> set[int]:
        with self._lock:
            return {r.rid for r in self.waiting}

    def _counts(self) -> dict:
        return {"waiting": len(self.waiting), "running": len(self.running), "free_slots": len(self.free_slots),
                "free_pages": 0 if self.pool is None else self.pool.num_free + self.pool.num_evictable,
                "preemptions": self.metrics["preemptions"]}

    def _reject(self, r: _Req, reason: str):
        self.metrics["requests_rejected"] += 1
        self._complete(r, "rejected: " + reason)


def sample(logits: np.ndarray, sp: SamplingParams, index: int) -> int:
    """Pick a token from ``logits [V]``: greedy, or temperature / top-k / top-p with a per-request
    seed (the ``index``-th draw of a seeded request is reproducible). Non-finite logits never
    reach the random draw: they fall back to the greedy pick among the finite ones."""
    logits = np.asarray(logits, np.float64)
    if sp.temperature < GREEDY_TEMPERATURE:
        return int(np.argmax(np.where(np.isnan(logits), -np.inf, logits)))
    x = np.where(np.isfinite(logits), logits, -np.inf)
    if not np.isfinite(x).any():
        return int(np.argmax(logits))
    x = (x - x.max()) / sp.temperature  # shift first: no overflow for any temperature >= the floor
    if sp.top_k:
        kth = np.sort(x)[-min(sp.top_k, x.size)]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x)
    p /= p.sum()
    if sp.top_p < 1:
        order = np.argsort(-p)
        keep = np.cumsum(p[order]) - p[order] < sp.top_p
        mask = np.zeros_like(p, bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0)
        p /= p.sum()
    rng = np.random.default_rng(None if sp.seed is None else (int(sp.seed) % 2**64, index))
    return int(rng.choice(p.size, p=p))


# Device functions, jitted at module level with the config and kernels static, so engines of one
# model share compilations; the slot caches are donated.
def _slot(caches, slot):
    return jax.tree.map(lambda x: x[slot], caches)


def _put(caches, slot, c):
    return jax.tree.map(lambda all_, one: all_.at[slot].set(one), caches, c)


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=4)
def _prefill(cfg, kernels, params, ids, caches, slot):
    logits, c = forward(cfg, params, ids, _slot(caches, slot), kernels)
    return logits[-1], _put(caches, slot, c)


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=4)
def _decode(cfg, kernels, params, tokens, caches, active):
    logits, new = jax.vmap(lambda tok, c: forward(cfg, params, tok[None], c, kernels))(tokens, caches)
    keep = lambda n, o: jnp.where(active.reshape((-1,) + (1,) * (n.ndim - 1)), n, o)
    return logits[:, 0], jax.tree.map(keep, new, caches)


@partial(jax.jit, static_argnums=(0, 1))
def _verify(cfg, kernels, params, windows, caches):
    return jax.vmap(lambda w, c: forward(cfg, params, w, c, kernels, return_window=True))(windows, caches)


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def _commit(cfg, kernels, caches, after, win, n, active):
    new = commit_window(cfg, caches, after, win, n, kernels)
    keep = lambda a, b: jnp.where(active.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
    return jax.tree.map(keep, new, caches)


@jax.jit
def _checkpoint(caches, slot):
    """A slot's KDA and conv state as checkpoint words; pages hold the state head-contiguous."""
    return jnp.concatenate([jnp.swapaxes(caches.kda_state[slot], 0, 1).reshape(-1), caches.conv_state[slot].reshape(-1)])


@partial(jax.jit, static_argnums=0)
def _mla_block(B, caches, slot, j):
    """The slot's MLA latents of physical block ``j`` as ``[B, layers, lat]``."""
    return jnp.swapaxes(jax.lax.dynamic_slice_in_dim(caches.mla_kv[slot], j * B, B, axis=1), 0, 1)


@partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def _restore_slot(kda_shapes, mla_shape, caches, words, slot, kda_page, mla_pages, hit):
    """Inverse of :func:`_checkpoint` / :func:`_mla_block`: the checkpoint page and the first
    ``hit`` latent rows of ``mla_pages`` (padded to the slot's block count) into ``slot``."""
    (ks, cs), nk = kda_shapes, caches.kda_state.shape[1]
    n_k, n_c, n_m = nk * math.prod(ks), nk * math.prod(cs), math.prod(mla_shape)
    f32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)
    state = f32(words[kda_page, : n_k + n_c])
    kda = jnp.swapaxes(state[:n_k].reshape((ks[0], nk) + tuple(ks[1:])), 0, 1)
    conv = state[n_k:].reshape((nk,) + tuple(cs))
    rows = f32(words[mla_pages, :n_m]).reshape((-1,) + tuple(mla_shape[1:]))
    rows = jnp.where((jnp.arange(rows.shape[0]) < hit)[:, None, None], rows, 0.0)
    mla = jnp.swapaxes(rows, 0, 1).astype(caches.mla_kv.dtype)
    return _put(caches, slot, ModelCache(kda, conv, mla, jnp.asarray(hit, caches.pos.dtype)))


@partial(jax.jit, donate_argnums=0)
def _zero_slot(caches, slot):
    return jax.tree.map(lambda x: x.at[slot].set(0), caches)

class Drafter:
    """Proposes draft tokens for speculative decoding (a draft model implements the same call)."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        raise NotImplementedError


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the last ``n`` tokens (``n`` from
    ``max_ngram`` down to 1) and propose the ``k`` tokens that followed it."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            suffix = tokens[-n:]
            for i in range(len(tokens) - n - 1, -1, -1):
                if tokens[i : i + n] == suffix:
                    return list(tokens[i + n : i + n + k])
        return []
