"""Property tests for the pure-JAX KDA references (recurrent, chunked, checkpoints, decode)."""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from k3jax.ops import kda
from tests.helpers import assert_close, kda_inputs, random_cu_seqlens, random_state, rel_rms

naive = jax.jit(kda.naive_recurrent_kda, static_argnames=("scale", "use_qk_l2norm"))
chunk = jax.jit(kda.chunk_kda, static_argnames=("scale", "chunk_size", "checkpoint_stride", "use_qk_l2norm"))


def numpy_kda_f64(q, k, v, g, beta, scale, S):
    """Float64 NumPy recurrence for one sequence, written independently of k3jax."""
    q, k, v, g, beta, S = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, S))
    T, H = q.shape[:2]
    HV = v.shape[1]
    o = np.zeros(v.shape)
    for t in range(T):
        for h in range(HV):
            qh, kh = q[t, h // (HV // H)] * scale, k[t, h // (HV // H)]
            S[h] *= np.exp(g[t, h])[:, None]
            S[h] += np.outer(kh, beta[t, h] * (v[t, h] - kh @ S[h]))
            o[t, h] = qh @ S[h]
    return o, S


def test_naive_matches_float64_numpy():
    q, k, v, g, beta = kda_inputs(0, 1, 23, 2, 4, 8, 6)
    h0 = random_state(0, (1, 4, 8, 6))
    o, S = naive(q, k, v, g, beta, initial_state=h0)
    o_ref, S_ref = numpy_kda_f64(q[0], k[0], v[0], g[0], beta[0], 8**-0.5, h0[0])
    assert rel_rms(o[0], o_ref) < 1e-5 and rel_rms(S[0], S_ref) < 1e-5


shapes = st.tuples(
    st.integers(1, 3),  # B
    st.sampled_from([1, 15, 17, 63, 65, 130]),  # T
    st.sampled_from([(1, 1), (2, 2), (1, 2), (2, 4)]),  # (H, HV): GVA included
    st.sampled_from([(16, 16), (32, 16), (16, 32)]),  # (K, V): K != V included
)


@given(shape=shapes, chunk_size=st.sampled_from([16, 32, 64]), lb=st.sampled_from([None, -5.0]),
       with_init=st.booleans(), seed=st.integers(0, 2**16))
def test_chunk_matches_recurrent(shape, chunk_size, lb, with_init, seed):
    (B, T, (H, HV), (K, V)) = shape
    q, k, v, g, beta = kda_inputs(seed, B, T, H, HV, K, V, lower_bound=lb)
    h0 = random_state(seed, (B, HV, K, V)) if with_init else None
    o_ref, S_ref = naive(q, k, v, g, beta, initial_state=h0)
    o, S = chunk(q, k, v, g, beta, initial_state=h0, chunk_size=chunk_size)
    assert_close(o, o_ref, "f32_out")
    assert_close(S, S_ref, "f32_state")


def test_chunk_long_sequence():
    q, k, v, g, beta = kda_inputs(7, 1, 1000, 2, 2, 32, 32)
    o_ref, S_ref = naive(q, k, v, g, beta)
    o, S = chunk(q, k, v, g, beta)
    assert_close(o, o_ref, "f32_out")
    assert_close(S, S_ref, "f32_state")


@given(N=st.integers(1, 6), pad=st.sampled_from([0, 5]), chunk_size=st.sampled_from([16, 64]),
       seed=st.integers(0, 2**16))
def test_varlen_matches_separate_sequences(N, pad, chunk_size, seed):
    T, H, HV, K, V = 150, 1, 2, 16, 16
    cu = random_cu_seqlens(np.random.default_rng(seed), T, N, pad)
    q, k, v, g, beta = kda_inputs(seed, 1, T, H, HV, K, V, lower_bound=-5.0)
    # NaN-poison the padding tokens: they must not reach any real output or state.
    poison = lambda x: x.at[:, T - pad:].set(jnp.nan)
    q, k, v, g, beta = map(poison, (q, k, v, g, beta))
    h0 = random_state(seed, (N, HV, K, V))
    o, S = chunk(q, k, v, g, beta, initial_state=h0, cu_seqlens=jnp.asarray(cu), chunk_size=chunk_size)
    o_n, S_n = naive(q, k, v, g, beta, initial_state=h0, cu_seqlens=jnp.asarray(cu))
    for n in range(N):
        a, b = int(cu[n]), int(cu[n + 1])
        if b > a:
            o_ref, S_ref = naive(*(x[:, a:b] for x in (q, k, v, g, beta)), initial_state=h0[n : n + 1])
            assert_close(o[:, a:b], o_ref, "f32_out")
            assert_close(o_n[:, a:b], o_ref, "f32_out")
        else:
            S_ref = h0[n : n + 1]  # an empty sequence returns its initial state
        assert_close(S[n : n + 1], S_ref, "f32_state")
        assert_close(S_n[n : n + 1], S_ref, "f32_state")
    assert bool(jnp.all(o[:, T - pad:] == 0)) and bool(jnp.all(o_n[:, T - pad:] == 0))


@pytest.mark.parametrize("split", [1, 37, 64, 100])
def test_split_invariance(split):
    q, k, v, g, beta = kda_inputs(3, 2, 150, 2, 2, 16, 32)
    o_full, S_full = chunk(q, k, v, g, beta)
    o1, S1 = chunk(*(x[:, :split] for x in (q, k, v, g, beta)))
    o2, S2 = chunk(*(x[:, split:] for x in (q, k, v, g, beta)), initial_state=S1)
    assert_close(jnp.concatenate([o1, o2], axis=1), o_full, "f32_out")
    assert_close(S2, S_full, "f32_state")


def test_checkpoints_every_stride():
    T, stride = 300, 64
    cu = jnp.array([0, 130, 130, 140, 296], jnp.int32)
    q, k, v, g, beta = kda_inputs(4, 1, T, 1, 2, 16, 16)
    h0 = random_state(4, (4, 2, 16, 16))
    _, S, ck = chunk(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, chunk_size=32, checkpoint_stride=stride)
    chex.assert_shape(ck, (4, T // stride, 2, 16, 16))
    for n in range(4):
        a, b = int(cu[n]), int(cu[n + 1])
        for j in range(T // stride):
            if (j + 1) * stride <= b - a:
                _, S_ref = naive(*(x[:, a : a + (j + 1) * stride] for x in (q, k, v, g, beta)), initial_state=h0[n : n + 1])
                assert_close(ck[n : n + 1, j], S_ref, "f32_state")
            else:
                assert bool(jnp.all(ck[n, j] == 0))


def test_saturated_gates_stay_finite_and_exact():
    # Every gate at the K3 bound over several chunks: 64-token chunks span 320 nats.
    q, k, v, _, beta = kda_inputs(5, 1, 256, 2, 2, 32, 32)
    g = jnp.full((1, 256, 2, 32), -5.0)
    o_ref, S_ref = naive(q, k, v, g, beta)
    for C in (16, 32, 64):
        o, S = chunk(q, k, v, g, beta, chunk_size=C)
        assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(S)))
        assert_close(o, o_ref, "f32_out")


def test_unbounded_gates_stay_finite():
    # The softplus gate has no lower bound: very negative gates inside one sub-chunk.
    q, k, v, g, beta = kda_inputs(6, 1, 128, 1, 1, 16, 16, gate_scale=30.0)
    assert float(g.min()) < -50
    o_ref, S_ref = naive(q, k, v, g, beta)
    o, S = chunk(q, k, v, g, beta)
    assert_close(o, o_ref, "f32_out")
    assert_close(S, S_ref, "f32_state")


@pytest.mark.parametrize("t0", [16 + 3, 32 + 8, 48 + 15 - 1])
def test_causality_inside_sub_chunk(t0):
    q, k, v, g, beta = kda_inputs(8, 1, 64, 1, 1, 16, 16, lower_bound=-5.0)
    o, _ = chunk(q, k, v, g, beta)
    perturb = lambda x, s: x.at[:, t0 + 1 :].set(jax.random.normal(jax.random.key(s), x[:, t0 + 1 :].shape, x.dtype))
    g2 = g.at[:, t0 + 1 :].set(-5.0 * jax.random.uniform(jax.random.key(9), g[:, t0 + 1 :].shape))
    o2, _ = chunk(perturb(q, 1), perturb(k, 2), perturb(v, 3), g2, perturb(beta, 4))
    np.testing.assert_array_equal(np.asarray(o[:, : t0 + 1]), np.asarray(o2[:, : t0 + 1]))
    assert not np.array_equal(np.asarray(o[:, t0 + 1 :]), np.asarray(o2[:, t0 + 1 :]))


def test_bf16_inputs():
    q, k, v, g, beta = kda_inputs(10, 2, 100, 2, 4, 32, 32, dtype=jnp.bfloat16)
    o, S = chunk(q, k, v, g, beta)
    chex.assert_type([o, S], [jnp.bfloat16, jnp.float32])
    f32 = lambda x: x.astype(jnp.float32)
    o_ref, S_ref = naive(f32(q), f32(k), f32(v), g, f32(beta))
    assert_close(o.astype(jnp.float32), o_ref, "bf16")
    assert_close(S, S_ref, "bf16")


def test_qk_l2norm_option():
    q, k, v, g, beta = kda_inputs(11, 1, 40, 1, 1, 16, 16)
    q, k = 3.0 * q, -2.0 * k
    o, _ = chunk(q, k, v, g, beta, use_qk_l2norm=True)
    o_ref, _ = naive(kda.l2norm(q), kda.l2norm(k), v, g, beta)
    assert_close(o, o_ref, "f32_out")


def test_gates():
    g_raw = jax.random.normal(jax.random.key(0), (5, 3, 4)) * 4
    A_log = jnp.array([-1.0, 0.0, 1.0])
    dt_bias = jax.random.normal(jax.random.key(1), (12,))
    g = kda.kda_gate(g_raw, A_log, dt_bias)
    x = np.asarray(g_raw, np.float64) + np.asarray(dt_bias, np.float64).reshape(3, 4)
    ref = -np.exp(np.asarray(A_log, np.float64))[:, None] * np.log1p(np.exp(x))
    np.testing.assert_allclose(np.asarray(g), ref, rtol=1e-5, atol=1e-6)
    g3 = kda.kda_gate(g_raw, A_log, dt_bias, lower_bound=-5.0)
    ref3 = -5.0 / (1 + np.exp(-np.exp(np.asarray(A_log, np.float64))[:, None] * x))
    np.testing.assert_allclose(np.asarray(g3), ref3, rtol=1e-5, atol=1e-6)
    assert float(g3.min()) >= -5.0 and float(g3.max()) <= 0.0
    with pytest.raises(ValueError, match="lower_bound"):
        kda.kda_gate(g_raw, A_log, dt_bias, lower_bound=1.0)
    with pytest.raises(ValueError, match="dt_bias"):
        kda.kda_gate(g_raw, A_log, dt_bias[:5])
    n = kda.l2norm(g_raw)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(n), axis=-1), 1.0, rtol=1e-5)


def test_bad_inputs_are_rejected():
    q, k, v, g, beta = kda_inputs(0, 2, 10, 2, 3, 8, 8)
    with pytest.raises(ValueError, match="multiple"):
        kda.chunk_kda(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    q, k, v, g, beta = kda_inputs(0, 2, 10, 1, 2, 8, 8)
    with pytest.raises(ValueError, match="B == 1"):
        kda.chunk_kda(q, k, v, g, beta, cu_seqlens=jnp.array([0, 10], jnp.int32))
    with pytest.raises(ValueError, match="initial_state"):
        kda.chunk_kda(q, k, v, g, beta, initial_state=jnp.zeros((1, 2, 8, 8)))
    with pytest.raises(ValueError, match="chunk_size"):
        kda.chunk_kda(q, k, v, g, beta, chunk_size=48)
    with pytest.raises(ValueError, match="checkpoint_stride"):
        kda.chunk_kda(q, k, v, g, beta, checkpoint_stride=100)
    with pytest.raises(ValueError, match="g"):
        kda.naive_recurrent_kda(q, k, v, g[:, :5], beta)


decode = jax.jit(kda.kda_decode_step)
verify = jax.jit(kda.kda_verify)
commit = jax.jit(kda.kda_commit)


@given(T=st.integers(1, 8), hv=st.sampled_from([(1, 1), (2, 4)]), seed=st.integers(0, 2**16))
def test_verify_and_commit_match_sequential_decodes(T, hv, seed):
    B, (H, HV), K, V = 3, hv, 16, 8
    q, k, v, g, beta = kda_inputs(seed, B, T, H, HV, K, V, lower_bound=-5.0)
    S0 = random_state(seed, (B, HV, K, V))
    o_win = verify(S0, q, k, v, g, beta)
    S, states, outs = S0, [S0], []
    for t in range(T):
        o_t, S = decode(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        states.append(S)
        outs.append(o_t)
    assert_close(o_win, jnp.stack(outs, 1), "f32_out")
    for n in range(T + 1):
        assert_close(commit(S0, k, v, g, beta, jnp.full((B,), n, jnp.int32)), states[n], "f32_state")
    mixed = jnp.array([0, T, T // 2], jnp.int32)
    got = commit(S0, k, v, g, beta, mixed)
    for b in range(B):
        assert_close(got[b], states[int(mixed[b])][b], "f32_state")


def test_decode_step_matches_chunk():
    q, k, v, g, beta = kda_inputs(12, 2, 1, 2, 2, 16, 16)
    S0 = random_state(12, (2, 2, 16, 16))
    o, S = decode(S0, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    o_ref, S_ref = chunk(q, k, v, g, beta, initial_state=S0)
    assert_close(o, o_ref[:, 0], "f32_out")
    assert_close(S, S_ref, "f32_state")
