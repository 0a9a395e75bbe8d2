"""Speculative verify + commit: replay (ours) vs the snapshot baseline, and the decode step vs fla.

Steps timed per (H, T, B): replay (verify returning the deltas, commit from them), fused (the
previous window's commit from its deltas inside this window's verify), recompute (verify, then a
commit that recomputes the deltas) and snapshot (the baseline).

Run on the GPU: ``PYTHONPATH=$PWD python3 -m benchmarks.kda_spec_decode`` (fla-core importable for
the decode comparison). Each point is checked against the k3jax reference on a few rows before
it is timed. Prints a table and writes ``$OUT/kda_spec_decode.json``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (HBM_BYTES_PER_S, device_seconds, time_back_to_back_calls, time_torch, to_torch, window_step,
                               write_json)
from k3jax.ops import kda as ref
from k3jax.testing import kda_window_inputs, rel_rms
from pallas_kernels import kda
from pallas_kernels.kda import decode

K = V = 128
STATE_BYTES = K * V * 4
INPUT_BYTES = 2 * K * 2 + V * 2 + K * 4 + 2  # one window position's q, k, v (bf16), g (f32), beta, per head
DELTA_BYTES = V * 4  # its f32 delta-rule correction


@functools.partial(jax.jit, donate_argnums=(0,))
def replay_step(pool, slots, n, q, k, v, g, beta):
    """Verify returning the deltas, then the commit from them (no reduction over K)."""
    o, deltas = kda.kda_verify(pool, slots, q, k, v, g, beta, return_deltas=True)
    return o, kda.kda_commit(pool, slots, k, v, g, beta, n, deltas=deltas)


@functools.partial(jax.jit, donate_argnums=(0,))
def recompute_step(pool, slots, n, q, k, v, g, beta):
    """Verify, then a commit that recomputes the deltas from ``v`` and ``beta``."""
    o = kda.kda_verify(pool, slots, q, k, v, g, beta)
    return o, kda.kda_commit(pool, slots, k, v, g, beta, n)


@functools.partial(jax.jit, donate_argnums=(0,))
def fused_step(pool, slots, n, q, k, v, g, beta, prev_k, prev_v, prev_g, prev_beta, prev_deltas):
    """Commit of the previous window (from its deltas) fused into this window's verify, which
    returns this window's deltas for the next step."""
    return kda.kda_commit_verify(pool, slots, (prev_k, prev_v, prev_g, prev_beta), n, q, k, v, g, beta,
                                 prev_deltas=prev_deltas, return_deltas=True)


@functools.partial(jax.jit, donate_argnums=(0,))
def snapshot_step(pool, slots, n, q, k, v, g, beta):
    o, snaps = decode.kda_verify_snapshot(pool, slots, q, k, v, g, beta)
    return o, decode.kda_commit_snapshot(pool, slots, snaps, n)


@functools.partial(jax.jit, donate_argnums=(0,))
def decode_step(pool, slots, q, k, v, g, beta):
    return kda.kda_decode(pool, slots, q, k, v, g, beta)


def time_threaded(step, pool, args_list, *, warmup=3, repeats=20):
    """Median seconds of ``pool = step(pool, *args)[-1]``, threading the donated pool."""
    ts = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        out = step(pool, *args_list[i % len(args_list)])
        jax.block_until_ready(out)
        pool = out[-1]
        if i >= warmup:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts), pool


def _threaded(step, pool, args):
    """A no-argument call that runs ``step`` on the last pool it returned, and a box holding that pool."""
    box = [pool]

    def call():
        box[0] = step(box[0], *args)[-1]
        return box[0]

    return call, box


def time_back_to_back(step, pool, args, *, steps=20, rounds=5):
    """Device time per step: ``steps`` dependent calls (each takes the last pool) dispatched
    without waiting, one sync per round (:func:`benchmarks.common.time_back_to_back_calls`). Host
    dispatch overlaps the GPU, so this excludes the per-call sync latency that
    :func:`time_threaded` keeps. Returns ``(seconds, pool)``."""
    call, box = _threaded(step, pool, args)
    return time_back_to_back_calls(call, jax.block_until_ready, steps=steps, rounds=rounds), box[0]


def device_per_step(step, pool, args):
    """:func:`time_back_to_back`'s dependent steps timed as kernel time alone
    (:func:`benchmarks.common.device_seconds`). Returns ``(seconds, pool)``."""
    call, box = _threaded(step, pool, args)
    return device_seconds(call), box[0]


def check(B, T, H):
    """Every step against the reference on a small batch of the same head count."""
    b = min(B, 4)
    q, k, v, g, beta = kda_window_inputs(99, b, T, H)
    pool = jax.random.normal(jax.random.key(5), (b + 1, H, K, V), jnp.float32)
    slots = jnp.arange(b, dtype=jnp.int32)[::-1] + 1
    n = jnp.arange(b, dtype=jnp.int32) % (T + 1)
    dense = pool[slots]
    o_ref = ref.kda_verify(dense, q, k, v, g, beta)
    s_ref = ref.kda_commit(dense, k, v, g, beta, n)
    errs = []
    for step in (replay_step, recompute_step, snapshot_step):
        o, p = step(jnp.array(pool), slots, n, q, k, v, g, beta)
        errs += [rel_rms(o, o_ref), rel_rms(p[slots], s_ref)]
    # Fused: commit this window from its deltas, then verify the same inputs again from the committed state.
    _, deltas = kda.kda_verify(pool, slots, q, k, v, g, beta, return_deltas=True)
    o, _, p = fused_step(jnp.array(pool), slots, n, q, k, v, g, beta, k, v, g, beta, deltas)
    errs += [rel_rms(o, ref.kda_verify(s_ref, q, k, v, g, beta)), rel_rms(p[slots], s_ref)]
    return max(errs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--windows", default="2,4,8")
    ap.add_argument("--heads", default="12,32,96")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--skip-decode", action="store_true", help="skip the decode-step comparison with fla")
    ap.add_argument("--skip-spec", action="store_true", help="only the decode-step comparison with fla")
    ap.add_argument("--tune", action="store_true",
                    help="sweep the GPU window kernels' block_v / num_warps (device time) at --heads x "
                         "--batches and exit")
    ap.add_argument("--tune-configs", default="32:2,64:8,128:8",
                    help="--tune's block_v:num_warps list (128:4 takes minutes to compile; 4 warps at 32 / 64 "
                         "and 16 warps lost on the H200)")
    a = ap.parse_args()
    if a.tune:
        return tune(a.heads, a.batches, [tuple(map(int, c.split(":"))) for c in a.tune_configs.split(",")])
    dev = jax.devices()[0].device_kind
    rows = []
    for H in [] if a.skip_spec else map(int, a.heads.split(",")):
        for T in map(int, a.windows.split(",")):
            err = check(8, T, H)
            for B in map(int, a.batches.split(",")):
                row = {"H": H, "T": T, "B": B, "max_err": err}
                rows.append(row)
                if err > 5e-3:
                    row["status"] = "MISMATCH: speed not reported"
                    continue
                num_slots = 2 * B
                slots = jnp.asarray(np.random.default_rng(B).permutation(num_slots)[:B].astype(np.int32))
                xs = [kda_window_inputs(s, B, T, H) for s in (1, 2)]
                rng = np.random.default_rng(T)
                args = [(slots, jnp.asarray(rng.integers(0, T + 1, B).astype(np.int32)), *x) for x in xs]
                pool = jax.random.normal(jax.random.key(0), (num_slots, H, K, V), jnp.float32)
                # The fused step replays the other window with deltas of the right shape (values do
                # not change the work).
                deltas = jnp.zeros((B, T, H, V), jnp.float32)
                steps = {"replay": (replay_step, args), "recompute": (recompute_step, args),
                         "snapshot": (snapshot_step, args),
                         "fused": (fused_step, [(*args[i], *xs[1 - i][1:], deltas) for i in range(2)])}
                for name, (step, step_args) in steps.items():
                    t, pool = time_threaded(step, pool, step_args, repeats=a.repeats)
                    row[f"{name}_us"] = t * 1e6
                    t, pool = device_per_step(step, pool, step_args[0])
                    row[f"{name}_device_us"] = t * 1e6
                del pool
                win_bytes = B * T * H * (INPUT_BYTES + V * 2)  # inputs read, outputs written
                deltas_bytes = B * T * H * DELTA_BYTES
                state = B * H * STATE_BYTES
                # Replay: read the state (verify) + read and write it (commit), the deltas written
                # and read once. Fused: read and write the state once. Snapshot: read the state,
                # write T states, read one back, write it to the pool.
                traffic = {"replay": 3 * state + 2 * win_bytes + 2 * deltas_bytes,
                           "recompute": 3 * state + 2 * win_bytes,
                           "fused": 2 * state + 2 * win_bytes + 2 * deltas_bytes,
                           "snapshot": (3 + T) * state + win_bytes}
                for name in steps:
                    device_s = row[f"{name}_device_us"] * 1e-6 or float("nan")  # 0: no GPU kernels (CPU)
                    row[f"{name}_frac_bw"] = traffic[name] / HBM_BYTES_PER_S / device_s
                    if name != "snapshot":
                        row[f"speedup_{name}"] = row["snapshot_us"] / row[f"{name}_us"]
                        row[f"speedup_{name}_device"] = row["snapshot_device_us"] * 1e-6 / device_s
                row.update(scratch_bytes_per_request_replay=T * H * (INPUT_BYTES + DELTA_BYTES),
                           scratch_bytes_per_request_snapshot=T * H * STATE_BYTES)
                print(row, flush=True)
    decode_rows = [] if a.skip_decode else decode_vs_fla(a.heads, a.batches, a.repeats)
    meta = {"device": dev, "date": datetime.date.today().isoformat(), "jax": jax.__version__}
    path = write_json({"meta": meta, "spec": rows, "decode": decode_rows}, "kda_spec_decode.json")
    print(f"\n{dev}  ->  {path}")
    names = ("replay", "fused", "recompute", "snapshot")
    print(f"{'H':>3} {'T':>2} {'B':>4} | wall us: " + " ".join(f"{n:>9}" for n in names) + " | device us: "
          + " ".join(f"{n:>9}" for n in names) + " | snapshot / ours (device): " + " ".join(f"{n:>9}" for n in names[:3])
          + " | bw% (device): " + " ".join(f"{n:>9}" for n in names))
    for r in rows:
        if "replay_us" not in r:
            print(r)
            continue
        print(f"{r['H']:>3} {r['T']:>2} {r['B']:>4} | {'':>8} " + " ".join(f"{r[n + '_us']:>9.1f}" for n in names)
              + f" | {'':>10} " + " ".join(f"{r[n + '_device_us']:>9.1f}" for n in names)
              + f" | {'':>26} " + " ".join(f"{r['speedup_' + n + '_device']:>9.2f}" for n in names[:3])
              + f" | {'':>13} " + " ".join(f"{100 * r[n + '_frac_bw']:>9.1f}" for n in names))
    nan = float("nan")
    print(f"\n{'H':>3} {'B':>4} {'ours us':>8} {'fla us':>8} {'fla/ours':>8} {'bw% ours':>8} | back to back: "
          f"{'ours us':>8} {'fla us':>8} {'fla/ours':>8} {'bw% ours':>8}")
    for r in decode_rows:
        print(f"{r['H']:>3} {r['B']:>4} {r['ours_us']:>8.1f} {r.get('fla_us', nan):>8.1f} "
              f"{r.get('fla_over_ours', nan):>8.2f} {100 * r['ours_frac_bw']:>8.1f} | {'':>13} {r['ours_b2b_us']:>8.1f} "
              f"{r.get('fla_b2b_us', nan):>8.1f} {r.get('fla_over_ours_b2b', nan):>8.2f} {100 * r['ours_b2b_frac_bw']:>8.1f}")


def tune(heads, batches, configs, T=8):
    """Device time of each GPU window kernel (commit, verify, fused commit + verify, verify with
    snapshots, loading each position's inputs in place or one ahead; the verify returning deltas,
    the commit and the fused commit + verify from them) per ``(block_v, num_warps)`` in
    ``configs``, T = 8, half the window accepted."""
    from pallas_kernels.kda._window import (COMMIT, COMMIT_DELTAS, COMMIT_VERIFY, COMMIT_VERIFY_DELTAS, VERIFY,
                                            VERIFY_DELTAS, VERIFY_SNAPSHOT)

    for H, B in itertools.product(map(int, heads.split(",")), map(int, batches.split(","))):
        q, k, v, g, beta = kda_window_inputs(1, B, T, H)
        slots = jnp.asarray(np.random.default_rng(0).permutation(2 * B)[:B].astype(np.int32))
        n = jnp.full((B,), T // 2, jnp.int32)
        pool = jax.random.normal(jax.random.key(0), (2 * B, H, K, V), jnp.float32)
        for bv, nw in configs:
            step = lambda mode, prefetch=None: window_step(mode, block_v=bv, num_warps=nw, prefetch=prefetch)
            o, deltas = step(VERIFY_DELTAS)(pool, slots, n, q, k, v, g, beta, None)[:2]
            err = rel_rms(o, ref.kda_verify(pool[slots], q, k, v, g, beta))
            if err > 1e-3:  # a tiling is timed only once its outputs match the reference
                print(f"H={H} B={B} block_v={bv:>3} num_warps={nw:>2}  MISMATCH (error {err:.1e}): not timed")
                continue
            x = (slots, n, q, k, v, g, beta, deltas)
            t = {}
            for name, mode in (("commit", COMMIT), ("fused", COMMIT_VERIFY), ("commit from deltas", COMMIT_DELTAS),
                               ("fused from deltas", COMMIT_VERIFY_DELTAS)):
                writes = jax.jit(lambda p, *a, f=step(mode): (f(p, *a)[3],), donate_argnums=(0,))
                t[name], pool = device_per_step(writes, pool, x)
            for name, mode, prefetch in (("verify", VERIFY, False), ("verify + deltas", VERIFY_DELTAS, None),
                                         ("snapshot verify", VERIFY_SNAPSHOT, False),
                                         ("prefetching", VERIFY_SNAPSHOT, True)):
                f = jax.jit(lambda p, *a, f=step(mode, prefetch): f(p, *a)[:2])
                t[name] = device_seconds(lambda: f(pool, *x))
            print(f"H={H} B={B} block_v={bv:>3} num_warps={nw:>2}  "
                  + "  ".join(f"{name} {s * 1e6:7.0f} us" for name, s in t.items())
                  + f"  verify + commit {(t['verify'] + t['commit']) * 1e6:7.0f} us"
                  + f"  replay from deltas {(t['verify + deltas'] + t['commit from deltas']) * 1e6:7.0f} us", flush=True)


def decode_vs_fla(heads, batches, repeats):
    """One-token decode on a slot pool: ours vs fla's fused_recurrent_kda with state indices, in place."""
    try:
        import torch
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except ImportError:
        fused_recurrent_kda_fwd = None
    rows = []
    for H in map(int, heads.split(",")):
        for B in map(int, batches.split(",")):
            q, k, v, g, beta = kda_window_inputs(3, B, 1, H)
            num_slots = 2 * B
            slots = jnp.asarray(np.random.default_rng(B).permutation(num_slots)[:B].astype(np.int32))
            pool = jax.random.normal(jax.random.key(1), (num_slots, H, K, V), jnp.float32)
            o, new_pool = decode_step(jnp.array(pool), slots, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
            o_ref, s_ref = ref.kda_decode_step(pool[slots], q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
            row = {"H": H, "B": B, "err_out": rel_rms(o, o_ref), "err_state": rel_rms(new_pool[slots], s_ref)}
            args = [(slots, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])]
            t, pool = time_threaded(decode_step, pool, args, repeats=repeats)
            t_dev, pool = time_back_to_back(decode_step, pool, args[0])
            bytes_moved = 2 * B * H * STATE_BYTES
            row.update(ours_us=t * 1e6, ours_frac_bw=bytes_moved / HBM_BYTES_PER_S / t, ours_b2b_us=t_dev * 1e6,
                       ours_b2b_frac_bw=bytes_moved / HBM_BYTES_PER_S / t_dev)
            if fused_recurrent_kda_fwd is not None:
                tq, tk, tv, tg, tb = (to_torch(x) for x in (q, k, v, g, beta))
                tpool = torch.from_dlpack(jax.random.normal(jax.random.key(1), (num_slots, H, K, V), jnp.float32))
                tslots = torch.from_dlpack(slots).long()
                o_f, _ = fused_recurrent_kda_fwd(tq, tk, tv, tg, tb, initial_state=tpool, inplace_final_state=True,
                                                 ssm_state_indices=tslots, output_final_state=True)
                row["fla_err_out"] = rel_rms(jnp.from_dlpack(o_f.float().contiguous())[:, 0], o_ref)
                f = lambda: fused_recurrent_kda_fwd(tq, tk, tv, tg, tb, initial_state=tpool, inplace_final_state=True,
                                                    ssm_state_indices=tslots, output_final_state=True)
                row["fla_us"] = time_torch(f, [()], repeats=repeats) * 1e6
                row["fla_over_ours"] = row["fla_us"] / row["ours_us"]
                # The same host clock as ours (CUDA events, used until 2026-12-01, left fla's host gaps out).
                row["fla_b2b_us"] = time_back_to_back_calls(f, lambda _: torch.cuda.synchronize(), steps=20) * 1e6
                row["fla_over_ours_b2b"] = row["fla_b2b_us"] / row["ours_b2b_us"]
            print(row, flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
