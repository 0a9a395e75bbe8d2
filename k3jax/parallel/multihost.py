"""Several processes (hosts), one SPMD program: start-up and the little each step needs to agree on.

Every process holds its own devices' part of the weights and page pool and must launch the same
jitted programs in the same order. In the serving engine only process 0 plans (scheduler, HTTP);
before each step it sends the step's bucket and packed batch through a :class:`StepChannel`
(``jax.distributed``'s key-value store: host to host, so process 0 goes on planning while the
devices run), and the other processes run what they receive (``serving.step_engine.Runner.follow``).

On CPU the cross-process collectives are gloo's (so a two-process run on one machine works, as
the tests do); on GPU, NCCL; on TPU, ICI.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
from jax._src import distributed  # the key-value store of jax.distributed's client (no public handle)
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


def min_over_processes(n: int) -> int:
    """The least of every process's ``n`` (a collective: every process calls it at the same
    point). One process: ``n``."""
    if jax.process_count() == 1:
        return n
    return int(np.min(multihost_utils.process_allgather(np.int64(n))))


class StepChannel:
    """Process 0's steps to the other processes, in order, through ``jax.distributed``'s
    key-value store: each message is a bucket ``(decode rows, prefill tokens, window)`` and the
    step's packed ``int32`` and ``float32`` batch (or the stop). Only the last few are kept."""

    KEEP = 16  # messages kept in the store: the others are at most a step or two behind (each step is a collective)
    POLL_MS = 10_000  # a follower's wait per try; it waits on while the store answers (an idle server sends nothing)

    def __init__(self, name: str = "k3jax/steps"):
        self.client = distributed.global_state.client
        if self.client is None:
            raise RuntimeError("StepChannel needs jax.distributed (k3jax.parallel.multihost.initialize)")
        self.name, self.n = name, 0
        self._lock = threading.Lock()  # the engine loop's steps and the server's stop come from two threads

    def send(self, key, ints: np.ndarray | None = None, floats: np.ndarray | None = None):
        """Process 0: the next step (``key`` ``(-1, 0, 0)``: stop)."""
        ints = np.zeros(0, np.int32) if ints is None else np.ascontiguousarray(ints, np.int32)
        floats = np.zeros(0, np.float32) if floats is None else np.ascontiguousarray(floats, np.float32)
        head = np.array([*key, ints.size, floats.size], np.int32)
        with self._lock:
            self.client.key_value_set_bytes(f"{self.name}/{self.n}", head.tobytes() + ints.tobytes() + floats.tobytes())
            if self.n >= self.KEEP:
                self.client.key_value_delete(f"{self.name}/{self.n - self.KEEP}")
            self.n += 1

    def receive(self):
        """Another process: the next step ``(key, ints, floats)`` (flat arrays), or None at the stop."""
        while True:
            try:
                raw = self.client.blocking_key_value_get_bytes(f"{self.name}/{self.n}", self.POLL_MS)
                break
            except Exception as e:  # noqa: BLE001 - only a timeout is waited out
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self.n += 1
        head = np.frombuffer(raw[:20], np.int32)
        ni, nf = int(head[3]), int(head[4])
        ints = np.frombuffer(raw[20 : 20 + 4 * ni], np.int32)
        floats = np.frombuffer(raw[20 + 4 * ni : 20 + 4 * (ni + nf)], np.float32)
        return None if head[0] < 0 else (tuple(int(x) for x in head[:3]), ints, floats)
