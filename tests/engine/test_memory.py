"""What checkpoint keeps alive after forward: only the segment inputs (counted through saved-tensor hooks)."""

import pytest
import torch

import fastckpt
from tests.models import TransformerBlock


def saved_bytes(forward, x, params):
    """Bytes of the distinct tensors handed to saved-tensor hooks during `forward(x)`, parameters excluded."""
    param_ptrs = {p.data_ptr() for p in params}
    seen = {}

    def pack(t):
        if t.data_ptr() not in param_ptrs:
            seen[t.data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(x)
    return sum(seen.values()), out


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_only_segment_inputs_are_kept(use_reentrant):
    torch.manual_seed(0)
    block = TransformerBlock(dim=64)
    x = torch.randn(8, 32, 64, requires_grad=True)
    plain_bytes, _ = saved_bytes(block, x, block.parameters())
    ours, out = saved_bytes(lambda x: fastckpt.checkpoint(block, x, use_reentrant=use_reentrant), x, block.parameters())
    assert ours == x.numel() * x.element_size()
    assert plain_bytes > 10 * ours  # the block's own activations, which checkpoint avoids
    out.sum().backward()


@pytest.mark.parametrize("policy", ["recompute", "int8"])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_autocast_casts_of_the_weights_are_not_kept_past_a_segment(use_reentrant, policy):
    """Under autocast, fp32 weights' low-precision copies are cached until the outermost autocast region ends;
    a segment's forward runs with the cache off, so its copies are freed with its products (the values, and the
    gradients, are torch checkpoint's)."""
    from torch.utils import checkpoint as torch_checkpoint

    from fastckpt.memory import peak_bytes

    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 512) for _ in range(4)]
    x = torch.randn(4, 512, requires_grad=True)
    outputs = {}

    def forward(name, checkpoint, **options):
        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = x
                for layer in layers:  # with the cache, every layer's bf16 weight stays until the region ends
                    h = checkpoint(layer, h, use_reentrant=use_reentrant, **options)
            outputs[name] = h

        return run

    peaks = {
        "ours": peak_bytes(forward("ours", fastckpt.checkpoint, policy=policy)),
        "torch": peak_bytes(forward("torch", torch_checkpoint.checkpoint)),
    }
    grads = {}
    for name, h in outputs.items():
        h.float().sum().backward()
        grads[name] = [x.grad, *[layer.weight.grad for layer in layers]]
        for p in (x, *[p for layer in layers for p in layer.parameters()]):
            p.grad = None
    for got, want in zip(grads["ours"], grads["torch"], strict=True):
        if policy == "recompute":
            assert torch.equal(got, want)
        else:  # the stored inputs quantized
            assert (got - want).norm() <= 2e-2 * want.norm()
    one_copy = 512 * 512 * 2
    assert peaks["ours"] + 2.5 * one_copy <= peaks["torch"]  # torch's holds 4 copies at the end, ours 1 at most
