"""The serving step against the reference forward: ragged batches mixing prefill chunks, decode
rows and idle rows on the unified page pool; pages shared between rows; MoE; sampling; errors."""

import json
import math
import os
import re
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.model import ModelConfig, init_params, load_hf_checkpoint, logits
from k3jax.model.pool import PoolLayout, read_kda, read_latents, write_kda, write_latents
from k3jax.model.model import route
from k3jax.model.step import (Row, StepBatch, StepKernels, filter_logits, implementations_for_widths, jit_step,
                              layer_runs, moe, pack_batch, prepare_params, sample, select_cuts, stack_layers)
from pallas_kernels.kda.decode_pages import kda_decode_pages
from pallas_kernels.mla import paged_mla_decode
from pallas_kernels.mla.prefill_flash import attend_tile
from tests.helpers import rel_rms

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden")
BUCKET = dict(num_decode=4, num_tokens=48, num_rows=7, max_blocks=3)
# the Pallas decode kernels on pages (interpreted): MLA attention and the KDA state step
PAGED = StepKernels(mla_decode=partial(paged_mla_decode, tile=16, interpret=True),
                    kda_decode=partial(kda_decode_pages, interpret=True))
PAGED_TPU = StepKernels(mla_decode=partial(paged_mla_decode, interpret=True, backend="tpu"),
                        kda_decode=partial(kda_decode_pages, interpret=True, backend="tpu"))


# tiny with 7 layers: layers 1-3 and 4-6 are one period (KDA, MLA, KDA; MoE) twice
SEVEN_LAYERS = dict(num_hidden_layers=7, layer_types=["linear_attention", "linear_attention", "full_attention"] * 2
                    + ["linear_attention"], mlp_layer_types=["dense"] + ["sparse"] * 6)


def _tiny(config="configs/tiny.json", **over):
    with open(config) as f:
        d = json.load(f)
    d.update(over)
    cfg = ModelConfig.from_hf_dict(d)
    return cfg, init_params(cfg, jax.random.key(3))


class Runner:
    """Feeds known sequences through the step chunk by chunk (teacher forcing) and keeps the
    logits of each row's last token."""

    def __init__(self, cfg, params, dtype, page_tokens=16, num_pages=24, scan=False, kernels=StepKernels()):
        self.cfg, self.kernels = cfg, kernels
        self.lay = PoolLayout.for_model(cfg, page_tokens=page_tokens, latent_dtype=dtype)
        self.params = prepare_params(cfg, params, dtype)
        if scan:
            self.params = stack_layers(cfg, self.params)
        self.pool = self.lay.allocate(num_pages)
        self.N = num_pages

    def run(self, decode, prefill, window=1):
        out = self.step(decode, prefill, window)
        nd = BUCKET["num_decode"]
        rows = list(range(len(decode))) + [nd + i for i in range(len(prefill))]
        return np.asarray(out.logits)[rows], np.asarray(out.tokens)[rows]

    def step(self, decode, prefill, window=1):
        batch = pack_batch(self.lay, decode, prefill, num_pages=self.N, window=window, **BUCKET)
        out, self.pool = jit_step(self.cfg, self.lay, self.kernels, BUCKET["num_decode"], self.params, self.pool,
                                  batch, window=window, return_logits=True)
        return out


def _seqs(cfg, lens, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]


def _schedule(runner, seqs):
    """Three steps over sequences A (40 tokens), B (24), C (6) and D (A's first 16 + its own):
    step 1 prefills A[:16] (checkpoint page 20) and B[:23]; step 2 decodes B, prefills A[16:40],
    C and D from A's checkpoint with A's first page shared; step 3 decodes A, C, D (one idle
    decode row). Returns ``[(seq, position, logits)]``."""
    A, B, C, D = seqs
    pa, pb, pc, pd = [0, 1, 2], [3, 4], [5], [0, 6]
    got = []
    lg, _ = runner.run([], [Row(A[:16], 0, pa, slot=10, checkpoint=20), Row(B[:23], 0, pb, slot=11)])
    got += [(0, 15, lg[0]), (1, 22, lg[1])]
    lg, _ = runner.run([Row(B[23:24], 23, pb, slot=11)],
                       [Row(A[16:40], 16, pa, slot=10), Row(C[:5], 0, pc, slot=12),
                        Row(D[16:28], 16, pd, slot=13, src=20)])
    got += [(1, 23, lg[0]), (0, 39, lg[1]), (2, 4, lg[2]), (3, 27, lg[3])]
    lg, _ = runner.run([Row(A[40:41], 40, pa, slot=10), Row(C[5:6], 5, pc, slot=12), Row(D[28:29], 28, pd, slot=13)],
                       [])
    got += [(0, 40, lg[0]), (2, 5, lg[1]), (3, 28, lg[2])]
    return got


def _seqs_with_shared_prefix(cfg):
    """Four sequences of 41 tokens (the schedule uses prefixes of them), D sharing A's first 16."""
    A, B, C, D = _seqs(cfg, [41] * 4)
    return [A, B, C, A[:16] + D[16:]]


def _reference(cfg, params, seqs):
    """Reference logits of each sequence (one compilation: all have the same length)."""
    run = jax.jit(lambda ids: logits(cfg, params, ids))
    return [np.asarray(run(jnp.asarray(s))) for s in seqs]


EXPANDED = StepKernels(expand_prefill_from=1)  # every prefill chunk attends over expanded keys and values
FLASH_CALLS = []


def _counted_flash(*args, **kw):
    FLASH_CALLS.append(kw["block_q"])
    return attend_tile(*args, **kw)


@pytest.mark.parametrize("config,scan,kernels", [
    ("configs/tiny.json", False, replace(EXPANDED, mla_prefill=_counted_flash)),  # the XLA form: the K3 case
    pytest.param("configs/tiny_k3.json", False, StepKernels(), marks=pytest.mark.slow),  # scanned K3 below
    ("seven_layers", True, StepKernels()), ("configs/tiny_k3.json", True, replace(PAGED, expand_prefill_from=1)),
    pytest.param("configs/tiny.json", False, PAGED_TPU, marks=pytest.mark.slow)])
def test_step_matches_forward_float32(config, scan, kernels):
    """The step's logits equal the reference forward's, unrolled and scanned, with the Pallas
    decode kernels on pages (GPU and TPU versions, interpreted) or the gathered attention and
    states, and with the prefill chunks over latents (absorbed) or expanded keys and values (in
    XLA or in the fused kernel, interpreted)."""
    cfg, params = _tiny(**SEVEN_LAYERS) if config == "seven_layers" else _tiny(config)
    seqs = _seqs_with_shared_prefix(cfg)
    ref = _reference(cfg, params, seqs)
    runner = Runner(cfg, params, jnp.float32, scan=scan, kernels=kernels)
    assert not scan or runner.params["runs"], "the scanned case must scan"
    page0 = np.asarray(runner.pool[0])
    for seq, pos, lg in _schedule(runner, seqs):
        assert rel_rms(lg, ref[seq][pos]) < 1e-5, (seq, pos)
        assert np.argmax(lg) == np.argmax(ref[seq][pos])
    # A's first page (shared with D) held A's latents after step 1; D never wrote it.
    assert not np.array_equal(page0, np.asarray(runner.pool[0]))
    if kernels.mla_prefill:  # the fused attention ran, in blocks of 16 (the block table's 48 tokens)
        assert FLASH_CALLS and set(FLASH_CALLS) == {16}


def test_stacking_writes_each_layer_into_the_stack_in_place():
    """stack_layers' writes reuse the stack's buffers (an eager copy per layer would hold two
    stacks at once: the 48B model would not fit an H200 while stacking)."""
    from k3jax.model.step import _set_layer_in_place
    stack = {"w": jnp.zeros((3, 4, 8), jnp.bfloat16)}
    where = stack["w"].unsafe_buffer_pointer()
    out = _set_layer_in_place(stack, 1, {"w": jnp.ones((4, 8), jnp.bfloat16)})
    assert stack["w"].is_deleted() and out["w"].unsafe_buffer_pointer() == where
    np.testing.assert_array_equal(np.asarray(out["w"], np.float32).sum(axis=(1, 2)), [0, 32, 0])


def test_layer_runs_find_the_repeating_period():
    cfg, _ = _tiny(**SEVEN_LAYERS)
    assert layer_runs(cfg) == ((1, 3, 2),)
    big = ModelConfig.from_json("configs/kimi_linear_48b_a3b.json")
    runs = layer_runs(big)
    kinds = list(zip(big.layer_types, big.mlp_types))
    covered = set()
    for s, P, c in runs:  # each run is c copies of its first period, over layers no other run covers
        assert c >= 2 and all(kinds[s + n * P + j] == kinds[s + j] for n in range(c) for j in range(P))
        assert covered.isdisjoint(range(s, s + P * c))
        covered |= set(range(s, s + P * c))
    assert len(covered) >= 20  # 24 of its 27 layers: one compiled period of 4 instead of 24 layers
    assert layer_runs(_tiny("configs/tiny_k3.json")[0]) == ((1, 2, 2),)  # Block AttnRes too


def _pool_index_maps(text: str, pool_size: int) -> list[list[int]]:
    """The start-index maps of the gathers and scatters in StableHLO ``text`` whose operand has
    ``pool_size`` elements (the pool or a reshape of it)."""
    maps = []
    for m in re.finditer(r"(start_index_map|scatter_dims_to_operand_dims) = \[([0-9, ]*)\]", text):
        operand = re.search(r": \(tensor<([0-9x]+)x[a-z]", text[m.end():])
        if math.prod(int(d) for d in operand.group(1).split("x")) == pool_size:
            maps.append([int(d) for d in m.group(2).split(",")])
    return maps


@pytest.mark.parametrize("kernels", [StepKernels(), PAGED])
def test_pool_is_indexed_by_its_leading_dims(kernels):
    """Every gather and scatter on the pool indexes its leading dims in order: XLA's GPU gather
    and scatter simplifiers transpose an operand indexed otherwise, a copy of the whole pool (seen
    on the H100: a prefill bucket held two)."""
    cfg, params = _tiny()
    lay = PoolLayout.for_model(cfg, page_tokens=16, latent_dtype=jnp.bfloat16)
    pool = lay.allocate(24)
    batch = pack_batch(lay, [Row([3], 5, [1], slot=2)], [Row([4] * 20, 0, [3, 4], slot=5, checkpoint=6)], **BUCKET,
                       num_pages=24)
    text = jit_step.lower(cfg, lay, kernels, 4, prepare_params(cfg, params, jnp.bfloat16), pool, batch).as_text()
    maps = _pool_index_maps(text, pool.size)
    assert len(maps) >= 6  # the state, conv and latent reads and writes, the page copy
    assert all(m == list(range(len(m))) for m in maps), maps


def test_scanned_step_writes_the_pool_as_the_unrolled_one():
    cfg, params = _tiny(**SEVEN_LAYERS)
    seqs = _seqs_with_shared_prefix(cfg)
    flat, scanned = Runner(cfg, params, jnp.float32), Runner(cfg, params, jnp.float32, scan=True)
    for a, b in zip(_schedule(flat, seqs), _schedule(scanned, seqs)):
        np.testing.assert_allclose(a[2], b[2], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(flat.pool).view(np.float32), np.asarray(scanned.pool).view(np.float32),
                               rtol=1e-6, atol=1e-6, equal_nan=True)


def test_shared_page_is_not_written_by_the_sharing_row():
    cfg, params = _tiny()
    A, B, C, D = _seqs_with_shared_prefix(cfg)
    runner = Runner(cfg, params, jnp.float32)
    runner.run([], [Row(A[:16], 0, [0, 1, 2], slot=10, checkpoint=20)])
    before = np.asarray(runner.pool[0])
    runner.run([], [Row(D[16:28], 16, [0, 6], slot=13, src=20)])
    np.testing.assert_array_equal(np.asarray(runner.pool[0]), before)


def test_step_bf16_close_to_forward():
    cfg, params = _tiny()
    seqs = _seqs_with_shared_prefix(cfg)
    ref = _reference(cfg, params, seqs)
    for seq, pos, lg in _schedule(Runner(cfg, params, jnp.bfloat16), seqs):
        assert rel_rms(lg, ref[seq][pos]) < 3e-2, (seq, pos)


def test_bf16_step_ignores_what_other_pages_hold():
    """A request whose KDA state lives in page 0 (the first page the allocator hands out): the
    other rows' unused block-table entries read page 0 as latents. bf16 views of its floats hold
    NaNs, which must not reach any output."""
    cfg, params = _tiny()
    A, B = _seqs(cfg, [41, 24], seed=4)
    runner = Runner(cfg, params, jnp.bfloat16)
    lg, _ = runner.run([], [Row(A[:20], 0, [1, 2], slot=0), Row(B[:10], 0, [3], slot=4)])
    assert np.all(np.isfinite(lg))
    lg, _ = runner.run([Row(A[20:21], 20, [1, 2], slot=0), Row(B[10:11], 10, [3], slot=4)], [])
    assert np.all(np.isfinite(lg))


@pytest.mark.parametrize("case", ["moe_hf_form", pytest.param("original_form_sharded", marks=pytest.mark.slow)])
def test_step_on_golden_checkpoints(case):
    cfg, params = load_hf_checkpoint(os.path.join(GOLDEN, case))
    ids = np.load(os.path.join(GOLDEN, case, "golden.npz"))["token_ids"].tolist()
    ref = np.asarray(logits(cfg, params, jnp.asarray(ids)))
    runner = Runner(cfg, params, jnp.float32, page_tokens=16, num_pages=8)
    n = len(ids)
    half = n // 2
    lg, _ = runner.run([], [Row(ids[:half], 0, [0, 1, 2], slot=5)])
    assert rel_rms(lg[0], ref[half - 1]) < 1e-5
    for t in range(half, n):
        lg, tok = runner.run([Row(ids[t : t + 1], t, [0, 1, 2], slot=5)], [])
        assert rel_rms(lg[0], ref[t]) < 1e-5
        assert tok[0] == np.argmax(ref[t])


def test_mosaic_ragged_dot_only_for_whole_tiles():
    """tokamax's Mosaic GPU ragged_dot only where both widths are whole tiles (the tiny K3's
    48-wide latent failed to lower on an H100); its XLA one otherwise."""
    impls = ("mosaic", "triton", "xla")
    assert implementations_for_widths(impls, 64, 32) == impls and implementations_for_widths(None, 48, 48) is None
    assert implementations_for_widths(impls, 48, 64) == implementations_for_widths(impls, 64, 48) == ("xla",)
    assert implementations_for_widths(("mosaic",), 48, 64) == ()


@pytest.mark.parametrize("T", [1, 37])
def test_grouped_moe_matches_per_token_experts(T):
    cfg, params = _tiny()
    p = prepare_params(cfg, params, jnp.float32)["layers"][1]["mlp"]
    x = jax.random.normal(jax.random.key(T), (T, cfg.hidden_size), jnp.float32)
    got = moe(cfg, StepKernels(), p, x)
    w, idx = route(cfg, p, x)
    hp = jax.lax.Precision.HIGHEST
    want = np.zeros((T, cfg.hidden_size), np.float32)
    I = cfg.moe_intermediate_size
    for t in range(T):
        for j in range(cfg.num_experts_per_tok):
            e = int(idx[t, j])
            h = jnp.dot(x[t], p["gate_up"][e], precision=hp)
            want[t] += float(w[t, j]) * np.asarray(jnp.dot(jax.nn.silu(h[:I]) * h[I:], p["down"][e], precision=hp))
    sh = p["shared"]
    want += np.asarray(jnp.dot(jax.nn.silu(jnp.dot(x, sh["gate"].T, precision=hp)) * jnp.dot(x, sh["up"].T, precision=hp),
                               sh["down"].T, precision=hp))
    assert rel_rms(got, want) < 1e-5


def _sampling_batch(R, temperature=0.0, top_k=0, top_p=1.0, seed=0):
    z = lambda v, dt: jnp.full((R,), v, dt)
    return StepBatch(*[None] * 10, z(temperature, jnp.float32), z(top_k, jnp.int32), z(top_p, jnp.float32),
                     jnp.arange(R, dtype=jnp.int32) + seed)


def test_sampling_filters_and_seeds():
    R, V = 8, 50
    lg = jax.random.normal(jax.random.key(0), (R, V), jnp.float32) * 3
    pos = jnp.arange(R, dtype=jnp.int32)
    greedy = np.argmax(np.asarray(lg), axis=-1)
    for kw in (dict(), dict(temperature=1.0, top_k=1), dict(temperature=1.0, top_p=1e-6)):
        tok, *_ = sample(lg, _sampling_batch(R, **kw), pos)
        np.testing.assert_array_equal(np.asarray(tok), greedy)
    a, *_ = sample(lg, _sampling_batch(R, temperature=1.0, seed=5), pos)
    b, *_ = sample(lg, _sampling_batch(R, temperature=1.0, seed=5), pos)
    c, *_ = sample(lg, _sampling_batch(R, temperature=1.0, seed=6), pos + 1)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    tok, *_ = sample(lg, _sampling_batch(R, temperature=1.0, top_k=3), pos)
    top3 = np.argsort(-np.asarray(lg), axis=-1)[:, :3]
    assert all(int(t) in top3[r] for r, t in enumerate(np.asarray(tok)))
    # Mixed rows: greedy rows give the argmax, top-k 1 rows too, unfiltered hot rows draw outside it.
    hot = jnp.arange(R) % 2 == 1
    mixed = _sampling_batch(R, temperature=1.0, seed=3)
    mixed = mixed._replace(temperature=jnp.where(hot, 50.0, 0.0), top_k=jnp.where(hot, 0, 5))
    draws = np.stack([np.asarray(jax.jit(sample)(lg, mixed, pos + i)[0]) for i in range(4)])
    assert (draws[:, ~hot] == greedy[~hot]).all() and (draws[:, hot] != greedy[hot]).any()
    tok, *_ = sample(lg, mixed._replace(top_k=jnp.where(hot, 1, 0)), pos)
    np.testing.assert_array_equal(np.asarray(tok), greedy)


def test_one_sort_samples_as_two_did():
    """Bit for bit against the sampler that sorted twice (:mod:`benchmarks.sampler`), over rows of
    every kind (greedy, hot, top-k, top-p, both) and logits with ties (rounded to quarters):
    tokens, their logprobs, the top ids and their logprobs. (Logits one rounding apart whose
    log-probabilities round equal may rank differently: see :func:`sample`.)"""
    from benchmarks.sampler import mixed_rows, sample_two_sorts

    R, V, n = 12, 300, 20
    k = jax.random.split(jax.random.key(int(np.random.default_rng().integers(2**31))), 3)
    lg = jnp.round(jax.random.normal(k[0], (R, V)) * 12) / 4
    batch, pos = mixed_rows(R, k[1]), jax.random.randint(k[2], (R,), 0, 1000)
    got = jax.jit(sample, static_argnums=3)(lg, batch, pos, n)
    want = jax.jit(sample_two_sorts, static_argnums=3)(lg, batch, pos, n)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("seed,scale,ties", [(0, 0.5, False), (1, 4.0, True), (2, 12.0, False)])
def test_searched_cuts_draw_the_tokens_of_the_sort(seed, scale, ties):
    """``filters="top_k"`` and ``"top_p"`` (cuts searched, no sort) against ``"sort"`` on random
    logits, flat to peaked and with ties (rounded to quarters, signed zeros included): the same
    tokens and logprobs over greedy, hot, top-k (any k), top-p and both; the same filtered logits
    as :func:`filter_logits`, -inf included. (Fixed seeds: the two sum the top-p mass in
    different orders, so a row whose mass lands within a rounding of ``top_p`` may keep one
    token more or less; the test below bounds that.)"""
    from benchmarks.sampler import mixed_rows

    R, V = 48, 2000
    k = jax.random.split(jax.random.key(seed), 4)
    lg = jax.random.normal(k[0], (R, V)) * scale
    lg = jnp.round(lg * 4) / 4 if ties else lg
    lg = lg.at[:, :3].set(jnp.asarray([-0.0, 0.0, -jnp.inf]))
    batch = mixed_rows(R, k[1])
    batch = batch._replace(top_k=jnp.where(jnp.arange(R) % 5 == 0, V + 7, batch.top_k))  # some k past the vocabulary
    pos = jax.random.randint(k[2], (R,), 0, 1000)
    f = jax.jit(sample, static_argnums=(3, 4))
    want = f(lg, batch, pos, 0, "sort")
    for g, w in zip(f(lg, batch, pos, 0, "top_k"), want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    no_k = batch._replace(top_k=jnp.zeros((R,), jnp.int32))
    for g, w in zip(f(lg, no_k, pos, 0, "top_p"), f(lg, no_k, pos, 0, "sort")):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    x = lg / batch.temperature.clip(0.1)[:, None]
    np.testing.assert_array_equal(np.asarray(jax.jit(select_cuts)(x, batch.top_k, batch.top_p)),
                                  np.asarray(filter_logits(x, -jnp.sort(-x, axis=-1), batch.top_k, batch.top_p)))
    with pytest.raises(ValueError, match="top logprobs need the sort"):
        sample(lg, batch, pos, 2, "top_k")


def test_searched_cuts_at_kimi_vocabulary_and_at_the_edges():
    """At Kimi's vocabulary (163,840) the searched top-p set is within one token of the exact
    one (float64, sorted) in every row, as the sort's is; ties at the k-th value are kept, a
    value one rounding below it is not, signed zeros are one value and come back unchanged, and
    a top_p that rounds to 0 keeps the largest value."""
    R, V = 4, 163840
    x = jax.random.normal(jax.random.key(3), (R, V)) * 0.5
    top_p, top_k = jnp.asarray([0.9, 0.5, 0.99, 0.3]), jnp.zeros((R,), jnp.int32)
    xd = np.asarray(x, np.float64)
    p = np.exp(xd - xd.max(1, keepdims=True))
    ps = -np.sort(-p / p.sum(1, keepdims=True), axis=1)
    exact = (np.cumsum(ps, 1) - ps < np.asarray(top_p, np.float64)[:, None]).sum(1)
    for kept in (select_cuts(x, top_k, top_p), filter_logits(x, -jnp.sort(-x, axis=-1), top_k, top_p)):
        assert np.abs(np.isfinite(np.asarray(kept)).sum(1) - exact).max() <= 1

    below = float(np.nextafter(np.float32(0.5), np.float32(0)))
    ulps = np.float32(1) + np.float32(2**-23) * np.arange(4, dtype=np.float32)  # 1.0 and the next 3 floats: the
    x = jnp.asarray([[1.0, 0.0, -0.0, -1.0], [1.0, 0.5, below, -1.0], [3.0, 2.0, 1.0, 0.0],  # last key bits
                     [ulps[3], ulps[2], 0.0, -1.0]], jnp.float32)
    top_k, top_p = jnp.asarray([2, 2, 0, 1]), jnp.asarray([1.0, 1.0, 1e-50, 1.0])  # 1e-50: 0.0 in float32
    got = select_cuts(x, top_k, top_p)
    want = jnp.where(jnp.asarray([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]], bool), x, -jnp.inf)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(filter_logits(x, -jnp.sort(-x, axis=-1), top_k, top_p)), want)


def test_sampled_distribution_matches_softmax():
    V, n = 6, 4000
    lg = jnp.asarray([[1.0, 0.5, 0.0, -0.5, 2.0, -3.0]], jnp.float32)
    draw = jax.jit(jax.vmap(lambda s: sample(lg, _sampling_batch(1, temperature=0.7, seed=s), jnp.zeros(1, jnp.int32))[0][0]))
    counts = np.bincount(np.asarray(draw(jnp.arange(n, dtype=jnp.int32))), minlength=V) / n
    want = np.asarray(jax.nn.softmax(lg[0] / 0.7))
    assert np.abs(counts - want).max() < 0.03, (counts, want)


def test_logprobs_are_of_the_distribution():
    lg = jax.random.normal(jax.random.key(1), (3, 20), jnp.float32)
    tok, lp, ids, top = sample(lg, _sampling_batch(3), jnp.zeros(3, jnp.int32), num_logprobs=4)
    ref = np.asarray(jax.nn.log_softmax(lg, axis=-1))
    np.testing.assert_allclose(np.asarray(lp), ref[np.arange(3), np.asarray(tok)], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(top), np.sort(ref, axis=-1)[:, ::-1][:, :4], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(ids)[:, 0], np.asarray(tok))


def test_pool_views_roundtrip_and_are_disjoint():
    cfg, _ = _tiny()
    lay = PoolLayout.for_model(cfg, token_multiple=8)
    assert lay.page_tokens * lay.n_mla * lay.row_words <= lay.page_words >= lay.kda_words
    pool = lay.allocate(4)
    k = jax.random.split(jax.random.key(0), 3)
    st = jax.random.normal(k[0], (2, lay.HV, lay.K, lay.V), jnp.float32)
    cv = jax.random.normal(k[1], (2, lay.W - 1, 3 * lay.HV * lay.K), jnp.float32)
    lat = jax.random.normal(k[2], (5, lay.latent), jnp.float32).astype(jnp.bfloat16)
    pool = write_kda(lay, pool, jnp.asarray([1, -1], jnp.int32), 2, st, cv)
    s2, c2 = read_kda(lay, pool, jnp.asarray([1, 0], jnp.int32), 2)
    np.testing.assert_array_equal(np.asarray(s2[0]), np.asarray(st[0]))
    np.testing.assert_array_equal(np.asarray(c2[0]), np.asarray(cv[0]))
    assert not np.any(np.asarray(pool[0])) and not np.any(np.asarray(pool[2:]))  # -1 wrote nothing
    pool = write_latents(lay, pool, 0, jnp.asarray([2, 2, 2, 3, -1], jnp.int32), jnp.asarray([0, 1, 5, 0, 0], jnp.int32), lat)
    n = lay.page_tokens + 1
    got = read_latents(lay, pool, 0, jnp.asarray([[2, 3]], jnp.int32), n, jnp.asarray([n], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got[0, [0, 1, 5, lay.page_tokens]]), np.asarray(lat[:4]))
    # past the context or the block table: zeros, whatever the page holds (here a KDA state)
    kda_page = jnp.asarray([[1, -1]], jnp.int32)
    assert np.any(np.asarray(read_latents(lay, pool, 0, kda_page, n, jnp.asarray([n], jnp.int32)), np.float32))
    got = read_latents(lay, pool, 0, kda_page, n, jnp.asarray([3], jnp.int32))
    assert not np.any(np.asarray(got[0, 3:], np.float32))
    s3, _ = read_kda(lay, pool, jnp.asarray([1], jnp.int32), 2)
    np.testing.assert_array_equal(np.asarray(s3[0]), np.asarray(st[0]))  # latents in other pages


def test_bad_batches_raise():
    cfg, _ = _tiny()
    lay = PoolLayout.for_model(cfg, page_tokens=16)
    pack = lambda d, p: pack_batch(lay, d, p, num_pages=8, **BUCKET)
    with pytest.raises(ValueError, match="exceeds its block table"):
        pack([], [Row(list(range(20)), 0, [0], slot=1)])
    with pytest.raises(ValueError, match="outside"):
        pack([], [Row([1, 2], 0, [0], slot=8)])
    with pytest.raises(ValueError, match="exceed the bucket"):
        pack([], [Row([1] * 30, 0, [0, 1], slot=1), Row([1] * 30, 0, [2, 3], slot=2)])
    with pytest.raises(ValueError, match="decode rows"):
        pack([Row([1], 3, [0], slot=1)] * 5, [])
    for rows in ([], [Row([1] * 8, 0, [0], slot=1, checkpoint_at=4)]), ([], [Row([1] * 8, 0, [0], slot=1, checkpoint=2,
                                                                               checkpoint_at=8)]), \
                ([Row([1], 3, [0], slot=1, checkpoint=2, checkpoint_at=1)], []):
        with pytest.raises(ValueError, match="checkpoint_at"):  # no checkpoint page, past the row, a decode row
            pack(*rows)
    assert pack([], [Row([1] * 8, 0, [0], slot=1, checkpoint=2, checkpoint_at=4)]).checkpoint_at.max() == 4


@pytest.mark.parametrize("seven,kernels", [  # the scanned XLA case is slow (CI time): the paged one scans too
    (False, StepKernels()), pytest.param(True, StepKernels(), marks=pytest.mark.slow), (True, PAGED)])
def test_speculative_windows_commit_the_accepted_prefix(seven, kernels):
    """Decode rows with draft windows beside a plain decode row, a sampled row and a prefill chunk:
    each row accepts its drafts up to the first that differs from the greedy token, emits those
    plus one, and leaves its state as if it had decoded them one at a time; the next step's logits
    match a run without windows."""
    cfg, params = _tiny(**SEVEN_LAYERS) if seven else _tiny()
    A, B, C, E = _seqs(cfg, [18, 10, 9, 12], seed=7)
    nA, nB, nE = len(A), len(B), len(E)
    pages = {10: [0, 1], 11: [2, 3], 12: [4], 13: [5, 6]}
    plain, spec = (Runner(cfg, params, jnp.float32, scan=seven, kernels=kernels) for _ in range(2))
    for r in (plain, spec):
        _, first = r.run([], [Row(A, 0, pages[10], slot=10), Row(B, 0, pages[11], slot=11),
                              Row(E, 0, pages[13], slot=13, temperature=1.0, seed=3)])
    # The greedy continuation of A and B, one token per step.
    a, b, x = [int(first[0])], [int(first[1])], []
    for t in range(4):
        lg, tok = plain.run([Row(a[-1:], nA + t, pages[10], slot=10), Row(b[-1:], nB + t, pages[11], slot=11)], [])
        a.append(int(tok[0]))
        b.append(int(tok[1]))
    # A: three right drafts then a wrong one -> accepts 3; B: a wrong first draft -> accepts 0;
    # E (sampled) never accepts; a prefill chunk of C runs beside them.
    wrong = lambda t: (t + 1) % cfg.vocab_size
    out = spec.step([Row([a[0], a[1], a[2], wrong(a[3])], nA, pages[10], slot=10),
                     Row([b[0], wrong(b[1])], nB, pages[11], slot=11),
                     Row([int(first[2]), 1, 2], nE, pages[13], slot=13, temperature=1.0, seed=3)],
                    [Row(C, 0, pages[12], slot=12)], window=4)
    acc, win, tok = np.asarray(out.accepted), np.asarray(out.window), np.asarray(out.tokens)
    assert acc[:3].tolist() == [2, 0, 0]
    assert [int(tok[0])] + win[0, 1:3].tolist() == a[1:4] and int(tok[1]) == b[1]
    # The next step from the committed states: A after a[0..2] (next input a[3]), B after b[0].
    lg_s, tok_s = spec.run([Row(a[3:4], nA + 3, pages[10], slot=10), Row(b[1:2], nB + 1, pages[11], slot=11)], [])
    ref = Runner(cfg, params, jnp.float32)
    ref.run([], [Row(A + a[:3], 0, pages[10], slot=10), Row(B + b[:1], 0, pages[11], slot=11)])
    lg_r, tok_r = ref.run([Row(a[3:4], nA + 3, pages[10], slot=10), Row(b[1:2], nB + 1, pages[11], slot=11)], [])
    assert rel_rms(lg_s, lg_r) < 1e-5 and tok_s.tolist() == tok_r.tolist()


def test_windows_read_only_what_they_wrote():
    """bf16, every pool word a NaN pattern at the start: a window with fewer drafts than its width
    (and a plain row beside it) must not read its unwritten padding positions (0 x NaN in the
    attention is NaN): every logit stays finite, in that step and the next."""
    cfg, params = _tiny()
    A, B = _seqs(cfg, [20, 12], seed=11)
    runner = Runner(cfg, params, jnp.bfloat16)
    runner.pool = jnp.full_like(runner.pool, 0xFFFFFFFF)
    _, first = runner.run([], [Row(A, 0, [1, 2], slot=0), Row(B, 0, [3], slot=4)])
    out = runner.step([Row([int(first[0]), 5], 20, [1, 2], slot=0), Row([int(first[1])], 12, [3], slot=4)], [],
                      window=4)
    assert np.all(np.isfinite(np.asarray(out.logits)[:2]))
    n = 1 + int(np.asarray(out.accepted)[0])
    lg, _ = runner.run([Row([7], 20 + n, [1, 2], slot=0), Row([7], 13, [3], slot=4)], [])
    assert np.all(np.isfinite(lg))


def test_padding_decode_rows_give_the_paged_kernel_no_context():
    """The paged MLA kernel sees length 0 for a decode row with no pages (a bucket's padding): a
    length of 1 had it read page -1, out of the pool (a CUDA illegal address on a large pool)."""
    seen = []

    def spy(q_lat, q_rope, latents, tables, lengths, layer, **kw):
        jax.debug.callback(lambda t, n: seen.append((np.asarray(t), np.asarray(n))), tables, lengths)
        return paged_mla_decode(q_lat, q_rope, latents, tables, lengths, layer, tile=16, interpret=True, **kw)

    cfg, params = _tiny()
    runner = Runner(cfg, params, jnp.float32, kernels=StepKernels(mla_decode=spy))
    seq = _seqs(cfg, [20])[0]
    runner.run([], [Row(seq[:19], 0, [0, 1], slot=10)])
    runner.run([Row(seq[19:20], 19, [0, 1], slot=10)], [])  # one decode row of the bucket's four
    tables, lengths = seen[-1]
    assert (tables[:, 0] < 0).sum() == 3 and lengths[tables[:, 0] < 0].tolist() == [0, 0, 0]
    assert lengths[0] == 20
