"""Kimi K3 goldens made by ``tools/make_k3_golden.py`` from the torch reference, for the shapes the
first golden (``k3_tiny``) does not have: several AttnRes blocks with a partial last one, a full
last block, blocks of one layer, MLA as the last and as the first layer, top-4 of 16 experts,
group-limited routing, q without LoRA, MoE every other layer, bf16 weights; and the serving step
against one of them."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.model import forward, hidden_states, init_cache, load_hf_checkpoint
from tests.k3jax.test_step import Row, Runner

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "fixtures", "golden")


def _shape_of(case, cfg):
    """What each fixture is there for (so a config change cannot quietly drop the case)."""
    L, B = cfg.num_layers, cfg.attn_res_block_size
    if case == "k3_blocks_mla_last":
        return (L, B, cfg.layer_types[-1], cfg.num_experts, cfg.num_experts_per_tok) == (9, 4, "mla", 16, 4)
    if case == "k3_mla_first":
        return (L % B, cfg.layer_types[0], cfg.mlp_types[:3], cfg.n_group, cfg.topk_group, cfg.q_lora_rank,
                cfg.latent_moe_norm, cfg.routed_scaling_factor) == (0, "mla", ("dense", "dense", "moe"), 4, 2, None,
                                                                    False, 2.5)
    if case == "k3_block1_freq2":
        return B == 1 and cfg.mlp_types == ("moe", "dense", "moe", "dense")
    raise KeyError(case)


@pytest.mark.parametrize("case", ["k3_blocks_mla_last", "k3_mla_first", "k3_block1_freq2"])
def test_k3_golden_shapes_match_the_reference(case):
    cfg, params = load_hf_checkpoint(os.path.join(GOLDEN, case))
    assert _shape_of(case, cfg)
    g = np.load(os.path.join(GOLDEN, case, "golden.npz"))

    @jax.jit
    def run(ids):
        out, _ = forward(cfg, params, ids, init_cache(cfg, ids.shape[0]))
        return out, *hidden_states(cfg, params, ids)

    for i in (0, 1):  # a long sequence (the sorted MoE path, chunked KDA) and a short one (gathered experts)
        out, mixed, normed = run(jnp.asarray(g[f"token_ids_{i}"]))
        np.testing.assert_allclose(out, g[f"logits_{i}"], atol=2e-3)
        np.testing.assert_allclose(mixed, g[f"final_attnres_hidden_{i}"], atol=2e-3)
        np.testing.assert_allclose(normed, g[f"final_norm_hidden_{i}"], atol=2e-3)


def test_k3_step_matches_the_reference():
    """The serving step (float32, paged) on the 9-layer golden, one step of one compilation: a
    40-token prefill row of sequence 0 and a decode row holding sequence 1's first token, each
    row's logits and greedy token against the reference's. (Steps from cached state against
    ``forward`` on a random tiny K3: ``test_step.py``.)"""
    case = "k3_blocks_mla_last"
    cfg, params = load_hf_checkpoint(os.path.join(GOLDEN, case))
    g = np.load(os.path.join(GOLDEN, case, "golden.npz"))
    a, b = g["token_ids_0"].tolist(), g["token_ids_1"].tolist()
    runner = Runner(cfg, params, jnp.float32, page_tokens=16, num_pages=8)
    lg, tok = runner.run([Row(b[:1], 0, [3], slot=6)], [Row(a[:40], 0, [0, 1, 2], slot=5)])
    for row, want in ((0, g["logits_1"][0]), (1, g["logits_0"][39])):
        np.testing.assert_allclose(lg[row], want, atol=2e-3)
        assert tok[row] == np.argmax(want)
