"""The Pallas chunked prefill kernels against the k3jax references.

CPU: the TPU kernels in the Mosaic interpreter (race detection, NaN-initialised memory, two
simulated cores, shuffled parallel grid order) and the GPU kernels in the generic interpreter;
both lowerings are checked with ``jax.export``. ``-m gpu`` on a GPU runs the compiled kernels.
Shapes are small: the interpreters run every grid step in Python.
"""

from __future__ import annotations

import re
from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

from k3jax.ops import kda as ref
from k3jax.ops.segments import apply_segment, segment_initial_states
from pallas_kernels.kda import chunk_prep_gpu, prefill, recurrence_triton, segment_plan
from pallas_kernels.kda.common import GPU_PRECISION
from pallas_kernels.kda.wy_fast_triton import _inverse_body
from tests.helpers import GPU_RUNS, GPU_RUNS_SLOW_INTERPRET, assert_close, kda_inputs, kernel_backends, random_state, skip_compiled_on_cpu

TPU_INTERPRET = pltpu.InterpretParams(
    detect_races=True, num_cores_or_threads=2, random_seed=3, uninitialized_memory="nan"
)
run = kernel_backends("tpu", TPU_INTERPRET)
H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")  # for jax.export to CUDA


def _kinds(dtype):
    return ("bf16", "bf16") if dtype == jnp.bfloat16 else ("f32_out", "f32_state")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_gva_initial_state_checkpoints(run, dtype):
    """B = 2, T not a multiple of the chunk, GVA (HV = 2 H), initial state, K3 gates, 64-token checkpoints."""
    B, T, H, HV, K, V = 2, 136, 1, 2, 32, 64
    x = kda_inputs(1, B, T, H, HV, K, V, lower_bound=-5.0, dtype=dtype)
    h0 = random_state(1, (B, HV, K, V))
    o, s, ck = prefill.chunk_kda(*x, initial_state=h0, checkpoint_stride=64, **run)
    o_r, s_r = ref.naive_recurrent_kda(*x, initial_state=h0)
    _, _, ck_r = ref.chunk_kda(*x, initial_state=h0, checkpoint_stride=64)
    out, state = _kinds(dtype)
    chex.assert_type(o, dtype)
    chex.assert_shape(ck, (B, 2, HV, K, V))
    assert_close(o, o_r, out)
    assert_close(s, s_r, state)
    assert_close(ck, ck_r, state)


def test_varlen_segments_and_padding(run):
    """Packed sequences (one empty, one shorter than a chunk), NaN padding past cu_seqlens[-1],
    chunk 16, 32-token checkpoints; on the GPU also 3 segments per sequence."""
    T, H, HV, K, V = 168, 2, 2, 32, 32
    q, k, v, g, beta = kda_inputs(2, 1, T, H, HV, K, V, gate_scale=2.0)
    cu = jnp.array([0, 70, 70, 79, 160], jnp.int32)
    poison = lambda x: x.at[:, 160:].set(jnp.nan)
    x = tuple(poison(a) for a in (q, k, v, g, beta))
    h0 = random_state(2, (4, HV, K, V))
    kw = dict(initial_state=h0, cu_seqlens=cu, chunk_size=16, checkpoint_stride=32)
    o_r, s_r = ref.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    _, _, ck_r = ref.chunk_kda(q, k, v, g, beta, **kw)
    segments = [None, 3] if run["backend"] != "tpu" else [None]
    for P in segments:
        o, s, ck = prefill.chunk_kda(*x, num_segments=P, **kw, **run)
        assert not np.any(np.asarray(o[:, 160:]))  # padding outputs are exactly zero
        assert_close(o[:, :160], o_r[:, :160], "f32_out")
        assert_close(s, s_r, "f32_state")
        assert_close(ck, ck_r, "f32_state")


def test_initial_state_hook(run):
    """``initial_state_fn`` gets each sequence's own map (GPU: from the segment summary pass,
    here with 3 segments) and the kernel runs from the states it returns: each sequence's
    state after one pass from h0."""
    T, cu = 96, jnp.array([0, 40, 40, 96], jnp.int32)
    q, k, v, g, beta = kda_inputs(6, 1, T, 1, 2, 32, 32, lower_bound=-5.0)
    h0 = random_state(6, (3, 2, 32, 32))
    _, S1 = ref.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    hook = lambda M, E: jnp.einsum("nhij,nhjv->nhiv", M, h0, precision="highest") + E
    # GPU: 3 segments and a summary column block unlike the recurrence's; TPU: chunk 32 (half the
    # interpreted grid steps).
    gpu = run["backend"] != "tpu"
    o, S2 = prefill.chunk_kda(q, k, v, g, beta, cu_seqlens=cu, chunk_size=16 if gpu else 32,
                              num_segments=3 if gpu else None, initial_state_fn=hook, summary_block_v=16, **run)
    o_ref, S2_ref = ref.naive_recurrent_kda(q, k, v, g, beta, initial_state=S1, cu_seqlens=cu)
    assert_close(o, o_ref, "f32_out")
    assert_close(S2, S2_ref, "f32_state")


@pytest.mark.parametrize("bound", [None, -5.0], ids=["exact-diagonal", "bounded-gate-diagonal"])
def test_no_future_leakage_at_the_gate_bound(run, bound):
    """Gates at the K3 bound (-5 per token, 320 nats per 64-token chunk): exact against the
    recurrence, and perturbing tokens after t0 (inside t0's 16-token sub-chunk) leaves every
    output up to t0 bit-identical. Also with ``gate_lower_bound`` (GPU: the diagonal blocks as
    anchored matmuls, spanning 75 nats per 16-token sub-chunk here)."""
    if bound is not None and run["backend"] == "tpu":
        pytest.skip("gate_lower_bound changes the GPU kernels only")
    T, H, HV, K, V, t0 = 64, 1, 1, 32, 32, 37
    q, k, v, g, beta = kda_inputs(3, 1, T, H, HV, K, V, lower_bound=-5.0, gate_scale=30.0)
    o, _ = prefill.chunk_kda(q, k, v, g, beta, gate_lower_bound=bound, **run)
    assert_close(o, ref.naive_recurrent_kda(q, k, v, g, beta)[0], "f32_out")
    q2, k2, v2, g2, beta2 = kda_inputs(5, 1, T, H, HV, K, V, lower_bound=-5.0)  # new, still normalised, tokens
    later = lambda x, y: x.at[:, t0 + 1 :].set(y[:, t0 + 1 :])
    o2, _ = prefill.chunk_kda(later(q, q2), later(k, k2), later(v, v2), later(g, g2), later(beta, beta2),
                              gate_lower_bound=bound, **run)
    np.testing.assert_array_equal(np.asarray(o[:, : t0 + 1]), np.asarray(o2[:, : t0 + 1]))
    assert not np.array_equal(np.asarray(o[:, t0 + 1 :]), np.asarray(o2[:, t0 + 1 :]))


@pytest.mark.parametrize("run", GPU_RUNS)
def test_diagonal_fallback_past_the_gate_span(run):
    """The GPU intra-chunk kernel forms a row's diagonal block by anchored matmuls while the row's gate span is
    at most 60 nats, by exact differences past it. One channel decays 6 nats a token, so rows 11+
    of each sub-chunk fall back: exact against the recurrence, and outputs up to t0 (row 5 of its
    sub-chunk) bit-identical when later tokens change to gates that never fall back (the
    sub-chunk then takes only the matmul branch)."""
    T, K, V, t0 = 64, 32, 32, 37
    q, k, v, g, beta = kda_inputs(8, 1, T, 1, 1, K, V, lower_bound=-5.0)
    g = g.at[..., 0].set(-6.0)
    o, _ = prefill.chunk_kda(q, k, v, g, beta, **run)
    assert_close(o, ref.naive_recurrent_kda(q, k, v, g, beta)[0], "f32_out")
    g2 = g.at[:, t0 + 1:].multiply(0.1)
    o2, _ = prefill.chunk_kda(q, k, v, g2, beta, **run)
    np.testing.assert_array_equal(np.asarray(o[:, : t0 + 1]), np.asarray(o2[:, : t0 + 1]))
    assert not np.array_equal(np.asarray(o[:, t0 + 1:]), np.asarray(o2[:, t0 + 1:]))


def test_repeated_keys_stay_exact(run):
    """One key repeated through a chunk (||Akk|| ~ C) with beta near 1: the float32 solve holds."""
    T, K, V = 64, 32, 32
    q, k, v, g, beta = kda_inputs(4, 1, T, 1, 1, K, V)
    k = jnp.broadcast_to(k[:, :1], k.shape)
    beta = jnp.full_like(beta, 0.99)
    g = g * 0.01
    o, s = prefill.chunk_kda(q, k, v, g, beta, **run)
    o_r, s_r = ref.naive_recurrent_kda(q, k, v, g, beta)
    assert_close(o, o_r, "f32_out")
    assert_close(s, s_r, "f32_state")


def _strictly_lower_cases(seed, n=64):
    """The all-ones strictly lower N (one repeated key, beta = 1; a Neumann series cancels
    catastrophically there, the true inverse is bidiagonal) and N from random unit keys."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, 32))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    return np.tril(np.ones((n, n)), -1), np.tril(rng.uniform(0, 1, (n, 1)) * (k @ k.T), -1)


def test_inverse_kernel():
    """The GPU inverse kernel (``wy_fast_triton``: the 16 x 16 diagonal blocks' inverses, then forward
    substitution over blocks) against the float64 inverse, on :func:`_strictly_lower_cases` with
    junk (7) on and above the diagonal, which must not enter; the blocks above the diagonal come
    out exactly zero."""
    n = 64
    for N in _strictly_lower_cases(1, n):
        want = np.linalg.inv(np.eye(n) + N)
        X = pl.pallas_call(partial(_inverse_body, precision=jax.lax.Precision.HIGHEST),
                           out_shape=jax.ShapeDtypeStruct((n, n), jnp.float32), interpret=True)(
            jnp.asarray(N + np.triu(np.full((n, n), 7.0)), jnp.float32))
        assert_close(X, want, "f32_out")
        assert bool(jnp.all(jnp.triu(X, 16) == 0)) and bool(jnp.all(jnp.isfinite(X)))


@pytest.mark.parametrize("run", GPU_RUNS_SLOW_INTERPRET)
def test_bf16_intermediates(run):
    """GPU stages passing bfloat16 through memory (the default for bf16 inputs): within bf16
    tolerance of the reference (outputs, final state, checkpoints), through the segment summary
    pass too, and not the float32-intermediate result (the option takes effect)."""
    B, T, H, HV, K, V = 1, 200, 1, 2, 32, 64
    x = kda_inputs(5, B, T, H, HV, K, V, lower_bound=-5.0, dtype=jnp.bfloat16)
    h0 = random_state(5, (B, HV, K, V))
    kw = dict(initial_state=h0, checkpoint_stride=64, num_segments=2, **run)
    o, s, ck = prefill.chunk_kda(*x, intermediate_dtype=jnp.bfloat16, **kw)
    o32, _, _ = prefill.chunk_kda(*x, intermediate_dtype=jnp.float32, **kw)
    assert bool(jnp.array_equal(prefill.chunk_kda(*x, **kw)[0], o))
    o_r, s_r = ref.naive_recurrent_kda(*x, initial_state=h0)
    _, _, ck_r = ref.chunk_kda(*x, initial_state=h0, checkpoint_stride=64)
    chex.assert_type([o, s, ck], [jnp.bfloat16, jnp.float32, jnp.float32])
    assert_close(o, o_r, "bf16")
    assert_close(s, s_r, "bf16")
    assert_close(ck, ck_r, "bf16")
    assert not bool(jnp.array_equal(o, o32))


def test_gate_cumsum_kernel_and_default_precisions():
    """The GPU cumsum kernel restarts every chunk; 16-bit inputs get bf16 recurrence operands
    (float32 accumulation) and TF32 stage-1 products, float32 inputs TF32x3 everywhere."""
    g = -jax.random.uniform(jax.random.key(8), (96, 3, 32), maxval=5.0)
    G = chunk_prep_gpu.gate_cumsum_call(g, C=32, interpret=True)
    assert_close(G, jnp.cumsum(g.reshape(3, 32, 3, 32), axis=1).reshape(96, 3, 32), "f32_state")
    presets = jax.lax.DotAlgorithmPreset
    assert prefill.default_precision(None, jnp.bfloat16, scan=True) == presets.BF16_BF16_F32
    assert prefill.default_precision(None, jnp.bfloat16) == presets.TF32_TF32_F32
    assert prefill.default_precision(None, jnp.float32, scan=True) == GPU_PRECISION
    assert prefill.default_precision(presets.F32_F32_F32, jnp.bfloat16, scan=True) == presets.F32_F32_F32


def test_summary_pass_skips_and_starts():
    """The GPU summary pass (interpreted): a segment whose E columns start from a state returns
    ``M S + E`` of the full map there; skipped column blocks return their start (I, 0)."""
    T, H, K, V, C = 64, 1, 16, 32, 16
    q, k, v, g, beta = (x.reshape(T, *x.shape[2:]) for x in kda_inputs(9, 1, T, H, H, K, V))
    prep = chunk_prep_gpu.gpu_prep(q, k, v, g, beta[..., None], C=C, scale=K**-0.5, precision=None, interpret=True)
    vstart, vend = jnp.array([0, 2], jnp.int32), jnp.array([2, 4], jnp.int32)  # two segments of two chunks
    run = partial(recurrence_triton.scan_call, prep, vstart=vstart, vend=vend, n_ck_slots=1, summary=True, block_v=16,
                  interpret=True)
    full = run(None, ck_slot=jnp.array([[-1, 1, 1], [-1, 1, 1]], jnp.int32))
    S0 = random_state(9, (1, H, K, V))
    part = run(S0, ck_slot=jnp.array([[0, 0, 1], [-1, 0, 0]], jnp.int32))
    M, E = full[0, 0, :, :K], full[0, 0, :, K:]
    assert_close(part[0, 0, :, K:], M @ S0[0, 0] + E, "f32_state")
    eye = jnp.eye(K)
    assert bool(jnp.array_equal(part[0, 0, :, :K], eye)) and bool(jnp.array_equal(part[1, 0, :, :K], eye))
    assert not np.any(np.asarray(part[1, 0, :, K:]))
    assert not bool(jnp.allclose(full[1, 0, :, :K], eye))  # the skipped segment's map is not the identity


@pytest.mark.parametrize("run", GPU_RUNS)
@pytest.mark.parametrize("P, block_k", [(2, 32), (3, 16), (6, 32), (6, 16)])
def test_fold_kernel_matches_the_exclusive_scan(P, block_k, run):
    """The GPU fold (``recurrence_triton.fold_call``) gives the reference exclusive scan's
    starts (``segment_initial_states``) from ``[M | E]`` as the summary pass leaves it: the first
    segment's E columns already run from the start; its M and the last segment's map are NaN
    here, so reading them fails the test. ``block_k = 16`` holds the state as two row blocks."""
    ks = jax.random.split(jax.random.key(P), 3)
    N, HV, K, V = 2, 3, 32, 32
    M = 0.2 * jax.random.normal(ks[0], (N, P, HV, K, K))
    E = jax.random.normal(ks[1], (N, P, HV, K, V))
    init = random_state(P, (N, HV, K, V))
    want = segment_initial_states((M, E), init)
    ME = jnp.concatenate([M, E.at[:, 0].set(apply_segment((M[:, 0], E[:, 0]), init))], axis=-1)
    ME = ME.at[:, 0, ..., :K].set(jnp.nan).at[:, -1].set(jnp.nan)
    skip_compiled_on_cpu(run)
    got = recurrence_triton.fold_call(ME.reshape(N * P, HV, K, K + V), init, P=P, block_v=16, block_k=block_k,
                                interpret=run["interpret"])
    assert got.shape == (N * P, HV, K, V)
    assert_close(got.reshape(N, P, HV, K, V), want, "f32_state")
    with pytest.raises(ValueError, match="do not match"):
        recurrence_triton.fold_call(ME.reshape(N * P, HV, K, K + V), init, P=P + 1, interpret=True)


def test_bad_arguments_are_rejected():
    x = kda_inputs(7, 1, 32, 1, 1, 24, 16)
    with pytest.raises(ValueError, match="powers of two"):
        prefill.chunk_kda(*x, backend="gpu")
    with pytest.raises(ValueError, match="GPU kernels only"):
        prefill.chunk_kda(*x, backend="tpu", num_segments=2)
    with pytest.raises(ValueError, match="chunk_size"):
        prefill.chunk_kda(*x, chunk_size=128)
    with pytest.raises(ValueError, match="GPU kernels only"):
        prefill.chunk_kda(*x, backend="tpu", intermediate_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="gate_lower_bound"):
        prefill.chunk_kda(*x, backend="tpu", gate_lower_bound=-6.0)
    with pytest.raises(ValueError, match="intermediate_dtype"):
        prefill.chunk_kda(*x, backend="tpu", intermediate_dtype=jnp.float16)
    with pytest.raises(ValueError, match="initial_state"):
        prefill.chunk_kda(*x, initial_state=jnp.zeros((2, 1, 24, 16)))


def test_plan_segments():
    plan = partial(segment_plan.plan_segments, V=128, max_chunks=2048, backend="gpu", num_cores=132)
    assert plan(1, 32) == 1  # 64 programs: heads already fill the device
    mosaic = partial(plan, recurrence="mosaic_gpu")
    assert mosaic(1, 32) == 2 and mosaic(1, 48) == 1 and mosaic(8, 32, max_chunks=64) == 1
    # H = 12: P = 5 fills the SMs in the recurrence (120 CTAs); its summary pass takes one wave at
    # 128 columns per CTA (84 CTAs), two at 64 (168). P = 11 takes two full waves in the recurrence
    # and one in the summary at 256 columns (120 CTAs; 228 at 128).
    assert mosaic(1, 12) == 11 and mosaic(1, 4) == 16 and mosaic(1, 4, max_chunks=64) == 4
    cost = partial(segment_plan.mosaic_segment_cost, 1, 12, 128, 128, 2048, num_cores=132)
    assert cost(5) == (1 + 1.0 * 1) * (2048 / 5 + 4) + 6 * 4 and cost(1) == 2048 + 4
    assert cost(4) == (1 + 0.75 * 1) * (512 + 4) + 6 * 3  # 120 summary CTAs at 64 columns: one wave
    assert cost(11) == (2 + 1.6 * 1) * (2048 / 11 + 4) + 6 * 10 < cost(5) < cost(4)
    # With the recurrence at 128 columns per CTA too (two warpgroups of 64): it takes the width that
    # costs fewer waves, at 1.9 of a 64-column wave.
    wide = partial(mosaic, recurrence_widths=(64, 128))
    rec_cols = partial(segment_plan.recurrence_cta_cols, V=128, widths=(64, 128), num_cores=132)
    assert wide(1, 12) == 11 and rec_cols(1, 12, P=11) == 128  # 132 CTAs against 264 (two waves)
    assert rec_cols(1, 12, P=12) == 64  # 2 waves of 144 CTAs (3.8) against 3 of 288 (3)
    assert wide(1, 32) == wide(1, 32, max_chunks=513) == 2 and rec_cols(1, 32, P=2) == 64  # one wave either way
    assert wide(8, 32, max_chunks=64) == 1 and rec_cols(8, 32, P=1) == 128  # 2 waves against 4
    assert wide(1, 4) == 16 and rec_cols(1, 4, P=16) == 64
    assert cost(11, recurrence_widths=(64, 128)) == (1.9 + 1.6) * (2048 / 11 + 4) + 6 * 10
    cols = partial(segment_plan.summary_cta_cols, 1, num_cores=132)
    assert cols(12, 128, 128, 5) == 128 and cols(12, 128, 128, 4) == 64  # the same waves: the faster chunks
    assert cols(12, 128, 128, 11) == 256 and cols(4, 128, 128, 16) == 128  # one wave against two; one each
    assert cols(12, 128, 128, 5, block_v=32) == cols(12, 64, 128, 5) == 64  # 128 needs two warpgroups of 64, K % 128
    assert cols(32, 128, 128, 3, paid=True) == 256  # 96 CTAs at 256 columns (1 wave) against 192 (2) at 128
    assert plan(1, 4) == 16 and plan(1, 12) == 5 and plan(1, 4, block_v=32) == 8  # fill the 132 SMs
    assert plan(1, 12, block_v=32) == 1  # 2 segments for 48 programs: not worth the summary pass
    assert plan(1, 4, max_chunks=32) == 1  # too short to split
    assert plan(1, 32, summary_paid=True) == 3  # the summary runs anyway: fill the SMs
    assert plan(1, 128, summary_paid=True) == 1 and plan(1, 32, max_chunks=32, summary_paid=True) == 2
    assert segment_plan.plan_segments(1, 4, 128, 2048, backend="tpu") == 1


def _export(backend, platform, device, K=128, V=128, **kw):
    B, T, H, HV = 1, 256, 2, 4
    spec = jax.ShapeDtypeStruct
    args = (spec((B, T, H, K), jnp.bfloat16), spec((B, T, H, K), jnp.bfloat16), spec((B, T, HV, V), jnp.bfloat16),
            spec((B, T, HV, K), jnp.float32), spec((B, T, HV), jnp.bfloat16))
    f = jax.jit(partial(prefill.chunk_kda, backend=backend, interpret=False, checkpoint_stride=128,
                        num_segments=None if backend == "tpu" else 2, **kw))
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")] if backend == "gpu" else []
    with use_abstract_mesh(mesh):
        return jax.export.export(f, platforms=[platform], disabled_checks=checks)(*args).mlir_module()


def test_kernels_lower_for_tpu_and_gpu():
    """Mosaic accepts the TPU kernels and the Triton lowering accepts the GPU kernels (incl. the
    segment summary pass, the fold and both stage-1 kernels) at serving shapes: bf16, K = V = 128, GVA;
    and both at K = V = 256 (where the GPU recurrence falls back to Triton: the Mosaic GPU one
    takes K <= 128; stage 1's W/U kernel is Mosaic GPU's for these bf16 inputs)."""
    tpu = AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    assert _export("tpu", "tpu", tpu).count("tpu_custom_call") >= 2
    assert _export("tpu", "tpu", tpu, K=256, V=256).count("tpu_custom_call") >= 2
    module = _export("gpu", "cuda", H200, K=256, V=256)
    assert module.count("xla.gpu.triton") == 6 and module.count("mosaic_gpu_v2") == 1
    # The summary pass and the recurrence run one pipeline stage there (three overflow the H200's
    # shared memory), three at K = 128.
    scan_stages = lambda m: re.findall(r'name = "_scan_kernel", num_stages = (\d+)', m)
    assert scan_stages(module) == ["1", "1"]
    module = _export("gpu", "cuda", H200, recurrence="triton")
    assert module.count("xla.gpu.triton") >= 5 and scan_stages(module) == ["3", "3"]
    fast = dict(intermediate_dtype=jnp.bfloat16, gate_lower_bound=-5.0, recurrence="triton")  # the opt-in variants
    assert _export("gpu", "cuda", H200, **fast).count("xla.gpu.triton") >= 5


def test_head_dim_256(run):
    """K = V = 256: float32 against the recurrence (a chunk and a partial one, initial state); the
    GPU kernels run float32 inputs this wide as a bf16 call (float32 outputs, bf16 accuracy). The
    lowerings at that size are in :func:`test_kernels_lower_for_tpu_and_gpu`."""
    x = kda_inputs(4, 1, 80, 1, 1, 256, 256, lower_bound=-5.0)
    h0 = random_state(4, (1, 1, 256, 256))
    o, s = prefill.chunk_kda(*x, initial_state=h0, **run)
    o_r, s_r = ref.naive_recurrent_kda(*x, initial_state=h0)
    assert o.dtype == s.dtype == jnp.float32
    as_bf16 = prefill._backend(run["backend"]) == "gpu"
    assert_close(o, o_r, "bf16" if as_bf16 else "f32_out")
    assert_close(s, s_r, "bf16" if as_bf16 else "f32_state")

