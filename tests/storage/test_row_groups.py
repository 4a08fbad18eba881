"""Codec groups never span rows shorter than a group: a token of tiny scale next to ordinary ones keeps its
own parameters, so a norm's backward (which multiplies its error by 1/std) stays accurate."""

from __future__ import annotations

import pytest
import torch

import fastckpt
from fastckpt.storage import codecs


def _rows_of_mixed_scale(width: int) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(16, width)
    x[0] = 0.0  # a CLS token at init
    x[3] = 1e-4 * torch.randn(width) + 2e-3  # near-constant: a LayerNorm's 1/std is ~1e4 there
    return x


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "fp8"])
def test_rows_shorter_than_a_group_get_groups_of_their_own(codec):
    x = _rows_of_mixed_scale(32)
    encoded = codecs.encode(x, codec, None, False)
    assert encoded.group_size == 32
    y = codecs.decode(encoded)
    assert torch.equal(y[0], x[0]) if codec != "fp8" else (y[0] == 0).all()
    # the small row errs relative to its own spread, not to its neighbours'
    small = (y[3] - x[3]).abs().max() / (x[3].max() - x[3].min())
    assert small < {"int8": 1e-2, "int4": 0.1, "int2": 0.6, "fp8": 0.3}[codec]


def test_long_rows_and_narrow_heads_keep_the_default_group():
    assert codecs.encode(torch.randn(4, 512), "int8", None, False).group_size == 128
    assert codecs.encode(torch.randn(4, 2, 8), "int8", None, False).group_size == 8  # 8-wide heads: rows
    assert codecs.encode(torch.randn(4, 2, 4), "int8", None, False).group_size == 128  # narrower: the default
    assert codecs.encode(torch.randn(4, 32), "int8", 64, False).group_size == 64  # an explicit size is kept


def test_a_layer_norm_over_tokens_of_very_different_scale_keeps_its_gradient():
    norm = torch.nn.LayerNorm(32, eps=1e-12)
    x = _rows_of_mixed_scale(32).requires_grad_()
    weight = torch.randn(16, 32)

    def step(policy):
        x.grad = None
        out = fastckpt.checkpoint(lambda t: norm(t * 1.0), x, policy=policy) if policy else norm(x * 1.0)
        (out * weight).sum().backward()
        return x.grad.clone()

    reference = step(None)
    error = (step("int8") - reference).norm() / reference.norm()
    assert error < 1e-2
