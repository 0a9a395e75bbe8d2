"""Several processes (hosts), one SPMD program: start-up and the little each step needs to agree on.

Every process holds its own devices' part of the weights and page pool and must launch the same
jitted programs in the same order. In the serving engine only process 0 plans (scheduler, HTTP);
before each step it sends the step's bucket and packed batch with :func:`broadcast_from_first`,
and the other processes run what they receive (``serving.step_engine.Runner.follow``).

On CPU the cross-process collectives are gloo's (so a two-process run on one machine works, as
the tests do); on GPU, NCCL; on TPU, ICI.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize(coordinator: str, num_processes: int, process_id: int):
    """``jax.distributed.initialize`` for ``num_processes`` processes meeting at ``coordinator``
    (``host:port``, process 0's), with gloo collectives for CPU devices. Call it first, before
    anything touches a device."""
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is not in [0, {num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def is_lead() -> bool:
    """Whether this process plans the steps (process 0)."""
    return jax.process_index() == 0


def broadcast_from_first(tree):
    """Process 0's ``tree`` of host arrays on every process (each passes one of the same shapes
    and dtypes; a collective, so every process calls it at the same point). One process: ``tree``."""
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))
