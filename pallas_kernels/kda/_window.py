"""The per-(row, value head) window math shared by the TPU and GPU decode kernels.

Everything is 2-D so both backends lower it without reshapes: K-indexed vectors are columns
``[K, 1]``, V-indexed vectors rows ``[1, V]``, the state ``f32[K, V]`` (K-first, as everywhere).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.kda.common import fast_exp  # exp2-based: fewer GPU instructions


@dataclasses.dataclass(frozen=True)
class Mode:
    """What one window kernel does.

    readout: emit ``o`` at every position; write_state: write the state after ``n`` positions
    back to the slot (``n`` = the whole window unless ``per_row_n``); snapshot: write the state
    after every position to a scratch output (the baseline); per_row_n: replay only the row's
    first ``num_accepted[b]`` positions; replay_first: first replay the accepted prefix of the
    *previous* window (written back as the committed state), then verify the current window
    from it without writing (commit fused into the next verify); deltas_out: also emit each
    position's delta-rule correction ``u_t = beta_t (v_t - k_t^T S_dec)`` (f32 ``[1, V]`` rows);
    deltas_in: the replayed positions take those corrections instead of ``v`` and ``beta``
    (``S <- e^g S + k u^T``: no read of the state, so no reduction over K).
    """

    readout: bool
    write_state: bool
    snapshot: bool = False
    per_row_n: bool = False
    replay_first: bool = False
    deltas_out: bool = False
    deltas_in: bool = False

    @property
    def replay_only(self) -> bool:
        """The window only rebuilds the state from the row's first ``n`` positions (commit)."""
        return self.per_row_n and not self.replay_first

    @property
    def writes_at_end(self) -> bool:
        """The state after the window's loop goes back to the slot (``replay_first`` writes it
        after the replayed prefix instead)."""
        return self.write_state and not self.replay_first


DECODE = Mode(readout=True, write_state=True)
VERIFY = Mode(readout=True, write_state=False)
COMMIT = Mode(readout=False, write_state=True, per_row_n=True)
VERIFY_SNAPSHOT = Mode(readout=True, write_state=False, snapshot=True)
COMMIT_VERIFY = Mode(readout=True, write_state=True, per_row_n=True, replay_first=True)
VERIFY_DELTAS = dataclasses.replace(VERIFY, deltas_out=True)
COMMIT_DELTAS = dataclasses.replace(COMMIT, deltas_in=True)
COMMIT_VERIFY_DELTAS = dataclasses.replace(COMMIT_VERIFY, deltas_in=True, deltas_out=True)


def split_refs(refs, mode: Mode):
    """A window kernel's refs by role, in operand order: ``(prev, q, k, v, g, beta, pool, o, deltas,
    snap, pool_out)`` (None where the mode has none) and an iterator over what follows (scratch).
    A replayed window is ``(k, v, g, beta)``, or ``(k, u, g)`` with ``deltas_in`` (``v`` is then
    the deltas and ``beta`` None)."""
    it = iter(refs)
    take = lambda present: next(it) if present else None
    replayed = 3 if mode.deltas_in else 4
    prev = [next(it) for _ in range(replayed)] if mode.replay_first else None
    q = take(mode.readout)
    k, v, g = (next(it) for _ in range(3))
    beta = take(not (mode.replay_only and mode.deltas_in))
    pool = next(it)
    outs = (take(mode.readout), take(mode.deltas_out), take(mode.snapshot), take(mode.write_state))
    return (prev, q, k, v, g, beta, pool, *outs), it


def delta_rule(S, k_col, v_row, g_col, b):
    """One token: decay, delta-rule correction, rank-1 write. S: f32[K, V]; b: [1, 1].
    Returns the new state and the correction ``u [1, V]``."""
    S = S * fast_exp(g_col)
    u = b * (v_row - jnp.sum(k_col * S, axis=0, keepdims=True))
    return S + k_col * u, u


def apply_delta(S, k_col, u_row, g_col):
    """One token whose correction ``u`` is known (from :func:`delta_rule` on the same state)."""
    return S * fast_exp(g_col) + k_col * u_row


def readout(S, q_col, scale):
    """``o = scale * q^T S`` as a row ``[1, V]``."""
    return jnp.sum(q_col * S, axis=0, keepdims=True) * scale
