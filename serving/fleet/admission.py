"""Budget-based admission: each request class (by prompt length) owns a token budget, so a burst
in one class consumes only its own share. Decisions are made at arrival, before any prefill:
accept, queue (FIFO, with a timeout), or reject with an HTTP status and a reason.

Starvation guard: a class admits in FIFO order (a later small request never overtakes a queued
large one), and a request larger than its whole budget is admitted when its class is idle.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestClass:
    """Requests with ``prompt tokens <= max_tokens`` (the smallest class that fits) share
    ``budget_tokens`` of in-flight tokens; up to ``max_queue`` wait ``queue_timeout_s``.
    ``share`` is the class's relative weight for prefill compute when classes contend."""

    name: str
    max_tokens: int
    budget_tokens: int
    max_queue: int = 64
    queue_timeout_s: float = 30.0
    share: float = 1.0


DEFAULT_CLASSES = (
    RequestClass("short", 2048, 256 * 1024, share=2.0),
    RequestClass("medium", 65536, 1024 * 1024, share=2.0),
    RequestClass("long", 1 << 20, 2 << 20, max_queue=16, queue_timeout_s=600.0),
)


@dataclass
class Decision:
    """``action`` is "accept", "queue" or "reject"; rejects carry ``status`` (413/429/503) and a reason."""

    request_id: object
    action: str
    klass: str | None = None
    status: int = 200
    reason: str = ""


@dataclass
class _ClassState:
    spec: RequestClass
    in_flight: dict = field(default_factory=dict)  # request id -> tokens
    queue: deque = field(default_factory=deque)  # (request id, tokens, deadline)

    @property
    def used(self) -> int:
        return sum(self.in_flight.values())

    def fits(self, tokens: int) -> bool:
        return self.used + tokens <= self.spec.budget_tokens or not self.in_flight


class Admission:
    """Admission control over request classes (host-side, not thread-safe: call from one loop)."""

    def __init__(self, classes=DEFAULT_CLASSES):
        self.classes = sorted(classes, key=lambda c: c.max_tokens)
        self.state = {c.name: _ClassState(c) for c in self.classes}
        self._class_of: dict = {}

    def classify(self, tokens: int) -> RequestClass | None:
        return next((c for c in self.classes if tokens <= c.max_tokens), None)

    def arrive(self, request_id, tokens: int, now: float) -> Decision:
        """Decide at arrival."""
        c = self.classify(tokens)
        if c is None:
            return Decision(request_id, "reject", None, 413, f"{tokens} tokens exceed the largest class ({self.classes[-1].max_tokens})")
        st = self.state[c.name]
        if not st.queue and st.fits(tokens):
            st.in_flight[request_id] = tokens
            self._class_of[request_id] = c.name
            return Decision(request_id, "accept", c.name)
        if len(st.queue) >= c.max_queue:
            return Decision(request_id, "reject", c.name, 429, f"class {c.name!r} budget and queue are full")
        st.queue.append((request_id, tokens, now + c.queue_timeout_s))
        self._class_of[request_id] = c.name
        return Decision(request_id, "queue", c.name)

    def finish(self, request_id, now: float) -> list[Decision]:
        """A request left; returns the queued requests this admits (and any that timed out)."""
        name = self._class_of.pop(request_id, None)
        if name is not None:
            self.state[name].in_flight.pop(request_id, None)
        return self.tick(now)

    def tick(self, now: float) -> list[Decision]:
        """Expire queued requests past their deadline and admit the heads that now fit."""
        out = []
        for st in self.state.values():
            while st.queue:
                rid, tokens, deadline = st.queue[0]
                if deadline <= now:
                    st.queue.popleft()
                    self._class_of.pop(rid, None)
                    out.append(Decision(rid, "reject", st.spec.name, 503, f"queued longer than {st.spec.queue_timeout_s} s"))
                elif st.fits(tokens):
                    st.queue.popleft()
                    st.in_flight[rid] = tokens
                    out.append(Decision(rid, "accept", st.spec.name))
                else:
                    break
        return out
