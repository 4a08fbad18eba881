"""quantize_per_group / dequantize_per_group: bit-identical to the reference on every device, within
half a step when rounding to nearest, unbiased when rounding stochastically, NaN/Inf never hidden."""

import math

import pytest
import torch

from fastckpt.ops import DEFAULT_GROUP_SIZE, dequantize_per_group, quantize_per_group
from fastckpt.ops.reference import dequantize_per_group_ref, quantize_per_group_ref
from tests.ops.quant_helpers import (
    CANONICAL_NAN,
    DEVICES,
    DTYPES,
    SHAPES,
    assert_bitwise_equal,
    assert_within_half_step,
    bitwise,
    half_ulp,
    hard_groups,
    per_element,
    sample,
    steps_and_evaluation_error,
    stored_bits_per_element,
)

BITS = [8, 4, 2]
GROUP_SIZES = [4, 36, 64, 128]  # multiples of 4, valid for every bit width; 36 is no power of two


def round_trip(x, bits, group_size, stochastic=False, seed=0, dtype=None):
    stored = quantize_per_group(x, bits, group_size, stochastic, seed)
    return stored, dequantize_per_group(*stored, bits, group_size, dtype or x.dtype, x.shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_kernel_matches_reference_bit_for_bit(bits, dtype, group_size, shape, stochastic, device):
    x = sample(shape, dtype, device)
    stored, y = round_trip(x, bits, group_size, stochastic, seed=1234)
    expected = quantize_per_group_ref(x.cpu(), bits, group_size, stochastic, seed=1234)
    assert_bitwise_equal(stored, expected)
    assert y.dtype == dtype and y.shape == x.shape and y.device == x.device
    assert_bitwise_equal((y,), (dequantize_per_group_ref(*expected, bits, group_size, dtype, list(shape)),))
    if device == "cuda":  # the CUDA kernels agree with the CPU kernels, too
        cpu_stored, cpu_y = round_trip(x.cpu(), bits, group_size, stochastic, seed=1234)
        assert_bitwise_equal(stored + (y,), cpu_stored + (cpu_y,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_round_to_nearest_errs_by_at_most_half_a_step(bits, dtype, device):
    group_size = 64
    x = torch.cat([hard_groups(dtype, group_size).reshape(-1), sample((50 * group_size + 17,), dtype, "cpu")])
    x = x.to(device)
    stored, y = round_trip(x, bits, group_size)
    assert torch.isfinite(y).all()
    assert_within_half_step(x, stored, y, bits, group_size)
    # decoding ordinary data into another dtype only adds that dtype's own rounding
    x = x[hard_groups(dtype, group_size).numel() :]
    stored = quantize_per_group(x, bits, group_size)
    for out_dtype in DTYPES:
        y = dequantize_per_group(*stored, bits, group_size, out_dtype, x.shape)
        assert_within_half_step(x, stored, y, bits, group_size)


@pytest.mark.parametrize("bits", BITS)
def test_stochastic_rounding_is_unbiased_and_reproducible(bits):
    group_size, seeds = 64, 1000
    x = sample((4 * group_size,), torch.float32, "cpu")
    stored, _ = round_trip(x, bits, group_size, stochastic=True, seed=0)
    step, evaluation = steps_and_evaluation_error(stored, bits, group_size, x.numel())
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for seed in range(seeds):
        _, y = round_trip(x, bits, group_size, stochastic=True, seed=seed)
        error = (y.double() - x.double()).abs()
        # next to the zero code (which decodes to exactly 0) neighbouring values are up to 1.5 steps apart
        bound = torch.where(x.double().abs() < 1.5 * step, 1.5 * step, step)
        assert (error <= bound + evaluation).all(), "stochastic rounding moved a value beyond its neighbours"
        total += y.double()
    # One draw has variance <= step^2 / 4, so the mean's standard deviation is <= step / (2 sqrt(seeds)):
    # a 5-sigma band, while rounding to nearest would miss by up to step / 2 (~30 sigma here).
    bias = (total / seeds - x.double()).abs()
    assert (bias <= 5 * step / (2 * math.sqrt(seeds))).all(), f"max bias {float((bias / step).max()):.3f} steps"

    again = quantize_per_group(x, bits, group_size, True, 7)
    assert_bitwise_equal(again, quantize_per_group(x, bits, group_size, True, 7))
    assert not torch.equal(again[0], quantize_per_group(x, bits, group_size, True, 8)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_nan_and_inf_survive_and_their_group_keeps_its_finite_values(bits, dtype, device):
    x = sample((6, 64), dtype, "cpu")
    x[1, 5], x[2, 0], x[3, 63] = float("nan"), float("inf"), float("-inf")
    x[4, ::2] = float("-inf")  # an additive mask's padding
    x[5] = float("-inf")  # a group with no finite element
    x = x.to(device)
    stored, y = round_trip(x, bits, 64)
    assert_bitwise_equal(stored, quantize_per_group_ref(x, bits, 64))
    assert_bitwise_equal((y,), (dequantize_per_group_ref(*stored, bits, 64, dtype, list(x.shape)),))
    infinite = torch.isinf(x)
    assert torch.equal(y[infinite], x[infinite]) and torch.equal(torch.isnan(y), torch.isnan(x))
    assert (bitwise(y)[torch.isnan(x).cpu()] == CANONICAL_NAN[dtype]).all()
    special = (stored[1].cpu() < 0).tolist()
    assert special == [False, True, True, True, True, True]  # the sign of the scale flags them
    # finite elements keep the bound of their group's grid (the stored scale's magnitude)
    finite = torch.isfinite(x).cpu().reshape(-1)
    magnitude = (stored[0], stored[1].abs(), stored[2])
    step, evaluation = steps_and_evaluation_error(magnitude, bits, 64, x.numel())
    error = (x.cpu().reshape(-1).double() - y.cpu().reshape(-1).double()).abs()[finite]
    # int2 keeps one code for a special group's finite elements: they decode to its minimum rounded down
    finite_max = torch.where(torch.isfinite(x), x, float("-inf")).cpu().double().amax(1)
    spread = per_element(finite_max, 64, x.numel()) - per_element(stored[2].cpu(), 64, x.numel())
    y64 = y.cpu().reshape(-1).double()
    x64 = x.cpu().reshape(-1).double()
    quantization = torch.where(x64.abs() < 1.5 * step, 1.5 * step, step / 2)  # next to zero: a neighbour's value
    bound = (quantization if bits > 2 else spread) + evaluation + half_ulp(y64, dtype)
    assert (error <= bound[finite]).all()
    healthy = x[0:1]
    y_healthy = dequantize_per_group(*quantize_per_group(healthy, bits, 64), bits, 64, dtype, healthy.shape)
    assert torch.equal(y[0:1], y_healthy)  # other groups are untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
def test_groups_beyond_the_scale_format_saturate_and_decode_finite(bits, device):
    # finite in float32, but no bfloat16 offset <= it exists: the offset saturates at bfloat16's lowest
    below_bf16 = torch.full((64,), -3.4e38, device=device)
    stored, y = round_trip(below_bf16, bits, 64)
    assert float(stored[2]) == torch.finfo(torch.bfloat16).min
    assert torch.equal(y.cpu(), torch.full((64,), torch.finfo(torch.bfloat16).min))
    # max - min overflows float32 (the step is taken from halves); above bfloat16's max
    for x in (torch.tensor([-3e38, 3e38]).repeat(32), torch.full((64,), 3.4e38)):
        stored, y = round_trip(x.to(device), bits, 64)
        assert torch.isfinite(y).all()
        assert_within_half_step(x, stored, y, bits, 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
def test_non_contiguous_inputs_quantize_like_their_contiguous_copy(bits, device):
    base = sample((64, 50), torch.bfloat16, device)
    for view in (base.t(), base[:, 3:41], base[5:], base[::2, ::3]):
        expected = quantize_per_group(view.contiguous(), bits, 16)
        assert_bitwise_equal(quantize_per_group(view, bits, 16), expected)
        assert_bitwise_equal(expected, quantize_per_group_ref(view.cpu(), bits, 16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits, target", [(8, 8.5), (4, 4.5), (2, 2.5)])
def test_default_group_sizes_meet_the_storage_targets(bits, target, dtype):
    x = sample((1 << 16,), dtype, "cpu")
    assert stored_bits_per_element(quantize_per_group(x, bits), x.numel()) <= target
    assert DEFAULT_GROUP_SIZE[bits] * bits % 8 == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_opcheck(stochastic, device):
    x = sample((5, 13), torch.float16, device)
    torch.library.opcheck(torch.ops.fastckpt.quantize_per_group.default, (x, 4, 8, stochastic, 7))
    stored = quantize_per_group(x, 4, 8)
    torch.library.opcheck(torch.ops.fastckpt.dequantize_per_group.default, (*stored, 4, 8, torch.float32, [5, 13]))


def test_bad_inputs_name_the_argument_and_what_is_valid():
    x = torch.randn(64)
    with pytest.raises(RuntimeError, match="x has dtype Double; supported: float32, float16, bfloat16"):
        quantize_per_group(x.double(), 4)
    with pytest.raises(RuntimeError, match="x has dtype Long"):
        quantize_per_group(torch.ones(64, dtype=torch.int64), 4)
    with pytest.raises(RuntimeError, match="bits must be 8, 4 or 2, got 3"):
        quantize_per_group(x, 3, 64)
    with pytest.raises(RuntimeError, match="group_size must be a positive multiple of 2 for bits=4.*got 0"):
        quantize_per_group(x, 4, 0)
    with pytest.raises(RuntimeError, match="group_size must be a positive multiple of 4 for bits=2.*got 6"):
        quantize_per_group(x, 2, 6)
    with pytest.raises(
        RuntimeError, match="group_size must be .* and at most 2147483647 \\(2\\^31 - 1\\), got 2147483648"
    ):
        quantize_per_group(x, 8, 2**31)

    codes, scale, offset = quantize_per_group(x, 4, 16)
    with pytest.raises(RuntimeError, match="dtype Int is not supported; supported: float32"):
        dequantize_per_group(codes, scale, offset, 4, 16, torch.int32, [64])
    with pytest.raises(RuntimeError, match="codes must be 1-D with 16 entries for shape \\[32\\] at 4 bits"):
        dequantize_per_group(codes, scale, offset, 4, 16, torch.float32, [32])
    with pytest.raises(RuntimeError, match="codes must be 1-D with 64 entries"):
        dequantize_per_group(codes, scale, offset, 8, 16, torch.float32, [64])  # bits that do not match
    with pytest.raises(RuntimeError, match="scale must be 1-D with one entry per group \\(4\\)"):
        dequantize_per_group(codes, scale[:3], offset, 4, 16, torch.float32, [64])
    with pytest.raises(RuntimeError, match="offset has dtype Float; expected float16 or bfloat16"):
        dequantize_per_group(codes, scale, offset.float(), 4, 16, torch.float32, [64])
    with pytest.raises(RuntimeError, match="scale \\(BFloat16\\) and offset \\(Half\\) must have the same dtype"):
        dequantize_per_group(codes, scale, offset.half(), 4, 16, torch.float32, [64])
    with pytest.raises(RuntimeError, match="codes have dtype Float; expected Byte"):
        dequantize_per_group(codes.float(), scale, offset, 4, 16, torch.float32, [64])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_cuda_large_groups_misaligned_views_and_many_groups(bits, dtype):
    # groups wider than the kernel keeps in registers, inputs that are not 16-byte aligned, and more
    # groups than one grid covers
    for numel, group_size, misalign in [(3 * 5000, 2048, 0), (4097, 64, 1), ((1 << 26) + 5, 64, 0)]:
        x = sample((numel + misalign,), dtype, "cuda")[misalign:]
        stored, y = round_trip(x, bits, group_size, stochastic=True, seed=3)
        cpu_stored, cpu_y = round_trip(x.cpu(), bits, group_size, stochastic=True, seed=3)
        assert_bitwise_equal(stored + (y,), cpu_stored + (cpu_y,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_zero_is_exact_and_constant_groups_decode_exactly(bits, dtype, stochastic, device):
    # a zero row inside groups that also hold other values (a CLS token at init, next to real tokens)
    x = sample((8, 64), dtype, "cpu")
    x[2] = 0.0
    x[3, :24] = 0.0
    x[5, ::3] = 0.0
    x[5, 1] = -0.0
    x[6] = 0.375  # constant groups: 16-bit inputs are exact (their offset is the value)
    x[7] = -1.5e-3
    x = x.to(device)
    stored, y = round_trip(x, bits, 64, stochastic, seed=3)
    assert_bitwise_equal(stored, quantize_per_group_ref(x, bits, 64, stochastic, 3))
    assert_bitwise_equal((y,), (dequantize_per_group_ref(*stored, bits, 64, dtype, list(x.shape)),))
    zeros = x == 0
    assert (y[zeros] == 0).all()
    if not stochastic:  # a non-negative tensor keeps its positives positive (ReLU's backward reads `output > 0`)
        relu = torch.relu(sample((8, 64), dtype, "cpu") * 3).to(device)
        relu[0, :5] = torch.tensor([1e-6, 2e-5, 1e-3, 0.0, 1e-2])
        _, decoded = round_trip(relu, bits, 64)
        assert torch.equal(decoded > 0, relu > 0) and (decoded[relu == 0] == 0).all()
    if dtype != torch.float32:
        assert torch.equal(y[6:], x[6:])
    else:  # float32 constants round to the 16-bit parameters' grid
        assert torch.allclose(y[6:], x[6:], rtol=2**-7, atol=0)  # within one bf16 ulp
