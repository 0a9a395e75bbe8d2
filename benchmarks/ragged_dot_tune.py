"""tokamax's grouped matmul on the MoE shapes of a config: its H100 heuristic tiles against
explicit tile configurations and, with ``--autotune``, the fastest ``tokamax.autotune`` finds,
for issue 51's prefill target. The grouped matmul was 11.1 of the 33.2 ms of an 8192-token
prefill on the 48B 4-layer slice (H100, 2026-12-08) with the heuristic's 64 x 64 x 128 tiles;
the autotuner found nothing faster for gate_up at 8192 tokens, but tokamax 0.0.17 searches
only ``block_n = 1024 bits / output width`` (32 columns for a float32 output, 64 for bf16).

Per projection (gate_up and down), token count, output dtype and configuration: the rows routed
uniformly at random over the experts, bf16 operands. One JSON row each (time, TFLOP/s, the
largest difference from the heuristic's output, or the error if the configuration does not
lower), written to ``$OUT/ragged_dot_tune.json``; with ``--autotune`` the autotuning results
go to ``$OUT/ragged_dot_autotune.json`` (``tokamax.autotuning``'s format, which a ``with``
block can apply).

Run on the GPU: ``PYTHONPATH=$PWD python3 -m benchmarks.ragged_dot_tune [--tokens 8192,2048]
[--configs 64x128x64x4,...] [--out-dtypes float32,bfloat16]``. On the CPU only the XLA
implementation exists (nothing to tune): a check that the script runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import jax
import jax.numpy as jnp

from benchmarks.common import time_jax, write_json
from benchmarks.model_step import sliced_config
from k3jax.model.step import _grouped_implementations


def projections(cfg) -> dict[str, tuple[int, int]]:
    """The routed experts' matmuls ``name: (K, N)``."""
    D = cfg.latent_moe_size or cfg.hidden_size
    return {"gate_up": (D, 2 * cfg.moe_intermediate_size), "down": (cfg.moe_intermediate_size, D)}


def case(cfg, tokens: int, K: int, N: int, seed: int = 0):
    """Rows ``bf16[tokens * k, K]`` sorted by expert, experts ``bf16[E, K, N]``, group sizes."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    key = jax.random.split(jax.random.key(seed), 3)
    w = (0.05 * jax.random.normal(key[0], (E, K, N), jnp.float32)).astype(jnp.bfloat16)
    x = jax.random.normal(key[1], (tokens * k, K), jnp.float32).astype(jnp.bfloat16)
    sizes = jnp.bincount(jax.random.randint(key[2], (tokens * k,), 0, E), length=E).astype(jnp.int32)
    return x, w, sizes


DEFAULT_CONFIGS = "64x64x128x2,64x128x64x4,64x128x128x3,64x256x64x3,128x128x64x4,128x256x64x3"


def parse_config(text: str) -> dict:
    """``MxNxKxS`` (block_m x block_n x block_k x stages) as tokamax Config fields; the rest as
    its H100 heuristic has them."""
    from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu_common import MatmulDimension

    m, n, k, stages = map(int, text.split("x"))
    return dict(block_m=m, block_n=n, block_k=k, num_stages=stages, split_k=1, persistent=False,
                grid_minor_dim=MatmulDimension.M, grid_tile_width=1)


def main():
    import tokamax

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/kimi_linear_48b_a3b.json", help="a config file, or 'mid'")
    ap.add_argument("--tokens", default="8192,2048", help="comma-separated (a prefill chunk; 256 decode rows x k / 8)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated MxNxKxS tile configurations")
    ap.add_argument("--out-dtypes", default="float32,bfloat16")
    ap.add_argument("--autotune", action="store_true", help="also tokamax.autotune each case (minutes a case)")
    a = ap.parse_args()
    cfg = sliced_config(a.config, 1)
    impls = _grouped_implementations()
    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "config": a.config,
            "implementations": impls}
    on_gpu = impls is not None and "mosaic" in impls

    def matmul(out_dtype, implementation=impls):  # a fresh jit: the configuration is chosen when it traces
        return jax.jit(lambda x, w, s: tokamax.ragged_dot(x, w, s, preferred_element_type=out_dtype,
                                                          implementation=implementation, bypass_device_check=True))

    rows, tuned = [], []
    emit = lambda r: (rows.append({**meta, **r}), print(json.dumps(rows[-1]), flush=True))
    for tokens in map(int, a.tokens.split(",")):
        for name, (K, N) in projections(cfg).items():
            args = case(cfg, tokens, K, N)
            flops = 2 * args[0].shape[0] * K * N
            shape = {"projection": name, "tokens": tokens, "K": K, "N": N}
            for out_dtype in a.out_dtypes.split(","):
                base = matmul(out_dtype)
                want = base(*args).astype(jnp.float32)
                s0 = time_jax(base, [args])
                emit({**shape, "out": out_dtype, "tiles": "heuristic", "ms": s0 * 1e3, "TFLOP_s": flops / s0 / 1e12})
                for text in a.configs.split(",") if on_gpu else []:
                    emit({**shape, "out": out_dtype, "tiles": text, **time_config(matmul, out_dtype, text, args,
                                                                                  want, flops)})
                if a.autotune:
                    result = tokamax.autotune(base, *args, ignore_cache=True, progress_bar=False)
                    tuned.append(result)
                    with result:
                        timed = measure(matmul(out_dtype), args, want, flops)
                    emit({**shape, "out": out_dtype, "tiles": "autotuned", **timed,
                          "chosen": [str(d.fastest_config) for _, d in result.data if d]})
    write_json(rows, "ragged_dot_tune.json")
    out = os.environ.get("OUT")
    if out and tuned:
        with open(os.path.join(out, "ragged_dot_autotune.json"), "w") as f:
            f.write(json.dumps([json.loads(r.dumps(prune_errors=True)) for r in tuned]))


def time_config(matmul, out_dtype, text: str, args, want, flops) -> dict:
    """One explicit tile configuration of tokamax's Mosaic GPU kernel: its time and its largest
    difference from ``want``, or why it failed."""
    from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import Config, PallasMosaicGpuRaggedDot

    try:
        return measure(matmul(out_dtype, implementation=[PallasMosaicGpuRaggedDot(config=Config(**parse_config(text)))]),
                       args, want, flops)
    except Exception as e:  # noqa: BLE001  (a configuration that does not lower: report it, time the next)
        return {"error": repr(e)[:300]}


def measure(f, args, want, flops) -> dict:
    """``f``'s time and TFLOP/s on ``args`` and its largest difference from ``want``."""
    got = f(*args).astype(jnp.float32)
    s = time_jax(f, [args])
    return {"ms": s * 1e3, "TFLOP_s": flops / s / 1e12, "max_abs_diff": float(jnp.max(jnp.abs(got - want)))}


if __name__ == "__main__":
    main()
