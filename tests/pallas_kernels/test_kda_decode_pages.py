"""The KDA decode kernel on pages of the unified pool against :func:`k3jax.ops.kda.kda_decode_step`:
the state read from ``src`` (or zeros), written to ``dst`` and ``checkpoint`` at the layer's rows,
every other word of the pool unchanged (the GPU and TPU kernels interpreted on CPU, the GPU one
compiled with ``-m gpu``; the TPU one lowers for a TPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from k3jax.ops.kda import kda_decode_step
from pallas_kernels.kda.decode_pages import kda_decode_pages
from tests.helpers import assert_close, kda_inputs, kernel_backends, random_state

run = kernel_backends("tpu", pltpu.InterpretParams(detect_races=True))


@pytest.mark.parametrize("B,H,HV,K,V,rows,state_row,dtype,words", [
    (5, 2, 4, 16, 64, 40, 16, jnp.float32, jnp.uint32),  # GQA (rep 2); the layer's rows in a head's middle
    (3, 1, 2, 32, 32, 32, 0, jnp.bfloat16, jnp.float32),  # the state fills the head
])
def test_decode_pages_matches_reference(run, B, H, HV, K, V, rows, state_row, dtype, words):
    """``words``: the pool's dtype as the kernel gets it (uint32: the serving pool's own words)."""
    N = 9
    q, k, v, g, beta = (x[:, 0] for x in kda_inputs(B, B, 1, H, HV, K, V, dtype=dtype))
    pool = random_state(B + 1, (N, HV, rows, V))
    # row 0 reads and writes its page; row 1 resumes from another page (a checkpoint) into its own
    # and writes a checkpoint too; row 2 is fresh (no src); the rest: padding rows (no dst) last.
    src = np.array([3, 5, -1] + [-1] * (B - 3), np.int32)
    dst = np.array([3, 1, 7] + [-1] * (B - 3), np.int32)
    ckpt = np.array([-1, 8, -1] + [-1] * (B - 3), np.int32)
    before = np.asarray(pool)
    step = jax.jit(functools.partial(kda_decode_pages, **run), donate_argnums=(0,))
    o, pool = step(jax.lax.bitcast_convert_type(pool, words), jnp.int32(state_row), *map(jnp.asarray, (src, dst, ckpt)),
                  q, k, v, g, beta)
    assert pool.dtype == words
    after = np.asarray(jax.lax.bitcast_convert_type(pool, jnp.float32))

    layer = slice(state_row, state_row + K)
    s0 = np.where((src >= 0)[:, None, None, None], before[np.maximum(src, 0)][:, :, layer], 0.0)
    o_ref, s_ref = kda_decode_step(jnp.asarray(s0), q, k, v, g, beta)
    live = dst >= 0
    assert o.dtype == v.dtype
    assert_close(np.asarray(o, np.float32)[live], np.asarray(o_ref, np.float32)[live],
                 "bf16" if dtype == jnp.bfloat16 else "f32_out")
    want = before.copy()
    for b in np.flatnonzero(live):
        for page in (dst[b], ckpt[b]):
            if page >= 0:
                want[page, :, layer] = np.asarray(s_ref[b])
    written = np.zeros(N, bool)
    written[np.concatenate([dst, ckpt])[np.concatenate([dst, ckpt]) >= 0]] = True
    np.testing.assert_array_equal(after[~written], before[~written])  # untouched pages, bit for bit
    other = np.ones(rows, bool)
    other[layer] = False
    np.testing.assert_array_equal(after[:, :, other], before[:, :, other])  # other layers' rows
    assert_close(after[written], want[written], "f32_state")


@pytest.mark.gpu
def test_decode_pages_compiled_at_the_end_of_a_pool_past_2_31_words():
    """Compiled on the GPU: rows reading and writing the last pages of a pool of 3 x 2^30 words
    (12 GiB: past 32-bit element offsets, so the kernel must index it with 64-bit ones), beside
    padding rows (-1 everywhere), give the same outputs and page contents as on a small pool
    holding the same pages."""
    B, H, HV, K, V, rows, small_n = 6, 2, 4, 16, 64, 40, 5
    N = 3 * 2**30 // (HV * rows * V)
    q, k, v, g, beta = (x[:, 0] for x in kda_inputs(B, B, 1, H, HV, K, V))
    small = jax.lax.bitcast_convert_type(random_state(3, (small_n, HV, rows, V)), jnp.uint32)
    # no page written twice (two writers of one page race: which lands is not defined)
    src, dst, ckpt = (np.array(x + [-1] * (B - 3), np.int32) for x in ([0, 2, -1], [0, 1, 4], [-1, 3, -1]))
    step = jax.jit(functools.partial(kda_decode_pages, interpret=False), donate_argnums=(0,))
    big = jnp.zeros((N, HV, rows, V), jnp.uint32).at[N - small_n:].set(small)
    o_want, want = step(small, jnp.int32(16), *map(jnp.asarray, (src, dst, ckpt)), q, k, v, g, beta)
    move = lambda x: jnp.asarray(np.where(x >= 0, x + N - small_n, -1))
    o, big = step(big, jnp.int32(16), move(src), move(dst), move(ckpt), q, k, v, g, beta)
    np.testing.assert_array_equal(np.asarray(o[:3]), np.asarray(o_want[:3]))
    np.testing.assert_array_equal(np.asarray(big[N - small_n:]), np.asarray(want))
    assert not np.any(np.asarray(big[: N - small_n].max()))


def test_decode_pages_rejects_bad_shapes():
    q, k, v, g, beta = (x[:, 0] for x in kda_inputs(0, 2, 1, 1, 2, 16, 16))
    ids = jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="states must be"):
        kda_decode_pages(jnp.zeros((4, 2, 8, 16)), 0, ids, ids, ids, q, k, v, g, beta)  # rows < K
    with pytest.raises(ValueError, match="beta must have shape"):
        kda_decode_pages(jnp.zeros((4, 2, 16, 16)), 0, ids, ids, ids, q, k, v, g, beta[:, :1])


def test_decode_pages_lowers_for_a_tpu():
    """jax.export for a TPU at a Kimi-Linear-48B head shape (32 heads, K = V = 128): one Mosaic call."""
    B, H, K, N, rows = 8, 32, 128, 64, 3 * 128 + 16
    spec = jax.ShapeDtypeStruct
    ids = spec((B,), jnp.int32)
    args = (spec((N, H, rows, K), jnp.uint32), spec((), jnp.int32), ids, ids, ids,
            *(spec((B, H, K), jnp.bfloat16) for _ in range(4)), spec((B, H), jnp.bfloat16))
    f = jax.jit(functools.partial(kda_decode_pages, interpret=False, backend="tpu"))
    assert jax.export.export(f, platforms=["tpu"])(*args).mlir_module().count("tpu_custom_call") == 1
