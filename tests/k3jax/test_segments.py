"""The (M, E) segment algebra and the scan-based prefill built on it."""

import jax
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3jax.ops import kda, segments
from tests.helpers import assert_close, kda_inputs, random_state, rel_rms

summary = jax.jit(kda.sequence_maps, static_argnames="chunk_size")


@given(T=st.sampled_from([1, 20, 64, 100]), seed=st.integers(0, 2**16))
def test_summary_reproduces_final_state(T, seed):
    q, k, v, g, beta = kda_inputs(seed, 2, T, 1, 2, 16, 8, lower_bound=-5.0)
    h0 = random_state(seed, (2, 2, 16, 8))
    _, S_ref = kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    assert_close(segments.apply_segment(summary(k, v, g, beta), h0), S_ref, "f32_state")


def test_combine_is_associative_and_matches_sequential():
    q, k, v, g, beta = kda_inputs(1, 1, 96, 1, 1, 16, 16)
    parts = [summary(*(x[:, a : a + 32] for x in (k, v, g, beta))) for a in (0, 32, 64)]
    left = segments.combine_segments(segments.combine_segments(parts[0], parts[1]), parts[2])
    right = segments.combine_segments(parts[0], segments.combine_segments(parts[1], parts[2]))
    whole = summary(k, v, g, beta)
    for a, b in zip(left, right):
        assert_close(a, b, "f32_state")
    for a, b in zip(left, whole):
        assert_close(a, b, "f32_state")
    h0 = random_state(1, (1, 1, 16, 16))
    S = h0
    for p in parts:
        S = segments.apply_segment(p, S)
    assert_close(segments.apply_segment(left, h0), S, "f32_state")


def test_combine_order_matters():
    # A guard that the test above can fail: swapping the order gives a different map.
    q, k, v, g, beta = kda_inputs(2, 1, 64, 1, 1, 16, 16)
    a = summary(*(x[:, :32] for x in (k, v, g, beta)))
    b = summary(*(x[:, 32:] for x in (k, v, g, beta)))
    ab, ba = segments.combine_segments(a, b), segments.combine_segments(b, a)
    assert rel_rms(ab[1], ba[1]) > 1e-2


@pytest.mark.parametrize("P", [1, 2, 3, 8])
def test_segmented_prefill_matches_recurrent(P):
    q, k, v, g, beta = kda_inputs(3, 2, 203, 2, 2, 16, 16, lower_bound=-5.0)
    h0 = random_state(3, (2, 2, 16, 16))
    o_ref, S_ref = kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    segmented = jax.jit(segments.chunk_kda_segmented, static_argnames=("num_segments", "chunk_size"))
    o, S = segmented(q, k, v, g, beta, num_segments=P, initial_state=h0, chunk_size=32)
    assert_close(o, o_ref, "f32_out")
    assert_close(S, S_ref, "f32_state")


def test_sequence_maps_varlen_and_the_initial_state_hook():
    """``sequence_maps`` per packed sequence (one empty, one shorter than a chunk, NaN padding)
    reproduces each final state; ``chunk_kda(initial_state_fn=...)`` hands the maps over and runs
    from the states it returns (here: each sequence's own state after one pass from h0)."""
    import jax.numpy as jnp

    T, cu = 100, jnp.array([0, 37, 37, 45, 90], jnp.int32)
    q, k, v, g, beta = (x.at[:, 90:].set(jnp.nan) for x in kda_inputs(9, 1, T, 1, 2, 16, 8, lower_bound=-5.0))
    h0 = random_state(9, (4, 2, 16, 8))
    _, S1 = kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    maps = kda.sequence_maps(k, v, g, beta, cu_seqlens=cu, chunk_size=16)
    assert_close(segments.apply_segment(maps, h0), S1, "f32_state")
    seen = []
    hook = lambda M, E: seen.append(M.shape) or segments.apply_segment((M, E), h0)
    o, S2 = kda.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, chunk_size=16, initial_state_fn=hook)
    o_ref, S2_ref = kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=S1, cu_seqlens=cu)
    assert seen == [(4, 2, 16, 16)]
    assert_close(o[:, :90], o_ref[:, :90], "f32_out")
    assert_close(S2, S2_ref, "f32_state")
