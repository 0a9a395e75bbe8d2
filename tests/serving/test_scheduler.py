"""The step engine's scheduler with the prefix cache, host only (no device): which checkpoints its
chunks write, what a preemption keeps, what a request reports as cached."""

import numpy as np
import pytest

from serving.engine import SamplingParams
from serving.page_pool import PagePool
from serving.prefix_cache import CacheConfig, PrefixCache
from serving.scheduler import Scheduler

H, P = 4, 16  # hash block and page, in tokens


def _scheduler(num_pages=40, budget=64, **kw):
    pool = PagePool(num_pages, with_storage=False)
    cache = PrefixCache(CacheConfig(H, P, 1, 1, "junction+interval:16"), pool)
    return Scheduler(pool, P, token_budget=budget, max_decode=4, max_prefill_rows=4, max_chunk=budget, cache=cache,
                     **kw)


def _step(s):
    """Plan a step and land it at once, each kept row sampling token 7."""
    plan = s.plan()
    s.advance(plan)
    for r, keep in zip(plan.requests, plan.keep):
        if keep:
            r.pending -= 1
            r.out.append(7)
    s.landed()
    return plan


def _prefill(s, prompt):
    """Serve ``prompt`` alone until its prompt is in the cache, then finish it (its cache kept)."""
    r = s.new_request(prompt, SamplingParams(max_tokens=4), 0)
    s.add(r)
    while r.done < len(prompt):
        _step(s)
    s.release(r, keep=True)
    return r


@pytest.mark.parametrize("inside", [False, True])
def test_a_chunk_stops_at_the_junction_so_its_checkpoint_is_written(inside):
    """B leaves A's cached prompt at token 22: the policy keeps B's junction (20), though B's
    prompt fits one chunk whose last boundary is 28. C, sharing those 22 tokens, restores 20."""
    s = _scheduler(checkpoint_stride=H if inside else None)
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, 40).tolist()
    b, c = (a[:22] + rng.integers(0, 256, 10).tolist() for _ in range(2))
    assert [_prefill(s, p).cached for p in (a, b)] == [0, 0]
    assert _prefill(s, c).cached == 20
    s.cache.check_invariants()


def test_a_preempted_request_keeps_its_landed_checkpoints_and_reports_its_first_hit():
    """A request preempted after its generated tokens crossed a hash boundary resumes from its own
    checkpoint there (past its prompt), and still reports the prompt tokens of its first hit."""
    s = _scheduler()
    prompt = list(range(100, 106))  # 6 tokens: the 8-token boundary is in its output
    r = s.new_request(prompt, SamplingParams(max_tokens=20), 0)
    s.add(r)
    while r.done < 10:
        _step(s)
    assert r.cached == 0
    s.preempt(r)
    assert s.cache.lookup(r.hashes[:2]).tokens == 8  # its checkpoint at 8 stayed cached
    plan = _step(s)
    assert plan.prefill and plan.prefill[0].start == 8  # readmitted from it
    assert r.cached == 0  # the first admission's hit, never more than the prompt
    s.cache.check_invariants()


def test_prefill_rows_and_chunks_must_be_positive():
    with pytest.raises(ValueError, match="max_prefill_rows"):
        Scheduler(PagePool(8, with_storage=False), P, token_budget=64, max_decode=4, max_prefill_rows=0, max_chunk=64)


def test_drafts_take_only_spare_pages():
    """Scheduler alone: two requests fill a 4-page pool (a state page and one MLA page each); the
    oldest's drafts would need a third page: they are cut to what its page holds instead of
    preempting the other request."""
    pool = PagePool(4, with_storage=False)

    class Always:
        def propose(self, tokens, k):
            return [1] * k

    s = Scheduler(pool, 16, token_budget=64, max_decode=2, max_prefill_rows=2, max_chunk=64, speculative=4,
                  drafter=Always())
    a, b = (s.new_request([5] * 14, SamplingParams(max_tokens=8), 0) for _ in range(2))
    s.add(a)
    s.add(b)
    _step(s)  # both prompts
    plan = s.plan()
    assert s.preemptions == 0 and [len(row.tokens) for row in plan.decode] == [2, 2]  # 14 + 1 + 1 = one page
