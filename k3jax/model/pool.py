"""The unified device page pool: one buffer of 32-bit words, MLA latent pages and KDA state pages
of one byte size, viewed by bitcast.

Physical layout: ``u32[N, page_words]`` with ``page_words = HV * head_words``, a multiple of the
MLA row width ``rw`` so that both views are free reshapes of the same buffer:

- KDA view ``u32[N, HV, head_words]``: a request's recurrent state and conv state for every KDA
  layer, head-contiguous (a head's bytes are one run: the unit a prefill->decode transfer
  moves). Per head: ``state f32[n_kda, K, V]`` then ``conv f32[n_kda, W - 1, 3, K]`` (the q, k, v
  channels of that head).
- MLA view ``u32[N, page_words // rw, rw]``: row ``layer * P + t`` holds token ``t`` of the page's
  ``P`` tokens for MLA layer ``layer``: the normalised latent and the rope part (``L + R``
  values of ``latent_dtype``, bf16 by default, two per word).

A page is MLA or KDA by its use, never by its array; reading one as the other kind gives
garbage. Page ids outside ``[0, N)`` are dropped on write (padding rows use -1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from k3jax.model.config import ModelConfig

f32 = jnp.float32
u32 = jnp.uint32


@dataclass(frozen=True)
class PoolLayout:
    """Word layout of one page for a model. ``page_tokens`` (P): tokens per MLA page."""

    n_kda: int
    n_mla: int
    HV: int
    K: int
    V: int
    W: int
    latent: int  # L + R
    latent_dtype: str
    page_tokens: int

    @classmethod
    def for_model(cls, cfg: ModelConfig, *, page_tokens: int | None = None, token_multiple: int = 16,
                  latent_dtype=jnp.bfloat16) -> "PoolLayout":
        """The layout where an MLA page and a KDA page have the same byte size: ``page_tokens`` is
        the most tokens (a multiple of ``token_multiple``, e.g. the prefix cache's hash block) whose
        latents of every MLA layer fit in the KDA page; or given explicitly (the page grows to fit)."""
        K = V = cfg.linear_head_dim
        base = cls(len(cfg.kda_layers), len(cfg.mla_layers), cfg.linear_num_heads, K, V, cfg.conv_width,
                   cfg.kv_lora_rank + cfg.qk_rope_head_dim, jnp.dtype(latent_dtype).name, 0)
        if base.latent * jnp.dtype(latent_dtype).itemsize % 4:
            raise ValueError(f"a latent row of {base.latent} x {latent_dtype} is not a whole number of words")
        if page_tokens is None:
            per_token = max(base.n_mla, 1) * base.row_words
            page_tokens = max(token_multiple, base.kda_words // per_token // token_multiple * token_multiple)
        return cls(**{**base.__dict__, "page_tokens": page_tokens})

    @property
    def row_words(self) -> int:
        """Words per latent row (one token of one MLA layer)."""
        return self.latent * jnp.dtype(self.latent_dtype).itemsize // 4

    @property
    def state_words(self) -> int:
        """Per head: recurrent state words of all KDA layers."""
        return self.n_kda * self.K * self.V

    @property
    def conv_words(self) -> int:
        """Per head and KDA layer: the conv state (``W - 1`` raw q, k, v inputs)."""
        return (self.W - 1) * 3 * self.K

    @property
    def kda_words(self) -> int:
        return self.HV * (self.state_words + self.n_kda * self.conv_words)

    @property
    def head_words(self) -> int:
        """Words per head in the KDA view, padded so the page is a whole number of MLA rows and
        a head a whole number of ``V``-word rows (the state view)."""
        need = max(self.state_words + self.n_kda * self.conv_words,
                   -(-self.n_mla * self.page_tokens * self.row_words // self.HV))
        step = math.lcm(self.row_words // math.gcd(self.row_words, self.HV), self.V)
        return -(-need // step) * step

    @property
    def page_words(self) -> int:
        return self.HV * self.head_words

    @property
    def page_bytes(self) -> int:
        return 4 * self.page_words

    def allocate(self, num_pages: int) -> jax.Array:
        """A zeroed pool ``u32[num_pages, page_words]``."""
        return jnp.zeros((num_pages, self.page_words), u32)

    def pages_for_memory(self, free_bytes: int, fraction: float = 0.9) -> int:
        """How many pages fit in ``fraction`` of ``free_bytes``."""
        return int(free_bytes * fraction) // self.page_bytes


def _to_words(x, dtype):
    """``[..., n]`` of ``dtype`` -> ``u32[..., n * itemsize / 4]``."""
    per = 4 // jnp.dtype(dtype).itemsize
    x = x.astype(dtype)
    if per > 1:
        x = x.reshape(*x.shape[:-1], x.shape[-1] // per, per)
    return jax.lax.bitcast_convert_type(x, u32)


def _from_words(w, dtype):
    """Inverse of :func:`_to_words`."""
    x = jax.lax.bitcast_convert_type(w, jnp.dtype(dtype))
    return x.reshape(*w.shape[:-1], -1)


def _write_ids(pages, num_pages):
    """Page ids for writes: anything outside ``[0, N)`` becomes ``N`` (dropped)."""
    return jnp.where((pages >= 0) & (pages < num_pages), pages, num_pages)


def copy_pages(pool, src, dst):
    """Copy whole pages ``src i32[n]`` -> ``dst i32[n]`` (pairs with a negative id do nothing)."""
    ok = (src >= 0) & (dst >= 0)
    pages = jax.lax.optimization_barrier(pool[jnp.maximum(src, 0)])  # see _read_heads
    return pool.at[_write_ids(jnp.where(ok, dst, -1), pool.shape[0])].set(pages, mode="drop")


def _kda_words(lay: PoolLayout, layer):
    """Word offsets, within a head, of KDA layer ``layer``'s state and conv state (``layer`` may
    be traced: a step scans over layers)."""
    return layer * (lay.K * lay.V), lay.state_words + layer * lay.conv_words


def _head_rows(lay: PoolLayout, pool):
    """The pool as one row of ``head_words`` per (page, head): ``u32[N * HV, head_words]`` (a reshape)."""
    return pool.reshape(pool.shape[0] * lay.HV, lay.head_words)


def _head_starts(lay: PoolLayout, pages, start):
    """Gather/scatter start indices ``i32[B, HV, 2]``: (row of page ``p``'s head ``h``, ``start``).
    Indexing the leading dims in order keeps XLA from transposing the pool: its GPU gather and
    scatter simplifiers move indexed dims to the front, copying the whole operand otherwise."""
    rows = pages[:, None] * lay.HV + jnp.arange(lay.HV, dtype=pages.dtype)[None, :]
    return jnp.stack([rows, jnp.broadcast_to(jnp.asarray(start, pages.dtype), rows.shape)], axis=-1)


def _gather_heads(lay: PoolLayout, pool, pages, start, size: int):
    """``u32[B, HV, size]``: words ``[start, start + size)`` of every head of pages ``pages i32[B]``
    (in range); ``start`` a scalar, possibly traced."""
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(0,), start_index_map=(0, 1))
    return jax.lax.gather(_head_rows(lay, pool), _head_starts(lay, pages, start), dims, (1, size),
                          mode=jax.lax.GatherScatterMode.CLIP)


def _scatter_heads(lay: PoolLayout, pool, pages, start, words):
    """Inverse of :func:`_gather_heads`: write ``words u32[B, HV, size]``; a page id outside
    ``[0, N)`` writes nothing. Returns the pool."""
    dims = jax.lax.ScatterDimensionNumbers(update_window_dims=(2,), inserted_window_dims=(0,),
                                           scatter_dims_to_operand_dims=(0, 1))
    out = jax.lax.scatter(_head_rows(lay, pool), _head_starts(lay, pages, start), words, dims,
                          mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
    return out.reshape(pool.shape)


def _read_heads(lay: PoolLayout, pool, pages, start, size: int):
    """Words ``[start, start + size)`` of every head of ``pages i32[B]`` as ``f32[B, HV, size]``;
    zeros for a negative page id (a fresh request). The gathered words are materialised (an
    optimization barrier): XLA on the GPU otherwise fuses the gather into the fusion that later
    scatters into the pool (e.g. an empty row's final state is its initial one), and a fusion
    that reads and writes the pool in place needs a copy of the whole pool first."""
    words = _gather_heads(lay, pool, jnp.clip(pages, 0, pool.shape[0] - 1), start, size)
    words = jax.lax.optimization_barrier(words)
    return jnp.where((pages < 0)[:, None, None], 0.0, jax.lax.bitcast_convert_type(words, f32))


def _write_heads(lay: PoolLayout, pool, pages, start, values):
    """Inverse of :func:`_read_heads`: ``values f32[B, HV, size]`` in place."""
    words = jax.lax.bitcast_convert_type(values.astype(f32), u32)
    return _scatter_heads(lay, pool, _write_ids(pages, pool.shape[0]), start, words)


def read_conv(lay: PoolLayout, pool, pages, layer):
    """KDA layer ``layer``'s conv state ``f32[B, W - 1, 3 * HV * K]`` from ``pages i32[B]``
    (zeros for a negative id)."""
    conv = _read_heads(lay, pool, pages, _kda_words(lay, layer)[1], lay.conv_words)
    # [B, HV, W-1, 3, K] -> [B, W-1, 3, HV, K]: the channel order of the model's q, k, v concat
    B = pages.shape[0]
    return jnp.transpose(conv.reshape(B, lay.HV, lay.W - 1, 3, lay.K), (0, 2, 3, 1, 4)).reshape(B, lay.W - 1, -1)


def write_conv(lay: PoolLayout, pool, pages, layer, conv):
    """Inverse of :func:`read_conv`: write the conv state of rows ``pages i32[B]`` in place."""
    B = pages.shape[0]
    conv = jnp.transpose(conv.astype(f32).reshape(B, lay.W - 1, 3, lay.HV, lay.K), (0, 3, 1, 2, 4))
    return _write_heads(lay, pool, pages, _kda_words(lay, layer)[1], conv.reshape(B, lay.HV, lay.conv_words))


def read_kda(lay: PoolLayout, pool, pages, layer):
    """KDA layer ``layer``'s state ``f32[B, HV, K, V]`` and conv state ``f32[B, W - 1, 3 * HV * K]``
    from ``pages i32[B]``; a negative page id reads zeros (a fresh request)."""
    state = _read_heads(lay, pool, pages, _kda_words(lay, layer)[0], lay.K * lay.V)
    return state.reshape(pages.shape[0], lay.HV, lay.K, lay.V), read_conv(lay, pool, pages, layer)


def write_kda(lay: PoolLayout, pool, pages, layer, state, conv):
    """Inverse of :func:`read_kda`: write ``state``, ``conv`` of rows ``pages i32[B]`` in place."""
    state = state.reshape(pages.shape[0], lay.HV, lay.K * lay.V)
    pool = _write_heads(lay, pool, pages, _kda_words(lay, layer)[0], state)
    return write_conv(lay, pool, pages, layer, conv)


def state_view(lay: PoolLayout, pool):
    """The pool as KDA state rows ``u32[N, HV, head_words / V, V]`` of float32 bits (a reshape, no
    copy; the kernel bitcasts what it reads: a bitcast of the whole pool here would make XLA copy
    it): layer ``i``'s state ``f32[K, V]`` of a head is rows ``[state_row(lay, i), + K)``. The
    input of the KDA decode kernel on pages; :func:`from_state_view` inverts it."""
    return pool.reshape(pool.shape[0], lay.HV, lay.head_words // lay.V, lay.V)


def from_state_view(lay: PoolLayout, states):
    return states.reshape(states.shape[0], lay.page_words)


def state_row(lay: PoolLayout, layer):
    """The first row of KDA layer ``layer``'s state in :func:`state_view` (``layer`` may be traced)."""
    return layer * lay.K


def latent_words(lay: PoolLayout, pool):
    """The pool as latent rows of words ``u32[N, page_words / row_words, row_words]`` (a reshape,
    no copy): the input of a paged attention kernel, which unpacks the ``latent_dtype`` values
    (:func:`_to_words`'s packing); a bitcast of the whole pool here would make XLA copy it."""
    return pool.reshape(pool.shape[0], lay.page_words // lay.row_words, lay.row_words)


def token_pages(lay: PoolLayout, block_tables, rows, positions):
    """(page, token-in-page) of each token: ``block_tables i32[R, blocks]``, ``rows`` and
    ``positions`` of equal shape; page -1 where the position is past the block table."""
    blk = positions // lay.page_tokens
    ok = blk < block_tables.shape[1]
    page = jnp.where(ok, block_tables[rows, jnp.minimum(blk, block_tables.shape[1] - 1)], -1)
    return page, positions % lay.page_tokens


def write_latents(lay: PoolLayout, pool, layer, pages, offsets, latents):
    """Write ``latents [T, L + R]`` of MLA layer ``layer`` (may be traced) at ``(pages, offsets) i32[T]``."""
    view = latent_words(lay, pool)
    ids = _write_ids(pages, pool.shape[0])
    view = view.at[ids, layer * lay.page_tokens + offsets].set(_to_words(latents, lay.latent_dtype), mode="drop")
    return view.reshape(pool.shape)


def read_latent_tile(lay: PoolLayout, pool, layer, block_table, start, size: int, length):
    """Latent rows ``[start, start + size)`` of one row's ``block_table i32[blocks]`` for MLA layer
    ``layer``: ``[size, L + R]``, zeros at or past ``length`` or the table's end (``start``,
    ``length`` and ``layer`` may be traced): a page's other words may be anything (a KDA page's
    floats read as bf16 include NaNs), and a masked attention weight of 0 times NaN is NaN."""
    pos = start + jnp.arange(size, dtype=jnp.int32)
    page, off = token_pages(lay, block_table[None], jnp.zeros_like(pos), pos)
    valid = (page >= 0) & (pos < length)
    words = latent_words(lay, pool)[jnp.clip(page, 0, pool.shape[0] - 1), layer * lay.page_tokens + off]
    return _from_words(jnp.where(valid[:, None], words, 0), lay.latent_dtype)


def read_latents(lay: PoolLayout, pool, layer, block_tables, num_tokens: int, lengths):
    """The first ``num_tokens`` latent rows of every row's block table: ``[R, num_tokens, L + R]``,
    zeros where ``lengths i32[R]`` (each row's context) or the block table ends
    (:func:`read_latent_tile` for each row)."""
    return jax.vmap(lambda bt, n: read_latent_tile(lay, pool, layer, bt, 0, num_tokens, n))(block_tables, lengths)
