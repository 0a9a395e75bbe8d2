"""Trace and compile time of one serving-step bucket, layers unrolled against the repeating
layers scanned (:func:`k3jax.model.step.stack_layers`). Abstract shapes only: nothing is
allocated, so the full Kimi-Linear-48B compiles on any machine.

``python3 -m benchmarks.step_compile --config configs/kimi_linear_48b_a3b.json --decode 64 --tokens 512``
(``--shrink`` keeps the layer pattern but makes every width small: the per-layer cost without
the big shapes). Writes ``$OUT/step_compile.json`` when ``$OUT`` is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import time

import jax
import jax.numpy as jnp

from benchmarks.common import write_json
from benchmarks.model_step import kernels_for
from k3jax.model import ModelConfig
from k3jax.model.pool import PoolLayout
from k3jax.model.step import jit_step, layer_runs, pack_batch, random_params, stack_layers

SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_heads=2, kv_lora_rank=32,
             qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, linear_num_heads=2, linear_head_dim=32,
             num_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, vocab_size=256)


def compile_seconds(cfg: ModelConfig, *, scan: bool, decode: int, tokens: int, max_blocks: int, rows: int):
    """``(trace s, compile s, temp MB, pool MB)`` of one step bucket with abstract params and pool
    (temp: the compiled step's scratch memory; a pool-sized one would be a copy of the pool)."""
    make = lambda: random_params(cfg, jax.random.key(0))
    params = jax.eval_shape(lambda: stack_layers(cfg, make()) if scan else make())
    lay = PoolLayout.for_model(cfg)
    num_pages = 64
    pool = jax.ShapeDtypeStruct((num_pages, lay.page_words), jnp.uint32)
    batch = pack_batch(lay, [], [], num_decode=decode, num_tokens=decode + tokens,
                       num_rows=decode + (rows if tokens else 0), max_blocks=max_blocks, num_pages=num_pages)
    t0 = time.perf_counter()
    lowered = jit_step.lower(cfg, lay, kernels_for(cfg, "tokamax"), decode, params, pool, batch, num_logprobs=20)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", float("nan")) / 1e6 if mem is not None else float("nan")
    return t1 - t0, t2 - t1, temp, num_pages * lay.page_bytes / 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/kimi_linear_48b_a3b.json")
    ap.add_argument("--shrink", action="store_true", help="the layer pattern with small widths")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512, help="prefill tokens of the bucket")
    ap.add_argument("--rows", type=int, default=4, help="prefill rows of the bucket")
    ap.add_argument("--max-blocks", type=int, default=8)
    ap.add_argument("--modes", default="unrolled,scan", help="which of unrolled,scan to compile")
    a = ap.parse_args()
    jax.config.update("jax_compilation_cache_dir", None)  # measure compiles, not cache hits
    cfg = ModelConfig.from_json(a.config)
    if a.shrink:
        cfg = dataclasses.replace(cfg, **{k: v for k, v in SMALL.items() if hasattr(cfg, k)},
                                  **({"latent_moe_size": 32} if cfg.latent_moe_size else {}))
    res = dict(config=a.config, shrink=a.shrink, layers=cfg.num_layers, runs=layer_runs(cfg), decode=a.decode,
               tokens=a.tokens, device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
               date=datetime.date.today().isoformat())
    for scan in [m == "scan" for m in a.modes.split(",")]:
        trace, comp, temp, pool = compile_seconds(cfg, scan=scan, decode=a.decode, tokens=a.tokens,
                                                  max_blocks=a.max_blocks, rows=a.rows)
        res["scan" if scan else "unrolled"] = dict(trace_s=round(trace, 2), compile_s=round(comp, 2), temp_MB=temp,
                                                   pool_MB=pool)
        print(f"{'scanned' if scan else 'unrolled'}: trace {trace:.1f}s, compile {comp:.1f}s, temp {temp:.0f} MB "
              f"(pool {pool:.0f} MB)", flush=True)
    write_json(res, "step_compile.json")


if __name__ == "__main__":
    main()
