"""The dense grouped matmul kernel (interpreted on CPU, compiled with -m gpu) against
jax.lax.ragged_dot: empty groups, groups of several row tiles, rows past the groups, widths no
multiple of the tiles, bad input; and it lowers to one Triton call for an H200 at the
Kimi-Linear-48B decode shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import grouped_matmul
from tests.helpers import triton_calls_for_h200


def _reference(a, w, sizes):
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.ragged_dot(a, w, sizes, preferred_element_type=jnp.float32, precision=prec)


@pytest.mark.parametrize("dtype,K,N,interpret", [
    (jnp.float32, 128, 128, None), (jnp.bfloat16, 128, 128, None), (jnp.float32, 96, 48, None),
    pytest.param(jnp.float32, 128, 128, False, marks=pytest.mark.gpu),
    pytest.param(jnp.bfloat16, 96, 48, False, marks=pytest.mark.gpu)])
def test_matches_ragged_dot(dtype, K, N, interpret):
    rng = np.random.default_rng()
    sizes = jnp.array([3, 0, 37, 1, 0], jnp.int32)  # empty groups, a group of three row tiles
    w = jnp.asarray(rng.standard_normal((5, K, N)), dtype)
    a = jnp.asarray(rng.standard_normal((int(sizes.sum()) + 4, K)), dtype)  # rows past the groups: zeros
    out = grouped_matmul(a, w, sizes, interpret=interpret)
    want = _reference(a, w, sizes)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=0, atol=tol * float(jnp.abs(want).max()))
    assert not np.asarray(out[int(sizes.sum()):]).any()


def test_result_dtype_and_bad_input():
    a, w, sizes = jnp.ones((4, 32), jnp.bfloat16), jnp.ones((2, 32, 32), jnp.bfloat16), jnp.array([1, 3], jnp.int32)
    assert grouped_matmul(a, w, sizes, preferred_element_type=jnp.bfloat16).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="needs rhs"):
        grouped_matmul(jnp.ones((4, 64), jnp.bfloat16), w, sizes)
    with pytest.raises(ValueError, match="one dtype"):
        grouped_matmul(a.astype(jnp.float32), w, sizes)
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_matmul(jnp.ones((4, 40), jnp.bfloat16), jnp.ones((2, 40, 32), jnp.bfloat16), sizes)


def test_lowers_to_one_triton_call_for_the_h200():
    """jax.export for an abstract H200 at Kimi-Linear-48B's decode shape: 256 tokens' 8 routed
    slots of the hidden state (2304) times the experts' gate and up projections (2 x 1024)."""
    spec = jax.ShapeDtypeStruct
    args = (spec((2048, 2304), jnp.bfloat16), spec((256, 2304, 2048), jnp.bfloat16), spec((256,), jnp.int32))
    assert triton_calls_for_h200(lambda a, w, s: grouped_matmul(a, w, s, interpret=False), *args) == 1
