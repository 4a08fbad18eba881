"""Typed wrappers and fake kernels of the quantize family: per-group int8/int4/int2 and fp8 storage.

Layout, rounding and NaN/Inf rules are documented with the schemas in csrc/registration.cpp and
csrc/quantize/quantize.h; fastckpt/ops/reference.py restates them in pure PyTorch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastckpt._extension import OPS, extension

extension(OPS)  # the schemas below must be registered before their fake kernels

# With 16-bit scale and offset per group these store 8.25, 4.5 and 2.5 bits per element
# (targets: 8.5, 4.5, 2.5); int8 affords the larger group, int4/int2 need 64 for accuracy.
DEFAULT_GROUP_SIZE: dict[int, int] = {8: 128, 4: 64, 2: 64}
# One bf16 power-of-two scale per 64 fp8 codes: 8.25 bits per element.
FP8_DEFAULT_GROUP_SIZE = 64
# The largest group_size the ops accept (csrc/quantize/quantize.h kMaxGroupSize; fastckpt.Policy's bound).
# A group_size at or beyond the tensor's size means one group; the kernels never allocate for more.
MAX_GROUP_SIZE = 2**31 - 1


def affine_param_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of quantize_per_group's scale/offset: float16 for float16 inputs, else bfloat16 (fp32's range)."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def quantize_per_group(
    x: torch.Tensor, bits: int, group_size: int | None = None, stochastic: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize x per group to `bits` (8, 4, 2); returns (packed uint8 codes, scale, offset)."""
    group_size = DEFAULT_GROUP_SIZE.get(bits, 0) if group_size is None else group_size
    return torch.ops.fastckpt.quantize_per_group.default(x, bits, group_size, stochastic, seed)


def dequantize_per_group(
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    shape: Sequence[int],
) -> torch.Tensor:
    """Rebuild a tensor of `shape` and `dtype` from quantize_per_group's output."""
    return torch.ops.fastckpt.dequantize_per_group.default(codes, scale, offset, bits, group_size, dtype, list(shape))


def quantize_fp8_per_group(
    x: torch.Tensor, group_size: int = FP8_DEFAULT_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store x as e4m3 codes (uint8 bit patterns) with a power-of-two bf16 scale per group; returns (codes, scale)."""
    return torch.ops.fastckpt.quantize_fp8_per_group.default(x, group_size)


def dequantize_fp8_per_group(
    codes: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor:
    """Rebuild a tensor of `shape` and `dtype` from quantize_fp8_per_group's output."""
    return torch.ops.fastckpt.dequantize_fp8_per_group.default(codes, scale, group_size, dtype, list(shape))


def _num_groups(numel: int, group_size: int) -> int:
    return (numel + group_size - 1) // group_size


def _check_group_size(op: str, group_size: int, bits: int | None = None) -> None:
    """The kernels' group_size check (same message), for the fake kernels."""
    if bits is None:
        if not 0 < group_size <= MAX_GROUP_SIZE:
            raise RuntimeError(
                f"{op}: group_size must be positive and at most {MAX_GROUP_SIZE} (2^31 - 1), got {group_size}"
            )
        return
    if bits not in (8, 4, 2):
        raise RuntimeError(f"{op}: bits must be 8, 4 or 2, got {bits}")
    per_byte = 8 // bits
    if not (0 < group_size <= MAX_GROUP_SIZE and group_size % per_byte == 0):
        raise RuntimeError(
            f"{op}: group_size must be a positive multiple of {per_byte} for bits={bits} (so that every group "
            f"starts on a byte) and at most {MAX_GROUP_SIZE} (2^31 - 1), got {group_size}"
        )


@torch.library.register_fake("fastckpt::quantize_per_group")
def _quantize_per_group_fake(
    x: torch.Tensor, bits: int, group_size: int, stochastic: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_group_size("quantize_per_group", group_size, bits)
    codes = x.new_empty(((x.numel() * bits + 7) // 8,), dtype=torch.uint8)
    scale = x.new_empty((_num_groups(x.numel(), group_size),), dtype=affine_param_dtype(x.dtype))
    return codes, scale, torch.empty_like(scale)


@torch.library.register_fake("fastckpt::dequantize_per_group")
def _dequantize_per_group_fake(
    codes: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
    shape: list[int],
) -> torch.Tensor:
    _check_group_size("dequantize_per_group", group_size, bits)
    return codes.new_empty(shape, dtype=dtype)


@torch.library.register_fake("fastckpt::quantize_fp8_per_group")
def _quantize_fp8_per_group_fake(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_group_size("quantize_fp8_per_group", group_size)
    codes = x.new_empty((x.numel(),), dtype=torch.uint8)
    return codes, x.new_empty((_num_groups(x.numel(), group_size),), dtype=torch.bfloat16)


@torch.library.register_fake("fastckpt::dequantize_fp8_per_group")
def _dequantize_fp8_per_group_fake(
    codes: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype, shape: list[int]
) -> torch.Tensor:
    _check_group_size("dequantize_fp8_per_group", group_size)
    return codes.new_empty(shape, dtype=dtype)
