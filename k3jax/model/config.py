"""Model configuration: both Kimi Linear config forms read into one frozen dataclass."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields


def _expert_format(d: dict) -> str | None:
    """"mxfp4" for a compressed-tensors ``quantization_config`` in MXFP4, None for none."""
    q = d.get("quantization_config")
    if not q:
        return None
    fmt = q.get("format") or next(iter(q.get("config_groups", {}).values()), {}).get("format")
    if fmt != "mxfp4-pack-quantized":
        raise ValueError(f"quantization format {fmt!r} is not supported (mxfp4-pack-quantized)")
    return "mxfp4"


@dataclass(frozen=True)
class ModelConfig:
    """Shape and options of a Kimi Linear / K3 model.

    ``layer_types[i]`` is "kda" or "mla"; ``mlp_types[i]`` is "dense" or "moe". K3 options:
    ``kda_lower_bound`` (the lower-bound gate, e.g. -5.0; None = Kimi Linear softplus gate) and
    ``full_rank_output_gate`` (the output gate is one ``D -> HV*V`` projection instead of low rank),
    ``attn_res_block_size`` (Block Attention Residuals: the trunk mixes the embedding, the sealed
    block sums and the current block's partial sum before every sublayer), ``latent_moe_size``
    (Stable LatentMoE: routed experts work in this latent, with an RMSNorm before the up
    projection when ``latent_moe_norm``), ``hidden_act`` "situ" (SiTU-GLU with ``situ_beta`` and
    ``situ_linear_beta``), ``mla_output_gate`` (``o_proj(o * sigmoid(g_proj x))``) and
    ``expert_format`` "mxfp4" (routed experts stored as compressed-tensors MXFP4).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    linear_num_heads: int
    linear_head_dim: int
    conv_width: int = 4
    q_lora_rank: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    kda_lower_bound: float | None = None
    full_rank_output_gate: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    attn_res_block_size: int | None = None
    latent_moe_size: int | None = None
    latent_moe_norm: bool = False
    hidden_act: str = "silu"
    situ_beta: float = 1.0
    situ_linear_beta: float | None = None
    mla_output_gate: bool = False
    expert_format: str | None = None

    def __post_init__(self):
        n = len(self.layer_types)
        if len(self.mlp_types) != n:
            raise ValueError(f"{len(self.mlp_types)} mlp_types for {n} layers")
        if set(self.layer_types) - {"kda", "mla"} or set(self.mlp_types) - {"dense", "moe"}:
            raise ValueError(f"bad layer types {set(self.layer_types)} / {set(self.mlp_types)}")
        if "moe" in self.mlp_types and (self.num_experts <= 0 or self.num_experts % self.n_group):
            raise ValueError(f"num_experts={self.num_experts} must be positive and divisible by n_group={self.n_group}")
        if self.hidden_act not in ("silu", "situ"):
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (silu, situ)")
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ValueError(f"attn_res_block_size must be >= 1, got {self.attn_res_block_size}")
        if self.expert_format not in (None, "mxfp4"):
            raise ValueError(f"expert_format {self.expert_format!r} is not supported (None, 'mxfp4')")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "kda"]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "mla"]

    @property
    def qkv_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` dict in either form: transformers' own
        (``layer_types`` / ``mlp_layer_types``) or the original checkpoint's (``linear_attn_config``
        with 1-indexed ``kda_layers`` / ``full_attn_layers``, ``first_k_dense_replace``, ``moe_layer_freq``: layer
        ``i`` is MoE when ``i >= first_k_dense_replace and i % moe_layer_freq == 0``); a K3
        checkpoint's (``KimiK3ForConditionalGeneration``) text fields under ``text_config``."""
        if "text_config" in d:
            d = {**{k: v for k, v in d.items() if k != "text_config"}, **d["text_config"]}
        if d.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ValueError(f"moe_router_activation_func {d['moe_router_activation_func']!r} is not supported (sigmoid)")
        g = lambda *names, default=None: next((d[n] for n in names if d.get(n) is not None), default)
        L = d["num_hidden_layers"]
        lin = d.get("linear_attn_config") or {}
        if d.get("layer_types"):
            types = tuple("mla" if t == "full_attention" else "kda" for t in d["layer_types"])
        elif "kda_layers" in lin and "full_attn_layers" in lin:
            t = [None] * L
            for i in lin["full_attn_layers"]:
                t[i - 1] = "mla"
            for i in lin["kda_layers"]:
                t[i - 1] = "kda"
            if None in t:
                raise ValueError(f"linear_attn_config leaves layers {[i + 1 for i, x in enumerate(t) if x is None]} untyped")
            types = tuple(t)
        else:
            types = tuple("mla" if i and i % 4 == 0 else "kda" for i in range(L))
        if d.get("mlp_layer_types"):
            mlp = tuple("moe" if t == "sparse" else "dense" for t in d["mlp_layer_types"])
        else:
            k, freq = d.get("first_k_dense_replace", 1), d.get("moe_layer_freq") or 1
            mlp = tuple("moe" if i >= k and i % freq == 0 else "dense" for i in range(L))
        eos = d.get("eos_token_id")
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            moe_intermediate_size=g("moe_intermediate_size", default=d["intermediate_size"]),
            num_heads=d["num_attention_heads"], kv_lora_rank=d["kv_lora_rank"],
            qk_rope_head_dim=d["qk_rope_head_dim"], qk_nope_head_dim=d["qk_nope_head_dim"],
            v_head_dim=g("v_head_dim", default=d["qk_nope_head_dim"]), q_lora_rank=d.get("q_lora_rank"),
            layer_types=types, mlp_types=mlp,
            linear_num_heads=lin.get("num_heads", d.get("linear_num_heads", 32)),
            linear_head_dim=lin.get("head_dim", d.get("linear_head_dim", 128)),
            conv_width=lin.get("short_conv_kernel_size", d.get("linear_conv_kernel_dim", 4)),
            num_experts=g("num_local_experts", "num_experts", default=0),
            num_experts_per_tok=g("num_experts_per_tok", "num_experts_per_token", default=0),
            n_shared_experts=g("n_shared_experts", "num_shared_experts", default=1),
            n_group=g("n_group", "num_expert_group", default=1), topk_group=g("topk_group", default=1),
            routed_scaling_factor=float(g("routed_scaling_factor", default=1.0)),
            norm_topk_prob=bool(g("norm_topk_prob", "moe_renormalize", default=True)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)), tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            kda_lower_bound=g("kda_lower_bound", default=lin.get("gate_lower_bound")),
            full_rank_output_gate=bool(g("full_rank_output_gate", default=lin.get("use_full_rank_gate", False))),
            bos_token_id=d.get("bos_token_id"), eos_token_id=eos[0] if isinstance(eos, list) else eos,
            attn_res_block_size=d.get("attn_res_block_size"), latent_moe_size=d.get("routed_expert_hidden_size"),
            latent_moe_norm=bool(d.get("latent_moe_use_norm", False)), hidden_act=d.get("hidden_act", "silu"),
            situ_beta=float(d.get("activation_situ_beta") or 1.0), situ_linear_beta=d.get("activation_situ_linear_beta"),
            mla_output_gate=bool(d.get("mla_use_output_gate", False)), expert_format=_expert_format(d),
        )

    @classmethod
    def from_json(cls, path: str) -> "ModelConfig":
        """Load a config file (a checkpoint's ``config.json`` or one of ``configs/*.json``)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))

    def to_hf_dict(self) -> dict:
        """transformers' own config form (``model_type = kimi_linear``)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(
            model_type="kimi_linear", num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_heads, num_local_experts=self.num_experts,
            layer_types=["full_attention" if t == "mla" else "linear_attention" for t in self.layer_types],
            mlp_layer_types=["sparse" if t == "moe" else "dense" for t in self.mlp_types],
            linear_conv_kernel_dim=self.conv_width,
        )
        for k in ("num_heads", "mlp_types", "num_experts", "conv_width", "expert_format"):
            d.pop(k)
        for ours, hf in (("latent_moe_size", "routed_expert_hidden_size"), ("latent_moe_norm", "latent_moe_use_norm"),
                         ("situ_beta", "activation_situ_beta"), ("situ_linear_beta", "activation_situ_linear_beta"),
                         ("mla_output_gate", "mla_use_output_gate")):
            d[hf] = d.pop(ours)
        return d
