"""The engine on the serving step: greedy outputs equal to the reference forward across token
budgets, batch sizes and preemption; no compilation after warm-up; aborts; bad requests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.model import ModelConfig, forward, init_cache, init_params
from serving.engine import CONFIGS, RequestError, SamplingParams
from serving.step_engine import StepEngine

PROMPTS = [[5, 6, 7] * 30, [9] * 17, list(range(40, 100)), [200, 3, 77]]
MAX_TOKENS = 6


def _model():
    cfg = ModelConfig.from_json(f"{CONFIGS}/tiny.json")
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


def _engine(**kw):
    args = dict(dtype=jnp.float32, max_running=4, max_len=128, token_budget=64, max_prefill_rows=2,
                decode_buckets=(4,), prefill_buckets=(64,))
    return StepEngine(_model(), **{**args, **kw})


@pytest.fixture(scope="module")
def engine():
    e = _engine()
    e.warmup()
    return e


def test_greedy_equals_forward_and_nothing_compiles_after_warmup(engine, greedy_reference):
    res = engine.generate(PROMPTS, max_tokens=MAX_TOKENS)
    assert [r.token_ids for r in res] == greedy_reference
    assert all(r.finish_reason == "length" for r in res)
    one = engine.generate(PROMPTS[2:3], max_tokens=MAX_TOKENS)  # alone: the same tokens
    assert one[0].token_ids == greedy_reference[2]
    rng = np.random.default_rng(1)
    engine.generate([rng.integers(0, 256, int(n)).tolist() for n in rng.integers(1, 100, 6)], max_tokens=3)
    assert engine.runner.compiles_while_serving == 0
    assert engine.sched.pool.num_used == 0 and not engine.has_work()


@pytest.mark.parametrize("budget", [16, 256])
def test_token_budgets_give_the_same_tokens(budget, greedy_reference):
    e = _engine(token_budget=budget, max_chunk=min(budget, 64), prefill_buckets=(min(budget, 64) * 2,),
                max_len=128)
    assert [r.token_ids for r in e.generate(PROMPTS, max_tokens=MAX_TOKENS)] == greedy_reference


def test_preemption_recomputes_and_never_corrupts():
    """Four requests fill a pool of nine 16-token pages at admission; crossing their second page
    preempts the later ones, whose tokens are recomputed: the outputs equal an unpressed run."""
    prompts = np.random.default_rng(2).integers(0, 256, (4, 14)).tolist()
    want = _engine(page_tokens=16).generate(prompts, max_tokens=10)
    tight = _engine(page_tokens=16, num_pages=9)
    got = tight.generate(prompts, max_tokens=10)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert tight.preemptions > 0 and tight.sched.pool.num_used == 0


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
