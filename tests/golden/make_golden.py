"""Build tiny random Kimi Linear checkpoints with Hugging Face transformers and record their logits.

Run with a Python that has torch and transformers==5.24.0 (not the project's venv), e.g.:
    python3.11 -m venv /tmp/ref && /tmp/ref/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors
    /tmp/ref/bin/python tests/golden/make_golden.py tests/fixtures/golden
Each case directory gets config.json, safetensors weights and golden.npz (token_ids, logits).
"""

import json
import os
import sys

import numpy as np
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
    v_head_dim=16, linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4, num_local_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.446,
    rms_norm_eps=1e-5, initializer_range=0.08, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
    eos_token_id=2,
)

CASES = {
    # transformers' own config form; MoE after one dense layer; MLA at layer 2.
    "moe_hf_form": dict(layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
    # the original checkpoint form (1-indexed linear_attn_config, first_k_dense_replace = 2), sharded.
    "original_form_sharded": dict(num_hidden_layers=5, original_form=dict(kda_layers=[1, 2, 4, 5], full_attn_layers=[3],
                                                                            first_k_dense_replace=2), shard=True),
    # all dense MLPs, two MLA layers, weights stored in bf16.
    "dense_bf16": dict(layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                       mlp_layer_types=["dense"] * 4, dtype="bfloat16"),
}


def randomise(model, gen):
    """Make the parameters that default to constants non-trivial."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def build(case, spec, out):
    spec = dict(spec)
    original = spec.pop("original_form", None)
    shard = spec.pop("shard", False)
    dtype = spec.pop("dtype", "float32")
    kw = {**BASE, **spec}
    if original:
        cfg = KimiLinearConfig(**kw, linear_attn_config=dict(kda_layers=original["kda_layers"],
                                                              full_attn_layers=original["full_attn_layers"]),
                               first_k_dense_replace=original["first_k_dense_replace"])
    else:
        cfg = KimiLinearConfig(**kw)
    torch.manual_seed(hash(case) % 2**31)
    gen = torch.Generator().manual_seed(len(case))
    model = KimiLinearForCausalLM(cfg).float().eval()
    randomise(model, gen)
    if dtype == "bfloat16":  # round the weights, then compute the reference in float32
        model = model.to(torch.bfloat16).float()
    path = os.path.join(out, case)
    os.makedirs(path, exist_ok=True)
    save = model.to(torch.bfloat16) if dtype == "bfloat16" else model
    save.save_pretrained(path, max_shard_size="100KB" if shard else "50GB")
    model = model.float()
    if original:  # rewrite config.json in the original checkpoint's form
        with open(os.path.join(path, "config.json")) as f:
            d = json.load(f)
        for k in ("layer_types", "mlp_layer_types"):
            d.pop(k, None)
        d["linear_attn_config"] = dict(kda_layers=original["kda_layers"], full_attn_layers=original["full_attn_layers"],
                                       head_dim=kw["linear_head_dim"], num_heads=kw["linear_num_heads"],
                                       short_conv_kernel_size=kw["linear_conv_kernel_dim"])
        d["first_k_dense_replace"] = original["first_k_dense_replace"]
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(d, f, indent=1)
    ids = torch.randint(3, kw["vocab_size"], (1, 40), generator=gen)
    with torch.no_grad():
        logits = model(ids).logits[0].float().numpy()
    np.savez(os.path.join(path, "golden.npz"), token_ids=ids[0].numpy().astype(np.int32), logits=logits)
    print(case, sorted(os.listdir(path)), float(np.abs(logits).mean()))


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/golden"
    for case, spec in CASES.items():
        build(case, spec, out)
