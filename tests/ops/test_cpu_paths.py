"""The CPU kernels pick instruction sets at run time (F16C for fp16 blocks); the portable fallback,
forced with FASTCKPT_DISABLE_F16C=1, must give the same bits as the reference."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastckpt.ops.reference import (
    dequantize_fp8_per_group_ref,
    dequantize_per_group_ref,
    quantize_fp8_per_group_ref,
    quantize_per_group_ref,
)
from tests.ops.quant_helpers import assert_bitwise_equal, hard_groups, sample

GROUP_SIZE = 64
REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh process (the switch is read once): every fp16 round trip, saved for the parent.
ROUND_TRIPS = """
import sys, torch
from fastckpt.ops import quantize_per_group, dequantize_per_group, quantize_fp8_per_group, dequantize_fp8_per_group
x, group = torch.load(sys.argv[1]), int(sys.argv[3])
out = {}
for bits in (8, 4, 2):
    stored = quantize_per_group(x, bits, group)
    out[bits] = stored + (dequantize_per_group(*stored, bits, group, x.dtype, x.shape),)
stored = quantize_fp8_per_group(x, group)
out["fp8"] = stored + (dequantize_fp8_per_group(*stored, group, x.dtype, x.shape),)
torch.save(out, sys.argv[2])
"""


def fp16_inputs() -> torch.Tensor:
    """Subnormals, NaN/Inf groups, extremes, more than the 1K elements converted at a time, and a tail
    that is not a whole group or 8-element vector."""
    tiny = torch.tensor([6e-8, -6e-8, 3e-5, -1e-5, 0.0, -0.0]).repeat(GROUP_SIZE)[:GROUP_SIZE]
    with_nan, with_inf = sample((2, GROUP_SIZE), torch.float32, "cpu", seed=3)
    with_nan[5], with_inf[7] = float("nan"), float("-inf")
    rows = [hard_groups(torch.float16, GROUP_SIZE).reshape(-1), tiny, with_nan, with_inf]
    return torch.cat([r.half() for r in rows] + [sample((40 * GROUP_SIZE + 13,), torch.float16, "cpu")])


@pytest.mark.parametrize("disable_f16c", [True, False])
def test_fp16_paths_match_the_reference(tmp_path, disable_f16c):
    x = fp16_inputs()
    torch.save(x, tmp_path / "x.pt")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if disable_f16c:
        env["FASTCKPT_DISABLE_F16C"] = "1"
    else:
        env.pop("FASTCKPT_DISABLE_F16C", None)
    subprocess.run(
        [sys.executable, "-c", ROUND_TRIPS, tmp_path / "x.pt", tmp_path / "out.pt", str(GROUP_SIZE)],
        check=True,
        env=env,
    )
    out = torch.load(tmp_path / "out.pt")
    for bits in (8, 4, 2):
        expected = quantize_per_group_ref(x, bits, GROUP_SIZE)
        decoded = dequantize_per_group_ref(*expected, bits, GROUP_SIZE, x.dtype, list(x.shape))
        assert_bitwise_equal(out[bits], expected + (decoded,))
    expected = quantize_fp8_per_group_ref(x, GROUP_SIZE)
    decoded = dequantize_fp8_per_group_ref(*expected, GROUP_SIZE, x.dtype, list(x.shape))
    assert_bitwise_equal(out["fp8"], expected + (decoded,))


def test_several_threads_give_one_threads_bits():
    # The suite's workers run one intra-op thread each (conftest): here the kernels' parallel_for splits the work
    # (quantize: 65,536-element tasks; bitpack: 131,072 bools), stochastic rounding included, with a ragged tail.
    from fastckpt.ops import pack_bits, unpack_bits
    from fastckpt.ops import quantize as q
    from tests.helpers import num_threads

    x = sample((5 * 2**16 + 77,), torch.float32, "cpu", seed=11)
    mask = sample((5 * 2**17 + 33,), torch.float32, "cpu", seed=12) > 0

    def run() -> list[torch.Tensor]:
        out = []
        for bits in (8, 4, 2):
            for stochastic in (False, True):
                stored = q.quantize_per_group(x, bits, GROUP_SIZE, stochastic, 7)
                out += [*stored, q.dequantize_per_group(*stored, bits, GROUP_SIZE, x.dtype, x.shape)]
        stored = q.quantize_fp8_per_group(x, GROUP_SIZE)
        packed = pack_bits(mask)
        return [*out, *stored, q.dequantize_fp8_per_group(*stored, GROUP_SIZE, x.dtype, x.shape), packed,
                unpack_bits(packed, mask.shape)]  # fmt: skip

    with num_threads(1):
        one = run()
    with num_threads(4):
        several = run()
    assert_bitwise_equal(tuple(one), tuple(several))
    assert torch.equal(several[-1], mask)
