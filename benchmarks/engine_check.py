"""Both engines on the current device with their default kernels: ``serving.Engine`` and
``serving.StepEngine`` (float32 and bf16, prefix cache on; then float32 with speculation; on a
GPU the step's defaults are the Pallas prefill and the decode kernels on pages) on the tiny model with a fifth layer (so the step scans layers
1-4), the same greedy tokens, a resend served from the prefix cache, start-up time and compiles
while serving. The check to run on the GPU after any change to the serving path.

Run: ``PYTHONPATH=$PWD python3 -m benchmarks.engine_check`` (exit status 1 if a check fails;
``--quick``: the float32 StepEngine only).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time

import jax
import jax.numpy as jnp

from k3jax.model import ModelConfig, init_params
from k3jax.model.step import layer_runs
from serving.engine import CONFIGS, Engine
from serving.step_engine import StepEngine

PROMPTS = [[5, 6, 7] * 100, [9] * 40]


def main() -> int:
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
    # The step engine's default kernels: on a GPU the Pallas prefill and decode kernels on pages.
    variants = ((jnp.float32, {}), (jnp.bfloat16, {}), (jnp.float32, dict(speculative=3)))
    for dt, extra in variants[:1] if "--quick" in sys.argv else variants:
        t0 = time.perf_counter()
        s = StepEngine(model, dtype=dt, max_running=4, max_len=1024, token_budget=256, hash_tokens=64, num_pages=64,
                       **extra)
        s.warmup()
        start = time.perf_counter() - t0
        out = [r.token_ids for r in s.generate(PROMPTS, max_tokens=8)]
        again = s.generate(PROMPTS, max_tokens=8)
        same, resend = out == ref, [r.token_ids for r in again] == out
        ok &= same and resend and again[0].num_cached_tokens > 0 and s.runner.compiles_while_serving == 0
        print(f"StepEngine {dt.__name__} {sorted(extra)}: start-up {start:.1f}s ({len(s.runner.compiled)} buckets), same as Engine "
              f"{same}, resend same {resend}, cached {[r.num_cached_tokens for r in again]}, compiles while serving "
              f"{s.runner.compiles_while_serving}", flush=True)
    print("OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
