"""Host-side serving: page pool, prefix cache, engine, server. Imports k3jax and pallas_kernels."""

from serving.engine import Drafter, Engine, NgramDrafter, RequestError, Result, SamplingParams
from serving.step_engine import StepEngine

__all__ = ["Drafter", "NgramDrafter", "Engine", "RequestError", "Result", "SamplingParams", "StepEngine"]
