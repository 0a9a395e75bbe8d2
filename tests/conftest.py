"""Test-wide JAX and hypothesis settings (imported by pytest before any test module)."""

import gc
import os
import tempfile

# The suite is dominated by XLA:CPU compiling many small programs once each: LLVM's -O0
# halves compile time (the engine's second-turn test: 87 -> 52 s) and costs little run time
# here; skipping LLVM's expensive passes takes about 10% more off (a K3 test: 21.8 -> 19.8 s).
# Read when the backend initialises; the server processes the tests start inherit it.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true").strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Eight fake CPU devices for sharding tests; must be set before any backend initialises.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_enable_x64", False)

# One persistent compilation cache per test run and xdist worker, shared with the server
# processes a worker starts (they inherit the environment): an engine of the same shapes there
# compiles once. Not shared between workers: JAX writes entries in place, without a lock.
_run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
_worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"k3jax-jax-cache-{_run}-{_worker}"))
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
# Every program, not only those that took a second to compile (JAX's default): the server
# processes a test starts find their small programs too (the whole suite: 676 -> 630 s).
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

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


def _num_mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def _bounded_compiled_code():
    """XLA:CPU maps each compiled kernel's code into memory mappings of its own (one small
    engine's buckets: about 4,000) and JAX keeps every executable in its caches, so a worker of
    the full suite reached Linux's default limit of 65,530 mappings (``vm.max_map_count``) and
    died with SIGSEGV inside a compile. Past 30,000 the caches are dropped before the next test
    (later calls load from the persistent cache or compile again)."""
    if _num_mappings() > 30_000:
        jax.clear_caches()
        gc.collect()
    yield

