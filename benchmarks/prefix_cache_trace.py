"""Replay a Mooncake-format trace through the prefix cache under three designs (CPU, no model).

- ``k3``: our design: 512-token hash blocks, physical blocks derived from the model shape,
  KDA checkpoints at a sparse subset of hash endpoints (``--k3-policy``, default ``junction+interval:16``, chosen by the measurement in docs/benchmarks.md).
- ``block``: a plain hybrid cache: the hash unit is the physical block, a checkpoint at every
  block end.
- ``dense``: the ideal: a checkpoint at every 512-token hash endpoint.

The pool is sized like a real deployment (``--pool-gib`` of cache memory; page bytes from the
Kimi-Linear-48B shape: 20 KDA layers of 32 x 128 x 128 float32 state, 7 MLA layers of
512 + 64 bf16 per token). Requests are replayed in arrival order, one at a time.

Usage: ``python benchmarks/prefix_cache_trace.py --trace PATH``; prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import json

from serving.page_pool import PagePool, PoolExhausted, PoolLayout, hybrid_groups
from serving.prefix_cache import CacheConfig, PrefixCache

KIMI_LINEAR_48B = dict(kda_layers=20, mla_layers=7, HV=32, K=128, V=128, kv_lora_rank=512, rope_dim=64, conv_width=4)


def model_layout(m=KIMI_LINEAR_48B):
    kda_groups, mla_groups = hybrid_groups(m["kda_layers"], m["mla_layers"])
    conv = (m["conv_width"] - 1) * (2 * m["HV"] * m["K"] + m["HV"] * m["V"])  # q, k, v conv states
    lay = PoolLayout(layers_per_group=m["mla_layers"], HV=m["HV"], K=m["K"], V=m["V"], kv_lora_rank=m["kv_lora_rank"],
                     rope_dim=m["rope_dim"], conv_words_per_layer=conv)
    return lay, kda_groups, mla_groups


def replay(trace, policy: str, *, pool_gib: float | None, block_tokens: int, k3_policy: str, hash_tokens=512):
    lay, kda_groups, mla_groups = model_layout()
    if policy == "k3":
        cfg = CacheConfig(hash_tokens, block_tokens, mla_groups, kda_groups, k3_policy)
    elif policy == "block":
        cfg = CacheConfig(block_tokens, block_tokens, mla_groups, kda_groups, "dense")
    elif policy == "dense":
        cfg = CacheConfig(hash_tokens, block_tokens, mla_groups, kda_groups, "dense")
    else:
        raise ValueError(policy)
    num_pages = 10**7 if pool_gib is None else int(pool_gib * 2**30 // lay.page_bytes)
    pool = PagePool(num_pages, with_storage=False)
    cache = PrefixCache(cfg, pool)
    stride = cfg.hash_tokens // hash_tokens
    rejected = peak_ckpts = 0
    for i, req in enumerate(trace):
        n = req["input_length"]
        ids = req["hash_ids"][: n // hash_tokens]
        # The trace's ids are chained per 512 tokens: a coarser unit is named by its last 512 id.
        hashes = ids[stride - 1 :: stride]
        try:
            cache.admit(i, hashes, n)
        except PoolExhausted:
            rejected += 1
            continue
        try:
            cache.on_forward(i, n)
        except PoolExhausted:
            pass  # no room for a checkpoint: served, nothing kept
        cache.end_step()
        cache.finish(i)
        peak_ckpts = max(peak_ckpts, cache.num_checkpoints())
    m = cache.metrics
    ckpt_bytes = cache.num_checkpoints() * kda_groups * lay.page_bytes
    return {
        "policy": policy,
        "token_hit_rate": m["hit_tokens"] / m["query_tokens"],
        "checkpoints": cache.num_checkpoints(),
        "checkpoints_peak": peak_ckpts,
        "checkpoints_written": m["checkpoints_written"],
        "checkpoint_gib": ckpt_bytes / 2**30,
        "tokens_lost_to_missing_checkpoint": m["lost_tokens"] / m["query_tokens"],
        "evictions": pool.evictions,
        "rejected": rejected,
        "block_tokens": block_tokens,
        "hash_tokens": cfg.hash_tokens,
        "checkpoint_policy": cfg.checkpoint_policy,
        "pool_gib": pool_gib,
        "page_mib": lay.page_bytes / 2**20,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--pool-gib", type=float, default=400.0, help="cache memory; 0 = unlimited")
    ap.add_argument("--block-tokens", type=int, default=None, help="physical block (default: derived, 2048)")
    ap.add_argument("--k3-policy", default="junction+interval:16", help="parts: turn, junction, interval:N, dense; join with +")
    ap.add_argument("--policies", default="k3,block,dense")
    a = ap.parse_args()
    with open(a.trace) as f:
        trace = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["timestamp"])
    block = a.block_tokens or model_layout()[0].block_tokens
    for policy in a.policies.split(","):
        row = replay(trace, policy, pool_gib=a.pool_gib or None, block_tokens=block, k3_policy=a.k3_policy)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
