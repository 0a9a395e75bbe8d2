"""Cache-affinity routing: every session is pinned to a primary and a secondary cluster by
rendezvous hashing (the two highest scores), with bounded loads.

- A session stays where it was first placed while that cluster is healthy (its prefix cache is
  there); a cluster that fails sends each of its sessions to its next-ranked healthy cluster
  (its secondary, unless that one already took its cap of the failed cluster's sessions,
  ``max(ceil(avg), floor(c x avg))`` with ``avg = moved / survivors``: then the next in its
  ranking), so the extra load on a survivor is at most ``c`` times the average whenever that is
  feasible; when the cluster returns, moved sessions stay where they are (no flapping).
- Bounded loads: no cluster takes a new session above ``ceil(c x average)`` sessions; a displaced
  session goes to the next cluster in its ranking (its secondary first).
- Adding or removing one of N clusters changes the ranking's top choice for about 1/N of the
  sessions, and only those.
"""

from __future__ import annotations

import hashlib
import math


def _score(session: str, cluster: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session}\x00{cluster}".encode(), digest_size=8).digest(), "little")


class Router:
    """Host-side routing state.

    Args:
      clusters: cluster names.
      c: load bound factor (>= 1): a cluster accepts a new session only below ``ceil(c * average)``.
    """

    def __init__(self, clusters, *, c: float = 1.25):
        if c < 1:
            raise ValueError(f"load bound c must be >= 1, got {c}")
        self.c = c
        self.clusters: list[str] = []
        self.healthy: set[str] = set()
        self.assignment: dict[str, str] = {}
        self.load: dict[str, int] = {}
        for name in clusters:
            self.add_cluster(name)

    def ranking(self, session: str) -> list[str]:
        """All clusters, best first (rendezvous hashing)."""
        return sorted(self.clusters, key=lambda cl: _score(session, cl), reverse=True)

    def primary_secondary(self, session: str) -> tuple[str, str | None]:
        r = self.ranking(session)
        return r[0], (r[1] if len(r) > 1 else None)

    def _cap(self) -> int:
        n = len(self.healthy)
        return math.ceil(self.c * (len(self.assignment) + 1) / n) if n else 0

    def route(self, session: str) -> str:
        """The cluster for this session's next request (sticky while that cluster is healthy)."""
        cur = self.assignment.get(session)
        if cur is not None and cur in self.healthy:
            return cur
        if cur is not None:
            self._unassign(session)
        if not self.healthy:
            raise RuntimeError("no healthy cluster")
        cap = self._cap()
        ranked = [cl for cl in self.ranking(session) if cl in self.healthy]
        target = next((cl for cl in ranked if self.load[cl] < cap), ranked[0])
        self.assignment[session] = target
        self.load[target] += 1
        return target

    def _unassign(self, session: str):
        cl = self.assignment.pop(session)
        self.load[cl] -= 1

    def end_session(self, session: str):
        if session in self.assignment:
            self._unassign(session)

    def fail(self, cluster: str):
        """Mark a cluster down and move its sessions now, with bounded extra load per survivor."""
        self.healthy.discard(cluster)
        moved = sorted(s for s, cl in self.assignment.items() if cl == cluster)
        if not moved or not self.healthy:
            return
        avg = len(moved) / len(self.healthy)
        cap = max(math.ceil(avg), math.floor(self.c * avg))
        extra = dict.fromkeys(self.healthy, 0)
        for s in moved:
            self._unassign(s)
            ranked = [cl for cl in self.ranking(s) if cl in self.healthy]
            target = next((cl for cl in ranked if extra[cl] < cap), ranked[0])
            extra[target] += 1
            self.assignment[s] = target
            self.load[target] += 1

    def recover(self, cluster: str):
        """Mark a cluster up again; sessions that moved away stay where they are."""
        if cluster in self.clusters:
            self.healthy.add(cluster)

    def add_cluster(self, cluster: str):
        if cluster in self.clusters:
            raise ValueError(f"cluster {cluster!r} already present")
        self.clusters.append(cluster)
        self.healthy.add(cluster)
        self.load.setdefault(cluster, 0)

    def remove_cluster(self, cluster: str):
        self.clusters.remove(cluster)
        self.healthy.discard(cluster)
        for s in [s for s, cl in self.assignment.items() if cl == cluster]:
            self._unassign(s)
        self.load.pop(cluster, None)
