"""Stored tensors keep their layout: a permuted dense tensor is encoded in memory order and permuted back."""

from __future__ import annotations

import pytest
import torch

import fastckpt
from fastckpt import Policy
from fastckpt.storage.codecs import dense_permutation
from fastckpt.storage.packer import SegmentStorage


@pytest.mark.parametrize(
    "make, order",
    [
        (lambda: torch.randn(64, 128).t(), (1, 0)),
        (lambda: torch.randn(2, 64, 4, 32).permute(0, 2, 1, 3), (0, 2, 1, 3)),  # attention's head view
        (lambda: torch.randn(64, 128), None),  # contiguous already
        (lambda: torch.randn(64, 256)[:, :128], None),  # not dense: encoded from a row-major copy
        (lambda: (torch.rand(64, 128) > 0.5).t(), (1, 0)),  # a 1-bit mask
    ],
)
@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
def test_decoded_tensor_has_the_saved_strides(make, order, codec):
    t = make()
    assert dense_permutation(t) == order
    storage = SegmentStorage(Policy.parse(codec))
    back = storage.unpack(storage.pack(t))
    assert back.shape == t.shape and back.dtype == t.dtype
    if order is not None:
        assert back.stride() == t.stride()
    if t.dtype == torch.bool:
        assert torch.equal(back, t)
    else:
        assert ((back - t).norm() / t.norm()).item() < {"int8": 0.01, "int4": 0.15, "fp8": 0.05}[codec]


def test_gradients_through_transposed_saved_tensors():
    torch.manual_seed(0)
    w = (torch.randn(256, 256) / 16).requires_grad_(True)
    x = torch.randn(128, 256, requires_grad=True)

    def fn(x):
        y = torch.tanh(x @ w).t()  # tanh's output is saved; the transpose's consumer sees a permuted tensor
        return (y.contiguous() @ torch.tanh(x) / 128).sin()

    def grads(run):
        w.grad = x.grad = None
        run().pow(2).sum().backward()
        return torch.cat([w.grad.flatten(), x.grad.flatten()])

    plain = grads(lambda: fn(x))
    for policy in ("int8", "recompute:int8"):
        ours = grads(lambda p=policy: fastckpt.checkpoint(fn, x, policy=p))
        assert 0 < ((ours - plain).norm() / plain.norm()).item() <= 1e-2, policy
