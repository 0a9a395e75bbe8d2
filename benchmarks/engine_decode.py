"""The engine's decode rate against its bare compiled step at the same batch (issue 52: at least
0.9x) and against the bandwidth floor (the bytes a decode step must move, over the measured copy
bandwidth; ``benchmarks.model_step``), on a random bf16 model (default: the first 4 layers of Kimi-Linear-48B-A3B).

``B`` requests of ``--prompt`` random tokens are prefilled, then ``--steps`` engine steps of pure
decode are timed (``StepEngine.step``: plan, pack, dispatch, read back, emit; async dispatch on).
The bare step is the engine's own compiled decode bucket called back to back on one packed batch
of ``B`` rows at the same context (no scheduler, no packing, no read-back but the last). Where
the engine's time goes: the host's work and its wait per step (timed around the read-back), and
on a GPU each side's kernel time per step from a profile (``device_busy``: the engine's kernel
time over its step time).

Run on the GPU: ``PYTHONPATH=$PWD python3 -m benchmarks.engine_decode`` (writes ``$OUT/engine_decode.json``);
on several GPUs (issue 55) ``--tensor 2`` or ``--expert 2`` beside a run without, for tokens/s per GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import datetime
import json
import time

import jax
import numpy as np

from benchmarks.common import kernel_seconds, random_model, write_json
from benchmarks.model_step import copy_bandwidth, decode_floor_bytes, decode_tokens, sliced_config
from k3jax.model.step import Row, batch_shapes, flatten_batch, pack_batch
from serving.engine import SamplingParams
from k3jax.parallel.sharded_step import host_memory_if, step_mesh
from serving.step_engine import StepEngine, default_step_kernels


PROFILED_STEPS = 20


def engine_decode_ms(engine: StepEngine, B: int, prompt: int, steps: int, seed: int = 0,
                     temperature: float = 0.0, top_p: float = 1.0) -> tuple[float, float, dict]:
    """Milliseconds per engine step once ``B`` requests of ``prompt`` tokens (sampling with
    ``temperature`` and ``top_p``, each its own seed) all decode; of them
    the milliseconds the host waited for the device (the rest is host work); and the device's
    seconds per step by kernel from a profile of :data:`PROFILED_STEPS` more (empty without
    a GPU). Kernel time over step time is the fraction of the step the device is busy."""
    rng = np.random.default_rng(seed)
    sp = SamplingParams(max_tokens=engine.max_len - prompt, temperature=temperature, top_p=top_p)
    reqs = [engine.submit(rng.integers(3, engine.cfg.vocab_size, prompt).tolist(), dataclasses.replace(sp, seed=i))
            for i in range(B)]
    while any(not r.out for r in reqs):
        engine.step()
    for _ in range(3):
        engine.step()
    waited = [0.0]
    fetch = engine.runner.fetch

    def timed_fetch(handle, logprobs=False):
        t = time.perf_counter()
        jax.block_until_ready(handle[0].tokens)
        waited[0] += time.perf_counter() - t
        return fetch(handle, logprobs)

    engine.runner.fetch = timed_fetch
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t0
    del engine.runner.fetch
    device = kernel_seconds(engine.step, PROFILED_STEPS)
    for r in reqs:
        engine.abort(r)
    engine.step()
    engine.step()
    return dt / steps * 1e3, waited[0] / steps * 1e3, device


def bare_decode_ms(engine: StepEngine, B: int, context: int, steps: int, **step_kw) -> tuple[float, dict]:
    """Milliseconds per call of the engine's compiled decode bucket for ``B`` rows at ``context``
    (pages and slots taken from the top of the pool; run after :func:`engine_decode_ms`), each
    row its own random token (:func:`benchmarks.model_step.decode_tokens`: one token for all made
    the bare step's MoE about 1 ms cheaper than the engine's at batch 64 on an H100). Returns its
    device seconds per call by kernel from a profile (empty without a GPU). ``step_kw``: more
    arguments of the step (``sample_rows=True``: the sampler inside the step, as before the engine
    left it to a second call when a row draws)."""
    r = engine.runner
    nd, _, _ = r.bucket(B, 0)
    blocks = -(-(context + 1) // r.lay.page_tokens)
    top = r.num_pages
    if top < B * (blocks + 1):
        raise ValueError(f"{top} pages cannot hold {B} rows of {blocks} pages and a state page each")
    rows = [Row([t], context, list(range(top - (i + 1) * blocks, top - i * blocks)), slot=top - B * blocks - 1 - i)
            for i, t in enumerate(decode_tokens(engine.cfg, B))]
    batch = pack_batch(r.lay, rows, [], num_decode=nd, num_tokens=nd, num_rows=nd, max_blocks=r.max_blocks,
                       num_pages=r.num_pages, to_device=False)
    ints, floats = r.place(flatten_batch(batch))
    state = {"pool": r.pool, "last": r.last}

    def run():
        out, state["pool"], state["last"] = r._step(nd, r.params, state["pool"], state["last"], ints, floats,
                                                    shapes=batch_shapes(batch), window=1, num_logprobs=r.num_logprobs,
                                                    **step_kw)
        return out.tokens

    jax.block_until_ready(run())
    t0 = time.perf_counter()
    for _ in range(steps):
        out = run()
    jax.block_until_ready(out)
    dt = (time.perf_counter() - t0) / steps * 1e3
    device = kernel_seconds(run, PROFILED_STEPS)
    r.pool, r.last = state["pool"], state["last"]
    return dt, device


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/kimi_linear_48b_a3b.json", help="a config file, or 'mid'")
    ap.add_argument("--layers", type=int, default=4, help="keep only the first N layers (0: all)")
    ap.add_argument("--batches", default="64")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--budget", type=int, default=4096, help="token budget per step")
    ap.add_argument("--pages-per-row", type=int, default=4, help="pool pages per batch row (the bare step takes half)")
    ap.add_argument("--tensor", type=int, default=1, help="a mesh's tensor axis (issue 55's TP runs; 1 and --expert 1: "
                                                          "one device)")
    ap.add_argument("--expert", type=int, default=1, help="a mesh's expert axis")
    ap.add_argument("--mxfp4", action="store_true", help="routed experts packed in MXFP4 (common.random_model)")
    ap.add_argument("--temperature", type=float, default=0.0, help="the requests' (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="the requests' (with --temperature)")
    ap.add_argument("--search-cuts", action="store_true",
                    help="top-k / top-p by searched cuts (StepKernels.search_cuts)")
    ap.add_argument("--inline-sampler", action="store_true",
                    help="also time the bare step with the sampler inside it (its sort on every step)")
    a = ap.parse_args()
    mesh = step_mesh(a.tensor, a.expert) if a.tensor * a.expert > 1 else None
    devices = 1 if mesh is None else mesh.size
    cfg = sliced_config(a.config, a.layers)
    base = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "config": a.config,
            "layers": cfg.num_layers, "mxfp4": a.mxfp4, "prompt": a.prompt, "steps": a.steps, "tensor": a.tensor,
            "expert": a.expert, "temperature": a.temperature, "top_p": a.top_p, "search_cuts": a.search_cuts}
    bandwidth = copy_bandwidth()
    rows = []
    for B in map(int, a.batches.split(",")):
        max_len = a.prompt + 2 * a.steps + PROFILED_STEPS + 64
        t0 = time.perf_counter()
        # step-format weights built a layer at a time and consumed by the engine (the whole model fits once)
        with host_memory_if(mesh):
            params = random_model(cfg, a.mxfp4)
        engine = StepEngine(cfg, params=params, max_running=B, max_len=max_len, token_budget=max(a.budget, B + 1),
                            prefix_cache=False, decode_buckets=(B,), prefill_buckets=(max(a.budget, B + 1),),
                            num_pages=a.pages_per_row * B + 64, mesh=mesh,
                            kernels=dataclasses.replace(default_step_kernels(cfg), search_cuts=a.search_cuts))
        engine.warmup()
        startup = time.perf_counter() - t0
        eng, wait, eng_kernels = engine_decode_ms(engine, B, a.prompt, a.steps, temperature=a.temperature,
                                                  top_p=a.top_p)
        bare, bare_kernels = bare_decode_ms(engine, B, a.prompt + a.steps + PROFILED_STEPS, a.steps)
        inline = bare_decode_ms(engine, B, a.prompt + a.steps + PROFILED_STEPS, a.steps, sample_rows=True)[0] \
            if a.inline_sampler and mesh is None else None
        eng_device, bare_device = sum(eng_kernels.values()) * 1e3, sum(bare_kernels.values()) * 1e3
        extra = {k: (eng_kernels.get(k, 0) - bare_kernels.get(k, 0)) * 1e3 for k in {*eng_kernels, *bare_kernels}}
        r = engine.runner
        # one device's floor (on a mesh the bytes split unevenly: replicated latents, router)
        floor = decode_floor_bytes(cfg, r.params, r.lay, B, a.prompt + a.steps) / bandwidth * 1e3 if mesh is None else None
        rows.append({**base, "batch": B, "engine_step_ms": eng, "bare_step_ms": bare, "ratio": bare / eng,
                     "bare_sampling_in_step_ms": inline,
                     "host_ms": eng - wait, "wait_ms": wait, "engine_kernel_ms": eng_device,
                     "bare_kernel_ms": bare_device, "device_busy": eng_device / eng,
                     "engine_extra_kernel_ms": dict(sorted(extra.items(), key=lambda kv: -abs(kv[1]))[:6]),
                     "engine_top_kernel_ms": {k: v * 1e3 for k, v in sorted(eng_kernels.items(), key=lambda kv: -kv[1])[:10]},
                     "floor_ms": floor, "engine_of_floor": floor and floor / eng, "copy_GB_s": bandwidth / 1e9,
                     "engine_tokens_per_s": B / eng * 1e3, "tokens_per_s_per_device": B / eng * 1e3 / devices,
                     "startup_s": startup,
                     "compiles_while_serving": engine.runner.compiles_while_serving})
        print(json.dumps(rows[-1]), flush=True)
        del engine, r, params  # before the next batch's weights exist
        gc.collect()
    write_json(rows, "engine_decode.json")


if __name__ == "__main__":
    main()
