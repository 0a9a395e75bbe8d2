"""Session affinity for the HTTP router: which backend serves a request (no JAX, no I/O).

A request's *session* is what its prefix cache follows:

- an explicit session id (the router takes the ``X-Session-Id`` header or the body's ``user``)
  is sticky for as long as its backend is healthy;
- without one, the session is derived from the prompt (:meth:`Affinity.prompt_session`): a
  prompt that *continues* an earlier one (starts with all of it, checked by hash) joins that
  prompt's session; any other prompt starts a new one. Sharing the first blocks (a system
  prompt) is not continuing, and an earlier prompt that was already continued once is a branch
  point, not a conversation: a second, different prompt that starts with it starts a new session
  (so a prefix warm-up request does not pull every conversation after it onto one backend). The
  router keys chat requests on their opening messages instead (see ``http_router``).

A new session goes to the first backend, among those that were sent the longest prefix of its
prompt (a system prompt, a shared document) and then in its rendezvous ranking (the top of which
is stable as the fleet changes), that is under two bounds: fewer than ``ceil(c * average)``
sessions, and outstanding work (the estimated tokens, prompt plus ``max_tokens``, of its in-flight
requests) at most ``c`` times the average counting this request; when every backend is over, the
least loaded. So a prefix every request shares spreads as the session bound fills, and then
every backend has it. A derived session also leaves a backend whose outstanding work is over
``c`` times the average by more than ``slack`` requests' worth, for the least loaded one (many
clients sending one identical prompt must not pile onto one backend); an explicit one never
does. When a backend fails, each of its sessions goes to its next choice when it next arrives;
when the backend returns, they stay (no flapping).

State is bounded: sessions, indexed prompts and remembered prompt blocks are dropped least
recently used beyond ``max_sessions`` / ``max_prompts`` / ``max_blocks`` entries and after ``ttl_s``
without a request.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

from serving.fleet.routing import _score


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def prompt_units(prompt) -> str | list[int]:
    """What a completion prompt is compared by: its text, its token ids, or (a batch of prompts,
    or anything else) its JSON text."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return json.dumps(prompt, sort_keys=True)


def _encode(units) -> bytes:
    if isinstance(units, str):
        return units.encode("utf-8", "surrogatepass")
    return b",".join(str(t).encode() for t in units)


@dataclass
class _Session:
    backend: str
    explicit: bool
    last: float


class _Slot:
    """Indexed prompts whose last full block is the same: ``(length, hash) -> [session, continued]``."""

    __slots__ = ("last", "entries", "lengths")

    def __init__(self):
        self.last = 0.0
        self.entries: OrderedDict[tuple[int, bytes], list] = OrderedDict()
        self.lengths: dict[int, int] = {}  # length -> entries of that length

    def add(self, key, entry):
        self.entries[key] = entry
        self.lengths[key[0]] = self.lengths.get(key[0], 0) + 1

    def pop_oldest(self):
        (n, _), _ = self.entries.popitem(last=False)
        self.lengths[n] -= 1
        if not self.lengths[n]:
            del self.lengths[n]


class Affinity:
    """Routing state: sessions, an index of recent prompts, outstanding work per backend.

    Args:
      backends: backend names. c: load bound factor (>= 1). slack: requests' worth of work a
        derived session's backend may be over the bound before the session moves.
      block: prompt units (characters or token ids) per hash block of the prompt index.
      max_sessions, max_prompts, max_blocks, ttl_s: state bounds (sessions, indexed prompts, prompt
        blocks remembered per backend; entries unused for ``ttl_s`` go). clock: seconds (monotonic).
    """

    PER_BLOCK = 1024  # indexed prompts kept per last full block (the newest)

    def __init__(self, backends, *, c: float = 1.25, slack: float = 2.0, block: int = 64, max_sessions: int = 65536,
                 max_prompts: int = 65536, max_blocks: int = 65536, ttl_s: float = 3600.0, clock=time.monotonic):
        if c < 1:
            raise ValueError(f"load bound c must be >= 1, got {c}")
        if min(block, max_sessions, max_prompts, max_blocks) < 1 or ttl_s <= 0:
            raise ValueError("block, max_sessions, max_prompts, max_blocks and ttl_s must be positive")
        self.backends = list(dict.fromkeys(backends))
        self.healthy = set(self.backends)
        self.c, self.slack, self.block = c, slack, block
        self.max_sessions, self.max_prompts, self.max_blocks = max_sessions, max_prompts, max_blocks
        self.ttl_s, self.clock = ttl_s, clock
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self.count = dict.fromkeys(self.backends, 0)  # sessions per backend
        self.inflight = dict.fromkeys(self.backends, 0)  # requests per backend
        self.work = dict.fromkeys(self.backends, 0)  # estimated tokens of the in-flight requests
        # the chain hash of a prompt's last full block -> the prompts indexed under it
        self.prompts: OrderedDict[bytes, _Slot] = OrderedDict()
        self.num_prompts = 0
        # the chain hash of a prompt block -> {backend: last time it was sent there}
        self.held: OrderedDict[bytes, dict[str, float]] = OrderedDict()
        self.moved_for_load = 0

    # ---- sessions from prompts
    def _chain(self, data: str | list[int]) -> list[bytes]:
        """``chain[j]``: the hash of the first ``j`` blocks (each covers everything before it)."""
        out = [b"\x00" * 16]
        for j in range(len(data) // self.block):
            out.append(_h(out[-1] + b"\x00" + _encode(data[j * self.block : (j + 1) * self.block])))
        return out

    def _exact(self, chain: list[bytes], data, length: int) -> bytes:
        """The hash of ``data[:length]``."""
        j = length // self.block
        return _h(chain[j] + b"\x01" + _encode(data[j * self.block : length]))

    def blocks(self, prompt) -> list[bytes]:
        """The chain hashes of a prompt's full blocks (for :meth:`route`'s ``blocks``)."""
        return self._chain(prompt_units(prompt))[1:]

    def prompt_session(self, prompt) -> str:
        """The session of a prompt sent without a session id (text, token ids or anything JSON);
        the prompt is indexed for the requests after it."""
        return self.prompt_key(prompt)[0]

    def prompt_key(self, prompt) -> tuple[str, list[bytes]]:
        """:meth:`prompt_session` and :meth:`blocks` of a prompt, hashed once."""
        data = prompt_units(prompt)
        now = self.clock()
        chain = self._chain(data)
        n = len(data)
        session = None
        for j in range(len(chain) - 1, -1, -1):  # the longest indexed prompt this one starts with
            slot = self.prompts.get(chain[j])
            if slot is None:
                continue
            hit = next(((L, e) for L in sorted(slot.lengths, reverse=True) if L <= n
                        and (e := slot.entries.get((L, self._exact(chain, data, L)))) is not None), None)
            if hit is None:
                continue
            slot.last = now
            self.prompts.move_to_end(chain[j])
            L, e = hit
            if L == n:  # the same prompt again
                session = e[0]
            elif not e[1]:  # the next turn of that prompt's conversation
                e[1] = True
                session = e[0]
            break  # a prompt that was already continued differently is a branch point: a new session
        full = self._exact(chain, data, n)
        session = session or "p" + full.hex()
        self._index(chain[n // self.block], n, full, session, now)
        return session, chain[1:]

    def _index(self, key: bytes, n: int, full: bytes, session: str, now: float):
        slot = self.prompts.get(key)
        if slot is None:
            slot = self.prompts[key] = _Slot()
        self.prompts.move_to_end(key)
        slot.last = now
        if (n, full) not in slot.entries:
            slot.add((n, full), [session, False])
            self.num_prompts += 1
            if len(slot.entries) > self.PER_BLOCK:
                slot.pop_oldest()
                self.num_prompts -= 1
        self._prune(now)

    # ---- placement
    def ranking(self, session: str) -> list[str]:
        """All backends, best first (rendezvous hashing)."""
        return sorted(self.backends, key=lambda b: _score(session, b), reverse=True)

    def _work_bound(self, up: list[str], cost: float) -> float:
        return self.c * (sum(self.work[b] for b in up) + cost) / len(up)

    def _overloaded(self, backend: str, up: list[str], cost: float) -> bool:
        reqs = sum(self.inflight[b] for b in up)
        mean_cost = sum(self.work[b] for b in up) / reqs if reqs else cost
        return self.work[backend] > self._work_bound(up, cost) + self.slack * max(mean_cost, cost)

    def _held_depth(self, blocks: list[bytes]) -> dict[str, int]:
        """Per healthy backend, how many leading blocks of this prompt were sent to it."""
        depth: dict[str, int] = {}
        for j in range(len(blocks) - 1, -1, -1):
            holders = self.held.get(blocks[j])
            if holders:
                for b in holders:
                    if b in self.healthy and b not in depth:
                        depth[b] = j + 1
                if len(depth) == len(self.healthy):
                    break
        return depth

    def _hold(self, blocks: list[bytes], backend: str, now: float):
        for h in blocks:
            holders = self.held.get(h)
            if holders is None:
                holders = self.held[h] = {}
            else:
                self.held.move_to_end(h)
            holders[backend] = now
        while len(self.held) > self.max_blocks:
            self.held.popitem(last=False)

    def route(self, session: str, *, explicit: bool = False, cost: float = 1.0, blocks: list[bytes] = ()) -> str:
        """The backend for this session's next request (``cost``: its estimated tokens; ``blocks``:
        its prompt's :meth:`blocks`, so a new session prefers backends that have its prefix)."""
        target = self._route(session, explicit, cost, blocks)
        if blocks:
            self._hold(blocks, target, self.clock())
        return target

    def _route(self, session: str, explicit: bool, cost: float, blocks) -> str:
        now = self.clock()
        self._prune(now)
        up = [b for b in self.backends if b in self.healthy]
        if not up:
            raise RuntimeError("no healthy backend")
        s = self.sessions.get(session)
        if s is not None and s.backend in self.healthy and (
                s.explicit or explicit or not self._overloaded(s.backend, up, cost)):
            s.last, s.explicit = now, s.explicit or explicit
            self.sessions.move_to_end(session)
            return s.backend
        old = None
        if s is not None:
            old = s.backend if s.backend in self.healthy else None
            self._drop(session)
        cap = math.ceil(self.c * (sum(self.count[b] for b in up) + 1) / len(up))
        bound = self._work_bound(up, cost)
        ranked = [b for b in self.ranking(session) if b in self.healthy]
        if blocks:  # backends that have more of the prompt first (sorted is stable: the ranking breaks ties)
            depth = self._held_depth(blocks)
            ranked.sort(key=lambda b: -depth.get(b, 0))
        least = lambda: min(ranked, key=lambda b: (self.work[b], self.count[b]))  # stable: ranking breaks ties
        if old is not None:  # moved off an overloaded backend: to the least loaded
            target = least()
            self.moved_for_load += target != old
        else:
            target = next((b for b in ranked if self.count[b] < cap and self.work[b] <= bound), None) or least()
        self.sessions[session] = _Session(target, explicit, now)
        self.count[target] += 1
        return target

    def begin(self, backend: str, cost: float):
        """A request was sent to ``backend``."""
        self.inflight[backend] += 1
        self.work[backend] += cost

    def end(self, backend: str, cost: float):
        """That request finished (answered, failed or abandoned)."""
        self.inflight[backend] -= 1
        self.work[backend] -= cost

    def fail(self, backend: str):
        self.healthy.discard(backend)

    def recover(self, backend: str):
        if backend in self.count:
            self.healthy.add(backend)

    # ---- bounds
    def _drop(self, session: str):
        s = self.sessions.pop(session)
        self.count[s.backend] -= 1

    def _prune(self, now: float):
        old = now - self.ttl_s
        while self.sessions:
            key, s = next(iter(self.sessions.items()))
            if len(self.sessions) <= self.max_sessions and s.last >= old:
                break
            self._drop(key)
        while self.prompts:
            slot = next(iter(self.prompts.values()))
            if self.num_prompts <= self.max_prompts and slot.last >= old:
                break
            self.num_prompts -= len(self.prompts.popitem(last=False)[1].entries)
        while self.held:
            holders = next(iter(self.held.values()))
            if len(self.held) <= self.max_blocks and max(holders.values()) >= old:
                break
            self.held.popitem(last=False)
