"""Time to first token of one long prompt through the engine (``serving.StepEngine``), on a
random bf16 model (default: the first 4 layers of Kimi-Linear-48B-A3B): issue 52's long-context
TTFT on one GPU, and issue 55's KCP prefill (``--expert P --context-from N``: prefill steps of
at least N tokens split over P GPUs) against one GPU.

The prompt is prefilled in chunks of ``--budget`` tokens, one per engine step, and the first
token read back; ``--repeats`` prompts (fresh random tokens, the prefix cache off), the first
also compiling nothing (every bucket is compiled at start-up). Prefill tokens/s is the prompt
over the median TTFT.

Run on the GPU: ``PYTHONPATH=$PWD python3 -m benchmarks.engine_prefill --prompt 131072``; with two
GPUs, beside that: ``... --prompt 524288 --expert 2 --context-from 8192`` and the same without
the mesh flags (writes ``$OUT/engine_prefill.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time

import jax
import numpy as np

from benchmarks.common import random_model, write_json
from benchmarks.model_step import sliced_config
from k3jax.parallel.sharded_step import host_memory_if, step_mesh
from pallas_kernels.mla.prefill_flash import attend_tile
from serving.engine import SamplingParams
from serving.step_engine import StepEngine, default_step_kernels


def ttft_s(engine: StepEngine, prompt: int, seed: int) -> tuple[float, int]:
    """Seconds from submitting a ``prompt``-token request to its first token, and that token."""
    tokens = np.random.default_rng(seed).integers(3, engine.cfg.vocab_size, prompt).tolist()
    t0 = time.perf_counter()
    r = engine.submit(tokens, SamplingParams(max_tokens=2))
    while not r.out:
        engine.step()
    dt = time.perf_counter() - t0
    while engine.has_work():
        engine.step()
    return dt, r.result.token_ids[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/kimi_linear_48b_a3b.json", help="a config file, or 'mid'")
    ap.add_argument("--layers", type=int, default=4, help="keep only the first N layers (0: all)")
    ap.add_argument("--prompt", type=int, default=131072)
    ap.add_argument("--budget", type=int, default=16384, help="prefill tokens per step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mxfp4", action="store_true", help="routed experts packed in MXFP4 (common.random_model)")
    ap.add_argument("--expert", type=int, default=1, help="a mesh's expert axis (1: one device)")
    ap.add_argument("--context-from", type=int, default=None,
                    help="with --expert: prefill steps of at least this many tokens split over it (KCP)")
    ap.add_argument("--expand-from", type=int, default=None,
                    help="prefill chunks of at least this many tokens attend over expanded keys and values "
                         "(StepKernels.expand_prefill_from; default: over the latents, not the engine's GPU default 1024)")
    ap.add_argument("--flash", action="store_true",
                    help="with --expand-from: the expanded attention in the fused kernel (StepKernels.mla_prefill)")
    a = ap.parse_args()
    mesh = step_mesh(1, a.expert) if a.expert > 1 else None
    cfg = sliced_config(a.config, a.layers)
    with host_memory_if(mesh):
        params = random_model(cfg, a.mxfp4)  # consumed by the engine
    t0 = time.perf_counter()
    engine = StepEngine(cfg, params=params, max_running=4, max_len=a.prompt + 64, token_budget=a.budget,
                        max_prefill_rows=1, prefix_cache=False, decode_buckets=(4,), prefill_buckets=(a.budget,),
                        mesh=mesh, context_parallel_from=a.context_from, kernels=dataclasses.replace(
                            default_step_kernels(cfg), expand_prefill_from=a.expand_from,
                            mla_prefill=attend_tile if a.flash else None))
    engine.warmup()
    startup = time.perf_counter() - t0
    times, first = zip(*[ttft_s(engine, a.prompt, seed) for seed in range(a.repeats)])
    ttft = float(np.median(times))
    row = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
           "devices": 1 if mesh is None else mesh.size, "config": a.config, "layers": cfg.num_layers, "mxfp4": a.mxfp4,
           "prompt": a.prompt, "budget": a.budget, "context_from": a.context_from,
           "expand_from": a.expand_from, "flash": a.flash, "first_tokens": first, "ttft_s": times,
           "ttft_median_s": ttft, "prefill_tokens_per_s": a.prompt / ttft, "startup_s": startup,
           "compiles_while_serving": engine.runner.compiles_while_serving}
    print(json.dumps(row), flush=True)
    write_json([row], "engine_prefill.json")


if __name__ == "__main__":
    main()
