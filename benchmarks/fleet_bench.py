"""Fleet policies on a Mooncake trace: admission budgets, routing hit rates, failover balance.

``python benchmarks/fleet_bench.py --trace ../shared/data/mooncake/synthetic_trace.jsonl`` replays the
trace (time compressed by ``--time-scale``) plus bursts of 1M-token requests through 16
simulated clusters (serving/fleet/simulator.py) and prints one JSON object; ``--plots DIR``
writes TTFT and hit-rate figures (matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import numpy as np

from serving.fleet.simulator import CostModel, FleetSim, inject_bursts, load_trace


def p99(xs):
    return float(np.percentile(xs, 99)) if xs else float("nan")


def summarize(recs):
    served = [r for r in recs if "ttft" in r]
    out = {"served": len(served), "rejected": sum("rejected" in r for r in recs)}
    for k in sorted({r["klass"] for r in recs}):
        t = [r["ttft"] for r in served if r["klass"] == k]
        out[k] = {"n": sum(r["klass"] == k for r in recs), "served": len(t), "ttft_p50": float(np.median(t)) if t else None,
                  "ttft_p99": p99(t), "rejected": sum(r["klass"] == k and "rejected" in r for r in recs)}
    # Over the trace's own requests: the injected bursts are unique prompts by construction.
    trace = [r for r in served if not r["session"].startswith("burst")]
    inp = sum(r["input"] for r in trace)
    out["hit_rate"] = sum(r["cached"] for r in trace) / inp if inp else 0.0
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--clusters", type=int, default=16)
    ap.add_argument("--time-scale", type=float, default=8.0, help="compress trace time by this factor")
    ap.add_argument("--bursts", type=int, default=3, help="number of 1M-token bursts")
    ap.add_argument("--burst-size", type=int, default=32)
    ap.add_argument("--prefill-tok-s", type=float, default=CostModel.prefill_tok_s)
    ap.add_argument("--decode-step-s", type=float, default=CostModel.decode_step_s)
    ap.add_argument("--cache-blocks", type=int, default=CostModel.cache_blocks)
    ap.add_argument("--fit", default=None, help="model.json from benchmarks/model.py: take the prefill and decode rates from it")
    ap.add_argument("--limit", type=int, default=None, help="only the first N trace requests")
    ap.add_argument("--plots", default=None, help="directory for PNG plots")
    a = ap.parse_args(argv)

    if a.fit:
        cost = CostModel.fitted(a.fit, cache_blocks=a.cache_blocks)
    else:
        cost = CostModel(prefill_tok_s=a.prefill_tok_s, decode_step_s=a.decode_step_s, cache_blocks=a.cache_blocks)
    base = load_trace(a.trace, time_scale=a.time_scale, limit=a.limit)
    span = base[-1].t
    burst_at = [span * (i + 1) / (a.bursts + 1) for i in range(a.bursts)]
    reqs = inject_bursts(base, at=burst_at, count=a.burst_size)

    runs = {}
    for name, kw in {
        "affinity_budgets": dict(routing="affinity", budgets=True),
        "affinity_no_budgets": dict(routing="affinity", budgets=False),
        "random_budgets": dict(routing="random", budgets=True),
        "least_loaded_budgets": dict(routing="least_loaded", budgets=True),
    }.items():
        runs[name] = FleetSim(a.clusters, cost=cost, **kw).run(reqs)

    # Failover: kill the cluster holding the most sessions halfway through (affinity + budgets).
    probe = FleetSim(a.clusters, cost=cost, routing="affinity")
    for r in base:
        probe.router.route(r.session)
    victim = max(probe.router.load, key=probe.router.load.get)
    t_kill = span / 2
    sim = FleetSim(a.clusters, cost=cost, routing="affinity", kill=(t_kill, victim))
    runs["affinity_budgets_failover"] = sim.run(reqs)
    # Work = uncached prefill tokens of the trace's requests (the injected bursts excluded).
    work = lambda c, keep: sum(tok for t, tok, s in c.prefilled if keep(t) and not s.startswith("burst"))
    after = {n: work(c, lambda t: t >= t_kill) for n, c in sim.clusters.items() if n != victim}
    before = {n: work(c, lambda t: t < t_kill) for n, c in sim.clusters.items() if n != victim}
    sessions = {n: sim.router.load[n] for n in after}
    # The victim's sessions: the work they bring to each survivor after the kill (the "extra" load).
    recs = runs["affinity_budgets_failover"]
    moved = {r["session"] for r in recs if r["t"] < t_kill and r.get("cluster") == victim}
    extra = dict.fromkeys(after, 0)
    for r in recs:
        if r["session"] in moved and "ttft" in r and r["cluster"] != victim:
            extra[r["cluster"]] += r["input"] - r["cached"]
    moved_sessions = dict.fromkeys(after, 0)
    for sess in moved:
        cl = sim.router.assignment.get(sess)
        if cl in moved_sessions:
            moved_sessions[cl] += 1

    summary = {k: summarize(v) for k, v in runs.items()}
    result = {
        "short_ttft_p99_with_budgets": summary["affinity_budgets"]["short"]["ttft_p99"],
        "short_ttft_p99_without_budgets": summary["affinity_no_budgets"]["short"]["ttft_p99"],
        "hit_rate_affinity": summary["affinity_budgets"]["hit_rate"],
        "hit_rate_random": summary["random_budgets"]["hit_rate"],
        "hit_rate_least_loaded": summary["least_loaded_budgets"]["hit_rate"],
        # The extra load: the victim's sessions each survivor took over, max over mean.
        "failover_max_over_mean": max(moved_sessions.values()) / np.mean(list(moved_sessions.values())),
        "failover_sessions_after_kill_max_over_mean": max(sessions.values()) / np.mean(list(sessions.values())),
        "failover_moved_work_max_over_mean": max(extra.values()) / np.mean(list(extra.values())),
        "failover_work_after_kill_max_over_mean": max(after.values()) / np.mean(list(after.values())),
        "failover_work_before_kill_max_over_mean": max(before.values()) / np.mean(list(before.values())),
        "failover_moved_sessions": len(moved),
        "failover_moved_sessions_active_after_kill": len({r["session"] for r in recs if r["session"] in moved and r["t"] >= t_kill}),
        "failover_lost_requests": sum("ttft" not in r and "rejected" not in r for r in runs["affinity_budgets_failover"]),
        "killed": victim,
        "kill_at_s": t_kill,
        "requests": len(reqs),
        "bursts": {"times_s": burst_at, "count": a.burst_size, "tokens": 1_000_000},
        "cost_model": dataclasses.asdict(cost),
        "time_scale": a.time_scale,
        "runs": summary,
    }
    if a.plots:
        plot(runs, summary, a.plots)
    print(json.dumps(result, indent=1, default=float))
    return result


def plot(runs, summary, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, klass in zip(axes, ("short", "medium", "long")):
        for name in ("affinity_budgets", "affinity_no_budgets"):
            t = np.sort([r["ttft"] for r in runs[name] if "ttft" in r and r["klass"] == klass])
            if len(t):
                ax.plot(t, np.arange(1, len(t) + 1) / len(t), label=name.replace("_", " "))
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{klass} requests")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "fleet_ttft.png"), dpi=110)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    names = ["affinity_budgets", "random_budgets", "least_loaded_budgets"]
    ax.bar([n.split("_budgets")[0].replace("_", " ") for n in names], [summary[n]["hit_rate"] for n in names])
    ax.set_ylabel("prefix-cache hit rate (tokens)")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "fleet_hit_rate.png"), dpi=110)


if __name__ == "__main__":
    main()
