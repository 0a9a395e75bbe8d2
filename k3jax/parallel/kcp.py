"""KDA context parallelism (KCP): shard the sequence axis over a mesh axis.

Each rank summarises the part of its shard that flows into the next rank as an affine map
``S -> M S + E`` (``M [HV, K, K]``, ``E [HV, K, V]``, computed from its own tokens only), one
all-gather exchanges those maps (a fixed size, independent of tokens per rank), and every rank
folds the earlier ranks' maps with an exclusive associative scan in float32 to get the true
state entering its shard. Then it runs the per-shard prefill op from that state. The exchange
happens inside the per-shard op, through its ``initial_state_fn``: between its token-parallel
stage, which also yields the maps, and its recurrent stage, so the token-parallel work is done
once per rank.

Varlen: only the sequence that crosses into a rank continues from the fold. A rank whose last
sequence starts inside it contributes a constant map ``(0, M init + E)``, so the fold needs no
special cases. Final states are collected with one psum of ``N`` states (also independent of T).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from k3jax.ops.conv import short_conv
from k3jax.ops.kda import check_kda_inputs, chunk_kda
from k3jax.ops.segments import apply_segment, combine_segments


def _rank_geometry(cu, lo, L, N):
    """Sequence layout of the shard ``[lo, lo + L)``.

    Returns ``(local_cu, c, crosses, owner)``: per-shard ``cu_seqlens``; the sequence ``c`` holding
    the shard's first token and whether it started on an earlier rank; and for every sequence
    the rank that holds its last token (0 for empty sequences).
    """
    local_cu = jnp.clip(cu - lo, 0, L)
    c = jnp.minimum(jnp.searchsorted(cu, lo, side="right").astype(jnp.int32) - 1, N - 1)
    crosses = (cu[c] < lo) & (cu[c + 1] > lo)
    ends = cu[1:]
    owner = jnp.where(ends > cu[:-1], (ends - 1) // L, 0)
    return local_cu, c, crosses, owner


def _state_entering(M, E, axis_name: str, fold_dtype):
    """The state entering this rank, from every rank's constant-or-not map (one all-gather)."""
    Ms, Es = jax.lax.all_gather((M.astype(fold_dtype), E.astype(fold_dtype)), axis_name)  # [P, ...]
    _, E_incl = jax.lax.associative_scan(combine_segments, (Ms, Es), axis=0)
    # Rank 0's map is constant, so the inclusive fold's E is the state leaving each rank.
    return E_incl[jnp.maximum(jax.lax.axis_index(axis_name) - 1, 0)].astype(jnp.float32)


def chunk_kda_on_shard(q, k, v, g, beta, cu, init, *, axis_name: str, scale=None, chunk_size: int = 64,
                       kernel: Callable | None = None, fold_dtype=jnp.float32):
    """KCP inside ``shard_map`` over ``axis_name``: this rank's contiguous piece ``q [1, L, H, K]``
    (and so on) of one packed varlen row of ``L * P`` tokens, its sequences ``cu i32[n + 1]`` in
    the row's (global) positions (tokens past ``cu[-1]`` are padding), ``init [n, HV, K, V]``
    every sequence's initial state. Returns ``(o [1, L, HV, V], final f32[n, HV, K, V])``, the
    final states the same on every rank. ``kernel``: as in :func:`chunk_kda_cp`."""
    kernel = chunk_kda if kernel is None else kernel
    n, L = cu.shape[0] - 1, q.shape[1]
    r = jax.lax.axis_index(axis_name)
    lo = r * L
    local_cu, c, crosses, owner = _rank_geometry(cu, lo, L, n)
    j = jnp.minimum(jnp.searchsorted(cu, lo + L - 1, side="right").astype(jnp.int32) - 1, n - 1)

    def initial_states(M, E):  # M, E: every sequence's map over its tokens on this rank
        # The shard's last sequence flows into the next rank; if it starts here its map is constant.
        starts_here = cu[j] >= lo
        E_j = jnp.where(starts_here, apply_segment((M[j], E[j]), init[j]), E[j])
        s_in = _state_entering(jnp.where(starts_here, 0.0, M[j]), E_j, axis_name, fold_dtype)
        return init.at[c].set(jnp.where(crosses, s_in, init[c]))

    o, fin = kernel(q, k, v, g, beta, scale=scale, cu_seqlens=local_cu, chunk_size=chunk_size,
                    initial_state_fn=initial_states)
    fin = jax.lax.psum(jnp.where((owner == r)[:, None, None, None], fin, 0.0), axis_name)
    return o, fin


# One jitted program: outside jit, shard_map compiles each primitive on its own, and XLA:CPU
# (jax 0.11.2) segfaults on a lone concatenate with a zero-size operand (associative_scan makes them).
@partial(jax.jit, static_argnames=("mesh", "axis_name", "scale", "chunk_size", "kernel", "fold_dtype"))
def chunk_kda_cp(
    q,
    k,
    v,
    g,
    beta,
    *,
    mesh: Mesh,
    axis_name: str,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    chunk_size: int = 64,
    kernel: Callable | None = None,
    fold_dtype=jnp.float32,
):
    """KDA prefill with the sequence axis sharded over ``mesh`` axis ``axis_name``.

    Args:
      q, k, v, g, beta: global arrays in the layout of :func:`k3jax.ops.kda.chunk_kda`
        (sharded or not); ``T`` must be divisible by the axis size.
      mesh, axis_name: the mesh and the axis to shard T over; other mesh axes pass through.
      scale, initial_state, cu_seqlens, chunk_size: as in ``chunk_kda`` (``scale`` a Python float:
        the call is jitted with ``mesh``, ``axis_name``, ``scale``, ``chunk_size``, ``kernel`` and
        ``fold_dtype`` static).
      kernel: the per-shard prefill op with ``chunk_kda``'s signature including
        ``initial_state_fn`` (default: the XLA path; pass ``pallas_kernels.kda.chunk_kda`` where
        it exists). Each rank's maps come from the op's own token-parallel stage.
      fold_dtype: dtype of the exchanged maps and the fold; float32. Anything else is only a
        negative control for tests (a bf16 M chain visibly loses accuracy).
    Returns:
      ``(o [B, T, HV, V] sharded like the inputs, final_state f32[N, HV, K, V] replicated)``.
    """
    B, T, H, HV, K, V, N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    P = mesh.shape[axis_name]
    if T % P:
        raise ValueError(f"T={T} must be divisible by the {axis_name!r} axis size {P}")
    kernel = chunk_kda if kernel is None else kernel
    init = jnp.zeros((N, HV, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    if cu_seqlens is None:
        # Every row is one sequence spanning all ranks: the rank's B row pieces run as one dense
        # call (no varlen repacking), and their maps travel in one all-gather.
        def shard_fn(q, k, v, g, beta, init):
            r = jax.lax.axis_index(axis_name)
            first = r == 0

            def initial_states(M, E):
                s_in = _state_entering(jnp.where(first, 0.0, M), jnp.where(first, apply_segment((M, E), init), E),
                                       axis_name, fold_dtype)
                return jnp.where(first, init, s_in)

            o, fin = kernel(q, k, v, g, beta, scale=scale, chunk_size=chunk_size, initial_state_fn=initial_states)
            fin = jax.lax.psum(jnp.where(r == P - 1, fin, 0.0), axis_name)
            return o, fin

        args = (q, k, v, g, beta, init)
        in_specs = (PartitionSpec(None, axis_name),) * 5 + (PartitionSpec(),)
    else:
        shard_fn = partial(chunk_kda_on_shard, axis_name=axis_name, scale=scale, chunk_size=chunk_size, kernel=kernel,
                           fold_dtype=fold_dtype)
        args = (q, k, v, g, beta, cu_seqlens.astype(jnp.int32), init)
        in_specs = (PartitionSpec(None, axis_name),) * 5 + (PartitionSpec(), PartitionSpec())
    f = jax.shard_map(shard_fn, mesh=mesh, in_specs=in_specs, out_specs=(PartitionSpec(None, axis_name), PartitionSpec()),
                      axis_names={axis_name}, check_vma=False)
    return f(*args)


def short_conv_on_shard(x, cu, init, weight, *, axis_name: str, bias=None, activation="silu"):
    """The short causal conv inside ``shard_map`` over ``axis_name``: this rank's contiguous piece
    ``x [1, L, D]`` of one packed varlen row, its sequences ``cu i32[n + 1]`` in the row's
    positions, ``init [n, W - 1, D]``. Each rank all-gathers the last ``min(L, W - 1)`` raw inputs
    of every rank, so a sequence that crosses into a rank gets its previous ``W - 1`` inputs even
    when they span several short shards. Returns ``(y [1, L, D], final [n, W - 1, D])``, the
    final states the same on every rank."""
    n, L, W = cu.shape[0] - 1, x.shape[1], weight.shape[-1]
    P, m = jax.lax.axis_size(axis_name), min(L, W - 1)
    r = jax.lax.axis_index(axis_name)
    lo = r * L
    tails = jax.lax.all_gather(x[0, L - m :], axis_name)  # [P, m, D]
    pos = lo - (W - 1) + jnp.arange(W - 1)
    src_rank = jnp.clip(pos // L, 0, P - 1)
    from_tails = tails[src_rank, jnp.clip(pos - src_rank * L - (L - m), 0, m - 1)]
    local_cu, c, crosses, owner = _rank_geometry(cu, lo, L, n)
    from_init = init[c, jnp.clip(W - 1 + pos - cu[c], 0, W - 2)]
    halo = jnp.where((pos >= cu[c])[:, None], from_tails, from_init)
    local_init = init.at[c].set(jnp.where(crosses, halo, init[c]))
    y, fin = short_conv(x, weight, bias=bias, activation=activation, initial_state=local_init, cu_seqlens=local_cu)
    fin = jax.lax.psum(jnp.where((owner == r)[:, None, None], fin, jnp.zeros((), fin.dtype)), axis_name)
    return y, fin


def short_conv_cp(x, weight, *, mesh: Mesh, axis_name: str, bias=None, activation="silu", initial_state=None,
                  cu_seqlens=None):
    """Short causal conv with T sharded over ``axis_name``, exchanging only a ``W - 1`` token halo
    (:func:`short_conv_on_shard`). Args and returns as :func:`k3jax.ops.conv.short_conv`
    (``x: [B, T, D]``, T divisible by the axis size); ``final_state`` is replicated.
    """
    B, T, D = x.shape
    W = weight.shape[-1]
    P = mesh.shape[axis_name]
    if T % P:
        raise ValueError(f"T={T} must be divisible by the {axis_name!r} axis size {P}")
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    init = jnp.zeros((N, W - 1, D), x.dtype) if initial_state is None else initial_state.astype(x.dtype)
    shard_seq = partial(short_conv_on_shard, weight=weight, axis_name=axis_name, bias=bias, activation=activation)

    if cu_seqlens is None:
        cu_row = jnp.array([0, T], jnp.int32)

        def shard_fn(x, init):
            y, fin = jax.vmap(lambda x, s: shard_seq(x[None], cu_row, s[None]))(x, init)
            return y[:, 0], fin[:, 0]

        args, in_specs = (x, init), (PartitionSpec(None, axis_name), PartitionSpec())
    else:
        shard_fn = shard_seq
        args = (x, cu_seqlens.astype(jnp.int32), init)
        in_specs = (PartitionSpec(None, axis_name), PartitionSpec(), PartitionSpec())
    f = jax.shard_map(shard_fn, mesh=mesh, in_specs=in_specs, out_specs=(PartitionSpec(None, axis_name), PartitionSpec()),
                      axis_names={axis_name}, check_vma=False)
    return f(*args)
