"""The fleet simulator: cost-model arithmetic, prefix reuse, budgets under bursts, failover."""

import random

import pytest

from serving.fleet import RequestClass
from serving.fleet.simulator import BLOCK_TOKENS, CostModel, FleetSim, TraceRequest, inject_bursts

COST = CostModel(prefill_tok_s=10_000.0, decode_step_s=0.01, prefill_overhead_s=0.0, cache_blocks=1000)


def req(rid, t, blocks, out=4, session=None):
    hids = tuple(blocks)
    return TraceRequest(rid, t, len(hids) * BLOCK_TOKENS, out, hids, session or f"s{hids[0]}")


def test_fifo_prefill_times_follow_the_cost_model():
    # Two cold requests at t = 0 on one cluster: the second waits for the first.
    a, b = req(0, 0.0, [1, 2]), req(1, 0.0, [7, 8, 9])
    recs = FleetSim(1, cost=COST, budgets=False).run([a, b])
    assert recs[0]["ttft"] == pytest.approx(1024 / 10_000)
    assert recs[1]["ttft"] == pytest.approx((1024 + 1536) / 10_000)


def test_a_later_turn_reuses_the_cached_prefix():
    first = req(0, 0.0, [1, 2, 3])
    second = req(1, 5.0, [1, 2, 3, 4])  # extends the first turn
    other = req(2, 6.0, [9, 2, 3])  # shares blocks but not the first: no reuse (prefix chain)
    recs = FleetSim(1, cost=COST).run([first, second, other])
    assert [r["cached"] for r in recs] == [0, 3 * BLOCK_TOKENS, 0]
    assert recs[1]["ttft"] == pytest.approx(BLOCK_TOKENS / 10_000)


def _sessions(n_sessions, turns, seed):
    """Multi-turn conversations: each turn extends the previous prompt by one to three blocks."""
    rng = random.Random(seed)
    reqs, next_block, rid = [], 0, 0
    for s in range(n_sessions):
        chain, t = [], rng.uniform(0, 50)
        for _ in range(turns):
            k = rng.randint(1, 3)
            chain += list(range(next_block, next_block + k))
            next_block += k
            reqs.append(req(rid, t, chain, session=f"s{s}"))
            rid += 1
            t += rng.uniform(5, 20)
    return sorted(reqs, key=lambda r: (r.t, r.rid))


def _hit_rate(recs):
    return sum(r["cached"] for r in recs) / sum(r["input"] for r in recs)


def test_affinity_routing_beats_random_and_least_loaded_on_hit_rate():
    reqs = _sessions(60, 5, seed=1)
    rates = {p: _hit_rate(FleetSim(8, cost=COST, routing=p, seed=2).run(reqs)) for p in ("affinity", "random", "least_loaded")}
    # Every later turn hits its whole previous prompt under affinity.
    ideal = sum(len(r.hash_ids) * BLOCK_TOKENS for r in reqs if r.rid not in {min(x.rid for x in reqs if x.session == r.session)})
    assert rates["affinity"] > rates["random"] + 0.2 and rates["affinity"] > rates["least_loaded"] + 0.1
    assert rates["affinity"] <= ideal / sum(r.input_len for r in reqs)


CLASSES = (RequestClass("short", 2048, 64_000, share=2.0), RequestClass("long", 1 << 20, 2_000_000, max_queue=64, queue_timeout_s=1e6))


def test_budgets_protect_short_requests_from_a_long_burst():
    rng = random.Random(3)
    shorts = [req(i, rng.uniform(0, 60), [10_000 + 4 * i + j for j in range(3)]) for i in range(200)]
    reqs = inject_bursts(sorted(shorts, key=lambda r: r.t), at=[5.0], count=8, tokens=1_000_000)
    p99 = {}
    for budgets in (True, False):
        recs = FleetSim(2, cost=COST, budgets=budgets, classes=CLASSES).run(reqs)
        assert all("ttft" in r for r in recs), "nothing lost"
        t = sorted(r["ttft"] for r in recs if r["klass"] == "short")
        p99[budgets] = t[int(0.99 * (len(t) - 1))]
    # A short request alone takes 0.15 s; with budgets it shares the cluster with the burst
    # (2/3 of the compute), without them it waits behind 1M-token prefills (100 s each).
    assert p99[True] < 1.0 < 50.0 < p99[False]


def test_failover_reroutes_everything_and_loses_nothing():
    reqs = _sessions(80, 4, seed=4)
    probe = FleetSim(4, cost=COST)
    victim = probe.router.route(reqs[0].session)
    sim = FleetSim(4, cost=COST, kill=(30.0, victim))
    recs = sim.run(reqs)
    assert all("ttft" in r or "rejected" in r for r in recs)
    assert all(r["cluster"] != victim for r in recs if r["t"] >= 30.0 or r.get("rerouted"))
    assert all(t < 30.0 for t, _, _ in sim.clusters[victim].prefilled)
    loads = [sim.router.load[c] for c in sim.clusters if c != victim]
    assert max(loads) <= 1.25 * sum(loads) / len(loads) + 1


def test_cost_model_fits_the_model_benchmark_output(tmp_path):
    path = tmp_path / "model.json"
    path.write_text('{"prefill_tok_s": 20000.0, "decode_step_ms_median": 4.0, "T": 8192}')
    cost = CostModel.fitted(str(path), cache_blocks=7)
    assert (cost.prefill_tok_s, cost.decode_step_s, cost.cache_blocks) == (20000.0, 0.004, 7)
    recs = FleetSim(1, cost=cost).run([req(0, 0.0, [1, 2], out=10)])
    assert recs[0]["ttft"] == pytest.approx(1024 / 20000 + cost.prefill_overhead_s)
    assert recs[0]["end"] - recs[0]["ttft"] == pytest.approx(10 * 0.004)
