"""The quantize ops at the edges of their inputs (issue 11): finite values up to each dtype's maximum
decode to finite values within the documented error bound, on every codec, bit-identical to the
reference; group sizes beyond the tensor cost nothing, absurd ones are rejected by name."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.ops import (
    MAX_GROUP_SIZE,
    dequantize_fp8_per_group,
    dequantize_per_group,
    quantize_fp8_per_group,
    quantize_per_group,
)
from fastckpt.ops.reference import (
    dequantize_fp8_per_group_ref,
    dequantize_per_group_ref,
    quantize_fp8_per_group_ref,
    quantize_per_group_ref,
)
from tests.ops.quant_helpers import (
    CANONICAL_NAN,
    DEVICES,
    DTYPES,
    assert_bitwise_equal,
    assert_fp8_within_half_step,
    assert_within_half_step,
    below_saturated_offset,
    bitwise,
    extreme_groups,
    half_ulp,
    sample,
    steps_and_evaluation_error,
)

BITS = [8, 4, 2]
GROUP = 64
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- item 2: values near a dtype's maximum


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_extreme_groups_match_the_reference_and_decode_finite_in_every_dtype(bits, dtype, stochastic, device):
    x = extreme_groups(dtype, GROUP).to(device)
    stored = quantize_per_group(x, bits, GROUP, stochastic, 11)
    expected = quantize_per_group_ref(x.cpu(), bits, GROUP, stochastic, 11)
    assert_bitwise_equal(stored, expected)
    assert torch.isfinite(stored[1].float()).all() and torch.isfinite(stored[2].float()).all()
    for out_dtype in DTYPES:  # other dtypes too: decoding clamps to the output dtype's range
        y = dequantize_per_group(*stored, bits, GROUP, out_dtype, x.shape)
        assert_bitwise_equal((y,), (dequantize_per_group_ref(*expected, bits, GROUP, out_dtype, list(x.shape)),))
        assert torch.isfinite(y).all(), f"{int((~torch.isfinite(y)).sum())} non-finite values decoded as {out_dtype}"
        if device == "cuda":
            cpu_y = dequantize_per_group(*(t.cpu() for t in stored), bits, GROUP, out_dtype, x.shape)
            assert_bitwise_equal((y,), (cpu_y,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_extreme_groups_err_by_at_most_half_a_step(bits, dtype, device):
    x = extreme_groups(dtype, GROUP).to(device)
    stored = quantize_per_group(x, bits, GROUP)
    y = dequantize_per_group(*stored, bits, GROUP, dtype, x.shape)
    assert_within_half_step(x, stored, y, bits, GROUP)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_extreme_groups_round_stochastically_within_one_step(bits, dtype):
    x = extreme_groups(dtype, GROUP)
    for seed in range(5):
        stored = quantize_per_group(x, bits, GROUP, True, seed)
        y = dequantize_per_group(*stored, bits, GROUP, dtype, x.shape)
        step, evaluation = steps_and_evaluation_error(stored, bits, GROUP, x.numel())
        y64 = y.reshape(-1).double()
        error = (x.reshape(-1).double() - y64).abs()
        # next to the zero code (which decodes to exactly 0) neighbouring values are up to 1.5 steps apart
        quantization = torch.where(x.reshape(-1).double().abs() < 1.5 * step, 1.5 * step, step)
        bound = quantization + evaluation + half_ulp(y64, dtype) + below_saturated_offset(x, stored, GROUP)
        assert (error <= bound).all()


def test_float32_below_bfloat16s_lowest_is_the_one_documented_exception():
    # the offset saturates at bfloat16's lowest; values below it decode to it, within bf16's ulp there (2^120)
    x = torch.linspace(torch.finfo(torch.float32).min, -3.39e38, GROUP)
    stored = quantize_per_group(x, 8, GROUP)
    y = dequantize_per_group(*stored, 8, GROUP, x.dtype, x.shape)
    assert float(stored[2]) == torch.finfo(torch.bfloat16).min
    assert y.min() == torch.finfo(torch.bfloat16).min
    assert ((x.double() - y.double()).abs() <= 2.0**120).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_extreme_groups_match_the_reference_and_decode_finite_in_every_dtype(dtype, device):
    x = extreme_groups(dtype, GROUP).to(device)
    stored = quantize_fp8_per_group(x, GROUP)
    expected = quantize_fp8_per_group_ref(x.cpu(), GROUP)
    assert_bitwise_equal(stored, expected)
    for out_dtype in DTYPES:
        y = dequantize_fp8_per_group(*stored, GROUP, out_dtype, x.shape)
        assert_bitwise_equal((y,), (dequantize_fp8_per_group_ref(*expected, GROUP, out_dtype, list(x.shape)),))
        assert torch.isfinite(y).all(), f"{int((~torch.isfinite(y)).sum())} non-finite values decoded as {out_dtype}"
        if device == "cuda":
            cpu_y = dequantize_fp8_per_group(*(t.cpu() for t in stored), GROUP, out_dtype, x.shape)
            assert_bitwise_equal((y,), (cpu_y,))
    y = dequantize_fp8_per_group(*stored, GROUP, dtype, x.shape)
    assert_fp8_within_half_step(x, stored[1], y, GROUP)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_top_of_the_range_rounds_to_the_dtype_maximum_not_inf(dtype, device):
    # 1.9375 * 2^k and above round to 2^(k+1) in e4m3 at any exponent: past the maximum in the top binade
    top = torch.finfo(dtype).max
    x = (torch.linspace(0.96, 1.0, GROUP, dtype=torch.float64) * top).to(dtype).to(device)
    codes, scale = quantize_fp8_per_group(x, GROUP)
    y = dequantize_fp8_per_group(codes, scale, GROUP, dtype, x.shape)
    assert torch.isfinite(y).all() and y.max() == top
    assert_fp8_within_half_step(x, scale, y, GROUP)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_parameters_that_are_not_finite_decode_to_the_canonical_nan(dtype, device):
    # quantize never stores them (NaN/Inf data goes to reserved codes); foreign parameters: never finite, never Inf
    x = sample((4, GROUP), dtype, device)
    codes, scale, offset = quantize_per_group(x, 4, GROUP)
    scale, offset = scale.clone(), offset.clone()
    scale[1], scale[2], offset[3] = float("nan"), float("inf"), float("-inf")
    for out_dtype in DTYPES:
        y = dequantize_per_group(codes, scale, offset, 4, GROUP, out_dtype, x.shape)
        expected = dequantize_per_group_ref(codes.cpu(), scale.cpu(), offset.cpu(), 4, GROUP, out_dtype, list(x.shape))
        assert_bitwise_equal((y,), (expected,))
        assert y[1:].isnan().all() and torch.isfinite(y[0]).all()
        assert (bitwise(y[1:]) == CANONICAL_NAN[out_dtype]).all()
    codes, scale = quantize_fp8_per_group(x, GROUP)
    scale = scale.clone()
    scale[1], scale[2] = float("nan"), float("inf")
    for out_dtype in DTYPES:
        y = dequantize_fp8_per_group(codes, scale, GROUP, out_dtype, x.shape)
        expected = dequantize_fp8_per_group_ref(codes.cpu(), scale.cpu(), GROUP, out_dtype, list(x.shape))
        assert_bitwise_equal((y,), (expected,))
        assert (bitwise(y[1:3]) == CANONICAL_NAN[out_dtype]).all()
        assert torch.isfinite(y[0]).all() and torch.isfinite(y[3]).all()


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4", "int2"])
def test_float16_activation_near_the_maximum_gives_a_finite_gradient(codec):
    # the end-to-end probe: an fp16 activation of 64000 stored with fp8 made its weight's gradient inf
    x = torch.full((64, 64), 64000.0, dtype=torch.float16)
    x[::2] = sample((32, 64), torch.float16, "cpu")
    w = torch.ones(64, 64, dtype=torch.float16, requires_grad=True)

    def fn(x):
        return x * w  # saves x for w's gradient

    (fastckpt.checkpoint(fn, x, policy=codec) * 1e-3).sum().backward()
    assert torch.isfinite(w.grad).all()
    assert torch.allclose(w.grad.float(), x.float() * 1e-3, rtol=0.07, atol=0.02)


# ---------------------------------------------------------------- item 3: group sizes beyond the tensor


def _huge(bits: int) -> int:
    """The largest group size valid for `bits`."""
    return MAX_GROUP_SIZE // (8 // bits) * (8 // bits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_a_group_size_beyond_the_tensor_means_one_group_of_the_tensor(bits, dtype, device):
    x = sample((100,), dtype, device)
    for stochastic in (False, True):
        small = quantize_per_group(x, bits, 100, stochastic, 3)  # one group already
        for group_size in (2**28, _huge(bits)):
            stored = quantize_per_group(x, bits, group_size, stochastic, 3)
            assert_bitwise_equal(stored, small)
            assert_bitwise_equal(stored, quantize_per_group_ref(x.cpu(), bits, group_size, stochastic, 3))
            y = dequantize_per_group(*stored, bits, group_size, dtype, x.shape)
            assert_bitwise_equal((y,), (dequantize_per_group(*small, bits, 100, dtype, x.shape),))
            assert_bitwise_equal((y,), (dequantize_per_group_ref(*stored, bits, group_size, dtype, [100]),))
    codes, scale = quantize_fp8_per_group(x, MAX_GROUP_SIZE)
    assert_bitwise_equal((codes, scale), quantize_fp8_per_group(x, 100))
    assert_bitwise_equal((codes, scale), quantize_fp8_per_group_ref(x.cpu(), MAX_GROUP_SIZE))
    y = dequantize_fp8_per_group(codes, scale, MAX_GROUP_SIZE, dtype, x.shape)
    assert_bitwise_equal((y,), (dequantize_fp8_per_group(codes, scale, 100, dtype, x.shape),))


# Runs in a fresh process: peak memory (max RSS) of round trips with huge group sizes on a small tensor.
PEAK_MEMORY = """
import resource, sys, torch
from fastckpt.ops import quantize_per_group, dequantize_per_group, quantize_fp8_per_group, dequantize_fp8_per_group
torch.set_num_threads(1)
def round_trips(group):
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(100).to(dtype)
        for bits in (8, 4, 2):
            stored = quantize_per_group(x, bits, group, True, 1)
            dequantize_per_group(*stored, bits, group, dtype, x.shape)
        dequantize_fp8_per_group(*quantize_fp8_per_group(x, group), group, dtype, x.shape)
round_trips(64)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
round_trips(int(sys.argv[1]))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_group_size_beyond_the_tensor_allocates_nothing_for_it():
    # before the fix, 2**26 made a 64 MiB code buffer (and 256 MiB of fp32 scratch for fp16) per call
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", PEAK_MEMORY, str(2**26)], check=True, env=env, capture_output=True, text=True
    )
    assert int(out.stdout.split()[-1]) < 16, f"peak memory grew by {out.stdout.split()[-1]} MiB"


@pytest.mark.parametrize("group_size", [0, -1, 2**31, 10**12])
def test_absurd_group_sizes_are_rejected_naming_the_accepted_range(group_size):
    x = torch.randn(64)
    at_most = "at most 2147483647 \\(2\\^31 - 1\\), got " + str(group_size)
    for bits in BITS:
        codes, scale, offset = quantize_per_group(x, bits, 64)
        with pytest.raises(
            RuntimeError, match=f"quantize_per_group: group_size must be a positive multiple.*{at_most}"
        ):
            quantize_per_group(x, bits, group_size)
        with pytest.raises(RuntimeError, match=f"dequantize_per_group: group_size must be .*{at_most}"):
            dequantize_per_group(codes, scale, offset, bits, group_size, x.dtype, x.shape)
    codes, scale = quantize_fp8_per_group(x, 64)
    with pytest.raises(RuntimeError, match=f"quantize_fp8_per_group: group_size must be positive and {at_most}"):
        quantize_fp8_per_group(x, group_size)
    with pytest.raises(RuntimeError, match=f"dequantize_fp8_per_group: group_size must be positive and {at_most}"):
        dequantize_fp8_per_group(codes, scale, group_size, x.dtype, x.shape)
    # the fake (meta) kernels agree
    meta = x.to("meta")
    with pytest.raises(RuntimeError, match=f"group_size must be .*{at_most}"):
        quantize_per_group(meta, 8, group_size)
    with pytest.raises(RuntimeError, match=f"group_size must be positive and {at_most}"):
        quantize_fp8_per_group(meta, group_size)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_a_group_size_beyond_the_tensor(device):
    x = sample((5, 13), torch.float16, device)
    torch.library.opcheck(torch.ops.fastckpt.quantize_per_group.default, (x, 4, 2**30, True, 7))
    stored = quantize_per_group(x, 4, 2**30)
    torch.library.opcheck(torch.ops.fastckpt.dequantize_per_group.default, (*stored, 4, 2**30, torch.float32, [5, 13]))
    torch.library.opcheck(torch.ops.fastckpt.quantize_fp8_per_group.default, (x, MAX_GROUP_SIZE))
    codes, scale = quantize_fp8_per_group(x, MAX_GROUP_SIZE)
    args = (codes, scale, MAX_GROUP_SIZE, torch.bfloat16, [5, 13])
    torch.library.opcheck(torch.ops.fastckpt.dequantize_fp8_per_group.default, args)
