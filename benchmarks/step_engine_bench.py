"""The engine on the serving step (``serving.StepEngine``) end to end on the random bf16 ``MID``
config: offline throughput of a batch of requests against the old engine (``serving.Engine``)
on the same workload, compile time at start-up, and the prefix cache on vs off on multi-turn
conversations.

Run on the GPU: ``PYTHONPATH=$PWD python3 -m benchmarks.step_engine_bench`` (writes
``$OUT/step_engine.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import jax
import numpy as np

from benchmarks.common import write_json
from benchmarks.model import mid_model
from benchmarks.serving_bench import multi_turn
from serving.engine import Engine
from serving.step_engine import StepEngine


def offline(engine, requests: int, prompt: int, output: int, seed: int = 0) -> dict:
    """``requests`` random prompts of ``prompt`` tokens, ``output`` greedy tokens each, all at once."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, engine.cfg.vocab_size, prompt).tolist() for _ in range(requests)]
    t0 = time.perf_counter()
    res = engine.generate(prompts, max_tokens=output)
    dt = time.perf_counter() - t0
    gen = sum(len(r.token_ids) for r in res)
    return {"requests": requests, "prompt": prompt, "output": output, "seconds": dt,
            "output_tokens_per_s": gen / dt, "total_tokens_per_s": (gen + requests * prompt) / dt,
            "ttft_p50_ms": 1e3 * float(np.median([r.ttft_s for r in res]))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--budget", type=int, default=4096, help="StepEngine token budget")
    ap.add_argument("--engines", default="step,old", help="offline runs: step (StepEngine), old (serving.Engine)")
    ap.add_argument("--turns", type=int, default=4, help="multi-turn rounds (0: skip)")
    ap.add_argument("--convs", type=int, default=16, help="multi-turn conversations")
    ap.add_argument("--first", type=int, default=1024, help="first-turn prompt tokens")
    ap.add_argument("--minimal-buckets", action="store_true",
                    help="compile one decode and one prefill size (the limits) instead of powers of four")
    a = ap.parse_args()
    cfg, params = mid_model()
    max_len = a.prompt + a.output + 64
    base = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "config": "MID"}
    rows = []

    def record(**r):
        rows.append({**base, **r})
        print(json.dumps(rows[-1]), flush=True)

    if "step" in a.engines:
        run_step(a, cfg, params, max_len, record)
    if "old" in a.engines:
        t0 = time.perf_counter()
        old = Engine((cfg, params), max_slots=a.requests, max_len=max_len, prefill_chunk=512, prefix_cache=False)
        old.warmup(prefill=False)  # the warm-up run below compiles the prefill pieces it uses
        record(kind="startup", engine="old", seconds=time.perf_counter() - t0)
        offline(old, 4, a.prompt, 4)
        record(kind="offline", engine="old", **offline(old, a.requests, a.prompt, a.output))
    for cache in (False, True) if a.turns else ():
        e = StepEngine((cfg, params), max_running=a.convs, max_len=a.first + 1024, token_budget=a.budget,
                       max_prefill_rows=8, prefix_cache=cache, hash_tokens=128, num_pages=10 * a.convs,
                       **buckets(a, a.convs))
        e.warmup()
        record(kind="multi_turn", engine="step", prefix_cache=cache,
               **multi_turn(e, convs=a.convs, turns=a.turns, first=a.first, step_tokens=256, out_tokens=32))
    write_json(rows, "step_engine.json")


def buckets(a, rows: int) -> dict:
    return {"decode_buckets": (rows,), "prefill_buckets": (a.budget,)} if a.minimal_buckets else {}


def run_step(a, cfg, params, max_len, record):
    t0 = time.perf_counter()
    step = StepEngine((cfg, params), max_running=a.requests, max_len=max_len, token_budget=a.budget,
                      max_prefill_rows=8, hash_tokens=128, num_pages=4 * a.requests + 16, **buckets(a, a.requests))
    step.warmup()
    record(kind="startup", engine="step", seconds=time.perf_counter() - t0, buckets=len(step.runner.bucket_keys()))
    offline(step, 4, a.prompt, 4)  # first-call effects off the clock
    record(kind="offline", engine="step", **offline(step, a.requests, a.prompt, a.output),
           compiles_while_serving=step.runner.compiles_while_serving)


if __name__ == "__main__":
    main()
