"""Host time per serving step (ENGINE.md: under 1 ms at batch 256): the scheduler's plan, the
batch packing and its host->device copy, for decode rows of 4k-token requests on the
Kimi-Linear-48B page layout, with the prefix cache off and on. No model runs (host only).

Run: ``PYTHONPATH=$PWD python3 -m benchmarks.host_step`` (writes ``$OUT/host_step.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import jax
import numpy as np

from benchmarks.common import write_json
from k3jax.model import ModelConfig
from k3jax.model.pool import PoolLayout
from k3jax.model.step import flatten_batch, pack_batch
from serving.engine import SamplingParams
from serving.page_pool import PagePool
from serving.prefix_cache import CacheConfig, PrefixCache
from serving.scheduler import Scheduler


def _land(s: Scheduler, plan):
    """What the engine does with a step's tokens, without a model: every kept row samples 7."""
    for r, keep in zip(plan.requests, plan.keep):
        if keep:
            r.pending -= 1
            r.out.append(7)
    s.landed()


def host_ms(lay: PoolLayout, batch: int, prompt: int, cache: bool, steps: int = 200) -> dict[str, float]:
    """Median milliseconds per step: the whole host step, and its parts (plan, pack: the packing,
    flattening and copy to the device, advance)."""
    P, pages = lay.page_tokens, batch * (prompt // lay.page_tokens + 4)
    pool = PagePool(pages, with_storage=False)
    pc = PrefixCache(CacheConfig(512, P, 1, 1), pool) if cache else None
    s = Scheduler(pool, P, token_budget=8192, max_decode=batch, max_prefill_rows=8, max_chunk=8192, cache=pc)
    rng = np.random.default_rng(0)
    for _ in range(batch):
        s.add(s.new_request(rng.integers(0, 1000, prompt).tolist(), SamplingParams(max_tokens=10**6), 0))
    while s.waiting or any(r.done < r.prefill_end for r in s.running):  # prefill everything
        plan = s.plan()
        s.advance(plan)
        _land(s, plan)
    blocks = -(-(prompt + steps + 1) // P)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = s.plan()
        t1 = time.perf_counter()
        jax.device_put(flatten_batch(pack_batch(lay, plan.decode, plan.prefill, num_decode=batch, num_tokens=batch,
                                                num_rows=batch, max_blocks=blocks, num_pages=pages, to_device=False)))
        t2 = time.perf_counter()
        s.advance(plan)
        t3 = time.perf_counter()
        ts.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
        _land(s, plan)
    med = 1e3 * np.median(np.array(ts), axis=0)
    return dict(zip(("host_ms_per_step_p50", "plan_ms_p50", "pack_ms_p50", "advance_ms_p50"), map(float, med)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/kimi_linear_48b_a3b.json")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200, help="decode steps timed per case (their median is reported)")
    a = ap.parse_args()
    lay = PoolLayout.for_model(ModelConfig.from_json(a.config), token_multiple=512)
    rows = []
    for cache in (False, True):
        for b in map(int, a.batches.split(",")):
            rows.append({"date": datetime.date.today().isoformat(), "host": platform.processor() or platform.machine(),
                         "batch": b, "prefix_cache": cache, **host_ms(lay, b, a.prompt, cache, a.steps)})
            print(json.dumps(rows[-1]), flush=True)
    write_json(rows, "host_step.json")


if __name__ == "__main__":
    main()
