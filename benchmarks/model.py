"""Model throughput on a mid-sized random config: prefill tokens/s and decode-step latency.

Run: ``PYTHONPATH=$PWD python3 benchmarks/model.py`` (writes ``$OUT/model.json``). Uses the
kernels injected by default (the XLA references) unless ``--kernels`` names another set.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from functools import partial

import jax
import jax.numpy as jnp

from benchmarks.common import time_jax, write_json
from k3jax.model import Kernels, ModelConfig, forward, init_cache, init_params

MID = {
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "moe_intermediate_size": 512,
    "num_hidden_layers": 8, "num_attention_heads": 8, "kv_lora_rank": 256, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64, "v_head_dim": 64,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "mlp_layer_types": ["dense"] + ["sparse"] * 7, "linear_num_heads": 8, "linear_head_dim": 128,
    "num_local_experts": 16, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.446,
}


def mid_model():
    """The MID config with bf16 random weights: ``(ModelConfig, params)``."""
    cfg = ModelConfig.from_hf_dict(MID)
    return cfg, init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--recurrent-max-t", type=int, default=Kernels.recurrent_max_t,
                    help="pieces up to this many tokens use the token-by-token KDA (0: always chunked)")
    a = ap.parse_args()
    cfg, params = mid_model()
    n_params = sum(x.size for x in jax.tree.leaves(params))
    fwd = jax.jit(partial(forward, cfg, kernels=Kernels(recurrent_max_t=a.recurrent_max_t)), donate_argnums=2)
    ids = [jax.random.randint(jax.random.key(s), (a.T,), 3, cfg.vocab_size) for s in (1, 2)]
    max_len = a.T + a.decode_steps + 8
    prefill = lambda ids: fwd(params, ids, init_cache(cfg, max_len))
    t_prefill = time_jax(prefill, [(x,) for x in ids], warmup=2, repeats=5)
    logits, cache = prefill(ids[0])
    assert bool(jnp.all(jnp.isfinite(logits))), "non-finite logits"
    tok = jnp.argmax(logits[-1:], axis=-1).astype(jnp.int32)
    fwd(params, tok, cache)  # compile the T = 1 shape
    logits, cache = prefill(ids[0])
    ts = []
    for _ in range(a.decode_steps):
        t0 = time.perf_counter()
        logits, cache = fwd(params, tok, cache)
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tok.block_until_ready()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    row = {"T": a.T, "params_M": n_params / 1e6, "prefill_ms": t_prefill * 1e3, "prefill_tok_s": a.T / t_prefill,
           "decode_step_ms_median": ts[len(ts) // 2] * 1e3, "kernels": "XLA references", "recurrent_max_t": a.recurrent_max_t,
           "date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind}
    print(json.dumps(row))
    write_json(row, "model.json")


if __name__ == "__main__":
    main()
