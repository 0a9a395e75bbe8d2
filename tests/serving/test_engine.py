"""The engine on the tiny model: greedy outputs are identical across cache, chunking, batching
and preemption; the second turn of a conversation reuses the first."""

import numpy as np
import pytest

from serving.engine import Drafter, Engine, RequestError, SamplingParams


@pytest.fixture(scope="module")
def cached():
    return Engine(max_slots=3, max_len=1200, prefill_chunk=256)


@pytest.fixture(scope="module")
def plain():
    # No prefix cache and unchunked prefill (one piece per power of two).
    return Engine(max_slots=3, max_len=1200, prefill_chunk=1024, prefix_cache=False)


def prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 256, n)]


@pytest.mark.slow  # CI time; second turns at smaller sizes: test_restoring_hits_of_any_length_compiles_once,
# test_pallas_prefill_kernel_swaps_in (and the step engine's prefix-cache tests)
def test_second_turn_reuses_the_first(cached, plain):
    turn1 = prompt(0, 700)
    r1 = cached.generate([turn1], max_tokens=6)[0]
    assert r1.num_cached_tokens == 0 and len(r1.token_ids) == 6
    turn2 = turn1 + r1.token_ids + prompt(1, 40)
    r2 = cached.generate([turn2], max_tokens=6)[0]
    assert r2.num_cached_tokens == 512  # the longest checkpointed 512 boundary
    cold = plain.generate([turn2], max_tokens=6)[0]
    assert cold.num_cached_tokens == 0
    assert r2.token_ids == cold.token_ids
    assert plain.generate([turn1], max_tokens=6)[0].token_ids == r1.token_ids  # chunked == unchunked


def test_restoring_hits_of_any_length_compiles_once():
    """Cache restores of 64 and 128 tokens run one compiled function (no per-hit-length
    compilation on the serving path); the engine is the server tests' shape."""
    from serving import engine as eng

    e = Engine(max_slots=4, max_len=256, prefill_chunk=32, prefix_cache=True, hash_tokens=64)
    conv, sizes = prompt(11, 70), []
    for turn in range(3):
        r = e.generate([conv], max_tokens=2)[0]
        assert r.num_cached_tokens == 64 * turn
        if turn:
            sizes.append(eng._restore_slot._cache_size())
        conv = conv + r.token_ids + prompt(12 + turn, 62)
    assert sizes[0] == sizes[1] >= 1


@pytest.mark.slow  # CI time: the reference engine; the step engine's batches are tested in CI
def test_batch_of_one_vs_many(cached):
    ps = [prompt(2, 30), prompt(3, 90), prompt(4, 5), prompt(5, 300)]
    together = cached.generate(ps, max_tokens=5)
    alone = [cached.generate([p], max_tokens=5)[0] for p in ps]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert all(r.ttft_s > 0 and len(r.token_times_s) == 5 for r in together)
    assert cached.num_compilations <= 12  # prefill buckets (powers of two) + one decode shape


def test_sampling(cached):
    p = prompt(6, 20)
    greedy = cached.generate([p], max_tokens=4)[0].token_ids
    assert cached.generate([p], max_tokens=4, temperature=0.7, top_k=1)[0].token_ids == greedy
    a = cached.generate([p], max_tokens=4, temperature=1.5, top_p=0.9, seed=7)[0].token_ids
    b = cached.generate([p], max_tokens=4, temperature=1.5, top_p=0.9, seed=7)[0].token_ids
    assert a == b
    r = cached.generate([p], max_tokens=4, stop_token_ids=[greedy[1]])[0]
    assert r.token_ids == greedy[:2] and r.finish_reason == "stop"


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2),
                                 dict(temperature=float("nan"))])
def test_invalid_sampling_is_rejected(cached, bad):
    with pytest.raises(RequestError):
        cached.submit([5, 6], SamplingParams(**bad))


def test_invalid_prompts_are_rejected(cached):
    with pytest.raises(RequestError, match="empty"):
        cached.submit([])
    with pytest.raises(RequestError, match="vocabulary"):
        cached.submit([5, 999])
    with pytest.raises(RequestError, match="max_len"):
        cached.submit([5] * 1190, SamplingParams(max_tokens=20))


@pytest.mark.slow  # CI time: the reference engine; the step engine's preemption is tested in CI
def test_preemption_recomputes_and_never_corrupts(plain):
    # A 4-page pool: two requests fit at admission, but crossing the 512 boundary while
    # decoding needs a checkpoint and a new block, so one is preempted and recomputed later.
    small = Engine(max_slots=3, max_len=1200, prefill_chunk=256, cache_pages=4)
    ps = [prompt(8, 500), prompt(9, 505)]
    got = small.generate(ps, max_tokens=20)
    want = plain.generate(ps, max_tokens=20)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert small.metrics["preemptions"] >= 1
    small.cache.check_invariants()
    assert small.pool.num_used == sum(small.pool.refcount > 0) + small.pool.num_evictable


class OracleDrafter:
    """Proposes each prompt's known continuation with every third draft position corrupted, so
    steps accept all, some or none of their drafts."""

    def __init__(self, pairs):
        self.pairs = pairs

    def propose(self, tokens, k):
        prompt, cont = next((p, c) for p, c in self.pairs if tokens[: len(p)] == p)
        i = len(tokens) - len(prompt)
        out = list(cont[i : i + k])
        return [t if (i + j) % 3 else (t + 1) % 256 for j, t in enumerate(out)]


@pytest.mark.slow  # CI time: the step engine's speculation tests run in CI
def test_speculative_greedy_equals_plain_greedy(plain):
    """Batched verify + commit over three concurrent requests of different lengths equals plain
    greedy decoding token for token; so does the n-gram drafter on repetitive prompts."""
    ps = [prompt(10, 40), prompt(13, 17), prompt(14, 66)]
    want = [r.token_ids for r in plain.generate(ps, max_tokens=24)]
    spec = Engine(max_slots=3, max_len=1200, prefill_chunk=1024, prefix_cache=False, speculative=3,
                  drafter=OracleDrafter(list(zip(ps, want))))
    assert [r.token_ids for r in spec.generate(ps, max_tokens=24)] == want
    m = spec.metrics
    assert 0 < m["spec_accepted"] < m["spec_proposed"]
    # Accepted drafts carry the verify window's logprobs: the same as plain decoding's.
    got, ref = (e.generate(ps[:1], max_tokens=8, logprobs=2)[0].logprobs for e in (spec, plain))
    assert len(got) == 8 and all(g is not None for g in got)
    np.testing.assert_allclose([g[0] for g in got], [r[0] for r in ref], atol=1e-4)
    assert [[t for t, _ in g[1]] for g in got] == [[t for t, _ in r[1]] for r in ref]
    ngram = Engine(max_slots=3, max_len=1200, prefill_chunk=1024, prefix_cache=False, speculative=3)
    reps = [ps[0] * 3, ps[1] * 4]
    assert [r.token_ids for r in ngram.generate(reps, max_tokens=10)] == [r.token_ids for r in plain.generate(reps, max_tokens=10)]


def test_speculation_backs_off_when_nothing_is_accepted(plain):
    """A drafter that is always wrong. With back-off the request drafts 3 tokens at decode steps
    1, 3, 6, 11 and 20 (waits 1, 2, 4, 8, 16 after consecutive misses): 15 drafts. Without,
    at every step that has room: 3 at steps 1-20, then 2 and 1 (max_tokens), 63 drafts. The
    greedy tokens are the plain ones either way."""
    p = prompt(15, 30)
    want = plain.generate([p], max_tokens=24)[0].token_ids
    wrong = OracleDrafter([(p, [(t + 1) % 256 for t in want])])  # every position wrong
    e = Engine(max_slots=3, max_len=1200, prefill_chunk=1024, prefix_cache=False, speculative=3, drafter=wrong)
    e.warmup(prefill=False)  # then the loop's decode, verify and commit shapes compile no more
    from serving import engine as eng

    compiled = [f._cache_size() for f in (eng._decode, eng._verify, eng._commit)]
    for backoff, proposed in ((16, 15), (0, 63)):
        e.spec_backoff = backoff
        e.metrics.update(spec_proposed=0, spec_accepted=0)
        assert e.generate([p], max_tokens=24)[0].token_ids == want
        assert e.metrics["spec_accepted"] == 0
        assert e.metrics["spec_proposed"] == proposed
    assert [f._cache_size() for f in (eng._decode, eng._verify, eng._commit)] == compiled


def test_rows_without_drafts_ride_in_the_verify_window(plain, monkeypatch):
    """While a greedy row drafts, a sampled row decodes inside the same verify window (a window
    of one token): no separate decode call for it, and its seeded samples equal plain decoding's."""
    from serving import engine as eng

    g, s = prompt(16, 20), prompt(17, 12)
    sp = SamplingParams(max_tokens=5, temperature=0.8, seed=3)

    def run(e):
        reqs = [e.submit(g, SamplingParams(max_tokens=24)), e.submit(s, sp)]
        while not all(r.finished.is_set() for r in reqs):
            e.step()
        return [r.result.token_ids for r in reqs]

    want = run(plain)
    spec = Engine(max_slots=3, max_len=1200, prefill_chunk=1024, prefix_cache=False, speculative=3,
                  drafter=OracleDrafter([(g, want[0])]))
    decode, calls = eng._decode, []
    monkeypatch.setattr(eng, "_decode", lambda *a: calls.append(1) or decode(*a))
    assert run(spec) == want
    assert spec.metrics["spec_accepted"] > 0
    assert len(calls) <= 2  # only steps where no row drafts (the greedy row's last tokens); 4 before


def test_ngram_drafter():
    from serving.engine import NgramDrafter

    d = NgramDrafter(max_ngram=3)
    assert d.propose([1, 2, 3, 9, 9, 1, 2, 3], 3) == [9, 9, 1]
    assert d.propose([5, 6, 7], 2) == []
    assert d.propose([4, 1, 4], 5) == [1, 4]


def test_default_kernels_pick_pallas_prefill_on_gpu_only():
    from dataclasses import replace

    from k3jax.model import Kernels, ModelConfig
    from k3jax.ops.kda import chunk_kda
    from pallas_kernels.kda import chunk_kda as pallas_chunk_kda
    from serving.engine import CONFIGS, default_kernels

    cfg = ModelConfig.from_json(f"{CONFIGS}/tiny.json")
    assert default_kernels(cfg, "gpu").chunk_kda is pallas_chunk_kda
    assert default_kernels(cfg, "tpu") == default_kernels(cfg, "cpu") == Kernels()
    assert default_kernels(replace(cfg, linear_head_dim=24), "gpu").chunk_kda is chunk_kda
    k3 = default_kernels(ModelConfig.from_json(f"{CONFIGS}/kimi_k3.json"), "gpu").chunk_kda  # gates >= -5
    assert k3.func is pallas_chunk_kda and k3.keywords == {"gate_lower_bound": -5.0}
    assert default_kernels(replace(cfg, kda_lower_bound=-8.0), "gpu").chunk_kda is pallas_chunk_kda


@pytest.mark.slow  # about 50 s: the interpreted kernels compile for every piece length
def test_pallas_decode_kernels_swap_in(plain):
    """The Pallas slot-pool kernels (the GPU kernels, interpreted on CPU) as ``Kernels.recurrent_kda``
    (decode steps, verify windows, short prefill tails) and ``Kernels.kda_commit`` (commit by
    replay), with speculation accepting all, some or none of the drafts: the plain greedy tokens."""
    from functools import partial

    from k3jax.model import Kernels
    from pallas_kernels.kda import kda_commit_dense, kda_recurrent_dense

    ps = [prompt(10, 40), prompt(13, 17)]
    want = [r.token_ids for r in plain.generate(ps, max_tokens=12)]
    gpu = dict(backend="gpu", interpret=True)
    e = Engine(max_slots=3, max_len=1200, prefill_chunk=1024, prefix_cache=False, speculative=3,
               drafter=OracleDrafter(list(zip(ps, want))),
               kernels=Kernels(recurrent_kda=partial(kda_recurrent_dense, **gpu),
                               kda_commit=partial(kda_commit_dense, **gpu)))
    assert [r.token_ids for r in e.generate(ps, max_tokens=12)] == want
    assert 0 < e.metrics["spec_accepted"] < e.metrics["spec_proposed"]


@pytest.mark.slow  # CI time: the reference engine; the Pallas prefill is tested on its own in CI
def test_pallas_prefill_kernel_swaps_in(plain):
    """The Pallas prefill kernel (the GPU kernels, interpreted on CPU) injected through
    ``Kernels`` serves the same greedy tokens as the XLA path, prefix cache on (second turn)."""
    from functools import partial

    from k3jax.model import Kernels
    from pallas_kernels.kda import chunk_kda

    e = Engine(max_slots=2, max_len=256, prefill_chunk=128, hash_tokens=64,
               kernels=Kernels(chunk_kda=partial(chunk_kda, backend="gpu", interpret=True)))
    turn1 = prompt(21, 150)
    r1 = e.generate([turn1], max_tokens=4)[0]
    turn2 = turn1 + r1.token_ids + prompt(22, 40)
    r2 = e.generate([turn2], max_tokens=4)[0]
    assert r2.num_cached_tokens == 128
    assert r1.token_ids == plain.generate([turn1], max_tokens=4)[0].token_ids
    assert r2.token_ids == plain.generate([turn2], max_tokens=4)[0].token_ids


@pytest.mark.slow  # K3 on the serving path: tests/k3jax/test_k3_goldens.py::test_k3_step_matches_the_reference
def test_kimi_k3_through_the_engine():
    """The embedded tiny K3 (AttnRes, LatentMoE, gated MLA) served with the prefix cache and
    speculation: a second turn resumes from the first turn's checkpoint and every greedy
    output equals a cold engine's."""
    kw = dict(max_slots=2, max_len=192, prefill_chunk=32, hash_tokens=32)
    class Repeat(Drafter):  # always proposes: every decode step verifies a window
        def propose(self, tokens, k):
            return tokens[-1:] * k

    warm = Engine("tiny-k3", speculative=2, drafter=Repeat(), **kw)
    cold = Engine("tiny-k3", prefix_cache=False, **kw)
    turn1 = prompt(20, 70)
    r1 = warm.generate([turn1], max_tokens=6)[0]
    turn2 = turn1 + r1.token_ids + prompt(21, 10)
    r2 = warm.generate([turn2], max_tokens=6)[0]
    assert r2.num_cached_tokens == 64
    assert [r.token_ids for r in cold.generate([turn1, turn2], max_tokens=6)] == [r1.token_ids, r2.token_ids]
    assert warm.metrics["spec_proposed"] > 0
