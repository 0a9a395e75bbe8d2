"""The paged MLA attention kernels (GPU and TPU, interpreted on CPU) against the pure-JAX
attention over gathered latents: random pools, shared and scattered pages, lengths 0, 1, a page
boundary and a full block table, several splits, a traced layer index; and they lower for an H200
and for a TPU."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from k3jax.model import ModelConfig
from k3jax.model.pool import PoolLayout, latent_words, read_latents
from pallas_kernels.mla import paged_mla_decode
from pallas_kernels.mla.paged_decode import head_block
from tests.helpers import triton_calls_for_h200


def _reference(lay, pool, layer, bt, lengths, q_lat, q_rope, scale):
    S = bt.shape[1] * lay.page_tokens
    ctx = read_latents(lay, pool, layer, bt, S, lengths).astype(jnp.float32)  # [Q, S, L + R]
    L = q_lat.shape[-1]
    s = (jnp.einsum("qhl,qsl->qhs", q_lat.astype(jnp.float32), ctx[..., :L], precision="highest")
         + jnp.einsum("qhr,qsr->qhs", q_rope.astype(jnp.float32), ctx[..., L:], precision="highest")) * scale
    s = jnp.where(jnp.arange(S)[None, None, :] < lengths[:, None, None], s, -jnp.inf)
    a = jnp.nan_to_num(jax.nn.softmax(s, axis=-1))  # a row of length 0 gives 0
    return jnp.einsum("qhs,qsl->qhl", a, ctx[..., :L], precision="highest")


def _case(dtype, seed, H=2, L=32, R=16, page_tokens=64, blocks=3, N=12, Q=6):
    """A pool of random latents (finite: the kernel reads only rows inside a query's length, but
    the check compares every output), block tables of distinct random pages (one ending early)
    and lengths 0, 1, one page, a page and a bit, the whole table, a page boundary minus one."""
    cfg = ModelConfig.from_json("configs/tiny.json")
    cfg = dataclasses.replace(cfg, layer_types=(*cfg.layer_types, "mla"), mlp_types=(*cfg.mlp_types, "moe"))
    lay = PoolLayout.for_model(cfg, page_tokens=page_tokens, latent_dtype=dtype)  # two MLA layers a page
    assert lay.latent == L + R and lay.n_mla == 2
    rng = np.random.default_rng(seed)
    rows = lay.page_words * 4 // jnp.dtype(dtype).itemsize // lay.latent
    lat = jnp.asarray(rng.standard_normal((N, lay.page_words, 4 // jnp.dtype(dtype).itemsize)), dtype)
    pool = jax.lax.bitcast_convert_type(lat if lat.shape[-1] > 1 else lat[..., 0], jnp.uint32)
    assert latent_words(lay, pool).shape == (N, rows, lay.row_words)
    bt = np.stack([rng.choice(N, blocks, replace=False) for _ in range(Q)]).astype(np.int32)
    bt[1, 2] = -1
    lengths = np.array([0, 1, page_tokens, page_tokens + 5, blocks * page_tokens, 2 * page_tokens - 1], np.int32)
    q_lat = jnp.asarray(rng.standard_normal((Q, H, L)), dtype)
    q_rope = jnp.asarray(rng.standard_normal((Q, H, R)), dtype)
    return lay, pool, jnp.asarray(bt), jnp.asarray(lengths), q_lat, q_rope


COMPILED = pytest.mark.gpu


@pytest.mark.parametrize("dtype,splits,backend,H", [  # 48 heads: two blocks of 32, the second padded
    (jnp.float32, 1, "gpu", 2), (jnp.float32, 3, "gpu", 2), (jnp.bfloat16, 2, "gpu", 48),
    (jnp.float32, 1, "tpu", 2), (jnp.bfloat16, 1, "tpu", 2),
    pytest.param(jnp.float32, 3, "compiled", 2, marks=COMPILED), pytest.param(jnp.bfloat16, 2, "compiled", 96, marks=COMPILED)])
def test_paged_attention_matches_the_gathered_one(dtype, splits, backend, H):
    lay, pool, bt, lengths, q_lat, q_rope = _case(dtype, seed=splits, H=H)
    scale = 0.17
    interpret = {"tpu": pltpu.InterpretParams(detect_races=True), "gpu": True, "compiled": False}[backend]
    backend = None if backend == "compiled" else backend
    for layer in (0, 1):
        want = _reference(lay, pool, layer, bt, lengths, q_lat, q_rope, scale)
        run = jax.jit(partial(paged_mla_decode, page_tokens=lay.page_tokens, scale=scale, tile=16, splits=splits,
                              interpret=interpret, backend=backend))
        got = run(q_lat, q_rope, latent_words(lay, pool), bt, lengths, jnp.int32(layer))
        tol = 1e-5 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
        assert not np.any(np.asarray(got[0]))  # length 0: nothing attended, zeros


@COMPILED
def test_paged_attention_compiled_at_the_end_of_a_pool_past_2_31_words():
    """Compiled on the GPU: pages at the far end of a pool of 3 x 2^30 words (12 GiB: past 32-bit
    element offsets, which must not wrap), block tables padded with -1 and rows of length 0 (a
    bucket's padding rows) beside live ones, the same output as on a small pool holding the same pages."""
    dtype = jnp.bfloat16
    lay, small, bt, lengths, q_lat, q_rope = _case(dtype, seed=7)
    N = 3 * 2**30 // lay.page_words
    big = jnp.zeros((N, lay.page_words), jnp.uint32).at[N - small.shape[0]:].set(small)
    moved = jnp.where(bt >= 0, bt + N - small.shape[0], -1)
    pad = jnp.full((4, bt.shape[1]), -1, jnp.int32)  # padding rows: no pages, length 0
    run = jax.jit(partial(paged_mla_decode, page_tokens=lay.page_tokens, scale=0.17, interpret=False))
    q = lambda x: jnp.concatenate([x, jnp.zeros((4, *x.shape[1:]), x.dtype)])
    for layer in (0, 1):
        want = run(q_lat, q_rope, latent_words(lay, small), bt, lengths, jnp.int32(layer))
        got = run(q(q_lat), q(q_rope), latent_words(lay, big), jnp.concatenate([moved, pad]),
                  jnp.concatenate([lengths, jnp.zeros(4, jnp.int32)]), jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(got[:-4]), np.asarray(want))
        assert not np.any(np.asarray(got[-4:]))


def test_offsets_past_32_bits_are_refused_only_where_triton_keeps_them_32_bit():
    """Pallas Triton indexes an array of more than 2^32 bytes with 64-bit offsets: a pool of 3 x
    2^31 words is accepted; only one-byte arrays of 2^31 to 2^32 elements are refused."""
    from pallas_kernels.kda.gpu_common import check_offset_width

    spec = jax.ShapeDtypeStruct
    check_offset_width("pool", spec((3 * 2**31,), jnp.uint32))
    check_offset_width("pool", spec((2**31 - 1,), jnp.uint8))
    check_offset_width("pool", spec((2**32 + 1,), jnp.uint8))
    with pytest.raises(ValueError, match="32-bit offsets"):
        check_offset_width("packed", spec((2**31,), jnp.uint8))
    f = partial(paged_mla_decode, page_tokens=64, scale=0.1, backend="gpu")
    q, qr, ids = spec((4, 2, 32), jnp.bfloat16), spec((4, 2, 16), jnp.bfloat16), spec((4,), jnp.int32)
    out = jax.eval_shape(f, q, qr, spec((2**20, 128, 24), jnp.uint32), spec((4, 2), jnp.int32), ids,
                         spec((), jnp.int32))  # 3 x 2^31 words
    assert out.shape == (4, 2, 32)


def test_head_blocks_are_powers_of_two():
    assert [head_block(H) for H in (1, 2, 16, 24, 32, 48, 64, 96, 128)] == [16, 16, 16, 32, 32, 32, 64, 32, 32]


@pytest.mark.parametrize("H", [32, 96])
def test_paged_attention_lowers_for_the_h200(H):
    """jax.export for an abstract H200: the kernel is one Triton call at the Kimi-Linear-48B shape
    (32 heads, L = 512, R = 64, bf16) and at Kimi K3's 96 heads (three blocks of 32)."""
    Q, L, R, N, rows, blocks = 8, 512, 64, 16, 1024, 4
    spec = jax.ShapeDtypeStruct
    args = (spec((Q, H, L), jnp.bfloat16), spec((Q, H, R), jnp.bfloat16), spec((N, rows, (L + R) // 2), jnp.uint32),
            spec((Q, blocks), jnp.int32), spec((Q,), jnp.int32), spec((), jnp.int32))
    assert triton_calls_for_h200(partial(paged_mla_decode, page_tokens=256, scale=0.1, interpret=False), *args) == 1


def test_paged_attention_lowers_for_a_tpu():
    """jax.export for a TPU at the same shape: one Mosaic call."""
    Q, H, L, R, N, rows, blocks = 8, 32, 512, 64, 16, 1024, 4
    spec = jax.ShapeDtypeStruct
    args = (spec((Q, H, L), jnp.bfloat16), spec((Q, H, R), jnp.bfloat16), spec((N, rows, (L + R) // 2), jnp.uint32),
            spec((Q, blocks), jnp.int32), spec((Q,), jnp.int32), spec((), jnp.int32))
    f = jax.jit(partial(paged_mla_decode, page_tokens=256, scale=0.1, interpret=False, backend="tpu"))
    assert jax.export.export(f, platforms=["tpu"])(*args).mlir_module().count("tpu_custom_call") == 1
