"""Compressed storage of one tensor: per-group int8/int4/int2, fp8, exact 1-bit masks, and exact two-valued floats.

`encode_tensor` is the one way a saved tensor is encoded (eager storage and compiled graphs alike): in its
memory order, exactly when it holds at most two values, else by the codec. It returns an `Encoded` record
(the payload tensors are all that is kept); `decode` rebuilds the tensor, with the saved one's strides.
The kernels are the compiled ops in fastckpt.ops.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

BITS = {"int8": 8, "int4": 4, "int2": 2}
_stochastic_seeds = itertools.count(1)  # a counter, never the torch RNG: the caller's stream stays untouched
_SAMPLE = 256  # elements two_valued looks at before it reads a whole tensor
_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@dataclass
class Encoded:
    """A tensor as a codec keeps it."""

    codec: str
    payload: tuple[torch.Tensor, ...]
    group_size: int
    dtype: torch.dtype
    shape: torch.Size  # as encoded: the saved tensor's sizes in its memory order
    layout: tuple[int, ...] | None = None  # the permutation that gives the decoded tensor the saved one's strides


def dense_permutation(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dimension order in which `t` is contiguous, when it is a permuted dense tensor (e.g. a transpose or
    attention's (batch, heads, tokens, dim) view of (batch, tokens, heads, dim) memory); None otherwise."""
    if t.is_contiguous():
        return None
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))
    return order if t.permute(order).is_contiguous() else None


def encode_tensor(t: torch.Tensor, codec: str, group_size: int | None, stochastic: bool, exact_two: bool) -> Encoded:
    """`t` as `codec` keeps it ('mask' for bool tensors). A permuted dense tensor is encoded in its memory order
    (the kernels would copy it to row-major first) and permuted back by decode. With `exact_two`, a float tensor
    of at most two values (an additive attention mask of 0 and -inf, a constant) is kept exactly at 1 bit per
    element instead (two_valued: a data-dependent check, so eager storage only)."""
    order = dense_permutation(t)
    source = t.permute(order) if order else t
    encoded = two_valued(source) if exact_two and codec != "mask" else None
    if encoded is None:
        encoded = encode(source, codec, group_size, stochastic)
    encoded.layout = tuple(order.index(d) for d in range(t.dim())) if order else None
    return encoded


def sample_index(numel: int, device: torch.device) -> torch.Tensor:
    """The flat (row-major) positions two_valued samples: about _SAMPLE of them, at an odd stride (not in
    step with power-of-two rows)."""
    return torch.arange(0, numel, _sample_step(numel), device=device)


def _sample_step(numel: int) -> int:
    return max(1, numel // _SAMPLE) | 1


def two_valued(t: torch.Tensor) -> Encoded | None:
    """`t` (float32/float16/bfloat16) as the exact 'two-valued' codec keeps it, 1 bit per element ("equals the
    second value") plus its two values, when it holds at most two distinct bit patterns (-0.0 is not 0.0, NaNs
    differ by payload); None otherwise. An ordinary activation costs one read of a small sample to the host (one
    sync on an accelerator); only a sample of at most two values leads to the full check and a second read (its
    verdict)."""
    from fastckpt import ops

    if t.is_meta or t.numel() == 0:
        return None
    bits = t.view(_SAME_WIDTH_INT[t.dtype])  # compare bit patterns: NaN == NaN, -0.0 != 0.0
    if bits.is_contiguous():  # sample_index's positions as a strided view: no index tensor, one copy fewer
        sample = bits.view(-1)[:: _sample_step(t.numel())]
    else:
        sample = bits[torch.unravel_index(sample_index(t.numel(), t.device), bits.shape)]
    if len(set(sample.tolist())) > 2:
        return None
    lo, hi = bits.aminmax()  # at most two values: they are the least and the greatest
    second = bits == hi
    if not (bits == lo).logical_or_(second).all().item():
        return None
    return Encoded("two-valued", (ops.pack_bits(second), torch.stack([lo, hi]).view(t.dtype)), 0, t.dtype, t.shape)


_MIN_ROW_GROUP = 8  # narrower rows keep the default group: their parameters would outweigh their codes


def default_group_size(t: torch.Tensor, codec: str) -> int:
    """The codec's default group size for `t`, cut to its rows (last dimension, in memory order) when they are
    shorter: rows (tokens) can differ in scale by orders of magnitude, e.g. an all-zero or near-constant token
    beside ordinary ones, and a norm's backward multiplies a small-scale row's error by its 1/std (LayerNorm
    over tokens, RMSNorm over a head's query or key). A group spanning such rows gave BEiT at init a gradient
    error of 0.35 under int8; row-sized groups give 7.8e-4."""
    from fastckpt import ops

    size = ops.FP8_DEFAULT_GROUP_SIZE if codec == "fp8" else ops.DEFAULT_GROUP_SIZE[BITS[codec]]
    row = t.shape[-1] if t.dim() else 0
    per_byte = 1 if codec == "fp8" else 8 // BITS[codec]  # a group starts on a whole byte of codes
    return row if _MIN_ROW_GROUP <= row < size and row % per_byte == 0 else size


def encode(t: torch.Tensor, codec: str, group_size: int | None, stochastic: bool) -> Encoded:
    """Compress `t` with `codec` ('int8', 'int4', 'int2', 'fp8', or 'mask' for bool tensors); group_size None:
    default_group_size."""
    from fastckpt import ops  # here, not at import: `import fastckpt` must work without the compiled ops

    if codec == "mask":
        return Encoded("mask", (ops.pack_bits(t),), 0, t.dtype, t.shape)
    size = group_size or default_group_size(t, codec)
    if codec == "fp8":
        return Encoded("fp8", ops.quantize_fp8_per_group(t, size), size, t.dtype, t.shape)
    bits = BITS[codec]
    seed = next(_stochastic_seeds) if stochastic else 0
    return Encoded(codec, ops.quantize_per_group(t, bits, size, stochastic, seed), size, t.dtype, t.shape)


def decode(e: Encoded) -> torch.Tensor:
    """Rebuild the (approximate, or exact for masks and two-valued) tensor, with the saved one's strides."""
    tensor = _decode_memory_order(e)
    return tensor.permute(e.layout) if e.layout else tensor


def _decode_memory_order(e: Encoded) -> torch.Tensor:
    from fastckpt import ops

    if e.codec == "mask":
        return ops.unpack_bits(e.payload[0], e.shape)
    if e.codec == "two-valued":
        packed, values = e.payload
        values = values.view(_SAME_WIDTH_INT[e.dtype])  # select bit patterns: NaN payloads survive
        return torch.where(ops.unpack_bits(packed, e.shape), values[1], values[0]).view(e.dtype)
    if e.codec == "fp8":
        codes, scale = e.payload
        return ops.dequantize_fp8_per_group(codes, scale, e.group_size, e.dtype, e.shape)
    codes, scale, offset = e.payload
    return ops.dequantize_per_group(codes, scale, offset, BITS[e.codec], e.group_size, e.dtype, e.shape)
