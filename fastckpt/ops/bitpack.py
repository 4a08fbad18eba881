"""Typed wrappers and fake kernels of the bitpack family (exact 1-bit masks)."""

from __future__ import annotations

import torch

from fastckpt._extension import OPS, extension

extension(OPS)  # the schemas below must be registered before their fake kernels


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack the nonzero pattern of `mask` into ceil(numel/8) uint8 bytes, little-endian bit order."""
    return torch.ops.fastckpt.pack_bits.default(mask)


def unpack_bits(packed: torch.Tensor, shape: torch.Size | list[int]) -> torch.Tensor:
    """Rebuild the bool mask of `shape` from pack_bits output."""
    return torch.ops.fastckpt.unpack_bits.default(packed, list(shape))


@torch.library.register_fake("fastckpt::pack_bits")
def _pack_bits_fake(mask: torch.Tensor) -> torch.Tensor:
    return mask.new_empty(((mask.numel() + 7) // 8,), dtype=torch.uint8)


@torch.library.register_fake("fastckpt::unpack_bits")
def _unpack_bits_fake(packed: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return packed.new_empty(shape, dtype=torch.bool)
