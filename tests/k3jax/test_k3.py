"""Kimi K3: the golden example (fp32 and MXFP4), MXFP4 unpacking, the K3 parts' cached paths,
and the loader's errors on K3 checkpoints."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.model import (CheckpointError, ModelConfig, forward, hidden_states, init_cache, init_params,
                         load_hf_checkpoint, logits)
from k3jax.model.loader import dequantize_mxfp4, read_safetensors
from tests.helpers import rel_rms, rewrite_safetensors

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden")


@pytest.mark.parametrize("case", ["k3_tiny", "k3_tiny_mxfp4"])
def test_k3_matches_the_reference(case):
    cfg, params = load_hf_checkpoint(os.path.join(GOLDEN, case))
    assert cfg.attn_res_block_size == 2 and cfg.latent_moe_size == 64 and cfg.mla_output_gate
    assert cfg.expert_format == ("mxfp4" if "mxfp4" in case else None)
    g = np.load(os.path.join(GOLDEN, case, "golden.npz"))
    run = jax.jit(lambda ids: (logits(cfg, params, ids), *hidden_states(cfg, params, ids)))
    for i in (0, 1):
        out, mixed, normed = run(jnp.asarray(g[f"token_ids_{i}"]))
        np.testing.assert_allclose(out, g[f"logits_{i}"], atol=2e-3)
        if "mxfp4" not in case:  # the MXFP4 golden holds logits only
            np.testing.assert_allclose(mixed, g[f"final_attnres_hidden_{i}"], atol=2e-3)
            np.testing.assert_allclose(normed, g[f"final_norm_hidden_{i}"], atol=2e-3)


def _e2m1(code):
    """E2M1 from its bits: sign, two exponent bits (bias 1), one mantissa bit; exponent 0 is subnormal."""
    e, m = (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if code & 8 else mag


def test_mxfp4_unpacking_is_exact():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (5, 32), dtype=np.uint8)
    scale = rng.integers(117, 137, (5, 2), dtype=np.uint8)
    want = np.zeros((5, 64), np.float32)
    for r in range(5):
        for c in range(64):
            code = packed[r, c // 2] >> 4 if c % 2 else packed[r, c // 2] & 0xF
            want[r, c] = _e2m1(int(code)) * 2.0 ** (int(scale[r, c // 32]) - 127)
    np.testing.assert_array_equal(dequantize_mxfp4(packed, scale), want)


def test_mxfp4_checkpoint_is_the_fp32_one_quantised():
    """Every MXFP4 expert dequantises to within one FP4 step of the fp32 expert it came from."""
    fp = read_safetensors(os.path.join(GOLDEN, "k3_tiny", "model.safetensors"))
    q = read_safetensors(os.path.join(GOLDEN, "k3_tiny_mxfp4", "model.safetensors"))
    name = "language_model.model.layers.3.block_sparse_moe.experts.5.w2"
    w = dequantize_mxfp4(q[name + ".weight_packed"], q[name + ".weight_scale"])
    ref = fp[name + ".weight"]
    step = np.repeat(np.ldexp(1.0, q[name + ".weight_scale"].astype(int) - 127), 32, axis=1)
    assert w.shape == ref.shape and np.all(np.abs(w - ref) <= step + 1e-12)


def _tiny_k3():
    cfg = ModelConfig.from_json("configs/tiny_k3.json")
    return cfg, init_params(cfg, jax.random.key(4))


def test_k3_cached_paths_equal_one_forward():
    """Chunked prefill and decode steps reproduce one full forward on a tiny K3 with a partial last
    AttnRes block, top-3 LatentMoE and a gated MLA as its last layer."""
    cfg, params = _tiny_k3()
    assert cfg.num_layers % cfg.attn_res_block_size and cfg.layer_types[-1] == "mla" and cfg.num_experts_per_tok == 3
    ids = jax.random.randint(jax.random.key(5), (21,), 3, cfg.vocab_size)
    full = logits(cfg, params, ids)
    fwd = jax.jit(lambda ids, cache: forward(cfg, params, ids, cache))
    cache = init_cache(cfg, 21)
    outs = []
    for a, b in ((0, 16), (16, 17), (17, 18), (18, 19), (19, 20), (20, 21)):
        out, cache = fwd(ids[a:b], cache)
        outs.append(out)
    assert rel_rms(jnp.concatenate(outs), full) <= 1e-4


def test_k3_parts_change_the_model():
    """Each K3 switch is live: turning it off moves the logits."""
    cfg, params = _tiny_k3()
    ids = jnp.arange(3, 20)
    base = logits(cfg, params, ids)
    d = cfg.to_hf_dict()
    for off in (dict(hidden_act="silu"), dict(attn_res_block_size=None), dict(mla_use_output_gate=False)):
        other = ModelConfig.from_hf_dict({**d, **off})
        assert rel_rms(logits(other, params, ids), base) > 1e-3, off


@pytest.fixture
def k3_checkpoint(tmp_path):
    dst = tmp_path / "k3"
    shutil.copytree(os.path.join(GOLDEN, "k3_tiny_mxfp4"), dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


EXPERT = "language_model.model.layers.4.block_sparse_moe.experts.7.w3."


@pytest.mark.parametrize("change, message", [
    (lambda t: {k: v for k, v in t.items() if not k.startswith(EXPERT)},
     "missing tensor layers.4.mlp.experts.7.w3.weight_packed"),
    (lambda t: {**t, EXPERT + "weight_scale": t[EXPERT + "weight_scale"][:, :1]},
     r"tensor layers.4.mlp.experts.7.w3.weight_scale has shape \(96, 1\)"),
    (lambda t: {**t, EXPERT + "weight_packed": t[EXPERT + "weight_packed"].astype(np.float32)},
     "layers.4.mlp.experts.7.w3: MXFP4 tensors must be uint8"),
    (lambda t: {**t, "language_model.model.layers.2.self_attn.extra": np.zeros(3, np.float32)},
     "unexpected tensors .*layers.2.self_attn.extra"),
])
def test_k3_loader_errors_name_the_tensor(k3_checkpoint, change, message):
    rewrite_safetensors(k3_checkpoint, change)
    with pytest.raises(CheckpointError, match=message):
        load_hf_checkpoint(str(k3_checkpoint))


def test_the_k3_config_reads_the_release_fields():
    cfg = ModelConfig.from_json("configs/kimi_k3.json")
    assert (cfg.num_heads, cfg.moe_intermediate_size, cfg.n_shared_experts, cfg.routed_scaling_factor,
            cfg.intermediate_size, cfg.latent_moe_size, cfg.attn_res_block_size) == (96, 3072, 2, 1.0, 33792, 3584, 12)
    assert cfg.kda_lower_bound == -5.0 and cfg.full_rank_output_gate and cfg.mla_output_gate
    assert (cfg.situ_beta, cfg.situ_linear_beta, cfg.hidden_act) == (4.0, 25.0, "situ")
    wrapped = {"architectures": ["KimiK3ForConditionalGeneration"], "text_config": cfg.to_hf_dict()}
    assert ModelConfig.from_hf_dict(wrapped) == cfg
    with pytest.raises(ValueError, match="softmax"):
        ModelConfig.from_hf_dict({**cfg.to_hf_dict(), "moe_router_activation_func": "softmax"})
