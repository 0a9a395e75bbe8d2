"""Scenario tests for the dual-granularity prefix cache and its three concurrency rules."""

import numpy as np
import pytest

from serving.page_pool import KDA, PagePool, PoolExhausted
from serving.prefix_cache import CacheConfig, PrefixCache, chain_hashes


def tokens(seed, n):
    return np.random.default_rng(seed).integers(0, 50000, n)


def make(num_pages=64, checkpoint_policy="turn", **cfg):
    pool = PagePool(num_pages, with_storage=False)
    return PrefixCache(CacheConfig(checkpoint_policy=checkpoint_policy, **cfg), pool), pool


def run_request(cache, rid, toks, *, total=None):
    """Admit, prefill the prompt in one step, optionally generate to ``total`` tokens, finish."""
    adm = cache.admit(rid, chain_hashes(toks), len(toks))
    cache.on_forward(rid, len(toks))
    cache.end_step()
    if total is not None:
        full = np.concatenate([toks, tokens(hash(rid) % 1000, total - len(toks))])
        cache.extend(rid, chain_hashes(full), total)
        cache.on_forward(rid, total)
        cache.end_step()
        toks = full
    cache.finish(rid)
    cache.check_invariants()
    return adm, toks


def test_design_example_hits_at_2560_inside_a_6144_block():
    cache, _ = make(block_tokens=6144)
    _, conv = run_request(cache, "turn1", tokens(0, 2600), total=3000)
    new = np.concatenate([conv[:2800], tokens(1, 1200)])
    adm = cache.admit("other", chain_hashes(new), len(new))
    assert adm.num_cached_tokens == 2560
    assert adm.copy_state_from is not None and adm.copy_block_from is not None  # partial block copied


def test_second_turn_resumes_at_the_generation_end():
    cache, _ = make(block_tokens=2048)
    _, conv = run_request(cache, "t1", tokens(2, 1800), total=2300)
    turn2 = np.concatenate([conv, tokens(3, 500)])
    adm = cache.admit("t2", chain_hashes(turn2), len(turn2))
    assert adm.num_cached_tokens == 2048  # the last 512 boundary crossed while generating
    assert len(adm.block_table) == 2


def test_prompt_shorter_than_a_block_is_reusable():
    cache, _ = make(block_tokens=4096)
    run_request(cache, "a", tokens(4, 1500))
    again = np.concatenate([tokens(4, 1500), tokens(5, 100)])
    adm = cache.admit("b", chain_hashes(again), len(again))
    assert adm.num_cached_tokens == 1024  # partially filled page, registered under its last hash block


def test_exact_multiple_prompt_lengths():
    cache, _ = make(block_tokens=1024)
    run_request(cache, "a", tokens(6, 2048))
    same = cache.admit("same", chain_hashes(tokens(6, 2048)), 2048)
    assert same.num_cached_tokens == 1536  # the last token is always recomputed
    cache.abort("same")
    cache.end_step()
    longer = np.concatenate([tokens(6, 2048), tokens(7, 10)])
    adm = cache.admit("longer", chain_hashes(longer), len(longer))
    assert adm.num_cached_tokens == 2048
    assert adm.copy_block_from is None and len(adm.block_table) == 3


def test_missing_checkpoint_costs_tokens_and_junction_policy_recovers_them():
    for policy, expect in (("turn", 0), ("junction", 2560)):
        cache, _ = make(block_tokens=2048, checkpoint_policy=policy)
        base = tokens(8, 4096)
        run_request(cache, "a", base)
        run_request(cache, "b", np.concatenate([base[:2800], tokens(9, 700)]))
        adm = cache.admit("c", chain_hashes(np.concatenate([base[:2800], tokens(10, 900)])), 3700)
        assert adm.num_cached_tokens == expect, policy
        if policy == "turn":
            assert cache.metrics["lost_tokens"] >= 2 * 2560


def test_rule1_hit_is_pinned_before_allocation():
    cache, pool = make(num_pages=8, block_tokens=1024, kda_groups=2)
    a = tokens(11, 1100)
    run_request(cache, "a", a)  # caches block 0 and a checkpoint at 1024: 3 pages, oldest in LRU
    run_request(cache, "c", tokens(12, 600))  # 3 more cached pages, more recent
    assert pool.num_free == 2 and pool.num_evictable == 6
    b = np.concatenate([a[:1024], tokens(13, 476)])
    adm = cache.admit("b", chain_hashes(b), len(b))  # needs 3 pages: 2 free + 1 eviction
    assert adm.num_cached_tokens == 1024
    for p in adm.copy_state_from + adm.block_table[0]:
        assert pool.cached[p] and pool.refcount[p] > 0, "a hit page was evicted by the request's own allocation"
    cache.check_invariants()


def test_rule2_unlanded_blocks_are_not_matchable():
    cache, _ = make(block_tokens=1024)
    p = tokens(14, 1500)
    cache.admit("a", chain_hashes(p), len(p))
    cache.on_forward("a", len(p))
    same_step = cache.admit("b", chain_hashes(p), len(p))
    assert same_step.num_cached_tokens == 0
    cache.end_step()
    later = cache.admit("c", chain_hashes(p), len(p))
    assert later.num_cached_tokens == 1024


def test_rule3_evicting_one_group_drops_the_boundary_everywhere():
    cache, pool = make(num_pages=8, block_tokens=1024, kda_groups=3)
    p = tokens(15, 1100)
    run_request(cache, "a", p)  # block 0 (1 page) + checkpoint (3 pages) cached; 4 free
    ck = cache.lookup(chain_hashes(p)).checkpoint
    assert ck is not None and len(ck.pages) == 3
    for _ in range(4):
        pool.allocate(KDA)
    pool.allocate(KDA)  # evicts the LRU page: the checkpoint's first page (kept before block 0 was released)
    cache.check_invariants()
    assert cache.num_checkpoints() == 0
    assert all(pool.kind[q] in ("free", KDA) for q in ck.pages)
    assert sum(pool.kind[q] == "free" for q in ck.pages) == 2  # the siblings were released


def test_pool_too_small_is_reported_and_leaves_nothing_behind():
    cache, pool = make(num_pages=4, block_tokens=1024, kda_groups=2)
    with pytest.raises(PoolExhausted):
        cache.admit("huge", chain_hashes(tokens(16, 5000)), 5000)
    assert pool.num_free == 4
    cache.check_invariants()


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="multiple"):
        CacheConfig(block_tokens=1000)
    with pytest.raises(ValueError, match="checkpoint_policy"):
        CacheConfig(checkpoint_policy="sometimes")
