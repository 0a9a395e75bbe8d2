"""The step's sampler alone (:func:`k3jax.model.step.sample`) against the sampler it replaced,
which sorted each row twice (a sort of the tempered logits for top-k / top-p, and
``jax.lax.top_k`` for the top logprobs, which XLA's GPU backend runs as a second full sort for
k > 16); and, without top logprobs, the sort against the searched cuts (``filters="top_p"`` and
``"top_k"``, no sort) and a draw with no filters. Device time per call from the profiler (and
wall time), Kimi's vocabulary (163,840), rows of mixed sampling parameters and chat rows
(temperature 0.7, top_p 0.9).

Run on the GPU: ``PYTHONPATH=$PWD python3 -m benchmarks.sampler --rows 64,256`` (writes
``$OUT/sampler.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp

from benchmarks.common import device_seconds, time_jax, write_json
from k3jax.model.step import StepBatch, filter_logits, sample


def sample_two_sorts(logits, batch, positions, num_logprobs):
    """The sampler before one sort served both the filters and the top logprobs."""
    V = logits.shape[-1]
    greedy = batch.temperature <= 0
    x = logits / jnp.where(greedy, 1.0, batch.temperature)[:, None]
    x = filter_logits(x, jnp.sort(x, axis=-1)[:, ::-1], batch.top_k, batch.top_p)
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s.astype(jnp.uint32)), t))(batch.seed, positions)
    drawn = jnp.argmax(x + jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys), axis=-1)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    lp = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(lp, num_logprobs)
    return tokens, jnp.take_along_axis(lp, tokens[:, None], axis=1)[:, 0], top_ids, top_lp


def mixed_rows(R: int, key) -> StepBatch:
    """Sampling parameters of ``R`` rows: greedy, hot, top-k, top-p and both, in turn."""
    k = jax.random.split(key, 3)
    i = jnp.arange(R)
    return StepBatch(*[None] * 10, temperature=jnp.where(i % 4 == 0, 0.0, jax.random.uniform(k[0], (R,), minval=0.3, maxval=2.0)),
                     top_k=jnp.where(i % 3 == 0, 0, jax.random.randint(k[1], (R,), 1, 40)),
                     top_p=jnp.where(i % 2 == 0, 1.0, jax.random.uniform(k[2], (R,), minval=0.05, maxval=0.99)),
                     seed=i.astype(jnp.int32))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--logprobs", type=int, default=20)
    a = ap.parse_args()
    rows = []
    for R in map(int, a.rows.split(",")):
        key = jax.random.key(R)
        logits = jax.random.normal(key, (R, a.vocab), jnp.float32) * 4
        batch, pos = mixed_rows(R, key), jnp.arange(R, dtype=jnp.int32)
        row = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "rows": R,
               "vocab": a.vocab, "logprobs": a.logprobs}
        for name, f in (("one_sort", sample), ("two_sorts", sample_two_sorts)):
            step = jax.jit(f, static_argnums=3)
            row[f"{name}_ms"] = device_seconds(lambda: step(logits, batch, pos, a.logprobs)) * 1e3
        # Without top logprobs: chat rows (temperature 0.7, top_p 0.9) and the mixed rows, by the
        # sort, the searched cuts, and (the floor) a draw with no filters.
        chat = batch._replace(temperature=jnp.full((R,), 0.7), top_k=jnp.zeros((R,), jnp.int32),
                              top_p=jnp.full((R,), 0.9))
        step = jax.jit(sample, static_argnums=(3, 4))
        for name, b, cuts in (("chat", chat, "top_p"), ("mixed", batch, "top_k")):
            for filters in ("sort", cuts, "none"):  # device time, and wall time
                row[f"{name}_{filters}_ms"] = device_seconds(lambda: step(logits, b, pos, 0, filters)) * 1e3
                row[f"{name}_{filters}_wall_ms"] = time_jax(lambda *x: step(*x, 0, filters), [(logits, b, pos)]) * 1e3
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_json(rows, "sampler.json")


if __name__ == "__main__":
    main()
