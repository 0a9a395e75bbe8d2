"""Host-side scheduling for the serving step (no JAX): one token budget per step shared by
decode rows and prefill chunks of several requests, pages and state slots from one allocator,
preemption by recompute.

Each :meth:`Scheduler.plan` returns a :class:`StepPlan`: the decode rows (one token each: the
last sampled token of a request whose prompt is in the cache) and the prefill chunks that fit
the budget, as :class:`k3jax.model.step.Row` s, with the request behind each row and whether
its sampled token is kept. Pages are allocated before a row is planned; when the pool runs
dry the most recently admitted request after it is preempted (its pages freed, its tokens
recomputed later: never corrupted); a new request is admitted only into free pages.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from k3jax.model.step import Row
from serving.page_pool import KDA, MLA, PagePool, PoolExhausted
from serving.prefix_cache import PrefixCache, chain_hashes

_ROW_FIELDS = ("tokens", "start", "pages", "slot", "src", "checkpoint", "copy", "temperature", "top_k", "top_p", "seed",
               "checkpoint_at")
# Scheduler._row builds its rows as plain tuples of these fields; Row(...) if they ever differ.
_new_row = tuple.__new__ if Row._fields == _ROW_FIELDS else (lambda cls, fields: cls(*fields))


@dataclass(eq=False)
class Request:
    """A request and its place in the pool: ``pages`` (MLA pages in order; the list is replaced,
    never changed in place, as its decode rows hold it), ``slot`` (its KDA state page, -1 until
    admitted), ``done`` tokens in the cache."""

    rid: int
    prompt: list[int]
    sp: object  # serving.engine.SamplingParams
    seed: int
    on_token: object = None
    out: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    pages: list[int] = field(default_factory=list)
    slot: int = -1
    done: int = 0
    cached: int = 0  # prompt tokens served from the prefix cache (at its first admission)
    admitted: bool = False  # once admitted (preemption does not reset it)
    hashes: list[int] = field(default_factory=list)  # chain hashes of the complete hash blocks of tokens
    restore: tuple[int, tuple[int, int] | None] | None = None  # a hit's (checkpoint, page copy), for its first row
    cache_tokens: int = 0  # tokens the prefix cache has given pages for
    pending: int = 0  # tokens sampled by dispatched steps, not yet read back (the step feeds them on)
    spec_misses: int = 0  # consecutive windows with no draft accepted
    spec_wait: int = 0  # steps left without drafts (the back-off after misses)
    aborted: bool = False
    abort_reason: str = "abort"  # the finish reason an abort gives ("stop": the server found a stop string)
    lane: int = 0  # the engine's data shard (scheduler) that serves it
    finished: threading.Event = field(default_factory=threading.Event)
    result: object = None
    logprobs: list = field(default_factory=list)  # filled before on_token sees the token

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.out)

    def token_slice(self, a: int, b: int) -> list[int]:
        """``tokens[a:b]`` without building ``tokens`` (prompts are long, steps are many)."""
        n = len(self.prompt)
        if b <= n:
            return self.prompt[a:b]
        return self.prompt[a:n] + self.out[max(a - n, 0) : b - n] if a < n else self.out[a - n : b - n]

    @property
    def prefill_end(self) -> int:
        """Tokens to prefill before decoding: the prompt, or after a preemption everything but
        the last sampled token (which the next decode row feeds)."""
        return self.num_tokens - (1 if self.out else 0)


@dataclass
class StepPlan:
    """One step's rows and, per row, the request and whether its sampled token is kept."""

    decode: list[Row]
    prefill: list[Row]
    requests: list[Request]  # decode rows first, then prefill rows
    keep: list[bool]


class Scheduler:
    """Plans steps under ``token_budget`` tokens, at most ``max_decode`` decode rows and
    ``max_prefill_rows`` prefill chunks of at most ``max_chunk`` tokens each.

    With a :class:`serving.prefix_cache.PrefixCache` (over the same pool; its block is the MLA
    page), admission looks the prompt up and takes the hit: full MLA pages shared by refcount,
    a partial page copied and the KDA checkpoint read into the request's slot by its first
    row, inside the step. A prefill chunk that crosses a hash boundary ends on the last one it
    crosses, so the state the step writes after it is that boundary's checkpoint; with
    ``checkpoint_stride`` (the hash block: the step takes a row's checkpoint inside its chunk) a
    prompt's last chunk, starting on a boundary, runs to the prompt's end instead (one step
    fewer). Registrations of a step become visible when the engine calls :meth:`landed` after
    the step finished."""

    def __init__(self, pool: PagePool, page_tokens: int, *, token_budget: int, max_decode: int,
                 max_prefill_rows: int, max_chunk: int, cache: PrefixCache | None = None, ids=None,
                 speculative: int = 0, drafter=None, spec_backoff: int = 16, draft_context: int = 4096,
                 checkpoint_stride: int | None = None):
        if min(max_prefill_rows, max_chunk) < 1:
            raise ValueError(f"max_prefill_rows ({max_prefill_rows}) and max_chunk ({max_chunk}) must be at least 1: "
                             "prompts are prefilled in chunks of prefill rows")
        self.pool, self.P = pool, page_tokens
        self.budget = token_budget
        self.max_decode, self.max_prefill_rows, self.max_chunk = max_decode, max_prefill_rows, max_chunk
        self.cache = cache
        self.speculative, self.drafter, self.spec_backoff = speculative, drafter, spec_backoff
        self.draft_context = draft_context
        self.H = cache.cfg.hash_tokens if cache else 0
        if cache and cache.cfg.block_tokens != page_tokens:
            raise ValueError(f"the prefix cache's block ({cache.cfg.block_tokens}) must be the page ({page_tokens})")
        if cache and checkpoint_stride not in (None, self.H):
            raise ValueError(f"checkpoint_stride {checkpoint_stride} must be the hash block ({self.H})")
        self.checkpoints_inside = bool(cache) and checkpoint_stride is not None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.preemptions = 0
        self._preempted_now: set[int] = set()
        self.ids = ids or itertools.count()  # request ids, carried over when a scheduler is rebuilt
        self._lock = threading.Lock()

    def new_request(self, prompt, sp, seed, on_token=None) -> Request:
        """A request with a fresh id (not queued: see :meth:`add`)."""
        return Request(next(self.ids), list(prompt), sp, seed, on_token)

    def add(self, req: Request):
        """Queue a request (thread-safe)."""
        with self._lock:
            self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- pages
    def _make_room(self, r: Request, need: int) -> bool:
        """Free pages until ``need`` can be allocated: a running request preempts requests
        admitted after it (the oldest always progresses); a new one only takes free pages."""
        while not self.pool.can_allocate(need):
            later = self.running[self.running.index(r) + 1 :] if r in self.running else []
            if not later:
                return False
            self.preempt(later[-1])
        return True

    def _admit(self, r: Request) -> bool:
        """Give a new (or preempted) request its state slot; with the prefix cache, look it up and
        take its pages for the tokens to prefill. False (nothing held) if it does not fit now."""
        if self.cache is None:
            if not self.pool.can_allocate(1):
                return False
            r.slot = self.pool.allocate(KDA)
            return True
        self._hash(r)
        try:
            adm = self.cache.admit(r.rid, r.hashes, r.prefill_end)
        except PoolExhausted:
            return False
        r.slot, r.pages = adm.slot[0], [b[0] for b in adm.block_table]
        r.done = adm.num_cached_tokens
        if not r.admitted:  # a readmission's hit may cover generated tokens: the first one's is reported
            r.cached, r.admitted = min(r.done, len(r.prompt)), True
        r.cache_tokens = r.prefill_end
        if r.done:
            copy = (adm.copy_block_from[0], r.pages[r.done // self.P]) if adm.copy_block_from else None
            r.restore = (adm.copy_state_from[0], copy)
        return True

    def _hash(self, r: Request):
        full = r.num_tokens // self.H
        if len(r.hashes) < full:
            r.hashes += chain_hashes(r.token_slice(len(r.hashes) * self.H, full * self.H), self.H,
                                     r.hashes[-1] if r.hashes else 0)

    def _pages_needed(self, r: Request, end: int) -> int:
        return max(0, -(-end // self.P) - len(r.pages))

    def _grow(self, r: Request, end: int, drafts: int = 0, boundary: int | None = None) -> int | None:
        """Pages for ``r``'s tokens up to ``end`` plus ``drafts`` draft tokens (and with the prefix
        cache, the checkpoint page of the hash boundary at ``boundary``, default ``end``, when one
        can be spared): the checkpoint page, -1 for none, or None if the pages cannot be had."""
        if end + drafts <= len(r.pages) * self.P and (self.cache is None or end // self.H == r.done // self.H):
            # Most decode rows: no page to add and no hash boundary reached, so nothing for the
            # cache to register (its next call covers these tokens too).
            return -1
        if not self._make_room(r, self._pages_needed(r, end + drafts)):
            return None
        if self.cache is None:
            pages = list(r.pages)  # a new list: planned rows hold the old one
            while len(pages) * self.P < end + drafts:
                pages.append(self.pool.allocate(MLA))
            r.pages = pages
            return -1
        self._hash(r)
        r.cache_tokens = max(r.cache_tokens, end + drafts)
        self.cache.extend(r.rid, r.hashes, r.cache_tokens)
        r.pages = [b[0] for b in self.cache.request_blocks(r.rid)]
        # The checkpoint is optional: with no page to spare the boundary is simply not cached.
        writes = self.cache.on_forward(r.rid, end, only=end if boundary is None else boundary,
                                       checkpoint=self.pool.can_allocate(1))
        return writes[0][1][0] if writes else -1

    def take_aborted_waiting(self) -> list[Request]:
        """Remove and return the aborted requests still waiting (wherever they are in the queue)."""
        with self._lock:
            gone = [r for r in self.waiting if r.aborted]
            self.waiting = deque(r for r in self.waiting if not r.aborted)
        return gone

    def waiting_ids(self) -> set[int]:
        with self._lock:
            return {r.rid for r in self.waiting}

    def release(self, r: Request, *, keep: bool = False):
        """Free ``r``'s pages and take it off the queue (a preempted request can finish while
        waiting, when its last in-flight token lands); with ``keep`` (a finished request) what it
        cached stays cached."""
        if r.slot < 0:
            with self._lock:
                self.waiting = deque(x for x in self.waiting if x is not r)
        if self.cache is not None and r.slot >= 0:
            (self.cache.finish if keep else self.cache.abort)(r.rid)
        elif r.slot >= 0:
            for p in r.pages + [r.slot]:
                self.pool.decref(p)
        r.pages, r.slot, r.done, r.restore, r.cache_tokens = [], -1, 0, None, 0
        if r in self.running:
            self.running.remove(r)

    def preempt(self, r: Request):
        """Free ``r``'s pages and queue it first; its tokens are recomputed when it is readmitted."""
        self.preemptions += 1
        self._preempted_now.add(r.rid)
        self.release(r)
        with self._lock:
            self.waiting.appendleft(r)

    def landed(self):
        """The planned step has finished on the device: what it wrote becomes matchable."""
        if self.cache is not None:
            self.cache.end_step()

    # ---- planning
    def plan(self) -> StepPlan:
        # This runs every step over every running request (256 at batch 256, under ENGINE.md's 1 ms of
        # host time per step with the batch packing): the decode loop reads each field once and does
        # no call for the common row (no drafts, no page to add, no hash boundary reached).
        pre = self._preempted_now = set()
        P, H, cache, speculative, max_decode = self.P, self.H, self.cache, self.speculative, self.max_decode
        new_row = _new_row
        decode, dreqs = [], []  # decode rows and their requests
        add_row, add_req = decode.append, dreqs.append
        n_drafted = 0  # the decode rows' draft tokens
        # The running requests still prefilling (done < prefill_end), found on the way: a request that
        # passes _decodes is not one (its done is at least its prefill_end).
        prefilling = []
        running = list(self.running)
        for r in running:
            if len(decode) == max_decode:
                rest = running[running.index(r) :]  # not seen: looked at for prefilling below
                break
            if pre and r.rid in pre:
                continue  # preempted in this step: not running now
            out, pending, done = r.out, r.pending, r.done
            if not (out or pending):
                if done < len(r.prompt):
                    prefilling.append(r)
                continue
            n_out, sp = len(out), r.sp  # _decodes(r), inline:
            if done != len(r.prompt) + n_out + pending - 1:
                if done < len(r.prompt) + n_out - (1 if out else 0):
                    prefilling.append(r)
                continue
            if n_out + pending >= sp.max_tokens:
                continue
            end = done + 1
            if cache is not None and pending and end % H == 0:
                continue  # its row completes a hash block: wait a step for the token, to hash and cache it
            if speculative:
                drafts = self._drafts(r)
                n_drafts = len(drafts)
                if n_drafts:
                    plain, need = self._pages_needed(r, end), self._pages_needed(r, end + n_drafts)
                    if need > plain and not self.pool.can_allocate(need):
                        # Drafts take only spare pages (they never preempt a request): those that fit.
                        drafts = drafts[: (len(r.pages) + plain) * P - end]
                        n_drafts = len(drafts)
            else:
                drafts, n_drafts = None, 0
            if end + n_drafts <= len(r.pages) * P and (cache is None or end // H == done // H):
                ck = -1  # _grow's common case, inline: no page to add and no hash boundary reached
            elif (ck := self._grow(r, end, n_drafts)) is None:
                continue
            # A token still on the device is fed from there (-1): the step reads its slot's last sample.
            tokens = [-1] if pending else out[-1:]
            if n_drafts:
                tokens += drafts
                n_drafted += n_drafts
            if restore := r.restore:  # self._row(r, tokens, ck), inline
                (src, copy), r.restore = restore, None
            else:
                src = copy = None
            add_row(new_row(Row, (tokens, done, r.pages, r.slot, src, ck, copy, sp.temperature, sp.top_k, sp.top_p,
                                  r.seed, 0)))
            add_req(r)
        else:
            rest = ()
        prefilling += [r for r in rest if r.done < r.prefill_end]
        prefill, preqs, pkeep = [], [], []
        budget = self.budget - len(decode) - n_drafted
        n_prefill = 0
        for r in self._prefill_candidates(prefilling):
            if budget <= 0 or n_prefill == self.max_prefill_rows or (r.slot < 0 and not self._admit(r)):
                self._requeue(r)
                break
            new = r not in self.running
            if new:
                self.running.append(r)
            end = r.done + min(r.prefill_end - r.done, budget, self.max_chunk)
            b = end
            if cache is not None and end // H > r.done // H:
                b = end // H * H  # the last hash boundary crossed: its checkpoint
                if b == end == r.prefill_end and b - H > r.done:
                    b -= H  # a resend of this prompt restores the boundary before its last token
                if not (self.checkpoints_inside and end == r.prefill_end and r.done % H == 0):
                    end = b  # the chunk ends on it: the state after the chunk is the checkpoint
                if (k := cache.first_kept(r.rid, r.done, b)) is not None:
                    end = b = k  # a boundary the policy keeps (a junction, an interval) comes first: end there
            if (ck := self._grow(r, end, boundary=b)) is None:
                if new:  # not admitted after all: hold nothing while waiting
                    self.release(r)
                    self._requeue(r)
                break
            prefill.append(self._row(r, r.token_slice(r.done, end), ck, b - r.done if ck >= 0 and b < end else 0))
            preqs.append(r)
            pkeep.append(end == r.prefill_end and not r.out)
            budget -= end - r.done
            n_prefill += 1
        if pre:  # a request preempted while this step was planned has no pages now: its rows go
            kept = [i for i, r in enumerate(dreqs) if r.rid not in pre]
            decode, dreqs = [decode[i] for i in kept], [dreqs[i] for i in kept]
            kept = [i for i, r in enumerate(preqs) if r.rid not in pre]
            prefill, preqs, pkeep = [prefill[i] for i in kept], [preqs[i] for i in kept], [pkeep[i] for i in kept]
        if cache is not None and (decode or prefill):  # the engine dispatches it (and calls landed() when it lands)
            cache.begin_step()
        return StepPlan(decode, prefill, dreqs + preqs, [True] * len(decode) + pkeep)

    def _drafts(self, r: Request) -> list[int]:
        """Draft tokens for ``r``'s decode row: for a greedy request without logprobs whose last
        token is known, at most ``speculative``, what its length allows, and (with the prefix
        cache) short of the next hash boundary, whose checkpoint only a plain row writes."""
        if not self.speculative or r.pending or r.sp.temperature > 0 or r.sp.logprobs is not None:
            return []
        if r.spec_wait:
            r.spec_wait -= 1
            return []
        k = min(self.speculative, r.sp.max_tokens - len(r.out) - 1)
        if self.H:
            k = min(k, -(r.done + 1) % self.H - 1)
        if k <= 0:
            return []
        n = r.num_tokens  # the drafter sees the last draft_context tokens (its cost grows with them)
        drafts = self.drafter.propose(r.token_slice(max(0, n - self.draft_context), n), k)[:k]
        if not drafts:
            self.drafts_landed(r, 0)  # nothing to propose counts as a miss: back off
        return drafts

    def drafts_landed(self, r: Request, accepted: int):
        """``r``'s window accepted ``accepted`` drafts: after ``m`` windows in a row with none, it
        drafts again only after ``min(2^(m-1), spec_backoff)`` plain steps (a window costs the whole
        step its window's width in tokens)."""
        r.spec_misses = 0 if accepted else r.spec_misses + 1
        r.spec_wait = min(1 << (r.spec_misses - 1), self.spec_backoff) if r.spec_misses else 0

    @staticmethod
    def _decodes(r: Request) -> bool:
        """``r``'s prompt is in the cache and its last sampled token is next (known or in flight),
        and it may still produce a token."""
        return ((r.out or r.pending) and r.done == r.num_tokens + r.pending - 1
                and len(r.out) + r.pending < r.sp.max_tokens)

    def _requeue(self, r: Request):
        if r not in self.running:
            with self._lock:
                self.waiting.appendleft(r)

    def _prefill_candidates(self, prefilling: list[Request]):
        """The running requests still prefilling (``prefilling``, in admission order), then waiting
        ones in arrival order (one preempted in this step waits for the next)."""
        for r in prefilling:
            if r.rid not in self._preempted_now:
                yield r
        while True:
            with self._lock:
                if not self.waiting or self.waiting[0].rid in self._preempted_now or self.waiting[0].pending:
                    return
                r = self.waiting.popleft()
            yield r

    def _row(self, r: Request, tokens: list[int], checkpoint: int, checkpoint_at: int = 0) -> Row:
        sp, restore = r.sp, r.restore
        if restore:
            (src, copy), r.restore = restore, None
        else:
            src = copy = None
        # A tuple built directly, in Row's field order (checked at import): Row(...) goes through
        # its Python-level __new__, and this runs for every row of every step.
        return _new_row(Row, (tokens, r.done, list(r.pages), r.slot, src, checkpoint, copy, sp.temperature, sp.top_k,
                              sp.top_p, r.seed, checkpoint_at))

    def advance(self, plan: StepPlan):
        """The step was dispatched: every planned row's tokens are (about to be) in the cache and
        every kept row's sample is pending until it is read back."""
        nd, reqs, keep = len(plan.decode), plan.requests, plan.keep
        for row, r, k in zip(plan.decode, reqs, keep):
            r.done = row.start + 1  # drafts: when accepted
            r.pending += k
        for row, r, k in zip(plan.prefill, reqs[nd:], keep[nd:]):
            r.done = row.start + len(row.tokens)
            r.pending += k
