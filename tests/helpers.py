"""Shared test helpers: the one tolerance table, the kernel-backend fixtures; the error metric and
random KDA inputs come from :mod:`k3jax.testing` (shared with the benchmarks)."""

from __future__ import annotations

import json

import chex
import jax
import numpy as np
import pytest

from k3jax.testing import kda_inputs, random_cu_seqlens, random_state, rel_rms  # noqa: F401  (re-exported)

# Relative RMS error bounds against a float32/float64 reference (KDA.md).
TOL = {
    "f32_out": 5e-4,
    "f32_state": 2e-3,
    "bf16": 5e-3,
}


def assert_close(x, ref, kind: str):
    """Fail unless ``rel_rms(x, ref) <= TOL[kind]`` (NaN never passes)."""
    err = rel_rms(x, ref)
    chex.assert_equal_shape([x, ref])
    assert err <= TOL[kind], f"relative RMS error {err:.3e} > {TOL[kind]:.1e} ({kind})"


# The GPU kernels in the generic interpreter, and compiled (``-m gpu``).
GPU_RUNS = [
    pytest.param(dict(backend="gpu", interpret=True), id="gpu-interpret"),
    pytest.param(dict(backend=None, interpret=False), id="compiled", marks=pytest.mark.gpu),
]
# For cases whose interpreted run is long (CI time) and whose kernel another case interprets:
# the interpreter run is marked slow, the compiled one stays a GPU test.
GPU_RUNS_SLOW_INTERPRET = [pytest.param(*GPU_RUNS[0].values, id="gpu-interpret", marks=pytest.mark.slow), GPU_RUNS[1]]


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


def triton_calls_for_h200(f, *args) -> int:
    """Triton custom calls in ``jax.export`` of ``f(*args)`` for an abstract NVIDIA H200 (the
    Pallas Triton kernels lower on CPU; ``args`` may be ``jax.ShapeDtypeStruct``)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with use_abstract_mesh(mesh):
        module = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()
    return module.count("xla.gpu.triton")
