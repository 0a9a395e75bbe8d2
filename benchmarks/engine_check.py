"""Both engines on the current device with their default kernels: ``serving.Engine`` and
``serving.StepEngine`` (float32 and bf16, prefix cache on; then float32 with speculation; the step's default kernels, on
a GPU the Pallas prefill) on the tiny model with a fifth layer (so the step scans layers 1-4), the
same greedy tokens, a resend served from the prefix cache, start-up time and compiles while
serving. The check to run on the GPU after any change to the serving path.

Run: ``PYTHONPATH=$PWD python3 -m benchmarks.engine_check`` (exit status 1 if a check fails;
``--quick``: the float32 StepEngine only; ``--paged mla|kda|both``: add the Pallas decode kernels
on pages; ``--pages N``: the pool's pages, default 64, 0: the engine's default sizing;
``--expand-from 64``: the prefill chunks over expanded keys and values, on a GPU in the fused
kernel).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

import jax
import jax.numpy as jnp

from k3jax.model import ModelConfig, init_params
from k3jax.model.step import layer_runs
from serving.engine import CONFIGS, Engine
from pallas_kernels.kda.decode_pages import kda_decode_pages
from pallas_kernels.mla import paged_mla_decode
from serving.step_engine import StepEngine, default_step_kernels

PROMPTS = [[5, 6, 7] * 100, [9] * 40]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--paged", choices=("mla", "kda", "both"))
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--expand-from", type=int, default=None,
                    help="prefill chunks of at least this many tokens attend over expanded keys and values "
                         "(StepKernels.expand_prefill_from; the GPU default 1024 is past these prompts)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for name in ("jax", "absl"):
        logging.getLogger(name).setLevel(logging.WARNING)
    cfg = ModelConfig.from_json(f"{CONFIGS}/tiny.json")
    cfg = dataclasses.replace(cfg, layer_types=(*cfg.layer_types, "mla"), mlp_types=(*cfg.mlp_types, "moe"))
    assert layer_runs(cfg)
    model = (cfg, init_params(cfg, jax.random.key(0)))
    e = Engine(model, max_slots=2, max_len=1024, prefill_chunk=256)
    e.warmup(prefill=False)
    ref = [r.token_ids for r in e.generate(PROMPTS, max_tokens=8)]
    print("Engine", ref, flush=True)
    ok = True
    kernels = default_step_kernels(cfg)
    if a.paged in ("mla", "both"):
        kernels = dataclasses.replace(kernels, mla_decode=paged_mla_decode)
    if a.paged in ("kda", "both"):
        kernels = dataclasses.replace(kernels, kda_decode=kda_decode_pages)
    if a.expand_from:
        kernels = dataclasses.replace(kernels, expand_prefill_from=a.expand_from)
    variants = ((jnp.float32, {}), (jnp.bfloat16, {}), (jnp.float32, dict(speculative=3)))
    for dt, extra in variants[:1] if a.quick else variants:
        t0 = time.perf_counter()
        s = StepEngine(model, dtype=dt, max_running=4, max_len=1024, token_budget=256, hash_tokens=64, num_pages=a.pages or None,
                       kernels=kernels, **extra)
        s.warmup()
        start = time.perf_counter() - t0
        out = [r.token_ids for r in s.generate(PROMPTS, max_tokens=8)]
        again = s.generate(PROMPTS, max_tokens=8)
        same, resend = out == ref, [r.token_ids for r in again] == out
        ok &= same and resend and again[0].num_cached_tokens > 0 and s.runner.compiles_while_serving == 0
        print(f"StepEngine {dt.__name__} {sorted(extra)} paged {a.paged} pages {a.pages} ({s.runner.pool.size / 2**31:.2f} x 2^31 words) expand from {kernels.expand_prefill_from} flash {kernels.mla_prefill is not None}: start-up {start:.1f}s ({len(s.runner.bucket_keys())} buckets), same as Engine "
              f"{same}, resend same {resend}, cached {[r.num_cached_tokens for r in again]}, compiles while serving "
              f"{s.runner.compiles_while_serving}", flush=True)
    print("OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
