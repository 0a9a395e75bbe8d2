"""Test-wide JAX and hypothesis settings (imported by pytest before any test module)."""

import os
import tempfile

# The suite is dominated by XLA:CPU compiling many small programs once each: LLVM's -O0
# halves compile time (the engine's second-turn test: 87 -> 52 s) and costs little run time
# here. Read when the backend initialises; the server processes the tests start inherit it.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Eight fake CPU devices for sharding tests; must be set before any backend initialises.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_enable_x64", False)

# One persistent compilation cache per test run and xdist worker, shared with the server
# processes a worker starts (they inherit the environment): an engine of the same shapes there
# compiles once. Not shared between workers: JAX writes entries in place, without a lock, and
# two workers crashed (SIGSEGV in a step call) with one shared cache.
_run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
_worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"k3jax-jax-cache-{_run}-{_worker}"))
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=5,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


from tests.helpers import GPU_RUNS, skip_compiled_on_cpu  # noqa: E402  (after the JAX settings above)


@pytest.fixture(params=GPU_RUNS)
def gpu_run(request):
    """The GPU kernels in the generic interpreter and compiled (``GPU_RUNS``; the compiled run is
    skipped on CPU)."""
    skip_compiled_on_cpu(request.param)
    return request.param
