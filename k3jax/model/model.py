"""The Kimi Linear / K3 forward pass as pure functions over a params pytree.

One code path serves the golden no-cache forward, chunked prefill and decode: ``forward`` takes
caches in and returns them out (KDA recurrent state, short-conv state, MLA latent KV). Kernels
are injected through :class:`Kernels` (default: the pure-JAX references).

Params (weights in Hugging Face ``[out, in]`` orientation):
``embed [V, D]``, ``norm [D]``, ``lm_head [V, D]``, and per layer ``input_norm``, ``post_norm``, an
``attn`` dict (KDA: ``q, k, v [HV*K, D]``, ``conv [3*HV*K, W]``, ``f_a [K, D]``, ``f_b [HV*K, K]``,
``dt_bias [HV*K]``, ``A_log [HV]``, ``b [HV, D]``, ``g_a [K, D]`` + ``g_b [HV*K, K]`` or ``g [HV*K, D]``,
``o_norm [K]``, ``o [D, HV*K]``; MLA: ``q [nh*(nope+rope), D]`` or ``q_a``/``q_a_norm``/``q_b``,
``kv_a [L+R, D]``, ``kv_a_norm [L]``, ``kv_b [nh*(nope+v), L]``, ``o [D, nh*v]``) and an ``mlp`` dict
(dense: ``gate, up [I, D]``, ``down [D, I]``; MoE: ``router [E, D]``, ``bias [E]``,
``gate_up [E, 2I, D]``, ``down [E, D, I]``, ``shared`` dense MLP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from k3jax.model.config import ModelConfig
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


def mlp(p, x):
    return linear(jax.nn.silu(linear(x, p["gate"])) * linear(x, p["up"]), p["down"])


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


def mla_attention(cfg: ModelConfig, p, x, kv_cache, pos):
    """MLA sublayer (no positional encoding, as in Kimi Linear) for ``x [T, D]`` at positions
    ``pos .. pos + T - 1``; ``kv_cache [S_max, L + R]`` holds the normalised latents."""
    T = x.shape[0]
    nh, nope, rope, vd, L = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if "q" in p:
        q = linear(x, p["q"])
    else:
        q = linear(rms_norm(linear(x, p["q_a"]), p["q_a_norm"], cfg.rms_norm_eps), p["q_b"])
    q = q.reshape(T, nh, nope + rope)
    ckv = linear(x, p["kv_a"])
    latent = jnp.concatenate([rms_norm(ckv[:, :L], p["kv_a_norm"], cfg.rms_norm_eps), ckv[:, L:]], axis=-1)
    kv_cache = jax.lax.dynamic_update_slice(kv_cache, latent, (pos, 0))
    kv = linear(kv_cache[:, :L], p["kv_b"]).reshape(-1, nh, nope + vd)
    S = kv_cache.shape[0]
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(kv_cache[:, None, L:], (S, nh, rope))], axis=-1)
    scores = jnp.einsum("thd,shd->hts", q, k, precision=HIGHEST) * (nope + rope) ** -0.5
    visible = jnp.arange(S)[None, :] <= pos + jnp.arange(T)[:, None]
    attn = jax.nn.softmax(jnp.where(visible[None], scores, -jnp.inf), axis=-1)
    o = jnp.einsum("hts,shd->thd", attn, kv[..., nope:], precision=HIGHEST)
    return linear(o.reshape(T, nh * vd), p["o"]), kv_cache


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
    many tokens (prefill) sort by expert and run two grouped matmuls."""
    T, D = x.shape
    I = cfg.moe_intermediate_size
    w, idx = route(cfg, p, x)
    if T * cfg.num_experts_per_tok <= cfg.num_experts:
        h = jnp.einsum("td,tkfd->tkf", x, p["gate_up"][idx].astype(f32), precision=HIGHEST)
        a = jax.nn.silu(h[..., :I]) * h[..., I:]
        y = jnp.einsum("tki,tkdi->tkd", a, p["down"][idx].astype(f32), precision=HIGHEST)
        return jnp.einsum("tk,tkd->td", w, y, precision=HIGHEST) + mlp(p["shared"], x)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat)
    tok = order // cfg.num_experts_per_tok
    sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    h = jax.lax.ragged_dot(x[tok], jnp.swapaxes(p["gate_up"].astype(f32), 1, 2), sizes, precision=HIGHEST)
    a = jax.nn.silu(h[:, :I]) * h[:, I:]
    y = jax.lax.ragged_dot(a, jnp.swapaxes(p["down"].astype(f32), 1, 2), sizes, precision=HIGHEST)
    y = y * w.reshape(-1)[order][:, None]
    return jnp.zeros((T, D), f32).at[tok].add(y) + mlp(p["shared"], x)


def forward(cfg: ModelConfig, params, token_ids, cache: ModelCache, kernels: Kernels = Kernels(),
            return_window: bool = False):
    """Run ``token_ids i32[T]`` after the ``cache.pos`` tokens already in ``cache``.

    Returns ``(logits f32[T, vocab], cache)``, plus the per-KDA-layer :class:`WindowInputs` stacked
    over layers when ``return_window`` (speculative verify). Prefill, chunked prefill and decode
    (T = 1) are all this function; ``T`` must fit: ``cache.pos + T <= S_max``.
    """
    x = params["embed"][token_ids].astype(f32)
    ks, cs, kv = list(cache.kda_state), list(cache.conv_state), list(cache.mla_kv)
    windows = []
    ik = im = 0
    for i, lp in enumerate(params["layers"]):
        h = rms_norm(x, lp["input_norm"], cfg.rms_norm_eps)
        if cfg.layer_types[i] == "kda":
            h, ks[ik], cs[ik], w = kda_attention(cfg, lp["attn"], h, ks[ik], cs[ik], kernels)
            windows.append(w)
            ik += 1
        else:
            h, kv[im] = mla_attention(cfg, lp["attn"], h, kv[im], cache.pos)
            im += 1
        x = x + h
        h = rms_norm(x, lp["post_norm"], cfg.rms_norm_eps)
        x = x + (moe(cfg, lp["mlp"], h) if cfg.mlp_types[i] == "moe" else mlp(lp["mlp"], h))
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    stack = lambda xs, like: jnp.stack(xs) if xs else like
    new = ModelCache(stack(ks, cache.kda_state), stack(cs, cache.conv_state), stack(kv, cache.mla_kv),
                     cache.pos + token_ids.shape[0])
    if return_window:
        return linear(x, head), new, jax.tree.map(lambda *a: jnp.stack(a), *windows)
    return linear(x, head), new


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
        if m == "dense":
            mlp = dense(cfg.intermediate_size)
        else:
            E, I = cfg.num_experts, cfg.moe_intermediate_size
            mlp = dict(router=(E, D), bias=(E,), gate_up=(E, 2 * I, D), down=(E, D, I),
                       shared=dense(I * cfg.n_shared_experts))
        layers.append(dict(input_norm=(D,), post_norm=(D,), attn=attn, mlp=mlp))
    out = dict(embed=(cfg.vocab_size, D), norm=(D,), layers=layers)
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (cfg.vocab_size, D)
    return out


def init_params(cfg: ModelConfig, key, dtype=jnp.float32, scale: float = 0.05):
    """Random params for tests and benchmarks: normal weights, norms near 1, gate parameters in
    their usual ranges (``A_log = log U(1, 16)``, ``dt_bias ~ N(0, 1)``)."""
    shapes = param_shapes(cfg)
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, shape), k in zip(leaves, keys):
        name = getattr(path[-1], "key", "")
        if "norm" in name:
            x = 1.0 + 0.1 * jax.random.normal(k, shape)
        elif name == "A_log":
            x = jnp.log(jax.random.uniform(k, shape, minval=1.0, maxval=16.0))
        elif name in ("dt_bias", "bias"):
            x = (1.0 if name == "dt_bias" else 0.1) * jax.random.normal(k, shape)
        else:
            x = scale * jax.random.normal(k, shape)
        out.append(x.astype(dtype))
    return jax.tree_util.tree_unflatten(tree, out)
