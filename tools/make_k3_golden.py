"""Make tiny random Kimi K3 golden fixtures from the torch reference modeling code.

Run with a separate torch venv (torch is not a project dependency), e.g.::

    /root/.pyenv/versions/3.12.1/bin/python3.12 -m venv /tmp/torchvenv
    /tmp/torchvenv/bin/pip install torch numpy safetensors einops "transformers==4.56.2"
    /tmp/torchvenv/bin/python tools/make_k3_golden.py                      # every fixture below
    /tmp/torchvenv/bin/python tools/make_k3_golden.py --only k3_blocks_mla_last

The reference is ``/work/shared/refs/kimi_k3_reference/`` (``--ref``): the HF-style K3 modeling
code (MindSpeed-MM ``modeling_kimi_linear.py`` @ 57069cd), its pure-torch chunked KDA and vLLM
0.33.0's ``KimiLinearConfig``, used unmodified. They are copied into a temporary package laid out
as the code imports it, with the minimal CPU shims of ``tests/fixtures/golden/k3_tiny/README.md``:

1. ``mindspeed_mm.fsdp.utils.device`` with ``IS_NPU_AVAILABLE = False``;
2. a stub ``fla``: ``ShortConvolution`` as a depthwise causal ``nn.Conv1d`` (``weight [C, 1, W]``,
   ``silu(conv1d(pad(x^T, (W - 1, 0)), weight, groups=C))^T``, returns ``(y, None)``),
   ``tensor_cache`` an identity decorator, ``chunk_kda`` / ``fused_recurrent_kda`` raising;
3. ``config.kda_implementation = "naive"`` (runtime attribute, not in config.json);
4. ``model.config._attn_implementation = "eager"`` after construction;
5. ``transformers.configuration_utils.PreTrainedConfig = PretrainedConfig``.

Each fixture directory gets ``config.json`` (the real ``KimiK3ForConditionalGeneration`` layout,
K3 fields under ``text_config``), ``model.safetensors`` (real checkpoint names under
``language_model.``; ``A_log`` stored as ``[head_dim]`` of which the first ``num_heads`` are
used) and ``golden.npz``: ``token_ids_{i}`` int32 [T_i], ``logits_{i}`` fp32 [T_i, V],
``final_attnres_hidden_{i}`` (the final AttnRes mix, the input of ``model.norm``) and
``final_norm_hidden_{i}`` (the lm_head input), each sequence run alone (batch 1, fp32, CPU,
full-sequence forward, ``use_cache=False``). Every parameter is drawn at random (no default left:
norms, ``A_log``, ``dt_bias``, ``e_score_correction_bias``, ``*_res_proj``). A ``"bf16"`` fixture
rounds its weights to bf16 before the reference runs and stores them as bf16, except ``A_log``,
``dt_bias``, the convs and ``o_norm`` (fp32, as in the real checkpoint).

Checks made here: every routing decision (the top-k and, with expert groups, the top groups) has a
margin of at least ``MIN_MARGIN`` in the selection scores, so fp32 rounding cannot flip an expert;
the logits of a prefix run equal the full run's first rows (causality); reloading
``model.safetensors`` gives back the exact weights the reference ran with.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

REF = "/work/shared/refs/kimi_k3_reference"
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "golden")
MIN_MARGIN = 1e-4

# Fields every fixture shares (the K3 values where they are not shapes).
BASE = dict(
    activation_situ_beta=4.0, activation_situ_linear_beta=25.0, hidden_act="situ", mla_use_nope=True,
    mla_use_output_gate=True, moe_router_activation_func="sigmoid", moe_renormalize=True, moe_layer_freq=1,
    topk_method="noaux_tc", use_grouped_topk=True, rms_norm_eps=1e-5, tie_word_embeddings=False,
    num_nextn_predict_layers=0, initializer_range=0.02, max_position_embeddings=4096, rope_theta=10000.0,
    use_cache=True, latent_moe_use_norm=True, routed_scaling_factor=1.0, num_expert_group=1, topk_group=1,
)

FIXTURES = {
    # 9 layers in AttnRes blocks of 4: blocks {0-3}, {4-7} sealed and {8} partial (final mix over
    # 4 sources); MLA at layers 3 and 8 (the last layer); 16 experts top-4; fp32. T=3 takes
    # k3jax's few-token MoE path (3 * 4 <= 16), T=70 the sorted one and two KDA chunks.
    "k3_blocks_mla_last": dict(
        seed=2, bf16=False, lengths=(70, 3),
        text=dict(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=9, attn_res_block_size=4,
            first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=16, num_experts_per_token=4,
            num_shared_experts=2, moe_intermediate_size=12, routed_expert_hidden_size=16,
            linear_attn_config=dict(kda_layers=[1, 2, 3, 5, 6, 7, 8], full_attn_layers=[4, 9], num_heads=2,
                                    head_dim=16, short_conv_kernel_size=4, use_full_rank_gate=True,
                                    gate_lower_bound=-5.0),
        ),
    ),
    # 6 layers in AttnRes blocks of 3 (the last block full, sealed never: final mix over 3
    # sources); MLA first (layers 0 and 4) with q_proj (no q LoRA); two dense layers; 8 experts in
    # 4 groups, top-2 groups, top-3, routed scaling 2.5, no latent norm; bf16 weights.
    "k3_mla_first": dict(
        seed=2, bf16=True, lengths=(45, 2),
        text=dict(
            vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=6, attn_res_block_size=3,
            first_k_dense_replace=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, num_experts=8,
            num_experts_per_token=3, num_expert_group=4, topk_group=2, num_shared_experts=1,
            moe_intermediate_size=16, routed_expert_hidden_size=24, latent_moe_use_norm=False,
            routed_scaling_factor=2.5,
            linear_attn_config=dict(kda_layers=[2, 3, 4, 6], full_attn_layers=[1, 5], num_heads=3, head_dim=16,
                                    short_conv_kernel_size=4, use_full_rank_gate=True, gate_lower_bound=-5.0),
        ),
    ),
    # 4 layers in AttnRes blocks of 1 (every layer seals a block: final mix over 5 sources); no
    # dense first layer and MoE every other layer (moe_layer_freq 2: MoE at 0 and 2, dense at 1
    # and 3); 4 experts top-2, one shared expert. T=1 takes the few-token MoE path.
    "k3_block1_freq2": dict(
        seed=3, bf16=False, lengths=(20, 1),
        text=dict(
            vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=4, attn_res_block_size=1,
            first_k_dense_replace=0, moe_layer_freq=2, num_attention_heads=2, num_key_value_heads=2,
            q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_experts=4,
            num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=16, routed_expert_hidden_size=16,
            linear_attn_config=dict(kda_layers=[1, 3, 4], full_attn_layers=[2], num_heads=2, head_dim=16,
                                    short_conv_kernel_size=4, use_full_rank_gate=True, gate_lower_bound=-5.0),
        ),
    ),
}

FLA_MODULES = '''
import torch
import torch.nn.functional as F
from torch import nn


class ShortConvolution(nn.Conv1d):
    """Causal depthwise conv + SiLU, plain torch (CPU shim for fla.modules.ShortConvolution)."""

    def __init__(self, hidden_size, kernel_size, activation="silu", bias=False, **kwargs):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=False)
        assert activation == "silu"

    def forward(self, x, cache=None, output_final_state=False, cu_seqlens=None, **kwargs):
        assert cache is None and cu_seqlens is None
        W = self.kernel_size[0]
        y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), self.weight, groups=self.in_channels)
        return F.silu(y).transpose(1, 2), None
'''

FLA_KDA = '''
def chunk_kda(*args, **kwargs):
    raise RuntimeError("fla chunk_kda is not available (CPU shim): use kda_implementation='naive'")


def fused_recurrent_kda(*args, **kwargs):
    raise RuntimeError("fla fused_recurrent_kda is not available (CPU shim)")
'''


def build_package(ref: str, root: str):
    """The reference files laid out as the package the modeling code imports, plus the shims."""
    def write(rel, text=""):
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    for pkg in ("mindspeed_mm", "mindspeed_mm/fsdp", "mindspeed_mm/fsdp/utils", "mindspeed_mm/fsdp/models",
                "mindspeed_mm/fsdp/models/kimi_k3", "mindspeed_mm/fsdp/ops", "mindspeed_mm/fsdp/ops/kda",
                "fla", "fla/ops"):
        write(f"{pkg}/__init__.py")
    write("mindspeed_mm/fsdp/utils/device.py", "IS_NPU_AVAILABLE = False\n")
    write("fla/modules/__init__.py", FLA_MODULES)
    write("fla/utils.py", "def tensor_cache(fn):\n    return fn\n")
    write("fla/ops/kda/__init__.py", FLA_KDA)
    shutil.copy(os.path.join(ref, "modeling_kimi_linear.py"), os.path.join(root, "mindspeed_mm/fsdp/models/kimi_k3/"))
    shutil.copy(os.path.join(ref, "configuration_kimi_k3.py"), os.path.join(root, "mindspeed_mm/fsdp/models/kimi_k3/"))
    shutil.copy(os.path.join(ref, "chunk_kda_naive.py"), os.path.join(root, "mindspeed_mm/fsdp/ops/kda/"))
    sys.path.insert(0, root)


def text_config(spec) -> dict:
    t = {**BASE, **spec["text"]}
    t.update(model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], dtype="float32",
             bos_token_id=t["vocab_size"] - 4, eos_token_id=t["vocab_size"] - 3, pad_token_id=t["vocab_size"] - 1,
             auto_map={"AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
                       "AutoModel": "modeling_kimi_linear.KimiLinearModel",
                       "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM"})
    if spec["bf16"]:
        t["dtype"] = "bfloat16"
    return dict(sorted(t.items()))


def full_config(t: dict) -> dict:
    V = t["vocab_size"]
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                     "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
                     "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
        "bos_token_id": t["bos_token_id"], "dtype": t["dtype"], "eos_token_id": t["eos_token_id"],
        "ignore_index": -100, "image_placeholder": "<|kimi_image_placeholder|>",
        "media_placeholder_token_id": V - 2, "model_type": "kimi_k3", "pad_token_id": t["pad_token_id"],
        "text_config": t, "tie_word_embeddings": False,
    }


FP32_KEEP = ("A_log", "dt_bias", "conv1d.weight", "o_norm.weight")


def randomise(model, cfg, gen, bf16: bool):
    """Every parameter random (no default left); returns the stored ``A_log [head_dim]`` per name."""
    import torch
    stored_a_log = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if name.endswith("A_log"):
                full = torch.log(torch.empty(cfg.linear_attn_config["head_dim"]).uniform_(1, 16, generator=gen))
                stored_a_log[name] = full
                p.copy_(full[: shape[0]])
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(shape, generator=gen))
            elif name.endswith("_res_proj.weight"):
                p.copy_(0.3 * torch.randn(shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(0.4 * torch.randn(shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(shape, generator=gen))
            else:  # Linear [out, in] (incl. the router): variance preserving
                p.copy_(torch.randn(shape, generator=gen) / shape[-1] ** 0.5)
            if bf16 and not any(name.endswith(k) for k in FP32_KEEP):
                p.copy_(p.bfloat16().float())
    return stored_a_log


class RoutingMargins:
    """Forward hooks on every router: the smallest gap, over tokens, between the k-th and the
    (k+1)-th selection score (and, with expert groups, between the kept and the dropped groups)."""

    def __init__(self, model):
        import torch
        from mindspeed_mm.fsdp.models.kimi_k3.modeling_kimi_linear import KimiMoEGate
        self.margin = float("inf")

        def hook(gate, inputs, _out):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            choice = torch.sigmoid(x @ gate.weight.float().T) + gate.e_score_correction_bias[None]
            G, E = gate.num_expert_group, gate.num_experts
            if G > 1 and G > gate.topk_group:
                gs = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1).sort(-1, descending=True)[0]
                self.margin = min(self.margin, float((gs[:, gate.topk_group - 1] - gs[:, gate.topk_group]).min()))
                keep = gs[:, gate.topk_group - 1 : gate.topk_group]
                full = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
                mask = (full >= keep).repeat_interleave(E // G, dim=1)
                choice = choice.masked_fill(~mask, float("-inf"))
            s = choice.sort(-1, descending=True)[0]
            k = gate.top_k
            if k < E:
                gap = s[:, k - 1] - s[:, k]
                self.margin = min(self.margin, float(gap[torch.isfinite(gap)].min()))

        for m in model.modules():
            if isinstance(m, KimiMoEGate):
                m.register_forward_hook(hook)


def make(name: str, spec: dict, out_root: str, tries: int = 1):
    """Make one fixture; with ``tries > 1`` the next seeds are tried while a routing margin is too
    small (then put the seed printed into ``FIXTURES``)."""
    for seed in range(spec["seed"], spec["seed"] + tries):
        if _make(name, {**spec, "seed": seed}, out_root, last=seed == spec["seed"] + tries - 1):
            return


def _make(name: str, spec: dict, out_root: str, last: bool) -> bool:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.configuration_utils import PretrainedConfig
    import transformers.configuration_utils as cu
    cu.PreTrainedConfig = PretrainedConfig  # shim 5
    from mindspeed_mm.fsdp.models.kimi_k3.configuration_kimi_k3 import KimiLinearConfig
    from mindspeed_mm.fsdp.models.kimi_k3.modeling_kimi_linear import KimiLinearForCausalLM

    torch.manual_seed(spec["seed"])
    gen = torch.Generator().manual_seed(spec["seed"])
    t = text_config(spec)
    cfg = KimiLinearConfig(**{k: v for k, v in t.items() if k not in ("architectures", "auto_map", "dtype")})
    cfg.kda_implementation = "naive"  # shim 3
    model = KimiLinearForCausalLM(cfg).float().eval()
    model.config._attn_implementation = "eager"  # shim 4
    stored_a_log = randomise(model, cfg, gen, spec["bf16"])
    margins = RoutingMargins(model)

    final_mix = {}
    model.model.norm.register_forward_pre_hook(lambda _m, args: final_mix.__setitem__("h", args[0].detach().clone()))

    def run(ids):
        with torch.no_grad():
            out = model(input_ids=torch.as_tensor(ids[None], dtype=torch.long), use_cache=False)
            h = out.hidden_states
            return model.lm_head(h).float()[0].numpy(), final_mix["h"][0].numpy(), h[0].numpy()

    rng = np.random.default_rng(spec["seed"])
    golden = {}
    for i, T in enumerate(spec["lengths"]):
        ids = rng.integers(0, t["vocab_size"], T).astype(np.int32)
        lg, mixed, normed = run(ids)
        golden.update({f"token_ids_{i}": ids, f"logits_{i}": lg.astype(np.float32),
                       f"final_attnres_hidden_{i}": mixed.astype(np.float32),
                       f"final_norm_hidden_{i}": normed.astype(np.float32)})
        if T > 8:  # causality: a prefix run reproduces the first rows
            pre, _, _ = run(ids[: T // 2])
            assert np.abs(pre - lg[: T // 2]).max() < 1e-4, "reference output is not causal"
    if margins.margin < MIN_MARGIN:
        print(f"{name}: seed {spec['seed']}: routing margin {margins.margin:.2e} < {MIN_MARGIN}")
        if last:
            raise SystemExit(f"{name}: no seed with a routing margin of {MIN_MARGIN}: try --tries")
        return False

    d = os.path.join(out_root, name)
    os.makedirs(d, exist_ok=True)
    tensors = {}
    for k, v in model.state_dict().items():
        v = stored_a_log.get(k, v).detach().contiguous()
        if spec["bf16"] and not any(k.endswith(s) for s in FP32_KEEP):
            v = v.bfloat16()
        tensors["language_model." + k] = v
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    os.chmod(os.path.join(d, "model.safetensors"), 0o644)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(full_config(t), f, indent=2)
        f.write("\n")
    np.savez_compressed(os.path.join(d, "golden.npz"), **golden)

    # Reloading gives back the weights the reference ran with (bf16 ones exactly, after rounding).
    back = load_file(os.path.join(d, "model.safetensors"))
    for k, v in model.state_dict().items():
        w = back["language_model." + k].float()
        if k in stored_a_log:
            w = w[: v.shape[0]]
        assert torch.equal(w, v.float()), k
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    print(f"{name}: seed {spec['seed']}, {len(tensors)} tensors, {size / 1e6:.2f} MB, routing margin {margins.margin:.2e}, "
          f"max |logit| {max(np.abs(golden[k]).max() for k in golden if k.startswith('logits')):.2f}")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default=REF, help="the reference files (modeling, config, naive KDA)")
    ap.add_argument("--out", default=OUT, help="where the fixture directories go")
    ap.add_argument("--only", nargs="*", default=None, help="fixture names (default: all)")
    ap.add_argument("--tries", type=int, default=1, help="seeds to try per fixture (routing margins)")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        build_package(args.ref, root)
        for name in args.only or FIXTURES:
            make(name, FIXTURES[name], args.out, args.tries)


if __name__ == "__main__":
    main()
