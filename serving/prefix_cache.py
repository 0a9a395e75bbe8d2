"""Dual-granularity prefix cache for hybrid KDA-MLA models (SERVING.md).

| | physical block | hash block | KDA checkpoint |
| --- | --- | --- | --- |
| size | ``block_tokens`` (1024-6144) | ``hash_tokens`` (512) | a sparse subset of hash endpoints |
| role | allocation unit | smallest reusable prefix | where KDA state can be restored |

Chained hashes cover everything before them, so one hash names a whole prefix. An MLA page
(one per MLA group and physical block) is registered under every complete hash block inside it,
so a partially filled page is found under its last complete hash block. A KDA checkpoint (one
page per KDA group) is registered under the hash of the boundary it restores.

Sibling pages (the MLA pages of one block across MLA groups, the KDA pages of one checkpoint
across KDA groups) form a :class:`Unit`: pinned, registered and evicted together. The three
concurrency rules:

1. ``admit`` pins every hit unit in every group before allocating anything, so an allocation
   for one group cannot evict a page another group just hit.
2. A key registered in the current step is invisible to lookups until ``end_step`` says the
   write that fills it has landed.
3. Evicting any page of a checkpoint unregisters and releases its siblings in all other KDA
   groups at once: a boundary is restorable in every group or in none.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from serving.page_pool import KDA, MLA, PagePool, PoolExhausted

POLICY_PARTS = ("turn", "junction", "dense")  # plus "interval:<hash blocks>"; combine with "+"


def chain_hashes(tokens, hash_tokens: int = 512, parent: int = 0) -> list[int]:
    """Chained 64-bit hashes of every complete ``hash_tokens`` block of ``tokens``."""
    out, h = [], parent
    arr = np.asarray(tokens, np.int64)
    for i in range(len(arr) // hash_tokens):
        d = hashlib.blake2b(h.to_bytes(8, "little") + arr[i * hash_tokens : (i + 1) * hash_tokens].tobytes(),
                            digest_size=8)
        h = int.from_bytes(d.digest(), "little")
        out.append(h)
    return out


@dataclass(frozen=True)
class CacheConfig:
    """Granularities and policy.

    Args:
      hash_tokens: tokens per hash block (the reuse unit).
      block_tokens: tokens per physical MLA block, a multiple of ``hash_tokens``.
      mla_groups, kda_groups: cache groups of each kind.
      checkpoint_policy: which hash endpoints keep a KDA checkpoint after a request moves on:
        "turn" (prompt and generation ends), "junction" (turn, plus the point where a request
        diverges from a cached prefix), "interval:N" (turn, plus every N hash blocks),
        "dense" (every hash endpoint); parts combine with "+", e.g. "junction+interval:16".
    """

    hash_tokens: int = 512
    block_tokens: int = 2048
    mla_groups: int = 1
    kda_groups: int = 1
    checkpoint_policy: str = "junction+interval:16"

    def __post_init__(self):
        if self.block_tokens % self.hash_tokens:
            raise ValueError(f"block_tokens {self.block_tokens} must be a multiple of hash_tokens {self.hash_tokens}")
        for part in self.checkpoint_policy.split("+"):
            if part not in POLICY_PARTS and not (part[:9] == "interval:" and part[9:].isdigit() and int(part[9:]) > 0):
                raise ValueError(f"unknown checkpoint_policy part {part!r}: one of {POLICY_PARTS} or 'interval:N'")

    @property
    def policy_parts(self) -> set[str]:
        return set(self.checkpoint_policy.split("+"))

    @property
    def interval(self) -> int | None:
        """Hash blocks between interval checkpoints, if the policy has one."""
        return next((int(p[9:]) for p in self.policy_parts if p.startswith("interval:")), None)

    @property
    def hashes_per_block(self) -> int:
        return self.block_tokens // self.hash_tokens


@dataclass(eq=False)
class Unit:
    """Sibling pages, one per group of one kind, that live and die together."""

    kind: str
    pages: tuple[int, ...]
    keys: list[int] = field(default_factory=list)


@dataclass
class Hit:
    """Result of a lookup: ``tokens`` reusable, served by full MLA blocks, one partially used
    block (copied, since the request writes after the hit) and a KDA checkpoint."""

    tokens: int = 0
    full_blocks: list[Unit] = field(default_factory=list)
    partial_block: Unit | None = None
    checkpoint: Unit | None = None
    mla_tokens: int = 0  # what the MLA stage alone matched


@dataclass
class Admission:
    """What the engine must do for an admitted request (device copies), and what it got."""

    num_cached_tokens: int
    slot: tuple[int, ...]  # private KDA state pages, one per KDA group
    copy_state_from: tuple[int, ...] | None  # checkpoint pages to copy into ``slot``
    copy_block_from: tuple[int, ...] | None  # MLA pages to copy into the first private block
    block_table: list[tuple[int, ...]]  # MLA pages per physical block (per MLA group)


@dataclass
class _Request:
    hashes: list[int]
    num_tokens: int
    prompt_tokens: int
    blocks: list[tuple[int, ...]]
    owned_blocks: dict[int, Unit]  # physical block index -> unit of pages this request writes
    slot: tuple[int, ...]
    done: int
    pins: list[Unit]
    keep: set[int]  # boundaries (hash blocks) whose checkpoints stay after the request moves on
    ckpts: dict[int, Unit] = field(default_factory=dict)  # checkpoints this request wrote, by boundary


class PrefixCache:
    """The dual-granularity prefix cache over a :class:`PagePool` (which it owns the eviction hook of)."""

    def __init__(self, config: CacheConfig, pool: PagePool):
        self.cfg = config
        self.pool = pool
        pool.on_evict = self._on_evict
        self.step = 0  # the step being planned: its registrations and copy pins carry this number
        self.landed = 0  # steps whose device work has finished (registrations of steps < landed are visible)
        self._mla_index: dict[int, tuple[Unit, int]] = {}  # hash -> (unit, step registered)
        self._ckpt_index: dict[int, tuple[Unit, int]] = {}
        self._unit_of: dict[int, Unit] = {}  # registered page -> unit
        self._reqs: dict[object, _Request] = {}
        self._step_pins: dict[int, list[Unit]] = {}  # step -> copy sources pinned until it lands
        self._num_ckpts = 0
        self.metrics = {"queries": 0, "query_tokens": 0, "hit_tokens": 0, "lost_tokens": 0, "checkpoints_written": 0}

    # ---- lookup
    def _visible(self, index, key):
        e = index.get(key)
        return e[0] if e is not None and e[1] < self.landed else None

    def lookup(self, hashes: list[int]) -> Hit:
        """Two-stage lookup: MLA (full blocks, then endpoints inside the first incomplete block),
        then the longest of those boundaries with a checkpoint in every KDA group."""
        r = self.cfg.hashes_per_block
        units: list[Unit] = []
        mla = 0
        j = 0
        while True:
            full = (j + 1) * r - 1
            u = self._visible(self._mla_index, hashes[full]) if full < len(hashes) else None
            if u is not None:
                units.append(u)
                mla = (j + 1) * r
                j += 1
                continue
            for m in range(min(r - 1, len(hashes) - j * r), 0, -1):
                u = self._visible(self._mla_index, hashes[j * r + m - 1])
                if u is not None:
                    units.append(u)
                    mla = j * r + m
                    break
            break
        hit = Hit(mla_tokens=mla * self.cfg.hash_tokens)
        for b in range(mla, 0, -1):
            ck = self._visible(self._ckpt_index, hashes[b - 1])
            if ck is not None:
                hit.tokens = b * self.cfg.hash_tokens
                hit.checkpoint = ck
                hit.full_blocks = units[: b // r]
                hit.partial_block = units[b // r] if b % r else None
                break
        return hit

    # ---- pins
    def _pin(self, unit: Unit):
        for p in unit.pages:
            self.pool.incref(p)

    def _unpin(self, unit: Unit):
        for p in unit.pages:
            self.pool.decref(p)

    def _alloc_unit(self, kind: str, n: int) -> Unit:
        pages = []
        try:
            for _ in range(n):
                pages.append(self.pool.allocate(kind))
        except PoolExhausted:
            for p in pages:
                self.pool.decref(p)
            raise
        return Unit(kind, tuple(pages))

    # ---- request life cycle
    def admit(self, req_id, hashes: list[int], num_tokens: int) -> Admission:
        """Look up, pin the hit (rule 1), then allocate the private slot and the prompt's blocks.

        Args:
          req_id: any hashable id; hashes: chain hashes of the prompt's complete hash blocks;
          num_tokens: prompt length. At least the last prompt token is always recomputed.
        Raises:
          PoolExhausted: the request cannot fit; nothing is left pinned or allocated.
        """
        if req_id in self._reqs:
            raise ValueError(f"request {req_id!r} is already admitted")
        if num_tokens <= 0:
            raise ValueError("a request needs at least one token")
        H = self.cfg.hash_tokens
        hit = self.lookup(hashes[: (num_tokens - 1) // H])
        self.metrics["queries"] += 1
        self.metrics["query_tokens"] += num_tokens
        self.metrics["hit_tokens"] += hit.tokens
        self.metrics["lost_tokens"] += hit.mla_tokens - hit.tokens
        pinned = hit.full_blocks + [u for u in (hit.partial_block, hit.checkpoint) if u is not None]
        for u in pinned:  # rule 1: before any allocation
            self._pin(u)
        n_blocks = -(-num_tokens // self.cfg.block_tokens)
        n_shared = len(hit.full_blocks)
        need = self.cfg.kda_groups + (n_blocks - n_shared) * self.cfg.mla_groups
        owned: dict[int, Unit] = {}
        slot = None
        try:
            if not self.pool.can_allocate(need):
                raise PoolExhausted(f"request needs {need} pages, {self.pool.num_free + self.pool.num_evictable} available")
            slot = self._alloc_unit(KDA, self.cfg.kda_groups)
            for j in range(n_shared, n_blocks):
                owned[j] = self._alloc_unit(MLA, self.cfg.mla_groups)
        except PoolExhausted:
            for u in list(owned.values()) + ([slot] if slot is not None else []):
                self._unpin(u)
            for u in pinned:
                self._unpin(u)
            raise
        # Copy sources stay pinned until the copies land (end_step); shared blocks until finish.
        self._step_pins.setdefault(self.step, []).extend(u for u in (hit.partial_block, hit.checkpoint) if u is not None)
        keep = set()
        if "junction" in self.cfg.policy_parts and hit.mla_tokens > hit.tokens:
            keep.add(hit.mla_tokens // H)
        req = _Request(
            hashes=list(hashes), num_tokens=num_tokens, prompt_tokens=num_tokens,
            blocks=[u.pages for u in hit.full_blocks] + [owned[j].pages for j in range(n_shared, n_blocks)],
            owned_blocks=owned, slot=slot.pages, done=hit.tokens, pins=list(hit.full_blocks), keep=keep,
        )
        self._reqs[req_id] = req
        return Admission(
            num_cached_tokens=hit.tokens, slot=slot.pages,
            copy_state_from=hit.checkpoint.pages if hit.checkpoint else None,
            copy_block_from=hit.partial_block.pages if hit.partial_block else None,
            block_table=list(req.blocks),
        )

    def first_kept(self, req_id, start: int, end: int) -> int | None:
        """The first hash boundary strictly inside tokens ``(start, end)`` that the request's
        junction or the interval keeps (in tokens; None: none): an engine that writes one
        checkpoint a row ends the row's chunk there, so that the boundary gets its checkpoint."""
        req, H, n = self._reqs[req_id], self.cfg.hash_tokens, self.cfg.interval
        kept = [b for b in req.keep if start < b * H < end]
        if n:
            b = (start // H // n + 1) * n  # the first interval boundary after start
            kept += [b] if b * H < end else []
        return min(kept) * H if kept else None

    def _keeps(self, req: _Request, b: int) -> bool:
        # The prompt-end checkpoint sits before the prompt's last token: a resend of the same
        # prompt must recompute at least that token to get its logits.
        if "dense" in self.cfg.policy_parts or b in req.keep or b == (req.prompt_tokens - 1) // self.cfg.hash_tokens:
            return True
        return self.cfg.interval is not None and b % self.cfg.interval == 0

    def extend(self, req_id, hashes: list[int], num_tokens: int):
        """Grow a request (generated tokens): new chain hashes and the new total length."""
        req = self._reqs[req_id]
        req.hashes = list(hashes)
        n_blocks = -(-num_tokens // self.cfg.block_tokens)
        for j in range(len(req.blocks), n_blocks):
            u = self._alloc_unit(MLA, self.cfg.mla_groups)
            req.owned_blocks[j] = u
            req.blocks.append(u.pages)
        req.num_tokens = num_tokens

    def on_forward(self, req_id, done: int, *, only: int | None = None,
                   checkpoint: bool = True) -> list[tuple[int, tuple[int, ...]]]:
        """Tokens ``[req.done, done)`` were computed in this step: register the MLA endpoints they
        complete and allocate checkpoints for the hash boundaries crossed.

        Returns ``[(boundary_tokens, kda_pages)]``: the engine writes the state at each boundary
        into those pages (the prefill kernel emits them without a second pass). The newest
        boundary is always written (intermediate, reclaimed when superseded unless the policy
        keeps it); with ``only`` just the boundary at that many tokens, if it is one these tokens
        cross (an engine that writes one state a row: after it, or inside it); with
        ``checkpoint=False`` none (no page to spare). Raises PoolExhausted if a checkpoint cannot
        be allocated (nothing changes).
        """
        req = self._reqs[req_id]
        H, r = self.cfg.hash_tokens, self.cfg.hashes_per_block
        if not req.done <= done <= req.num_tokens:
            raise ValueError(f"done={done} outside [{req.done}, {req.num_tokens}]")
        first, last = req.done // H + 1, min(done // H, len(req.hashes))
        if only is not None:
            new = [only // H] if checkpoint and only % H == 0 and first <= only // H <= last else []
        else:
            new = [b for b in range(first, last + 1) if (self._keeps(req, b) or b == last) and checkpoint]
        units = []
        try:
            for _ in new:
                units.append(self._alloc_unit(KDA, self.cfg.kda_groups))
        except PoolExhausted:
            for u in units:
                self._unpin(u)
            raise
        for b in range(first, last + 1):  # MLA endpoints now complete
            owner = req.owned_blocks.get((b - 1) // r)
            if owner is not None:
                self._register(self._mla_index, owner, req.hashes[b - 1])
        writes = []
        for b, u in zip(new, units):
            self._register(self._ckpt_index, u, req.hashes[b - 1])
            self.metrics["checkpoints_written"] += 1
            writes.append((b * H, u.pages))
            for old_b in [ob for ob in req.ckpts if not self._keeps(req, ob)]:
                self._drop(req.ckpts.pop(old_b))
            req.ckpts[b] = u
        req.done = done
        return writes

    def finish(self, req_id):
        """Release a finished request: its registered pages become evictable cache entries and
        its checkpoints at turn boundaries (prompt end, generation end) stay."""
        req = self._reqs.pop(req_id)
        gen_end = max(req.ckpts, default=None)
        for b, u in req.ckpts.items():
            if self._keeps(req, b) or b == gen_end:
                self._unpin(u)  # stays registered, now owned by the cache
            else:
                self._drop(u)
        self._release_blocks(req)

    def abort(self, req_id):
        """Drop a request that will not finish (or is preempted): its unlanded registrations are
        withdrawn; its landed checkpoints stay cached, so a preempted request resumes from them."""
        req = self._reqs.pop(req_id)
        for u in req.ckpts.values():
            landed = u.keys and all(self._ckpt_index.get(k, (None, self.landed))[1] < self.landed for k in u.keys)
            (self._unpin if landed else self._drop)(u)
        for u in req.owned_blocks.values():
            if any(self._mla_index.get(k, (None, -1))[1] >= self.landed for k in u.keys):
                self._unregister(u)
        self._release_blocks(req)

    def _release_blocks(self, req: _Request):
        for u in req.pins:
            self._unpin(u)
        for u in req.owned_blocks.values():
            self._unpin(u)
        for p in req.slot:
            self.pool.decref(p)

    def begin_step(self):
        """The step being planned was dispatched; what is planned next belongs to the next step
        (an engine that plans step N + 1 before step N has landed calls this after each plan)."""
        self.step += 1

    def end_step(self):
        """The oldest step in flight has landed: its registrations become matchable (rule 2) and
        its copy sources are unpinned. An engine that waits for each step before planning the
        next may call only this, once per step (as ``serving.Engine`` does)."""
        for u in self._step_pins.pop(self.landed, []):
            self._unpin(u)
        self.landed += 1
        self.step = max(self.step, self.landed)

    def end_all_steps(self):
        """No step is in flight any more (the engine dropped a failed one): land them all."""
        while self.landed < self.step:
            self.end_step()

    # ---- registration and eviction
    def _register(self, index, unit: Unit, key: int):
        if key in index:  # another request already cached this prefix; keep the first copy
            return
        index[key] = (unit, self.step)
        if unit.kind == KDA and not unit.keys:
            self._num_ckpts += 1
        unit.keys.append(key)
        for p in unit.pages:
            self._unit_of[p] = unit
            self.pool.set_cached(p, True)

    def _unregister(self, unit: Unit):
        index = self._mla_index if unit.kind == MLA else self._ckpt_index
        if unit.kind == KDA and unit.keys:
            self._num_ckpts -= 1
        for k in unit.keys:
            if index.get(k, (None,))[0] is unit:
                del index[k]
        unit.keys = []
        for p in unit.pages:
            if self._unit_of.get(p) is unit:
                del self._unit_of[p]
            self.pool.set_cached(p, False)

    def _drop(self, unit: Unit):
        """Unregister a unit this request holds and drop the request's reference."""
        self._unregister(unit)
        self._unpin(unit)

    def _on_evict(self, page: int):
        unit = self._unit_of.get(page)
        if unit is not None:
            self._unregister(unit)  # rule 3: siblings in every group go with it

    # ---- introspection
    def num_checkpoints(self) -> int:
        """KDA checkpoints (boundaries) currently registered."""
        return self._num_ckpts

    def request_blocks(self, req_id) -> list[tuple[int, ...]]:
        return list(self._reqs[req_id].blocks)

    def check_invariants(self):
        """Assert the cache's structural invariants (used by tests)."""
        pool = self.pool
        assert (pool.refcount >= 0).all()
        assert pool.num_free + int(sum(k != "free" for k in pool.kind)) == pool.num_pages
        assert len(set(pool._free)) == len(pool._free), "a page is on the free list twice"
        for index, kind, n in ((self._mla_index, MLA, self.cfg.mla_groups), (self._ckpt_index, KDA, self.cfg.kda_groups)):
            for key, (u, _) in index.items():
                assert len(u.pages) == n
                for p in u.pages:  # restorable in every group or in none
                    assert pool.kind[p] == kind and pool.cached[p], f"{kind} key {key:x}: page {p} is not a live cached page"
        for p in pool._lru:
            assert pool.refcount[p] == 0 and pool.cached[p]
        assert self._num_ckpts == len({id(u) for u, _ in self._ckpt_index.values()})
