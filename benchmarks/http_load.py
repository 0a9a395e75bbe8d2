"""HTTP load on ``k3jax-serve`` with the embedded tiny model: a fixed number of completions at
each concurrency, throughput, p50/p99 latency and errors (connection failures and non-2xx), and
the server process's threads and resident memory after each level, against after the warm-up
(the server runs in this process; the load is one asyncio loop, no client threads).

Run: ``PYTHONPATH=$PWD python3 -m benchmarks.http_load [--engine reference] [--rounds N]`` (writes
``$OUT/http_load.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import time

import httpx
import numpy as np

from benchmarks.common import write_json
from serving.server import make_engine, parser, serve
from serving.tokenizers import load_tokenizer


def threads_and_rss() -> tuple[int, float]:
    """This process's thread count and resident MiB (Linux)."""
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return int(status["Threads"]), int(status["VmRSS"].split()[0]) / 1024


async def _load(url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    lat, status = [], []
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(i):
            async with sem:
                t0 = time.perf_counter()
                try:
                    r = await client.post(url, json={"prompt": f"Hello number {i}", "max_tokens": max_tokens})
                    status.append(r.status_code)
                except httpx.HTTPError:
                    status.append(-1)
                lat.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        wall = time.perf_counter() - t0
    ok = sum(200 <= s < 300 for s in status)
    return {"concurrency": concurrency, "requests": requests, "ok": ok, "http_429": status.count(429),
            "errors": requests - ok - status.count(429), "req_per_s": requests / wall,
            "p50_s": float(np.percentile(lat, 50)), "p99_s": float(np.percentile(lat, 99))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--engine", choices=("step", "reference"), default="step")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each concurrency level")
    a = ap.parse_args()
    engine = make_engine(parser().parse_args(["--engine", a.engine, "--max-slots", "4", "--max-len", "2048",
                                              "--prefill-chunk", "256"]))
    engine.warmup()
    server, _ = serve(engine, load_tokenizer("tiny"), port=0)
    server.start()
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    rows = []
    try:
        asyncio.run(_load(url, 64, 64, a.max_tokens))  # warm the shapes, connections and threads the load uses
        threads0, rss0 = threads_and_rss()
        for c in map(int, a.concurrency.split(",")):
            for _ in range(a.rounds):
                row = asyncio.run(_load(url, c, a.requests, a.max_tokens))
                threads, rss = threads_and_rss()
                row.update(date=datetime.date.today().isoformat(), engine=a.engine, threads=threads,
                           thread_growth=threads - threads0, rss_mib=round(rss, 1), rss_growth_mib=round(rss - rss0, 1))
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        server.stop()
    write_json(rows, "http_load.json")


if __name__ == "__main__":
    main()
