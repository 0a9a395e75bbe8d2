"""Unified page pool: one allocator, refcount and LRU for MLA KV pages and KDA state pages.

Layers are split into cache groups of equal layer count. Every page, MLA or KDA, has the same
byte size; the device storage is one array of raw 32-bit words ``u32[num_pages, page_words]``
per device, and a page is viewed as MLA KV (bf16) or KDA state (f32) by bitcast, so pages are
truly interchangeable. Inside a KDA page each value head's bytes are contiguous
(``[HV, layers, K, V]``), the unit a prefill->decode transfer moves.

Host state (free list, refcounts, kind tags, LRU of cached pages) is plain Python. Page ids are
bounds-checked on the host before any device op (JAX clamps out-of-range indices silently), and
a page is readable only after it was written since its allocation.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

FREE, MLA, KDA = "free", "mla", "kda"


class PoolExhausted(RuntimeError):
    """No free page and nothing evictable."""


@dataclass(frozen=True)
class PoolLayout:
    """Page geometry derived from the model shape.

    ``kda_layers_per_group`` layers of ``HV x K x V`` float32 state (plus the short-conv state of
    ``conv_words_per_layer`` words) fill a KDA page; an MLA page holds ``block_tokens`` tokens of
    ``layers_per_group x (kv_lora_rank + rope_dim)`` bf16. ``block_tokens`` is the smallest
    multiple of ``hash_tokens`` whose MLA page is at least the KDA page.
    """

    layers_per_group: int
    HV: int
    K: int
    V: int
    kv_lora_rank: int
    rope_dim: int
    conv_words_per_layer: int = 0
    hash_tokens: int = 512

    @property
    def kda_page_words(self) -> int:
        return self.layers_per_group * (self.HV * self.K * self.V + self.conv_words_per_layer)

    @property
    def mla_words_per_token(self) -> float:
        return self.layers_per_group * (self.kv_lora_rank + self.rope_dim) / 2  # bf16 pairs

    @property
    def block_tokens(self) -> int:
        t = self.kda_page_words / self.mla_words_per_token
        return max(1, math.ceil(t / self.hash_tokens)) * self.hash_tokens

    @property
    def page_words(self) -> int:
        return max(self.kda_page_words, math.ceil(self.block_tokens * self.mla_words_per_token))

    @property
    def page_bytes(self) -> int:
        return 4 * self.page_words


def hybrid_groups(num_kda_layers: int, num_mla_layers: int, layers_per_group: int | None = None):
    """Split layers into groups of equal layer count: ``(kda_groups, mla_groups)``.

    The default group size is the MLA layer count (one MLA group); the last KDA group is padded.
    """
    g = layers_per_group or num_mla_layers or num_kda_layers
    return math.ceil(num_kda_layers / g), math.ceil(num_mla_layers / g) if num_mla_layers else 0


class PagePool:
    """Host-side allocator over ``num_pages`` equal pages, with optional device storage.

    Args:
      num_pages: pool size.
      page_words: 32-bit words per page (device storage only).
      with_storage: allocate ``u32[num_pages, page_words]`` on the default device; off for
        host-only simulation of the allocator.
      on_evict: called with a page id when an LRU page is evicted to make room; the owner
        (the prefix cache) unregisters it and may release sibling pages.
    """

    def __init__(self, num_pages: int, page_words: int = 1, *, with_storage: bool = True,
                 on_evict: Callable[[int], None] | None = None):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.page_words = page_words
        self.refcount = np.zeros(num_pages, np.int64)
        self.kind = [FREE] * num_pages
        self.cached = np.zeros(num_pages, bool)  # registered in the prefix cache
        self.written = np.zeros(num_pages, bool)
        self._free = list(range(num_pages - 1, -1, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages with refcount 0
        self.on_evict = on_evict
        self.evictions = 0
        self.words = jnp.zeros((num_pages, page_words), jnp.uint32) if with_storage else None

    # ---- accounting
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def check(self, page: int) -> int:
        """Bounds-check a page id (JAX would clamp it silently)."""
        if not (0 <= int(page) < self.num_pages):
            raise IndexError(f"page id {page} out of range [0, {self.num_pages})")
        return int(page)

    def allocate(self, kind: str) -> int:
        """A fresh page with refcount 1, evicting the least recently used cached page if needed."""
        if kind not in (MLA, KDA):
            raise ValueError(f"kind must be {MLA!r} or {KDA!r}, got {kind!r}")
        while not self._free:
            if not self._lru:
                raise PoolExhausted(f"all {self.num_pages} pages are in use")
            page, _ = self._lru.popitem(last=False)
            self.evictions += 1
            self.cached[page] = False
            if self.on_evict is not None:
                self.on_evict(page)  # may release sibling pages
            if self.refcount[page] == 0 and self.kind[page] != FREE:
                self._release(page)
        page = self._free.pop()
        self.kind[page] = kind
        self.refcount[page] = 1
        self.written[page] = False
        return page

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free) + len(self._lru)

    def incref(self, page: int):
        page = self.check(page)
        if self.kind[page] == FREE:
            raise ValueError(f"page {page} is free")
        self.refcount[page] += 1
        self._lru.pop(page, None)

    def decref(self, page: int):
        """Drop one reference; at zero a cached page becomes evictable, an uncached one free."""
        page = self.check(page)
        if self.refcount[page] <= 0:
            raise ValueError(f"page {page} released more often than referenced")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if self.cached[page]:
                self._lru[page] = None
            else:
                self._release(page)

    def set_cached(self, page: int, cached: bool):
        """Register (or unregister) a page in the prefix cache; an unregistered idle page is freed."""
        page = self.check(page)
        self.cached[page] = cached
        if not cached:
            self._lru.pop(page, None)
            if self.refcount[page] == 0 and self.kind[page] != FREE:
                self._release(page)

    def _release(self, page: int):
        self._lru.pop(page, None)
        self.kind[page] = FREE
        self.cached[page] = False
        self.written[page] = False
        self._free.append(page)

    # ---- device storage
    def _storage(self):
        if self.words is None:
            raise RuntimeError("this pool has no device storage (with_storage=False)")
        return self.words

    def write_f32(self, page: int, x: jax.Array, kind: str):
        """Write float32 data into a page of ``kind`` (checked): a KDA state ``[HV, layers, K, V]``
        (head-contiguous) or float32 MLA latents."""
        page = self.check(page)
        if self.kind[page] != kind:
            raise ValueError(f"page {page} is a {self.kind[page]} page, not {kind}")
        if x.size > self.page_words:
            raise ValueError(f"{x.size} words do not fit a page of {self.page_words}")
        self.words = _write_words(self._storage(), page, jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32))
        self.written[page] = True

    def read_f32(self, page: int, shape) -> jax.Array:
        """Read the first ``prod(shape)`` words of a written page as ``f32[shape]``."""
        return _read_f32(self._storage(), jnp.asarray(self.page_ids([page])), tuple(shape))[0]

    def page_ids(self, pages) -> np.ndarray:
        """Checked ids of written pages, for device functions that read ``self.words`` directly."""
        return np.asarray([self._readable(p) for p in pages], np.int32)

    def write_kda_state(self, page: int, state: jax.Array):
        """Write ``f32[HV, layers, K, V]`` (head-contiguous) into a KDA page."""
        self.write_f32(page, state, KDA)

    def read_kda_state(self, page: int, shape) -> jax.Array:
        """Read a KDA page as ``f32[shape]`` (``shape = (HV, layers, K, V)``)."""
        return self.read_f32(page, shape)

    def write_mla(self, page: int, kv: jax.Array):
        """Write bf16 MLA KV (even element count) into an MLA page."""
        page = self.check(page)
        if self.kind[page] != MLA:
            raise ValueError(f"page {page} is a {self.kind[page]} page, not {MLA}")
        pairs = kv.astype(jnp.bfloat16).reshape(-1, 2)
        self.words = _write_words(self._storage(), page, jax.lax.bitcast_convert_type(pairs, jnp.uint32))
        self.written[page] = True

    def read_mla(self, page: int, shape) -> jax.Array:
        page = self._readable(page)
        return _read_bf16(self._storage(), page, tuple(shape))

    def copy_page(self, src: int, dst: int):
        """Copy a whole page (a read-only checkpoint into a request-private slot)."""
        src, dst = self._readable(src), self.check(dst)
        if self.kind[src] != self.kind[dst]:
            raise ValueError(f"cannot copy a {self.kind[src]} page into a {self.kind[dst]} page")
        self.words = _copy_page(self._storage(), src, dst)
        self.written[dst] = True

    def _readable(self, page: int) -> int:
        page = self.check(page)
        if not self.written[page]:
            raise ValueError(f"page {page} was not written since it was allocated")
        return page


@partial(jax.jit, donate_argnums=0)
def _write_words(words, page, data):
    flat = data.reshape(-1)
    return words.at[page, : flat.size].set(flat)


@partial(jax.jit, static_argnums=2)
def _read_f32(words, pages, shape):
    n = int(np.prod(shape))
    return jax.lax.bitcast_convert_type(words[pages, :n], jnp.float32).reshape((pages.shape[0],) + shape)


@partial(jax.jit, static_argnums=2)
def _read_bf16(words, page, shape):
    n = int(np.prod(shape))
    return jax.lax.bitcast_convert_type(words[page, : n // 2], jnp.bfloat16).reshape(shape)


@partial(jax.jit, donate_argnums=0)
def _copy_page(words, src, dst):
    return words.at[dst].set(words[src])
