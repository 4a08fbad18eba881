"""Compressed storage of one tensor: per-group int8/int4/int2, fp8, and exact 1-bit masks.

`encode` returns an `Encoded` record (the payload tensors are all that is kept); `decode` rebuilds
the tensor from it. The kernels are the compiled ops in fastckpt.ops.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

BITS = {"int8": 8, "int4": 4, "int2": 2}
_stochastic_seeds = itertools.count(1)  # a counter, never the torch RNG: the caller's stream stays untouched


@dataclass
class Encoded:
    """A tensor as a codec keeps it."""

    codec: str
    payload: tuple[torch.Tensor, ...]
    group_size: int
    dtype: torch.dtype
    shape: torch.Size


def encode(t: torch.Tensor, codec: str, group_size: int | None, stochastic: bool) -> Encoded:
    """Compress `t` with `codec` ('int8', 'int4', 'int2', 'fp8', or 'mask' for bool tensors)."""
    from fastckpt import ops  # here, not at import: `import fastckpt` must work without the compiled ops

    if codec == "mask":
        return Encoded("mask", (ops.pack_bits(t),), 0, t.dtype, t.shape)
    if codec == "fp8":
        size = group_size or ops.FP8_DEFAULT_GROUP_SIZE
        return Encoded("fp8", ops.quantize_fp8_per_group(t, size), size, t.dtype, t.shape)
    bits = BITS[codec]
    size = group_size or ops.DEFAULT_GROUP_SIZE[bits]
    seed = next(_stochastic_seeds) if stochastic else 0
    return Encoded(codec, ops.quantize_per_group(t, bits, size, stochastic, seed), size, t.dtype, t.shape)


def decode(e: Encoded) -> torch.Tensor:
    """Rebuild the (approximate, or exact for masks) tensor."""
    from fastckpt import ops

    if e.codec == "mask":
        return ops.unpack_bits(e.payload[0], e.shape)
    if e.codec == "fp8":
        codes, scale = e.payload
        return ops.dequantize_fp8_per_group(codes, scale, e.group_size, e.dtype, e.shape)
    codes, scale, offset = e.payload
    return ops.dequantize_per_group(codes, scale, offset, BITS[e.codec], e.group_size, e.dtype, e.shape)
