"""The XLA chunked KDA (k3jax.ops.kda.chunk_kda) against fla-core's Triton chunk_kda, same process.

Run on the GPU: ``PYTHONPATH=$PWD python3 benchmarks/kda_reference.py`` (fla-core 0.6.0 importable).
Prints a table and writes ``$OUT/kda_reference.json``. Speed is reported only for shapes whose
output matches fla within the bf16 bound; a small float32 check against the token-by-token
reference runs first.
"""

from __future__ import annotations

import argparse
import datetime

import jax
import jax.numpy as jnp

from benchmarks.common import kda_prefill_hw, time_jax, time_torch, to_torch, write_json
from k3jax.ops.kda import chunk_kda, naive_recurrent_kda
from k3jax.testing import XLA_PREFILL_SHAPES, kda_bench_inputs, rel_rms

MATCH_TOL = 1e-2  # bf16 inputs on both sides; fla also rounds intermediates to bf16


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    ours = jax.jit(chunk_kda)
    theirs = lambda q, k, v, g, b: fla_chunk_kda(q, k, v, g, b, output_final_state=True)

    small = kda_bench_inputs(0, 1, 300, 2, 64, 64, jnp.float32)
    o_ref, S_ref = jax.jit(naive_recurrent_kda)(*small)
    o, S = ours(*small)
    sanity = {"out": rel_rms(o, o_ref), "state": rel_rms(S, S_ref)}
    print(f"f32 check vs naive on {jax.devices()[0].device_kind}: {sanity}")
    assert sanity["out"] <= 5e-4 and sanity["state"] <= 2e-3, sanity

    rows = []
    for B, T, H in XLA_PREFILL_SHAPES:
        xs = [kda_bench_inputs(s, B, T, H) for s in (1, 2)]
        o, S = ours(*xs[0])
        o_f, S_f = theirs(*(to_torch(x) for x in xs[0]))
        err_o = rel_rms(o.astype(jnp.float32), jnp.from_dlpack(o_f.float()))
        err_s = rel_rms(S, jnp.from_dlpack(S_f.float().contiguous()))
        row = {"B": B, "T": T, "H": H, "K": 128, "V": 128, "err_out_vs_fla": err_o, "err_state_vs_fla": err_s}
        if max(err_o, err_s) > MATCH_TOL:
            row["status"] = "MISMATCH: speed not reported"
        else:
            t_ours = time_jax(ours, xs, repeats=a.repeats)
            t_fla = time_torch(theirs, [tuple(to_torch(x) for x in x3) for x3 in xs], repeats=a.repeats)
            hw = kda_prefill_hw(t_ours, B * T * H)
            row.update(ms_xla=t_ours * 1e3, ms_fla=t_fla * 1e3, xla_over_fla=t_ours / t_fla,
                       xla_fraction_of_limit=hw["fraction_of_limit"], fla_fraction_of_limit=hw["limit_s"] / t_fla,
                       bound=hw["bound"], status="ok")
        rows.append(row)
        print(row, flush=True)
    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "sanity": sanity}
    write_json({"meta": meta, "rows": rows}, "kda_reference.json")
    print(f"\n{'B':>2} {'T':>7} {'H':>3} {'xla ms':>9} {'fla ms':>8} {'xla/fla':>8} {'err':>8}")
    for r in rows:
        if r["status"] == "ok":
            print(f"{r['B']:>2} {r['T']:>7} {r['H']:>3} {r['ms_xla']:9.2f} {r['ms_fla']:8.2f} {r['xla_over_fla']:8.2f} {r['err_out_vs_fla']:8.1e}")
        else:
            print(f"{r['B']:>2} {r['T']:>7} {r['H']:>3} {r['status']} err {r['err_out_vs_fla']:.1e}")


if __name__ == "__main__":
    main()
