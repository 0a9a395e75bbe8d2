"""Decode / verify / commit-by-replay kernels on a slot pool against the k3jax references.

Each case runs the TPU kernel in interpret mode (race detection, NaN-initialised scratch, two
simulated cores, shuffled parallel grid order) and the GPU kernel through the generic
interpreter; ``-m gpu`` on a GPU runs the compiled GPU kernel.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops import kda as ref
from pallas_kernels import kda
from pallas_kernels.kda import decode
from tests.helpers import assert_close, kda_inputs, kernel_backends, random_state

TPU_INTERPRET = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, random_seed=7)

run = kernel_backends("cpu", TPU_INTERPRET)


def _pool(seed, num_slots, HV, K, V):
    return random_state(seed, (num_slots, HV, K, V))


def _rows(pool, slots):
    """Dense ``[B, HV, K, V]`` states of the rows (padding rows get slot 0's, ignored)."""
    return pool[jnp.asarray(np.maximum(slots, 0))]


SHAPES = [  # B, T, H, HV, K, V, dtype
    (3, 4, 2, 4, 16, 64, jnp.float32),
    (2, 3, 1, 2, 32, 16, jnp.bfloat16),
    (4, 8, 2, 2, 16, 16, jnp.float32),
]


def _skip_slow_interpreter(run, T):
    """The TPU interpreter is slow on CPU: its T = 8 cases run only with K3JAX_ALL_INTERPRET=1 (the
    GPU-interpret and compiled runs always cover them)."""
    if run["interpret"] is TPU_INTERPRET and T == 8 and os.environ.get("K3JAX_ALL_INTERPRET") is None:
        pytest.skip("long window under the TPU interpreter: set K3JAX_ALL_INTERPRET=1")


def _tol(dtype, state=False):
    return "bf16" if dtype == jnp.bfloat16 else ("f32_state" if state else "f32_out")


@pytest.mark.parametrize("B,T,H,HV,K,V,dtype", SHAPES)
def test_decode_updates_only_its_slots(run, B, T, H, HV, K, V, dtype):
    _skip_slow_interpreter(run, T)
    q, k, v, g, beta = kda_inputs(B * 10 + T, B, 1, H, HV, K, V, dtype=dtype)
    num_slots = B + 3
    pool = _pool(T, num_slots, HV, K, V)
    # Slots out of row order, one padding row.
    slots = np.random.default_rng(T).permutation(num_slots)[:B].astype(np.int32)
    slots[1] = -1
    before = np.asarray(pool)
    o_ref, s_ref = ref.kda_decode_step(_rows(pool, slots), q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
    o, pool = kda.kda_decode(pool, slots, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], **run)
    live = slots >= 0
    assert o.dtype == v.dtype
    assert_close(o[live], o_ref[live], _tol(dtype))
    assert_close(pool[slots[live]], s_ref[live], _tol(dtype, True))
    assert np.all(np.asarray(o[~live]) == 0)
    untouched = np.setdiff1d(np.arange(num_slots), slots[live])
    np.testing.assert_array_equal(np.asarray(pool)[untouched], before[untouched])


@pytest.mark.parametrize("B,T,H,HV,K,V,dtype", SHAPES)
def test_verify_then_commit_any_accept_counts(run, B, T, H, HV, K, V, dtype):
    _skip_slow_interpreter(run, T)
    q, k, v, g, beta = kda_inputs(B + 7 * T, B, T, H, HV, K, V, dtype=dtype)
    num_slots = B + 2
    pool = _pool(B, num_slots, HV, K, V)
    slots = np.arange(num_slots)[::-1][:B].astype(np.int32)
    dense = _rows(pool, slots)
    o = kda.kda_verify(pool, slots, q, k, v, g, beta, **run)
    assert_close(o, ref.kda_verify(dense, q, k, v, g, beta), _tol(dtype))
    o2, deltas = kda.kda_verify(pool, slots, q, k, v, g, beta, return_deltas=True, **run)
    np.testing.assert_array_equal(np.asarray(o2), np.asarray(o))
    # Accept none, all, and mixed counts in one batch; replay recomputing the deltas, and from them.
    counts = (np.zeros(B, np.int32), np.full(B, T, np.int32), np.arange(B, dtype=np.int32) % (T + 1))
    for n, given in [(n, None) for n in counts] + [(counts[2], deltas), (counts[1], deltas)]:
        before = np.asarray(pool)
        new_pool = kda.kda_commit(jnp.asarray(before), slots, k, v, g, beta, n, deltas=given, **run)
        want = ref.kda_commit(dense, k, v, g, beta, jnp.asarray(n))
        assert_close(new_pool[slots], want, _tol(dtype, True))
        rejected = slots[n == 0]
        np.testing.assert_array_equal(np.asarray(new_pool)[rejected], before[rejected])
        untouched = np.setdiff1d(np.arange(num_slots), slots)
        np.testing.assert_array_equal(np.asarray(new_pool)[untouched], before[untouched])


def test_window_of_one_is_the_decode_step(run):
    B, H, HV, K, V = 3, 2, 4, 16, 16
    q, k, v, g, beta = kda_inputs(5, B, 1, H, HV, K, V)
    pool = _pool(5, 4, HV, K, V)
    slots = np.array([2, 0, 3], np.int32)
    o_win = kda.kda_verify(pool, slots, q, k, v, g, beta, **run)
    committed = kda.kda_commit(jnp.array(pool), slots, k, v, g, beta, np.ones(B, np.int32), **run)
    o_dec, stepped = kda.kda_decode(jnp.array(pool), slots, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], **run)
    assert_close(o_win[:, 0], o_dec, "f32_out")
    assert_close(committed, stepped, "f32_state")


def test_snapshot_baseline_matches_replay(run):
    B, T, H, HV, K, V = 4, 4, 2, 2, 16, 16
    q, k, v, g, beta = kda_inputs(11, B, T, H, HV, K, V)
    pool = _pool(11, 6, HV, K, V)
    slots = np.array([5, -1, 0, 2], np.int32)
    n = np.array([3, 2, 0, 4], np.int32)
    o_snap, snaps = decode.kda_verify_snapshot(pool, slots, q, k, v, g, beta, **run)
    o = kda.kda_verify(pool, slots, q, k, v, g, beta, **run)
    np.testing.assert_allclose(np.asarray(o_snap), np.asarray(o), rtol=1e-6, atol=1e-6)
    by_snapshot = decode.kda_commit_snapshot(jnp.array(pool), jnp.asarray(slots), snaps, jnp.asarray(n))
    by_replay = kda.kda_commit(jnp.array(pool), slots, k, v, g, beta, n, **run)
    np.testing.assert_allclose(np.asarray(by_snapshot), np.asarray(by_replay), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,prefetch", [("DECODE", False), ("VERIFY", False), ("VERIFY", True), ("COMMIT", None),
                                          ("VERIFY_SNAPSHOT", False), ("VERIFY_SNAPSHOT", True), ("COMMIT_VERIFY", True),
                                          ("VERIFY_DELTAS", False), ("COMMIT_DELTAS", None),
                                          ("COMMIT_VERIFY_DELTAS", False)])
def test_gpu_column_blocks(mode, prefetch, gpu_run):
    """The GPU kernel with the value columns split over programs (block_v < V), loading each
    position's inputs in place or one position ahead, against the references: outputs,
    snapshots, committed states, padding rows, untouched slots."""
    from pallas_kernels.kda import _window, decode_gpu

    m = getattr(_window, mode)
    B, T, H, HV, K, V = 3, 1 if m is _window.DECODE else 4, 1, 2, 16, 32
    q, k, v, g, beta = kda_inputs(40, B, T, H, HV, K, V)
    prev = kda_inputs(41, B, T, H, HV, K, V)[1:]
    pool = _pool(40, 5, HV, K, V)
    slots = np.array([4, -1, 1], np.int32)
    n = np.array([2, 3, 4], np.int32) if m.per_row_n else np.full(B, T, np.int32)
    call = functools.partial(decode_gpu.window_call, mode=m, scale=K**-0.5, block_v=16, prefetch=prefetch,
                             interpret=gpu_run["interpret"])
    live = slots >= 0
    S0 = _rows(pool, slots)
    # Deltas of the replayed window, from the compiled verify (checked below through the states).
    deltas_of = lambda w: call(pool, jnp.asarray(slots), jnp.asarray(n), w[0], *w, mode=_window.VERIFY_DELTAS)[1]
    if m.replay_first:
        given = (prev[0], deltas_of(prev), prev[2]) if m.deltas_in else prev
    window = (q, k, deltas_of((k, v, g, beta)), g, None) if m.replay_only and m.deltas_in else (q, k, v, g, beta)
    o, deltas, snaps, new = call(jnp.array(pool), jnp.asarray(slots), jnp.asarray(n), *window,
                                 prev=given if m.replay_first else None)
    if m.replay_first:
        S0 = ref.kda_commit(S0, *prev, jnp.asarray(n))
    if m.readout:
        assert_close(o[live], ref.kda_verify(S0, q, k, v, g, beta)[live], "f32_out")
        assert not np.any(np.asarray(o[~live]))
    if m.deltas_out:  # the next position's state from this one's delta
        S1 = ref.kda_commit(S0, k, v, g, beta, jnp.ones(B, jnp.int32))
        decayed = S0 * jnp.exp(g[:, 0])[..., None]
        assert_close((decayed + k[:, 0, :, :, None] * deltas[:, 0, :, None, :])[live], S1[live], "f32_state")
        assert not np.any(np.asarray(deltas[~live]))
    if m.snapshot:
        _, states = ref._window_states(S0, q, k, v, g, beta, None)
        assert_close(snaps[live], states[live], "f32_state")
        assert not np.any(np.asarray(snaps[~live]))
    if m.write_state:
        want = S0 if m.replay_first else ref.kda_commit(S0, k, v, g, beta, jnp.asarray(n))
        assert_close(new[slots[live]], want[live], "f32_state")
        untouched = np.setdiff1d(np.arange(5), slots[live])
        np.testing.assert_array_equal(np.asarray(new[untouched]), np.asarray(pool[untouched]))


def test_gpu_tiling_rules():
    """128 columns per program for the verify and the kernels that replay given deltas once the
    programs fill the SMs, for the snapshot verify up to 32 programs per SM, 64 otherwise and for
    every other mode; the snapshot verify prefetches, the verify (and the fused kernel from
    deltas) while its programs do not fill the SMs (measured: decode_gpu.default_block_v /
    default_prefetch)."""
    from pallas_kernels.kda._window import (COMMIT, COMMIT_DELTAS, COMMIT_VERIFY, COMMIT_VERIFY_DELTAS, DECODE, VERIFY,
                                            VERIFY_DELTAS, VERIFY_SNAPSHOT)
    from pallas_kernels.kda.decode_gpu import default_block_v, default_prefetch

    assert default_block_v(VERIFY, 256, 32, 128) == 128 and default_block_v(VERIFY, 32, 32, 128) == 128
    assert default_block_v(VERIFY, 1, 32, 128) == 64 and default_block_v(VERIFY, 1, 96, 128) == 64
    assert default_block_v(VERIFY_SNAPSHOT, 128, 32, 128) == 128 and default_block_v(VERIFY_SNAPSHOT, 256, 12, 128) == 128
    assert default_block_v(VERIFY_SNAPSHOT, 1, 32, 128) == 64 and default_block_v(VERIFY_SNAPSHOT, 256, 32, 128) == 64
    assert {default_block_v(m, 256, 32, 128) for m in (COMMIT, COMMIT_VERIFY, DECODE)} == {64}
    deltas = (VERIFY_DELTAS, COMMIT_DELTAS, COMMIT_VERIFY_DELTAS)
    assert [default_block_v(m, B, 32, 128) for m in deltas for B in (256, 1)] == [128, 64] * 3
    modes = (COMMIT, COMMIT_VERIFY, DECODE, VERIFY, VERIFY_SNAPSHOT, *deltas)
    for B, want in ((256, [VERIFY_SNAPSHOT]), (1, [VERIFY, VERIFY_SNAPSHOT, VERIFY_DELTAS, COMMIT_VERIFY_DELTAS])):
        assert [m for m in modes if default_prefetch(m, B, 32, 128)] == want


_decode_ref = jax.jit(ref.kda_decode_step)


@jax.jit
def _window_ref(dense, q, k, v, g, beta, n):
    """Sequential decode over the window: outputs at every position, state after the first n."""
    window, outs = dense, []
    for t in range(q.shape[1]):
        o_t, window = _decode_ref(window, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(o_t)
        dense = jnp.where((t < n)[:, None, None, None], window, dense)
    return jnp.stack(outs, axis=1), dense


def _chain(run, steps, seed, how="replay"):
    """Verify + commit with random accept counts vs sequential decoding of the committed stream.
    how: "replay" (the commit recomputes the deltas), "deltas" (the verify's deltas are
    replayed), "fused" (each commit fused into the next verify, from the deltas)."""
    B, T, H, HV, K, V = 3, 4, 1, 2, 16, 16
    rng = np.random.default_rng(seed)
    pool = _pool(seed, 4, HV, K, V)
    slots = np.array([3, 0, 1], np.int32)
    dense = _rows(pool, slots)
    stream = [x.reshape(steps, B, *x.shape[1:]) for x in kda_inputs(seed, steps * B, T, H, HV, K, V)]
    worst, last = 0.0, None
    for step in range(steps):
        q, k, v, g, beta = (x[step] for x in stream)
        n = jnp.asarray(rng.integers(0, T + 1, size=B).astype(np.int32))
        if how == "replay":
            o = kda.kda_verify(pool, slots, q, k, v, g, beta, **run)
            pool = kda.kda_commit(pool, slots, k, v, g, beta, n, **run)
        elif how == "deltas" or last is None:
            o, deltas = kda.kda_verify(pool, slots, q, k, v, g, beta, return_deltas=True, **run)
            if how == "deltas":
                pool = kda.kda_commit(pool, slots, k, v, g, beta, n, deltas=deltas, **run)
        else:  # fused: commit the previous window, then verify this one
            prev, prev_n, prev_deltas = last
            o, deltas, pool = kda.kda_commit_verify(pool, slots, prev, prev_n, q, k, v, g, beta,
                                                    prev_deltas=prev_deltas, return_deltas=True, **run)
        if how == "fused":
            last = ((k, v, g, beta), n, deltas)
        o_ref, dense = _window_ref(dense, q, k, v, g, beta, n)
        assert_close(o, o_ref, "f32_out")
        if how == "fused" and step + 1 < steps:
            continue  # the pool holds the state one commit behind
        if how == "fused":
            pool = kda.kda_commit(pool, slots, *last[0], last[1], deltas=last[2], **run)
        worst = max(worst, float(jnp.linalg.norm(pool[slots] - dense) / jnp.linalg.norm(dense)))
    assert worst <= 2e-3, worst


@pytest.mark.parametrize("how", ["replay", "deltas", "fused"])
def test_chained_steps_with_random_accepts(run, how):
    _chain(run, 256 if run["interpret"] is True else 6, seed=3, how=how)


@pytest.mark.slow
def test_chained_256_steps_tpu_interpret():
    _chain(dict(backend="cpu", interpret=TPU_INTERPRET), 256, seed=4)


def test_bad_slot_ids_and_shapes_are_rejected():
    B, H, HV, K, V = 2, 1, 2, 16, 16
    q, k, v, g, beta = (x[:, 0] for x in kda_inputs(0, B, 1, H, HV, K, V))
    pool = _pool(0, 3, HV, K, V)
    for bad in ([0, 3], [-2, 0], [1, 1]):
        with pytest.raises(ValueError, match="slot ids"):
            kda.kda_decode(pool, np.array(bad, np.int32), q, k, v, g, beta)
    with pytest.raises(ValueError, match="v must have shape"):
        kda.kda_decode(pool, np.array([0, 1], np.int32), q, k, v[:, :1], g, beta)
    with pytest.raises(ValueError, match="state_pool"):
        kda.kda_decode(pool.astype(jnp.bfloat16), np.array([0, 1], np.int32), q, k, v, g, beta)


def test_race_detector_flags_a_shared_slot():
    """Negative control: two live rows on one slot (bypassing the host check) is a detected race."""
    B, H, HV, K, V = 2, 1, 1, 16, 16
    q, k, v, g, beta = (x[:, 0] for x in kda_inputs(1, B, 1, H, HV, K, V))
    pool = _pool(1, 2, HV, K, V)
    decode = jax.jit(lambda p, s: kda.kda_decode(p, s, q, k, v, g, beta, interpret=TPU_INTERPRET, backend="cpu"))
    decode(pool, jnp.array([1, 1], jnp.int32))[1].block_until_ready()
    assert tpu_interpreter.races is not None and tpu_interpreter.races.races_found
    pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.parametrize("mode", ["DECODE", "VERIFY", "COMMIT", "VERIFY_SNAPSHOT", "COMMIT_VERIFY", "VERIFY_DELTAS",
                                  "COMMIT_DELTAS", "COMMIT_VERIFY_DELTAS"])
def test_tpu_kernels_lower_for_tpu(mode):
    """The Mosaic lowering accepts every mode at serving shapes (bf16 inputs, K = V = 128, GVA)."""
    from pallas_kernels.kda import _window, decode_tpu

    m = getattr(_window, mode)
    B, T, H, HV, K, V = 4, 4, 2, 4, 128, 128  # DECODE too: the dense adapter's window of T
    spec = jax.ShapeDtypeStruct
    window = (spec((B, T, H, K), jnp.bfloat16), spec((B, T, HV, V), jnp.bfloat16),
              spec((B, T, HV, K), jnp.float32), spec((B, T, HV), jnp.bfloat16))

    def f(pool, ids, n, q, k, v, g, beta, pk, pv, pg, pb, deltas):
        prev = ((pk, deltas, pg) if m.deltas_in else (pk, pv, pg, pb)) if m.replay_first else None
        if m.replay_only and m.deltas_in:
            v, beta = deltas, None
        return decode_tpu.window_call(pool, ids, n, q, k, v, g, beta, mode=m, scale=K**-0.5, prev=prev)

    args = (spec((8, HV, K, V), jnp.float32), spec((B,), jnp.int32), spec((B,), jnp.int32),
            spec((B, T, H, K), jnp.bfloat16), *window, *window, spec((B, T, HV, V), jnp.float32))
    exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exported.mlir_module()


def test_commit_fused_into_next_verify(run):
    """kda_commit_verify == kda_commit then kda_verify, with a different window length per step;
    also replaying the previous window from its deltas and returning this window's."""
    B, H, HV, K, V = 3, 1, 2, 16, 64
    prev = kda_inputs(21, B, 3, H, HV, K, V)[1:]
    q, k, v, g, beta = kda_inputs(22, B, 2, H, HV, K, V)
    pool = _pool(21, 5, HV, K, V)
    slots = np.array([4, -1, 0], np.int32)
    n = np.array([2, 3, 0], np.int32)
    before = np.asarray(pool)
    committed = kda.kda_commit(jnp.array(before), slots, *prev, n, **run)
    o_want = kda.kda_verify(committed, slots, q, k, v, g, beta, **run)
    o, fused = kda.kda_commit_verify(jnp.array(before), slots, prev, n, q, k, v, g, beta, **run)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(committed), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_want), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(o[1]) == 0)
    np.testing.assert_array_equal(np.asarray(fused)[[1, 2, 3]], before[[1, 2, 3]])
    # From the previous window's deltas, returning this window's.
    _, prev_deltas = kda.kda_verify(jnp.array(before), slots, prev[0], *prev, return_deltas=True, **run)
    o_d, deltas, fused_d = kda.kda_commit_verify(jnp.array(before), slots, prev, n, q, k, v, g, beta,
                                                 prev_deltas=prev_deltas, return_deltas=True, **run)
    _, deltas_want = kda.kda_verify(committed, slots, q, k, v, g, beta, return_deltas=True, **run)
    np.testing.assert_allclose(np.asarray(fused_d), np.asarray(committed), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(o_d), np.asarray(o_want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(deltas), np.asarray(deltas_want), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(deltas[1]))
    np.testing.assert_array_equal(np.asarray(fused_d)[[1, 2, 3]], before[[1, 2, 3]])


def test_dense_adapters_match_the_references_and_fold_vmap(run):
    """``kda_recurrent_dense`` (T = 1 and 5: one decode-kernel call) and
    ``kda_commit_dense`` against the references; under ``jax.vmap`` of one-row calls (the
    engine's per-slot model) each is still one kernel call, with the same results; the
    caller's state survives the kernels' donation."""
    B, H, HV, K, V = 3, 1, 2, 16, 16
    h0 = random_state(1, (B, HV, K, V))
    one = lambda x: x[None]
    for T in (1, 5):
        x = kda_inputs(T, B, T, H, HV, K, V)
        o, s = kda.kda_recurrent_dense(*x, initial_state=h0, **run)
        o_r, s_r = ref.naive_recurrent_kda(*x, initial_state=h0)
        assert_close(o, o_r, "f32_out")
        assert_close(s, s_r, "f32_state")
        rows = lambda *a: kda.kda_recurrent_dense(*map(one, a[:5]), initial_state=one(a[5]), **run)
        assert str(jax.make_jaxpr(jax.vmap(rows))(*x, h0)).count("pallas_call") == 1
        o2, s2 = jax.jit(jax.vmap(rows))(*x, h0)
        assert_close(o2[:, 0], o_r, "f32_out")
        assert_close(s2[:, 0], s_r, "f32_state")
    n = jnp.array([0, 2, 5], jnp.int32)
    assert_close(kda.kda_commit_dense(h0, *x[1:], n, **run), ref.kda_commit(h0, *x[1:], n), "f32_state")
    assert np.isfinite(np.asarray(h0)).all()  # not deleted by donation
