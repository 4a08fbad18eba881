"""The storage engine's packer: what is stored, what is kept plain, dedup, accounting, exactness."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import fastckpt
from fastckpt import Policy
from fastckpt.storage.packer import keep_plain_reason
from tests.helpers import assert_all_equal, run_step
from tests.models import TransformerBlock, seeded

LOSSLESS = ["save", "offload", "recompute+offload"]


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("policy", LOSSLESS)
def test_lossless_policies_bit_identical(policy, use_reentrant):
    model, x = seeded(TransformerBlock)
    plain = run_step(model, x, model)
    ours = run_step(model, x, lambda x: fastckpt.checkpoint(model, x, use_reentrant=use_reentrant, policy=policy))
    assert_all_equal(ours, plain)


def test_track_counts_each_stored_tensor_once_and_never_parameters():
    torch.manual_seed(0)
    layer1, layer2 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def fn(x):
        h = layer1(x)
        return layer2(h.sin() * h.cos())  # h is saved by sin and by cos: stored once

    x = torch.randn(32, 64, requires_grad=True) * 1  # a non-leaf activation, as between layers
    with fastckpt.track() as report:
        out = fastckpt.checkpoint(fn, x, policy="save")
        out.sum().backward()
    (segment,) = report.segments
    act = 32 * 256 * 4
    # stored: x (saved by layer1), h (once), sin(h), cos(h), and their product (saved by layer2)
    assert segment.raw_bytes == 32 * 64 * 4 + 4 * act
    assert segment.device_bytes == segment.raw_bytes and segment.host_bytes == 0
    assert segment.policy == "save" and segment.tensors >= 7
    assert "save" in report.table()


@pytest.mark.parametrize("policy", ["recompute+int8", "int8"])
def test_a_tensor_every_segment_takes_is_stored_once(policy):
    # An attention mask or position embeddings, passed to every layer: one stored copy for all segments.
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(3)]
    shared = torch.randn(32, 64)  # no grad: a per-step constant every segment takes as an input
    x = torch.randn(32, 64, requires_grad=True)

    def run(copies: bool) -> tuple:
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        with fastckpt.track() as report:
            h = x
            for layer in layers:
                s = shared.clone() if copies else shared
                h = fastckpt.checkpoint(lambda h, s, layer=layer: layer(h) * s, h, s, policy=policy)
            h.sum().backward()
        return report, [p.grad.clone() for layer in layers for p in layer.parameters()]

    shared_report, grads = run(copies=False)
    copies_report, copies_grads = run(copies=True)
    # the first segment stores `shared`; the other two find its stored form
    assert copies_report.raw_bytes - shared_report.raw_bytes == 2 * shared.numel() * shared.element_size()
    assert copies_report.device_bytes > shared_report.device_bytes
    assert_all_equal(grads, copies_grads)  # the same stored form, decoded for each


def test_track_around_backward_only_still_reports_the_segment():
    x = torch.randn(64, 64, requires_grad=True) * 1
    out = fastckpt.checkpoint(lambda x: x.exp().sin(), x, policy="save")
    with fastckpt.track() as report:
        out.sum().backward()
    assert len(report.segments) == 1 and report.raw_bytes == 64 * 64 * 4  # exp's output, also sin's input


def test_recompute_offload_stores_only_the_inputs():
    x = torch.randn(64, 64, requires_grad=True) * 1
    with fastckpt.track() as report:
        fastckpt.checkpoint(lambda x: x.exp().sin().exp(), x, policy="recompute+offload").sum().backward()
    assert report.raw_bytes == x.numel() * 4


@pytest.mark.parametrize(
    "tensor, reason",
    [
        (torch.nn.Parameter(torch.randn(64, 64)), "parameter"),
        (torch.nn.Parameter(torch.randn(64, 64)).t(), "parameter"),
        (torch.randn(3), "small"),
        (torch.randint(0, 5, (4096,)), "int64"),
        (torch.randn(4096) > 0, "bool"),
        (torch.randn(64, 64).to_sparse(), "not a dense tensor"),
        (torch.randn(64, 64, dtype=torch.complex64), "complex64"),
    ],
)
def test_kept_plain(tensor, reason):
    assert keep_plain_reason(tensor, Policy.parse("save")) == reason


def test_stored_when_large_activation():
    assert keep_plain_reason(torch.randn(64, 64) * 1, Policy.parse("int8")) is None
    assert keep_plain_reason(torch.randn(64, 64) * 1, Policy(min_tensor_bytes=1 << 20)) == "small"


def test_per_tensor_rule_overrides_policy():
    x = torch.randn(64, 64, requires_grad=True) * 1
    big_only = Policy(recompute=False, rule=lambda t: Policy(recompute=False, min_tensor_bytes=1 << 30))
    with fastckpt.track() as report:
        fastckpt.checkpoint(lambda x: x.exp().sin(), x, policy=big_only).sum().backward()
    assert report.raw_bytes == 0  # the rule made every tensor "small": all kept plain


@pytest.mark.parametrize("policy", [Policy.parse("save"), Policy(recompute=False, min_tensor_bytes=0)])
def test_no_reference_cycles_with_storage_policy(policy):  # kept-plain and stored tensors alike
    gc.collect()
    gc.disable()
    try:
        layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU())
        out = fastckpt.checkpoint(layer, torch.randn(2, 8, requires_grad=True) * 2, policy=policy)
        out_ref, layer_ref = weakref.ref(out), weakref.ref(layer)
        del out, layer
        assert out_ref() is None and layer_ref() is None
    finally:
        gc.enable()


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["offload", "recompute+offload"])
def test_cuda_offload_moves_bytes_to_host_and_is_exact(policy):
    torch.manual_seed(0)
    model = TransformerBlock(dim=64).cuda().train()
    x = torch.randn(4, 128, 64, device="cuda")
    plain = run_step(model, x, model)
    with fastckpt.track() as report:
        ours = run_step(model, x, lambda x: fastckpt.checkpoint(model, x, policy=policy))
    assert_all_equal(ours, plain)
    assert report.host_bytes > 0 and report.device_bytes == 0


def test_each_stored_tensor_is_released_once_its_node_has_run():
    """As plain autograd: storage must not keep a segment's tensors until its whole backward is done."""
    from fastckpt.storage import packer

    def alive_stored():
        return sum(type(o) is packer._Stored for o in gc.get_objects())

    seen = []

    def fn(x):
        e = (x * 2).exp()  # e: saved by exp (its result) and by tanh (its input), stored once
        e.register_hook(lambda grad: seen.append(alive_stored()))  # runs after TanhBackward, before ExpBackward
        return e.tanh()  # saves its result t

    x = torch.randn(64, 64, requires_grad=True)
    out = fastckpt.checkpoint(fn, x, policy="save")
    assert alive_stored() == 2
    out.sum().backward()
    assert seen == [1]  # t was released with TanhBackward; e is still needed by ExpBackward


INPLACE_ERROR = "one of the variables needed for gradient computation has been modified by an inplace operation"


def _modify_output(policy):
    h = torch.randn(4, 8, requires_grad=True)  # 128 bytes: below the codecs' minimum size, kept plain
    y = fastckpt.checkpoint(torch.tanh, h, policy=policy) if policy else torch.tanh(h)
    y.mul_(0.5)
    y.sum().backward()


def _modify_input(policy):
    h = torch.randn(4, 8, requires_grad=True) * 1.0
    y = fastckpt.checkpoint(torch.sin, h, policy=policy) if policy else torch.sin(h)
    h.add_(1.0)
    y.sum().backward()


def _modify_parameter(policy):
    linear = torch.nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    y = fastckpt.checkpoint(lambda t: linear(t).tanh(), x, policy=policy) if policy else linear(x).tanh()
    with torch.no_grad():
        linear.weight.mul_(2.0)
    y.sum().backward()


@pytest.mark.parametrize(
    "modify, policy",
    [
        (_modify_output, "save"),  # stored plainly: the same tensor
        (_modify_output, "int8"),  # small: kept plain under a codec
        (_modify_input, "save"),
        (_modify_input, "recompute+offload"),  # on CPU the input stays where it is
        (_modify_input, "recompute+int8"),  # small input kept plain
        (_modify_input, "recompute"),  # stock: autograd's own SavedVariable
        (_modify_parameter, "int8"),  # parameters are never copied
        (_modify_parameter, "save"),
    ],
)
def test_inplace_modification_after_forward_raises_like_autograd(modify, policy):
    with pytest.raises(RuntimeError, match=INPLACE_ERROR):
        modify(None)  # plain autograd: the reference behaviour
    with pytest.raises(RuntimeError, match=INPLACE_ERROR):
        modify(policy)


def test_a_tensor_stored_through_a_codec_is_a_copy_and_may_change():
    """Encoded at pack, so a later in-place change cannot reach backward: no error, gradient from the forward values."""
    h = torch.randn(64, 64, requires_grad=True)
    y = fastckpt.checkpoint(torch.tanh, h, policy="int8")
    expected = 1 - y.detach().clone() ** 2
    y.mul_(1.0)  # a version bump with the same values, to check only that no error is raised
    y.sum().backward()
    assert torch.allclose(h.grad, expected, atol=0.05)


def test_float64_under_a_codec_is_kept_exact_and_reported():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()).double()
    x = torch.randn(32, 64, dtype=torch.float64, requires_grad=True)
    with fastckpt.track() as report:
        out = fastckpt.checkpoint(model, x, policy="int8")
    expected_grad = torch.autograd.grad(model(x).sum(), x)[0]
    out.sum().backward()
    (segment,) = report.segments
    assert set(segment.kept_plain) == {"float64"}  # the dtype is the first reason, parameters included
    assert segment.kept_plain["float64"] >= 3  # input, weight, tanh output at least
    assert segment.raw_bytes == 0 and not segment.codecs  # nothing went through the codec
    assert "float64:" in report.table()
    assert torch.equal(x.grad, expected_grad)  # exact
