"""Load on the engine (``serving.StepEngine``) on a random bf16 model (default: Kimi-Linear-48B-A3B,
``--layers`` of it): Poisson arrivals, a fixed concurrency, and a Mooncake trace replayed with the
prefix cache on and off (issue 52). Output tokens/s, TTFT and TPOT p50/p99; for the trace also the
prompt tokens served from the cache.

The engine runs in this process; requests are submitted at their arrival times between engine
steps (the same loop the server runs, without HTTP). Mooncake prompts are built from the trace's
hash ids: 512 tokens per id, drawn from a generator seeded by the id, so equal ids are equal
prefixes. Trace timestamps are milliseconds; ``--trace-speed`` compresses them.

Run on the GPU: ``PYTHONPATH=$PWD python3 -m benchmarks.engine_load --parts poisson,concurrency,trace``
(writes ``$OUT/engine_load.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import time

import jax
import numpy as np

from benchmarks.common import random_model, write_json
from benchmarks.model_step import sliced_config
from serving.engine import SamplingParams
from serving.server import positive_ints
from serving.step_engine import StepEngine

HASH_BLOCK = 512


def drive(engine: StepEngine, arrivals, concurrency: int | None = None) -> dict:
    """Submit ``arrivals`` (``(seconds, prompt, max_tokens)``, sorted) at their times, at most
    ``concurrency`` in flight (None: no cap), stepping the engine until all finish."""
    pending, live, done = list(arrivals), [], []
    t0 = time.perf_counter()
    while pending or live:
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now and (concurrency is None or len(live) < concurrency):
            _, prompt, n = pending.pop(0)
            live.append(engine.submit(prompt, SamplingParams(max_tokens=n)))
        if engine.has_work():
            engine.step()
        elif pending:
            time.sleep(min(max(pending[0][0] - now, 0.0), 0.01))
        done += [r for r in live if r.finished.is_set()]
        live = [r for r in live if not r.finished.is_set()]
    wall = time.perf_counter() - t0
    res = [r.result for r in done]
    ttft = np.array([r.ttft_s for r in res])
    tpot = np.array([(r.token_times_s[-1] - r.token_times_s[0]) / (len(r.token_times_s) - 1)
                     for r in res if len(r.token_times_s) > 1])
    out = sum(len(r.token_ids) for r in res)
    pct = lambda a, q: float(np.percentile(a, q) * 1e3) if len(a) else None
    return {"requests": len(res), "seconds": wall, "output_tokens_per_s": out / wall,
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in res),
            "cached_prompt_tokens": sum(r.num_cached_tokens for r in res),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99),
            "errors": sum(r.finish_reason.startswith("error") for r in res)}


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(n)]


def poisson(n: int, rate: float, prompt: int, output: int, vocab: int, seed: int = 0):
    """``n`` arrivals at ``rate`` per second."""
    times = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n))
    return [(float(t), p, output) for t, p in zip(times, random_prompts(n, prompt, vocab, seed + 1))]


def mooncake(path: str, limit: int, max_len: int, vocab: int, speed: float):
    """The first ``limit`` trace requests that fit ``max_len``, prompts from their hash ids."""
    rows = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r["input_length"] + r["output_length"] > max_len:
                continue
            prompt = [int(t) for h in r["hash_ids"] for t in np.random.default_rng(h).integers(3, vocab, HASH_BLOCK)]
            rows.append((r["timestamp"] / 1e3 / speed, prompt[: r["input_length"]], max(1, r["output_length"])))
            if len(rows) == limit:
                break
    t_first = rows[0][0] if rows else 0.0
    return [(t - t_first, p, n) for t, p, n in rows]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/kimi_linear_48b_a3b.json", help="a config file, or 'mid'")
    ap.add_argument("--layers", type=int, default=4, help="keep only the first N layers (0: all)")
    ap.add_argument("--parts", default="poisson,concurrency,trace")
    ap.add_argument("--mxfp4", action="store_true", help="routed experts packed in MXFP4 (common.random_model)")
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--decode-buckets", type=positive_ints, default=None, help="comma-separated (default: the engine's)")
    ap.add_argument("--prefill-buckets", type=positive_ints, default=None, help="comma-separated (default: the engine's)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    ap.add_argument("--poisson-shape", default="8000,1500", help="input,output tokens of the Poisson requests")
    ap.add_argument("--concurrency", default="8,64")
    ap.add_argument("--concurrency-shape", default="1000,2000", help="input,output tokens at fixed concurrency")
    ap.add_argument("--trace", default="../shared/data/mooncake/synthetic_trace.jsonl")
    ap.add_argument("--trace-requests", type=int, default=200)
    ap.add_argument("--trace-speed", type=float, default=1.0)
    ap.add_argument("--checkpoints-after", action="store_true",
                    help="with the prefix cache, prefill chunks stop at hash boundaries for their checkpoints "
                         "(not StepEngine's default checkpoints_inside)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # start-up progress
    cfg = sliced_config(a.config, a.layers)
    base = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "config": a.config,
            "layers": cfg.num_layers, "mxfp4": a.mxfp4, "max_running": a.max_running, "budget": a.budget,
            "max_len": a.max_len, "checkpoints_inside": not a.checkpoints_after}
    rows = []

    def engine(prefix_cache: bool, **kw) -> StepEngine:
        t0 = time.perf_counter()
        params = random_model(cfg, a.mxfp4)  # an engine consumes its params
        e = StepEngine(cfg, params=params, max_running=a.max_running, max_len=a.max_len, token_budget=a.budget,
                       max_prefill_rows=8, prefix_cache=prefix_cache, hash_tokens=HASH_BLOCK,
                       decode_buckets=a.decode_buckets, prefill_buckets=a.prefill_buckets,
                       checkpoints_inside=not a.checkpoints_after, **kw)
        e.warmup()
        rows.append({**base, "kind": "startup", "prefix_cache": prefix_cache, "seconds": time.perf_counter() - t0,
                     "buckets": len(e.runner.bucket_keys()), "decode_buckets": e.runner.decode_buckets,
                     "prefill_buckets": e.runner.prefill_buckets, "pages": e.runner.num_pages})
        print(json.dumps(rows[-1]), flush=True)
        return e

    def record(e: StepEngine, **r):
        rows.append({**base, **r, "compiles_while_serving": e.runner.compiles_while_serving})
        print(json.dumps(rows[-1]), flush=True)

    parts = a.parts.split(",")
    if "poisson" in parts or "concurrency" in parts:
        e = engine(prefix_cache=False)
        if "poisson" in parts:
            i, o = map(int, a.poisson_shape.split(","))
            record(e, kind="poisson", rate=a.rate, input=i, output=o,
                   **drive(e, poisson(a.requests, a.rate, i, o, cfg.vocab_size)))
        for c in map(int, a.concurrency.split(",")) if "concurrency" in parts else ():
            i, o = map(int, a.concurrency_shape.split(","))
            arrivals = [(0.0, p, o) for p in random_prompts(max(a.requests, c), i, cfg.vocab_size, seed=c)]
            record(e, kind="concurrency", concurrency=c, input=i, output=o, **drive(e, arrivals, concurrency=c))
        del e
    if "trace" in parts:
        arrivals = mooncake(a.trace, a.trace_requests, a.max_len, cfg.vocab_size, a.trace_speed)
        e = engine(prefix_cache=True)
        record(e, kind="mooncake", prefix_cache=True, trace_speed=a.trace_speed, **drive(e, arrivals))
        same = dict(page_tokens=e.runner.lay.page_tokens, num_pages=e.runner.num_pages)  # so its compiled steps serve
        del e
        e = engine(prefix_cache=False, **same)
        record(e, kind="mooncake", prefix_cache=False, trace_speed=a.trace_speed, **drive(e, arrivals))
    write_json(rows, "engine_load.json")


if __name__ == "__main__":
    main()
