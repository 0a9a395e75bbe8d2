"""What the GPU kernels (prefill and decode) share: the device's SM count, programs per grid, the
head sizes they take, and the Triton compiler parameters."""

from __future__ import annotations

import jax


def gpu_programs(rows, num_heads, V, block_v):
    """Programs of a GPU kernel with one per (row, head, column block): the recurrent kernel per
    segment (rows = sequences) and the decode window kernels (rows = batch rows)."""
    return rows * num_heads * max(V // block_v, 1)


def gpu_core_count() -> int:
    """Streaming multiprocessors of the default device (132 on the H200 when it does not say)."""
    return getattr(jax.devices()[0], "core_count", 132)


def gpu_head_dims_ok(*dims) -> bool:
    """Whether the GPU kernels take these head sizes (powers of two >= 16)."""
    return all(d >= 16 and not d & (d - 1) for d in dims)


def triton_params(num_warps, num_stages):
    """Compiler parameters of a Pallas Triton kernel."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


MAX_TRITON_ELEMENTS = 2**31 - 1  # Pallas Triton indexes a ref with 32-bit offsets


def check_offset_width(name: str, x):
    """Raise if Pallas Triton would index ``x`` past its 32-bit offsets: it takes 64-bit offsets
    only for arrays of more than 2^32 bytes (jax 0.11.2), so an array of 2^31 to 2^32 elements
    of one byte each overflows them."""
    if x.size > MAX_TRITON_ELEMENTS and x.size * x.dtype.itemsize <= 2**32:
        raise ValueError(f"{name} has {x.size} elements in {x.size * x.dtype.itemsize} bytes: the GPU kernel "
                         f"indexes it with 32-bit offsets (at most {MAX_TRITON_ELEMENTS} elements)")

