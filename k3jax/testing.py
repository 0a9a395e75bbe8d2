"""What the tests and the benchmarks share: named KDA shapes, input factories, the error metric.

Two input distributions, each with its own factory so neither's bits change:
:func:`kda_inputs` (the tests': GVA, any dtype, random ``dt_bias`` so some gates are steep) and
:func:`kda_bench_inputs` (the benchmarks': ``HV = H``, bf16, ``dt_bias = 0``, the inputs every
number in ``docs/benchmarks.md`` was measured on); :func:`kda_window_inputs` for decode windows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.kda import kda_gate, l2norm

# (B, T, H) with K = V = 128: the Pallas prefill against fla (benchmarks.kda_prefill) and the
# XLA chunked path against fla (benchmarks.kda_reference).
PREFILL_SHAPES = [(1, 32768, 32), (8, 4096, 32), (1, 8192, 96), (1, 131072, 32), (1, 131072, 4), (1, 131072, 12)]
XLA_PREFILL_SHAPES = [(1, 8192, 32), (1, 32768, 32), (8, 4096, 32), (1, 8192, 96), (1, 131072, 32)]


def rel_rms(x, ref) -> float:
    """``||x - ref|| / ||ref||`` in float64; NaN or inf anywhere gives inf (never passes a bound)."""
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(ref))):
        return float("inf")
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def kda_inputs(seed, B, T, H, HV, K, V, *, lower_bound=None, dtype=jnp.float32, gate_scale=1.0):
    """Random KDA inputs for tests: L2-normalised q/k, gates from :func:`kda_gate` (random ``A_log``
    in (-1, 1) and ``dt_bias``; ``gate_scale`` scales the raw gate), beta in (0, 1).

    Returns ``(q, k [B, T, H, K], v [B, T, HV, V], g f32[B, T, HV, K], beta [B, T, HV])``, all but
    ``g`` in ``dtype``.
    """
    ks = jax.random.split(jax.random.key(seed), 8)
    q = l2norm(jax.random.normal(ks[0], (B, T, H, K)))
    k = l2norm(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, HV, V))
    A_log = jax.random.uniform(ks[5], (HV,), minval=-1.0, maxval=1.0)
    dt_bias = jax.random.normal(ks[6], (HV * K,))
    g = kda_gate(gate_scale * jax.random.normal(ks[3], (B, T, HV, K)), A_log, dt_bias, lower_bound=lower_bound)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV)))
    cast = lambda x: x.astype(dtype)
    return cast(q), cast(k), cast(v), g, cast(beta)


def kda_bench_inputs(seed, B, T, H, K=128, V=128, dtype=jnp.bfloat16, lower_bound=None):
    """Random KDA inputs for benchmarks (``HV = H``): as :func:`kda_inputs` but ``A_log`` in
    (-1, 0.5) and ``dt_bias = 0``; ``lower_bound=None`` gives Kimi Linear gates, -5 K3's.

    Returns ``(q, k [B, T, H, K], v [B, T, H, V], g f32[B, T, H, K], beta [B, T, H])``.
    """
    ks = jax.random.split(jax.random.key(seed), 6)
    q = l2norm(jax.random.normal(ks[0], (B, T, H, K))).astype(dtype)
    k = l2norm(jax.random.normal(ks[1], (B, T, H, K))).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, H, V), dtype)
    A_log = jax.random.uniform(ks[5], (H,), minval=-1.0, maxval=0.5)
    g = kda_gate(jax.random.normal(ks[3], (B, T, H, K)), A_log, jnp.zeros(H * K), lower_bound=lower_bound)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))).astype(dtype)
    return q, k, v, g, beta


def kda_window_inputs(seed, B, T, H, K=128, V=128):
    """Random bf16 decode windows (``HV = H``, ``A_log = dt_bias = 0``) for the decode benchmarks.

    Returns ``(q, k bf16[B, T, H, K], v bf16[B, T, H, V], g f32[B, T, H, K], beta bf16[B, T, H])``.
    """
    ks = jax.random.split(jax.random.key(seed), 6)
    q = l2norm(jax.random.normal(ks[0], (B, T, H, K))).astype(jnp.bfloat16)
    k = l2norm(jax.random.normal(ks[1], (B, T, H, K))).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, H, V), jnp.bfloat16)
    g = kda_gate(jax.random.normal(ks[3], (B, T, H, K)), jnp.zeros(H), jnp.zeros(H * K))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))).astype(jnp.bfloat16)
    return q, k, v, g, beta


def random_state(seed, shape):
    """A float32 normal state (e.g. ``[N, HV, K, V]``), its key offset from the inputs' seeds."""
    return jax.random.normal(jax.random.key(seed + 1000), shape, jnp.float32)


def random_cu_seqlens(rng: np.random.Generator, T: int, N: int, pad: int = 0) -> np.ndarray:
    """``N`` sequence lengths (zeros and ones included) summing to ``T - pad``, as i32[N + 1]."""
    cuts = np.sort(rng.integers(0, T - pad + 1, size=N - 1))
    return np.concatenate([[0], cuts, [T - pad]]).astype(np.int32)
