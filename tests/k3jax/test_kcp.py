"""KDA context parallelism on 8 fake CPU devices against the single-device reference."""

import os
import re
import subprocess
import sys
import tempfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from k3jax.ops import conv, kda
from k3jax.parallel.kcp import chunk_kda_cp, short_conv_cp
from tests.helpers import TOL, assert_close, kda_inputs, random_state, rel_rms


def mesh_of(P):
    return Mesh(np.array(jax.devices()[:P]), ("cp",))


def cp(P, **kw):
    return jax.jit(lambda *x, init=None, cu=None: chunk_kda_cp(*x, mesh=mesh_of(P), axis_name="cp", initial_state=init,
                                                                 cu_seqlens=cu, chunk_size=16, **kw))


def test_eight_fake_devices():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("P", [1, 2, 4, 8])
def test_dense_matches_single_device(P):
    q, k, v, g, beta = kda_inputs(P, 2, 128, 2, 2, 16, 16, lower_bound=-5.0)
    h0 = random_state(P, (2, 2, 16, 16))
    o_ref, S_ref = kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    o, S = cp(P)(q, k, v, g, beta, init=h0)
    assert_close(o, o_ref, "f32_out")
    assert_close(S, S_ref, "f32_state")


# T = 128: sequences inside one rank next to others, ending exactly on a rank boundary, empty,
# starting exactly on a boundary and spanning ranks (three ranks at P = 8), one token, and padding.
CU = [0, 5, 32, 32, 70, 71, 120]


@pytest.mark.parametrize("P", [2, 4, 8])
def test_varlen_matches_single_device(P):
    T = 128
    q, k, v, g, beta = kda_inputs(10 + P, 1, T, 1, 2, 16, 16)
    q, k, v, g, beta = (x.at[:, CU[-1]:].set(jnp.nan) for x in (q, k, v, g, beta))
    cu = jnp.array(CU, jnp.int32)
    h0 = random_state(P, (len(CU) - 1, 2, 16, 16))
    o_ref, S_ref = kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    o, S = cp(P)(q, k, v, g, beta, init=h0, cu=cu)
    assert_close(o, o_ref, "f32_out")
    assert_close(S, S_ref, "f32_state")
    assert bool(jnp.all(o[:, CU[-1]:] == 0))


@pytest.mark.parametrize("backend,P,varlen", [("gpu", 8, False), ("gpu", 4, True), ("tpu", 2, False)])
def test_pallas_kernel_as_the_per_shard_op(backend, P, varlen):
    """The Pallas prefill kernels (interpreted on CPU) injected as the per-shard op."""
    from functools import partial

    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.kda import prefill

    kernel = partial(prefill.chunk_kda, backend=backend, interpret=True if backend == "gpu" else pltpu.InterpretParams())
    B, cu = (1, jnp.array(CU, jnp.int32)) if varlen else (2, None)
    q, k, v, g, beta = kda_inputs(20 + P, B, 128, 1, 2, 16, 16, lower_bound=-5.0)
    h0 = random_state(P, (len(CU) - 1 if varlen else B, 2, 16, 16))
    o_ref, S_ref = kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    o, S = cp(P, kernel=kernel)(q, k, v, g, beta, init=h0, cu=cu)
    assert_close(o, o_ref, "f32_out")
    assert_close(S, S_ref, "f32_state")


def test_other_mesh_axes_pass_through():
    """A 2 x 4 mesh: T over "cp" while batch (dense) or heads (varlen) are sharded over "x"."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "cp"))
    put = lambda xs, spec: [jax.device_put(a, NamedSharding(mesh, spec)) for a in xs]
    for cu, spec in ((None, PartitionSpec("x", "cp")), (jnp.array(CU, jnp.int32), PartitionSpec(None, "cp", "x"))):
        B, N = (2, 2) if cu is None else (1, len(CU) - 1)
        x = kda_inputs(30, B, 128, 2, 2, 16, 16, lower_bound=-5.0)
        h0 = random_state(30, (N, 2, 16, 16))
        f = jax.jit(lambda *x: chunk_kda_cp(*x, mesh=mesh, axis_name="cp", initial_state=h0, cu_seqlens=cu,
                                            chunk_size=16))
        o, S = f(*put(x, spec))
        o_ref, S_ref = kda.naive_recurrent_kda(*x, initial_state=h0, cu_seqlens=cu)
        assert_close(o, o_ref, "f32_out")
        assert_close(S, S_ref, "f32_state")


def _collective_shapes(hlo: str, op: str):
    return sorted(re.findall(rf"= (\S+) {op}\(", hlo))


def test_exchanged_bytes_do_not_grow_with_T():
    P = 4
    shapes = []
    for T in (64, 512):
        x = kda_inputs(0, 1, T, 1, 2, 16, 16)
        hlo = cp(P).lower(*x).compile().as_text()
        gathers = _collective_shapes(hlo, "all-gather")
        assert gathers, "expected an all-gather of the (M, E) maps"
        shapes.append((gathers, _collective_shapes(hlo, "all-reduce")))
    assert shapes[0] == shapes[1]


def test_bf16_fold_is_visibly_worse():
    # Negative control: the same fold with the M chain in bf16 fails the tolerance. Slow gates
    # keep the handed-off state alive across ranks, so its error reaches the outputs.
    q, k, v, _, beta = kda_inputs(3, 1, 256, 1, 1, 32, 32)
    g = -0.01 * jax.random.uniform(jax.random.key(4), (1, 256, 1, 32))
    h0 = random_state(3, (1, 1, 32, 32))
    o_ref, S_ref = kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0)
    o32, S32 = cp(8)(q, k, v, g, beta, init=h0)
    o16, S16 = cp(8, fold_dtype=jnp.bfloat16)(q, k, v, g, beta, init=h0)
    assert rel_rms(o32, o_ref) <= TOL["f32_out"] and rel_rms(S32, S_ref) <= TOL["f32_state"]
    assert rel_rms(o16, o_ref) > TOL["f32_out"], rel_rms(o16, o_ref)


# The plain (unjitted) call in a fresh process: it used to segfault there (eager shard_map).
_PLAIN_CALL = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from k3jax.parallel.kcp import chunk_kda_cp
from tests.helpers import kda_inputs, random_state
mesh = Mesh(np.array(jax.devices()), ("cp",))
x = kda_inputs(40, 1, 128, 1, 2, 16, 16)
cu = jnp.array({cu}, jnp.int32)
o, S = chunk_kda_cp(*x, mesh=mesh, axis_name="cp", initial_state=random_state(40, (6, 2, 16, 16)),
                    cu_seqlens=cu, chunk_size=16)
o2, S2 = chunk_kda_cp(*kda_inputs(41, 2, 128, 1, 2, 16, 16), mesh=mesh, axis_name="cp", chunk_size=16)
np.savez(sys.argv[1], o=o, S=S, o2=o2, S2=S2)
"""


def test_plain_call_outside_jit_matches_jitted():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "out.npz")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        proc = subprocess.run([sys.executable, "-c", _PLAIN_CALL.format(cu=CU), path], cwd=root, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": root})
        assert proc.returncode == 0, f"plain call exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        got = dict(np.load(path))
    h0 = random_state(40, (len(CU) - 1, 2, 16, 16))
    o, S = cp(8)(*kda_inputs(40, 1, 128, 1, 2, 16, 16), init=h0, cu=jnp.array(CU, jnp.int32))
    o2, S2 = cp(8)(*kda_inputs(41, 2, 128, 1, 2, 16, 16))
    chex.assert_trees_all_equal(got, {"o": o, "S": S, "o2": o2, "S2": S2})


def test_indivisible_T_is_rejected():
    x = kda_inputs(0, 1, 30, 1, 1, 16, 16)
    with pytest.raises(ValueError, match="divisible"):
        chunk_kda_cp(*x, mesh=mesh_of(4), axis_name="cp")


@pytest.mark.parametrize("P,cu", [(8, None), (8, [0, 1, 3, 3, 9, 14]), (4, [0, 2, 8, 15])])
def test_short_conv_halo(P, cu):
    # T = 16 over 8 ranks gives 2-token shards: a halo of W - 1 = 3 spans two earlier ranks.
    B = 2 if cu is None else 1
    x = jax.random.normal(jax.random.key(0), (B, 16, 6))
    w = jax.random.normal(jax.random.key(1), (6, 4))
    N = B if cu is None else len(cu) - 1
    h0 = jax.random.normal(jax.random.key(2), (N, 3, 6))
    cu = None if cu is None else jnp.array(cu, jnp.int32)
    y_ref, f_ref = conv.short_conv(x, w, initial_state=h0, cu_seqlens=cu)
    y, f = jax.jit(lambda x: short_conv_cp(x, w, mesh=mesh_of(P), axis_name="cp", initial_state=h0, cu_seqlens=cu))(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(f), np.asarray(f_ref), rtol=1e-6, atol=1e-6)
