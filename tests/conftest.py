"""Test-wide JAX and hypothesis settings (imported by pytest before any test module)."""

import os

import jax
from hypothesis import HealthCheck, settings

# Eight fake CPU devices for sharding tests; must be set before any backend initialises.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_enable_x64", False)

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
