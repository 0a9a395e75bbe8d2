"""The KDA segment algebra: every segment acts on the state as ``S_out = M S_in + E``.

``M [HV, K, K]`` and ``E [HV, K, V]`` depend only on the segment's own tokens, and pieces
compose associatively: ``(M2, E2) o (M1, E1) = (M2 M1, M2 E1 + E2)``. This is the math behind
segment-parallel prefill inside one device and KDA context parallelism (KCP) across devices.
The M chain stays in float32 with HIGHEST matmul precision.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.ops.kda import _einsum, check_kda_inputs, chunk_kda, combine_segments, sequence_maps

__all__ = ["apply_segment", "chunk_kda_segmented", "combine_segments", "prefix_starts", "segment_initial_states"]


def apply_segment(summary, state):
    """``M @ state + E`` for ``summary = (M, E)`` and ``state [..., HV, K, V]``."""
    M, E = summary
    return _einsum("...ij,...jv->...iv", M, state) + E


def segment_initial_states(summaries, initial_state):
    """True initial state of every segment from the earlier segments' maps (an exclusive scan).

    Args:
      summaries: ``(M [B, P, HV, K, K], E [B, P, HV, K, V])`` for P consecutive segments.
      initial_state: ``f32[B, HV, K, V]`` entering segment 0.
    Returns:
      ``f32[B, P, HV, K, V]``: the state entering each segment.
    """
    return prefix_starts(jax.lax.associative_scan(combine_segments, summaries, axis=1), initial_state)


def prefix_starts(prefix_maps, initial_state):
    """The state entering each segment from the inclusive prefix maps ``(M [B, P, HV, K, K],
    E [B, P, HV, K, V])`` (segments 0..p composed) and ``initial_state f32[B, HV, K, V]``."""
    M, E = prefix_maps
    after = apply_segment((M[:, :-1], E[:, :-1]), initial_state[:, None])
    return jnp.concatenate([initial_state[:, None], after], axis=1)


def chunk_kda_segmented(
    q, k, v, g, beta, *, num_segments: int, scale=None, initial_state=None, chunk_size: int = 64
):
    """Segment-parallel prefill: split each row into segments, summarise them in parallel,
    scan the summaries, then finish every segment from its true initial state.

    Same inputs as :func:`k3jax.ops.kda.chunk_kda` without varlen. Returns ``(o, final_state)``.
    """
    B, T, H, HV, K, V, N = check_kda_inputs(q, k, v, g, beta, initial_state, None)
    P = num_segments
    if P < 1:
        raise ValueError(f"num_segments must be >= 1, got {P}")
    L = -(-T // (P * chunk_size)) * chunk_size
    # Zero tokens (k = 0, beta = 0, g = 0) are the identity map, so padding the tail is exact.
    pad = lambda x: jnp.pad(x, [(0, 0), (0, P * L - T)] + [(0, 0)] * (x.ndim - 2)).reshape(B * P, L, *x.shape[2:])
    qs, ks, vs, gs, bs = (pad(x) for x in (q, k, v, g, beta))
    M, E = sequence_maps(ks, vs, gs, bs, chunk_size=chunk_size)
    init = jnp.zeros((B, HV, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    starts = segment_initial_states((M.reshape(B, P, HV, K, K), E.reshape(B, P, HV, K, V)), init)
    o, final = chunk_kda(
        qs, ks, vs, gs, bs, scale=scale, initial_state=starts.reshape(B * P, HV, K, V), chunk_size=chunk_size
    )
    return o.reshape(B, P * L, HV, V)[:, :T], final.reshape(B, P, HV, K, V)[:, -1]
