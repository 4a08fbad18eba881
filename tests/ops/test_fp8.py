"""quantize_fp8_per_group / dequantize_fp8_per_group: bit-identical to the reference (torch's own e4m3
rounding) on every device, each value rounded once to the nearest e4m3 step, NaN/Inf never hidden."""

import pytest
import torch

from fastckpt.ops import FP8_DEFAULT_GROUP_SIZE, dequantize_fp8_per_group, quantize_fp8_per_group
from fastckpt.ops.reference import dequantize_fp8_per_group_ref, quantize_fp8_per_group_ref
from tests.ops.quant_helpers import (
    CANONICAL_NAN,
    DEVICES,
    DTYPES,
    SHAPES,
    assert_bitwise_equal,
    assert_fp8_within_half_step,
    bitwise,
    sample,
    stored_bits_per_element,
)

GROUP_SIZES = [1, 7, 32, 64, 100]
E4M3_MAX = 448.0


def round_trip(x, group_size, dtype=None):
    stored = quantize_fp8_per_group(x, group_size)
    return stored, dequantize_fp8_per_group(*stored, group_size, dtype or x.dtype, x.shape)


def e4m3_values() -> torch.Tensor:
    """Every finite e4m3 value, ascending."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(values)].unique()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference_bit_for_bit(dtype, group_size, shape, device):
    x = sample(shape, dtype, device)
    stored, y = round_trip(x, group_size)
    expected = quantize_fp8_per_group_ref(x.cpu(), group_size)
    assert_bitwise_equal(stored, expected)
    assert y.dtype == dtype and y.shape == x.shape and y.device == x.device
    assert_bitwise_equal((y,), (dequantize_fp8_per_group_ref(*expected, group_size, dtype, list(shape)),))
    if device == "cuda":  # the CUDA kernels agree with the CPU kernels, too
        cpu_stored, cpu_y = round_trip(x.cpu(), group_size)
        assert_bitwise_equal(stored + (y,), cpu_stored + (cpu_y,))


@pytest.mark.parametrize("device", DEVICES)
def test_every_e4m3_value_midpoint_and_neighbour_rounds_like_torch(device):
    values = e4m3_values()
    midpoints = (values[1:] + values[:-1]) / 2  # ties: round to the even code
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    x = torch.cat([values, midpoints, midpoints.nextafter(up), midpoints.nextafter(down)])
    for scale in (1.0, 2.0**-20, 2.0**20):  # the group scale (max |x| = 448 * scale) is exact
        scaled = (x * scale).to(device)
        codes, group_scale = quantize_fp8_per_group(scaled, scaled.numel())
        assert float(group_scale) == scale
        assert torch.equal(codes.cpu(), x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_value_rounds_once_to_the_nearest_e4m3_step(dtype, device):
    group_size = 64
    x = torch.cat([sample((40 * group_size + 9,), dtype, "cpu"), (sample((group_size,), dtype, "cpu") * 1e-3)])
    x = x.to(device)
    (codes, scale), y = round_trip(x, group_size)
    assert torch.isfinite(y).all()
    # the scale is the smallest power of two that brings the group's max |x| to <= 448
    amax = torch.nn.functional.pad(x.cpu().float().abs(), (0, (-x.numel()) % group_size)).view(-1, group_size).amax(1)
    assert ((amax / scale.float() <= E4M3_MAX) & (amax / scale.float() > E4M3_MAX / 2)).all()
    assert_fp8_within_half_step(x, scale, y, group_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_survive_and_their_group_keeps_its_finite_values(dtype, device):
    x = sample((6, 64), dtype, "cpu") * 100
    x[1, 5], x[2, 0], x[3, 63] = float("nan"), float("inf"), float("-inf")
    x[4, ::2] = float("-inf")  # an additive mask's padding
    x[5] = float("inf")  # a group with no finite element
    x = x.to(device)
    (codes, scale), y = round_trip(x, 64)
    assert_bitwise_equal((codes, scale), quantize_fp8_per_group_ref(x, 64))
    assert_bitwise_equal((y,), (dequantize_fp8_per_group_ref(codes, scale, 64, dtype, list(x.shape)),))
    infinite = torch.isinf(x)
    assert torch.equal(y[infinite], x[infinite]) and torch.equal(torch.isnan(y), torch.isnan(x))
    assert (bitwise(y)[torch.isnan(x).cpu()] == CANONICAL_NAN[dtype]).all()
    assert (scale.cpu() < 0).tolist() == [False, True, True, True, True, True]  # the sign flags them
    finite = torch.isfinite(x)
    assert_fp8_within_half_step(x[finite], scale.abs().repeat_interleave(64)[finite.reshape(-1)], y[finite], 1)
    # no finite element of a special group takes a reserved code (+-448 and NaN)
    magnitude = codes.cpu().reshape(x.shape)[finite.cpu()] & 0x7F
    assert int(magnitude.max()) <= 0x7D


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs_quantize_like_their_contiguous_copy(device):
    base = sample((64, 50), torch.float16, device)
    for view in (base.t(), base[:, 3:41], base[5:], base[::2, ::3]):
        expected = quantize_fp8_per_group(view.contiguous(), 16)
        assert_bitwise_equal(quantize_fp8_per_group(view, 16), expected)
        assert_bitwise_equal(expected, quantize_fp8_per_group_ref(view.cpu(), 16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_group_size_meets_the_storage_target(dtype):
    x = sample((1 << 16,), dtype, "cpu")
    assert stored_bits_per_element(quantize_fp8_per_group(x), x.numel()) <= 8.5
    assert quantize_fp8_per_group(x)[1].numel() == x.numel() // FP8_DEFAULT_GROUP_SIZE


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = sample((5, 13), torch.bfloat16, device)
    torch.library.opcheck(torch.ops.fastckpt.quantize_fp8_per_group.default, (x, 8))
    stored = quantize_fp8_per_group(x, 8)
    torch.library.opcheck(torch.ops.fastckpt.dequantize_fp8_per_group.default, (*stored, 8, torch.float16, [5, 13]))


def test_bad_inputs_name_the_argument_and_what_is_valid():
    x = torch.randn(64)
    with pytest.raises(RuntimeError, match="x has dtype Double; supported: float32, float16, bfloat16"):
        quantize_fp8_per_group(x.double())
    with pytest.raises(
        RuntimeError, match="group_size must be positive and at most 2147483647 \\(2\\^31 - 1\\), got 0"
    ):
        quantize_fp8_per_group(x, 0)
    codes, scale = quantize_fp8_per_group(x, 16)
    with pytest.raises(RuntimeError, match="dtype Long is not supported; supported: float32"):
        dequantize_fp8_per_group(codes, scale, 16, torch.int64, [64])
    with pytest.raises(RuntimeError, match="codes have dtype Float8_e4m3fn; expected Byte"):
        dequantize_fp8_per_group(codes.view(torch.float8_e4m3fn), scale, 16, torch.float32, [64])
    with pytest.raises(RuntimeError, match="codes must be 1-D with 65 entries for shape \\[65\\]"):
        dequantize_fp8_per_group(codes, scale, 16, torch.float32, [65])
    with pytest.raises(RuntimeError, match="scale must be 1-D with one entry per group \\(2\\)"):
        dequantize_fp8_per_group(codes, scale, 32, torch.float32, [64])
    with pytest.raises(RuntimeError, match="group_size must be positive and at most .*, got -1"):
        dequantize_fp8_per_group(codes, scale, -1, torch.float32, [64])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_large_groups_misaligned_views_and_many_groups(dtype):
    for numel, group_size, misalign in [(3 * 5000, 2048, 0), (4097, 64, 1), (4097, 37, 0), ((1 << 26) + 5, 64, 0)]:
        x = sample((numel + misalign,), dtype, "cuda")[misalign:]
        stored, y = round_trip(x, group_size)
        cpu_stored, cpu_y = round_trip(x.cpu(), group_size)
        assert_bitwise_equal(stored + (y,), cpu_stored + (cpu_y,))
