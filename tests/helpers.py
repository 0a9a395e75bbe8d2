"""Shared test helpers: the one tolerance table, error metric and random KDA inputs."""

from __future__ import annotations

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.kda import kda_gate, l2norm

# Relative RMS error bounds against a float32/float64 reference (KDA.md).
TOL = {
    "f32_out": 5e-4,
    "f32_state": 2e-3,
    "bf16": 5e-3,
}


def rel_rms(x, ref) -> float:
    """``||x - ref|| / ||ref||`` in float64; NaN anywhere gives inf."""
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(ref))):
        return float("inf")
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_close(x, ref, kind: str):
    """Fail unless ``rel_rms(x, ref) <= TOL[kind]`` (NaN never passes)."""
    err = rel_rms(x, ref)
    chex.assert_equal_shape([x, ref])
    assert err <= TOL[kind], f"relative RMS error {err:.3e} > {TOL[kind]:.1e} ({kind})"


def kda_inputs(seed, B, T, H, HV, K, V, *, lower_bound=None, dtype=jnp.float32, gate_scale=1.0):
    """Fresh random KDA inputs: L2-normalised q/k, gates from :func:`kda_gate`, beta in (0, 1)."""
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


def random_state(seed, shape):
    return jax.random.normal(jax.random.key(seed + 1000), shape, jnp.float32)


def random_cu_seqlens(rng: np.random.Generator, T: int, N: int, pad: int = 0) -> np.ndarray:
    """``N`` sequence lengths (zeros and ones included) summing to ``T - pad``."""
    cuts = np.sort(rng.integers(0, T - pad + 1, size=N - 1))
    return np.concatenate([[0], cuts, [T - pad]]).astype(np.int32)


# The GPU kernels in the generic interpreter, and compiled (``-m gpu``).
GPU_RUNS = [
    pytest.param(dict(backend="gpu", interpret=True), id="gpu-interpret"),
    pytest.param(dict(backend=None, interpret=False), id="compiled", marks=pytest.mark.gpu),
]


def skip_compiled_on_cpu(opts):
    """Skip a compiled-kernel run (``interpret=False``) where only the CPU backend exists."""
    if opts["interpret"] is False and jax.default_backend() == "cpu":
        pytest.skip("compiled kernels need an accelerator")


def kernel_backends(tpu_backend: str, tpu_interpret):
    """A ``run`` fixture over the Pallas backends: the TPU kernels in the Mosaic interpreter
    (``tpu_interpret``; fails the test on a detected race), the GPU kernels in the generic
    interpreter, and the compiled kernels (``-m gpu``, skipped on CPU)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
    from jax.experimental.pallas import tpu as pltpu

    params = [pytest.param(dict(backend=tpu_backend, interpret=tpu_interpret), id="tpu-interpret"), *GPU_RUNS]

    @pytest.fixture(params=params)
    def run(request):
        opts = request.param
        skip_compiled_on_cpu(opts)
        yield opts
        if opts["interpret"] is tpu_interpret:
            races = tpu_interpreter.races
            assert races is None or not races.races_found, "the TPU interpreter detected a data race"
            pltpu.reset_tpu_interpret_mode_state()

    return run


def rewrite_safetensors(path, fn):
    """Replace ``path/model.safetensors`` by ``fn(its tensors as a dict)`` (for broken-checkpoint tests)."""
    from k3jax.model.loader import read_safetensors

    t = fn(dict(read_safetensors(str(path / "model.safetensors"))))
    names = {"bfloat16": "BF16", "float32": "F32", "uint8": "U8"}
    header, blobs, off = {}, [], 0
    for k, v in t.items():
        b = np.ascontiguousarray(v).tobytes()
        header[k] = {"dtype": names[v.dtype.name], "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    with open(path / "model.safetensors", "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))
