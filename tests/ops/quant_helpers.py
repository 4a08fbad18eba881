"""Shared by the quantize tests: devices, sample data and rounding-error bounds."""

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


def extreme_groups(dtype: torch.dtype, group_size: int) -> torch.Tensor:
    """Finite groups at the ends of dtype's range, one per row: +-max, max and -max together, max and 0,
    values just below max, denormals, huge and tiny mixed; float32 and float16 add their known traps."""
    info = torch.finfo(dtype)
    top, tiny = info.max, info.smallest_normal
    subnormal = tiny / 8  # a denormal of every dtype here
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int16
    below = (torch.tensor(top, dtype=dtype).view(int_dtype) - 1).view(dtype).item()  # max's lower neighbour
    generator = torch.Generator().manual_seed(2)
    g = group_size

    def pattern(*values: float) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64).repeat(g)[:g]

    rows = [
        pattern(top),
        pattern(-top),
        pattern(top, -top),
        pattern(top, 0.0),
        pattern(-top, 0.0),
        pattern(below),
        pattern(below, -below),
        torch.linspace(0.97, 1.0, g, dtype=torch.float64) * top,  # the top 3% of the range
        -torch.linspace(0.97, 1.0, g, dtype=torch.float64) * top,
        (torch.rand(g, generator=generator, dtype=torch.float64) * 2 - 1) * top,
        torch.randn(g, generator=generator, dtype=torch.float64) * subnormal,  # denormals only
        pattern(subnormal, -subnormal, 0.0, tiny),
        pattern(top, tiny, -tiny, 0.0, 1.0, -top / 3, 1e-3, subnormal),  # huge and tiny mixed
        pattern(-top, subnormal, top / 2, -tiny),
    ]
    if dtype == torch.float32:
        rows += [
            pattern(-1.7e38, 1.7e38),  # max - min just below FLT_MAX; code * scale overflows at 4 and 2 bits
            pattern(-3e38, 3e38),  # max - min overflows float32
            pattern(-3.4e38),  # below bfloat16's lowest: the offset saturates
            torch.linspace(-top, -3.39e38, g, dtype=torch.float64),
            pattern(3.3e38, -1.0),
        ]
    if dtype == torch.float16:
        rows += [pattern(0.0, 65472.0), pattern(0.0, 64000.0), pattern(64000.0), pattern(-65504.0, 63488.0)]
    # float64 -> dtype rounds to nearest: values up to max stay finite
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


FP32_EPS = torch.finfo(torch.float32).eps
# The canonical quiet NaN of each dtype, as bits: what every decode gives for NaN.
CANONICAL_NAN = {torch.float32: 0x7FC00000, torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}
BF16_LOWEST = torch.finfo(torch.bfloat16).min


def steps_and_evaluation_error(stored, bits, group_size, numel):
    """Per element: the quantization step, and the float32 error of the arithmetic around it."""
    _, scale, offset = (t.cpu() for t in stored)
    step = per_element(scale, group_size, numel)
    # quantize and decode run a handful of float32 operations on values up to |offset| + max_code * step
    evaluation = 4 * FP32_EPS * (per_element(offset, group_size, numel).abs() + ((1 << bits) - 1) * step)
    return step, evaluation


def below_saturated_offset(x: torch.Tensor, stored, group_size: int) -> torch.Tensor:
    """The documented exception to the error bound: float32 values below bfloat16's lowest, whose group
    offset saturates there, decode to it. Per element: how far below the saturated offset x is (else 0)."""
    offset = per_element(stored[2].cpu(), group_size, x.numel())
    x64 = x.cpu().reshape(-1).double()
    return torch.where(offset == BF16_LOWEST, (offset - x64).clamp(min=0), 0.0)


def assert_within_half_step(x, stored, y, bits, group_size):
    """|x - y| <= scale/2, plus float32 evaluation error and the rounding of y into its dtype; next to zero
    (the zero code holds exact zeros only; a nonzero value rounding to it takes a neighbour) within 1.5 scales."""
    step, evaluation = steps_and_evaluation_error(stored, bits, group_size, x.numel())
    y64 = y.cpu().reshape(-1).double()
    x64 = x.cpu().reshape(-1).double()
    error = (x64 - y64).abs()
    quantization = torch.where(x64.abs() < 1.5 * step, 1.5 * step, step / 2)
    bound = quantization + evaluation + half_ulp(y64, y.dtype) + below_saturated_offset(x, stored, group_size)
    worst = int(torch.argmax(error - bound))
    assert (error <= bound).all(), f"element {worst}: error {error[worst]:.3g} > bound {bound[worst]:.3g}"


def assert_fp8_within_half_step(x, scale, y, group_size):
    """|x - y| <= half an e4m3 step of x / scale, times scale, plus the rounding of y into its dtype."""
    step_scale = scale.cpu().double().repeat_interleave(group_size)[: x.numel()]
    x64, y64 = x.cpu().reshape(-1).double(), y.cpu().reshape(-1).double()
    error = (x64 - y64).abs()
    bound = half_ulp(x64 / step_scale, torch.float8_e4m3fn) * step_scale + half_ulp(y64, y.dtype)
    worst = int(torch.argmax(error - bound))
    assert (error <= bound).all(), f"element {worst}: error {error[worst]:.3g} > bound {bound[worst]:.3g}"
