"""The fused prefill attention tile (interpreted on CPU, compiled with -m gpu) against its plain-JAX
reference over several tiles of one context: queries of another row (position -1), a block of
queries with nothing to see, a tile past every query, a partial last tile, a chunk straddling a
tile; and it lowers to one Triton call for an H200 at Kimi-Linear-48B's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda.gpu_common import gpu_head_dims_ok
from pallas_kernels.mla.prefill_flash import attend_tile, attend_tile_reference
from tests.helpers import triton_calls_for_h200


def _case(dtype, seed, T=96, H=2, n=32, R=16, Dv=32, S=64):
    rng = np.random.default_rng(seed)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    # a chunk of 70 queries at positions 100..169 after another row's 10 (-1) and 16 padding (-1)
    pos = np.full(T, -1, np.int32)
    pos[10:80] = 100 + np.arange(70)
    return arr(T, H, n), arr(T, H, R), jnp.asarray(pos), [(arr(S, H, n), arr(S, R), arr(S, H, Dv)) for _ in range(4)]


def _state(H, T, Dv):
    return jnp.full((H, T), -jnp.inf), jnp.zeros((H, T)), jnp.zeros((H, T, Dv))


@pytest.mark.parametrize("dtype,block,seed", [(jnp.float32, 16, 0), (jnp.float32, 32, 1), (jnp.bfloat16, 16, 2),
                                              pytest.param(jnp.bfloat16, 64, 3, marks=pytest.mark.gpu)])
def test_attend_tile_matches_reference_over_tiles(dtype, block, seed):
    qn, qr, pos, tiles = _case(dtype, seed, T=128 if block == 64 else 96)
    T, H, _ = qn.shape
    Dv = tiles[0][2].shape[-1]
    # tiles at 0, 64 (whole), 128 (partial: 30 keys, straddled by the chunk), 300 (past every query)
    bounds = [(0, 64), (64, 64), (128, 30), (300, 64)]
    got, want = _state(H, T, Dv), _state(H, T, Dv)
    interpret = None if block == 64 else True
    for (start, length), (kn, kr, v) in zip(bounds, tiles):
        got = attend_tile(qn, qr, pos, kn, kr, v, start, length, got, scale=0.125, block_q=block, block_k=block,
                          interpret=interpret)
        want = attend_tile_reference(qn, qr, pos, kn, kr, v, start, length, want, scale=0.125)
    m, l, acc = (np.asarray(x, np.float64) for x in got)
    wm, wl, wacc = (np.asarray(x, np.float64) for x in want)
    mine = np.asarray(pos) >= 0
    assert np.all(np.isneginf(m[:, ~mine])) and np.all(l[:, ~mine] == 0) and np.all(acc[:, ~mine] == 0)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(m[:, mine], wm[:, mine], rtol=tol, atol=tol)
    out, want_out = acc[:, mine] / l[:, mine, None], wacc[:, mine] / wl[:, mine, None]
    assert np.max(np.abs(out - want_out)) < tol * np.max(np.abs(want_out)) * 4


def test_attend_tile_is_causal():
    """A query's output does not change when the keys after its position change."""
    qn, qr, pos, tiles = _case(jnp.float32, 4)
    kn, kr, v = tiles[0]
    T, H, _ = qn.shape
    run = lambda kn, v: attend_tile(qn, qr, pos, kn, kr, v, 100, 64, _state(H, T, 32), scale=0.1, block_q=16,
                                    block_k=16, interpret=True)
    a = run(kn, v)
    b = run(kn.at[20:].add(1.0), v.at[20:].add(1.0))  # keys at positions >= 120
    early = np.asarray(pos) < 120
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x)[:, early], np.asarray(y)[:, early])
    assert not np.allclose(np.asarray(a[2])[:, ~early & (np.asarray(pos) >= 0)],
                           np.asarray(b[2])[:, ~early & (np.asarray(pos) >= 0)])


def test_attend_tile_rejects_unaligned_sizes():
    qn, qr, pos, tiles = _case(jnp.float32, 5)
    with pytest.raises(ValueError, match="multiples of block_q"):
        attend_tile(qn, qr, pos, *tiles[0], 0, 64, _state(2, 96, 32), scale=0.1, block_q=64, block_k=64)


def test_attend_tile_lowers_for_h200():
    T, H, S = 1024, 32, 2048
    bf = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
    f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    args = (bf(T, H, 128), bf(T, H, 64), jax.ShapeDtypeStruct((T,), jnp.int32), bf(S, H, 128), bf(S, 64),
            bf(S, H, 128), jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
            (f(H, T), f(H, T), f(H, T, 128)))
    assert gpu_head_dims_ok(128, 64, 128)
    run = lambda *a: attend_tile(*a, scale=192 ** -0.5, interpret=False)
    assert triton_calls_for_h200(run, *args) == 1
