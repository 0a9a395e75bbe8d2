"""The grouped MXFP4 matmul kernel (interpreted on CPU, compiled with -m gpu) against
jax.lax.ragged_dot over the dequantised experts: empty groups, groups of several row tiles, a
group map with repeated and unused experts, every E8M0 scale (inf and NaN at 255), bad input;
and it lowers to one Triton call for an H200 at Kimi K3's decode shape."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.model.mxfp4 import MXFP4, dequantize
from pallas_kernels.moe import mxfp4_grouped_matmul
from tests.helpers import triton_calls_for_h200


def _reference(a, packed, scale, sizes, experts=None):
    w = dequantize(MXFP4(packed, scale, axis=-2), a.dtype)
    if experts is not None:
        w = w[jnp.minimum(experts, w.shape[0] - 1)]
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32, precision=prec)


def _experts(rng, E, K, N, lo=118, hi=136):
    packed = jnp.asarray(rng.integers(0, 256, (E, K // 2, N), dtype=np.uint8))
    return packed, jnp.asarray(rng.integers(lo, hi, (E, K // 32, N), dtype=np.uint8))


@pytest.mark.parametrize("dtype,interpret", [
    (jnp.float32, None), (jnp.bfloat16, None),
    pytest.param(jnp.float32, False, marks=pytest.mark.gpu), pytest.param(jnp.bfloat16, False, marks=pytest.mark.gpu)])
def test_grouped_matmul_matches_ragged_dot_over_the_dequantised_experts(dtype, interpret):
    rng = np.random.default_rng()
    E, K, N = 5, 96, 128
    packed, scale = _experts(rng, E, K, N)
    sizes = jnp.array([3, 0, 37, 1, 0], jnp.int32)  # empty groups, a group of three row tiles
    M = int(sizes.sum()) + 4  # rows past the groups: zeros
    a = jnp.asarray(rng.standard_normal((M, K)), dtype)
    out = mxfp4_grouped_matmul(a, packed, scale, sizes, interpret=interpret)
    want = _reference(a, packed, scale, sizes)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    scale_of = float(jnp.abs(want).max())
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=tol * scale_of, rtol=0)
    assert not np.asarray(out[int(sizes.sum()):]).any()


def test_a_group_map_reads_each_groups_expert():
    """Groups over a map of experts (a decode step's routed experts: repeated, and unused slots
    past the last expert, which are never read)."""
    rng = np.random.default_rng()
    E, K, N = 6, 64, 64
    packed, scale = _experts(rng, E, K, N)
    experts = jnp.array([4, 0, 4, 6, 6], jnp.int32)  # 6: no expert (an empty group)
    sizes = jnp.array([2, 1, 17, 0, 0], jnp.int32)
    a = jnp.asarray(rng.standard_normal((int(sizes.sum()), K)), jnp.float32)
    out = mxfp4_grouped_matmul(a, packed, scale, sizes, experts)
    want = _reference(a, packed, scale, sizes, experts)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("N,block_n,interpret", [
    (48, 64, None), (96, 64, None), (64, 128, None), pytest.param(48, 64, False, marks=pytest.mark.gpu)])
def test_a_width_no_multiple_of_the_column_tile_takes_narrower_tiles(N, block_n, interpret):
    """The tiny K3's 48-wide latent, a 96-wide projection: column tiles of gcd(N, block_n)."""
    rng = np.random.default_rng()
    E, K = 3, 64
    packed, scale = _experts(rng, E, K, N)
    sizes = jnp.array([5, 0, 18], jnp.int32)
    a = jnp.asarray(rng.standard_normal((int(sizes.sum()), K)), jnp.float32)
    out = mxfp4_grouped_matmul(a, packed, scale, sizes, block_n=block_n, interpret=interpret)
    want = _reference(a, packed, scale, sizes)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


def test_every_scale_as_the_reference_dequantises_it():
    """Scales 0 to 255 (overflow to inf near 254, inf and NaN at 255), an identity input that
    picks single weights: every column of finite weights equals the reference bit for bit, but
    scales 0 and 1, whose weights are at most 6 x 2^-127 (subnormals among them) that the backends' float
    arithmetic may flush to zero; a column holding inf or NaN is not finite anywhere (0 x inf is
    NaN in the sums)."""
    rng = np.random.default_rng()
    E, K, N = 1, 32, 256
    packed = jnp.asarray(rng.integers(0, 256, (E, K // 2, N), dtype=np.uint8))
    scale = jnp.arange(N, dtype=jnp.uint8).reshape(E, 1, N)
    a = jnp.eye(K, dtype=jnp.float32)  # row i: weight row i
    out = np.asarray(mxfp4_grouped_matmul(a, packed, scale, jnp.array([K], jnp.int32)))
    want = np.asarray(dequantize(MXFP4(packed, scale, axis=-2), jnp.float32)[0])
    finite = np.isfinite(want).all(axis=0)
    assert finite[:2].all() and not finite[255]
    np.testing.assert_allclose(out[:, :2], want[:, :2], rtol=0, atol=2.0**-124)
    np.testing.assert_array_equal(out[:, 2:][:, finite[2:]], want[:, 2:][:, finite[2:]])
    assert not np.isfinite(out[:, ~finite]).any()


def test_bad_input_is_refused():
    packed, scale = _experts(np.random.default_rng(0), 2, 64, 64)
    a, sizes = jnp.zeros((4, 64), jnp.float32), jnp.array([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="packed"):
        mxfp4_grouped_matmul(jnp.zeros((4, 32), jnp.float32), packed, scale, sizes)
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_grouped_matmul(a, packed.astype(jnp.int32), scale, sizes)
    spec = jax.ShapeDtypeStruct  # 2^31 to 2^32 one-byte elements: past Pallas Triton's 32-bit offsets
    with pytest.raises(ValueError, match="32-bit offsets"):
        jax.eval_shape(mxfp4_grouped_matmul, a, spec((2, 32, 2**25 + 64), jnp.uint8), spec((2, 2, 2**25 + 64), jnp.uint8),
                       sizes)
    big = jax.eval_shape(mxfp4_grouped_matmul, a, spec((2, 32, 2**26 + 64), jnp.uint8),
                         spec((2, 2, 2**26 + 64), jnp.uint8), sizes)
    assert big.shape == (4, 2**26 + 64)  # over 2^32 bytes: 64-bit offsets
    narrow, narrow_scale = _experts(np.random.default_rng(0), 2, 64, 40)
    with pytest.raises(ValueError, match="multiple of 16"):
        mxfp4_grouped_matmul(a, narrow, narrow_scale, sizes)
    with pytest.raises(ValueError, match="one entry per group"):
        mxfp4_grouped_matmul(a, packed, scale, sizes, jnp.array([0], jnp.int32))


def test_lowers_to_one_triton_call_for_the_h200():
    """jax.export for an abstract H200 at Kimi K3's decode shape: 768 routed slots of the latent
    (3584) times one expert's gate and up projections (2 x 3072), bf16."""
    spec = jax.ShapeDtypeStruct
    G, K, N, E = 768, 3584, 6144, 896
    args = (spec((G, K), jnp.bfloat16), spec((E, K // 2, N), jnp.uint8), spec((E, K // 32, N), jnp.uint8),
            spec((G,), jnp.int32), spec((G,), jnp.int32))
    assert triton_calls_for_h200(partial(mxfp4_grouped_matmul, interpret=False), *args) == 1
