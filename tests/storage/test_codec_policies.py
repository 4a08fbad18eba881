"""Compressed policies end to end: stored bits per element, gradient error, exact masks, NaN handling."""

from __future__ import annotations

import pytest
import torch

import fastckpt
from fastckpt import Policy
from tests.helpers import rel_l2

# The targets (BENCHMARKS.md): stored bits per saved float element, scale/offset included.
BPE_TARGET = {"int8": 8.5, "fp8": 8.5, "int4": 4.5, "int2": 2.5}


def mlp_step(policy, seed=0):
    """Gradients of a small tanh MLP whose three activations go through `policy`, and its track() report."""
    torch.manual_seed(seed)
    w1, w2 = torch.randn(256, 512) / 16, torch.randn(512, 64) / 22
    w1.requires_grad_(True)
    w2.requires_grad_(True)
    x = torch.randn(128, 256) * 1

    def fn(x):
        return torch.tanh(x @ w1) @ w2

    with fastckpt.track() as report:
        fastckpt.checkpoint(fn, x, policy=policy).pow(2).sum().backward()
    return [w1.grad, w2.grad], report


@pytest.mark.parametrize("codec", sorted(BPE_TARGET))
def test_stored_bits_per_element_meet_targets(codec):
    _, report = mlp_step(codec)
    (segment,) = report.segments
    assert segment.raw_elements == segment.raw_bytes // 4  # all fp32
    bpe = segment.bits_per_element
    assert bpe == report.bits_per_element and bpe <= BPE_TARGET[codec], f"{codec}: {bpe:.2f} bits per element"
    assert segment.codecs == {codec}


def quantizer_rel_error(codec: str, stochastic: bool = False) -> float:
    """Expected relative RMS error of storing Gaussian data with `codec` (the MLP's input is Gaussian).

    Integer codecs: a group of 64 normals spans about 4.9 sigma, cut into 2^b - 1 steps; rounding to
    nearest leaves step/sqrt(12) RMS, stochastic rounding about step/sqrt(6). fp8 e4m3: 3 mantissa
    bits, relative RMS about 2^-4/sqrt(3).
    """
    if codec == "fp8":
        return 2**-4 / 3**0.5
    step = 4.9 / (2 ** {"int8": 8, "int4": 4, "int2": 2}[codec] - 1)
    return step / (6**0.5 if stochastic else 12**0.5)


@pytest.mark.parametrize(
    "codec, stochastic", [(c, False) for c in ("int8", "fp8", "int4", "int2")] + [(c, True) for c in ("int8", "int4")]
)
def test_gradient_error_is_what_the_quantizer_allows(codec, stochastic):
    exact, _ = mlp_step("save")
    approx, _ = mlp_step(Policy(recompute=False, codec=codec, stochastic_rounding=stochastic))
    errors = [rel_l2(a, b) for a, b in zip(approx, exact, strict=True)]
    assert 0 < max(errors) <= 1.5 * quantizer_rel_error(codec, stochastic), errors


def test_custom_group_size_is_honoured():
    _, default = mlp_step("int4")
    _, coarse = mlp_step(Policy(recompute=False, codec="int4", group_size=256))
    assert coarse.segments[0].stored_bytes < default.segments[0].stored_bytes


def test_bool_masks_are_stored_as_one_bit_exactly():
    x = torch.randn(64, 1024, requires_grad=True)
    mask = torch.rand(64, 1024) > 0.5

    def fn(x):
        return torch.where(mask, x, torch.zeros(())).sum()  # where saves only its bool condition

    with fastckpt.track() as report:
        fastckpt.checkpoint(fn, x * 1, policy=Policy(recompute=False, codec="int8", min_tensor_bytes=0)).backward()
    (segment,) = report.segments
    assert "mask" in segment.codecs
    ours, x.grad = x.grad, None
    fn(x * 1).backward()
    assert torch.equal(ours, x.grad)
    assert segment.stored_bytes == mask.numel() // 8


def test_recompute_with_codec_compresses_only_the_inputs():
    x = torch.randn(128, 256, requires_grad=True)
    with fastckpt.track() as report:
        out = fastckpt.checkpoint(lambda h: h.exp().sin().sum(), x * 1, policy="recompute+int8")
        out.backward()
    (segment,) = report.segments
    assert segment.raw_bytes == x.numel() * 4 and segment.stored_bytes < segment.raw_bytes / 3


def test_nan_in_an_activation_is_not_turned_into_finite_garbage():
    x = torch.randn(64, 256)
    x[3, 7] = float("nan")
    w = torch.randn(256, 256, requires_grad=True)
    fastckpt.checkpoint(lambda x: torch.tanh(x @ w).sum(), x * 1, policy="int4").backward()
    assert torch.isnan(w.grad[7]).all()  # the row fed by the NaN input is NaN, as in plain autograd


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["int8", "int4", "int4+offload", "recompute+int8", "fp8"])
def test_cuda_codec_policies(policy):
    torch.manual_seed(0)
    w = torch.randn(512, 512, device="cuda", requires_grad=True)
    x = torch.randn(256, 512, device="cuda")

    def grad(pol):
        w.grad = None
        fastckpt.checkpoint(lambda x: torch.tanh(x @ w).pow(2).sum(), x * 1, policy=pol).backward()
        return w.grad

    exact = grad("save")
    with fastckpt.track() as report:
        approx = grad(policy)
    assert rel_l2(approx, exact) <= 5e-2
    assert (report.host_bytes > 0) == ("offload" in policy)
