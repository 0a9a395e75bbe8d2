"""Public KDA decode kernels on a slot pool: one-token step, speculative verify, commit by replay.

The pool ``f32[num_slots, HV, K, V]`` is donated and updated in place. Rows whose slot id is out
of ``[0, num_slots)`` are padding: they read and write nothing and their outputs are zero.
Concrete slot ids (NumPy, as the serving loop passes them) are validated: ids ``>= num_slots``
or ``< -1`` and repeated ids raise ``ValueError``; use ``-1`` for padding rows.

The snapshot baseline (:func:`kda_verify_snapshot` + :func:`kda_commit_snapshot`) writes one
state per window position and commits by picking one; it exists to be measured against.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kda import decode_gpu, decode_tpu
from pallas_kernels.kda._window import (COMMIT, COMMIT_DELTAS, COMMIT_VERIFY, DECODE, VERIFY, VERIFY_DELTAS,
                                        VERIFY_SNAPSHOT, Mode)


def default_interpret(interpret):
    """``None`` means: run the TPU kernel in interpret mode on CPU, compile it elsewhere."""
    if interpret is None:
        return pltpu.InterpretParams() if jax.default_backend() == "cpu" else False
    return interpret


def pages_on_tpu(backend) -> bool:
    """Whether the kernels on the page pool (``kda_decode_pages``, ``paged_mla_decode``) take their
    TPU version: ``backend`` "tpu", or None on a TPU (elsewhere the GPU kernel, interpreted on CPU)."""
    return (backend or ("tpu" if jax.default_backend() == "tpu" else "gpu")) == "tpu"


def _backend_module(backend):
    backend = backend or jax.default_backend()
    if backend in ("gpu", "cuda", "rocm"):
        return decode_gpu
    if backend in ("tpu", "cpu"):
        return decode_tpu
    raise ValueError(f"no KDA decode kernel for backend {backend!r}")


def _check(pool, slot_ids, q, k, v, g, beta, window: bool, deltas=None):
    if pool.ndim != 4 or pool.dtype != jnp.float32:
        raise ValueError(f"state_pool must be f32[num_slots, HV, K, V], got {pool.dtype}{list(pool.shape)}")
    num_slots, HV, K, V = pool.shape
    lead = k.shape[:2] if window else k.shape[:1]
    B = lead[0]
    H = k.shape[-2]
    want = {"k": (*lead, H, K), "v": (*lead, HV, V), "g": (*lead, HV, K), "beta": (*lead, HV)}
    if q is not None:
        want["q"] = (*lead, H, K)
    got = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, shape in want.items():
        if tuple(got[name].shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for pool {pool.shape}, got {tuple(got[name].shape)}")
    if deltas is not None and (tuple(deltas.shape) != want["v"] or deltas.dtype != jnp.float32):
        raise ValueError(f"deltas must be f32{list(want['v'])} (kda_verify(..., return_deltas=True)), "
                         f"got {deltas.dtype}{list(deltas.shape)}")
    if HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of q/k heads H={H}")
    if slot_ids.shape != (B,) or not jnp.issubdtype(slot_ids.dtype, jnp.integer):
        raise ValueError(f"slot_ids must be int[{B}], got {slot_ids.dtype}{list(slot_ids.shape)}")
    if not isinstance(slot_ids, jax.core.Tracer):
        ids = np.asarray(slot_ids)
        if np.any(ids >= num_slots) or np.any(ids < -1):
            raise ValueError(f"slot ids must be in [0, {num_slots}) or -1 for padding, got {ids.tolist()}")
        live = ids[ids >= 0]
        if len(np.unique(live)) != len(live):
            raise ValueError(f"slot ids of live rows must be distinct, got {ids.tolist()}")


def _impl(pool, slot_ids, num_accepted, q, k, v, g, beta, prev, *, mode: Mode, scale, interpret, backend):
    impl = _backend_module(backend)
    return impl.window_call(
        pool, slot_ids.astype(jnp.int32), num_accepted.astype(jnp.int32), q, k, v, g, beta,
        mode=mode, scale=scale, interpret=interpret, prev=prev,
    )


_STATIC = ("mode", "scale", "interpret", "backend")
_run_in_place = jax.jit(_impl, static_argnames=_STATIC, donate_argnums=(0,))
_run_read_only = jax.jit(_impl, static_argnames=_STATIC)


def _call(mode, pool, slot_ids, num_accepted, q, k, v, g, beta, scale, interpret, backend, prev=None):
    scale = float(k.shape[-1] ** -0.5 if scale is None else scale)
    run = _run_in_place if mode.write_state else _run_read_only
    return run(
        pool, jnp.asarray(slot_ids), jnp.asarray(num_accepted), q, k, v, g, beta, prev,
        mode=mode, scale=scale, interpret=default_interpret(interpret), backend=backend,
    )


def kda_decode(state_pool, slot_ids, q, k, v, g, beta, *, scale=None, interpret=None, backend=None):
    """One decode token per row, updating each row's slot in place.

    Args:
      state_pool: ``f32[num_slots, HV, K, V]`` (donated); slot_ids: ``int[B]`` (-1: padding row);
      q, k: ``[B, H, K]``; v: ``[B, HV, V]``; g: ``[B, HV, K]`` log decay; beta: ``[B, HV]``.
      interpret: None (auto), False, or ``pltpu.InterpretParams``/True; backend: None (the
        default device's), "tpu", "gpu" or "cpu" (the TPU kernel interpreted).
    Returns:
      ``(o [B, HV, V] in v.dtype, state_pool)``.
    """
    _check(state_pool, slot_ids, q, k, v, g, beta, window=False)
    w = lambda x: x[:, None]
    o, _, _, pool = _call(DECODE, state_pool, slot_ids, np.zeros(k.shape[0], np.int32),
                       w(q), w(k), w(v), w(g), w(beta), scale, interpret, backend)
    return o[:, 0], pool


def kda_verify(state_pool, slot_ids, q, k, v, g, beta, *, scale=None, return_deltas=False, interpret=None,
               backend=None):
    """Outputs for a speculative window; reads each row's committed state, writes no state.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]``; beta: ``[B, T, HV]``
      (the window's projected inputs: keep them, they are what :func:`kda_commit` replays).
      return_deltas: also return each position's delta-rule correction
        ``u_t = beta_t (v_t - k_t^T (e^{g_t} S_{t-1}))``: with them :func:`kda_commit` rebuilds
        the state without reading it back per position (no reduction over K: faster).
    Returns:
      ``o [B, T, HV, V]``: position ``t`` sees the state after positions ``0..t``; with
      ``return_deltas``, ``(o, deltas f32[B, T, HV, V])``.
    """
    _check(state_pool, slot_ids, q, k, v, g, beta, window=True)
    o, deltas, _, _ = _call(VERIFY_DELTAS if return_deltas else VERIFY, state_pool, slot_ids,
                            np.zeros(k.shape[0], np.int32), q, k, v, g, beta, scale, interpret, backend)
    return (o, deltas) if return_deltas else o


def kda_commit(state_pool, slot_ids, k, v, g, beta, num_accepted, *, deltas=None, interpret=None, backend=None):
    """Replay each row's first ``num_accepted[b]`` (0..T) window positions into its slot.

    Args:
      k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]``; beta: ``[B, T, HV]``;
      num_accepted: ``int[B]`` clipped to ``[0, T]``;
      deltas: None, or the verify's ``deltas`` for this window and these slots' current states
        (``kda_verify(..., return_deltas=True)``): each position is then ``S <- e^g S + k u^T``
        with the given ``u`` (``v`` and ``beta`` are not read).
    Returns:
      the updated ``state_pool``.
    """
    _check(state_pool, slot_ids, None, k, v, g, beta, window=True, deltas=deltas)
    n = jnp.clip(jnp.asarray(num_accepted), 0, k.shape[1])
    mode, v, beta = (COMMIT, v, beta) if deltas is None else (COMMIT_DELTAS, deltas, None)
    return _call(mode, state_pool, slot_ids, n, None, k, v, g, beta, None, interpret, backend)[3]


def kda_commit_dense(state, k, v, g, beta, num_tokens, *, interpret=None, backend=None):
    """:func:`kda_commit` with the signature of :func:`k3jax.ops.kda.kda_commit`: a dense state
    batch ``f32[B, HV, K, V]`` whose row ``b`` is slot ``b``; returns the committed states (the
    model's ``Kernels.kda_commit``)."""
    ids = np.arange(state.shape[0], dtype=np.int32)
    state = jnp.array(state, jnp.float32, copy=True)  # the kernel donates the pool; the caller keeps its state
    return kda_commit(state, ids, k, v, g, beta, num_tokens, interpret=interpret, backend=backend)


def kda_recurrent_dense(q, k, v, g, beta, *, initial_state, scale=None, interpret=None, backend=None):
    """Short pieces with the contract of :func:`k3jax.ops.kda.naive_recurrent_kda` (``q, k
    [B, T, H, K]`` ..., ``initial_state f32[B, HV, K, V]``; returns ``(o, final_state)``) on the
    slot-pool kernels, row ``b`` being slot ``b``: the decode kernel over all T positions (one
    call; the state read and written once, where :func:`kda_verify` + :func:`kda_commit` read
    it twice). Under
    ``jax.vmap`` (the serving engine maps its per-sequence model over slots) the mapped axis
    folds into the kernels' rows, so one kernel call serves every slot (the model's
    ``Kernels.recurrent_kda``)."""
    def run(q, k, v, g, beta, S):
        ids = np.arange(k.shape[0], dtype=np.int32)
        _check(S, ids, q, k, v, g, beta, window=True)
        o, _, _, S = _call(DECODE, S, ids, np.zeros_like(ids), q, k, v, g, beta, scale, interpret, backend)
        return o, S

    batched = jax.custom_batching.custom_vmap(run)

    @batched.def_vmap
    def _fold(axis_size, in_batched, *args):
        args = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip(args, in_batched)]
        outs = run(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in args))
        return tuple(x.reshape(axis_size, -1, *x.shape[1:]) for x in outs), (True, True)

    # A copy: the kernels donate the pool, the caller keeps its initial state.
    return batched(q, k, v, g, beta, jnp.array(initial_state, jnp.float32, copy=True))


def kda_commit_verify(state_pool, slot_ids, prev, num_accepted, q, k, v, g, beta, *, prev_deltas=None,
                      return_deltas=False, scale=None, interpret=None, backend=None):
    """Commit fused into the next verify: per row, replay the previous window's first
    ``num_accepted[b]`` positions into the slot, then verify the new window from that state.

    One state read and one write per step instead of :func:`kda_verify` + :func:`kda_commit`'s
    two reads and one write.

    Args:
      prev: the previous window's ``(k, v, g, beta)`` (``[B, T', ...]``, as for :func:`kda_commit`);
      num_accepted: ``int[B]`` clipped to ``[0, T']``; q, k, v, g, beta: the new window;
      prev_deltas: None, or the previous window's deltas (as :func:`kda_commit`'s ``deltas``);
      return_deltas: also return the new window's deltas (the next step's ``prev_deltas``).
    Returns:
      ``(o [B, T, HV, V], state_pool)``, or ``(o, deltas, state_pool)`` with ``return_deltas``;
      ``state_pool`` holds the committed states.
    """
    _check(state_pool, slot_ids, q, k, v, g, beta, window=True)
    _check(state_pool, slot_ids, None, *prev, window=True, deltas=prev_deltas)
    n = jnp.clip(jnp.asarray(num_accepted), 0, prev[0].shape[1])
    mode = dataclasses.replace(COMMIT_VERIFY, deltas_in=prev_deltas is not None, deltas_out=return_deltas)
    if prev_deltas is not None:
        prev = (prev[0], prev_deltas, prev[2])  # the replayed window: (k, deltas, g)
    o, deltas, _, pool = _call(mode, state_pool, slot_ids, n, q, k, v, g, beta, scale, interpret, backend,
                               prev=tuple(prev))
    return (o, deltas, pool) if return_deltas else (o, pool)


def kda_verify_snapshot(state_pool, slot_ids, q, k, v, g, beta, *, scale=None, interpret=None, backend=None):
    """Baseline verify: outputs plus the state after every window position.

    Returns:
      ``(o [B, T, HV, V], snapshots f32[B, T, HV, K, V])``.
    """
    _check(state_pool, slot_ids, q, k, v, g, beta, window=True)
    o, _, snaps, _ = _call(VERIFY_SNAPSHOT, state_pool, slot_ids, np.zeros(k.shape[0], np.int32),
                        q, k, v, g, beta, scale, interpret, backend)
    return o, snaps


@functools.partial(jax.jit, donate_argnums=(0,))
def kda_commit_snapshot(state_pool, slot_ids, snapshots, num_accepted):
    """Baseline commit: copy snapshot ``num_accepted[b] - 1`` into the row's slot (0: unchanged).

    Args:
      state_pool: ``f32[num_slots, HV, K, V]`` (donated); slot_ids: ``int[B]``;
      snapshots: ``f32[B, T, HV, K, V]``; num_accepted: ``int[B]``.
    """
    num_slots = state_pool.shape[0]
    n = jnp.clip(num_accepted, 0, snapshots.shape[1])
    pick = jnp.take_along_axis(snapshots, jnp.maximum(n - 1, 0)[:, None, None, None, None], axis=1)[:, 0]
    keep = (n > 0) & (slot_ids >= 0)
    return state_pool.at[jnp.where(keep, slot_ids, num_slots)].set(pick, mode="drop")
