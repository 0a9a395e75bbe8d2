"""The Kimi Linear / K3 forward pass as pure functions over a params pytree.

One code path serves the golden no-cache forward, chunked prefill and decode: ``forward`` takes
caches in and returns them out (KDA recurrent state, short-conv state, MLA latent KV). Kernels
are injected through :class:`Kernels` (default: the pure-JAX references).

Params (weights in Hugging Face ``[out, in]`` orientation; K3's additions in brackets):
``embed [V, D]``, ``norm [D]``, ``lm_head [V, D]``, and per layer ``input_norm``, ``post_norm``, an
``attn`` dict (KDA: ``q, k, v [HV*K, D]``, ``conv [3*HV*K, W]``, ``f_a [K, D]``, ``f_b [HV*K, K]``,
``dt_bias [HV*K]``, ``A_log [HV]``, ``b [HV, D]``, ``g_a [K, D]`` + ``g_b [HV*K, K]`` or ``g [HV*K, D]``,
``o_norm [K]``, ``o [D, HV*K]``; MLA: ``q [nh*(nope+rope), D]`` or ``q_a``/``q_a_norm``/``q_b``,
``kv_a [L+R, D]``, ``kv_a_norm [L]``, ``kv_b [nh*(nope+v), L]``, ``o [D, nh*v]``, [``g [nh*v, D]``]) and
an ``mlp`` dict (dense: ``gate, up [I, D]``, ``down [D, I]``; MoE: ``router [E, D]``, ``bias [E]``,
``gate_up [E, 2I, Z]``, ``down [E, Z, I]`` (arrays, or packed :class:`~k3jax.model.mxfp4.MXFP4`),
``shared`` dense MLP, [``latent_down [Z, D]``, ``latent_up [D, Z]``, ``latent_norm [Z]``], ``Z = D``
without a latent); [per layer ``attn_res_proj, attn_res_norm, mlp_res_proj, mlp_res_norm [D]``;
top level ``out_res_proj, out_res_norm [D]``].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from k3jax.model.config import ModelConfig
from k3jax.model.mxfp4 import dense
from k3jax.ops.conv import short_conv
from k3jax.ops.kda import chunk_kda, kda_commit, kda_gate, l2norm, naive_recurrent_kda

HIGHEST = jax.lax.Precision.HIGHEST
f32 = jnp.float32


@dataclass(frozen=True)
class Kernels:
    """Device ops the model calls; ``serving`` passes the Pallas set for its device.

    Pieces of at most ``recurrent_max_t`` tokens (decode steps, speculative windows, the tail
    pieces of a prefill) run through ``recurrent_kda`` (token by token): the chunked form would
    pad them to a whole chunk. ``kda_commit`` rebuilds states after a speculative window's
    accepted prefix (:func:`commit_window`), with the signature of
    :func:`k3jax.ops.kda.kda_commit` (a dense state batch).
    """

    chunk_kda: Callable = chunk_kda
    short_conv: Callable = short_conv
    recurrent_kda: Callable = naive_recurrent_kda
    recurrent_max_t: int = 16
    kda_commit: Callable = kda_commit


class ModelCache(NamedTuple):
    """Per-sequence caches. ``kda_state f32[n_kda, HV, K, V]``, ``conv_state f32[n_kda, W - 1, 3*HV*K]``,
    ``mla_kv f32[n_mla, S_max, L + R]`` (normalised latent and the rope part), ``pos i32[]`` tokens seen."""

    kda_state: jax.Array
    conv_state: jax.Array
    mla_kv: jax.Array
    pos: jax.Array


def init_cache(cfg: ModelConfig, max_len: int) -> ModelCache:
    """Empty caches for a sequence of up to ``max_len`` tokens."""
    nk, nm = len(cfg.kda_layers), len(cfg.mla_layers)
    HV, K = cfg.linear_num_heads, cfg.linear_head_dim
    return ModelCache(
        kda_state=jnp.zeros((nk, HV, K, K), f32),
        conv_state=jnp.zeros((nk, cfg.conv_width - 1, 3 * cfg.qkv_dim), f32),
        mla_kv=jnp.zeros((nm, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim), f32),
        pos=jnp.zeros((), jnp.int32),
    )


def linear(x, w):
    """``x @ w.T`` in float32 (``w`` in ``[out, in]`` orientation)."""
    return jnp.einsum("...i,oi->...o", x, w.astype(f32), precision=HIGHEST)


def rms_norm(x, w, eps):
    x = x.astype(f32)
    return w.astype(f32) * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def glu(cfg: ModelConfig, gate, up):
    """The gated activation: ``silu(gate) * up``, or K3's SiTU-GLU
    ``b1 tanh(gate / b1) sigmoid(gate) * b2 tanh(up / b2)`` (``b2`` None: ``up`` as is), in float32."""
    gate, up = gate.astype(f32), up.astype(f32)
    if cfg.hidden_act == "silu":
        return jax.nn.silu(gate) * up
    b1, b2 = cfg.situ_beta, cfg.situ_linear_beta
    if b2 is not None:
        up = b2 * jnp.tanh(up / b2)
    return b1 * jnp.tanh(gate / b1) * jax.nn.sigmoid(gate) * up


def mlp(cfg: ModelConfig, p, x):
    return linear(glu(cfg, linear(x, p["gate"]), linear(x, p["up"])), p["down"])


def attn_res_mix(sources, proj, norm, eps, live=None):
    """Block Attention Residuals: ``sum_j softmax_j(logit) src_j`` over ``sources [S, T, D]`` with
    ``logit_j = sum_c RMSNorm(src_j)[c] norm[c] proj[c]`` (no 1/sqrt(D)); only the sources where
    ``live bool[S]`` (all when None; the others must be finite). Returns ``f32[T, D]``."""
    src = sources.astype(f32)
    unit = src * jax.lax.rsqrt(jnp.mean(src * src, axis=-1, keepdims=True) + eps)
    logit = jnp.einsum("std,d->st", unit, norm.astype(f32) * proj.astype(f32), precision=HIGHEST)
    if live is not None:
        logit = jnp.where(live[:, None], logit, -jnp.inf)
    return jnp.einsum("st,std->td", jax.nn.softmax(logit, axis=0), src, precision=HIGHEST)


class WindowInputs(NamedTuple):
    """What one KDA layer needs to rebuild its state after any prefix of a speculative window
    (the projection cache): post-conv, L2-normalised ``k [T, HV, K]``, ``v [T, HV, V]``,
    ``g [T, HV, K]``, ``beta [T, HV]``, and the raw pre-conv inputs ``raw [T, 3*HV*K]``."""

    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array
    raw: jax.Array


def kda_attention(cfg: ModelConfig, p, x, state, conv_state, kernels: Kernels):
    """KDA sublayer for ``x [T, D]`` from ``state [HV, K, V]`` and ``conv_state [W - 1, 3*HV*K]``.

    Returns ``(out [T, D], state, conv_state, WindowInputs)``."""
    T = x.shape[0]
    HV, K = cfg.linear_num_heads, cfg.linear_head_dim
    raw = jnp.concatenate([linear(x, p["q"]), linear(x, p["k"]), linear(x, p["v"])], axis=-1)
    qkv, conv_state = kernels.short_conv(raw[None], p["conv"], activation="silu", initial_state=conv_state[None])
    q, k, v = (a.reshape(1, T, HV, K) for a in jnp.split(qkv[0], 3, axis=-1))
    g = kda_gate(linear(linear(x, p["f_a"]), p["f_b"]).reshape(1, T, HV, K), p["A_log"].reshape(HV), p["dt_bias"],
                 lower_bound=cfg.kda_lower_bound)
    beta = jax.nn.sigmoid(linear(x, p["b"]))[None]
    q, k = l2norm(q), l2norm(k)
    kda = kernels.recurrent_kda if T <= kernels.recurrent_max_t else kernels.chunk_kda
    o, state = kda(q, k, v, g, beta, initial_state=state[None])
    gate = linear(x, p["g"]) if "g" in p else linear(linear(x, p["g_a"]), p["g_b"])
    o = rms_norm(o[0], p["o_norm"], cfg.rms_norm_eps) * jax.nn.sigmoid(gate.reshape(T, HV, K))
    window = WindowInputs(k[0], v[0], g[0], beta[0], raw)
    return linear(o.reshape(T, HV * K), p["o"]), state[0], conv_state[0], window


def mla_inputs(cfg: ModelConfig, p, x, linear=linear):
    """MLA's projections of ``x [T, D]``: queries ``[T, nh, nope + rope]`` (through the q LoRA
    when the model has one) and the cached latents ``[T, L + R]`` (the normalised ``kv_a``
    latent and the rope part); ``linear`` is the matmul (the serving step passes its own)."""
    L = cfg.kv_lora_rank
    if "q" in p:
        q = linear(x, p["q"])
    else:
        q = linear(rms_norm(linear(x, p["q_a"]), p["q_a_norm"], cfg.rms_norm_eps), p["q_b"])
    ckv = linear(x, p["kv_a"])
    latent = jnp.concatenate([rms_norm(ckv[:, :L], p["kv_a_norm"], cfg.rms_norm_eps), ckv[:, L:]], axis=-1)
    return q.reshape(x.shape[0], cfg.num_heads, -1), latent


def latent_moe_out(cfg: ModelConfig, p, y, linear=linear):
    """Stable LatentMoE's way back from the experts' latent ``y``: RMSNorm (when
    ``latent_moe_norm``) and ``latent_up``; ``y`` unchanged without a latent."""
    if not cfg.latent_moe_size:
        return y
    if cfg.latent_moe_norm:
        y = rms_norm(y, p["latent_norm"], cfg.rms_norm_eps)
    return linear(y, p["latent_up"])


def mla_attention(cfg: ModelConfig, p, x, kv_cache, pos):
    """MLA sublayer (no positional encoding, as in Kimi Linear) for ``x [T, D]`` at positions
    ``pos .. pos + T - 1``; ``kv_cache [S_max, L + R]`` holds the normalised latents."""
    T = x.shape[0]
    nh, nope, rope, vd, L = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q, latent = mla_inputs(cfg, p, x)
    kv_cache = jax.lax.dynamic_update_slice(kv_cache, latent, (pos, 0))
    kv = linear(kv_cache[:, :L], p["kv_b"]).reshape(-1, nh, nope + vd)
    S = kv_cache.shape[0]
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(kv_cache[:, None, L:], (S, nh, rope))], axis=-1)
    scores = jnp.einsum("thd,shd->hts", q, k, precision=HIGHEST) * (nope + rope) ** -0.5
    visible = jnp.arange(S)[None, :] <= pos + jnp.arange(T)[:, None]
    attn = jax.nn.softmax(jnp.where(visible[None], scores, -jnp.inf), axis=-1)
    o = jnp.einsum("hts,shd->thd", attn, kv[..., nope:], precision=HIGHEST).reshape(T, nh * vd)
    if cfg.mla_output_gate:  # K3
        o = o * jax.nn.sigmoid(linear(x, p["g"]))
    return linear(o, p["o"]), kv_cache


@jax.named_scope("route")
def route(cfg: ModelConfig, p, x):
    """Sigmoid router with score-correction bias and group-limited top-k.
    Returns ``(weights f32[T, k], experts i32[T, k])``."""
    E, G = cfg.num_experts, cfg.n_group
    scores = jax.nn.sigmoid(linear(x, p["router"]))
    choice = scores + p["bias"].astype(f32)
    group_scores = jnp.sum(jax.lax.top_k(choice.reshape(-1, G, E // G), 2)[0], axis=-1)
    _, groups = jax.lax.top_k(group_scores, cfg.topk_group)
    keep = jnp.any(jnp.arange(G)[None, :, None] == groups[:, None, :], axis=-1)  # [T, G]
    choice = jnp.where(jnp.repeat(keep, E // G, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx


def moe(cfg: ModelConfig, p, x):
    """Routed experts plus shared experts. Few tokens (decode) gather their experts' weights;
    many tokens (prefill) sort by expert and run two grouped matmuls. Stable LatentMoE (K3): the
    router reads ``x``, the experts a latent ``latent_down x``, and their weighted sum goes back
    through an RMSNorm and ``latent_up``. Packed MXFP4 experts are dequantised whole here."""
    T = x.shape[0]
    I = cfg.moe_intermediate_size
    p = dict(p, gate_up=dense(p["gate_up"]), down=dense(p["down"]))
    w, idx = route(cfg, p, x)
    z = linear(x, p["latent_down"]) if cfg.latent_moe_size else x
    if T * cfg.num_experts_per_tok <= cfg.num_experts:
        h = jnp.einsum("td,tkfd->tkf", z, p["gate_up"][idx].astype(f32), precision=HIGHEST)
        y = jnp.einsum("tki,tkdi->tkd", glu(cfg, h[..., :I], h[..., I:]), p["down"][idx].astype(f32), precision=HIGHEST)
        y = jnp.einsum("tk,tkd->td", w, y, precision=HIGHEST)
    else:
        flat = idx.reshape(-1)
        order = jnp.argsort(flat)
        tok = order // cfg.num_experts_per_tok
        sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
        h = jax.lax.ragged_dot(z[tok], jnp.swapaxes(p["gate_up"].astype(f32), 1, 2), sizes, precision=HIGHEST)
        a = glu(cfg, h[:, :I], h[:, I:])
        y = jax.lax.ragged_dot(a, jnp.swapaxes(p["down"].astype(f32), 1, 2), sizes, precision=HIGHEST)
        y = jnp.zeros(z.shape, f32).at[tok].add(y * w.reshape(-1)[order][:, None])
    return latent_moe_out(cfg, p, y) + mlp(cfg, p["shared"], x)


class Trunk:
    """The residual trunk of one forward: ``x + f(x)`` sums for Kimi Linear; for K3's Block
    Attention Residuals the sealed block sums (block 0: the embedding) and the current block's
    partial sum, mixed before each sublayer (every ``attn_res_block_size`` layers the partial sum
    is sealed; nothing crosses tokens, so no cache)."""

    def __init__(self, cfg: ModelConfig, x):
        self.cfg, self.partial, self.blocks = cfg, x, []

    def _mix(self, proj, norm):
        return attn_res_mix(jnp.stack(self.blocks + [self.partial]), proj, norm, self.cfg.rms_norm_eps)

    def attn_input(self, i: int, lp):
        bs = self.cfg.attn_res_block_size
        if bs is None:
            return self.partial
        h = self._mix(lp["attn_res_proj"], lp["attn_res_norm"]) if self.blocks else self.partial
        if i % bs == 0:
            self.blocks.append(self.partial)
            self.partial = None
        return h

    def mlp_input(self, lp, attn_out):
        self.partial = attn_out if self.partial is None else self.partial + attn_out
        if self.cfg.attn_res_block_size is None:
            return self.partial
        return self._mix(lp["mlp_res_proj"], lp["mlp_res_norm"])

    def add(self, mlp_out):
        self.partial = self.partial + mlp_out

    def output(self, params):
        if self.cfg.attn_res_block_size is None:
            return self.partial
        return self._mix(params["out_res_proj"], params["out_res_norm"])


def forward(cfg: ModelConfig, params, token_ids, cache: ModelCache, kernels: Kernels = Kernels(),
            return_window: bool = False):
    """Run ``token_ids i32[T]`` after the ``cache.pos`` tokens already in ``cache``.

    Returns ``(logits f32[T, vocab], cache)``, plus the per-KDA-layer :class:`WindowInputs` stacked
    over layers when ``return_window`` (speculative verify). Prefill, chunked prefill and decode
    (T = 1) are all this function; ``T`` must fit: ``cache.pos + T <= S_max``.
    """
    x, new, windows = _layers(cfg, params, token_ids, cache, kernels)
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    if return_window:
        return linear(x, head), new, jax.tree.map(lambda *a: jnp.stack(a), *windows)
    return linear(x, head), new


def _layers(cfg: ModelConfig, params, token_ids, cache: ModelCache, kernels: Kernels):
    """Every layer: the trunk's output before the final norm ``f32[T, D]``, the caches, the
    per-KDA-layer window inputs."""
    ks, cs, kv = list(cache.kda_state), list(cache.conv_state), list(cache.mla_kv)
    windows = []
    ik = im = 0
    trunk = Trunk(cfg, params["embed"][token_ids].astype(f32))
    for i, lp in enumerate(params["layers"]):
        h = rms_norm(trunk.attn_input(i, lp), lp["input_norm"], cfg.rms_norm_eps)
        if cfg.layer_types[i] == "kda":
            h, ks[ik], cs[ik], w = kda_attention(cfg, lp["attn"], h, ks[ik], cs[ik], kernels)
            windows.append(w)
            ik += 1
        else:
            h, kv[im] = mla_attention(cfg, lp["attn"], h, kv[im], cache.pos)
            im += 1
        h = rms_norm(trunk.mlp_input(lp, h), lp["post_norm"], cfg.rms_norm_eps)
        trunk.add(moe(cfg, lp["mlp"], h) if cfg.mlp_types[i] == "moe" else mlp(cfg, lp["mlp"], h))
    stack = lambda xs, like: jnp.stack(xs) if xs else like
    new = ModelCache(stack(ks, cache.kda_state), stack(cs, cache.conv_state), stack(kv, cache.mla_kv),
                     cache.pos + token_ids.shape[0])
    return trunk.output(params), new, windows


def hidden_states(cfg: ModelConfig, params, token_ids, kernels: Kernels = Kernels()):
    """One sequence with no cache: the trunk's output (K3: the final AttnRes mix) and the final
    norm's output (the LM head's input), both ``f32[T, D]``."""
    x, _, _ = _layers(cfg, params, token_ids, init_cache(cfg, token_ids.shape[0]), kernels)
    return x, rms_norm(x, params["norm"], cfg.rms_norm_eps)


def commit_window(cfg: ModelConfig, before: ModelCache, after: ModelCache, window: WindowInputs, num_tokens,
                  kernels: Kernels = Kernels()):
    """The caches of a batch of sequences after only the first ``num_tokens i32[B]`` positions of
    their verified windows (``before``, ``after`` and ``window`` with a leading batch axis).

    KDA states are rebuilt by replaying the cached projections from ``before`` (no per-draft state
    snapshots), every sequence and layer in one ``kernels.kda_commit`` call; the short-conv state
    is the last ``W - 1`` raw inputs before the cut; MLA latents come from ``after`` (positions
    past the cut are masked and later overwritten).
    """
    kda_state, conv_state = before.kda_state, before.conv_state
    if cfg.kda_layers:
        B, nk = kda_state.shape[:2]
        flat = lambda x: x.reshape(B * nk, *x.shape[2:])
        kda_state = kernels.kda_commit(flat(kda_state), flat(window.k), flat(window.v), flat(window.g),
                                       flat(window.beta), jnp.repeat(num_tokens, nk)).reshape(kda_state.shape)
        W1 = cfg.conv_width - 1
        cut = lambda c, raw, n: jax.lax.dynamic_slice_in_dim(jnp.concatenate([c, raw.astype(c.dtype)]), n, W1)
        conv_state = jax.vmap(jax.vmap(cut, (0, 0, None)))(conv_state, window.raw, num_tokens)
    return ModelCache(kda_state, conv_state, after.mla_kv, before.pos + num_tokens)


def logits(cfg: ModelConfig, params, token_ids, kernels: Kernels = Kernels()):
    """Logits ``f32[T, vocab]`` of one sequence with no cache (the golden path)."""
    out, _ = forward(cfg, params, token_ids, init_cache(cfg, token_ids.shape[0]), kernels)
    return out


def param_shapes(cfg: ModelConfig) -> dict:
    """The params pytree with shape tuples as leaves."""
    D, HVK, K, HV, W = cfg.hidden_size, cfg.qkv_dim, cfg.linear_head_dim, cfg.linear_num_heads, cfg.conv_width
    nh, qk, L = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    dense = lambda I: dict(gate=(I, D), up=(I, D), down=(D, I))
    layers = []
    for t, m in zip(cfg.layer_types, cfg.mlp_types):
        if t == "kda":
            attn = dict(q=(HVK, D), k=(HVK, D), v=(HVK, D), conv=(3 * HVK, W), f_a=(K, D), f_b=(HVK, K), dt_bias=(HVK,),
                        A_log=(HV,), b=(HV, D), o_norm=(K,), o=(D, HVK))
            attn.update(dict(g=(HVK, D)) if cfg.full_rank_output_gate else dict(g_a=(K, D), g_b=(HVK, K)))
        else:
            attn = dict(q=(nh * qk, D)) if cfg.q_lora_rank is None else dict(
                q_a=(cfg.q_lora_rank, D), q_a_norm=(cfg.q_lora_rank,), q_b=(nh * qk, cfg.q_lora_rank))
            attn.update(kv_a=(L + cfg.qk_rope_head_dim, D), kv_a_norm=(L,),
                        kv_b=(nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), L), o=(D, nh * cfg.v_head_dim))
            if cfg.mla_output_gate:
                attn["g"] = (nh * cfg.v_head_dim, D)
        if m == "dense":
            mlp = dense(cfg.intermediate_size)
        else:
            E, I, Z = cfg.num_experts, cfg.moe_intermediate_size, cfg.latent_moe_size or D
            mlp = dict(router=(E, D), bias=(E,), gate_up=(E, 2 * I, Z), down=(E, Z, I),
                       shared=dense(I * cfg.n_shared_experts))
            if cfg.latent_moe_size:
                mlp.update(latent_down=(Z, D), latent_up=(D, Z), **({"latent_norm": (Z,)} if cfg.latent_moe_norm else {}))
        layer = dict(input_norm=(D,), post_norm=(D,), attn=attn, mlp=mlp)
        if cfg.attn_res_block_size:
            layer.update(attn_res_proj=(D,), attn_res_norm=(D,), mlp_res_proj=(D,), mlp_res_norm=(D,))
        layers.append(layer)
    out = dict(embed=(cfg.vocab_size, D), norm=(D,), layers=layers)
    if cfg.attn_res_block_size:
        out.update(out_res_proj=(D,), out_res_norm=(D,))
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (cfg.vocab_size, D)
    return out


def init_params(cfg: ModelConfig, key, dtype=jnp.float32, scale: float = 0.05):
    """Random params for tests and benchmarks: normal weights, norms near 1, gate parameters in
    their usual ranges (``A_log = log U(1, 16)``, ``dt_bias ~ N(0, 1)``)."""
    return init_tree(param_shapes(cfg), key, dtype, scale)


def init_tree(shapes, key, dtype=jnp.float32, scale: float = 0.05):
    """:func:`init_params` for any subtree of :func:`param_shapes` (e.g. one layer)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    out = [_init_leaf(getattr(path[-1], "key", ""), shape, k, scale).astype(dtype)
           for (path, shape), k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(tree, out)


def _init_leaf(name: str, shape, k, scale):
    if "norm" in name:
        return 1.0 + 0.1 * jax.random.normal(k, shape)
    if name == "A_log":
        return jnp.log(jax.random.uniform(k, shape, minval=1.0, maxval=16.0))
    if name in ("dt_bias", "bias"):
        return (1.0 if name == "dt_bias" else 0.1) * jax.random.normal(k, shape)
    return scale * jax.random.normal(k, shape)
