"""Device time per kernel: the Pallas prefill (``pallas_kernels.kda.chunk_kda``) and fla-core's
``chunk_kda``, same process and inputs. Where the per-call wall clock of ``kda_prefill`` gives
one number, this says which stage the time goes to on each side.

Run on the GPU: ``python3 -m benchmarks.kernel_profile --shapes "1,32768,32"`` (fla-core 0.6.0
importable; ``--no-fla`` times ours only). ``--segments 4,5`` and ``--block-v 32,64`` time each
segment count and Mosaic GPU ``block_v`` (default: the planner's and the kernel's defaults);
``--k3-gates --prep-kernel triton,mosaic_gpu`` each stage 1 intra-chunk kernel, and ``--mgpu-a 32:3:1,16:3:3``
each layout of the Mosaic GPU one (K columns per part, input buffers, warpgroups per CTA),
``--wu-kernel triton,mosaic_gpu`` each stage 1 W/U kernel.
Both sides from a ``jax.profiler`` trace (:func:`benchmarks.common.kernel_seconds`); microseconds
per call. Writes ``$OUT/kernel_profile.json``.
"""

from __future__ import annotations

import argparse
import datetime
import functools

import jax

from benchmarks.common import kernel_seconds, to_torch, write_json
from k3jax.testing import kda_bench_inputs
from pallas_kernels.kda import chunk_intra_mgpu, chunk_kda

STEPS = 10


def fla_kernel_seconds(xs):
    """fla's kernels from the same ``jax.profiler`` trace as ours (it records every kernel of the
    process; a ``torch.profiler`` session first leaves later JAX traces without GPU events)."""
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    tx = [to_torch(x) for x in xs]

    def call():
        out = fla_chunk_kda(*tx, output_final_state=True)
        torch.cuda.synchronize()
        return out

    return kernel_seconds(call, STEPS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1,32768,32", help="B,T,H;B,T,H;...")
    ap.add_argument("--k3-gates", action="store_true",
                    help="K3 gates (lower bound -5), ours told so (gate_lower_bound=-5: no span check)")
    ap.add_argument("--segments", default="", help="comma-separated segment counts (default: the planner's)")
    ap.add_argument("--block-v", default="", help="comma-separated block_v of the recurrence (default: its own)")
    ap.add_argument("--prep-kernel", default="mosaic_gpu",
                    help="comma list: mosaic_gpu (chunk_kda's choice) and/or triton (stage 1's intra-chunk products; without "
                         "--k3-gates the Triton one also redoes the chunks whose sub-chunk gate spans pass 75 nats)")
    ap.add_argument("--wu-kernel", default="auto",
                    help="comma list: auto (chunk_kda's choice), triton and/or mosaic_gpu (stage 1's W and U)")
    ap.add_argument("--mgpu-a", default="",
                    help="comma list of PART:SLOTS:WGS, the Mosaic GPU intra-chunk kernel's layout "
                         "(pallas_kernels.kda.chunk_intra_mgpu; default: its own), one run each with --prep-kernel mosaic_gpu")
    ap.add_argument("--no-fla", action="store_true", help="time ours only")
    a = ap.parse_args()
    rows = []
    bound = -5.0 if a.k3_gates else None
    options = lambda text: [int(x) for x in text.split(",")] if text else [None]
    layouts = [tuple(map(int, c.split(":"))) for c in a.mgpu_a.split(",")] if a.mgpu_a else [None]
    variants = [(P, bv, pk, lay, wk) for P in options(a.segments) for bv in options(a.block_v)
                for pk in a.prep_kernel.split(",") for lay in (layouts if pk == "mosaic_gpu" else [None])
                for wk in a.wu_kernel.split(",")]
    own_layout = (chunk_intra_mgpu.PART, chunk_intra_mgpu.SLOTS, chunk_intra_mgpu.WGS)
    us = lambda table: {k: v * 1e6 for k, v in table.items()}
    for shape in a.shapes.split(";"):
        B, T, H = map(int, shape.split(","))
        xs = kda_bench_inputs(1, B, T, H, lower_bound=bound)
        def show(side, table):
            print(f"\nB={B} T={T} H={H} {side}: {sum(table.values()) * 1e6:.0f} us", flush=True)
            for name, t in sorted(table.items(), key=lambda kv: -kv[1]):
                print(f"  {t * 1e6:9.1f} us  {name[:90]}", flush=True)

        for P, bv, pk, lay, wk in variants:
            # Read when the kernel is traced: each variant is a new jit function.
            chunk_intra_mgpu.PART, chunk_intra_mgpu.SLOTS, chunk_intra_mgpu.WGS = lay or own_layout
            fn = jax.jit(functools.partial(chunk_kda, gate_lower_bound=bound, num_segments=P, block_v=bv,
                                           recurrence=bv and "mosaic_gpu", prep_kernel=pk,
                                           wu_kernel=None if wk == "auto" else wk))
            ours = kernel_seconds(lambda: fn(*xs), STEPS)
            show(f"ours P={P or 'plan'} block_v={bv or 'default'} prep_kernel={pk}{'' if lay is None else lay} "
                 f"wu_kernel={wk}", ours)
            rows.append({"B": B, "T": T, "H": H, "k3_gates": a.k3_gates, "segments": P, "block_v": bv,
                         "prep_kernel": pk, "mgpu_a": lay, "wu_kernel": wk, "ours_us": us(ours)})
        if not a.no_fla:
            theirs = fla_kernel_seconds(xs)
            show("fla", theirs)
            rows.append({"B": B, "T": T, "H": H, "k3_gates": a.k3_gates, "fla_us": us(theirs)})
    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind}
    write_json({"meta": meta, "rows": rows}, "kernel_profile.json")


if __name__ == "__main__":
    main()
