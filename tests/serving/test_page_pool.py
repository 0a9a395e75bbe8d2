"""The unified page pool: accounting, bounds checks, write-before-read, bitcast views."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.page_pool import KDA, MLA, PagePool, PoolExhausted, PoolLayout, hybrid_groups


def test_kimi_linear_layout():
    # Kimi-Linear-48B: 20 KDA + 7 MLA layers, 32 x 128 x 128 KDA heads, kv_lora_rank 512, rope 64.
    assert hybrid_groups(20, 7) == (3, 1)
    lay = PoolLayout(layers_per_group=7, HV=32, K=128, V=128, kv_lora_rank=512, rope_dim=64)
    assert lay.block_tokens == 2048 and 1024 <= lay.block_tokens <= 6144
    assert lay.page_words >= lay.kda_page_words
    assert lay.page_words >= lay.block_tokens * lay.mla_words_per_token


def test_allocate_refcount_lru_evict():
    evicted = []
    pool = PagePool(3, with_storage=False, on_evict=evicted.append)
    a, b, c = (pool.allocate(MLA) for _ in range(3))
    with pytest.raises(PoolExhausted):
        pool.allocate(KDA)
    pool.set_cached(a, True)
    pool.set_cached(b, True)
    pool.decref(b)  # b idle first, then a: LRU order b, a
    pool.decref(a)
    pool.decref(c)  # uncached: freed at once
    assert pool.num_free == 1 and pool.num_evictable == 2
    assert pool.allocate(KDA) == c
    d = pool.allocate(KDA)  # evicts the least recently used cached page
    assert evicted == [b] and d == b and pool.kind[d] == KDA
    with pytest.raises(ValueError, match="more often"):
        pool.decref(c) or pool.decref(c)


def test_bounds_and_kinds_are_checked():
    pool = PagePool(2, 8)
    with pytest.raises(IndexError):
        pool.incref(2)
    with pytest.raises(IndexError):
        pool.copy_page(5, 0)
    p = pool.allocate(MLA)
    with pytest.raises(ValueError, match="not kda"):
        pool.write_kda_state(p, jnp.zeros((1, 1, 2, 4)))
    with pytest.raises(ValueError, match="kind"):
        pool.allocate("bogus")


def test_bitcast_views_round_trip_and_write_before_read():
    pool = PagePool(4, 64)
    k = pool.allocate(KDA)
    with pytest.raises(ValueError, match="not written"):
        pool.read_kda_state(k, (2, 1, 4, 8))
    state = jax.random.normal(jax.random.key(0), (2, 1, 4, 8))
    pool.write_kda_state(k, state)
    np.testing.assert_array_equal(np.asarray(pool.read_kda_state(k, (2, 1, 4, 8))), np.asarray(state))
    m = pool.allocate(MLA)
    kv = jax.random.normal(jax.random.key(1), (10, 6)).astype(jnp.bfloat16)
    pool.write_mla(m, kv)
    np.testing.assert_array_equal(np.asarray(pool.read_mla(m, (10, 6))), np.asarray(kv))
    slot = pool.allocate(KDA)
    pool.copy_page(k, slot)
    np.testing.assert_array_equal(np.asarray(pool.read_kda_state(slot, (2, 1, 4, 8))), np.asarray(state))
    # A recycled page must be written again before it can be read.
    pool.decref(k)
    k2 = pool.allocate(KDA)
    assert k2 == k
    with pytest.raises(ValueError, match="not written"):
        pool.read_kda_state(k2, (2, 1, 4, 8))
