"""Load a Hugging Face ``kimi_linear`` checkpoint directory into ``(ModelConfig, params)``.

Reads single-file and sharded (``model.safetensors.index.json``) checkpoints, float32 or bf16,
in the hub's original tensor names (``q_conv1d``, ``block_sparse_moe.experts.N.w1``, ...) or
transformers' runtime names (``conv1d``, ``forget_gate.*``, ``experts.gate_up_proj``). Per-expert
weights are stacked into ``gate_up [E, 2I, D]`` and ``down [E, D, I]`` (MXFP4 ones dequantised to
float32, or kept packed: ``keep_mxfp4``). Missing, unexpected or mis-shaped tensors raise
:class:`CheckpointError` naming them.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from k3jax.model.config import ModelConfig
from k3jax.model.mxfp4 import MXFP4

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64, "I64": np.int64,
           "I32": np.int32, "U8": np.uint8}
# E2M1 (FP4) code points: bit 3 is the sign, bits 0-2 index these magnitudes.
_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


class CheckpointError(ValueError):
    """A checkpoint does not match its config."""


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one ``.safetensors`` file as read-only NumPy views of a memory map (bf16 via
    ml_dtypes): nothing is read until a tensor is used."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n) if os.path.getsize(path) > 8 + n else b""
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        a, b = meta["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype=_DTYPES[meta["dtype"]]).reshape(meta["shape"])
    return out


def _read_dir(path: str) -> dict[str, np.ndarray]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {path}")
    tensors = {}
    for fn in files:
        tensors.update(read_safetensors(os.path.join(path, fn)))
    return tensors


def _normalise(name: str) -> str:
    name = name.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")
    return re.sub(r"^model\.", "", re.sub(r"^language_model\.", "", name))


def dequantize_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """compressed-tensors MXFP4: ``packed u8[out, in / 2]`` (the even input column in the low
    nibble, E2M1 codes) and ``scale u8[out, in / 32]`` (E8M0: ``2^(s - 127)``) -> ``f32[out, in]``."""
    packed, scale = np.asarray(packed), np.asarray(scale)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    values = _FP4_VALUES[codes]
    factor = np.ldexp(np.float32(1.0), scale.astype(np.int32) - 127).astype(np.float32)
    return (values.reshape(*scale.shape, -1) * factor[..., None]).reshape(values.shape)


class HFCheckpoint:
    """A checkpoint directory read a layer at a time: the safetensors are memory-mapped, so a
    tensor's bytes are read when :meth:`layer` or :meth:`top` takes it (a loader that places
    each layer before taking the next never holds the whole model in host memory).

    Args: ``path``; ``dtype`` and ``keep_mxfp4`` as in :func:`load_hf_checkpoint`.
    """

    def __init__(self, path: str, dtype=None, keep_mxfp4: bool = False):
        self.path, self.dtype, self.keep_mxfp4 = path, dtype, keep_mxfp4
        self.cfg = ModelConfig.from_json(path)
        self.raw = {_normalise(k): v for k, v in _read_dir(path).items()}
        self.used: set[str] = set()

    def take(self, name, shape, cast=True):
        if name not in self.raw:
            raise CheckpointError(f"missing tensor {name} in {self.path}")
        a = self.raw[name]
        if a.size == int(np.prod(shape)) and a.squeeze().shape == tuple(d for d in shape if d != 1):
            a = a.reshape(shape)  # e.g. A_log stored as [1, 1, HV, 1]
        if tuple(a.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name} has shape {tuple(a.shape)}, config expects {tuple(shape)}")
        self.used.add(name)
        return jnp.asarray(a if self.dtype is None or not cast else a.astype(self.dtype))

    def _a_log(self, name):
        """``A_log [HV]``; K3 checkpoints store ``[head_dim]`` of which the first HV are used."""
        HV = self.cfg.linear_num_heads
        a = self.raw.get(name)
        if a is not None and a.ndim == 1 and a.shape[0] > HV:
            self.raw[name] = a[:HV]
        return self.take(name, (HV,))

    def _expert(self, name, shape):
        """A routed expert's ``[out, in]`` weight: dense, or MXFP4 dequantised to float32 (or kept
        packed: ``keep_mxfp4``)."""
        if self.cfg.expert_format != "mxfp4":
            return self.take(name + ".weight", shape)
        out, inp = shape
        packed = self.take(name + ".weight_packed", (out, inp // 2), cast=False)
        scale = self.take(name + ".weight_scale", (out, inp // 32), cast=False)
        if packed.dtype != jnp.uint8 or scale.dtype != jnp.uint8:
            raise CheckpointError(f"{name}: MXFP4 tensors must be uint8, got {packed.dtype} / {scale.dtype}")
        if self.keep_mxfp4:
            return MXFP4(packed, scale)
        w = dequantize_mxfp4(np.asarray(packed), np.asarray(scale))
        return jnp.asarray(w if self.dtype is None else w.astype(self.dtype))

    def _kda(self, a):
        cfg, take = self.cfg, self.take
        D, HVK, K, HV, W = cfg.hidden_size, cfg.qkv_dim, cfg.linear_head_dim, cfg.linear_num_heads, cfg.conv_width
        attn = {n: take(a + f"{n}_proj.weight", (HVK, D)) for n in ("q", "k", "v")}
        if a + "conv1d.weight" in self.raw:
            attn["conv"] = take(a + "conv1d.weight", (3 * HVK, 1, W)).reshape(3 * HVK, W)
        else:
            attn["conv"] = jnp.concatenate([take(a + f"{n}_conv1d.weight", (HVK, 1, W)).reshape(HVK, W)
                                            for n in ("q", "k", "v")])
        attn.update(
            f_a=take(a + "f_a_proj.weight", (K, D)), f_b=take(a + "f_b_proj.weight", (HVK, K)),
            dt_bias=take(a + "dt_bias", (HVK,)), A_log=self._a_log(a + "A_log"),
            b=take(a + "b_proj.weight", (HV, D)), o_norm=take(a + "o_norm.weight", (K,)),
            o=take(a + "o_proj.weight", (D, HVK)),
        )
        if cfg.full_rank_output_gate:
            attn["g"] = take(a + "g_proj.weight", (HVK, D))
        else:
            attn.update(g_a=take(a + "g_a_proj.weight", (K, D)), g_b=take(a + "g_b_proj.weight", (HVK, K)))
        return attn

    def _mla(self, a):
        cfg, take, D = self.cfg, self.take, self.cfg.hidden_size
        nh, qk, L = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank
        attn = {}
        if cfg.q_lora_rank is None:
            attn["q"] = take(a + "q_proj.weight", (nh * qk, D))
        else:
            attn.update(q_a=take(a + "q_a_proj.weight", (cfg.q_lora_rank, D)),
                        q_a_norm=take(a + "q_a_layernorm.weight", (cfg.q_lora_rank,)),
                        q_b=take(a + "q_b_proj.weight", (nh * qk, cfg.q_lora_rank)))
        attn.update(
            kv_a=take(a + "kv_a_proj_with_mqa.weight", (L + cfg.qk_rope_head_dim, D)),
            kv_a_norm=take(a + "kv_a_layernorm.weight", (L,)),
            kv_b=take(a + "kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), L)),
            o=take(a + "o_proj.weight", (D, nh * cfg.v_head_dim)),
        )
        if cfg.mla_output_gate:
            attn["g"] = take(a + "g_proj.weight", (nh * cfg.v_head_dim, D))
        return attn

    def _moe(self, m):
        cfg, take, D = self.cfg, self.take, self.cfg.hidden_size
        E, I, Z = cfg.num_experts, cfg.moe_intermediate_size, cfg.latent_moe_size or D
        if m + "experts.gate_up_proj" in self.raw:
            gate_up = take(m + "experts.gate_up_proj", (E, 2 * I, Z))
            down = take(m + "experts.down_proj", (E, Z, I))
        else:
            e = m + "experts.{}.{}"
            cat = lambda *ws: jax.tree.map(lambda *a: jnp.concatenate(a), *ws)  # arrays or MXFP4
            stack = lambda ws: jax.tree.map(lambda *a: jnp.stack(a), *ws)
            gate_up = stack([cat(self._expert(e.format(j, "w1"), (I, Z)), self._expert(e.format(j, "w3"), (I, Z)))
                             for j in range(E)])
            down = stack([self._expert(e.format(j, "w2"), (Z, I)) for j in range(E)])
        Is = I * cfg.n_shared_experts
        mlp = dict(
            router=take(m + "gate.weight", (E, D)), bias=take(m + "gate.e_score_correction_bias", (E,)),
            gate_up=gate_up, down=down,
            shared=dict(gate=take(m + "shared_experts.gate_proj.weight", (Is, D)),
                        up=take(m + "shared_experts.up_proj.weight", (Is, D)),
                        down=take(m + "shared_experts.down_proj.weight", (D, Is))),
        )
        if cfg.latent_moe_size:
            mlp.update(latent_down=take(m + "routed_expert_down_proj.weight", (Z, D)),
                       latent_up=take(m + "routed_expert_up_proj.weight", (D, Z)))
            if cfg.latent_moe_norm:
                mlp["latent_norm"] = take(m + "routed_expert_norm.weight", (Z,))
        return mlp

    def layer(self, i: int) -> dict:
        """Layer ``i``'s params (as in :mod:`k3jax.model.model`)."""
        cfg, take, D = self.cfg, self.take, self.cfg.hidden_size
        pre = f"layers.{i}."
        attn = self._kda(pre + "self_attn.") if cfg.layer_types[i] == "kda" else self._mla(pre + "self_attn.")
        m = pre + "mlp."
        if cfg.mlp_types[i] == "dense":
            I = cfg.intermediate_size
            mlp = dict(gate=take(m + "gate_proj.weight", (I, D)), up=take(m + "up_proj.weight", (I, D)),
                       down=take(m + "down_proj.weight", (D, I)))
        else:
            mlp = self._moe(m)
        layer = dict(input_norm=take(pre + "input_layernorm.weight", (D,)),
                     post_norm=take(pre + "post_attention_layernorm.weight", (D,)), attn=attn, mlp=mlp)
        if cfg.attn_res_block_size:
            layer.update(attn_res_proj=take(pre + "self_attention_res_proj.weight", (D,)),
                         attn_res_norm=take(pre + "self_attention_res_norm.weight", (D,)),
                         mlp_res_proj=take(pre + "mlp_res_proj.weight", (D,)),
                         mlp_res_norm=take(pre + "mlp_res_norm.weight", (D,)))
        return layer

    def top(self) -> dict:
        """The params outside the layers: embedding, final norm, AttnRes output mix, LM head."""
        cfg, take, D = self.cfg, self.take, self.cfg.hidden_size
        params = dict(embed=take("embed_tokens.weight", (cfg.vocab_size, D)), norm=take("norm.weight", (D,)))
        if cfg.attn_res_block_size:
            params.update(out_res_proj=take("output_attn_res_proj.weight", (D,)),
                          out_res_norm=take("output_attn_res_norm.weight", (D,)))
        if not cfg.tie_word_embeddings:
            params["lm_head"] = take("lm_head.weight", (cfg.vocab_size, D))
        return params

    def check_all_taken(self):
        """After every layer and the top were taken: :class:`CheckpointError` for tensors none took."""
        unexpected = sorted(set(self.raw) - self.used)
        if unexpected:
            raise CheckpointError(f"unexpected tensors in {self.path}: {unexpected[:8]}"
                                  f"{' ...' if len(unexpected) > 8 else ''}")


def load_hf_checkpoint(path: str, dtype=None, keep_mxfp4: bool = False):
    """Read ``config.json`` and the safetensors weights of a Kimi Linear checkpoint.

    Args:
      path: checkpoint directory.
      dtype: cast every weight to this dtype (default: keep the stored dtype).
      keep_mxfp4: MXFP4 routed experts stay packed: ``gate_up`` and ``down`` as
        :class:`k3jax.model.mxfp4.MXFP4` (``axis=-1``; ``dtype`` does not apply to them).
    Returns:
      ``(config, params)``; params as described in :mod:`k3jax.model.model`.
    """
    ck = HFCheckpoint(path, dtype, keep_mxfp4)
    params = dict(ck.top(), layers=[ck.layer(i) for i in range(ck.cfg.num_layers)])
    ck.check_all_taken()
    return ck.cfg, params
