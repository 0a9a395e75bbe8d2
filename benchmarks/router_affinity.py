"""Router session affinity on traces where every request shares its first blocks: how requests
spread over the backends and how often a request lands where its prefix already is, for the old
key (a hash of the prompt's first 512 tokens, rendezvous with bounded sessions:
``serving.fleet.Router``) against ``serving.fleet.affinity.Affinity`` (continuations of earlier
prompts, bounded sessions and outstanding work).

- ``shared``: conversations of several turns, every prompt opening with one 2048-token system
  prompt; turns replayed interleaved (no requests in flight: placement only).
- ``mooncake`` (``--mooncake PATH``): the Mooncake trace's hash-id chains as token blocks.
- ``--http``: the shared trace through the real ``k3jax-router`` (FastAPI/httpx) on loopback to
  stand-in backends (no model: each answers after a delay proportional to the request's tokens)
  at ``--concurrency`` clients: requests per backend and the most requests in flight on one.

Reuse is the fraction of prompt blocks already sent to the same backend before (a cache of
unbounded size): an upper bound of the prefix-cache hit rate the routing allows.

Run: ``PYTHONPATH=$PWD python3 -m benchmarks.router_affinity [--http] [--mooncake FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import hashlib
import json
import time

from fastapi import FastAPI, Request  # module level: FastAPI resolves the handlers' annotations here

BLOCK = 64  # tokens per block for the reuse count


def shared_trace(conversations: int, turns: int, system: int = 2048) -> list[tuple[int, list[int]]]:
    """(conversation, prompt) in replay order: turn t of every conversation before turn t + 1."""
    sys_prompt = [(7 * i) % 50000 for i in range(system)]
    prompts = {c: sys_prompt + [50000 + c, 1, 2, 3] for c in range(conversations)}
    out = []
    for t in range(turns):
        for c in range(conversations):
            if t:
                prompts[c] = prompts[c] + [(c * 131 + t * 17 + k) % 50000 for k in range(200)]
            out.append((c, prompts[c]))
    return out


def mooncake_trace(path: str, limit: int) -> list[tuple[int, list[int]]]:
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i == limit:
                break
            r = json.loads(line)
            out.append((i, [h * BLOCK + k for h in r["hash_ids"] for k in range(BLOCK)][: r["input_length"]]))
    return out


class OldKey:
    """The router before: a request's session is a hash of its first 512 tokens."""

    def __init__(self, backends):
        from serving.fleet import Router

        self.router = Router(backends)

    def __call__(self, prompt):
        key = hashlib.blake2b(json.dumps(prompt[:512]).encode(), digest_size=8).hexdigest()
        return self.router.route(key)


class NewKey:
    def __init__(self, backends):
        from serving.fleet.affinity import Affinity

        self.a = Affinity(backends)

    def __call__(self, prompt):
        session, blocks = self.a.prompt_key(prompt)
        return self.a.route(session, cost=len(prompt) + 16, blocks=blocks)


def replay(policy, trace, backends) -> dict:
    seen = {b: set() for b in backends}
    per = collections.Counter()
    homes = collections.defaultdict(set)
    reused = total = 0
    for conv, prompt in trace:
        b = policy(prompt)
        per[b] += 1
        homes[conv].add(b)
        h, blocks = b"", []
        for j in range(len(prompt) // BLOCK):
            h = hashlib.blake2b(h + json.dumps(prompt[j * BLOCK : (j + 1) * BLOCK]).encode(), digest_size=8).digest()
            blocks.append(h)
        reused += sum(x in seen[b] for x in blocks)
        total += len(blocks)
        seen[b].update(blocks)
    counts = [per[b] for b in backends]
    return {"requests_per_backend": counts, "max_over_mean": max(counts) / (sum(counts) / len(counts)),
            "conversations_split": sum(len(v) > 1 for v in homes.values()), "block_reuse": reused / total}


async def _http(trace, backends: int, concurrency: int) -> dict:
    from serving.fleet.http_router import serve_router
    from serving.http_base import BackgroundServer

    def fake(name):
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.post("/v1/completions")
        async def complete(request: Request):
            body = await request.json()
            await asyncio.sleep(0.005 + 2e-6 * len(body["prompt"]))
            return {"backend": name}

        return BackgroundServer(app).start()

    servers = [fake(f"b{i}") for i in range(backends)]
    router_srv, fleet = serve_router([s.url for s in servers], port=0)
    router_srv.start()
    peak = collections.Counter()
    stop = False

    async def sample():
        while not stop:
            for b, n in fleet.affinity.inflight.items():
                peak[b] = max(peak[b], n)
            await asyncio.sleep(0.002)

    try:
        import httpx

        sem = asyncio.Semaphore(concurrency)
        per = collections.Counter()
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            async def one(prompt):
                async with sem:
                    r = await c.post(f"http://127.0.0.1:{router_srv.port}/v1/completions",
                                     json={"prompt": prompt, "max_tokens": 16})
                    r.raise_for_status()
                    per[r.headers["X-K3jax-Backend"]] += 1

            sampler = asyncio.create_task(sample())
            t0 = time.perf_counter()
            # one turn at a time, the conversations of a turn concurrently (a turn follows its answer)
            by_turn = collections.defaultdict(list)
            count = collections.Counter()
            for conv, prompt in trace:
                by_turn[count[conv]].append(prompt)
                count[conv] += 1
            for t in sorted(by_turn):
                await asyncio.gather(*(one(p) for p in by_turn[t]))
            wall = time.perf_counter() - t0
            stop = True
            await sampler
        urls = [s.url for s in servers]
        return {"requests_per_backend": [per[u] for u in urls], "peak_inflight_per_backend": [peak[u] for u in urls],
                "req_per_s": len(trace) / wall, "concurrency": concurrency}
    finally:
        router_srv.stop()
        for s in servers:
            s.stop()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=200)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--mooncake", default=None, help="a Mooncake trace (jsonl with hash_ids)")
    ap.add_argument("--limit", type=int, default=2000, help="Mooncake requests replayed")
    ap.add_argument("--http", action="store_true", help="also replay the shared trace through k3jax-router")
    ap.add_argument("--concurrency", type=int, default=32)
    a = ap.parse_args(argv)
    backends = [f"b{i}" for i in range(a.backends)]
    traces = {"shared": shared_trace(a.conversations, a.turns)}
    if a.mooncake:
        traces["mooncake"] = mooncake_trace(a.mooncake, a.limit)
    out = {"date": datetime.date.today().isoformat(), "backends": a.backends}
    for name, trace in traces.items():
        for pol, cls in (("old_first_512", OldKey), ("affinity", NewKey)):
            out[f"{name}/{pol}"] = replay(cls(backends), trace, backends)
    if a.http:
        out["shared/http"] = asyncio.run(_http(traces["shared"], a.backends, a.concurrency))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
