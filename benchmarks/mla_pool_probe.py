"""The paged MLA decode kernel alone at the step engine's geometry (the tiny model with a fifth,
MLA layer, as ``benchmarks.engine_check``; 64-token pages) on a pool of about ``words`` 32-bit
words: the probe for the CUDA illegal address the engine hits with this kernel on its default
pool (docs/benchmarks.md, 2026-12-06). Prints the layout, then OK and the output's sum, or dies.

Run on the GPU: ``PYTHONPATH=$PWD python3 -m benchmarks.mla_pool_probe f32 2147483647 pad``
(dtype f32|bf16, pool words, pad: 4 rows of length 0 and no pages | live: one row over the
pool's last two pages; optional block-table width, default 16).
"""

from __future__ import annotations

import dataclasses
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.model import ModelConfig
from k3jax.model.pool import PoolLayout, latent_words
from pallas_kernels.mla import paged_mla_decode
from serving.engine import CONFIGS


ONES = {"f32": 0x3F800000, "bf16": 0x3F803F80}  # a word of latents all 1.0


def main(dtype: str, words: int, rows: str, blocks: int = 16):
    dt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    cfg = ModelConfig.from_json(f"{CONFIGS}/tiny.json")
    cfg = dataclasses.replace(cfg, layer_types=(*cfg.layer_types, "mla"), mlp_types=(*cfg.mlp_types, "moe"))
    lay = PoolLayout.for_model(cfg, latent_dtype=dt, token_multiple=64)
    N = words // lay.page_words
    print(f"{dtype} {rows}: page_tokens {lay.page_tokens}, page_words {lay.page_words}, {N} pages, "
          f"{N * lay.page_words} words", flush=True)
    Q, H = 4, cfg.num_heads
    bt, lengths = np.full((Q, blocks), -1, np.int32), np.zeros(Q, np.int32)
    if rows == "live":
        bt[0, :2], lengths[0] = [N - 1, N - 2], lay.page_tokens + 3
    run = jax.jit(partial(paged_mla_decode, page_tokens=lay.page_tokens, scale=0.1))
    o = run(jnp.ones((Q, H, cfg.kv_lora_rank), dt), jnp.ones((Q, H, cfg.qk_rope_head_dim), dt),
            latent_words(lay, jnp.full((N, lay.page_words), ONES[dtype], jnp.uint32)), jnp.asarray(bt), jnp.asarray(lengths),
            jnp.int32(1))
    print("OK", float(jnp.abs(o).sum()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *map(int, sys.argv[4:]))
