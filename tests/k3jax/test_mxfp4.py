"""MXFP4 experts kept packed: the JAX dequantisation against the loader's NumPy one, the golden K3
MXFP4 checkpoint loaded packed (reference forward and serving step against the dequantised load),
and the bytes the packed experts take."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.model import load_hf_checkpoint, logits
from k3jax.model.loader import dequantize_mxfp4
from k3jax.model.mxfp4 import MXFP4, dequantize
from k3jax.model.pool import PoolLayout
from k3jax.model.step import (Row, StepKernels, grouped_mxfp4, jit_step, pack_batch, prepare_params,
                              stack_layers)
from pallas_kernels.moe import mxfp4_grouped_matmul
from tests.helpers import rel_rms

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden", "k3_tiny_mxfp4")


def _random_mxfp4(E=3, out=40, inp=256, seed=0):
    """Random bytes with every packed byte value (so every nibble in both halves) and the scale
    extremes 0, 1, 2 (subnormal products), 127, 253, 254 (overflow) and 255 (inf / NaN)."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (E, out, inp // 2), dtype=np.uint8)
    packed[0, :16, :16] = np.arange(256, dtype=np.uint8).reshape(16, 16)
    scale = rng.integers(0, 256, (E, out, inp // 32), dtype=np.uint8)
    scale[0, :16, 0] = [0, 1, 2, 3, 125, 126, 127, 128, 129, 250, 251, 252, 253, 254, 255, 255]
    return packed, scale


@pytest.mark.parametrize("block_experts", [1, 2, 3, 6])
def test_grouped_matmul_on_blocks_of_experts(block_experts):
    """Dequantising a block of experts at a time (and their rows 512 at a time) gives the grouped
    matmul on the whole dequantised stack: groups of 0 to 700 rows, rows past the groups zero."""
    packed, scale = _random_mxfp4(E=6, out=16, inp=64, seed=3)
    scale = np.clip(scale, 100, 140)  # finite weights
    w = MXFP4(jnp.asarray(packed), jnp.asarray(scale)).mT  # the step's [E, in, out]
    sizes = jnp.array([0, 700, 3, 0, 513, 40], jnp.int32)
    a = jax.random.normal(jax.random.key(0), (int(sizes.sum()) + 20, 64))
    want = jax.lax.ragged_dot(a, dequantize(w), sizes, precision=jax.lax.Precision.HIGHEST)
    want = jnp.where((jnp.arange(a.shape[0]) < sizes.sum())[:, None], want, 0.0)
    kernels = StepKernels(ragged_dot=jax.lax.ragged_dot, mxfp4_block_bytes=block_experts * 64 * 16 * 4)
    got = jax.jit(lambda a, w, s: grouped_mxfp4(kernels, a, w, s, jnp.float32))(a, w, sizes)
    assert rel_rms(got, want) < 1e-6


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dequantize_is_bit_exact(dtype):
    packed, scale = _random_mxfp4()
    with np.errstate(over="ignore", invalid="ignore"):
        want = np.stack([dequantize_mxfp4(p, s) for p, s in zip(packed, scale)]).astype(dtype)
    w = MXFP4(jnp.asarray(packed), jnp.asarray(scale))
    run = jax.jit(dequantize, static_argnums=1)
    bits = lambda a: np.asarray(a).view(np.uint32 if a.dtype == np.float32 else np.uint16)
    nan = np.isnan(want.astype(np.float32))
    assert nan.any() and np.isinf(want.astype(np.float32)).any() and ((want != 0) & (np.abs(want) < 2.0 ** -126)).any()
    for got in (run(w, dtype), jnp.swapaxes(run(w.mT, dtype), 1, 2)):  # both layouts
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape == w.shape
        np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
        np.testing.assert_array_equal(bits(got)[~nan], bits(want)[~nan])


def test_a_different_nibble_order_fails():
    """The test above can fail: the high nibble first gives other values."""
    packed, scale = _random_mxfp4(E=1, out=16, inp=64)
    swapped = (packed >> 4) | (packed << 4)
    got = np.asarray(dequantize(MXFP4(jnp.asarray(swapped), jnp.asarray(scale))))
    with np.errstate(over="ignore", invalid="ignore"):
        want = dequantize_mxfp4(packed[0], scale[0])
    assert not np.array_equal(np.nan_to_num(got[0]), np.nan_to_num(want))


@pytest.fixture(scope="module")
def loads():
    """The golden MXFP4 K3 loaded dequantised (as today) and packed."""
    return load_hf_checkpoint(GOLDEN), load_hf_checkpoint(GOLDEN, keep_mxfp4=True)


def test_packed_experts_take_4_25_bits(loads):
    (_, dense), (cfg, packed) = loads
    serving = prepare_params(cfg, packed, jnp.bfloat16)
    n = 0
    for i, m in enumerate(cfg.mlp_types):
        if m != "moe":
            continue
        for k in ("gate_up", "down"):
            w, ref = packed["layers"][i]["mlp"][k], dense["layers"][i]["mlp"][k]
            assert isinstance(w, MXFP4) and w.packed.dtype == w.scale.dtype == jnp.uint8 and w.shape == ref.shape
            nbytes = w.packed.nbytes + w.scale.nbytes
            assert nbytes * 8 == 4.25 * ref.size  # bf16: 16 bits a weight
            assert nbytes / (ref.size * 2) == 4.25 / 16
            s = serving["layers"][i]["mlp"][k]  # the serving layout [E, in, out], still packed
            assert isinstance(s, MXFP4) and s.axis == -2 and s.shape == ref.shape[:1] + ref.shape[:0:-1]
            assert s.packed.nbytes + s.scale.nbytes == nbytes
            n += 1
    assert n == 2 * cfg.mlp_types.count("moe") > 0


@pytest.mark.slow  # CI time: test_k3 runs the packed prefill on the golden, test_step_on_packed_experts decode
def test_reference_forward_on_packed_experts(loads):
    """Same logits as the dequantised load (prefill: grouped experts; one token: gathered), and
    the golden ones."""
    (cfg, dense), (_, packed) = loads
    g = np.load(os.path.join(GOLDEN, "golden.npz"))
    run = jax.jit(lambda params, ids: (logits(cfg, params, ids), logits(cfg, params, ids[:1])))
    ids = jnp.asarray(g["token_ids_0"])
    want, got = run(dense, ids), run(packed, ids)
    for a, b in zip(got, want):
        assert rel_rms(a, b) < 1e-6
    np.testing.assert_allclose(got[0], g["logits_0"], atol=2e-3)


def _step_logits(cfg, params, ids, scan, kernels=StepKernels()):
    """Float32 serving-step logits: one prefill step of two rows, then three decode steps."""
    lay = PoolLayout.for_model(cfg, page_tokens=16, latent_dtype=jnp.float32)
    pool, params = lay.allocate(8), prepare_params(cfg, params, jnp.float32)
    if scan:
        params = stack_layers(cfg, params)
        assert params["runs"]
    mixed = dict(num_decode=2, num_tokens=48, num_rows=4, max_blocks=3, num_pages=8)
    decoding = dict(mixed, num_tokens=2, num_rows=2)  # 2 tokens x top-k routed slots, fewer than the experts
    steps = [([], [Row(ids[:20], 0, [0, 1], slot=6), Row(ids[3:27], 0, [2, 3], slot=7)])]
    steps += [([Row(ids[t : t + 1], t, [0, 1], slot=6), Row(ids[t + 7 : t + 8], t + 4, [2, 3], slot=7)], [])
              for t in (20, 21, 22)]
    out = []
    for decode, prefill in steps:
        batch = pack_batch(lay, decode, prefill, **(mixed if prefill else decoding))
        res, pool = jit_step(cfg, lay, kernels, 2, params, pool, batch, return_logits=True)
        out.append(np.asarray(res.logits)[[0, 1] if decode else [2, 3]])
    return np.stack(out)


@pytest.mark.parametrize("scan", [pytest.param(False, marks=pytest.mark.slow), True])  # unrolled: test_step covers it
def test_step_on_packed_experts(loads, scan):
    """The serving step dequantising packed experts in its MoE (all of them in the prefill step;
    in the decode steps only those the tokens route to, gathered or read in place by the fused
    kernel) gives the logits of the step on the dequantised load (float32), layers unrolled and
    scanned (the packed experts stacked); row 0's are the golden ones (a prefix of its sequence)."""
    (cfg, dense), (_, packed) = loads
    g = np.load(os.path.join(GOLDEN, "golden.npz"))
    ids = g["token_ids_0"].tolist()
    want = _step_logits(cfg, dense, ids, scan)
    got = _step_logits(cfg, packed, ids, scan, StepKernels(mxfp4_block_bytes=1 << 15))  # a few experts at a time
    assert rel_rms(got, want) < 1e-5
    np.testing.assert_allclose(got[:, 0], g["logits_0"][19:23], atol=2e-3)
    if scan:  # the decode steps' routed experts read in place by the fused kernel (interpreted)
        fused = _step_logits(cfg, packed, ids, scan, StepKernels(mxfp4_matmul=mxfp4_grouped_matmul))
        assert rel_rms(fused, want) < 1e-5
