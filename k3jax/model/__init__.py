"""The Kimi Linear / K3 model: config, pure forward, Hugging Face checkpoint loader."""

from k3jax.model.config import ModelConfig
from k3jax.model.loader import CheckpointError, load_hf_checkpoint
from k3jax.model.model import (Kernels, ModelCache, WindowInputs, commit_window, forward, hidden_states, init_cache,
                               init_params, logits, param_shapes)

__all__ = ["WindowInputs", "commit_window", "ModelConfig", "CheckpointError", "load_hf_checkpoint", "Kernels", "ModelCache", "forward", "hidden_states", "init_cache",
           "init_params", "logits", "param_shapes"]
