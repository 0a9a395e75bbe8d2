"""Discrete-event simulation of a fleet of serving clusters on Mooncake-format traces.

Each request (timestamp, input/output lengths, 512-token hash-id chain) is routed to a cluster
(cache affinity by session, random, or least loaded), passes that cluster's admission (per-class
budgets, or none), and is prefilled there. Cost model per cluster:

- Prefix cache: an LRU over hash ids with ``cache_blocks`` entries; a request reuses the longest
  prefix of its chain that is resident; its blocks are inserted when its prefill completes.
- Prefill: ``prefill_tok_s`` tokens/s over the uncached tokens, plus ``prefill_overhead_s``. The
  cluster's compute is shared between request classes in proportion to their ``share`` (classes
  with no waiting work give theirs away); inside a class, requests are served in arrival order.
  Without budgets there is one class: plain FIFO, as a chunked-prefill engine without classes
  behaves.
- Decode: ``output_length x decode_step_s`` after prefill (decode batches are assumed to have
  room); the admission budget is held until then.

The parameters default to the engine's measurements on the H200 (docs/benchmarks.md: 42.4 k
prefill tokens/s and a 2.5 ms decode step on the mid-sized config); pass fitted values for
other models. A cluster can be killed at a given time: its queued and running requests are
routed again (they re-prefill elsewhere) and nothing is lost.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import random
from collections import OrderedDict, deque

from serving.fleet.admission import DEFAULT_CLASSES, Admission, RequestClass
from serving.fleet.routing import Router

BLOCK_TOKENS = 512
_EPS = 1e-9


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-cluster cost model (see the module docstring)."""

    prefill_tok_s: float = 42_400.0
    decode_step_s: float = 0.0025
    prefill_overhead_s: float = 0.005
    cache_blocks: int = 16_384

    @classmethod
    def fitted(cls, model_json: str, **overrides) -> CostModel:
        """Rates measured by ``benchmarks/model.py`` (its ``model.json``) on the engine's device."""
        with open(model_json) as f:
            m = json.load(f)
        fit = {"prefill_tok_s": float(m["prefill_tok_s"]), "decode_step_s": float(m["decode_step_ms_median"]) / 1e3}
        return cls(**{**fit, **overrides})


@dataclasses.dataclass
class TraceRequest:
    """One request; ``t`` in seconds; ``session`` keys cache affinity (its first hash id)."""

    rid: int
    t: float
    input_len: int
    output_len: int
    hash_ids: tuple
    session: str


def load_trace(path: str, *, time_scale: float = 1.0, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace (timestamps in ms); ``time_scale > 1`` compresses time."""
    reqs = []
    with open(path) as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            r = json.loads(line)
            hids = tuple(r["hash_ids"])
            reqs.append(TraceRequest(i, r["timestamp"] / 1000.0 / time_scale, int(r["input_length"]),
                                     int(r["output_length"]), hids, f"s{hids[0] if hids else i}"))
    return reqs


def inject_bursts(reqs, *, at, count: int, tokens: int = 1_000_000, spread_s: float = 1.0, seed: int = 0):
    """Add ``count`` fresh-session requests of ``tokens`` tokens around each time in ``at``."""
    rng = random.Random(seed)
    next_hash = 1 + max((h for r in reqs for h in r.hash_ids), default=0)
    out = list(reqs)
    rid = 1 + max((r.rid for r in reqs), default=0)
    for t0 in at:
        for _ in range(count):
            n = -(-tokens // BLOCK_TOKENS)
            hids = tuple(range(next_hash, next_hash + n))
            next_hash += n
            out.append(TraceRequest(rid, t0 + rng.uniform(0, spread_s), tokens, 64, hids, f"burst{rid}"))
            rid += 1
    return sorted(out, key=lambda r: (r.t, r.rid))


@dataclasses.dataclass
class _Job:
    req: TraceRequest
    klass: str
    cached: int = 0
    remaining: float = 0.0  # seconds of full-rate prefill work left


class _Cluster:
    def __init__(self, name: str, cost: CostModel, classes):
        self.name = name
        self.cost = cost
        self.alive = True
        self.cache: OrderedDict = OrderedDict()
        self.queues = {c.name: deque() for c in classes}
        self.share = {c.name: c.share for c in classes}
        self.admission = Admission(classes) if len(classes) > 1 or classes[0].name != "all" else None
        self.t = 0.0
        self.version = 0
        self.prefilled: list[tuple[float, int, str]] = []  # (completion time, uncached tokens, session)

    def lookup(self, hids, input_len) -> int:
        n = 0
        for h in hids:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            n += 1
        return min(n * BLOCK_TOKENS, max(input_len - 1, 0))

    def insert(self, hids):
        for h in hids:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.cost.cache_blocks:
            self.cache.popitem(last=False)

    def outstanding(self) -> float:
        return sum(j.remaining for q in self.queues.values() for j in q)

    def _rates(self):
        busy = [k for k, q in self.queues.items() if q]
        total = sum(self.share[k] for k in busy)
        return {k: self.share[k] / total for k in busy}

    def advance(self, now: float):
        """Run the heads of the class queues from ``self.t`` to ``now`` at their shares."""
        for k, rate in self._rates().items():
            self.queues[k][0].remaining -= rate * (now - self.t)
        self.t = now

    def next_completion(self):
        rates = self._rates()
        if not rates:
            return None
        return self.t + min(max(self.queues[k][0].remaining, 0.0) / r for k, r in rates.items())


class FleetSim:
    """One simulation run.

    Args:
      num_clusters: clusters ``c0 .. c{N-1}``.
      routing: "affinity" (rendezvous, sticky, bounded loads), "random" or "least_loaded".
      budgets: per-class admission and compute shares (``classes``) if True, else FIFO, no admission.
      kill: ``(time_s, cluster_name)`` or None.
    """

    def __init__(self, num_clusters=16, *, routing="affinity", budgets=True, classes=DEFAULT_CLASSES,
                 cost=CostModel(), kill=None, seed=0, load_bound=1.25):
        if routing not in ("affinity", "random", "least_loaded"):
            raise ValueError(f"unknown routing {routing!r}")
        self.cost = cost
        self.routing = routing
        classes = tuple(classes) if budgets else (RequestClass("all", 1 << 62, 1 << 62),)
        self.classes = classes
        self._report = Admission(classes if budgets else DEFAULT_CLASSES)
        self.clusters = {f"c{i}": _Cluster(f"c{i}", cost, classes) for i in range(num_clusters)}
        self.router = Router(list(self.clusters), c=load_bound)
        self.rng = random.Random(seed)
        self.kill = kill
        self.events: list = []
        self.seq = 0
        self.records: dict[int, dict] = {}
        self.reqs: dict[int, TraceRequest] = {}

    def _push(self, t, kind, payload):
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def _route(self, req) -> _Cluster:
        alive = [c for c in self.clusters.values() if c.alive]
        if self.routing == "affinity":
            return self.clusters[self.router.route(req.session)]
        if self.routing == "random":
            return self.rng.choice(alive)
        return min(alive, key=lambda c: (c.outstanding(), c.name))

    def _klass(self, cl: _Cluster, req) -> str:
        if cl.admission is None:
            return "all"
        c = cl.admission.classify(req.input_len)
        return c.name if c else "reject"

    def _reschedule(self, cl: _Cluster):
        cl.version += 1
        t = cl.next_completion()
        if t is not None:
            self._push(t, "done", (cl.name, cl.version))

    def _enqueue(self, cl: _Cluster, req, now):
        job = _Job(req, self._klass(cl, req))
        job.cached = cl.lookup(req.hash_ids, req.input_len)
        job.remaining = (req.input_len - job.cached) / self.cost.prefill_tok_s + self.cost.prefill_overhead_s
        rec = self.records[req.rid]
        rec.update(cluster=cl.name, cached=job.cached)
        cl.advance(now)
        cl.queues[job.klass].append(job)
        self._reschedule(cl)

    def _arrive(self, req, now):
        cl = self._route(req)
        rec = self.records.setdefault(req.rid, {"t": req.t, "input": req.input_len, "session": req.session})
        c = self._report.classify(req.input_len)
        rec["klass"] = c.name if c else "oversize"
        if cl.admission is not None:
            d = cl.admission.arrive(req.rid, req.input_len, now)
            if d.action == "reject":
                rec.update(rejected=d.status, reason=d.reason, cluster=cl.name)
                return
            if d.action == "queue":
                rec["cluster"] = cl.name
                return
        self._enqueue(cl, req, now)

    def _admit_decisions(self, cl: _Cluster, decisions, now):
        for d in decisions:
            req = self.reqs[d.request_id]
            if d.action == "accept":
                self._enqueue(cl, req, now)
            else:
                self.records[d.request_id].update(rejected=d.status, reason=d.reason)

    def _done(self, cl: _Cluster, now):
        cl.advance(now)
        for q in cl.queues.values():
            while q and q[0].remaining <= _EPS:
                job = q.popleft()
                cl.insert(job.req.hash_ids)
                rec = self.records[job.req.rid]
                rec["ttft"] = now - job.req.t
                cl.prefilled.append((now, job.req.input_len - job.cached, job.req.session))
                self._push(now + job.req.output_len * self.cost.decode_step_s, "finish", (cl.name, job.req.rid))
        self._reschedule(cl)

    def _finish(self, cl: _Cluster, rid, now):
        self.records[rid]["end"] = now
        if cl.admission is not None and cl.alive:
            self._admit_decisions(cl, cl.admission.finish(rid, now), now)

    def _kill(self, name, now):
        cl = self.clusters[name]
        cl.advance(now)
        cl.alive = False
        self.router.fail(name)
        orphans = [j.req for q in cl.queues.values() for j in q]
        if cl.admission is not None:
            orphans += [self.reqs[rid] for st in cl.admission.state.values() for rid, _, _ in st.queue]
        # Requests already decoding there are lost mid-stream: they are re-run from scratch too.
        orphans += [self.reqs[rid] for rid, r in self.records.items()
                    if r.get("cluster") == name and "ttft" in r and "end" not in r]
        for q in cl.queues.values():
            q.clear()
        cl.cache.clear()
        cl.version += 1
        for req in sorted({r.rid: r for r in orphans}.values(), key=lambda r: r.t):
            self.records[req.rid].pop("ttft", None)
            self.records[req.rid]["rerouted"] = True
            self._arrive(req, now)

    def run(self, reqs) -> list[dict]:
        """Simulate to completion; returns one record per request (ttft, cached, klass, rejected...)."""
        for r in reqs:
            self.reqs[r.rid] = r
            self._push(r.t, "arrive", r.rid)
        if self.kill is not None:
            self._push(self.kill[0], "kill", self.kill[1])
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive(self.reqs[payload], now)
            elif kind == "kill":
                self._kill(payload, now)
            elif kind == "done":
                name, version = payload
                cl = self.clusters[name]
                if cl.alive and version == cl.version:
                    self._done(cl, now)
            else:
                name, rid = payload
                cl = self.clusters[name]
                if self.records[rid].get("cluster") == name and "end" not in self.records[rid]:
                    self._finish(cl, rid, now)
            for cl in self.clusters.values():
                if cl.admission is not None and cl.alive and any(st.queue for st in cl.admission.state.values()):
                    self._admit_decisions(cl, cl.admission.tick(now), now)
        return [dict(rid=rid, **rec) for rid, rec in sorted(self.records.items())]
