"""Shared by test_quantize.py and test_fp8.py: devices, sample data and rounding-error bounds."""

from __future__ import annotations

import math

import pytest
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# Odd sizes: empty, shorter than a group, a partial last group, a 3-D tensor with a zero dim.
SHAPES = [(0,), (1,), (3, 0, 5), (7, 13), (3, 5, 67), (4099,)]


def sample(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """Normal data with a nonzero mean (so groups are not symmetric around zero)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * 3 + 0.5).to(dtype).to(device)


def hard_groups(dtype: torch.dtype, group_size: int) -> torch.Tensor:
    """Groups that stress the 16-bit scale/offset: offset-dominated, constant, tiny and huge magnitudes."""
    generator = torch.Generator().manual_seed(1)
    noise = torch.randn(group_size, generator=generator)
    tiny, huge = (1e-6, 1e4) if dtype == torch.float16 else (1e-30, 1e30)
    rows = [
        1000 + 1e-3 * noise,  # range far below the offset's resolution
        torch.full((group_size,), 0.1),  # constant, not representable in bf16/fp16
        tiny * noise,  # fp16 subnormals / far below bf16's usual scales
        huge * noise,
        -huge + noise,
        noise.abs(),  # ReLU-like, minimum exactly 0
    ]
    return torch.stack(rows).to(dtype)


def half_ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of dtype's numbers at |values| (float64): the error of rounding into dtype."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(values.double().abs())
    exponent = torch.where(values == 0, math.log2(info.tiny), exponent.double() - 1)
    return info.eps * torch.exp2(torch.clamp(exponent, min=math.log2(info.tiny))) / 2


def per_element(params: torch.Tensor, group_size: int, numel: int) -> torch.Tensor:
    """A per-group tensor repeated over its group's elements, as float64."""
    return params.double().repeat_interleave(group_size)[:numel]


def stored_bits_per_element(tensors: tuple[torch.Tensor, ...], numel: int) -> float:
    """Bits stored per element by the tensors a quantize op returned."""
    return sum(t.numel() * t.element_size() for t in tensors) * 8 / numel


def bitwise(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns on the CPU, so that NaN == NaN and -0 != +0."""
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.detach().cpu().contiguous().view(int_dtype)


def assert_bitwise_equal(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    """Every tensor of `actual` has the dtype, shape and bits of its counterpart in `expected`."""
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.dtype == e.dtype and a.shape == e.shape, (
            f"output {index}: {a.dtype}{tuple(a.shape)} vs {e.dtype}{tuple(e.shape)}"
        )
        differ = bitwise(a) != bitwise(e)
        assert not differ.any(), f"output {index}: {int(differ.sum())} of {a.numel()} entries differ"
