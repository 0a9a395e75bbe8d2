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


@dataclass
class Request:
    """A request and its place in the pool: ``pages`` (MLA pages in order), ``slot`` (its KDA
    state page, -1 until admitted), ``done`` tokens in the cache."""

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
    cached: int = 0  # prompt tokens served from a prefix cache (none yet)
    aborted: bool = False
    finished: threading.Event = field(default_factory=threading.Event)
    result: object = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def prefill_end(self) -> int:
        """Tokens to prefill before decoding: the prompt, or after a preemption everything but
        the last sampled token (which the next decode row feeds)."""
        return len(self.tokens) - (1 if self.out else 0)


@dataclass
class StepPlan:
    """One step's rows and, per row, the request and whether its sampled token is kept."""

    decode: list[Row]
    prefill: list[Row]
    requests: list[Request]  # decode rows first, then prefill rows
    keep: list[bool]


class Scheduler:
    """Plans steps under ``token_budget`` tokens, at most ``max_decode`` decode rows and
    ``max_prefill_rows`` prefill chunks of at most ``max_chunk`` tokens each."""

    def __init__(self, pool: PagePool, page_tokens: int, *, token_budget: int, max_decode: int,
                 max_prefill_rows: int, max_chunk: int):
        self.pool, self.P = pool, page_tokens
        self.budget = token_budget
        self.max_decode, self.max_prefill_rows, self.max_chunk = max_decode, max_prefill_rows, max_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.preemptions = 0
        self._preempted_now: set[int] = set()
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def new_request(self, prompt, sp, seed, on_token=None) -> Request:
        req = Request(next(self._ids), list(prompt), sp, seed, on_token)
        with self._lock:
            self.waiting.append(req)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- pages
    def _grow(self, r: Request, tokens: int) -> bool:
        """Give ``r`` a state slot and pages for ``tokens`` tokens; False (nothing allocated beyond
        what ``r`` had) if it cannot. A running request preempts requests admitted after it when
        the pool is dry (the oldest always progresses); a new one only takes free pages."""
        need = (r.slot < 0) + max(0, -(-tokens // self.P) - len(r.pages))
        while not self.pool.can_allocate(need):
            later = self.running[self.running.index(r) + 1 :] if r in self.running else []
            if not later:
                return False
            self.preempt(later[-1])
        try:
            if r.slot < 0:
                r.slot = self.pool.allocate(KDA)
            while len(r.pages) * self.P < tokens:
                r.pages.append(self.pool.allocate(MLA))
        except PoolExhausted:  # cannot happen after can_allocate; never leave a half-grown request
            return False
        return True

    def take_aborted_waiting(self) -> list[Request]:
        """Remove and return the aborted requests still waiting (wherever they are in the queue)."""
        with self._lock:
            gone = [r for r in self.waiting if r.aborted]
            self.waiting = deque(r for r in self.waiting if not r.aborted)
        return gone

    def release(self, r: Request):
        for p in r.pages + ([r.slot] if r.slot >= 0 else []):
            self.pool.decref(p)
        r.pages, r.slot, r.done = [], -1, 0
        if r in self.running:
            self.running.remove(r)

    def preempt(self, r: Request):
        """Free ``r``'s pages and queue it first; its tokens are recomputed when it is readmitted."""
        self.preemptions += 1
        self._preempted_now.add(r.rid)
        self.release(r)
        with self._lock:
            self.waiting.appendleft(r)

    # ---- planning
    def plan(self) -> StepPlan:
        self._preempted_now: set[int] = set()
        rows = []  # (is_decode, row, request, keep)
        for r in list(self.running):
            if len(rows) == self.max_decode:
                break
            if r.rid in self._preempted_now:
                continue
            if r.out and r.done == len(r.tokens) - 1 and self._grow(r, r.done + 1):
                rows.append((True, self._row(r, r.tokens[-1:]), r, True))
        budget = self.budget - len(rows)
        n_prefill = 0
        for r in self._prefill_candidates():
            if budget <= 0 or n_prefill == self.max_prefill_rows:
                self._requeue(r)
                break
            n = min(r.prefill_end - r.done, budget, self.max_chunk)
            if not self._grow(r, r.done + n):
                self._requeue(r)
                break
            if r not in self.running:
                self.running.append(r)
            rows.append((False, self._row(r, r.tokens[r.done : r.done + n]), r, r.done + n == r.prefill_end and not r.out))
            budget -= n
            n_prefill += 1
        # A request preempted while this step was planned has no pages now: its rows go.
        rows = [x for x in rows if x[2].rid not in self._preempted_now]
        return StepPlan([x[1] for x in rows if x[0]], [x[1] for x in rows if not x[0]], [x[2] for x in rows],
                        [x[3] for x in rows])

    def _requeue(self, r: Request):
        if r not in self.running:
            with self._lock:
                self.waiting.appendleft(r)

    def _prefill_candidates(self):
        """Running requests still prefilling, then waiting ones in arrival order (one preempted in
        this step waits for the next)."""
        for r in [r for r in self.running if r.done < r.prefill_end]:
            if r.rid not in self._preempted_now:
                yield r
        while True:
            with self._lock:
                if not self.waiting or self.waiting[0].rid in self._preempted_now:
                    return
                r = self.waiting.popleft()
            yield r

    def _row(self, r: Request, tokens: list[int]) -> Row:
        sp = r.sp
        return Row(tokens, r.done, list(r.pages), r.slot, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                   seed=r.seed)

    def advance(self, plan: StepPlan):
        """The step ran: every planned row's tokens are in the cache."""
        for row, r in zip(plan.decode + plan.prefill, plan.requests):
            r.done = row.start + len(row.tokens)
