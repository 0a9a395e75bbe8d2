"""Short causal conv: full sequence, rolling step, and the ring used for speculative rollback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3jax.ops import conv
from tests.helpers import random_cu_seqlens


def _inputs(seed, shape):
    return jax.random.normal(jax.random.key(seed), shape)


@given(N=st.integers(1, 5), W=st.sampled_from([2, 4]), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_varlen_conv_matches_steps(N, W, bias, seed):
    T, D = 30, 6
    cu = random_cu_seqlens(np.random.default_rng(seed), T, N, pad=3)
    x = _inputs(seed, (1, T, D)).at[:, T - 3 :].set(jnp.nan)
    w, b = _inputs(seed + 1, (D, W)), (_inputs(seed + 2, (D,)) if bias else None)
    h0 = _inputs(seed + 3, (N, W - 1, D))
    y, final = conv.short_conv(x, w, bias=b, initial_state=h0, cu_seqlens=jnp.asarray(cu))
    for n in range(N):
        S = h0[n : n + 1]
        for t in range(int(cu[n]), int(cu[n + 1])):
            y_t, S = conv.short_conv_step(x[:, t], S, w, bias=b)
            np.testing.assert_allclose(np.asarray(y[:, t]), np.asarray(y_t), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(final[n]), np.asarray(S[0]))
    assert bool(jnp.all(y[:, T - 3 :] == 0))


def test_conv_matches_numpy():
    x, w = _inputs(0, (2, 9, 3)), _inputs(1, (3, 4))
    y, _ = conv.short_conv(x, w, activation=None)
    xp = np.pad(np.asarray(x, np.float64), [(0, 0), (3, 0), (0, 0)])
    ref = sum(xp[:, j : j + 9] * np.asarray(w, np.float64)[:, j] for j in range(4))
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 2, 5])
def test_ring_rollback_for_any_accept_count(T):
    B, D, W = 3, 5, 4
    h0 = _inputs(0, (B, W - 1, D))
    w = _inputs(1, (D, W))
    ring = conv.conv_ring_init(h0, T)
    committed = h0
    # Several rounds: each writes a window, accepts a random prefix per row (incl. fewer than W - 1).
    rng = np.random.default_rng(T)
    for rnd in range(4):
        x = _inputs(10 + rnd, (B, T, D))
        y, ring = conv.conv_ring_window(ring, x, w)
        y_ref, _ = conv.short_conv(x, w, initial_state=committed)
        np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
        n = rng.integers(0, T + 1, size=B)
        ring = conv.conv_ring_commit(ring, jnp.asarray(n, jnp.int32))
        for b in range(B):
            if n[b]:
                _, f = conv.short_conv(x[b : b + 1, : n[b]], w, initial_state=committed[b : b + 1])
                committed = committed.at[b].set(f[0])
        np.testing.assert_array_equal(np.asarray(conv.conv_ring_state(ring, W)), np.asarray(committed))


def test_ring_rejects_oversized_window():
    ring = conv.conv_ring_init(jnp.zeros((1, 3, 2)), 2)
    with pytest.raises(ValueError, match="capacity"):
        conv.conv_ring_window(ring, jnp.ones((1, 3, 2)), jnp.ones((2, 4)))
