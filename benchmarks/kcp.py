"""KCP scaling. With two or more GPUs: chunk_kda_cp over all of them against chunk_kda on one.
With one GPU: the per-rank work of a two-rank run (the per-shard prefill of T/2 tokens whose
maps, from its own token-parallel stage, go through the fold before its recurrent stage)
against the one-device prefill, and the exchanged bytes; the multi-GPU run is then still owed.
The per-shard op is the Pallas prefill (``--kernel xla``: the XLA reference); ``--segments P``
runs each rank's recurrence as P segments (its summary pass is paid anyway for the fold).

Run: ``PYTHONPATH=$PWD python3 benchmarks/kcp.py``. Writes ``$OUT/kcp.json``.
"""

from __future__ import annotations

import argparse
import datetime
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from benchmarks.common import time_jax, write_json
from k3jax.ops.kda import chunk_kda
from k3jax.ops.segments import combine_segments
from k3jax.parallel.kcp import chunk_kda_cp
from k3jax.testing import kda_bench_inputs, rel_rms
from pallas_kernels.kda import chunk_kda as pallas_chunk_kda


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kernel", choices=("xla", "pallas"), default="pallas", help="the per-shard prefill op")
    ap.add_argument("--segments", type=int, default=None,
                    help="Pallas: segments per rank for the per-shard op (its summary pass runs anyway); default: planner")
    a = ap.parse_args()
    if a.segments and a.kernel != "pallas":
        ap.error("--segments needs --kernel pallas")
    n_dev = len(jax.devices())
    kernel = pallas_chunk_kda if a.kernel == "pallas" else chunk_kda
    one = jax.jit(kernel)  # the one-device baseline keeps the planner's choice
    if a.segments:
        kernel = partial(pallas_chunk_kda, num_segments=a.segments)
    rows = []
    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "n_devices": n_dev}
    for T in a.T:
        # Under jit: no eager f32 temporaries. One input set from T = 262144 (two do not fit next to
        # the sharded copies at T = 524288; at these sizes no cache holds a set between calls).
        xs = [jax.jit(partial(kda_bench_inputs, s, 1, T, a.H))() for s in ((1, 2) if T < 262144 else (1,))]
        row = {"T": T, "H": a.H, "devices": n_dev}
        o_ref, S_ref = one(*xs[0])
        # Correctness of the sharded program on the devices at hand (P = n_dev, 1 on one GPU).
        mesh = Mesh(np.array(jax.devices()), ("cp",))
        cp = jax.jit(lambda *x: chunk_kda_cp(*x, mesh=mesh, axis_name="cp", kernel=kernel))
        o, S = cp(*xs[0])
        row["err_out_vs_one_device"] = rel_rms(o.astype(jnp.float32), o_ref.astype(jnp.float32))
        row["err_state_vs_one_device"] = rel_rms(S, S_ref)
        assert row["err_out_vs_one_device"] < 5e-3 and row["err_state_vs_one_device"] < 5e-3, row
        t_one = time_jax(one, xs, repeats=a.repeats)
        row["ms_one_device"] = t_one * 1e3
        if n_dev >= 2:
            # Inputs on the first device (each call scatters them) and already sharded along T over the
            # mesh, as a context-parallel model's earlier layers leave them.
            t_cp = time_jax(cp, xs, repeats=a.repeats)
            sharded = NamedSharding(mesh, PartitionSpec(None, "cp"))
            xs_sh = [tuple(jax.device_put(x, sharded) for x in x5) for x5 in xs]
            t_sh = time_jax(cp, xs_sh, repeats=a.repeats)
            row.update(ms_cp=t_cp * 1e3, speedup=t_one / t_cp, ms_cp_sharded_inputs=t_sh * 1e3,
                       speedup_sharded_inputs=t_one / t_sh)
        else:
            # The work of rank 1 of 2: summarise its half, fold two maps, prefill its half from the state.
            half = [tuple(x[:, T // 2 :] for x in x5) for x5 in xs]

            def rank_work(q, k, v, g, beta):
                def fold(M, E):  # the exchange stand-in: fold rank 0's (constant) map and ours
                    maps = (jnp.stack([jnp.zeros_like(M), M]), jnp.stack([E, E]))
                    return jax.lax.associative_scan(combine_segments, maps, axis=0)[1][0]

                return kernel(q, k, v, g, beta, initial_state_fn=fold)

            t_rank = time_jax(jax.jit(rank_work), half, repeats=a.repeats)
            t_half = time_jax(one, half, repeats=a.repeats)
            HV, K, V = a.H, 128, 128
            row.update(ms_rank_of_2=t_rank * 1e3, ms_prefill_half=t_half * 1e3,
                       projected_speedup_2gpu=t_one / t_rank,
                       allgather_bytes_per_rank=HV * K * (K + V) * 4, psum_state_bytes=HV * K * V * 4,
                       note="one GPU: two-GPU run still owed")
        rows.append(row)
        print(row, flush=True)
        write_json({"meta": meta, "rows": rows}, "kcp.json")  # after every row: a later shape may run out of memory


if __name__ == "__main__":
    main()
