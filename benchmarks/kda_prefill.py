"""The Pallas prefill kernel (pallas_kernels.kda.chunk_kda) against fla-core's chunk_kda, same process.

Run on the GPU: ``python3 -m benchmarks.kda_prefill`` (fla-core 0.6.0 importable). Prints one
JSON row per shape and, after each, writes the rows so far to ``$OUT/kda_prefill.json`` (``--json``
names another file, for several runs in one device call). Speed is reported only where our bf16
output matches fla's within 1e-2 (both round to bf16), and within 5e-2 on the same inputs with
slowly decaying gates (``SLOW_GATE``: segment starts then reach every output of their segment).
Each row also gives the time of the
token-parallel stage alone and the planner's segment count; ``--segments`` sweeps it.

Three ratios per row: ``ours_over_fla`` per call (ours by the host clock around dispatch and
sync, fla by CUDA events around its launches: the sync latency counts against ours only, kept
for comparison with earlier rows); ``ours_over_fla_b2b``, both by the same host clock over
back-to-back calls (:func:`benchmarks.common.time_back_to_back_calls`); ``ours_over_fla_device``,
the sums of kernel time from each library's profiler (launch gaps excluded on both sides).
"""

from __future__ import annotations

import argparse
import datetime
from functools import partial

import jax
import jax.numpy as jnp

from benchmarks.common import (device_seconds, kda_prefill_hw, time_back_to_back_calls, time_jax, time_torch, to_torch,
                               write_json)
from benchmarks.kernel_profile import fla_kernel_seconds
from k3jax.ops.kda import naive_recurrent_kda
from k3jax.testing import PREFILL_SHAPES, kda_bench_inputs, rel_rms
from pallas_kernels.kda import chunk_intra_mgpu, prefill, wy_fast_mgpu
from pallas_kernels.kda.chunk_prep_gpu import gpu_prep
from pallas_kernels.kda.common import GPU_PRECISION
from pallas_kernels.kda.segment_plan import plan_segments

MATCH_TOL = 1e-2
# The benchmark's gates forget within tens of tokens, so the state entering a segment reaches few
# outputs. The same inputs with gates times SLOW_GATE remember across a segment: a wrong segment
# start (the fold, the summary pass) then moves the outputs by O(1), where the two sides' bf16
# roundings, accumulated over the longer memory, stay well under SLOW_TOL.
SLOW_GATE, SLOW_TOL = 1e-3, 5e-2


PREP_PRECISIONS = {"auto": None, "x3": GPU_PRECISION}
INTERMEDIATES = {"auto": None, "f32": jnp.float32, "bf16": jnp.bfloat16}  # auto: chunk_kda's default


def stage1(q, k, v, g, beta, num_warps, prep_precision, store_dtype, bounded, kernel="triton"):
    """Stage 1 as :func:`prefill.chunk_kda` runs it, with ``kernel`` for the intra-chunk products."""
    f = lambda x: x.reshape(-1, *x.shape[2:])
    K, V = k.shape[-1], v.shape[-1]
    wu_kernel = "mosaic_gpu" if wy_fast_mgpu.supported(K, V, 64, k.dtype, v.dtype) else "triton"
    return gpu_prep(f(q), f(k), f(v), f(g), f(beta)[..., None], C=64, scale=q.shape[-1] ** -0.5,
                            precision=prefill.default_precision(prep_precision, v.dtype), num_warps=num_warps,
                            store_dtype=store_dtype or prefill.default_intermediates(v.dtype), bounded=bounded,
                            kernel=kernel, wu_kernel=wu_kernel)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--shapes", default=None, help="B,T,H;B,T,H;... (default: the issue's shapes)")
    ap.add_argument("--segments", default="plan", help="comma list of segment counts; 'plan' is the planner's")
    ap.add_argument("--configs", default="auto:4:3:4",
                    help="comma list of block_v:num_warps:num_stages:prep_num_warps (block_v auto: chunk_kda's choice)")
    ap.add_argument("--prep-precision", default="auto",
                    help="comma list: auto (single-pass TF32 products for bf16) and/or x3 (TF32x3 throughout)")
    ap.add_argument("--intermediates", default="auto",
                    help="comma list: auto (the default), f32 and/or bf16 (what the stages pass through memory)")
    ap.add_argument("--k3-gates", action="store_true", help="K3 gates (lower bound -5) instead of Kimi Linear ones")
    ap.add_argument("--diag", default="exact", help="comma list: exact and/or bounded (gate_lower_bound=-5; needs --k3-gates)")
    ap.add_argument("--recurrence", default="auto",
                    help="comma list: auto (chunk_kda's choice), triton and/or mosaic_gpu (the recurrent stage's kernel; "
                         "mosaic_gpu needs bf16 intermediates)")
    ap.add_argument("--prep-kernel", default="auto",
                    help="comma list: auto (chunk_kda's choice: mosaic_gpu where it applies), triton and/or mosaic_gpu "
                         "(stage 1's intra-chunk products; with --diag exact the Triton one also redoes the chunks where a 16-token "
                         "sub-chunk's gate span passes 75 nats)")
    ap.add_argument("--json", default="kda_prefill.json", help="the file under $OUT the rows go to")
    a = ap.parse_args()
    if "bounded" in a.diag and not a.k3_gates:
        ap.error("--diag bounded needs --k3-gates")
    bound = -5.0 if a.k3_gates else None
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    shapes = PREFILL_SHAPES if a.shapes is None else [tuple(map(int, s.split(","))) for s in a.shapes.split(";")]
    configs = [dict(zip(("block_v", "num_warps", "num_stages", "prep_num_warps"),
                        (None if x == "auto" else int(x) for x in c.split(":")))) for c in a.configs.split(",")]
    theirs = lambda q, k, v, g, b: fla_chunk_kda(q, k, v, g, b, output_final_state=True)

    small = kda_bench_inputs(0, 1, 300, 2, 64, 64, jnp.float32)
    o_ref, S_ref = jax.jit(naive_recurrent_kda)(*small)
    o, S = jax.jit(prefill.chunk_kda)(*small)
    sanity = {"out": rel_rms(o, o_ref), "state": rel_rms(S, S_ref)}
    print(f"f32 check vs naive on {jax.devices()[0].device_kind}: {sanity}", flush=True)
    assert sanity["out"] <= 5e-4 and sanity["state"] <= 2e-3, sanity

    rows = []
    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "sanity": sanity}
    for B, T, H in shapes:
        xs = [kda_bench_inputs(s, B, T, H, lower_bound=bound) for s in (1, 2)]
        # The planner's P for the recurrence chunk_kda will run.
        store = lambda im: jnp.dtype(INTERMEDIATES[im] or prefill.default_intermediates(xs[0][2].dtype))
        planned = lambda cfg, im, rc: plan_segments(
            B, H, 128, T // 64, backend="gpu",
            recurrence=rc if rc != "auto" else prefill.default_recurrence(128, 128, 64, store(im), cfg["block_v"]))
        sweep = [(p, cfg, pp, im, dg, rc, pk) for p in a.segments.split(",")
                 for cfg in configs for pp in a.prep_precision.split(",") for im in a.intermediates.split(",")
                 for dg in a.diag.split(",") for rc in a.recurrence.split(",") for pk in a.prep_kernel.split(",")]
        txs = [tuple(to_torch(x) for x in x3) for x3 in xs]
        tx = txs[0]
        t_fla = time_torch(theirs, txs, repeats=a.repeats)
        t_fla_b2b = time_back_to_back_calls(lambda: theirs(*tx), lambda _: torch.cuda.synchronize())
        t_fla_dev = sum(fla_kernel_seconds(xs[0]).values())
        as_jax = lambda o, S: (jnp.from_dlpack(o.float()), jnp.from_dlpack(S.float().contiguous()))
        o_f, S_f = as_jax(*theirs(*tx))
        slow = (*xs[0][:3], SLOW_GATE * xs[0][3], xs[0][4])
        o_fs, S_fs = as_jax(*theirs(*(to_torch(x) for x in slow)))
        t_prep = {}
        for p, cfg, pp, im, dg, rc, pk in sweep:
            if pk == "auto":  # chunk_kda's choice on the GPU
                pk = "mosaic_gpu" if chunk_intra_mgpu.supported(128, 64, xs[0][0].dtype) else "triton"
            plan = planned(cfg, im, rc)
            P = plan if p == "plan" else int(p)
            pw = cfg["prep_num_warps"]
            key = (pw, pp, im, dg, pk)  # what stage 1 depends on
            if key not in t_prep:
                st = jax.jit(partial(stage1, num_warps=pw, prep_precision=PREP_PRECISIONS[pp],
                                     store_dtype=INTERMEDIATES[im], bounded=dg == "bounded", kernel=pk))
                # The intra-chunk products alone (with the cumsum kernel): only qg is kept, so jit drops the
                # inverse and W/U kernels.
                st_a = jax.jit(lambda *x, st=st: st(*x)[0])
                t_prep[key] = time_jax(st, xs, repeats=a.repeats), time_jax(st_a, xs, repeats=a.repeats)
            ours = jax.jit(partial(prefill.chunk_kda, num_segments=P, prep_precision=PREP_PRECISIONS[pp],
                                   intermediate_dtype=INTERMEDIATES[im],
                                   gate_lower_bound=bound if dg == "bounded" else None,
                                   recurrence=None if rc == "auto" else rc, prep_kernel=pk, **cfg))
            o, S = ours(*xs[0])
            err_o, err_s = rel_rms(o.astype(jnp.float32), o_f), rel_rms(S, S_f)
            o, S = ours(*slow)
            err_slow = max(rel_rms(o.astype(jnp.float32), o_fs), rel_rms(S, S_fs))
            row = {"B": B, "T": T, "H": H, "K": 128, "V": 128, "segments": P, "planned": plan, **cfg, "prep": pp,
                   "intermediates": im, "diag": dg, "recurrence": rc, "prep_kernel": pk, "k3_gates": a.k3_gates,
                   "err_out_vs_fla": err_o, "err_state_vs_fla": err_s, "err_slow_gates_vs_fla": err_slow,
                   "ms_fla": t_fla * 1e3}
            if max(err_o, err_s) > MATCH_TOL or err_slow > SLOW_TOL:
                row["status"] = "MISMATCH: speed not reported"
            else:
                t = time_jax(ours, xs, repeats=a.repeats)
                t_b2b = time_back_to_back_calls(lambda: ours(*xs[0]), jax.block_until_ready)
                t_dev = device_seconds(lambda: ours(*xs[0]), 10)
                hw = kda_prefill_hw(t, B * T * H)
                row.update(ms_ours=t * 1e3, ms_stage1=t_prep[key][0] * 1e3,
                           ms_stage1_kernel_a=t_prep[key][1] * 1e3, ours_over_fla=t / t_fla,
                           ms_ours_b2b=t_b2b * 1e3, ms_fla_b2b=t_fla_b2b * 1e3, ours_over_fla_b2b=t_b2b / t_fla_b2b,
                           ms_ours_device=t_dev * 1e3, ms_fla_device=t_fla_dev * 1e3,
                           ours_over_fla_device=t_dev / t_fla_dev,
                           fraction_of_limit=hw["fraction_of_limit"], fla_fraction_of_limit=hw["limit_s"] / t_fla,
                           bound=hw["bound"], status="ok")
            rows.append(row)
            print(row, flush=True)
            write_json({"meta": meta, "rows": rows}, a.json)  # after every row: a later one may time out
    print(f"\n{'B':>2} {'T':>7} {'H':>3} {'P':>3} {'bv:w:s:pw:prep:im:diag:rec':>37} {'ours ms':>9} {'stage1':>8} {'fla ms':>8} {'ours/fla':>9} "
          f"{'err':>8} | b2b: {'ours':>6} {'fla':>6} {'ratio':>6} | device: {'ours':>6} {'fla':>6} {'ratio':>6}")
    for r in rows:
        if r["status"] == "ok":
            print(f"{r['B']:>2} {r['T']:>7} {r['H']:>3} {r['segments']:>3} {cfg_str(r):>37} {r['ms_ours']:9.2f} {r['ms_stage1']:8.2f} "
                  f"{r['ms_fla']:8.2f} {r['ours_over_fla']:9.2f} {r['err_out_vs_fla']:8.1e} | {'':>4} {r['ms_ours_b2b']:6.2f} "
                  f"{r['ms_fla_b2b']:6.2f} {r['ours_over_fla_b2b']:6.2f} | {'':>7} {r['ms_ours_device']:6.2f} "
                  f"{r['ms_fla_device']:6.2f} {r['ours_over_fla_device']:6.2f}")
        else:
            print(f"{r['B']:>2} {r['T']:>7} {r['H']:>3} {r['segments']:>3} {r['status']} err {r['err_out_vs_fla']:.1e}, "
                  f"slow gates {r['err_slow_gates_vs_fla']:.1e}")


def cfg_str(r):
    return ":".join(str(r[k]) for k in ("block_v", "num_warps", "num_stages", "prep_num_warps", "prep", "intermediates", "diag",
                                          "recurrence", "prep_kernel"))


if __name__ == "__main__":
    main()
