"""Short causal depthwise convolution (window W, 4 in Kimi Linear) with its rolling state.

``weight [D, W]``: ``y_t = act(sum_j weight[:, j] * x_{t - (W - 1) + j} + bias)``; the last tap
multiplies the current token. The conv state is the last ``W - 1`` raw inputs, ``[B, W - 1, D]``
(oldest first). For speculative decoding, :class:`ConvRing` keeps raw inputs in a ring of length
``W - 1 + T`` with a cursor: writing a window of ``T`` drafts never overwrites the ``W - 1``
committed inputs, so a rejected draft rolls back by moving the cursor only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from k3jax.ops.kda import _token_seq_ids


def _activate(y, activation):
    if activation is None:
        return y
    if activation == "silu":
        return jax.nn.silu(y)
    raise ValueError(f"unknown activation {activation!r} (None or 'silu')")


def _taps(windows, weight, bias, activation):
    """windows ``[..., W, D]`` raw inputs oldest first -> ``[..., D]`` in float32."""
    y = jnp.einsum("...wd,dw->...d", windows.astype(jnp.float32), weight.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return _activate(y, activation)


@jax.named_scope("short_conv")
def short_conv(x, weight, *, bias=None, activation="silu", initial_state=None, cu_seqlens=None):
    """Causal depthwise conv over whole sequences.

    Args:
      x: ``[B, T, D]``; weight: ``[D, W]``; bias: ``[D]`` or None; activation: "silu" or None.
      initial_state: ``[N, W - 1, D]`` raw inputs preceding each sequence, or None (zeros).
      cu_seqlens: ``i32[N + 1]`` for packed varlen inputs (``B == 1``).
    Returns:
      ``(y [B, T, D] in x.dtype, final_state [N, W - 1, D] in x.dtype)``; padding tokens past
      ``cu_seqlens[-1]`` get ``y = 0``.
    """
    B, T, D = x.shape
    W = weight.shape[-1]
    if weight.shape != (D, W):
        raise ValueError(f"weight must be [D, W] with D={D}, got {weight.shape}")
    if cu_seqlens is None:
        cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    elif B != 1:
        raise ValueError(f"varlen inputs must be packed with B == 1, got B={B}")
    else:
        cu = cu_seqlens.astype(jnp.int32)
    N = cu.shape[0] - 1
    init = jnp.zeros((N, W - 1, D), x.dtype) if initial_state is None else initial_state.astype(x.dtype)
    if init.shape != (N, W - 1, D):
        raise ValueError(f"initial_state must be [N, W - 1, D] = {(N, W - 1, D)}, got {init.shape}")
    xf = x.reshape(B * T, D)
    TT = B * T
    seq = _token_seq_ids(cu, TT)
    ok = seq < N
    s = jnp.minimum(seq, N - 1)
    start = cu[s]

    def gather(pos, s, start):
        """Raw input at absolute packed position ``pos`` of sequence ``s`` (from the state before its start)."""
        inside = pos >= start
        from_x = xf[jnp.clip(pos, 0, TT - 1)]
        from_state = init[s, jnp.clip(W - 1 + pos - start, 0, W - 2)]
        return jnp.where(inside[..., None], from_x, from_state)

    # tap by tap (one elementwise pass; no [T, W, D] windows, no matmul)
    t = jnp.arange(TT, dtype=jnp.int32)
    wf = weight.astype(jnp.float32)
    y = jnp.zeros((TT, D), jnp.float32) if bias is None else jnp.broadcast_to(bias.astype(jnp.float32), (TT, D))
    for j in range(W):  # tap j reads the input W - 1 - j tokens back
        y = y + gather(t - (W - 1 - j), s, start).astype(jnp.float32) * wf[:, j]
    y = jnp.where(ok[:, None], _activate(y, activation), 0.0)
    ends = cu[1:]
    last_pos = ends[:, None] - (W - 1) + jnp.arange(W - 1, dtype=jnp.int32)[None]  # [N, W - 1]
    final = gather(last_pos, jnp.arange(N)[:, None], cu[:-1, None])
    return y.reshape(B, T, D).astype(x.dtype), final


def short_conv_step(x, state, weight, *, bias=None, activation="silu"):
    """One decode token. x: ``[B, D]``; state: ``[B, W - 1, D]``. Returns ``(y [B, D], new_state)``."""
    windows = jnp.concatenate([state, x[:, None].astype(state.dtype)], axis=1)
    return _taps(windows, weight, bias, activation).astype(x.dtype), windows[:, 1:]


class ConvRing(NamedTuple):
    """Ring of raw conv inputs for speculative windows.

    buf: ``[B, W - 1 + T, D]``; cursor: ``i32[B]`` slot of the next input to write. The committed
    conv state is the ``W - 1`` slots before the cursor.
    """

    buf: jax.Array
    cursor: jax.Array


def conv_ring_init(state, window: int) -> ConvRing:
    """A ring holding the committed ``state [B, W - 1, D]``, sized for windows of up to ``window`` tokens."""
    B, Wm1, D = state.shape
    buf = jnp.concatenate([state, jnp.zeros((B, window, D), state.dtype)], axis=1)
    return ConvRing(buf, jnp.full((B,), Wm1 % (Wm1 + window), jnp.int32))


def _ring_slots(ring: ConvRing, offsets):
    R = ring.buf.shape[1]
    return (ring.cursor.reshape((-1,) + (1,) * offsets.ndim) + offsets[None]) % R


def conv_ring_state(ring: ConvRing, width: int):
    """The committed conv state ``[B, W - 1, D]`` (``width = W``)."""
    slots = _ring_slots(ring, jnp.arange(-(width - 1), 0))
    return jnp.take_along_axis(ring.buf, slots[..., None], axis=1)


def conv_ring_window(ring: ConvRing, x, weight, *, bias=None, activation="silu"):
    """Write a window of drafts after the cursor and convolve it; the cursor does not move.

    Args:
      ring: a :class:`ConvRing`; x: ``[B, T, D]`` with ``T <= ring capacity - (W - 1)``.
    Returns:
      ``(y [B, T, D], ring with the drafts written)``.
    """
    B, T, D = x.shape
    W = weight.shape[-1]
    R = ring.buf.shape[1]
    if T > R - (W - 1):
        raise ValueError(f"window {T} exceeds the ring's capacity {R - (W - 1)}")
    slots = _ring_slots(ring, jnp.arange(T))
    buf = ring.buf.at[jnp.arange(B)[:, None], slots].set(x.astype(ring.buf.dtype))
    taps = _ring_slots(ring, jnp.arange(T)[:, None] - (W - 1) + jnp.arange(W)[None]).reshape(B, T * W)
    windows = jnp.take_along_axis(buf, taps[..., None], axis=1).reshape(B, T, W, D)
    y = _taps(windows, weight, bias, activation).astype(x.dtype)
    return y, ConvRing(buf, ring.cursor)


def conv_ring_commit(ring: ConvRing, num_accepted) -> ConvRing:
    """Keep each row's first ``num_accepted[b]`` window inputs by advancing its cursor."""
    return ConvRing(ring.buf, (ring.cursor + num_accepted.astype(jnp.int32)) % ring.buf.shape[1])
