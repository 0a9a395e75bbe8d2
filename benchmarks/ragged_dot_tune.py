"""tokamax's grouped matmul on the MoE shapes of a config, with its heuristic tile configuration
against the fastest its autotuner finds (``tokamax.autotune``), for issue 51's prefill target:
the grouped matmul was 11.2 of the 40.5 ms of an 8192-token prefill on the 48B 4-layer slice
(H100, 2026-12-07), about 280 TFLOP/s, with the H100 heuristic's 64 x 64 x 128 tiles.

Per projection (gate_up and down) and token count: the rows routed uniformly at random over
the experts, bf16 operands, float32 out (as the step calls it). Prints one JSON row each (the
heuristic's time and TFLOP/s, the tuned one's, the tuned configuration, the largest difference
between the two outputs) and writes them to ``$OUT/ragged_dot_tune.json``; the autotuning
result itself goes to ``$OUT/ragged_dot_autotune.json`` (``tokamax.autotuning``'s format, which
a ``with`` block can apply).

Run on the GPU: ``PYTHONPATH=$PWD python3 -m benchmarks.ragged_dot_tune [--tokens 8192,2048]``.
On the CPU only the XLA implementation exists (nothing to tune): a check that the script runs.
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


def main():
    import tokamax

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/kimi_linear_48b_a3b.json", help="a config file, or 'mid'")
    ap.add_argument("--tokens", default="8192,2048", help="comma-separated (a prefill chunk; 256 decode rows x k / 8)")
    a = ap.parse_args()
    cfg = sliced_config(a.config, 1)
    impls = _grouped_implementations()
    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "config": a.config,
            "implementations": impls}

    def matmul():  # a fresh jit: the configuration is chosen when it traces
        return jax.jit(lambda x, w, s: tokamax.ragged_dot(x, w, s, preferred_element_type=jnp.float32,
                                                          implementation=impls, bypass_device_check=True))

    rows, tuned = [], []
    for tokens in map(int, a.tokens.split(",")):
        for name, (K, N) in projections(cfg).items():
            args = case(cfg, tokens, K, N)
            flops = 2 * args[0].shape[0] * K * N
            base = matmul()
            want = base(*args)
            s0 = time_jax(base, [args])
            result = tokamax.autotune(base, *args, ignore_cache=True, progress_bar=False)
            tuned.append(result)
            with result:
                fast = matmul()
                got = fast(*args)
                s1 = time_jax(fast, [args])
            best = [str(d.fastest_config) for _, d in result.data if d]
            rows.append({**meta, "projection": name, "tokens": tokens, "K": K, "N": N,
                         "heuristic_ms": s0 * 1e3, "heuristic_TFLOP_s": flops / s0 / 1e12,
                         "tuned_ms": s1 * 1e3, "tuned_TFLOP_s": flops / s1 / 1e12, "tuned_config": best,
                         "max_abs_diff": float(jnp.max(jnp.abs(got - want)))})
            print(json.dumps(rows[-1]), flush=True)
    write_json(rows, "ragged_dot_tune.json")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "ragged_dot_autotune.json"), "w") as f:
            f.write(json.dumps([json.loads(r.dumps(prune_errors=True)) for r in tuned]))


if __name__ == "__main__":
    main()
