"""The fused prefill attention (:func:`pallas_kernels.mla.prefill_flash.attend_tile`) against the
same online softmax in XLA (:func:`attend_tile_reference`, the step's form before the kernel), on
one chunk of ``T`` queries after ``context`` cached tokens, its keys and values already expanded,
tile by tile as the step runs it (Kimi-Linear-48B's MLA: 32 heads, nope 128, rope 64, values 128).
Device time from a profile (wall time without a GPU); useful TFLOP/s count each visible (query, key) pair once (causal).

Run on the GPU: ``PYTHONPATH=$PWD python3 -m benchmarks.mla_prefill_flash`` (writes ``$OUT/mla_prefill_flash.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
from functools import partial

import jax
import jax.numpy as jnp

from benchmarks.common import BF16_FLOPS_PER_S, device_seconds, time_jax, write_json
from pallas_kernels.mla.prefill_flash import attend_tile, attend_tile_reference


def tiled(attend, T: int, S: int, tile: int, H: int, Dv: int):
    """A jitted function of ``(q_nope, q_rope, pos, k_nope, k_rope, v)`` walking the ``S`` keys
    ``tile`` at a time with ``attend`` (either contract); returns ``acc / l``."""

    @jax.jit
    def run(qn, qr, pos, kn, kr, v):
        def body(j, state):
            cut = lambda x: jax.lax.dynamic_slice_in_dim(x, j * tile, tile)
            return attend(qn, qr, pos, cut(kn), cut(kr), cut(v), j * tile, tile, state)

        init = (jnp.full((H, T), -jnp.inf), jnp.zeros((H, T)), jnp.zeros((H, T, Dv)))
        _, l, acc = jax.lax.fori_loop(0, S // tile, body, init)
        return acc / l[..., None]

    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="8192:0,16384:114688", help="comma-separated T:context")
    ap.add_argument("--tile", type=int, default=2048)
    ap.add_argument("--configs", default="64:64:4:2,128:64:8:2,128:64:4:2,64:32:4:2",
                    help="comma-separated block_q:block_k:num_warps:num_stages of the kernel")
    a = ap.parse_args()
    H, n, R, Dv = 32, 128, 64, 128
    scale = (n + R) ** -0.5
    rows = []
    for chunk in a.chunks.split(","):
        T, context = map(int, chunk.split(":"))
        S = context + T
        ks = jax.random.split(jax.random.key(0), 5)
        bf = lambda k, *s: jax.random.normal(k, s, jnp.bfloat16)
        args = (bf(ks[0], T, H, n), bf(ks[1], T, H, R), context + jnp.arange(T, dtype=jnp.int32),
                bf(ks[2], S, H, n), bf(ks[3], S, R), bf(ks[4], S, H, Dv))
        flops = 2 * H * (n + R + Dv) * (T * context + T * (T + 1) / 2)
        ref = tiled(partial(attend_tile_reference, scale=scale), T, S, a.tile, H, Dv)
        want = ref(*args)
        variants = {"xla": ref}
        for c in a.configs.split(","):
            bq, bk, warps, stages = map(int, c.split(":"))
            kernel = partial(attend_tile, scale=scale, block_q=bq, block_k=bk, num_warps=warps, num_stages=stages)
            variants[f"flash {c}"] = tiled(kernel, T, S, a.tile, H, Dv)
        for name, f in variants.items():
            try:
                err = float(jnp.max(jnp.abs(f(*args) - want)))
                s = device_seconds(lambda: f(*args), 5) or time_jax(f, [args], warmup=1, repeats=3)  # no GPU: wall
            except Exception as e:  # noqa: BLE001  (report a configuration that fails, time the others)
                rows.append({"chunk": T, "context": context, "impl": name, "error": repr(e)[:300]})
                print(json.dumps(rows[-1]), flush=True)
                continue
            rows.append({"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
                         "chunk": T, "context": context, "tile": a.tile, "impl": name, "ms": s * 1e3,
                         "TFLOP_s": flops / s / 1e12, "fraction_of_bf16_peak": flops / s / BF16_FLOPS_PER_S,
                         "max_abs_diff_vs_xla": err})
            print(json.dumps(rows[-1]), flush=True)
    write_json(rows, "mla_prefill_flash.json")


if __name__ == "__main__":
    main()
