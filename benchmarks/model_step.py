"""The serving step (``k3jax.model.step``) on a random bf16 model: decode tokens/s against the
bytes floor, prefill TFLOP/s, the grouped matmul choice, and the old engine's decode beside it.

Run on the GPU: ``PYTHONPATH=$PWD python3 -m benchmarks.model_step --config configs/kimi_linear_48b_a3b.json``
(writes ``$OUT/model_step.json``). ``--config mid`` is the 294 M ``MID`` config of
``benchmarks/model.py``; ``--old-engine`` also times the old engine's vmapped decode there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import hlo_sources, kernel_seconds, random_model, write_json
from k3jax.model import ModelConfig
from k3jax.model.pool import PoolLayout
from k3jax.model.step import (PREFILL_TILE, Row, StepKernels, jit_step, layer_shapes, pack_batch,
                              stack_layers)
from pallas_kernels.mla.prefill_flash import attend_tile
from pallas_kernels.moe import mxfp4_grouped_matmul

BF16_PEAK = 790e12


def copy_bandwidth(n_bytes=4 << 30) -> float:
    """Bytes per second of a device copy (read + write) of ``n_bytes``."""
    x = jnp.ones((n_bytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001)
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    return 2 * n_bytes / min(ts)


def sliced_config(config: str, layers: int = 0) -> ModelConfig:
    """A config file (or "mid": ``benchmarks.model.MID``) keeping only its first ``layers`` layers (0: all)."""
    if config == "mid":
        from benchmarks.model import MID
        d = dict(MID)
    else:
        with open(config) as f:
            d = json.load(f)
    if layers:
        d["num_hidden_layers"] = layers
        lin = d.get("linear_attn_config", {})
        for key in ("kda_layers", "full_attn_layers"):
            if key in lin:
                lin[key] = [i for i in lin[key] if i <= layers]
        for key in ("layer_types", "mlp_layer_types"):
            if key in d:
                d[key] = d[key][:layers]
    return ModelConfig.from_hf_dict(d)


def kernels_for(cfg, ragged: str, paged_mla: bool = False, paged_kda: bool = False) -> StepKernels:
    chunk = None
    if jax.default_backend() == "gpu":
        from pallas_kernels.kda import chunk_kda
        chunk = chunk_kda
    if ragged == "triton":  # the dense grouped matmul for decode-sized groups (a decode-only comparison)
        from pallas_kernels.moe import grouped_matmul as rd
    else:
        rd = {"jax.lax": jax.lax.ragged_dot, "tokamax": StepKernels.ragged_dot}[ragged]
    mla = {}
    if paged_mla:
        from pallas_kernels.mla import paged_mla_decode
        mla = {"mla_decode": paged_mla_decode}
    if paged_kda:
        from pallas_kernels.kda.decode_pages import kda_decode_pages
        mla["kda_decode"] = kda_decode_pages
    return StepKernels(**({"chunk_kda": chunk} if chunk else {}), ragged_dot=rd, **mla)


def param_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def decode_floor_bytes(cfg: ModelConfig, params, lay: PoolLayout, B: int, ctx: int) -> float:
    """Bytes one decode step must move: every non-expert weight (not the embedding table), the
    experts ``B`` tokens touch (uniform routing: ``E (1 - (1 - k/E)^B)`` per layer), each row's
    KDA and conv state read and written, and its MLA latents read."""
    total = 0
    for i, lp in enumerate(layer_shapes(cfg, params)):
        mp = lp["mlp"]
        if cfg.mlp_types[i] == "moe":
            E, k = cfg.num_experts, cfg.num_experts_per_tok
            touched = E * (1 - (1 - k / E) ** B)
            total += (param_bytes(mp["gate_up"]) + param_bytes(mp["down"])) * touched / E
            total += param_bytes({n: v for n, v in mp.items() if n not in ("gate_up", "down")})
        else:
            total += param_bytes(mp)
        total += param_bytes(lp["attn"])
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    total += param_bytes(head)
    state = lay.n_kda * lay.HV * (lay.K * lay.V + lay.conv_words) * 4
    return total + B * (2 * state + ctx * lay.n_mla * lay.latent * 2)


def timed_steps(run, steps: int) -> float:
    """Seconds per step of ``steps`` back-to-back calls of ``run()`` (it returns what to wait on)."""
    jax.block_until_ready(run())
    t0 = time.perf_counter()
    for _ in range(steps):
        out = run()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def decode_tokens(cfg, B: int) -> list[int]:
    """A random token for each of ``B`` decode rows. Rows of one token over a zeroed pool route to
    the same experts, so a step read k experts a layer where the floor counts those of uniform
    routing (the bare steps before 2026-12-07)."""
    return np.random.default_rng(1).integers(3, cfg.vocab_size, B).tolist()


def top_kernels(run, lowered) -> dict:
    """Device microseconds per call of ``run()``'s kernels that take the most, its device total,
    and the model code behind each XLA kernel (:func:`benchmarks.common.hlo_sources` of
    ``lowered``, the step as lowered, compiled again for its HLO)."""
    per = sorted(kernel_seconds(run, steps=5).items(), key=lambda kv: -kv[1])
    sources = hlo_sources(lowered.compile().as_text())
    return {"top_kernels_us": {k[:80]: round(v * 1e6, 1) for k, v in per[:12]},
            "top_kernel_sources": {k: sources[k] for k, _ in per[:12] if k in sources},
            "device_ms": sum(v for _, v in per) * 1e3}


def bench_decode(cfg, params, kernels, B: int, ctx: int, steps: int, bw: float, profile: bool = False) -> dict:
    lay = PoolLayout.for_model(cfg, token_multiple=512)
    blocks = -(-(ctx + 1) // lay.page_tokens)
    num_pages = B * (blocks + 1)
    pool = lay.allocate(num_pages)
    rows = [Row([t], ctx, list(range(B + r * blocks, B + (r + 1) * blocks)), slot=r)
            for r, t in enumerate(decode_tokens(cfg, B))]
    batch = pack_batch(lay, rows, [], num_decode=B, num_tokens=B, num_rows=B, max_blocks=blocks, num_pages=num_pages)
    state = {"pool": pool}

    def run():  # greedy rows: the step as the engine runs it (sampling left to a call it skips)
        out, state["pool"] = jit_step(cfg, lay, kernels, B, params, state["pool"], batch, sample_rows=False)
        return out.tokens

    t0 = time.perf_counter()
    jax.block_until_ready(run())
    compile_s = time.perf_counter() - t0
    s = timed_steps(run, steps)
    floor = decode_floor_bytes(cfg, params, lay, B, ctx) / bw
    top = top_kernels(run, jit_step.lower(cfg, lay, kernels, B, params, state["pool"], batch,
                                          sample_rows=False)) if profile else {}
    return {**top, "kind": "decode", "batch": B, "context": ctx, "step_ms": s * 1e3, "tokens_per_s": B / s,
            "floor_ms": floor * 1e3, "fraction_of_floor": floor / s, "page_tokens": lay.page_tokens,
            "pages": num_pages, "pool_GB": num_pages * lay.page_bytes / 1e9, "compile_s": compile_s}


def active_flops_per_token(cfg, params) -> float:
    """2 x the weights one token multiplies (k routed experts of each MoE layer)."""
    n = 0
    for i, lp in enumerate(layer_shapes(cfg, params)):
        mp = lp["mlp"]
        if cfg.mlp_types[i] == "moe":
            n += (mp["gate_up"].size + mp["down"].size) * cfg.num_experts_per_tok / cfg.num_experts
            n += sum(x.size for x in jax.tree.leaves({k: x for k, x in mp.items() if k not in ("gate_up", "down")}))
        else:
            n += sum(x.size for x in jax.tree.leaves(mp))
        n += sum(x.size for x in jax.tree.leaves(lp["attn"]))
    return 2 * n


def bench_prefill(cfg, params, kernels, T: int, profile: bool = False) -> dict:
    lay = PoolLayout.for_model(cfg, token_multiple=512)
    blocks = -(-T // lay.page_tokens)
    pool = lay.allocate(blocks + 1)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, T).tolist()
    batch = pack_batch(lay, [], [Row(tokens, 0, list(range(1, blocks + 1)), slot=0)], num_decode=0, num_tokens=T,
                       num_rows=1, max_blocks=blocks, num_pages=blocks + 1)
    state = {"pool": pool}

    def run():
        out, state["pool"] = jit_step(cfg, lay, kernels, 0, params, state["pool"], batch)
        return out.tokens

    s = timed_steps(run, 3)
    S = -(-T // PREFILL_TILE) * PREFILL_TILE
    # the attention as computed (every query over the row's context in whole tiles): scores + values,
    # over the latents (absorbed) or over keys and values expanded from them (and that expansion)
    expanded = kernels.expand_prefill_from is not None and T >= kernels.expand_prefill_from
    if expanded:
        nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
        per_pair = nope + cfg.qk_rope_head_dim + v
        expand = S * cfg.num_heads * 2 * cfg.kv_lora_rank * (nope + v)
    else:
        per_pair, expand = 2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim, 0
    attn = len(cfg.mla_layers) * (T * S * cfg.num_heads * 2 * per_pair + expand)
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    flops = active_flops_per_token(cfg, params) * T + attn + 2 * head.size  # logits of the last token only
    top = top_kernels(run, jit_step.lower(cfg, lay, kernels, 0, params, state["pool"], batch)) if profile else {}
    return {**top, "kind": "prefill", "tokens": T, "expanded": expanded, "seconds": s, "tokens_per_s": T / s,
            "TFLOP_s": flops / s / 1e12,
            "fraction_of_bf16_peak": flops / s / BF16_PEAK}


def bench_ragged(cfg, tokens: int) -> list[dict]:
    """jax.lax.ragged_dot against tokamax.ragged_dot and, on a GPU, the dense grouped matmul of
    :mod:`pallas_kernels.moe` on one MoE layer's gate_up shape."""
    E, D, I, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    key = jax.random.split(jax.random.key(0), 3)
    w = (0.05 * jax.random.normal(key[0], (E, D, 2 * I), jnp.float32)).astype(jnp.bfloat16)
    x = jax.random.normal(key[1], (tokens * k, D), jnp.float32).astype(jnp.bfloat16)
    idx = jax.random.randint(key[2], (tokens * k,), 0, E)
    sizes = jnp.bincount(idx, length=E).astype(jnp.int32)
    rows = []
    impls = {"jax.lax": jax.lax.ragged_dot}
    try:
        import tokamax
        impls["tokamax"] = tokamax.ragged_dot
    except ImportError:
        pass
    if jax.default_backend() == "gpu":
        from pallas_kernels.moe import grouped_matmul
        impls["triton"] = grouped_matmul
    ref = None
    for name, f in impls.items():
        g = jax.jit(lambda x, w, s, f=f: f(x, w, s, preferred_element_type=jnp.float32))
        try:
            y = jax.block_until_ready(g(x, w, sizes))
        except Exception as e:  # noqa: BLE001  (report the failure, time the others)
            rows.append({"kind": "ragged_dot", "impl": name, "tokens": tokens, "error": repr(e)[:300]})
            continue
        ref = y if ref is None else ref
        s = timed_steps(lambda: g(x, w, sizes), 20)
        touched = int(jnp.sum(sizes > 0))
        rows.append({"kind": "ragged_dot", "impl": name, "tokens": tokens, "ms": s * 1e3,
                     "weight_GB_s": touched * D * 2 * I * 2 / s / 1e9,
                     "max_abs_diff_vs_first": float(jnp.max(jnp.abs(y - ref)))})
    return rows


def bench_old_engine(cfg, B: int, ctx: int, steps: int) -> dict:
    """The old engine's decode (a vmap of the reference forward over dense per-slot caches)."""
    from k3jax.model import Kernels, init_cache, init_params
    from serving.engine import _decode
    params = init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
    one = init_cache(cfg, ctx + 64)
    caches = jax.tree.map(lambda x: jnp.zeros((B,) + x.shape, x.dtype), one)
    caches = caches._replace(pos=jnp.full((B,), ctx, jnp.int32))
    tokens, active = jnp.full((B,), 7, jnp.int32), jnp.ones((B,), bool)
    state = {"c": caches}

    def run():
        logits, state["c"] = _decode(cfg, Kernels(), params, tokens, state["c"], active)
        return logits

    s = timed_steps(run, steps)
    return {"kind": "old_engine_decode", "batch": B, "context": ctx, "step_ms": s * 1e3, "tokens_per_s": B / s}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/kimi_linear_48b_a3b.json", help="a config file, or 'mid'")
    ap.add_argument("--layers", type=int, default=0, help="keep only the first N layers (0: all)")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefill", type=int, default=8192, help="prefill tokens (0: skip)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ragged", default="tokamax", choices=["jax.lax", "tokamax", "triton"])
    ap.add_argument("--ragged-tokens", default="1,64,256,8192", help="token counts for the ragged_dot comparison")
    ap.add_argument("--old-engine", action="store_true")
    ap.add_argument("--scan-layers", action="store_true", help="scan the repeating layers (the engine's default)")
    ap.add_argument("--paged-mla", action="store_true", help="decode attention by the Pallas paged MLA kernel")
    ap.add_argument("--paged-kda", action="store_true", help="decode KDA states by the Pallas kernel on pages")
    ap.add_argument("--profile", action="store_true", help="device time of the top kernels of each step")
    ap.add_argument("--flash-prefill", action="store_true",
                    help="also the prefill with expanded keys and values in the fused kernel (StepKernels.mla_prefill)")
    ap.add_argument("--expanded-prefill", action="store_true",
                    help="prefill attention over keys and values expanded from the latents, not over the latents")
    ap.add_argument("--mxfp4", action="store_true", help="routed experts packed in MXFP4 (Kimi K3's checkpoint); "
                    "the K3 slice: --config configs/kimi_k3.json --layers 4 --mxfp4")
    ap.add_argument("--fused-mxfp4", action="store_true",
                    help="with --mxfp4: each decode batch again with the routed experts read in place by the fused "
                         "kernel (pallas_kernels.moe.mxfp4_grouped_matmul) instead of gathered and dequantised")
    a = ap.parse_args()
    cfg = sliced_config(a.config, a.layers)
    meta = {"config": a.config, "layers": cfg.num_layers, "date": datetime.date.today().isoformat(),
            "device": jax.devices()[0].device_kind, "ragged": a.ragged, "scan_layers": a.scan_layers,
            "paged_mla": a.paged_mla, "paged_kda": a.paged_kda, "mxfp4": a.mxfp4}
    rows = []
    emit = lambda r: (rows.append({**meta, **r}), print(json.dumps(rows[-1]), flush=True))
    bw = copy_bandwidth()
    emit({"kind": "copy_bandwidth", "GB_s": bw / 1e9})
    if a.ragged_tokens:
        for t in map(int, a.ragged_tokens.split(",")):
            for r in bench_ragged(cfg, t):
                emit(r)
    t0 = time.perf_counter()
    params = random_model(cfg, a.mxfp4)
    if a.scan_layers:
        params = stack_layers(cfg, params)
    jax.block_until_ready(params)
    lay = PoolLayout.for_model(cfg, token_multiple=512)
    emit({"kind": "params", "GB": param_bytes(params) / 1e9, "init_s": time.perf_counter() - t0,
          # the caches against their formulas: (kv_lora_rank + rope) bf16 a token and MLA layer; HV K V fp32 a request and KDA layer
          "mla_bytes_per_token": lay.n_mla * lay.latent * 2,
          "mla_formula": len(cfg.mla_layers) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2,
          "kda_state_bytes_per_request_layer": lay.HV * lay.K * lay.V * 4,
          "kda_formula": cfg.linear_num_heads * cfg.linear_head_dim ** 2 * 4, "page_bytes": lay.page_bytes})
    kernels = kernels_for(cfg, a.ragged, a.paged_mla, a.paged_kda)
    if a.expanded_prefill:
        kernels = dataclasses.replace(kernels, expand_prefill_from=1024)
    fused = dataclasses.replace(kernels, mxfp4_matmul=mxfp4_grouped_matmul)
    for B in map(int, a.batches.split(",")):
        emit(bench_decode(cfg, params, kernels, B, a.context, a.steps, bw, a.profile))
        if a.fused_mxfp4:
            emit({**bench_decode(cfg, params, fused, B, a.context, a.steps, bw, a.profile), "fused_mxfp4": True})
    if a.prefill:
        emit(bench_prefill(cfg, params, kernels, a.prefill, a.profile))
        if a.flash_prefill:
            flash = dataclasses.replace(kernels, expand_prefill_from=1024, mla_prefill=attend_tile)
            emit({**bench_prefill(cfg, params, flash, a.prefill, a.profile), "flash": True})
    if a.old_engine:
        del params
        for B in map(int, a.batches.split(",")):
            emit(bench_old_engine(cfg, B, a.context, a.steps))
    write_json(rows, "model_step.json")


if __name__ == "__main__":
    main()
