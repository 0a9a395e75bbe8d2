"""The engine on the serving step: greedy outputs equal to the reference forward across token
budgets, batch sizes and preemption; no compilation after warm-up; aborts; bad requests."""

import dataclasses
import os
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.model import ModelConfig, forward, init_cache, init_params, load_hf_checkpoint
from k3jax.model.mxfp4 import MXFP4
from k3jax.model.step import Row, StepKernels, batch_shapes, flatten_batch, layer_runs, pack_batch, prepare_params
from k3jax.parallel.sharded_step import step_mesh
from serving.engine import CONFIGS, RequestError, SamplingParams
from serving import step_engine
from serving.step_engine import StepEngine, _fed_step, draw_filters, draw_rows, sampling_params

PROMPTS = [[5, 6, 7] * 30, [9] * 17, list(range(40, 100)), [200, 3, 77]]
MAX_TOKENS = 6


def _model():
    """tiny with a fifth layer, so layers 1-4 are two periods of (KDA, MLA) that the step scans."""
    cfg = ModelConfig.from_json(f"{CONFIGS}/tiny.json")
    cfg = dataclasses.replace(cfg, layer_types=(*cfg.layer_types, "mla"), mlp_types=(*cfg.mlp_types, "moe"))
    assert layer_runs(cfg) == ((1, 2, 2),)
    return cfg, init_params(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def greedy_reference():
    """Each prompt's greedy continuation by the reference forward (one token at a time)."""
    cfg, params = _model()
    fwd = jax.jit(lambda ids, cache: forward(cfg, params, ids, cache))
    out = []
    for p in PROMPTS:
        cache = init_cache(cfg, 128)
        logits, cache = jax.jit(lambda ids, cache: forward(cfg, params, ids, cache))(jnp.asarray(p), cache)
        toks = [int(jnp.argmax(logits[-1]))]
        for _ in range(MAX_TOKENS - 1):
            logits, cache = fwd(jnp.asarray(toks[-1:]), cache)
            toks.append(int(jnp.argmax(logits[-1])))
        out.append(toks)
    return out


def _engine(model=None, **kw):
    args = dict(dtype=jnp.float32, max_running=4, max_len=128, token_budget=64, max_prefill_rows=2,
                decode_buckets=(4,), prefill_buckets=(64,), prefix_cache=False)
    return StepEngine(model or _model(), **{**args, **kw})


@pytest.fixture(scope="module")
def engine():
    """Built from step-format weights (``params=``, as a model too large to hold twice is given):
    the tests on it check that path against the reference forward."""
    cfg, ref = _model()
    e = _engine(model=cfg, params=prepare_params(cfg, ref, jnp.float32))
    e.warmup()
    return e


def test_greedy_equals_forward_and_nothing_compiles_after_warmup(engine, greedy_reference):
    engine.runner.warmup()  # again: conftest may have dropped JAX's caches since the fixture warmed up
    traced = _fed_step._cache_size()  # nothing traced again (the bucket counter sees only new buckets)
    res = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r.token_ids for r in res] == greedy_reference
    assert all(r.finish_reason == "length" for r in res)
    one = engine.generate(PROMPTS[2:3], max_tokens=MAX_TOKENS)  # alone: the same tokens
    assert one[0].token_ids == greedy_reference[2]
    rng = np.random.default_rng(1)
    engine.generate([rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 100, 6)], max_tokens=3)
    assert engine.runner.compiles_while_serving == 0 and _fed_step._cache_size() == traced
    assert engine.sched.pool.num_used == 0 and not engine.has_work()


def test_params_go_with_a_config():
    cfg, ref = _model()
    with pytest.raises(ValueError, match="goes with a ModelConfig"):
        StepEngine("tiny", params=prepare_params(cfg, ref, jnp.float32))


def test_the_engine_keeps_every_compiled_program_for_the_next_start(tmp_path):
    """The engine's compile cache keeps programs that compile in well under a second (JAX keeps
    only those over one by default): a fresh process finds a small one there."""
    code = ("import sys, jax, jax.numpy as jnp; from serving.step_engine import use_compile_cache; "
            "use_compile_cache(sys.argv[1]); print(jax.jit(lambda x: x * 3 + 1)(jnp.arange(4.0)))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    run = lambda: subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                                 check=True)
    kept = lambda: {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.name.startswith("jit__lambda")}
    run()
    first = kept()
    assert first, sorted(p.name for p in tmp_path.iterdir())
    run()
    assert kept() == first  # read, not compiled and written again


@pytest.mark.parametrize("budget,async_dispatch", [  # 256 (CI time): the module engine's own budget is 64
    (16, True), pytest.param(256, False, marks=pytest.mark.slow), pytest.param(8192, True, marks=pytest.mark.slow)])
def test_token_budgets_give_the_same_tokens(budget, async_dispatch, greedy_reference):
    chunk = budget if budget == 8192 else min(budget, 64)  # 8192: every prompt whole in one step
    e = _engine(token_budget=budget, max_chunk=chunk, prefill_buckets=(min(budget, chunk * 2),),
                max_len=128, async_dispatch=async_dispatch)
    assert [r.token_ids for r in e.generate(PROMPTS, max_tokens=MAX_TOKENS)] == greedy_reference


@pytest.mark.parametrize("cache", [pytest.param(False, marks=pytest.mark.slow), True])  # CI time: the cached case
def test_preemption_recomputes_and_never_corrupts(cache, engine):
    """Four requests fill a tight pool of 16-token pages at admission; crossing their second page
    preempts the later ones, whose tokens are recomputed (with the prefix cache, from what they
    cached before): the outputs equal an unpressed run."""
    prompts = np.random.default_rng(2).integers(0, 256, (4, 30 if cache else 14)).tolist()
    want = engine.generate(prompts, max_tokens=10)  # the module engine: a roomy pool
    kw = dict(prefix_cache=True, hash_tokens=16, num_pages=13) if cache else dict(num_pages=9)
    tight = _engine(page_tokens=16, **kw)
    got = tight.generate(prompts, max_tokens=10)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    pool = tight.sched.pool
    assert tight.preemptions > 0 and pool.num_used == pool.num_evictable
    if cache:
        tight.sched.cache.check_invariants()


@pytest.mark.parametrize("cache,speculative", [(False, 0), (True, 2)])
def test_the_smallest_pool_serves_requests_that_each_fill_it(cache, speculative, engine):
    """The smallest pool the engine accepts (one request of ``max_len``: its pages, its state and
    with the prefix cache its checkpoints) and three requests that each grow to ``max_len`` (the
    issue's 512/1023/1024 case): the oldest always progresses, all finish with the tokens of an
    unpressed run; one page less is refused with the reason."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 256, n).tolist() for n in (60, 100, 110)]
    max_tokens = [128 - len(p) for p in prompts]
    kw = dict(page_tokens=16, prefix_cache=cache, hash_tokens=16, speculative=speculative)
    smallest = 8 + (5 if cache else 1)  # 128 / 16 MLA pages and the state pages
    with pytest.raises(ValueError, match="cannot hold one request"):
        _engine(num_pages=smallest - 1, **kw)
    e = _engine(num_pages=smallest, **kw)
    reqs = [e.submit(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, max_tokens)]
    while e.has_work():
        e.step()
    assert [r.result.token_ids for r in reqs] == [engine.generate([p], max_tokens=m)[0].token_ids
                                                  for p, m in zip(prompts, max_tokens)]
    # Without the cache admission takes a slot only, so growing requests preempt the later ones;
    # with it a prompt's pages are taken at admission, so the later ones wait for free pages.
    assert (e.preemptions > 0) == (not cache) and e.sched.pool.num_used == e.sched.pool.num_evictable


def test_seeded_sampling_is_reproducible_and_stops(engine):
    sp = SamplingParams(max_tokens=5, temperature=1.0, top_k=20, seed=123)
    a = engine.submit(PROMPTS[1], sp)
    b = engine.submit(PROMPTS[1], sp)
    while engine.has_work():
        engine.step()
    assert a.result.token_ids == b.result.token_ids and len(a.result.token_ids) == 5
    stop = a.result.token_ids[1]
    c = engine.submit(PROMPTS[1], SamplingParams(max_tokens=5, temperature=1.0, top_k=20, seed=123,
                                                 stop_token_ids=(stop,)))
    while engine.has_work():
        engine.step()
    assert c.result.finish_reason == "stop" and c.result.token_ids == a.result.token_ids[:2]


@pytest.mark.parametrize("filters", ["none", "top_k", "sort"])
def test_drawing_after_the_step_equals_sampling_in_it(engine, filters):
    """The engine's step samples greedily and :func:`draw_rows` draws the rest: the same tokens,
    logprobs and stored last tokens, bit for bit, as the sampler inside the step; ``"none"`` (no
    top-k, top-p or logprobs) and ``"top_k"`` (top-k and top-p, no logprobs) sort nothing and draw
    the same."""
    r = engine.runner
    params = [dict(temperature=0.0), dict(temperature=0.7, seed=3), dict(temperature=1.3, seed=4),
              dict(temperature=1.0, seed=5)]
    if filters != "none":
        params[2].update(top_k=5)
        params[3].update(top_p=0.5)
    rows = [Row([t], 0, [i], slot=10 + i, **sp) for i, (t, sp) in enumerate(zip([5, 9, 40, 200], params))]
    batch = pack_batch(r.lay, rows, [], num_decode=4, num_tokens=4, num_rows=4, max_blocks=r.max_blocks,
                       num_pages=r.num_pages, to_device=False)
    n = r.num_logprobs if filters == "sort" else 0

    def step(sample_rows):
        out, _, last = _fed_step(r.cfg, r.lay, r.kernels, 4, r.params, r.allocate_pool(), r.allocate_last(),
                                 *r.place(flatten_batch(batch)), shapes=batch_shapes(batch), window=1,
                                 num_logprobs=r.num_logprobs, sample_rows=sample_rows)
        return out, last

    (inline, last), (split, _) = step(True), step(False)
    assert split.logprob is None and np.array_equal(split.tokens, np.argmax(split.logits, -1))
    tokens, lp, top_ids, top_lp, drawn_last = draw_rows(split.logits, split.positions, sampling_params(batch),
                                                        step(False)[1], filters=filters, num_logprobs=n)
    assert not np.array_equal(tokens, split.tokens), "no row drew a token other than its greedy one"
    for got, want in [(tokens, inline.tokens), (lp, inline.logprob), (drawn_last, last),
                      (top_ids, inline.top_ids[:, :n]), (top_lp, inline.top_logprobs[:, :n])]:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_temperature_below_the_greedy_bound_is_greedy(engine, greedy_reference, monkeypatch):
    """``SamplingParams``: a temperature under ``GREEDY_TEMPERATURE`` samples greedily, so the
    step's greedy token stands and no sampler call runs."""
    draws = []
    real = engine.runner._draw
    monkeypatch.setattr(engine.runner, "_draw", lambda *a: draws.append(1) or real(*a))
    res = engine.generate(PROMPTS[:2], max_tokens=MAX_TOKENS, temperature=1e-6)
    assert [r.token_ids for r in res] == greedy_reference[:2] and not draws
    assert engine.generate(PROMPTS[:1], max_tokens=2, temperature=0.5, seed=1)[0].token_ids and draws


@pytest.mark.slow  # CI time (two engines): test_drawing_after_the_step_equals_sampling_in_it checks the draw per filter
def test_the_engine_draws_as_the_sampler_inside_its_step(greedy_reference):
    """The engine's split sampling (a greedy step; the sampler call only when a row draws or asks
    for logprobs, searching the top-k and top-p cuts (``search_cuts``, the default), sorting only for top logprobs)
    gives the tokens and logprobs of the same engine sampling inside every step (the sort), over
    greedy (with drafts), seeded, top-k, top-p and logprobs requests in the same steps; nothing
    compiles while serving."""
    def engine(split: bool):
        e = _engine(speculative=2, drafter=_OracleDrafter(PROMPTS, greedy_reference))
        if not split:  # as on a mesh
            r = e.runner
            r.split_sampling, r._step = False, partial(_fed_step, r.cfg, r.lay, r.kernels, sample_rows=True)
        e.warmup()
        return e

    sp = partial(SamplingParams, max_tokens=MAX_TOKENS)
    workloads = [[sp(), sp(temperature=0.9, seed=1), sp(temperature=1.2, top_k=5, seed=2),  # no logprobs:
                  sp(temperature=0.7, top_p=0.6, seed=3)],  # the searched cuts
                 [sp(temperature=1.2, top_k=5, seed=2, logprobs=3), sp(logprobs=2)],  # the sort
                 [sp(temperature=0.9, seed=4, logprobs=0), sp(logprobs=0)]]  # logprobs 0: neither

    def run(e):
        out = []
        for sps in workloads:
            reqs = [e.submit(p, s) for p, s in zip(PROMPTS, sps)]
            while e.has_work():
                e.step()
            out += [(r.result.token_ids, r.result.logprobs) for r in reqs]
        return out

    split, inline = engine(True), engine(False)
    traced, modes, draw = draw_rows._cache_size(), set(), split.runner._draw
    split.runner._draw = lambda out, batch, filters: modes.add(filters) or draw(out, batch, filters)
    got = run(split)
    assert modes == {"none", "top_p", "top_k", "sort"}
    assert got == run(inline) and got[0][0] == greedy_reference[0]
    assert split.metrics["accepted_drafts"] > 0 and split.runner.compiles_while_serving == 0
    assert draw_rows._cache_size() == traced


def test_the_draw_sorts_for_top_logprobs_and_filters_unless_it_searches():
    sp = partial(SamplingParams, max_tokens=4)
    for search in (False, True):
        assert draw_filters([sp(), sp(temperature=0.5)], search) == "none"
        assert draw_filters([sp(top_k=5, top_p=0.5), sp(temperature=0.5)], search) == "none"  # a greedy row's
        assert draw_filters([sp(temperature=0.5, top_p=0.9), sp(logprobs=1)], search) == "sort"
        assert draw_filters([sp(temperature=0.5, logprobs=0)], search) == "none"
    assert draw_filters([sp(temperature=0.5, top_p=0.9), sp(temperature=0.5)], True) == "top_p"
    assert draw_filters([sp(temperature=0.5, top_p=0.9), sp(temperature=0.5, top_k=500)], True) == "top_k"
    assert draw_filters([sp(temperature=0.5, top_p=0.9), sp(temperature=0.5, top_k=500)], False) == "sort"


def test_abort_and_bad_requests(engine):
    r = engine.submit(PROMPTS[0], SamplingParams(max_tokens=30))
    engine.step()
    engine.abort(r)
    w = engine.submit(PROMPTS[1], SamplingParams(max_tokens=3))
    engine.abort(w)  # still waiting: completed at the next step wherever it is in the queue
    while engine.has_work():
        engine.step()
    assert r.result.finish_reason == w.result.finish_reason == "abort"
    assert engine.sched.pool.num_used == 0
    for prompt, sp in (([], SamplingParams()), ([300], SamplingParams()), ([1] * 120, SamplingParams(max_tokens=20))):
        with pytest.raises(RequestError):
            engine.submit(prompt, sp)
    with pytest.raises(ValueError, match="cannot hold one request"):
        _engine(num_pages=2)
    with pytest.raises(ValueError, match="must cover"):
        _engine(prefill_buckets=(32,))


def test_mixed_steps_pad_decode_rows_to_their_own_buckets():
    """By default a step that also prefills pads its decode rows to the largest decode bucket
    (fewer compilations); the buckets warm-up compiles are exactly those the engine can pick."""
    e = _engine(decode_buckets=(1, 4), prefill_buckets=(32, 64))
    r = e.runner
    assert r.bucket(1, 0) == (1, 0, 1) and r.bucket(2, 0) == (4, 0, 1) and r.bucket(0, 10) == (0, 32, 1)
    assert r.bucket(1, 10) == (4, 32, 1) and r.bucket(3, 40) == (4, 64, 1)
    assert sorted(r.bucket_keys()) == sorted([(1, 0, 1), (4, 0, 1), (0, 32, 1), (0, 64, 1), (4, 32, 1), (4, 64, 1)])
    every = _engine(decode_buckets=(1, 4), prefill_buckets=(32, 64), mixed_decode_buckets=(1, 4)).runner
    assert every.bucket(1, 10) == (1, 32, 1) and len(every.bucket_keys()) == 8
    picked = {r.bucket(nd, tp) for nd in range(5) for tp in range(65) if nd or tp}
    assert picked == set(r.bucket_keys())
    with pytest.raises(ValueError, match="largest mixed decode bucket"):
        _engine(decode_buckets=(1, 4), mixed_decode_buckets=(1,))
    with pytest.raises(ValueError, match="positive"):
        _engine(decode_buckets=(1, 4), mixed_decode_buckets=(0, 4))


# ---- the prefix cache on the device pool (hash block 16 tokens; a page is 12 hash blocks, as a
# 6144-token page of 512-token hash blocks in SERVING.md)
def _cached_engine(**kw):
    return _engine(prefix_cache=True, hash_tokens=16, page_tokens=192, max_len=256, num_pages=16, **kw)


def _run(e, prompts, max_tokens=MAX_TOKENS):
    return [(r.token_ids, r.num_cached_tokens) for r in e.generate(prompts, max_tokens=max_tokens)]


def test_prefix_hit_inside_a_page_resumes_at_the_hash_boundary(engine):
    """SERVING.md's example scaled down: a request whose first 87 tokens match a cached 90-token
    prompt hits at 80 = 5 x 16 inside a 192-token page (the partial page copied, the checkpoint
    at the prompt end's boundary read into its slot) and gives the tokens of an uncached run."""
    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, 90).tolist()
    b = a[:87] + rng.integers(0, 256, 30).tolist()
    want = _run(engine, [a, b])  # the module engine: no prefix cache
    e = _cached_engine()
    assert _run(e, [a]) == [want[0]]
    got = _run(e, [b])
    assert got[0][0] == want[1][0] and got[0][1] == 80
    assert _run(e, [a])[0] == (want[0][0], 80)  # the same prompt again: all but its last hash block
    e.sched.cache.check_invariants()
    assert e.sched.pool.num_used == e.sched.pool.num_evictable  # only cache entries remain


def test_checkpoints_inside_chunks_save_a_step_and_restore_like_the_uncached_run():
    """With ``checkpoint_stride`` (the hash block) a prompt's last chunk runs past its last hash
    boundary and the step takes that boundary's checkpoint inside the chunk: a 150-token prompt
    (64-token blocks) gets its first token in as many steps as without the cache (a chunk ending
    at 128 took one more). Prompts that arrive a step apart (prefill rows beside decode rows, one
    checkpoint inside a chunk, one after it, none) and then their resends and a prompt sharing
    140 tokens and one extending a prompt that ends on a boundary (restored at 128, 128 and 64) give the tokens and log-probabilities of the
    uncached runs."""
    rng = np.random.default_rng(7)
    a, c, d = (rng.integers(0, 256, n).tolist() for n in (150, 64, 30))
    b, e = a[:140] + rng.integers(0, 256, 30).tolist(), c + rng.integers(0, 256, 20).tolist()
    args = dict(hash_tokens=64, page_tokens=192, max_len=256, num_pages=24, token_budget=256, prefill_buckets=(256,))
    plain = _engine(**args)
    inside = _engine(prefix_cache=True, kernels=StepKernels(checkpoint_stride=64), **args)
    assert inside.sched.checkpoints_inside and not plain.sched.checkpoints_inside

    def run(eng, prompts):  # each submitted a step after the one before; steps until its first token
        todo, reqs, steps = list(prompts), [], []
        while todo or eng.has_work():
            if todo:
                reqs.append(eng.submit(todo.pop(0), SamplingParams(max_tokens=MAX_TOKENS, logprobs=0)))
                steps.append(0)
            steps = [n + (not r.out) for n, r in zip(steps, reqs)]
            eng.step()
        return [(n, r.result.token_ids, [lp for lp, _ in r.result.logprobs], r.result.num_cached_tokens)
                for n, r in zip(steps, reqs)]

    for prompts, cached in (([a], [0]), ([c, d, a], [0, 0, 128]), ([b, e], [128, 64])):
        want, got = run(plain, prompts), run(inside, prompts)
        assert [g[:2] for g in got] == [w[:2] for w in want] and [g[3] for g in got] == cached, (got, want)
        np.testing.assert_allclose([g[2] for g in got], [w[2] for w in want], atol=1e-5)
    inside.sched.cache.check_invariants()


def test_prefix_cache_on_off_and_in_one_step_give_the_same_tokens(engine):
    """Requests sharing prefixes, all in one step (nothing is matchable before the step that
    writes it has finished: rule 2), then again one by one (hits), under a small token budget:
    every output equals the run without the cache."""
    rng = np.random.default_rng(6)
    base = rng.integers(0, 256, 70).tolist()
    prompts = [base + rng.integers(0, 256, int(n)).tolist() for n in (1, 20, 45)] + [base[:40]]
    want = _run(engine, prompts)  # no prefix cache
    e = _cached_engine(token_budget=256, max_chunk=128, prefill_buckets=(256,), max_prefill_rows=4)
    together = _run(e, prompts)
    assert [t for t, _ in together] == [t for t, _ in want]
    assert all(c == 0 for _, c in together)  # submitted together: no hit on unlanded writes
    small = _cached_engine(token_budget=24, max_chunk=24, prefill_buckets=(32,))
    for p, (toks, _) in zip(prompts, want):
        got = _run(small, [p])
        assert got[0][0] == toks
    assert small.metrics["cached_tokens"] > 0
    small.sched.cache.check_invariants()


def test_logprobs_match_the_logits_and_failed_steps_free_everything(engine):
    res = engine.generate(PROMPTS[:2], max_tokens=3, logprobs=4)
    cfg, params = _model()
    logits, _ = forward(cfg, params, jnp.asarray(PROMPTS[0]), init_cache(cfg, 128))
    lp = jax.nn.log_softmax(logits[-1].astype(jnp.float32))
    first, top = res[0].logprobs[0]
    assert abs(first - float(lp[res[0].token_ids[0]])) < 1e-4
    assert [t for t, _ in top] == [int(t) for t in jnp.argsort(-lp)[:4]]
    assert len(res[1].logprobs) == 3 and engine.generate(PROMPTS[:1], max_tokens=1)[0].logprobs is None
    # A step that raises fails the requests in it; the engine frees their pages and serves on.
    r = engine.submit(PROMPTS[0], SamplingParams(max_tokens=4))
    engine.step()
    failed = engine.fail_running(RuntimeError("boom"))
    assert failed == [r] and r.result.finish_reason.startswith("error:") and "boom" in r.result.finish_reason
    assert engine.sched.pool.num_used == 0 and engine.stats()["running"] == 0
    assert engine.generate(PROMPTS[2:3], max_tokens=2)[0].finish_reason == "length"


def test_async_dispatch_runs_one_step_ahead(engine, greedy_reference):
    """Step N + 1 is dispatched (its decode row fed the token step N sampled, on the device) before
    step N's token is read back; the tokens equal the reference's."""
    r = engine.submit(PROMPTS[3], SamplingParams(max_tokens=MAX_TOKENS))
    engine.step()  # the prefill is dispatched, its token not read
    assert r.out == [] and r.pending == 1
    engine.step()  # the first decode is dispatched, then the prefill's token is read
    assert len(r.out) == 1 and r.pending == 1
    while engine.has_work():
        engine.step()
    assert r.result.token_ids == greedy_reference[3] and r.pending == 0


def test_a_request_preempted_with_its_token_in_flight_finishes_once():
    """With async dispatch, the request preempted here still has its last token on the device;
    when it lands it finishes the request (max_tokens 2), which must leave the queue for good."""
    prompts = np.random.default_rng(2).integers(0, 256, (4, 14)).tolist()
    e = _engine(page_tokens=16, num_pages=9)
    reqs = [e.submit(p, SamplingParams(max_tokens=mt)) for p, mt in zip(prompts, (10, 10, 10, 2))]
    for _ in range(60):
        if not e.has_work():
            break
        e.step()
    assert e.preemptions > 0 and not e.has_work() and e.sched.pool.num_used == 0
    assert [len(r.result.token_ids) for r in reqs] == [10, 10, 10, 2]


def test_prefix_cache_keeps_what_async_decode_and_exact_prompts_write():
    """Hash boundaries completed by decode rows (whose token was still on the device when they
    were planned) are cached for the next turn, and a prompt of whole hash blocks keeps the
    checkpoint before its last block for a resend."""
    a = np.random.default_rng(5).integers(0, 256, 20).tolist()
    e = _cached_engine()
    out = e.generate([a], max_tokens=30)[0].token_ids
    assert e.generate([a + out + [1, 2, 3]], max_tokens=2)[0].num_cached_tokens == 48
    b = np.random.default_rng(7).integers(0, 256, 32).tolist()
    first = _run(e, [b])
    assert _run(e, [b]) == [(first[0][0], 16)]


def test_request_ids_stay_unique_when_the_pool_is_lost(engine):
    reqs = [engine.submit(p, SamplingParams(max_tokens=3)) for p in PROMPTS]
    engine.step()
    engine.runner.pool.delete()  # as if the donated pool went with a failed step
    engine.fail_running(RuntimeError("boom"))
    more = [engine.submit(p, SamplingParams(max_tokens=3)) for p in PROMPTS[:2]]
    assert len({r.rid for r in reqs + more}) == len(reqs + more)
    while engine.has_work():
        engine.step()
    assert all(r.finished.is_set() for r in reqs + more) and engine.sched.pool.num_used == 0


class _OracleDrafter:
    """Drafts from known outputs: the true continuation, its third token wrong (so windows accept
    0 to 4 drafts)."""

    def __init__(self, prompts, outputs):
        self.known = [(p, o) for p, o in zip(prompts, outputs)]

    def propose(self, tokens, k):
        for p, o in self.known:
            if tokens[: len(p)] == p and len(tokens) - len(p) <= len(o):
                d = list(o[len(tokens) - len(p) : len(tokens) - len(p) + k])
                if len(d) >= 3 and len(tokens) % 2:
                    d[2] = (d[2] + 1) % 256
                return d
        return []


@pytest.mark.parametrize("cache", [pytest.param(False, marks=pytest.mark.slow), True])  # CI time: with the cache
def test_speculation_gives_the_same_tokens_to_the_end_of_max_len(cache, engine):
    """Drafts verified in decode windows (4 drafts: a 5-token window through the grouped MoE), by
    the n-gram drafter and by one that knows the answer: greedy outputs equal those without
    speculation, drafts are accepted, nothing compiles after warm-up, and requests whose windows
    reach the last positions of ``max_len`` end there (each row advances once per step; with the
    prefix cache no window reaches a hash boundary). Then, on the same engine, a drafter that is
    always wrong backs off (``spec_backoff``)."""
    rng = np.random.default_rng(8)
    prompts = [[5, 6, 7] * 10, rng.integers(0, 256, 99).tolist(), [9, 4] * 40, [3] * 20]
    max_tokens = [40, 29, 48, 60]  # up to 128 = max_len for the second and third
    kw = dict(prefix_cache=True, hash_tokens=16, page_tokens=64, num_pages=20) if cache else {}

    def run(e):
        reqs = [e.submit(p, SamplingParams(max_tokens=m)) for p, m in zip(prompts, max_tokens)]
        while e.has_work():
            e.step()
        assert all(r.result.finish_reason == "length" for r in reqs)
        assert e.sched.pool.num_used == e.sched.pool.num_evictable
        if e.sched.cache is not None:
            e.sched.cache.check_invariants()
        return [r.result.token_ids for r in reqs]

    want = run(engine)  # the module engine: no speculation, no prefix cache
    for drafter in (None, _OracleDrafter(prompts, want)):
        spec = _engine(speculative=4, drafter=drafter, **kw)
        spec.warmup()
        assert run(spec) == want
        assert spec.metrics["accepted_drafts"] > (100 if drafter else 0)
        assert spec.runner.compiles_while_serving == 0
    _check_backoff(spec, run, prompts, want)


class _WrongDrafter:
    """Proposes k tokens no greedy output has; records each request's proposal positions."""

    def __init__(self, prompts, outputs):
        self.known, self.at = [(p, o) for p, o in zip(prompts, outputs)], {}

    def propose(self, tokens, k):
        i = next(i for i, (p, _) in enumerate(self.known) if tokens[: len(p)] == p)
        self.at.setdefault(i, []).append(len(tokens))
        o = self.known[i][1][len(tokens) - len(self.known[i][0]):]
        return [(t + 1) % 256 for t in o[:k]]


def _check_backoff(e, run, prompts, want, backoff: int = 4):
    """A drafter that is always wrong: the tokens stay greedy and no draft is accepted; the
    ``m``-th miss in a row waits ``min(2^(m-1), spec_backoff)`` steps (each a token) before the
    next proposal (a hash boundary may hold it back longer, never less), so it proposes at under
    half of the decode steps (without back-off: at every one with room)."""
    wrong = _WrongDrafter(prompts, want)
    e.sched.drafter, e.sched.spec_backoff = wrong, backoff
    accepted = e.metrics["accepted_drafts"]
    assert run(e) == want and e.metrics["accepted_drafts"] == accepted
    for at in wrong.at.values():
        waits = [min(1 << m, backoff) for m in range(len(at) - 1)]
        assert all(b - a >= 1 + w for a, b, w in zip(at, at[1:], waits)), at
        if not e.sched.H:  # nothing else holds a proposal back
            assert [b - a for a, b in zip(at, at[1:])] == [1 + w for w in waits], at
    assert 0 < sum(map(len, wrong.at.values())) < sum(len(w) - 1 for w in want) / 2


@pytest.mark.slow  # the step on packed experts: tests/k3jax/test_mxfp4.py
def test_an_mxfp4_checkpoint_is_served_with_its_experts_packed():
    """A K3 checkpoint with MXFP4 experts: the engine keeps them packed on the device (4.25 bits
    a weight) and gives the greedy tokens of the same model loaded dequantised; so does the
    engine on an expert 2 mesh, which places the checkpoint one layer at a time."""
    path = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden", "k3_tiny_mxfp4")
    kw = dict(dtype=jnp.float32, max_running=2, max_len=64, token_budget=32, max_prefill_rows=1,
              decode_buckets=(2,), prefill_buckets=(32,), prefix_cache=False)
    packed = StepEngine(path, **kw)
    assert any(isinstance(x, MXFP4) for x in jax.tree.leaves(packed.runner.params, is_leaf=lambda x: isinstance(x, MXFP4)))
    dense = StepEngine(load_hf_checkpoint(path), **kw)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    want = [r.token_ids for r in dense.generate(prompts, max_tokens=5)]
    assert [r.token_ids for r in packed.generate(prompts, max_tokens=5)] == want
    # On a mesh the checkpoint is placed a layer at a time, the whole model never read at once
    reads = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(step_engine, "load_hf_checkpoint", None)  # not this path
        layer = step_engine.HFCheckpoint.layer
        mp.setattr(step_engine.HFCheckpoint, "layer", lambda self, i: (reads.append(i), layer(self, i))[1])
        sharded = StepEngine(path, mesh=step_mesh(1, 2), **kw)
    assert sorted(reads) == list(range(sharded.cfg.num_layers)) and sharded.runner.params["runs"]
    assert [r.token_ids for r in sharded.generate(prompts, max_tokens=5)] == want


@pytest.mark.slow  # CI time: the data-axis test serves on a tensor axis, the context-parallel one on an expert axis
def test_engine_on_a_mesh_gives_the_reference_tokens(greedy_reference):
    """The engine's step over 4 fake devices (tensor 2 x expert 2; the prefix cache on, async
    dispatch): the reference's greedy tokens, then the same prompts again served from the cache."""
    e = _cached_engine(mesh=step_mesh(2, 2))
    e.warmup()
    assert [t for t, _ in _run(e, PROMPTS)] == greedy_reference
    again = _run(e, PROMPTS)
    assert [t for t, _ in again] == greedy_reference and again[0][1] == 80
    assert e.runner.compiles_while_serving == 0
    assert len(e.runner.pool.sharding.device_set) == 4 and e.runner.pool.shape[0] == 2


@pytest.mark.slow  # CI time (25 s): the server's --data-parallel 2 test and the multi-host test serve on lanes too
def test_engine_with_a_data_axis_gives_the_reference_tokens(greedy_reference):
    """Data 2 x tensor 2: the prompts spread over two lanes (each its own batch, pages and
    scheduler, one step for both), the experts over all four devices; the reference's greedy
    tokens (speculating: drafts in decode windows, one window bucket for both lanes), then again
    from each lane's prefix cache."""
    e = _cached_engine(mesh=step_mesh(2, data=2), speculative=2, drafter=_OracleDrafter(PROMPTS, greedy_reference))
    assert e.runner.lanes == 2 and e.runner.pool.shape[:2] == (2, 2) and e.runner.last.shape[0] == 2
    e.warmup()
    reqs = [e.submit(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in PROMPTS]
    assert sorted(r.lane for r in reqs) == [0, 0, 1, 1]
    while e.has_work():
        e.step()
    assert [r.result.token_ids for r in reqs] == greedy_reference
    again = _run(e, PROMPTS)
    assert [t for t, _ in again] == greedy_reference and again[0][1] == 80
    # alone, the second prompt goes to the lane that cached it (lane 1), not the least busy (a tie: lane 0)
    r = e.submit(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS))
    while e.has_work():
        e.step()
    assert r.lane == 1 and r.result.token_ids == greedy_reference[1] and r.result.num_cached_tokens == 16
    assert e.runner.compiles_while_serving == 0 and e.stats()["running"] == 0 and e.metrics["accepted_drafts"] > 0


def test_engine_with_context_parallel_prefill_gives_the_reference_tokens(greedy_reference):
    """Tensor 1 x expert 2 with prefills of a 64-token bucket split over the expert axis (KCP):
    the 90-token prompt's second chunk continues KDA states and reads latents another device
    wrote; the reference's greedy tokens, then the same again from the prefix cache."""
    e = _cached_engine(mesh=step_mesh(1, 2), context_parallel_from=64)
    e.warmup()
    assert [t for t, _ in _run(e, PROMPTS)] == greedy_reference
    again = _run(e, PROMPTS)
    assert [t for t, _ in again] == greedy_reference and again[0][1] == 80
    assert e.runner.compiles_while_serving == 0
    with pytest.raises(ValueError, match="must split over the 2 devices"):
        _cached_engine(mesh=step_mesh(1, 2), context_parallel_from=1, prefill_buckets=(15, 64))
    with pytest.raises(ValueError, match="needs an 'expert' axis"):
        _cached_engine(mesh=step_mesh(2), context_parallel_from=64)


def test_gpu_default_kernels_decode_on_pages_and_pages_hold_whole_tiles():
    """On a GPU the engine's default kernels are the Pallas decode kernels on pages, the MXFP4
    matmul and the expanded prefill attention from 1024-token chunks in the fused kernel; with the paged MLA kernel every page holds whole kernel tiles (without the prefix
    cache the page size is otherwise a multiple of 16: 5840 tokens on the 48B shape failed the
    kernel on an H100)."""
    from pallas_kernels.mla.paged_decode import TILE
    cfg, _ = _model()
    gpu = step_engine.default_step_kernels(cfg, "gpu")
    assert gpu.mla_decode is not None and gpu.kda_decode is not None and gpu.mxfp4_matmul is not None
    assert gpu.expand_prefill_from == 1024 and gpu.mla_prefill is not None
    cpu = step_engine.default_step_kernels(cfg, "cpu")
    assert cpu.mla_decode is None and cpu.mxfp4_matmul is None and cpu.expand_prefill_from is None
    assert cpu.mla_prefill is None
    odd = dataclasses.replace(cfg, v_head_dim=24)  # not a Triton block: the expanded attention stays in XLA
    assert step_engine.default_step_kernels(odd, "gpu").mla_prefill is None
    paged = _engine(kernels=dataclasses.replace(StepKernels(), mla_decode=gpu.mla_decode), num_pages=None)
    plain = _engine(num_pages=None)
    assert paged.runner.lay.page_tokens % TILE == 0 and plain.runner.lay.page_tokens % TILE
