"""Pure-PyTorch references for every fastckpt op: the test oracle, and runnable on any device."""

from __future__ import annotations

import torch


def pack_bits_ref(mask: torch.Tensor) -> torch.Tensor:
    """Reference of fastckpt::pack_bits: little-endian bits of the nonzero pattern, uint8."""
    bits = (mask.reshape(-1) != 0).to(torch.uint8)
    pad = (-bits.numel()) % 8
    bits = torch.nn.functional.pad(bits, (0, pad)).view(-1, 8)
    weights = (2 ** torch.arange(8, device=mask.device, dtype=torch.int32)).to(torch.uint8)
    return (bits * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bits_ref(packed: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """Reference of fastckpt::unpack_bits."""
    numel = 1
    for s in shape:
        numel *= s
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bits = (packed.view(-1, 1) >> shifts) & 1
    return bits.reshape(-1)[:numel].to(torch.bool).view(shape)
