"""End-to-end serving on a mid-sized random config: prefix cache on vs off on a multi-turn
workload, and speculative decoding on vs off on a repetitive workload.

Run: ``PYTHONPATH=$PWD python3 -m benchmarks.serving_bench`` (writes ``$OUT/serving-<kernels>-<decode>.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import jax
import numpy as np

from benchmarks.common import HBM_BYTES_PER_S, write_json
from benchmarks.model import mid_model
from k3jax.model import Kernels
from pallas_kernels.kda import chunk_kda, kda_commit_dense, kda_recurrent_dense
from serving.engine import Engine


def multi_turn(engine, convs, turns, first, step_tokens, out_tokens, seed=0):
    """Conversations whose turns extend the previous prompt (+ output + new user tokens)."""
    rng = np.random.default_rng(seed)
    V = engine.cfg.vocab_size
    prompts = [list(rng.integers(3, V, first)) for _ in range(convs)]
    ttft, total, t0 = [], 0, time.perf_counter()
    for _ in range(turns):
        res = engine.generate(prompts, max_tokens=out_tokens)
        ttft += [r.ttft_s for r in res]
        total += sum(len(p) + len(r.token_ids) for p, r in zip(prompts, res))
        prompts = [p + r.token_ids + list(rng.integers(3, V, step_tokens - out_tokens)) for p, r in zip(prompts, res)]
    dt = time.perf_counter() - t0
    cached = engine.metrics["cached_tokens"]
    return {"tokens_per_s": total / dt, "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
            "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)), "cached_tokens": cached, "seconds": dt}


def repetitive(engine, n, out_tokens, seed=1):
    rng = np.random.default_rng(seed)
    pats = [list(rng.integers(3, engine.cfg.vocab_size, 16)) * 8 for _ in range(n)]
    engine.warmup(prefill=False)  # verify and commit: random weights rarely let the n-gram drafter propose
    engine.generate(pats, max_tokens=8)
    engine.metrics.update(spec_proposed=0, spec_accepted=0)
    t0 = time.perf_counter()
    res = engine.generate(pats, max_tokens=out_tokens)
    dt = time.perf_counter() - t0
    gen = sum(len(r.token_ids) for r in res)
    m = engine.metrics
    return {"decode_tokens_per_s": gen / dt, "acceptance": m["spec_accepted"] / max(m["spec_proposed"], 1),
            "outputs": [r.token_ids for r in res]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--convs", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--kernels", choices=("xla", "pallas"), default="pallas",
                    help="chunked KDA prefill: the XLA path or pallas_kernels.kda.chunk_kda")
    ap.add_argument("--decode", choices=("xla", "pallas"), default="xla",
                    help="decode steps, verify windows and commit by replay: the XLA references or the Pallas "
                         "slot-pool kernels (kda_recurrent_dense, kda_commit_dense)")
    ap.add_argument("--parts", default="cache,spec", help="comma list: cache (prefix cache on/off), spec (speculation on/off)")
    a = ap.parse_args()
    parts = set(a.parts.split(","))
    cfg, params = mid_model()
    ops = {"chunk_kda": chunk_kda} if a.kernels == "pallas" else {}
    if a.decode == "pallas":
        ops.update(recurrent_kda=kda_recurrent_dense, kda_commit=kda_commit_dense)
    kernels = Kernels(**ops)
    kw = dict(max_slots=a.convs, max_len=4096, prefill_chunk=512, cache_pages=256, kernels=kernels)
    rows = {}
    if "cache" in parts:
        for name, opts in (("cache_on", {}), ("cache_off", {"prefix_cache": False})):
            e = Engine((cfg, params), **kw, **opts)
            multi_turn(e, 1, 2, 1024, 512, 16, seed=99)  # compile (two turns: the cache-hit path too)
            e.metrics["cached_tokens"] = 0
            rows[name] = multi_turn(e, a.convs, a.turns, 1024, 512, 16)
            print(name, rows[name], flush=True)
    if "spec" in parts:
        for name, spec in (("spec_off", 0), ("spec_on", 3)):
            e = Engine((cfg, params), **kw, prefix_cache=False, speculative=spec)
            rows[name] = repetitive(e, a.convs, 48)
            print(name, {k: v for k, v in rows[name].items() if k != "outputs"}, flush=True)
        plain, spec = (rows[k].pop("outputs") for k in ("spec_off", "spec_on"))
        assert spec == plain, "speculation changed greedy outputs"
        param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
        step_s = a.convs / rows["spec_off"]["decode_tokens_per_s"]
        rows["decode_bandwidth_fraction"] = param_bytes / HBM_BYTES_PER_S / step_s
    rows["meta"] = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
                    "config": "benchmarks/model.py MID, bf16 random weights", **vars(a)}
    print(json.dumps(rows, indent=1))
    write_json(rows, f"serving-{a.kernels}-{a.decode}.json")


if __name__ == "__main__":
    main()
