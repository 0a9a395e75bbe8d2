"""The model against Hugging Face transformers (golden fixtures), and incremental equivalence."""

import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.model import CheckpointError, ModelConfig, forward, init_cache, init_params, load_hf_checkpoint, logits
from tests.helpers import rel_rms, rewrite_safetensors

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden")
CASES = ["moe_hf_form", "original_form_sharded", "dense_bf16"]


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case):
    cfg, params = load_hf_checkpoint(os.path.join(GOLDEN, case))
    g = np.load(os.path.join(GOLDEN, case, "golden.npz"))
    out = jax.jit(lambda ids: logits(cfg, params, ids))(jnp.asarray(g["token_ids"]))
    assert out.dtype == jnp.float32 and out.shape == g["logits"].shape
    assert rel_rms(out, g["logits"]) <= 1e-4


def test_golden_cases_cover_the_variants():
    cfgs = {c: load_hf_checkpoint(os.path.join(GOLDEN, c))[0] for c in CASES}
    assert "moe" in cfgs["moe_hf_form"].mlp_types and "moe" not in cfgs["dense_bf16"].mlp_types
    assert cfgs["original_form_sharded"].mlp_types[:2] == ("dense", "dense")
    assert os.path.exists(os.path.join(GOLDEN, "original_form_sharded", "model.safetensors.index.json"))
    with open(os.path.join(GOLDEN, "original_form_sharded", "config.json")) as f:
        assert "linear_attn_config" in json.load(f)


def test_both_config_forms_agree():
    hf = ModelConfig.from_json(os.path.join(GOLDEN, "moe_hf_form"))
    d = hf.to_hf_dict()
    types, mlp = d.pop("layer_types"), d.pop("mlp_layer_types")
    d["linear_attn_config"] = {
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "num_heads": hf.linear_num_heads, "head_dim": hf.linear_head_dim,
    }
    d["first_k_dense_replace"] = mlp.index("sparse")
    assert ModelConfig.from_hf_dict(d) == hf


def _model(seed=0, **over):
    with open("configs/tiny.json") as f:
        d = json.load(f)
    d.update(over)
    cfg = ModelConfig.from_hf_dict(d)
    return cfg, init_params(cfg, jax.random.key(seed))


@pytest.mark.parametrize("k3", [pytest.param(False, marks=pytest.mark.slow), True])  # True covers the same path
def test_incremental_equivalence(k3):
    over = dict(kda_lower_bound=-5.0, full_rank_output_gate=True) if k3 else {}
    cfg, params = _model(1, **over)
    ids = jax.random.randint(jax.random.key(2), (37,), 3, cfg.vocab_size)
    fwd = jax.jit(lambda ids, cache: forward(cfg, params, ids, cache))
    full = logits(cfg, params, ids)
    # Few piece lengths (each compiles once): chunked prefill of 16 + 16 + 5 tokens, then 16 + 16
    # tokens and five decode steps.
    cache = init_cache(cfg, 37)
    pieces = []
    for a, b in ((0, 16), (16, 32), (32, 37)):
        out, cache = fwd(ids[a:b], cache)
        pieces.append(out)
    assert rel_rms(jnp.concatenate(pieces), full) <= 1e-4
    cache = init_cache(cfg, 37)
    steps = []
    for a, b in ((0, 16), (16, 32)) + tuple((t, t + 1) for t in range(32, 37)):
        out, cache = fwd(ids[a:b], cache)
        steps.append(out)
    assert rel_rms(jnp.concatenate(steps), full) <= 1e-4
    assert int(cache.pos) == 37


def test_k3_gate_changes_the_model():
    cfg, params = _model(3)
    cfg3 = ModelConfig.from_hf_dict({**cfg.to_hf_dict(), "kda_lower_bound": -5.0})
    ids = jnp.arange(3, 20)
    assert rel_rms(logits(cfg3, params, ids), logits(cfg, params, ids)) > 1e-3


@pytest.fixture
def broken_checkpoint(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(os.path.join(GOLDEN, "dense_bf16"), dst)
    return dst


def test_loader_errors_name_the_tensor(broken_checkpoint):
    p = broken_checkpoint
    rewrite_safetensors(p, lambda t: {k: v for k, v in t.items() if "layers.1.self_attn.q_proj" not in k})
    with pytest.raises(CheckpointError, match="missing tensor layers.1.self_attn.q_proj.weight"):
        load_hf_checkpoint(str(p))


def test_loader_rejects_bad_shapes_and_extras(broken_checkpoint):
    p = broken_checkpoint
    rewrite_safetensors(p, lambda t: {**t, "model.norm.weight": t["model.norm.weight"][:10]})
    with pytest.raises(CheckpointError, match="norm.weight has shape"):
        load_hf_checkpoint(str(p))
    rewrite_safetensors(p, lambda t: {**t, "model.norm.weight": np.ones(64, np.float32), "model.extra.weight": np.ones(3, np.float32)})
    with pytest.raises(CheckpointError, match="unexpected tensors.*extra"):
        load_hf_checkpoint(str(p))


def test_bf16_checkpoint_keeps_its_dtype():
    _, params = load_hf_checkpoint(os.path.join(GOLDEN, "dense_bf16"))
    assert params["embed"].dtype == jnp.bfloat16


def test_commit_window_equals_running_the_prefix():
    from k3jax.model import commit_window

    cfg, params = _model(4)
    ids = jax.random.randint(jax.random.key(5), (30,), 3, cfg.vocab_size)
    fwd = jax.jit(lambda ids, cache: forward(cfg, params, ids, cache))
    verify = jax.jit(lambda ids, cache: forward(cfg, params, ids, cache, return_window=True))
    _, c0 = fwd(ids[:24], init_cache(cfg, 40))
    _, after, win = verify(ids[24:30], c0)
    one = lambda tree: jax.tree.map(lambda x: x[None], tree)  # a batch of one
    for n in (0, 2, 6):  # none, some and all of the window
        got = jax.tree.map(lambda x: x[0], commit_window(cfg, one(c0), one(after), one(win), jnp.array([n], jnp.int32)))
        _, want = fwd(ids[24 : 24 + n], c0) if n else (None, c0)
        chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
        assert rel_rms(got.kda_state, want.kda_state) <= 2e-3
        np.testing.assert_allclose(np.asarray(got.conv_state), np.asarray(want.conv_state), rtol=1e-6, atol=1e-6)
        assert int(got.pos) == 24 + n
        # What follows the committed prefix is the same as after a plain run.
        nxt = ids[24 + n : 24 + n + 1] if n < 6 else ids[:1]
        assert rel_rms(fwd(nxt, got)[0], fwd(nxt, want)[0]) <= 1e-4
