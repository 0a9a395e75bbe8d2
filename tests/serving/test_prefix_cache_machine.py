"""A hypothesis state machine over admit / forward / end_step / finish / abort / evict.

A shadow "device" records what each page holds once the step that writes it lands, so the
machine can check that a hit never serves bytes that were not written for that prefix.
"""

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from serving.page_pool import KDA, PagePool, PoolExhausted
from serving.prefix_cache import CacheConfig, PrefixCache, chain_hashes

H = 512
# A few token families sharing prefixes, so hits happen.
BASES = [np.random.default_rng(s).integers(0, 1000, 6 * H) for s in range(3)]


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = PagePool(32, with_storage=False)
        self.cache = PrefixCache(CacheConfig(block_tokens=1024, mla_groups=2, kda_groups=2), self.pool)
        evict = self.pool.on_evict

        def checked_evict(page):
            assert self.pool.refcount[page] == 0, "a pinned page was evicted"
            evict(page)

        self.pool.on_evict = checked_evict
        self.reqs = {}  # id -> (hashes, n_tokens, done)
        self.next_id = 0
        self.pending = []  # shadow writes that land at end_step
        self.shadow = {}  # page -> what it holds: ("mla", block index, tuple of hashes) or ("kda", hash)
        self.extra = []  # pages held outside the cache (eviction pressure)

    @rule(base=st.integers(0, 1), keep=st.sampled_from([300, 700, 1100, 1600, 2100, 2600, 3072]), tail=st.integers(0, 700),
          seed=st.integers(0, 3))
    def admit(self, base, keep, tail, seed):
        toks = np.concatenate([BASES[base][:keep], np.random.default_rng(seed).integers(1000, 2000, tail)])
        hashes = chain_hashes(toks, H)
        rid = self.next_id
        self.next_id += 1
        try:
            adm = self.cache.admit(rid, hashes, len(toks))
        except PoolExhausted:
            return
        b = adm.num_cached_tokens // H
        assert adm.num_cached_tokens < len(toks) and adm.num_cached_tokens % H == 0
        if b:
            # The checkpoint restores exactly this prefix, in every KDA group.
            for p in adm.copy_state_from:
                assert self.shadow.get(p) == ("kda", hashes[b - 1]), "hit served bytes not written for this prefix"
            r = 2
            for j, pages in enumerate(adm.block_table[: b // r]):
                for p in pages:
                    assert self.shadow.get(p) == ("mla", j, tuple(hashes[j * r : (j + 1) * r]))
            if adm.copy_block_from:
                j = b // r
                for p in adm.copy_block_from:
                    kind, jj, held = self.shadow.get(p)
                    assert jj == j and held[: b % r] == tuple(hashes[j * r : b])
        self.reqs[rid] = [hashes, len(toks), adm.num_cached_tokens, adm]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), frac=st.floats(0.1, 1.0))
    def forward(self, data, frac):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        hashes, n, done, adm = self.reqs[rid]
        new_done = min(n, max(done + 1, int(done + frac * (n - done))))
        try:
            writes = self.cache.on_forward(rid, new_done)
        except PoolExhausted:
            return
        for tok, pages in writes:
            for p in pages:
                self.pending.append((p, ("kda", hashes[tok // H - 1])))
        blocks = self.cache.request_blocks(rid)
        for j in range(done // 1024, -(-new_done // 1024)):
            held = tuple(hashes[j * 2 : min((j + 1) * 2, new_done // H)])
            for p in blocks[j]:
                if self.shadow.get(p, (None, None, ()))[:2] != ("mla", j) or len(self.shadow[p][2]) < len(held):
                    self.pending.append((p, ("mla", j, held)))
        self.reqs[rid][2] = new_done

    @rule()
    def end_step(self):
        for p, content in self.pending:
            self.shadow[p] = content
        self.pending = []
        self.cache.end_step()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), abort=st.booleans())
    def finish(self, data, abort):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        del self.reqs[rid]
        (self.cache.abort if abort else self.cache.finish)(rid)

    @rule(n=st.integers(1, 4))
    def pressure(self, n):
        for _ in range(n):
            try:
                self.extra.append(self.pool.allocate(KDA))
            except PoolExhausted:
                break

    @precondition(lambda self: self.extra)
    @rule()
    def relieve(self):
        while self.extra:
            p = self.extra.pop()
            self.pool.decref(p)
            self.shadow.pop(p, None)

    @invariant()
    def structure(self):
        self.cache.check_invariants()
        # Freed pages forget their content (the shadow of a recycled page is rewritten first).
        for p, kind in enumerate(self.pool.kind):
            if kind == "free":
                self.shadow.pop(p, None)


CacheMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=50, deadline=None)
TestCacheMachine = CacheMachine.TestCase
