"""fastckpt.checkpoint inside a torch.compile'd function gives the eager gradients."""

import pytest
import torch

import fastckpt


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute", "int8"])
def test_checkpoint_under_torch_compile(policy):
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 32)

    def loss(x):
        return fastckpt.checkpoint(lambda h: torch.tanh(layer(h)), x * 2, policy=policy).sum()

    x = torch.randn(8, 32, requires_grad=True)
    torch.compile(loss)(x).backward()
    compiled = x.grad
    x.grad = None
    loss(x).backward()
    assert torch.equal(compiled, x.grad)
