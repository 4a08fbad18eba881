"""pack_bits / unpack_bits: exact against the pure-PyTorch reference, on every device available."""

import pytest
import torch

from fastckpt.ops import pack_bits, unpack_bits
from fastckpt.ops.reference import pack_bits_ref, unpack_bits_ref

SHAPES = [(0,), (1,), (7,), (8,), (9,), (3, 5, 7), (1000, 33), (4096,)]
DTYPES = [torch.bool, torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def random_mask(shape, dtype, device):
    values = torch.randn(shape, device=device).relu()  # about half exact zeros, as after ReLU
    return values != 0 if dtype == torch.bool else values.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_pack_matches_reference_and_round_trips(shape, dtype, device):
    mask = random_mask(shape, dtype, device)
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.shape == ((mask.numel() + 7) // 8,)
    assert torch.equal(packed, pack_bits_ref(mask))
    unpacked = unpack_bits(packed, mask.shape)
    assert unpacked.dtype == torch.bool and unpacked.shape == mask.shape
    assert torch.equal(unpacked, mask != 0)
    assert torch.equal(unpacked, unpack_bits_ref(packed, list(mask.shape)))


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_and_offset_inputs(device):
    base = random_mask((64, 50), torch.float32, device)
    for view in (base.t(), base[:, 3:41], base[5:]):
        assert torch.equal(pack_bits(view), pack_bits_ref(view))
        assert torch.equal(unpack_bits(pack_bits(view), view.shape), view != 0)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_negative_zero_follow_nonzero_pattern(device):
    x = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -1.0, 1e-30, 0.0, 2.0, 5.0], device=device)
    assert unpack_bits(pack_bits(x), x.shape).tolist() == [True, False, False, True, True, True, False, True, True]


@pytest.mark.cuda
def test_cuda_matches_cpu_kernel():
    mask = random_mask((12345,), torch.bfloat16, "cuda")
    assert torch.equal(pack_bits(mask).cpu(), pack_bits(mask.cpu()))


def test_bad_inputs_name_the_problem():
    with pytest.raises(RuntimeError, match="dtype Long"):
        pack_bits(torch.ones(4, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="expected uint8"):
        unpack_bits(torch.ones(4), [4])
    with pytest.raises(RuntimeError, match="needs 2"):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), [9])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    mask = random_mask((5, 13), torch.float32, device)
    torch.library.opcheck(torch.ops.fastckpt.pack_bits.default, (mask,))
    torch.library.opcheck(torch.ops.fastckpt.unpack_bits.default, (pack_bits(mask), [5, 13]))
