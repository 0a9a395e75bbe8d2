"""Host-side serving: page pool, prefix cache, engine, server. Imports k3jax and pallas_kernels."""

from serving.engine import Engine, RequestError, Result, SamplingParams

__all__ = ["Engine", "RequestError", "Result", "SamplingParams"]
