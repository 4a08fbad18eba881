"""Under autocast a saved low-precision copy of a parameter is kept as the parameter and cast again in backward."""

import pytest
import torch
from torch import nn

import fastckpt
from tests.helpers import every_size

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def _linear(trainable: bool) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(64, 48)
    layer.requires_grad_(trainable)
    return layer


def checkpointed(layer: nn.Module, x: torch.Tensor, policy: str, use_reentrant: bool) -> torch.Tensor:
    return fastckpt.checkpoint(layer, x, policy=every_size(policy), use_reentrant=use_reentrant)


def _grads(layer: nn.Module, x: torch.Tensor, policy: str | None, use_reentrant: bool = False) -> tuple:
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    with fastckpt.track() as report:
        with torch.autocast(**BF16):
            y = layer(x) if policy is None else checkpointed(layer, x, policy, use_reentrant)
        y.float().pow(2).sum().backward()
    grads = [x.grad] + [p.grad for p in layer.parameters() if p.requires_grad]
    return grads, report


@pytest.mark.parametrize("policy", ["int8", "int4", "fp8", "int4+offload", "recompute:int8", "recompute:int4"])
def test_frozen_weight_cast_is_exact(policy):
    # A frozen weight: autograd saves only its bf16 copy (for the input's gradient); kept by reference, the
    # gradient is exactly plain autocast's, whatever the codec.
    layer, x = _linear(trainable=False), torch.randn(32, 64)
    plain, _ = _grads(layer, x, None)
    got, report = _grads(layer, x, policy)
    assert torch.equal(got[0], plain[0])
    assert any("parameter-cast" in s.codecs for s in report.segments)
    assert sum(s.stored_bytes for s in report.segments) == 0  # nothing of its own: the parameter holds it


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_trainable_weight_cast_kept_by_reference(use_reentrant):
    # A trained weight: the input goes through the codec, the weight's copy is exact and costs no bytes.
    layer, x = _linear(trainable=True), torch.randn(64, 64)
    plain, _ = _grads(layer, x, None)
    got, report = _grads(layer, x, "recompute:int8", use_reentrant=use_reentrant)
    (segment,) = [s for s in report.segments if "parameter-cast" in s.codecs]
    assert "int8" in segment.codecs
    weight_cast = layer.weight.numel() * 2
    assert segment.raw_bytes == weight_cast + x.numel() * 2  # the bf16 input and the bf16 weight, as autograd
    assert segment.stored_bytes < x.numel() * 2  # only the int8 input (its payload, scales and offsets)
    torch.testing.assert_close(got[0], plain[0], rtol=0, atol=0)  # grad_x reads only the (exact) weight
    assert not torch.equal(got[1], plain[1])  # the weight's gradient reads the int8 input


def test_without_autocast_nothing_is_watched():
    # Without autocast the weight itself is saved: kept plain, as a parameter.
    layer, x = _linear(trainable=False), torch.randn(32, 64, requires_grad=True)
    with fastckpt.track() as report:
        fastckpt.checkpoint(layer, x, policy="int8").sum().backward()
    assert all("parameter-cast" not in s.codecs for s in report.segments)
    assert sum(s.kept_plain.get("parameter", 0) for s in report.segments) >= 1


def test_an_argument_of_the_parameters_shape_is_not_taken_for_its_cast():
    # x has the weight's shape: inside F.linear the bf16 copy of x could be the weight's, so neither is
    # taken for a cast; both go through the codec as any other tensor would.
    layer = nn.Linear(64, 64, bias=False)
    x = torch.randn(64, 64, requires_grad=True)
    with fastckpt.track() as report, torch.autocast(**BF16):
        y = fastckpt.checkpoint(layer, x, policy="int8")
    y.float().sum().backward()
    assert all("parameter-cast" not in s.codecs for s in report.segments)


def test_parameter_changed_in_place_before_backward_raises():
    layer, x = _linear(trainable=False), torch.randn(32, 64, requires_grad=True)
    with torch.autocast(**BF16):
        y = fastckpt.checkpoint(layer, x, policy="int8")
    with torch.no_grad():
        layer.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*by reference to the parameter"):
        y.float().sum().backward()


def test_views_of_the_cast_come_back_with_their_layout():
    # conv2d under autocast saves the bf16 weight itself; linear saves its transpose: both restored exactly.
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    block.requires_grad_(False)
    x = torch.randn(4, 3, 8, 8)
    plain, _ = _grads(block, x, None)
    got, report = _grads(block, x, "int8")
    assert torch.equal(got[0], plain[0])
    assert any("parameter-cast" in s.codecs for s in report.segments)


@pytest.mark.parametrize("policy", ["int8", "recompute:int8"])
def test_under_torch_distributed_copies_are_stored_as_any_tensor(policy, monkeypatch):
    # FSDP / ZeRO-3 free a parameter after the forward and gather it again in place: not kept by reference.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    layer, x = _linear(trainable=False), torch.randn(32, 64)
    _, report = _grads(layer, x, policy)
    assert all("parameter-cast" not in s.codecs for s in report.segments)
    assert any("int8" in s.codecs for s in report.segments)
