"""MXFP4 routed experts kept packed on the device (compressed-tensors' encoding, 4.25 bits a weight).

:class:`MXFP4` holds a stack of matrices as their packed codes and scales; :func:`dequantize`
expands them, bit for bit as :func:`k3jax.model.loader.dequantize_mxfp4`. The reference forward
dequantises a layer's experts whole; the serving step right before its grouped matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

u32 = jnp.uint32
_INF, _NAN = 0x7F800000, 0x7FC00000  # float32 bits


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class MXFP4:
    """A stack of MXFP4 matrices. ``packed u8`` holds two E2M1 codes a byte (the even index along
    ``axis`` in the low nibble), ``scale u8`` one E8M0 exponent (``2^(s - 127)``) per 32 values
    along ``axis``, the input (contracted) axis: ``axis=-1`` for the checkpoint's ``[..., out, in]``
    (``packed [..., out, in/2]``, ``scale [..., out, in/32]``), ``axis=-2`` for the serving step's
    ``[..., in, out]`` (``packed [..., in/2, out]``, ``scale [..., in/32, out]``)."""

    packed: jax.Array
    scale: jax.Array
    axis: int = field(default=-1, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantised shape."""
        s = list(self.packed.shape)
        s[self.axis] *= 2
        return tuple(s)

    @property
    def size(self) -> int:
        """Weights held (not bytes)."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def mT(self) -> MXFP4:
        """The last two axes swapped (``[..., out, in]`` <-> ``[..., in, out]``), still packed."""
        return MXFP4(jnp.swapaxes(self.packed, -1, -2), jnp.swapaxes(self.scale, -1, -2), -3 - self.axis)


def dequantize(w: MXFP4, dtype=jnp.float32) -> jax.Array:
    """``w`` as a dense ``dtype`` array of ``w.shape``. Bit-exact against
    :func:`k3jax.model.loader.dequantize_mxfp4` for float32 and bfloat16 (its result cast), NaN and
    inf included (scale 255: inf, NaN for a zero code). The bits are built with integer ops, so no
    subnormal (scales 0 and 1) is flushed to zero on a backend that flushes float results."""
    ax = w.axis % w.packed.ndim
    lead, rest = w.packed.shape[:ax], w.packed.shape[ax + 1 :]
    nb = w.scale.shape[ax]
    codes = jnp.stack([w.packed & 0xF, w.packed >> 4], axis=ax + 1).reshape(*lead, nb, 32, *rest).astype(jnp.int32)
    s = jnp.expand_dims(w.scale, ax + 1).astype(jnp.int32)
    m = codes & 7  # magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6 = 2^e (1 + f / 2) for m > 0
    e = jnp.where(m < 2, -1, (m >> 1) - 1)
    f = jnp.where(m < 2, 0, m & 1).astype(u32)
    t = e + s  # the float32 biased exponent of the product, from -1 to 257
    normal = (t.astype(u32) << 23) | (f << 22)
    subnormal = (2 + f) << jnp.clip(21 + t, 0, 31).astype(u32)  # t in {-1, 0}: exact, (2 + f) 2^(t + 21) ulps
    bits = jnp.where(t >= 255, u32(_INF), jnp.where(t >= 1, normal, subnormal))
    bits = jnp.where(m == 0, u32(0), bits)
    bits = jnp.where(s == 255, jnp.where(m == 0, u32(_NAN), u32(_INF)), bits)
    bits = (bits | ((codes >> 3).astype(u32) << 31)).reshape(w.shape)
    if jnp.dtype(dtype) == jnp.bfloat16:  # every value has <= 2 significant bits: the high half is exact
        return jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def dense(w, dtype=jnp.float32):
    """``w`` dequantised if it is :class:`MXFP4`, else as it is."""
    return dequantize(w, dtype) if isinstance(w, MXFP4) else w
