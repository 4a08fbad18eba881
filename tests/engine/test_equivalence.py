"""The central drop-in check: outputs and every gradient bit-identical to plain autograd and to
torch.utils.checkpoint with the same use_reentrant, for a set of models."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import fastckpt
from tests.helpers import assert_all_equal, run_step
from tests.models import MLP, KwargsModel, SmallCNN, TransformerBlock, make_input, seeded

MODES = [False, True]


def assert_matches_plain_and_stock(model, x, ours, stock, plain=None):
    """`ours` and `stock` (torch.utils.checkpoint) each give exactly what plain autograd gives."""
    plain = run_step(model, x, plain or model)
    assert_all_equal(run_step(model, x, ours), plain)
    assert_all_equal(run_step(model, x, stock), plain)


@pytest.mark.parametrize("use_reentrant", MODES)
@pytest.mark.parametrize("model_cls", [MLP, SmallCNN, TransformerBlock])
def test_models_bit_identical(model_cls, use_reentrant):
    torch.manual_seed(0)
    model = model_cls().train()
    assert_matches_plain_and_stock(
        model,
        make_input(model),
        lambda x: fastckpt.checkpoint(model, x, use_reentrant=use_reentrant),
        lambda x: torch_checkpoint.checkpoint(model, x, use_reentrant=use_reentrant),
    )


@pytest.mark.parametrize("use_reentrant", MODES)
def test_transformer_under_cpu_autocast(use_reentrant):
    model, x = seeded(TransformerBlock)

    def under_autocast(forward):
        def wrapped(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return forward(x)

        return wrapped

    plain = run_step(model, x, under_autocast(model))
    ours = run_step(model, x, under_autocast(lambda x: fastckpt.checkpoint(model, x, use_reentrant=use_reentrant)))
    stock = run_step(
        model, x, under_autocast(lambda x: torch_checkpoint.checkpoint(model, x, use_reentrant=use_reentrant))
    )
    assert not torch.equal(ours[1], run_step(model, x, model)[1]), "autocast had no effect: test is vacuous"
    assert_all_equal(ours, plain)
    assert_all_equal(ours, stock)


def test_kwargs_nested_inputs_and_non_tensor_outputs():
    torch.manual_seed(0)
    model = KwargsModel()
    x, shift, bias = torch.randn(4, 16), torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)

    def step(checkpoint_fn):
        model.zero_grad(set_to_none=True)
        shift.grad = bias.grad = None
        xr = x.detach().requires_grad_(True)
        out = checkpoint_fn(xr, {"shift": [shift], "label": "tag"}, scale=0.5, bias=bias)
        assert out["label"] == "tag" and out["count"] == 4
        (out["y"].sum() + out["norm"]).backward()
        return [out["y"].detach(), xr.grad, shift.grad, bias.grad] + [p.grad for p in model.parameters()]

    plain = step(model)
    ours = step(lambda *a, **k: fastckpt.checkpoint(model, *a, **k))
    stock = step(lambda *a, **k: torch_checkpoint.checkpoint(model, *a, use_reentrant=False, **k))
    assert_all_equal(ours, plain)
    assert_all_equal(ours, stock)


@pytest.mark.parametrize("use_reentrant", MODES)
def test_nested_checkpoints(use_reentrant):
    torch.manual_seed(0)
    outer, inner = MLP(), nn_sequential_dropout()

    def nested(checkpoint_fn):
        def forward(x):
            def body(x):
                return outer(checkpoint_fn(inner, x, use_reentrant=use_reentrant))

            return checkpoint_fn(body, x, use_reentrant=use_reentrant)

        return forward

    assert_matches_plain_and_stock(
        torch.nn.ModuleList([outer, inner]),
        torch.randn(4, 16),
        nested(fastckpt.checkpoint),
        nested(torch_checkpoint.checkpoint),
        plain=lambda x: outer(inner(x)),
    )


def nn_sequential_dropout():
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.SiLU())


@pytest.mark.parametrize("use_reentrant", MODES)
def test_checkpoint_sequential_matches_torch(use_reentrant):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[nn_sequential_dropout() for _ in range(5)])
    assert_matches_plain_and_stock(
        model,
        torch.randn(4, 16),
        lambda x: fastckpt.checkpoint_sequential(model, 3, x, use_reentrant=use_reentrant),
        lambda x: torch_checkpoint.checkpoint_sequential(model, 3, x, use_reentrant=use_reentrant),
    )


@pytest.mark.parametrize("use_reentrant", MODES)
def test_save_policy_is_lossless_and_never_recomputes(use_reentrant):
    model, x = seeded(TransformerBlock)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    plain = run_step(model, x, model)
    calls.clear()
    ours = run_step(model, x, lambda x: fastckpt.checkpoint(model, x, use_reentrant=use_reentrant, policy="save"))
    assert_all_equal(ours, plain)
    assert len(calls) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("use_reentrant", MODES)
def test_cuda_dropout_and_autocast_bit_identical(use_reentrant):
    torch.manual_seed(0)
    model = TransformerBlock().cuda().train()
    x = make_input(model).cuda()

    def forward(fn):
        def wrapped(x):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return fn(x)

        return wrapped

    def step(fn):
        model.zero_grad(set_to_none=True)
        xr = x.detach().requires_grad_(True)
        torch.cuda.manual_seed(7)
        torch.manual_seed(7)
        out = forward(fn)(xr)
        out.float().sum().backward()
        return [out.detach(), xr.grad, torch.rand(3, device="cuda")] + [p.grad for p in model.parameters()]

    plain = step(model)
    assert_all_equal(step(lambda x: fastckpt.checkpoint(model, x, use_reentrant=use_reentrant)), plain)
    assert_all_equal(step(lambda x: torch_checkpoint.checkpoint(model, x, use_reentrant=use_reentrant)), plain)
