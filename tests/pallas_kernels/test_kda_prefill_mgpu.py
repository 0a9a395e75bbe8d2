"""The Mosaic GPU prefill kernels: the recurrent stage (``pallas_kernels.kda.recurrence_mgpu``) and
stage 1's intra-chunk products (``pallas_kernels.kda.chunk_intra_mgpu``) and W, U
(``pallas_kernels.kda.wy_fast_mgpu``).

CPU: the kernels in the Mosaic GPU interpreter (race detection on, uninitialised shared memory
NaN): the recurrence against a NumPy replay of the same recurrence with bf16 operands, the intra-chunk kernel
against float64 products; both through ``chunk_kda`` against the k3jax references; the
lowering is checked with ``jax.export`` for an abstract H200. ``-m gpu`` on a GPU runs the same
checks compiled.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mgpu_interpreter
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax.ops import kda as ref
from pallas_kernels.kda import (chunk_intra_mgpu, chunk_prep_gpu, prefill, recurrence_mgpu, recurrence_triton, segment_plan,
                                wy_fast_mgpu)
from pallas_kernels.kda.chunk_prep_gpu import gate_cumsum_call
from pallas_kernels.kda.common import SUB
from tests.helpers import GPU_RUNS_SLOW_INTERPRET, assert_close, kda_inputs, random_state, rel_rms, skip_compiled_on_cpu
from tests.pallas_kernels.test_kda_prefill import H200, _export

INTERPRET = plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
HV, K, V, C, NC = 2, 64, 128, 64, 5  # two value column blocks per head


@pytest.fixture(params=[pytest.param(INTERPRET, id="interpret"),
                        pytest.param(False, id="compiled", marks=pytest.mark.gpu)])
def interpret(request):
    """The kernel in the Mosaic GPU interpreter, and compiled (``-m gpu``; skipped on CPU)."""
    skip_compiled_on_cpu({"interpret": request.param})
    return request.param


def _no_race(interpret):
    """The interpreter found no race in the kernel it ran last (its state is per kernel call)."""
    assert not (interpret and mgpu_interpreter.get_races().races_found)


def _prep(seed, K=K):
    """Random stage-1 outputs in bf16 (as the GPU stage 1 stores them), decays in (0.5, 1)."""
    ks = jax.random.split(jax.random.key(seed), 6)
    n = lambda key, *shape: (0.1 * jax.random.normal(key, shape)).astype(jnp.bfloat16)
    TT = NC * C
    return (n(ks[0], HV, TT, K), n(ks[1], HV, NC, K, C), n(ks[2], HV, TT, K), n(ks[3], HV, TT, V),
            n(ks[4], HV, TT, C), jax.random.uniform(ks[5], (HV, NC, K, 1), minval=0.5, maxval=1.0))


def _replay(prep, init, vstart, vend, ck_slot, n_slots, operand):
    """The recurrence chunk by chunk in NumPy; ``operand`` rounds what the products read (S, V_new)."""
    qg, kdT, W, U, Aqk, decay = (np.asarray(x, np.float32) for x in prep)
    o = np.zeros((NC * C, HV, V), np.float32)
    final = np.zeros((len(vstart), HV, K, V), np.float32)
    ckpt = np.full((n_slots, HV, K, V), np.nan, np.float32)
    for s, (lo, hi) in enumerate(zip(vstart, vend)):
        S = np.array(init[s], np.float32)
        for c in range(lo, hi):
            r = slice(c * C, (c + 1) * C)
            for h in range(HV):
                Sb = operand(S[h])
                v_new = U[h, r] - W[h, r] @ Sb
                o[r, h] = qg[h, r] @ Sb + Aqk[h, r] @ operand(v_new)
                S[h] = decay[h, c] * S[h] + kdT[h, c] @ operand(v_new)
            if ck_slot[c] >= 0:
                ckpt[ck_slot[c]] = S
        final[s] = S
    return o, final, ckpt


def _bf16(x):
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("block_v, cta_cols, out_dtype", [(32, 64, jnp.float32), (64, 64, jnp.float32),
                                                       (64, 128, jnp.bfloat16)],
                         ids=["two-warpgroups", "one-warpgroup", "two-warpgroups-of-64"])
def test_recurrence_matches_the_bf16_operand_replay(block_v, cta_cols, out_dtype, interpret):
    """Three virtual sequences (one chunk, none, four: input slots refilled), initial states,
    checkpoints after chunks 0 and 2: outputs, final states and checkpoints match the replay with
    bf16 operands, closer than the float32-operand replay does (the rounding is the kernel's; bf16
    outputs against the replays' rounded to bf16), with no race (two warpgroups share a CTA's
    inputs, or one per CTA; at 128 columns per CTA the state's staging shares the memory of both
    warpgroups' tiles). The compiled kernel sums
    its products in another order than NumPy, and these random maps grow such differences 5-10x
    a chunk: on the H200 the outputs' error was 1.4e-7 in the one-chunk sequence and 1.5e-6,
    8.8e-6, 7.5e-5, 1.4e-4 over the four-chunk one's (7.4e-5 in all), against 1.8e-3 to 2.5e-3
    between the two replays."""
    prep = _prep(0)
    vstart, vend = np.array([0, 1, 1], np.int32), np.array([1, 1, 5], np.int32)
    ck_slot = np.array([0, -1, 1, -1, -1], np.int32)
    init = random_state(0, (3, HV, K, V))
    got = recurrence_mgpu.scan_call(prep, init, jnp.asarray(vstart), jnp.asarray(vend), jnp.asarray(ck_slot),
                                 n_ck_slots=2, out_dtype=out_dtype, block_v=block_v, cta_cols=cta_cols,
                                 interpret=interpret)
    _no_race(interpret)
    assert got[0].dtype == out_dtype
    outputs = lambda o, final, ckpt: (_bf16(o) if out_dtype == jnp.bfloat16 else o, final, ckpt)
    want = outputs(*_replay(prep, init, vstart, vend, ck_slot, 2, _bf16))
    f32 = outputs(*_replay(prep, init, vstart, vend, ck_slot, 2, lambda x: x))
    for x, w, w32 in zip(got, want, f32):
        assert rel_rms(x, w) <= 2e-4 < rel_rms(x, w32)
    np.testing.assert_array_equal(np.asarray(got[1][1]), np.asarray(init[1]))  # no chunks: the start


@pytest.mark.parametrize("block_v, cta_cols", [(32, 64), (64, 64), (64, 128), (64, 256)],
                         ids=["two-warpgroups", "one-warpgroup", "two-warpgroups-of-64", "four-warpgroups-of-64"])
def test_summary_mode_matches_the_triton_kernel(block_v, cta_cols, interpret):
    """Summary mode (``[M | E]`` columns): the whole maps of two segments (1 and 4 chunks), and a
    segment whose E columns start from a state with its M columns skipped (I returned): the
    Triton kernel's results (interpreted, float32 operands) within bf16 rounding; the skipped
    blocks exactly. 128 columns per CTA need K = 128 (each CTA's columns all M or all E), and so
    do all 256, where one CTA runs a segment's M columns with its E columns: those equal the
    whole map's bit for bit."""
    Kt = K if cta_cols == 64 else 128
    prep = _prep(1, Kt)
    # 4 chunks: one of the summary pass's 3 input slots refilled
    vstart, vend = jnp.array([0, 1], jnp.int32), jnp.array([1, 5], jnp.int32)
    S0 = random_state(1, (2, HV, Kt, V))
    got = []
    for skips_m, table in enumerate(([[-1, 1, 1], [-1, 1, 1]], [[1, 0, 1], [-1, 0, 0]])):
        table = jnp.array(table, jnp.int32)
        got.append(np.asarray(recurrence_mgpu.scan_call(prep, S0, vstart, vend, table, n_ck_slots=1, summary=True,
                                                     block_v=block_v, cta_cols=cta_cols, interpret=interpret)))
        _no_race(interpret)
        want = recurrence_triton.scan_call(prep, S0, vstart, vend, table, n_ck_slots=1, summary=True, block_v=64,
                                     interpret=True)
        if skips_m and cta_cols == Kt + V:  # Triton skips segment 0's M columns; this CTA runs them
            want = want.at[0, :, :, :Kt].set(got[0][0, :, :, :Kt])
        assert_close(got[-1], want, "bf16")
    eye = np.broadcast_to(np.eye(Kt), (HV, Kt, Kt))
    np.testing.assert_array_equal(got[1][1, :, :, :Kt], eye)
    np.testing.assert_array_equal(got[1][0, :, :, :Kt], got[0][0, :, :, :Kt] if cta_cols == Kt + V else eye)
    assert not np.any(got[1][1, :, :, Kt:])


def _chunk_kda_matches_the_references(cu, x, h0, **kw):
    """``chunk_kda(**kw)`` with 64-token checkpoints and 2 segments: bf16 outputs, final states and
    checkpoints within bf16 tolerance of the references."""
    o_r, s_r = ref.naive_recurrent_kda(*x, initial_state=h0, cu_seqlens=cu)
    _, _, ck_r = ref.chunk_kda(*x, initial_state=h0, cu_seqlens=cu, checkpoint_stride=64)
    o, s, ck = prefill.chunk_kda(*x, initial_state=h0, cu_seqlens=cu, checkpoint_stride=64, num_segments=2, **kw)
    assert o.dtype == jnp.bfloat16
    assert_close(o, o_r, "bf16")
    assert_close(s, s_r, "bf16")
    assert_close(ck, ck_r, "bf16")


@pytest.mark.parametrize("gpu_run", GPU_RUNS_SLOW_INTERPRET, indirect=True)  # interpreted: kernel A's test runs it too
def test_chunk_kda_with_the_mosaic_recurrence(gpu_run):
    """``chunk_kda(recurrence="mosaic_gpu")``: bf16 inputs, GVA, a sequence that is not a whole
    number of chunks, initial states, 64-token checkpoints, 2 segments (the summary pass and the
    recurrence); against the references within bf16 tolerance."""
    x = kda_inputs(5, 1, 264, 1, 2, 64, 64, lower_bound=-5.0, dtype=jnp.bfloat16)
    _chunk_kda_matches_the_references(jnp.array([0, 200, 264], jnp.int32), x, random_state(5, (2, 2, 64, 64)),
                                      recurrence="mosaic_gpu", **gpu_run)


@pytest.mark.parametrize("gpu_run", GPU_RUNS_SLOW_INTERPRET, indirect=True)
def test_chunk_kda_with_the_wide_summary(gpu_run, monkeypatch):
    """The summary pass and the recurrence at 128 columns per CTA inside ``chunk_kda`` (K = V =
    128, 3 segments, GVA, initial states, checkpoints), chosen by the planner when their CTAs take
    fewer waves (one SM here makes every CTA a wave); against the references within bf16
    tolerance."""
    monkeypatch.setattr(segment_plan, "gpu_core_count", lambda: 1)
    assert segment_plan.summary_cta_cols(1, 2, 128, 128, 3) == 128
    assert segment_plan.recurrence_cta_cols(1, 2, 128, 3, recurrence_mgpu.recurrence_widths(128, 128, 64, jnp.bfloat16)) == 128
    x = kda_inputs(6, 1, 320, 1, 2, 128, 128, lower_bound=-5.0, dtype=jnp.bfloat16)
    x = (*x[:3], 0.02 * x[3], x[4])  # slow decay: what enters each segment matters at its end
    cu, h0 = jnp.array([0, 320], jnp.int32), random_state(6, (1, 2, 128, 128))
    o_r, s_r = ref.naive_recurrent_kda(*x, initial_state=h0, cu_seqlens=cu)
    _, _, ck_r = ref.chunk_kda(*x, initial_state=h0, cu_seqlens=cu, checkpoint_stride=64)
    o, s, ck = prefill.chunk_kda(*x, initial_state=h0, cu_seqlens=cu, checkpoint_stride=64, num_segments=3,
                                 recurrence="mosaic_gpu", **gpu_run)
    for got, want in ((o, o_r), (s, s_r), (ck, ck_r)):
        assert_close(got, want, "bf16")


@pytest.mark.parametrize("gpu_run", GPU_RUNS_SLOW_INTERPRET, indirect=True)
def test_initial_state_hook_with_the_mosaic_recurrence(gpu_run):
    """The KCP path through the default recurrence (Mosaic GPU here): ``initial_state_fn`` gets
    each sequence's whole map from the Mosaic summary pass over 2 segments, and the recurrence
    runs from the states it returns."""
    cu = jnp.array([0, 64, 192], jnp.int32)
    x = kda_inputs(8, 1, 192, 1, 1, 64, 64, lower_bound=-5.0, dtype=jnp.bfloat16)
    h0 = random_state(8, (2, 1, 64, 64))
    _, s1 = ref.naive_recurrent_kda(*x, initial_state=h0, cu_seqlens=cu)
    hook = lambda M, E: jnp.einsum("nhij,nhjv->nhiv", M, h0, precision="highest") + E
    o, s2 = prefill.chunk_kda(*x, cu_seqlens=cu, num_segments=2, initial_state_fn=hook, **gpu_run)
    o_r, s2_r = ref.naive_recurrent_kda(*x, initial_state=s1, cu_seqlens=cu)
    assert_close(o, o_r, "bf16")
    assert_close(s2, s2_r, "bf16")


def _exact_products(q, k, G, beta, scale, rep):
    """Float64 ``Aqk`` (scaled, causal) and ``N = beta Akk`` (strictly lower) per chunk, from the
    pairwise gate differences: ``[HV, TT, C]`` each."""
    q, k, G, beta = (np.asarray(x, np.float64) for x in (q, k, G, beta[..., 0]))
    TT, HV = G.shape[:2]
    aqk, n = np.zeros((HV, TT, C)), np.zeros((HV, TT, C))
    causal, strict = np.tril(np.ones((C, C))), np.tril(np.ones((C, C)), -1)
    for h in range(HV):
        for c in range(0, TT, C):
            Gc, qc, kc = G[c:c + C, h], q[c:c + C, h // rep], k[c:c + C, h // rep]
            decay = np.exp(np.minimum(Gc[:, None, :] - Gc[None, :, :], 0.0))  # [r, j, K]; r >= j kept
            aqk[h, c:c + C] = scale * causal * np.einsum("rd,jd,rjd->rj", qc, kc, decay)
            n[h, c:c + C] = beta[c:c + C, h, None] * strict * np.einsum("rd,jd,rjd->rj", kc, kc, decay)
    return aqk, n


@pytest.mark.parametrize("part, wgs", [(None, None), (16, 3)], ids=["default", "three-warpgroups-per-cta"])
def test_kernel_a_matches_exact_products(part, wgs, interpret, monkeypatch):
    """The Mosaic GPU intra-chunk kernel at the gate bound (most gates near -5: spans up to 75 nats per
    sub-chunk, 320 per chunk), GVA, K = 128 (parts of K): Aqk, N (diagonal blocks included)
    and qg against float64 (interpreter: float32 products; compiled: TF32); rows never read later
    tokens (the inputs of the second chunk's row 31, the last row of a sub-chunk, changed: every
    earlier row bit for bit the same). Its four items (chunk, head) one per CTA, or three per CTA
    in 16-column parts (the second CTA's two spare warpgroups store nothing)."""
    if part:
        monkeypatch.setattr(chunk_intra_mgpu, "PART", part)
        monkeypatch.setattr(chunk_intra_mgpu, "WGS", wgs)
    TT, H, HV_, K_ = 2 * C, 1, 2, 128
    q, k, _, g, beta = (x[0] for x in kda_inputs(9, 1, TT, H, HV_, K_, K_, lower_bound=-5.0, dtype=jnp.bfloat16,
                                                 gate_scale=4.0))
    beta = beta[..., None]
    assert float(g.min()) < -4.99
    G = jnp.cumsum(g.reshape(2, C, HV_, K_), axis=1).reshape(TT, HV_, K_)
    scale = K_**-0.5
    run = partial(chunk_intra_mgpu.rows_call, scale=scale, store_dtype=jnp.float32, interpret=interpret)
    qg, aqk, n = run(q, k, G, beta)
    _no_race(interpret)
    aqk_r, n_r = _exact_products(q, k, G, beta, scale, HV_ // H)
    qg_r = scale * np.moveaxis(np.asarray(q, np.float64)[:, [0, 0]] * np.exp(np.asarray(G, np.float64)), 1, 0)
    tol = 1e-5 if interpret else 2e-3  # TF32 products on the GPU
    for got, want in ((aqk, aqk_r), (n, n_r), (qg, qg_r)):
        assert rel_rms(got, want) < tol
    t0 = C + 2 * SUB - 1
    later = lambda x, key: x.at[t0].set(jax.random.normal(key, x.shape[1:]).astype(x.dtype))
    q2, k2 = later(q, jax.random.key(1)), later(k, jax.random.key(2))
    G2 = G.at[t0].set(G[t0 - 1] - 1.0)
    for a, b in zip(run(q2, k2, G2, beta), (qg, aqk, n)):
        np.testing.assert_array_equal(np.asarray(a)[:, :t0], np.asarray(b)[:, :t0])


def test_kernel_c_matches_exact_products(interpret):
    """The Mosaic GPU W/U kernel at the gate bound (spans up to 320 nats per chunk), GVA, K = 128 and
    V = 64 (four and two parts), a random lower-triangular X per chunk: W, U, kd^T and decay
    against float64 (interpreter: float32 products; compiled: TF32), with no race."""
    TT, H, HV_, K_, V_ = 2 * C, 1, 2, 128, 64
    _, k, v, g, beta = (x[0] for x in kda_inputs(10, 1, TT, H, HV_, K_, V_, lower_bound=-5.0, dtype=jnp.bfloat16,
                                                 gate_scale=4.0))
    beta = beta[..., None].astype(jnp.float32)
    G = jnp.cumsum(g.reshape(2, C, HV_, K_), axis=1).reshape(TT, HV_, K_)
    X = jnp.tril(jax.random.normal(jax.random.key(3), (HV_, 2, C, C))).reshape(HV_, TT, C)
    kdT, W, U, decay = wy_fast_mgpu.wu_call(k, v, G, beta, X, store_dtype=jnp.float32, interpret=interpret)
    _no_race(interpret)
    f64 = lambda x: np.asarray(x, np.float64)
    kk, vv, GG, bb, XX = f64(k)[:, [0, 0]], f64(v), f64(G), f64(beta), f64(X)
    tol = 1e-5 if interpret else 2e-3  # TF32 products on the GPU
    for h in range(HV_):
        for c in range(2):
            r = slice(c * C, (c + 1) * C)
            last = GG[r, h][-1]
            want = ((W[h, r], XX[h, r] @ (bb[r, h] * kk[r, h] * np.exp(GG[r, h]))),
                    (U[h, r], XX[h, r] @ (bb[r, h] * vv[r, h])),
                    (kdT[h, c], (kk[r, h] * np.exp(last - GG[r, h])).T),
                    (decay[h, c, :, 0], np.exp(last)))
            for got, w in want:
                assert rel_rms(got, w) < tol


@pytest.mark.parametrize("recurrence", ["mosaic_gpu", pytest.param("triton", marks=pytest.mark.slow)])
def test_chunk_kda_with_the_mosaic_kernel_a(recurrence, gpu_run):
    """``chunk_kda(prep_kernel="mosaic_gpu")`` at the gate bound: varlen (a sequence that is not a
    whole number of chunks), GVA, initial states, 64-token checkpoints, 2 segments, with either
    recurrence (Triton's in the slow run); against the references within bf16 tolerance."""
    x = kda_inputs(5, 1, 228, 1, 2, 64, 64, lower_bound=-5.0, dtype=jnp.bfloat16, gate_scale=4.0)
    _chunk_kda_matches_the_references(jnp.array([0, 100, 228], jnp.int32), x, random_state(5, (2, 2, 64, 64)),
                                      gate_lower_bound=-5.0, prep_kernel="mosaic_gpu", recurrence=recurrence, **gpu_run)


def test_the_cumsum_kernel_flags_wide_sub_chunks(gpu_run):
    """The span check of the cumsum kernel, per (head, chunk): a 16-row sub-chunk spanning
    exactly 75 nats passes, 75.5 does not, nor a rising gate of 76 or a NaN (which Triton's max
    and min would skip); G is unchanged."""
    g = jnp.zeros((128, 2, 64), jnp.float32).at[17:32, 1, 5].set(-5.0)  # rows 16..31: G 0 to -75

    def wide(g):
        G, flags = gate_cumsum_call(g, C=64, span=chunk_intra_mgpu.SPAN, interpret=gpu_run["interpret"])
        assert bool(jnp.array_equal(G, gate_cumsum_call(g, C=64, interpret=gpu_run["interpret"]), equal_nan=True))
        return flags.tolist()

    assert wide(g) == [[0, 0], [0, 0]]
    assert wide(g.at[31, 1, 5].set(-5.5)) == [[0, 0], [1, 0]]
    assert wide(g.at[100, 0, 63].set(76.0)) == [[0, 1], [0, 0]]
    assert wide(g.at[70, 1, 0].set(jnp.nan)) == [[0, 0], [0, 1]]


@pytest.mark.slow  # the heaviest interpret-mode cases (about 40 and 25 s on CI); compiled under -m gpu
def test_mosaic_kernel_a_for_unbounded_gates(gpu_run):
    """``prep_kernel="mosaic_gpu"`` (the default) without ``gate_lower_bound``, Kimi Linear gates
    below -5: where every sub-chunk spans at most 75 nats, the bits of the call that promises the
    bound (which only drops the check); with one chunk far steeper (the Triton intra-chunk kernel redoes it),
    within bf16 tolerance of the references, as the first (varlen, GVA, initial states,
    checkpoints, 2 segments). It lowers for the H200 with both kernels A in the program."""
    cu = jnp.array([0, 60, 160], jnp.int32)
    h0 = random_state(9, (2, 2, 64, 64))
    run = partial(prefill.chunk_kda, initial_state=h0, cu_seqlens=cu, checkpoint_stride=64, num_segments=2, **gpu_run)
    x = kda_inputs(9, 1, 160, 1, 2, 64, 64, dtype=jnp.bfloat16)
    assert float(x[3].min()) < -5.0
    got = run(*x)
    for a, b in zip(got, run(*x, prep_kernel="mosaic_gpu", gate_lower_bound=-5.0)):
        assert bool(jnp.array_equal(a, b))
    steep = (*x[:3], x[3].at[:, 60:124].multiply(100.0), x[4])  # the second sequence's first chunk
    for xs, out in ((x, got), (steep, run(*steep))):
        o_r, s_r = ref.naive_recurrent_kda(*xs, initial_state=h0, cu_seqlens=cu)
        _, _, ck_r = ref.chunk_kda(*xs, initial_state=h0, cu_seqlens=cu, checkpoint_stride=64)
        for a, b in zip(out, (o_r, s_r, ck_r)):
            assert_close(a, b, "bf16")
    module = _export("gpu", "cuda", H200, prep_kernel="mosaic_gpu")
    assert module.count("mosaic_gpu_v2") == 4 and module.count("xla.gpu.triton") == 4


def test_steep_chunks_take_the_triton_kernel_a(gpu_run):
    """Stage 1 with the Mosaic GPU intra-chunk kernel and unbounded gates, chunk by chunk: the chunks whose
    sub-chunks all span at most 75 nats get the bits of the unchecked Mosaic run, the steep one
    (flagged by the cumsum kernel, in both heads) those of the Triton intra-chunk kernel; all six outputs."""
    q, k, v, g, beta = (x[0] for x in kda_inputs(11, 1, 3 * C, 1, HV, K, K, dtype=jnp.bfloat16))
    g = g.at[C:2 * C].multiply(100.0)
    interpret = gpu_run["interpret"]
    assert gate_cumsum_call(g, C=C, span=chunk_intra_mgpu.SPAN, interpret=interpret)[1].tolist() == [[0, 1, 0]] * HV
    run = partial(chunk_prep_gpu.gpu_prep, q, k, v, g, beta[..., None], C=C, scale=K ** -0.5,
                  precision=prefill.default_precision(None, jnp.bfloat16), store_dtype=jnp.bfloat16,
                  interpret=interpret)
    for got, fast, exact in zip(run(kernel="mosaic_gpu"), run(kernel="mosaic_gpu", bounded=True), run()):
        got, fast, exact = (jnp.split(a, 3, axis=1) for a in (got, fast, exact))  # [HV, TT or NC, ...]
        for c, want in enumerate((fast, exact, fast)):
            assert bool(jnp.array_equal(got[c], want[c])), c


@pytest.mark.slow  # the heaviest interpret-mode cases (about 40 and 25 s on CI); compiled under -m gpu
def test_chunk_kda_with_the_mosaic_kernel_c(gpu_run):
    """``chunk_kda(wu_kernel="mosaic_gpu")`` beside the Mosaic GPU intra-chunk kernel, at the gate bound:
    varlen, GVA, initial states, 64-token checkpoints, 2 segments; against the references within
    bf16 tolerance. The default where it applies (16-bit k and v of one dtype), Triton's W/U kernel
    otherwise or when asked; it lowers for the H200 at a serving shape (K = V = 128), and is
    refused where it does not apply."""
    x = kda_inputs(8, 1, 228, 1, 2, 64, 64, lower_bound=-5.0, dtype=jnp.bfloat16, gate_scale=4.0)
    _chunk_kda_matches_the_references(jnp.array([0, 100, 228], jnp.int32), x, random_state(8, (2, 2, 64, 64)),
                                      gate_lower_bound=-5.0, prep_kernel="mosaic_gpu", wu_kernel="mosaic_gpu",
                                      **gpu_run)
    for kernel, mosaic in ((None, 4), ("mosaic_gpu", 4), ("triton", 3)):
        module = _export("gpu", "cuda", H200, gate_lower_bound=-5.0, wu_kernel=kernel)
        assert module.count("mosaic_gpu_v2") == mosaic and module.count("xla.gpu.triton") == 7 - mosaic
    f32_v = (*x[:2], x[2].astype(jnp.float32), *x[3:])  # k bf16, v float32: Triton's W/U kernel by default
    o, _ = prefill.chunk_kda(*f32_v, backend="gpu", interpret=True, gate_lower_bound=-5.0)
    assert o.shape == x[2].shape
    with pytest.raises(ValueError, match="wu_kernel must be"):
        prefill.chunk_kda(*x, backend="gpu", wu_kernel="mosaic")
    for bad in (tuple(a.astype(jnp.float32) for a in x), f32_v):
        with pytest.raises(ValueError, match="wu_kernel='mosaic_gpu' \\(W and U\\) runs on the GPU backend"):
            prefill.chunk_kda(*bad, backend="gpu", wu_kernel="mosaic_gpu")


@pytest.mark.slow  # CI time: the kernel runs interpreted in CI and compiled on the GPU
def test_the_mosaic_recurrence_lowers_for_the_h200():
    """jax.export for an abstract H200: the summary pass, the recurrence and stage 1's kernels A
    and C as Mosaic GPU kernels at a serving shape (bf16, K = V = 128, GVA, 2 segments), the
    cumsum, inverse and fold kernels on Triton; the default picks them there. Without
    ``gate_lower_bound`` the Triton intra-chunk kernel is in the program too (for gates too steep for the
    Mosaic one). The recurrence is Triton's where it does not apply (float32 intermediates) or
    where a Triton ``block_v`` is given; the intra-chunk kernel Triton's when asked."""
    for module in (_export("gpu", "cuda", H200, recurrence="mosaic_gpu"), _export("gpu", "cuda", H200)):
        assert module.count("mosaic_gpu_v2") == 4 and module.count("xla.gpu.triton") == 4
    for kw in (dict(intermediate_dtype=jnp.float32), dict(block_v=64)):
        module = _export("gpu", "cuda", H200, **kw)
        assert module.count("mosaic_gpu_v2") == 2 and module.count("xla.gpu.triton") == 6
    for bound, kernel, mosaic, triton in ((-5.0, None, 4, 3), (-5.0, "mosaic_gpu", 4, 3), (-5.0, "triton", 3, 4),
                                          (None, "triton", 3, 4)):
        module = _export("gpu", "cuda", H200, gate_lower_bound=bound, prep_kernel=kernel)
        assert module.count("mosaic_gpu_v2") == mosaic and module.count("xla.gpu.triton") == triton


def test_bad_arguments_are_rejected():
    x = kda_inputs(7, 1, 64, 1, 1, 64, 64, dtype=jnp.bfloat16)
    run = partial(prefill.chunk_kda, *x, backend="gpu", interpret=True)
    with pytest.raises(ValueError, match="recurrence must be"):
        run(recurrence="mosaic")
    with pytest.raises(ValueError, match="bfloat16 intermediates"):
        run(recurrence="mosaic_gpu", intermediate_dtype=jnp.float32)
    with pytest.raises(ValueError, match="chunk_size 64"):
        run(recurrence="mosaic_gpu", chunk_size=32)
    with pytest.raises(ValueError, match="GPU backend"):
        prefill.chunk_kda(*x, backend="tpu", recurrence="mosaic_gpu")
    with pytest.raises(ValueError, match="prep_kernel must be"):
        run(prep_kernel="mosaic")
    with pytest.raises(ValueError, match="16-bit inputs"):
        prefill.chunk_kda(*kda_inputs(7, 1, 64, 1, 1, 64, 64), backend="gpu", interpret=True, gate_lower_bound=-5.0,
                          prep_kernel="mosaic_gpu")
    with pytest.raises(ValueError, match="GPU backend"):
        prefill.chunk_kda(*x, backend="tpu", gate_lower_bound=-5.0, prep_kernel="mosaic_gpu")
    f32_prep = tuple(a.astype(jnp.float32) for a in _prep(2))
    with pytest.raises(ValueError, match="block_v must be 32 or 64"):
        run(recurrence="mosaic_gpu", block_v=128)
    with pytest.raises(ValueError, match="takes bf16 intermediates"):
        recurrence_mgpu.scan_call(f32_prep, None, jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32),
                               jnp.zeros(NC, jnp.int32), n_ck_slots=1)
    bounds = (jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), jnp.zeros((1, 3), jnp.int32))
    for kw in (dict(summary=True), dict(summary=True, K=128, block_v=32), dict(K=128, out_dtype=jnp.float32),
               dict(K=128, block_v=32, out_dtype=jnp.bfloat16), dict(cta_cols=256, K=128)):
        K_ = kw.pop("K", K)
        with pytest.raises(ValueError, match="cta_cols is one of"):
            recurrence_mgpu.scan_call(_prep(2, K_), None, *bounds, n_ck_slots=1, **{"cta_cols": 128, **kw})
