"""The pool's latent words as the paged MLA kernels read them: the operand check and the unpacking
(shared by the GPU and TPU kernels)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def check_latents(q_lat, q_rope, latents) -> int:
    """Raise unless ``latents`` are ``u32[N, rows, (L + R) / parts]`` words of latents in the
    queries' dtype (float32 or bfloat16); returns ``parts``, values per word."""
    L, R = q_lat.shape[-1], q_rope.shape[-1]
    dtype = jnp.dtype(q_lat.dtype)
    parts = 4 // dtype.itemsize
    if latents.dtype != jnp.uint32 or latents.shape[-1] * parts != L + R or dtype not in (_F32, jnp.bfloat16):
        raise ValueError(f"latents must be u32[N, rows, (L + R) / {parts}] words of {dtype} latents (L + R = {L + R}), "
                         f"got {latents.dtype}{list(latents.shape)}; q in float32 or bfloat16")
    return parts


def unpack(words, dtype):
    """``u32`` words of latent rows -> their values in ``dtype`` as parts: float32, the words
    themselves; bf16 (two to a word, the even element in the low half), ``(even, odd)``."""
    if dtype == _F32:
        return (jax.lax.bitcast_convert_type(words, _F32),)
    even = jax.lax.bitcast_convert_type(jax.lax.shift_left(words, jnp.uint32(16)), _F32)
    odd = jax.lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), _F32)
    return even.astype(dtype), odd.astype(dtype)
